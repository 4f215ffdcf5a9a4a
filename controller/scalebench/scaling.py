"""Measurements of how densevm's costs grow with the VM count, shared by `scalebench nightly` and
the benches (experiments/bench/cells_scaling.py, densevm_acceptance.py).

A `Session` is one densevm process booted with N VMs; `Session.window` drives zipfperf load
over them for a while and reads, over exactly that window, the replies per second, the faults
the pager served and the CPU time of densevm's whole process tree (parent, cells, holders). `boot`
records boot time and the host memory each idle VM costs (kernel + monitor, the guests' own
resident RAM excluded). `NginxReference` is the same load on nginx: the host's own speed.
`hibernated_density` boots densevm with --idle-after, lets every VM hibernate and reads what a
hibernated VM costs the host and how fast one wakes.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import statistics
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import numpy as np

from .densevm import DenseVM, DenseVMArgs, DenseVMError, boot_timeout_s
from .nginx import NginxServer
from .touch import touch_all, touch_one

TICKS = os.sysconf("SC_CLK_TCK")
WS_BYTES = 896 << 10  # the webguest's default per-request working set


def mem_available() -> int:
    """MemAvailable of /proc/meminfo, bytes."""
    return meminfo()["MemAvailable"]


VCPU_THREAD = "vcpu"  # densevm names each vCPU thread vcpuN (hypervisor/src/vstate/vcpu.rs)


@dataclass(frozen=True)
class TreeCpu:
    """CPU time of a process tree so far, seconds."""

    user: float
    kernel: float
    monitor: float  # every thread but the vCPUs, exact (schedstat), user and kernel together
    root_kernel: float  # the root process's own: densevm's parent, the pager


def children(pid: int) -> list[int]:
    """The child processes of `pid` (none once it is gone), oldest pid first."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return out
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            continue
    return sorted(out)


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (densevm: the parent, its cells, their holders)."""
    pids = [pid]
    for p in pids:
        pids.extend(children(p))
    return pids


@dataclass
class KernelObjects:
    """Threads, descriptors and mappings of a process and every process below it."""

    threads: int
    fds: int
    maps: int

    @staticmethod
    def of(pid: int) -> KernelObjects:
        t = f = m = 0
        for p in descendants(pid):
            try:
                t += len(os.listdir(f"/proc/{p}/task"))
                f += len(os.listdir(f"/proc/{p}/fd"))
                m += len(Path(f"/proc/{p}/maps").read_text().splitlines())
            except FileNotFoundError:
                continue
        return KernelObjects(t, f, m)


def swap_file_bytes(pid: int, capacity: int) -> int:
    """Bytes allocated on disk to densevm's swap file: nameless (O_TMPFILE), so found among
    the descriptors of its parent `pid` by its size, the pager's `swap_capacity_bytes`."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            st = os.stat(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if st.st_size == capacity:
            return st.st_blocks * 512
    raise FileNotFoundError(f"no swap file of {capacity} bytes among pid {pid}'s descriptors")


def tree_cpu(pid: int) -> TreeCpu:
    """CPU time of `pid` and every process below it, while they run.

    `user` and `kernel` are the processes' own totals, `root_kernel` that of `pid` alone.
    `monitor` sums the threads not named vcpuN: the host side of the in-core path (event
    loops, proxy, pager, API). A slowdown there changes it in full, while in the whole it is a
    sixth, beside the guests' larger and more host-sensitive share. It is read from schedstat,
    the scheduler's exact runtime: per-thread times in stat are whole ticks, which over
    thousands of vCPU threads lose a large share."""
    user = kernel = monitor = root_kernel = 0.0
    for p in descendants(pid):
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            tasks = os.listdir(f"/proc/{p}/task")
        except FileNotFoundError:
            continue
        user += int(fields[11]) / TICKS
        kernel += int(fields[12]) / TICKS
        if p == pid:
            root_kernel = int(fields[12]) / TICKS
        monitor += sum(monitor_thread_ns(p, task) for task in tasks) / 1e9
    return TreeCpu(user, kernel, monitor, root_kernel)


def monitor_thread_ns(pid: int, task: str) -> int:
    """Nanoseconds thread `task` of `pid` has run, 0 for a vCPU thread or one already gone."""
    try:
        with open(f"/proc/{pid}/task/{task}/comm") as f:
            if f.read().startswith(VCPU_THREAD):
                return 0
        with open(f"/proc/{pid}/task/{task}/schedstat") as f:
            return int(f.read().split()[0])
    except FileNotFoundError:
        return 0


@dataclass(frozen=True)
class Build:
    """The binaries one measurement runs, and densevm flags added to every serve (the
    documented slowdowns `--inject-request-us` / `--inject-fault-us` of the nightly check)."""

    densevm: Path
    zipfperf: Path
    extra: tuple[str, ...] = ()

    @classmethod
    def in_dir(cls, directory: Path, extra: tuple[str, ...] = ()) -> Build:
        build = cls(directory / "densevm", directory / "zipfperf", extra)
        for path in (build.densevm, build.zipfperf):
            if not os.access(path, os.X_OK):
                raise FileNotFoundError(f"{path} is missing or not executable")
        return build


@dataclass(frozen=True)
class Window:
    """One load window of a session."""

    seconds: float
    replies_per_s: float
    replies: int
    faults: int
    user_s: float
    kernel_s: float
    monitor_s: float
    pager_kernel_s: float

    @property
    def faults_per_s(self) -> float:
        return self.faults / self.seconds

    @property
    def faults_per_cpu_s(self) -> float:
        """Faults served per CPU-second of densevm's process tree: the scaling figure."""
        return self.faults / max(self.user_s + self.kernel_s, 1e-9)

    @property
    def cpu_us_per_reply(self) -> float:
        """densevm's CPU (its whole process tree) per reply served: the in-core path's cost,
        which idle gaps on a shared host do not blur the way they blur replies/s."""
        return (self.user_s + self.kernel_s) * 1e6 / max(self.replies, 1)

    @property
    def monitor_us_per_reply(self) -> float:
        """CPU of densevm's own threads (all but the vCPUs) per reply: the in-core path's host
        side at its own scale (see `tree_cpu`)."""
        return self.monitor_s * 1e6 / max(self.replies, 1)

    @property
    def kernel_us_per_fault(self) -> float:
        return self.kernel_s * 1e6 / max(self.faults, 1)

    @property
    def pager_kernel_us_per_fault(self) -> float:
        """Kernel CPU of densevm's parent per fault: the pager makes every install,
        write-protect and hole punch, so the MMU-notifier walks that grow with the VMs per
        address space are charged there, without the vCPU threads' fault entries and exits."""
        return self.pager_kernel_s * 1e6 / max(self.faults, 1)

    @property
    def user_us_per_fault(self) -> float:
        return self.user_s * 1e6 / max(self.faults, 1)


@dataclass(frozen=True)
class Boot:
    vms: int
    boot_seconds: float
    memavailable_drop_bytes: int
    guest_ram_resident_bytes: int
    platform: str
    cells: int

    @property
    def host_bytes_per_vm(self) -> float:
        """Kernel + monitor memory per booted idle VM."""
        return (self.memavailable_drop_bytes - self.guest_ram_resident_bytes) / self.vms


class LoadTarget:
    """A server on `vms` loopback addresses from `addr_base` at `port` (process `proc`), which
    zipfperf loads with a new connection per request."""

    build: Build
    vms: int
    addr_base: str
    port: int
    proc: subprocess.Popen

    def faults(self) -> int:
        """Faults the server has served so far (0: a server that does not page)."""
        return 0

    def load(self, seconds: float, alpha: float, concurrency: int = 64) -> dict:
        """zipfperf's JSON result for `seconds` of load, a new connection per request."""
        out = subprocess.run(
            [
                str(self.build.zipfperf),
                "--targets",
                str(self.vms),
                "--addr-base",
                self.addr_base,
                "--port",
                str(self.port),
                "--alpha",
                str(alpha),
                "--concurrency",
                str(concurrency),
                "--num-calls",
                "1",
                "--duration",
                str(seconds),
                "--json",
                "-",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout)

    def window(self, seconds: float, alpha: float, concurrency: int = 64) -> Window:
        """Load for `seconds`, measured: replies/s, faults and the server's CPU in the window."""
        before = self.faults()
        cpu_before = tree_cpu(self.proc.pid)
        started = time.monotonic()
        result = self.load(seconds, alpha, concurrency)
        elapsed = time.monotonic() - started
        cpu_after = tree_cpu(self.proc.pid)
        after = self.faults()
        return Window(
            elapsed,
            float(result["replies"]["rate"]),
            int(result["replies"]["total"]),
            int(after - before),
            cpu_after.user - cpu_before.user,
            cpu_after.kernel - cpu_before.kernel,
            cpu_after.monitor - cpu_before.monitor,
            cpu_after.root_kernel - cpu_before.root_kernel,
        )


class Session(LoadTarget):
    """One densevm serving `vms` VMs at addr_base; a context manager that stops it on exit.

    `args` are further serve flags (--mem, --block, --disk, --cell-vms, ...). densevm is
    launched as every controller run launches it (densevm.DenseVM); its swap file, API socket
    and log are in `workdir`."""

    def __init__(
        self,
        build: Build,
        workdir: Path,
        vms: int,
        addr_base: str,
        *args: str,
        port: int = 8080,
    ) -> None:
        self.build, self.vms, self.addr_base, self.port = build, vms, addr_base, port
        workdir = workdir.resolve()
        self.api = workdir / f"densevm-{addr_base}.sock"
        own_swap = any(a == "--swap" or a.startswith("--swap=") for a in args)
        serve = DenseVMArgs(
            vms=vms,
            addr_base=addr_base,
            port=port,
            api=self.api,
            swap=None if own_swap else workdir / f"densevm-swap-{addr_base}.img",
            extra=(*args, *build.extra),
        )
        settle_s = 1.0
        time.sleep(settle_s)
        before = mem_available()
        # Stopping thousands of VMs takes a while: SIGKILL only after minutes.
        self.densevm = DenseVM(
            build.densevm, serve, workdir / f"densevm-{addr_base}.log", stop_grace_s=300.0
        )
        self.proc = self.densevm.child.popen
        self._stopped = False
        try:
            try:
                self.ready: dict = self.densevm.wait_ready(boot_timeout_s(vms))
            except DenseVMError:
                raise DenseVMError(f"densevm failed: {self.densevm.last_error()}") from None
            time.sleep(settle_s)
            drop = before - mem_available()
            self.boot = Boot(
                vms,
                float(self.ready["boot_seconds"]),
                drop,
                int(self.stats(per_vm=True)["totals"]["ram_resident_bytes"]),
                str(self.ready.get("platform", "")),
                int(self.ready.get("cells", 1)),
            )
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Session:
        return self

    def __exit__(
        self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> float:
        """Stop densevm (its whole process group); seconds the shutdown took."""
        started = time.monotonic()
        if not self._stopped:
            self._stopped = True
            self.densevm.stop()
        return time.monotonic() - started

    def stats(self, per_vm: bool = False) -> dict:
        return self.densevm.request({"cmd": "stats", "vms": per_vm}, timeout_s=120)

    def totals(self) -> dict:
        """The cheap totals (no per-VM list, no mincore counts)."""
        return self.stats()["totals"]

    def faults(self) -> int:
        return int(self.totals()["faults"])


def meminfo() -> dict[str, int]:
    """/proc/meminfo, bytes per field."""
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields


def dropped_meminfo(readings: int = 3, gap_s: float = 0.2) -> dict[str, int]:
    """/proc/meminfo once dirty pages are written back and the page cache, dentries and inodes
    dropped (`sync; echo 3 > /proc/sys/vm/drop_caches`, root only): what happens to be cached,
    densevm's swap file above all, then moves the reading no more. Per field, the median of
    `readings` such readings `gap_s` apart: on a shared host other tenants' processes moved
    single readings a second apart by up to 177 MiB, and back."""
    values: list[dict[str, int]] = []
    for i in range(readings):
        if i:
            time.sleep(gap_s)
        os.sync()
        try:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        except PermissionError:
            raise RuntimeError(
                "dropping the page cache (/proc/sys/vm/drop_caches) needs root"
            ) from None
        values.append(meminfo())
    return {key: int(statistics.median(v[key] for v in values)) for key in values[0]}


def dropped_mem_available() -> int:
    """MemAvailable as dropped_meminfo reads it."""
    return dropped_meminfo()["MemAvailable"]


# MemAvailable has settled when two readings a second apart move less than this.
SETTLED_BYTES = 16 << 20


def settled_meminfo(timeout_s: float = 60.0) -> dict[str, int]:
    """dropped_meminfo once MemAvailable has stopped moving, the reading to measure a drop
    from: a host still freeing what the last densevm held (its VMs' memory, its swap file)
    read 600 KiB a VM low over 1,000 VMs. After `timeout_s` the last reading, as it is."""
    deadline = time.monotonic() + timeout_s
    reading = dropped_meminfo()
    while time.monotonic() < deadline:
        time.sleep(1.0)
        previous, reading = reading, dropped_meminfo()
        if abs(reading["MemAvailable"] - previous["MemAvailable"]) < SETTLED_BYTES:
            break
    return reading


# A GET to a VM, the first or a wake, that takes longer than this failed.
GET_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Density:
    """What hibernated VMs cost the host and how fast they wake (hibernated_density)."""

    vms: int
    memavailable_drop_bytes: int  # from before densevm started to every VM hibernated
    wake_s: tuple[float, ...]  # each answered wake, connect to last byte at the client
    failed: tuple[int, ...]  # VMs that did not answer a GET (their first or their wake)

    @property
    def hibernated_bytes_per_vm(self) -> float:
        """Host memory per hibernated VM: kernel and monitor, nothing resident for the guest."""
        return self.memavailable_drop_bytes / self.vms

    @property
    def wake_p99_ms(self) -> float:
        return float(np.percentile(self.wake_s, 99)) * 1e3


def hibernated_density(
    build: Build,
    workdir: Path,
    vms: int,
    addr_base: str,
    idle_after_s: float,
    wakes: int,
    wake_rate: float,
    *args: str,
) -> Density:
    """densevm serving `vms` VMs with --idle-after `idle_after_s` (and serve flags `args`):
    every VM is sent one GET and left to hibernate; then the host memory they cost (MemAvailable's
    drop since before densevm started, page cache dropped before each reading) and the wake
    latency at the client of `wakes` hibernated VMs, one GET each at `wake_rate` a second."""
    before = settled_meminfo()["MemAvailable"]
    with Session(
        build, workdir, vms, addr_base, "--idle-after", str(idle_after_s), *args
    ) as session:
        failed = touch_all(addr_base, session.port, range(vms), 64, GET_TIMEOUT_S)
        wait_until_hibernated(session, vms, timeout_s=30 + idle_after_s + vms / 50)
        drop = before - dropped_mem_available()
        woken = paced_gets(addr_base, session.port, range(min(wakes, vms)), wake_rate)
    return Density(
        vms,
        drop,
        tuple(t for (t,) in woken.values() if t is not None),
        tuple(sorted({*failed, *(vm for vm, (t,) in woken.items() if t is None)})),
    )


def wait_until_hibernated(session: Session, vms: int, timeout_s: float) -> None:
    """Until every VM is hibernated and the pager holds nothing of them; RuntimeError after
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        totals = session.totals()
        if totals.get("hibernated") == vms and totals.get("resident_bytes") == 0:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{totals.get('hibernated')} of {vms} VMs hibernated within {timeout_s:.0f} s "
                f"({totals.get('resident_bytes')} bytes still resident)"
            )
        time.sleep(0.1)


def paced_gets(
    addr_base: str, port: int, vms: Sequence[int], rate: float, gets_each: int = 1
) -> dict[int, list[float | None]]:
    """`gets_each` GETs to each of `vms`, one after another, each VM's first started `rate` a
    second however long the answers take: per VM, the seconds from connect to the last byte of
    each, None for one that failed (a wake's first GET and then the same VM awake, with 2)."""
    base = ipaddress.IPv4Address(addr_base)

    def timed(vm: int) -> list[float | None]:
        times: list[float | None] = []
        for _ in range(gets_each):
            started = time.perf_counter()
            ok = touch_one(str(base + vm), port, GET_TIMEOUT_S)
            times.append(time.perf_counter() - started if ok else None)
        return times

    # Enough threads that slow wakes never delay the next one's start.
    with ThreadPoolExecutor(max_workers=64) as pool:
        start = time.monotonic()
        futures = {}
        for i, vm in enumerate(vms):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            futures[vm] = pool.submit(timed, vm)
        return {vm: f.result() for vm, f in futures.items()}


class NginxReference(LoadTarget):
    """nginx (one worker) on `vms` loopback addresses, serving the webguest's 2,258-byte reply:
    the host's own speed under the in-core load shape, with no densevm in it. A context
    manager."""

    def __init__(self, build: Build, vms: int, addr_base: str) -> None:
        self.build, self.vms, self.addr_base = build, vms, addr_base
        self.port = free_port()
        self.server = NginxServer(self.port, extra_targets=vms, addr_base=addr_base)

    def __enter__(self) -> NginxReference:
        self.server.__enter__()
        assert self.server.proc is not None
        self.proc = self.server.proc
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()


def free_port() -> int:
    """A TCP port free on every loopback address now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
