"""The result document of one run (schema "scalebench.result/1", see controller/RESULTS.md)."""

from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from .config import host_memory_bytes

SCHEMA = "scalebench.result/1"
# A host's name and kind can be given (several "hosts" on one machine, as in the cluster tests).
HOST_NAME_ENV, HOST_KIND_ENV = "SCALEBENCH_HOST_NAME", "SCALEBENCH_HOST_KIND"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def kvm_platform() -> str:
    """What densevm's VMs run on: "pvm" (the shadow-paging kvm_pvm), "kvm" (VMX/SVM) or "none"."""
    if Path("/sys/module/kvm_pvm").exists():
        return "pvm"
    return "kvm" if Path("/dev/kvm").exists() else "none"


def host_info() -> dict:
    """Who ran a result: its host's name and kind (the facts that make figures comparable)."""
    info = {
        "hostname": os.environ.get(HOST_NAME_ENV) or socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "memory_bytes": host_memory_bytes(),
        "kernel": platform.release(),
        "kvm": kvm_platform(),
        "python": platform.python_version(),
    }
    fingerprint = (
        f"{info['cpu_model']} x{info['cpus']}, {round(info['memory_bytes'] / 2**30)} GiB, "
        f"Linux {info['kernel']}, {info['kvm']}"
    )
    info["kind"] = os.environ.get(HOST_KIND_ENV) or fingerprint
    return info


@dataclass
class RunResult:
    """One run, complete or failed part way (status "failed", error set, the rest partial)."""

    run_id: str
    config: dict
    schema: str = SCHEMA
    status: str = "running"  # "ok" | "failed" (never "running" once written)
    error: str | None = None
    warnings: list = field(default_factory=list)  # one line each: results to read with care
    started_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
    host: dict = field(default_factory=host_info)
    # measured, over the measurement phase
    throughput_rps: float | None = (
        None  # requests/s served, densevm's counter over the measurement window
    )
    client_rps: float | None = (
        None  # replies/s seen by zipfperf over its whole run (warm-up included)
    )
    latency_ms: dict = field(default_factory=dict)  # p50, p90, p99, p999, mean, max
    errors: int | None = None  # zipfperf's error total
    error_detail: dict = field(default_factory=dict)
    replies: int | None = None  # zipfperf's replies, whole run
    duration_s: float | None = None  # the measurement window
    boot_seconds: float | None = None
    resident_bytes: int | None = None  # at the end of the measurement
    budget_bytes: int | None = None
    footprint_bytes: int | None = None  # measured per-VM footprint (hot VMs' resident bytes)
    faults: int | None = None
    faults_per_s: float | None = None
    swap_read_bytes: int | None = None  # during the measurement phase
    swap_write_bytes: int | None = None
    swap_used_bytes: int | None = None  # in use at the end (regions, or compact records)
    swap_bytes_per_vm: float | None = None  # swap_used_bytes over the VMs
    swap_read_mbps: float | None = None  # MB/s = 10^6 bytes/s
    swap_write_mbps: float | None = None
    disk_busy: float | None = None  # densevm io_seconds per wall second
    # the swap device's µs per block read or written: {"settle": ..., "measure": ...}
    swap_io_us_per_block: dict = field(default_factory=dict)
    drive: dict = field(
        default_factory=dict
    )  # the modeled drives over the measurement, see RESULTS.md
    fault_latency_us: dict = field(default_factory=dict)
    regime: str | None = None  # "in-core" | "disk-bound", see RESULTS.md
    hit_ratio: float | None = (
        None  # 1 - (swap-in bytes / footprint) / requests: against model.hit_ratio
    )
    resident_mass: float | None = None  # Zipf request share of the VMs wholly resident at the end
    # hibernation (--idle-after; null without it): VMs asleep and awake at the end of the
    # measurement, its counters over it, wakes per request and the wakes' latency (µs)
    hibernated: int | None = None
    live: int | None = None
    wakes: int | None = None
    hibernations: int | None = None
    wake_failures: int | None = None
    wake_fraction: float | None = None
    wake_us_p50: int | None = None
    wake_us_p99: int | None = None
    clones_started: int | None = None  # VMs started as clones of the template by its end
    # model
    model_rps: float | None = None
    measured_over_model: float | None = None
    model: dict = field(default_factory=dict)
    calibration: dict = field(default_factory=dict)
    diskbench: dict = field(default_factory=dict)
    # containment
    containment: dict = field(default_factory=dict)
    psi: dict = field(default_factory=dict)
    # raw material
    phases: dict = field(default_factory=dict)  # per phase: zipfperf summary and window
    # The run's phases on the time series' clock (seconds since densevm was ready; boot is
    # before 0): [{"phase": "boot"|"calibrate"|"touch"|"settle"|"load", "from_s", "to_s"}].
    timeline: list = field(default_factory=list)
    timeseries: list = field(default_factory=list)  # densevm stats samples, about 1/s
    pager: dict = field(default_factory=dict)
    db: list = field(default_factory=list)
    files: dict = field(default_factory=dict)
    placement: dict = field(
        default_factory=dict
    )  # a sweep point run on a cluster: where, how many attempts

    def fail(self, message: str) -> None:
        if self.status != "failed":  # the first failure is the cause; later ones are fallout
            self.status, self.error = "failed", message

    def as_dict(self) -> dict:
        return asdict(self)

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.as_dict(), indent=2, default=str) + "\n")
        tmp.replace(path)  # a reader never sees half a document
