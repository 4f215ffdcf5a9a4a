"""One traced database run: image, libvirtd, guest, warm-up to steady state, workload, trace,
metrics, PostgreSQL's own counters."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from . import pgbench, pgstat, relfiles
from .analysis import BlockMetrics, block_metrics, plot_lba, write_trace_csv
from .daemon import Libvirt
from .errors import DbTraceError
from .guest import DbGuest, GuestConfig
from .image import REPO_ROOT
from .pgstat import IoAgreement
from .rubis import Rubis
from .sql import connect, lost_connection
from .steady import SteadyCriteria, SteadyDetector, SteadyState, Window
from .tpcc import Tpcc
from .tpcw import Tpcw
from .workload import InteractionStats, Workload, WorkloadResult, run_workload

SCHEMA = "scalebench-dbtrace/2"
WindowReport = Callable[[Window, str | None], None]

WORKLOADS: dict[str, Workload] = {"tpcc": Tpcc(), "tpcw": Tpcw(), "rubis": Rubis()}
PGBENCH = "pgbench"
MIXES: dict[str, tuple[str, ...]] = {
    **{name: tuple(w.mixes) for name, w in WORKLOADS.items()},
    PGBENCH: pgbench.MIXES,
}
READ_INTENSIVE = {"tpcc": "standard", "tpcw": "browsing", "rubis": "browsing"}
WRITE_INTENSIVE = {"tpcc": "highwrite", "tpcw": "ordering", "rubis": "highbidding"}
STUDY_NAMES = {"tpcc": "TPC-C", "tpcw": "TPC-W", "rubis": "RUBiS", PGBENCH: "pgbench"}


def default_out_dir(prefix: str) -> Path:
    """runs/<prefix>-<UTC time> under the repository (git-ignored)."""
    return REPO_ROOT / "runs" / time.strftime(f"{prefix}-%Y%m%d-%H%M%S", time.gmtime())


@dataclass(frozen=True)
class RunOptions:
    """What one ``dbtrace`` run does; the guest's own settings (disk model, tracing, memory,
    dilation, run directory) are its ``guest`` config's.

    ``warmup_s`` None warms up until steady state (``steady``, capped at ``steady.cap_s``);
    a number forces that fixed warm-up (0: none).
    """

    workload: str
    mix: str
    clients: int
    duration_s: float
    guest: GuestConfig
    warmup_s: float | None = None
    steady: SteadyCriteria = field(default_factory=SteadyCriteria)
    scale: int = pgbench.DEFAULT_SCALE  # pgbench only: the pgbench database's scale
    seed: int = 1

    @property
    def out_dir(self) -> Path:
        return self.guest.run_dir

    def describe(self) -> dict[str, Any]:
        """The options as the result JSON records them."""
        g = self.guest
        return {
            "workload": self.workload,
            "mix": self.mix,
            "clients": self.clients,
            "duration_s": self.duration_s,
            "disk": g.disk,
            "trace": g.trace,
            "warmup_s": self.warmup_s,
            "warmup_cap_s": self.steady.cap_s,
            "memory_mib": g.memory_mib,
            "db_cache_mib": g.db_cache_mib,
            "boot_timeout_s": g.boot_timeout_s,
            "out_dir": str(g.run_dir),
            "seed": self.seed,
            "dilate": g.dilate,
            "dilation": g.dilation,
            **({"scale": self.scale} if self.workload == PGBENCH else {}),
        }


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
    steady: SteadyState
    postgres: IoAgreement | None = None  # PostgreSQL's counters for the measured window
    lba_in_range: bool = True
    tracer_requests_total: int = 0
    cpu_slowdown: float = 0.0
    dilation: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["schema"] = SCHEMA
        return doc


def validate(workload: str, mix: str, clients: int, duration_s: float, disk: str) -> None:
    """Raise ValueError with a one-line message for bad input."""
    from .diskmodel import MODEL_NAMES

    if workload not in MIXES:
        raise ValueError(f"unknown workload {workload!r} (choose from {', '.join(MIXES)})")
    if mix not in MIXES[workload]:
        raise ValueError(
            f"{workload} has no mix {mix!r} (choose from {', '.join(MIXES[workload])})"
        )
    if clients < 1:
        raise ValueError(f"--clients must be at least 1, not {clients}")
    if duration_s <= 0:
        raise ValueError(f"--duration must be positive, not {duration_s}")
    if disk not in MODEL_NAMES:
        raise ValueError(f"unknown disk model {disk!r} (choose from {', '.join(MODEL_NAMES)})")


def _database(opts: RunOptions) -> str:
    return pgbench.DATABASE if opts.workload == PGBENCH else WORKLOADS[opts.workload].database


def warm_up(
    guest: DbGuest,
    opts: RunOptions,
    stop: threading.Event | None = None,
    on_window: WindowReport | None = None,
) -> SteadyState:
    """Run the mix unmeasured: until steady (or the cap), or for the fixed ``warmup_s``."""
    if opts.warmup_s == 0:
        return SteadyState.no_warmup()
    mode = "detect" if opts.warmup_s is None else "fixed"
    length = opts.steady.cap_s if opts.warmup_s is None else opts.warmup_s
    conn = connect(guest.port, "postgres", timeout=120)

    def request_checkpoint() -> None:
        own = connect(guest.port, "postgres", timeout=600)
        try:
            own.run("CHECKPOINT")
        finally:
            own.close()

    try:
        version = pgstat.version_num(conn)
        detector = SteadyDetector(
            opts.steady,
            mode,
            guest.trace_clock,
            guest.sectors,
            lambda: pgstat.checkpoints(conn, version),
            request_checkpoint,
            on_window,
        )
        if opts.workload == PGBENCH:
            first = pgstat.read_counters(conn, pgbench.DATABASE).commits

            def pgbench_progress() -> bool:
                done = pgstat.read_counters(conn, pgbench.DATABASE).commits - first
                return detector.poll(done) or (stop is not None and stop.is_set())

            pgbench.run(
                guest.port,
                opts.mix,
                opts.clients,
                length,
                check=guest.check_alive,
                progress=pgbench_progress,
            )
        else:
            run_workload(
                WORKLOADS[opts.workload],
                opts.mix,
                guest.port,
                opts.clients,
                length,
                seed=opts.seed + 7,
                check=guest.check_alive,
                stop=stop,
                progress=detector.poll,
            )
        return detector.finish()
    finally:
        conn.close()


def _measure_pgbench(
    guest: DbGuest, opts: RunOptions, conn: Any
) -> tuple[WorkloadResult, float, float, pgstat.PgCounters, pgstat.PgCounters]:
    """pgbench for the measured window, which closes with a checkpoint and the guest's sync so
    that what PostgreSQL wrote in it reaches the disk within it."""
    guest.sync(conn)
    before = pgstat.read_counters(conn, pgbench.DATABASE)
    start = guest.trace_clock()
    out = pgbench.run(guest.port, opts.mix, opts.clients, opts.duration_s, check=guest.check_alive)
    assert out is not None  # no progress callback: the run ends by itself
    conn.run("CHECKPOINT")
    guest.sync(conn)
    end = guest.trace_clock()
    after = pgstat.read_counters(conn, pgbench.DATABASE)
    result = WorkloadResult(
        workload=PGBENCH,
        mix=opts.mix,
        clients=opts.clients,
        duration_s=out.duration_s,
        completed=out.transactions,
        errors=out.failed,
        per_minute=out.transactions * 60.0 / out.duration_s,
        per_second=out.transactions / out.duration_s,
        per_minute_label=pgbench.PER_MINUTE_LABEL,
        response_ms=InteractionStats(
            count=out.transactions, errors=out.failed, mean_ms=out.latency_ms
        ),
    )
    return result, start, end, before, after


def _measure_workload(
    guest: DbGuest,
    opts: RunOptions,
    conn: Any,
    stop: threading.Event | None,
    on_progress: Callable[[int], None] | None,
) -> tuple[WorkloadResult, float, float, pgstat.PgCounters, pgstat.PgCounters]:
    window: dict[str, Any] = {}

    def progress(completed: int) -> bool:
        if on_progress is not None:
            on_progress(completed)
        return False  # the window ends at its duration or on `stop`, not here

    def began() -> None:
        window["before"] = pgstat.read_counters(conn, _database(opts))
        window["start"] = guest.trace_clock()

    result = run_workload(
        WORKLOADS[opts.workload],
        opts.mix,
        guest.port,
        opts.clients,
        opts.duration_s,
        seed=opts.seed,
        check=guest.check_alive,
        on_start=began,
        stop=stop,
        progress=progress,
    )
    after = pgstat.read_counters(conn, _database(opts))
    if "start" not in window:  # stopped before the clients were up: an empty window
        began()
    start = window["start"]
    # The measured interval only: not the drain of interactions still in flight when it ended.
    return result, start, start + result.duration_s, window["before"], after


def run_on_guest(
    guest: DbGuest,
    opts: RunOptions,
    stop: threading.Event | None = None,
    on_window: WindowReport | None = None,
    on_progress: Callable[[int], None] | None = None,
) -> RunResult:
    """Warm up, drive the measured window on a running guest and analyse its trace (``stop`` ends
    it early; ``on_window`` hears of each warm-up window; ``on_progress``, about once a second,
    of the interactions the measured window has completed so far)."""
    run_dir = opts.out_dir
    if opts.workload == PGBENCH:
        guest.set_tracing(False)  # loading the pgbench tables is not part of any run
        try:
            pgbench.initialise(guest.port, opts.scale)
        finally:
            guest.set_tracing(opts.guest.trace)
    try:
        steady = warm_up(guest, opts, stop, on_window)
        # On the postgres database: its own queries do not count among the workload's commits.
        conn = connect(guest.port, "postgres", timeout=120)
        try:
            if opts.workload == PGBENCH:
                result, start, end, before, after = _measure_pgbench(guest, opts, conn)
            else:
                result, start, end, before, after = _measure_workload(
                    guest, opts, conn, stop, on_progress
                )
            extents = relfiles.relation_extents(conn) if opts.guest.trace else []
        finally:
            conn.close()
    except lost_connection() as err:
        guest.check_alive()  # a guest that is gone altogether says so first
        raise guest.server_lost(err) from err
    guest.check_alive()
    records = guest.records(start, end)
    metrics = trace_csv = plot = agreement = None
    in_range = True
    if opts.guest.trace:
        metrics = block_metrics(records)
        agreement = IoAgreement.of(
            metrics.sectors_read,
            relfiles.sectors_within(records, extents),
            metrics.sectors_written,
            pgstat.PgWindow.between(before, after),
        )
        in_range = all(r.lba >= 0 and r.lba + r.sectors <= guest.disk_sectors for r in records)
        stem = f"{opts.workload}-{opts.mix}-{opts.guest.disk}-c{opts.clients}"
        trace_path, plot_path = run_dir / f"{stem}.trace.csv", run_dir / f"{stem}.lba.png"
        write_trace_csv(records, trace_path)
        plot_lba(
            records,
            plot_path,
            f"{STUDY_NAMES[opts.workload]} {opts.mix}, {opts.clients} clients, "
            f"disk {opts.guest.disk}",
            guest.disk_sectors,
        )
        trace_csv, plot = str(trace_path), str(plot_path)
    return RunResult(
        options=opts.describe(),
        domain_type=guest.config.domain_type,
        boot_seconds=round(guest.boot_seconds, 2),
        disk_sectors=guest.disk_sectors,
        throughput=result,
        metrics=metrics,
        trace_csv=trace_csv,
        lba_plot=plot,
        steady=steady,
        postgres=agreement,
        lba_in_range=in_range,
        tracer_requests_total=len(guest.server.records) if guest.server is not None else 0,
        cpu_slowdown=round(guest.cpu_slowdown, 2),
        dilation=round(guest.dilation, 2),
    )


def run_dbtrace(opts: RunOptions, on_window: WindowReport | None = None) -> RunResult:
    """Build or reuse the image, start libvirtd if needed, run one guest, clean everything up."""
    validate(opts.workload, opts.mix, opts.clients, opts.duration_s, opts.guest.disk)
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    with Libvirt() as lv, DbGuest(opts.guest, lv.conn) as guest:
        return run_on_guest(guest, opts, on_window=on_window)


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
