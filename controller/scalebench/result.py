"""The result document of one run (schema "scalebench.result/1", see controller/RESULTS.md)."""
from __future__ import annotations

import json
import os
import platform
import socket
from dataclasses import dataclass, asdict, field
from datetime import datetime, timezone
from pathlib import Path

SCHEMA = "scalebench.result/1"


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def host_info() -> dict:
    return {"hostname": socket.gethostname(), "cpus": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version()}


@dataclass
class RunResult:
    """One run, complete or failed part way (status "failed", error set, the rest partial)."""

    run_id: str
    config: dict
    schema: str = SCHEMA
    status: str = "running"               # "ok" | "failed" (never "running" once written)
    error: str | None = None
    warnings: list = field(default_factory=list)  # one line each: results to read with care
    started_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
    host: dict = field(default_factory=host_info)
    # measured, over the measurement phase
    throughput_rps: float | None = None   # requests/s served, densevm's counter over the measurement window
    client_rps: float | None = None       # replies/s seen by zipfperf over its whole run (warm-up included)
    latency_ms: dict = field(default_factory=dict)   # p50, p90, p99, p999, mean, max
    errors: int | None = None             # zipfperf's error total
    error_detail: dict = field(default_factory=dict)
    replies: int | None = None            # zipfperf's replies, whole run
    duration_s: float | None = None       # the measurement window
    boot_seconds: float | None = None
    resident_bytes: int | None = None     # at the end of the measurement
    budget_bytes: int | None = None
    footprint_bytes: int | None = None    # measured per-VM footprint (hot VMs' resident bytes)
    faults: int | None = None
    faults_per_s: float | None = None
    swap_read_bytes: int | None = None    # during the measurement phase
    swap_write_bytes: int | None = None
    swap_read_mbps: float | None = None   # MB/s = 10^6 bytes/s
    swap_write_mbps: float | None = None
    disk_busy: float | None = None        # densevm io_seconds per wall second
    drive: dict = field(default_factory=dict)  # the modeled drives over the measurement, see RESULTS.md
    fault_latency_us: dict = field(default_factory=dict)
    regime: str | None = None             # "in-core" | "disk-bound", see RESULTS.md
    hit_ratio: float | None = None        # 1 - (swap-in bytes / footprint) / requests: against model.hit_ratio
    resident_mass: float | None = None    # Zipf request share of the VMs wholly resident at the end
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
    phases: dict = field(default_factory=dict)       # per phase: zipfperf summary and window
    timeseries: list = field(default_factory=list)   # densevm stats samples, about 1/s
    pager: dict = field(default_factory=dict)
    db: list = field(default_factory=list)
    files: dict = field(default_factory=dict)

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

