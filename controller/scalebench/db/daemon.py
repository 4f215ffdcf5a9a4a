"""libvirtd: use the running one, or start our own and stop it afterwards.

Without systemd, Debian 12's monolithic libvirtd runs when (docs/host-facts.md):
the ``libvirt-qemu`` user and ``kvm`` group exist, ``/dev/kvm`` is group
``kvm`` mode 0660, and ``/etc/libvirt/qemu.conf`` sets ``stdio_handler =
"file"`` (no virtlogd). ``prepare_host`` makes those hold (root only); the
guest's QEMU runs as root (``user``/``group`` in qemu.conf) so that it can
reach the run directory's NBD socket and files.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import re
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from .errors import DbTraceError

URI = "qemu:///system"
QEMU_CONF = Path("/etc/libvirt/qemu.conf")
SOCKET = Path("/run/libvirt/libvirt-sock")
PIDFILE = Path("/run/libvirt/scalebench-libvirtd.pid")
QEMU_CONF_SETTINGS = {"stdio_handler": '"file"', "user": '"root"', "group": '"root"'}


def _import_libvirt():  # type: ignore[no-untyped-def]
    try:
        import libvirt
    except ImportError as err:
        raise DbTraceError(
            "the libvirt Python bindings are missing (pip install libvirt-python)"
        ) from err
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    return libvirt


def prepare_host(qemu_conf: Path = QEMU_CONF) -> None:
    """Make the host meet libvirtd's needs without systemd (idempotent)."""
    if shutil.which("libvirtd") is None:
        raise DbTraceError(
            "libvirtd is not installed (apt-get install libvirt-daemon libvirt-daemon-driver-qemu)"
        )
    if os.geteuid() != 0:
        raise DbTraceError("starting libvirtd needs root; run as root or start libvirtd first")
    for group in ("kvm", "libvirt-qemu"):
        try:
            grp.getgrnam(group)
        except KeyError:
            subprocess.run(["groupadd", "--system", group], check=True)
    try:
        pwd.getpwnam("libvirt-qemu")
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                "--gid",
                "kvm",
                "libvirt-qemu",
            ],
            check=True,
        )
    kvm = Path("/dev/kvm")
    if kvm.exists():
        gid = grp.getgrnam("kvm").gr_gid
        if kvm.stat().st_gid != gid or kvm.stat().st_mode & 0o777 != 0o660:
            os.chown(kvm, 0, gid)
            kvm.chmod(0o660)
    qemu_conf.parent.mkdir(parents=True, exist_ok=True)
    text = qemu_conf.read_text() if qemu_conf.exists() else ""
    updated = text
    for key, value in QEMU_CONF_SETTINGS.items():
        line = f"{key} = {value}  # set by scalebench (libvirtd without systemd)"
        pattern = re.compile(rf"^\s*{key}\s*=.*$", re.MULTILINE)
        if pattern.search(updated):
            updated = pattern.sub(line, updated)
        else:
            updated += f"{line}\n"
    if updated != text:
        qemu_conf.write_text(updated)


@dataclass
class Libvirt:
    """Context manager yielding a libvirt connection; starts libvirtd when none answers."""

    uri: str = URI
    start_timeout_s: float = 30.0
    conn: object = None
    started: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path("/tmp/scalebench-libvirtd.log"))

    def __enter__(self) -> Libvirt:
        libvirt = _import_libvirt()
        try:
            self.conn = libvirt.open(self.uri)
            return self
        except libvirt.libvirtError:
            pass
        self._start_daemon()
        try:
            self.conn = self._wait_for_daemon(libvirt)
        except BaseException:
            self._stop_daemon()
            raise
        return self

    def _wait_for_daemon(self, libvirt):  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + self.start_timeout_s
        last = ""
        while time.monotonic() < deadline:
            if self.started is not None and self.started.poll() is not None:
                raise DbTraceError(
                    f"libvirtd exited at start-up (code {self.started.returncode}); "
                    f"see {self.log_path}: {self._log_tail()}"
                )
            try:
                return libvirt.open(self.uri)
            except libvirt.libvirtError as err:
                last = str(err)
                time.sleep(0.2)
        raise DbTraceError(f"libvirtd did not answer within {self.start_timeout_s:.0f} s: {last}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.conn is not None:
            # Closing is best effort: the daemon is stopped next whatever it says.
            with contextlib.suppress(Exception):
                self.conn.close()  # type: ignore[attr-defined]
            self.conn = None
        self._stop_daemon()

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-3:])
        except OSError:
            return ""

    def _start_daemon(self) -> None:
        prepare_host()
        Path("/run/libvirt").mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.started = subprocess.Popen(
                ["libvirtd", "--pid-file", str(PIDFILE)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _stop_daemon(self) -> None:
        """Stop the libvirtd we started (never one we found running)."""
        if self.started is None:
            return
        if self.started.poll() is None:
            self.started.terminate()
            try:
                self.started.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.started.kill()
                self.started.wait()
        self.started = None
