"""One database guest's life: overlay, tracer, domain, readiness, teardown.

The guest's disk is either our NBD server (copy-on-write over the base image,
traced, disk model applied; in its own process, see tracer.py) or, with tracing off and no disk
model, a qcow2
overlay QEMU opens itself. Any failure destroys the domain, stops the server
and removes the overlay; the base image is only ever opened read-only.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from ..procs import stop_signals_deferred
from .domain import DomainSpec, pick_domain_type
from .errors import DbTraceError
from .image import GuestImage, ensure_image
from .nbd import TraceRecord
from .tracer import TracedDisk

READY_MARK = "SCALEBENCH-DB-READY"
FAILED_MARK = "SCALEBENCH-DB-FAILED"
# What the guest's kernel prints on its console when it kills a process for memory.
OOM_MARK = "Killed process"


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# The study's engines kept their own buffer pool and did direct I/O, so their buffer misses
# reached the disk. PostgreSQL 15 reads through the kernel's page cache, which in a 256 MiB guest
# would hold several times its 24 MB of shared buffers: the page cache of the server's files is
# held to this much (sbinit.sh) so that it stops being a second buffer pool. With it the trace
# reads 1.01 of the sectors PostgreSQL reads (TPC-C standard, 4 clients: read share 0.531, as
# under the 64 MiB cap on all the server's memory that left it about this much cache); with 4 MiB
# it read 1.93: readahead and the server's own binaries evicted before use and read again.
DEFAULT_DB_CACHE_MIB = 12


@dataclass
class GuestConfig:
    """What one guest needs; ``trace=False`` with ``disk='none'`` bypasses our NBD server.

    ``image`` None: the cached image (``image.ensure_image``), resolved when the guest starts.
    """

    image: GuestImage | None
    run_dir: Path
    disk: str = "hdd15k"
    trace: bool = True
    memory_mib: int = 256
    # The page cache the database server's files may keep; None: no limit.
    db_cache_mib: int | None = DEFAULT_DB_CACHE_MIB
    boot_timeout_s: float = 240.0
    # Slow the disk model down by the guest's measured CPU slowdown (see diskmodel.Dilated).
    dilate: bool = False
    # With dilate: this factor instead of the measured slowdown, so that runs compared with each
    # other share one time base (a slowdown measured per run varies with the host's load).
    dilation: float | None = None
    domain_type: str = field(default_factory=pick_domain_type)

    def __post_init__(self) -> None:
        # QEMU is started by libvirtd, in its own working directory: every path it opens
        # (overlay, NBD socket, console log) must be absolute.
        self.run_dir = Path(self.run_dir).resolve()


@dataclass
class DbGuest:
    """Context manager: a running database guest reachable at 127.0.0.1:``port``."""

    config: GuestConfig
    conn: object  # a libvirt.virConnect
    name: str = field(default_factory=lambda: f"scalebench-db-{uuid.uuid4().hex[:8]}")
    port: int = 0
    server: TracedDisk | None = None
    domain: object = None
    boot_seconds: float = 0.0
    cpu_slowdown: float = 0.0
    dilation: float = 1.0

    @property
    def image(self) -> GuestImage:
        """The image the guest booted (set once it starts)."""
        if self.config.image is None:
            raise DbTraceError("the guest has not started: no image yet")
        return self.config.image

    @property
    def console_log(self) -> Path:
        return self.config.run_dir / f"{self.name}.console.log"

    def __enter__(self) -> DbGuest:
        try:
            self.start()
            self.wait_ready()
            self.quiesce()
            if self.config.dilate:
                self.apply_dilation()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _overlay(self) -> Path:
        return self.config.run_dir / f"{self.name}.overlay"

    def start(self) -> None:
        """Prepare the disk path and start the (transient) domain."""
        import libvirt

        cfg = self.config
        if cfg.image is None:
            cfg.image = ensure_image()
        image = cfg.image
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        nbd_socket = qcow2 = None
        if cfg.trace or cfg.disk != "none":
            nbd_socket = cfg.run_dir / f"{self.name}.nbd.sock"
            self.server = TracedDisk(
                nbd_socket,
                Path(image.rootfs),
                self._overlay(),
                cfg.disk,
                record=cfg.trace,
                real_flush=cfg.disk == "none",
            )
        else:
            qcow2 = self._overlay()
            proc = subprocess.run(
                [
                    "qemu-img",
                    "create",
                    "-q",
                    "-f",
                    "qcow2",
                    "-F",
                    "raw",
                    "-b",
                    image.rootfs,
                    str(qcow2),
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if proc.returncode != 0:
                raise DbTraceError(f"qemu-img could not create the overlay: {proc.stderr.strip()}")
        spec = DomainSpec(
            name=self.name,
            domain_type=cfg.domain_type,
            memory_mib=cfg.memory_mib,
            db_cache_mib=cfg.db_cache_mib,
            kernel=Path(image.kernel),
            initrd=Path(image.initrd),
            console_log=self.console_log,
            host_port=self.port,
            nbd_socket=nbd_socket,
            qcow2_overlay=qcow2,
        )
        # A stop signal taken mid-creation either lost the domain's handle or had libvirt
        # destroy a domain still starting, which left its QEMU running: it waits until the
        # domain is created and held, so that teardown destroys it.
        with stop_signals_deferred():
            try:
                self.domain = self.conn.createXML(spec.to_xml(), 0)  # type: ignore[attr-defined]
            except libvirt.libvirtError as err:
                raise DbTraceError(f"libvirt could not start the guest: {err}") from err

    def check_alive(self) -> None:
        """Raise if QEMU or the tracer has died."""
        import libvirt

        try:
            active = self.domain is not None and self.domain.isActive()  # type: ignore[attr-defined]
        except libvirt.libvirtError:
            active = False
        if not active:
            raise DbTraceError(f"the guest's QEMU is gone (see {self.console_log})")
        if self.server is not None and not self.server.alive():
            raise DbTraceError(
                f"the block tracer stopped: {self.server.error or 'connection closed'}"
            )

    def server_lost(self, err: Exception) -> DbTraceError:
        """The error for a connection to the guest's PostgreSQL that broke while the guest ran:
        with the kernel's word when it killed a process for memory."""
        text = self.console_log.read_text(errors="replace") if self.console_log.exists() else ""
        killed = [line.strip() for line in text.splitlines() if OOM_MARK in line]
        why = f': the guest\'s kernel said "{killed[-1]}"' if killed else ""
        return DbTraceError(
            f"the guest's PostgreSQL went away ({err}){why} (see {self.console_log})"
        )

    def wait_ready(self) -> None:
        """Wait for the guest's PostgreSQL to accept connections through the port forward."""
        from .sql import connect

        started = time.monotonic()
        deadline = started + self.config.boot_timeout_s
        while True:
            self.check_alive()
            text = self.console_log.read_text(errors="replace") if self.console_log.exists() else ""
            if FAILED_MARK in text:
                raise DbTraceError(
                    f"PostgreSQL did not start in the guest (see {self.console_log})"
                )
            if READY_MARK in text:
                try:
                    connect(self.port, "postgres", timeout=10).close()
                    break
                except Exception:  # noqa: BLE001 - any failure means: not accepting connections yet
                    pass
            if time.monotonic() > deadline:
                raise DbTraceError(
                    f"the guest did not come up within {self.config.boot_timeout_s:.0f} s "
                    f"(see {self.console_log})"
                )
            time.sleep(0.5)
        self.boot_seconds = time.monotonic() - started

    def quiesce(self) -> None:
        """Write out what booting dirtied (a checkpoint, then the guest kernel's ``sync``).

        Otherwise the kernel's delayed write-back of start-up files lands ~30 s
        after boot, inside the measured interval of a short run.
        """
        from .sql import connect

        conn = connect(self.port, "postgres", timeout=120)
        try:
            conn.run("CHECKPOINT")
            self.sync(conn)
        finally:
            conn.close()

    @staticmethod
    def sync(conn: Any) -> None:
        """The guest kernel's ``sync`` (through PostgreSQL, on connection ``conn``)."""
        conn.run("COPY (SELECT 1) TO PROGRAM 'sync'")

    def measure_cpu_slowdown(self) -> float:
        """The guest's time for the image's CPU probe over the native time measured at build
        time."""
        from .sql import connect

        image = self.image
        conn = connect(self.port, "postgres", timeout=120)
        try:
            guest_s = min(
                float(conn.run(f"SELECT scalebench_cpu_probe({image.cpu_probe_n})")[0][0])
                for _ in range(3)
            )
        finally:
            conn.close()
        self.cpu_slowdown = guest_s / image.cpu_probe_native_s
        return self.cpu_slowdown

    def apply_dilation(self) -> None:
        """Run the disk model in time dilated by the configured factor, else by the measured CPU
        slowdown (at least 1). The slowdown is measured either way, for the record."""
        if self.server is None:
            raise DbTraceError("time dilation needs a disk model on the traced path")
        slowdown = self.measure_cpu_slowdown()
        self.dilation = max(1.0, self.config.dilation or slowdown)
        self.server.dilate(self.dilation)

    def set_tracing(self, on: bool) -> None:
        """Record the guest's block requests from now on, or not (the disk model applies either
        way)."""
        if self.server is None:
            raise DbTraceError("tracing needs our NBD server on the disk path")
        self.server.set_recording(on)

    def trace_clock(self) -> float:
        """The tracer's clock (seconds), to mark the measurement window."""
        return self.server.now() if self.server is not None else time.monotonic()

    def sectors(self, start: float, end: float) -> tuple[int, int] | None:
        """(sectors read, sectors written) within [start, end) on the tracer's clock; None when
        nothing is recorded."""
        if self.server is None or not self.config.trace:
            return None
        return self.server.sectors(start, end)

    def records(self, start: float, end: float) -> list[TraceRecord]:
        """Trace records that arrived within [start, end) on the tracer's clock."""
        if self.server is None:
            return []
        return [r for r in self.server.records if start <= r.t < end]

    @property
    def disk_sectors(self) -> int:
        return Path(self.image.rootfs).stat().st_size // 512

    def stop(self) -> None:
        """Destroy the domain, stop the tracer, remove the overlay; safe to call twice."""
        import libvirt

        if self.domain is not None:
            with contextlib.suppress(libvirt.libvirtError):
                self.domain.destroy()  # type: ignore[attr-defined]
            self.domain = None
        if self.server is not None:
            self.server.stop()
        self._overlay().unlink(missing_ok=True)
