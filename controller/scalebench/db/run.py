"""One traced database run: image, libvirtd, guest, workload, trace, metrics."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .analysis import BlockMetrics, block_metrics, plot_lba, write_trace_csv
from .daemon import Libvirt
from .errors import DbTraceError
from .guest import DbGuest, GuestConfig
from .image import REPO_ROOT, GuestImage, ensure_image
from .rubis import Rubis
from .tpcc import Tpcc
from .tpcw import Tpcw
from .workload import Workload, WorkloadResult, run_workload

WORKLOADS: dict[str, Workload] = {"tpcc": Tpcc(), "tpcw": Tpcw(), "rubis": Rubis()}
READ_INTENSIVE = {"tpcc": "standard", "tpcw": "browsing", "rubis": "browsing"}
WRITE_INTENSIVE = {"tpcc": "highwrite", "tpcw": "ordering", "rubis": "highbidding"}
STUDY_NAMES = {"tpcc": "TPC-C", "tpcw": "TPC-W", "rubis": "RUBiS"}


def default_out_dir(prefix: str) -> Path:
    """runs/<prefix>-<UTC time> under the repository (git-ignored)."""
    return REPO_ROOT / "runs" / time.strftime(f"{prefix}-%Y%m%d-%H%M%S", time.gmtime())


@dataclass(frozen=True)
class RunOptions:
    """What one ``dbtrace`` run does."""

    workload: str
    mix: str
    clients: int
    duration_s: float
    disk: str = "hdd15k"
    trace: bool = True
    warmup_s: float = 0.0
    memory_mib: int = 256
    boot_timeout_s: float = 240.0
    out_dir: Path = field(default_factory=lambda: default_out_dir("dbtrace"))
    seed: int = 1
    dilate: bool = False
    dilation: float | None = None  # with dilate: this factor, not the slowdown measured in the run


@dataclass
class RunResult:
    """User-level and block-level outcome of one run."""

    options: dict[str, Any]
    domain_type: str
    boot_seconds: float
    disk_sectors: int
    throughput: WorkloadResult
    metrics: BlockMetrics | None
    trace_csv: str | None
    lba_plot: str | None
    lba_in_range: bool = True
    tracer_requests_total: int = 0
    cpu_slowdown: float = 0.0
    dilation: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["schema"] = "scalebench-dbtrace/1"
        return doc


def validate(workload: str, mix: str, clients: int, duration_s: float, disk: str) -> None:
    """Raise ValueError with a one-line message for bad input."""
    from .diskmodel import MODEL_NAMES

    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r} (choose from {', '.join(WORKLOADS)})")
    if mix not in WORKLOADS[workload].mixes:
        raise ValueError(
            f"{workload} has no mix {mix!r} (choose from {', '.join(WORKLOADS[workload].mixes)})"
        )
    if clients < 1:
        raise ValueError(f"--clients must be at least 1, not {clients}")
    if duration_s <= 0:
        raise ValueError(f"--duration must be positive, not {duration_s}")
    if disk not in MODEL_NAMES:
        raise ValueError(f"unknown disk model {disk!r} (choose from {', '.join(MODEL_NAMES)})")


def run_on_guest(
    guest: DbGuest, opts: RunOptions, run_dir: Path, stop: threading.Event | None = None
) -> RunResult:
    """Drive the workload on a running guest and analyse its trace (``stop`` ends it early)."""
    workload = WORKLOADS[opts.workload]
    if opts.warmup_s > 0:
        run_workload(
            workload,
            opts.mix,
            guest.port,
            opts.clients,
            opts.warmup_s,
            seed=opts.seed + 7,
            check=guest.check_alive,
        )
    window: dict[str, float] = {}
    result = run_workload(
        workload,
        opts.mix,
        guest.port,
        opts.clients,
        opts.duration_s,
        seed=opts.seed,
        check=guest.check_alive,
        on_start=lambda: window.setdefault("start", guest.trace_clock()),
        stop=stop,
    )
    guest.check_alive()
    start = window.get("start", 0.0)
    # The measured interval only: not the drain of interactions still in flight when it ended.
    records = guest.records(start, start + result.duration_s)
    metrics = trace_csv = plot = None
    in_range = True
    if opts.trace:
        metrics = block_metrics(records)
        in_range = all(r.lba >= 0 and r.lba + r.sectors <= guest.disk_sectors for r in records)
        stem = f"{opts.workload}-{opts.mix}-{opts.disk}-c{opts.clients}"
        trace_path, plot_path = run_dir / f"{stem}.trace.csv", run_dir / f"{stem}.lba.png"
        write_trace_csv(records, trace_path)
        plot_lba(
            records,
            plot_path,
            f"{STUDY_NAMES[opts.workload]} {opts.mix}, {opts.clients} clients, disk {opts.disk}",
            guest.disk_sectors,
        )
        trace_csv, plot = str(trace_path), str(plot_path)
    return RunResult(
        options={k: str(v) if isinstance(v, Path) else v for k, v in asdict(opts).items()},
        domain_type=guest.config.domain_type,
        boot_seconds=round(guest.boot_seconds, 2),
        disk_sectors=guest.disk_sectors,
        throughput=result,
        metrics=metrics,
        trace_csv=trace_csv,
        lba_plot=plot,
        lba_in_range=in_range,
        tracer_requests_total=len(guest.server.records) if guest.server is not None else 0,
        cpu_slowdown=round(guest.cpu_slowdown, 2),
        dilation=round(guest.dilation, 2),
    )


def run_dbtrace(opts: RunOptions, image: GuestImage | None = None) -> RunResult:
    """Build or reuse the image, start libvirtd if needed, run one guest, clean everything up."""
    validate(opts.workload, opts.mix, opts.clients, opts.duration_s, opts.disk)
    image = image or ensure_image()
    run_dir = opts.out_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    config = GuestConfig(
        image=image,
        run_dir=run_dir,
        disk=opts.disk,
        trace=opts.trace,
        memory_mib=opts.memory_mib,
        boot_timeout_s=opts.boot_timeout_s,
        dilate=opts.dilate,
        dilation=opts.dilation,
    )
    with Libvirt() as lv, DbGuest(config, lv.conn) as guest:
        return run_on_guest(guest, opts, run_dir)


def save_json(result: RunResult | list[RunResult], path: Path) -> None:
    doc = [r.to_json() for r in result] if isinstance(result, list) else result.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def load_results(path: Path) -> list[dict[str, Any]]:
    """Result documents saved by ``--json`` (one or a list)."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise DbTraceError(f"cannot read results from {path}: {err}") from err
    return doc if isinstance(doc, list) else [doc]
