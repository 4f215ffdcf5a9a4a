"""libvirtd: use the running one, or start our own and stop it afterwards.

Without systemd, Debian 12's monolithic libvirtd runs when (docs/host-facts.md):
the ``libvirt-qemu`` user and ``kvm`` group exist, ``/dev/kvm`` is group
``kvm`` mode 0660, and ``/etc/libvirt/qemu.conf`` sets ``stdio_handler =
"file"`` (no virtlogd). ``prepare_host`` makes those hold (root only); the
guest's QEMU runs as root (``user``/``group`` in qemu.conf) so that it can
reach the run directory's NBD socket and files.

Several scalebench processes may use one libvirtd at once (a results run and a
test, or two ``dbtrace`` runs). Each holds a shared lock on a users file while
it runs; starting and stopping happen under an exclusive gate lock; and the
last user out stops the daemon that scalebench started, whichever process
started it. A libvirtd that scalebench did not start is never stopped.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import pwd
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from .errors import DbTraceError

URI = "qemu:///system"
QEMU_CONF = Path("/etc/libvirt/qemu.conf")
RUN_DIR = Path("/run/libvirt")
# How long a stopped libvirtd may take to exit before it is killed.
STOP_TIMEOUT_S = 15.0
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
    """Context manager yielding a libvirt connection; starts libvirtd when none answers, and the
    last scalebench user out stops it (see the module doc string)."""

    uri: str = URI
    start_timeout_s: float = 30.0
    conn: object = None
    started: subprocess.Popen[bytes] | None = None
    log_path: Path = field(default_factory=lambda: Path("/tmp/scalebench-libvirtd.log"))
    run_dir: Path = RUN_DIR
    _user_lock: int | None = None

    @property
    def pid_file(self) -> Path:
        """Where the libvirtd that scalebench starts writes its pid."""
        return self.run_dir / "scalebench-libvirtd.pid"

    def __enter__(self) -> Libvirt:
        libvirt = _import_libvirt()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with self._gate():
            try:
                self.conn = libvirt.open(self.uri)
            except libvirt.libvirtError:
                self._start_daemon()
                try:
                    self.conn = self._wait_for_daemon(libvirt)
                except BaseException:
                    self._stop_daemon()
                    raise
            self._user_lock = _locked(self.run_dir / "scalebench-libvirtd.users", fcntl.LOCK_SH)
        return self

    def _gate(self) -> contextlib.AbstractContextManager[None]:
        """Held while the daemon is started or stopped: two users never do both at once."""
        return _held(self.run_dir / "scalebench-libvirtd.gate")

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
            # Closing is best effort: whether the daemon stops depends on the other users only.
            with contextlib.suppress(Exception):
                self.conn.close()  # type: ignore[attr-defined]
            self.conn = None
        with self._gate():
            if self._user_lock is not None:
                os.close(self._user_lock)
                self._user_lock = None
            if self._last_user():
                self._stop_daemon()
            else:
                self.started = None  # another user still needs it; the last one stops it

    def _last_user(self) -> bool:
        """No other process holds the users lock (called under the gate, with ours released)."""
        try:
            fd = _locked(self.run_dir / "scalebench-libvirtd.users", fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        os.close(fd)
        return True

    def _log_tail(self) -> str:
        try:
            return " | ".join(self.log_path.read_text().strip().splitlines()[-3:])
        except OSError:
            return ""

    def _start_daemon(self) -> None:
        prepare_host()
        with self.log_path.open("wb") as log:
            self.started = subprocess.Popen(
                ["libvirtd", "--pid-file", str(self.pid_file)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _stop_daemon(self) -> None:
        """Stop the libvirtd that scalebench started, from this process or another (never one
        found running otherwise)."""
        if self.started is not None:
            child, self.started = self.started, None
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()
            return
        pid = _started_by_scalebench(self.pid_file)
        if pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _locked(path: Path, operation: int) -> int:
    """An fd of ``path`` holding an flock (released when the fd is closed, or the process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, operation)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _held(path: Path):  # type: ignore[no-untyped-def]
    fd = _locked(path, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def _started_by_scalebench(pid_file: Path) -> int | None:
    """The pid in ``pid_file`` when that process is a libvirtd told to write it, else None (a
    stale file, or a pid since reused by another process)."""
    try:
        pid = int(pid_file.read_text().strip())
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except (OSError, ValueError):
        return None
    return pid if str(pid_file).encode() in argv and b"--pid-file" in argv else None


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
