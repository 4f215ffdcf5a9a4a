"""One run, end to end: densevm contained and booted, warmed up, measured, modeled.

Phases: disk microbenchmark -> cgroup -> densevm boot -> calibration (runs out
of core by construction, or hibernating idle VMs) -> touch (one request per VM)
-> settle (the pager's policy brought to its steady state) -> warm-up and
measurement (one zipfperf run). Whatever happens, densevm and zipfperf are
stopped, the cgroup is removed and the result is written: status "ok", or
"failed" with the error and everything measured until then.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import time
import traceback
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from . import calibration, diskbench
from .cgroup import Containment, memory_limit
from .config import RunConfig, binary, hibernation_flags, validate
from .densevm import (
    DenseVM,
    DenseVMArgs,
    DenseVMError,
    boot_timeout_s,
    wake_quantile_us,
    wakes_between,
)
from .disks import differences, disk_model
from .model import (
    DEFAULT_FAULT_US,
    DEFAULT_WAKE_CPU_US,
    Prediction,
    estimate_footprint,
    model_input,
    predict,
    unmodeled,
    zipf_popularity,
)
from .procs import Terminated, interrupted, stop_signals_deferred
from .progress import Reporter
from .result import RunResult, now_iso
from .touch import lru_order, touch_all
from .zipfperf import OBJECT_URI, LoadSpec, ZipfperfError, run_load

# The regime is disk-bound when, over the measurement phase, requests missed (a
# miss reads a footprint back from swap) at least once per 500 requests. On the
# modeled 7,200 RPM disk a miss costs 50-350 ms of disk against the ~35 ms of CPU
# 500 in-core requests take, so paging time exceeds the requests' CPU time; on
# --disk none a 32k demand miss's ~31 faults are a visible share of it. Misses,
# not faults: a wsswap miss is 3 faults where a demand miss is 31 (at 32k).
MISSES_PER_REQUEST_DISK_BOUND = 1 / 500
# A phase whose CPU cost per request is taken as in-core pages at most this much:
# a phase that faulted more measured the pager's CPU as well.
FAULTS_PER_REQUEST_IN_CORE = 0.05
# Calibration phase: how many resident VMs it drives and for how long.
CALIBRATION_MAX_VMS = 256
SAMPLE_INTERVAL_S = 1.0
# The settle phase after the touch: the pager's clock reaches its steady state once its
# hand has gone round the resident VMs, about k swap-ins (k: the VMs the budget holds);
# the touch leaves an LRU state instead, and with every reference bit set. With the disk
# model suspended this takes seconds; the warm-up alone managed half a turn at 32k and a
# few VMs at 4k, and measured hit ratios 2-10% under the steady state's.
SETTLE_TURNS = 1.5
SETTLE_MAX_S = 120.0
# ... and serves at least this many requests: its second half calibrates the host time per
# fault (`_measured_fault_us`), which a thousand requests leave noisy. At 100,000 VMs the
# swap-ins took 13 s, and two runs' halves of about 1,100 requests gave 280 and 329 us.
SETTLE_MIN_REQUESTS = 10_000
# ... with a request stream of its own: on the load's seed, the warm-up and measurement
# replayed the settle phase's requests, each VM asked again as many requests later as the
# settle phase served rather than at its own rate (at 100,000 VMs under --max-live the
# warm-up woke no VM for its first 3,000 requests, where a quarter of requests wake one).
SETTLE_SEED_OFFSET = 1_000_003
SETTLE_CONCURRENCY = 64
# The swap device's time per block (real I/O, also with --disk none) may move by this
# factor between the settle phase, which calibrates the host time per fault, and the
# measurement before the run warns. This host's disk drifted from 1.0 to 1.6-8 ms a block
# within one 100,000-VM measurement (docs/host-facts.md, "The swap disk's speed drifts").
SWAP_IO_DRIFT = 1.5
# How the warning of a window measured before the closed loop's steady state begins.
UNSTEADY_WINDOW = "a miss waits about "
# The stats totals the measurement is computed from (INTERFACES.md, densevm control API).
CONTRACT_TOTALS = (
    "requests",
    "resident_bytes",
    "budget_bytes",
    "faults",
    "swap_read_bytes",
    "swap_write_bytes",
    "io_seconds",
)


@dataclass(frozen=True)
class Binaries:
    densevm: Path
    zipfperf: Path

    @classmethod
    def find(cls) -> Binaries:
        """Both binaries, or ConfigError before anything starts."""
        return cls(binary("densevm"), binary("zipfperf"))


def new_run_id(cfg: RunConfig) -> str:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{cfg.vms}vm-{cfg.block}-{cfg.policy}-{os.getpid()}"


def classify(requests: int, swap_read_bytes: int, footprint_bytes: int) -> str:
    """The measured regime, defined in RESULTS.md: misses (footprints read back) per request."""
    misses = swap_read_bytes / footprint_bytes
    if swap_read_bytes > 0 and misses >= MISSES_PER_REQUEST_DISK_BOUND * max(requests, 1):
        return "disk-bound"
    return "in-core"


def hot_footprint(vms: list[dict]) -> int | None:
    """The per-VM footprint: the mean size of the VMs whose size is within 10% of the most
    common one, among the sizes of the VMs that hold at least half of the 90th-percentile size.

    Most VMs that are resident hold exactly what a request touches. The rest
    are noise to leave out: evicted VMs keep the couple of blocks the monitor
    touches when a connection arrives, some are caught part way through paging
    in, and in core a few busy VMs hold extra connection state they touched
    once (the largest sizes are no guide: they made the model see 204 VMs fit
    where 264 did). The busiest VMs are no guide out of core either: they too
    are evicted and paged back in. The mean, not the most common size: the
    budget over it is how many VMs fit, and near the cliff that decides the
    throughput (Fig 8's wsswap at 1,100 VMs: 720 VMs held 32 blocks and 286 held
    31; 32 blocks made 1,024 VMs fit where 1,032 did).
    """
    sizes = sorted(
        v["resident_bytes"] for v in vms if v.get("requests", 0) > 0 and v.get("resident_bytes")
    )
    if not sizes:
        return None
    floor = 0.5 * sizes[int(0.9 * (len(sizes) - 1))]
    counts = Counter(s for s in sizes if s >= floor)
    mode = max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]
    return round(statistics.fmean(s for s in sizes if abs(s - mode) <= 0.1 * mode))


def resident_mass(vms: list[dict], footprint: int, alpha: float) -> float:
    """The share of Zipf(alpha) requests (VM i has rank i) that go to VMs wholly resident now."""
    p = zipf_popularity(len(vms), alpha)
    return float(
        sum(
            p[v["id"]]
            for v in vms
            if v.get("resident_bytes", 0) >= 0.75 * footprint and v["id"] < len(p)
        )
    )


class Sampler:
    """densevm totals about once a second, tagged by phase: the run's time series (with
    hibernation, also the VMs asleep and awake, its counters and the wake-latency histogram)."""

    KEYS = (
        "requests",
        "faults",
        "resident_bytes",
        "swap_read_bytes",
        "swap_write_bytes",
        "io_seconds",
    )
    # The modeled drives' counters (totals.disk_usage), sampled as disk_<name>.
    DISK_KEYS = ("busy_seconds", "requests", "positioned", "positioning_seconds")
    # Hibernation's (--idle-after): VMs asleep and awake ("running") now, and its counters.
    HIBERNATION_KEYS = (
        "hibernated",
        "running",
        "hibernations",
        "wakes",
        "wake_failures",
        "clones_started",
    )

    def __init__(self, dvm: DenseVM, samples: list, hibernation: bool = False) -> None:
        self.dvm, self.samples, self.t0, self.last = dvm, samples, time.monotonic(), -1e9
        self.hibernation = hibernation

    def sample(self, phase: str) -> dict:
        asked = time.monotonic()
        totals = self.dvm.totals()
        now = time.monotonic()
        # A busy densevm can take seconds to answer: date the figures mid-call, keep the delay.
        usage = totals.get("disk_usage") or {}
        row = {
            "t": round((asked + now) / 2 - self.t0, 3),
            "stats_s": round(now - asked, 3),
            "phase": phase,
            **{k: totals.get(k, 0) for k in self.KEYS},
            **{f"disk_{k}": usage.get(k, 0) for k in self.DISK_KEYS},
        }
        if self.hibernation:
            row.update({k: totals.get(k, 0) for k in self.HIBERNATION_KEYS})
            row["wake_us"] = totals.get("wake_us") or []
        self.samples.append(row)
        self.last = now
        return row

    def maybe(self, phase: str) -> None:
        if time.monotonic() - self.last >= SAMPLE_INTERVAL_S:
            self.sample(phase)

    def late_rows(self, phase: str) -> tuple[dict, dict] | None:
        """The samples that bound the second half of a phase, or None."""
        at = [i for i, r in enumerate(self.samples) if r["phase"] == phase]
        if not at:
            return None
        # The sample that ends a phase is the next phase's first (warm-up -> measurement).
        rows = self.samples[at[0] : at[-1] + 2]
        while len(rows) > 1 and rows[-1]["requests"] == rows[-2]["requests"]:
            rows.pop()  # samples after the load stopped
        if len(rows) < 3:
            return None
        return rows[len(rows) // 2], rows[-1]

    def late_window(self, phase: str) -> Window | None:
        """Requests and paging over the second half of a phase, or None."""
        bounds = self.late_rows(phase)
        if bounds is None:
            return None
        first, last = bounds
        dt, dreq = last["t"] - first["t"], last["requests"] - first["requests"]
        if dt <= 0 or dreq <= 0:
            return None
        return Window(
            dreq / dt,
            (last["faults"] - first["faults"]) / dreq,
            last["swap_read_bytes"] - first["swap_read_bytes"],
            (last.get("wakes", 0) - first.get("wakes", 0)) / dreq,
        )


@dataclass(frozen=True)
class Window:
    """The late half of a phase (Sampler.late_window)."""

    rps: float
    faults_per_request: float
    swap_read_bytes: int
    wakes_per_request: float = 0.0  # with hibernation: hibernated VMs woken per request

    @property
    def in_core(self) -> bool:
        """Its throughput measured the in-core CPU cost: nothing came back from swap (on a
        modeled disk even a few misses per thousand requests bound it) and few faults."""
        return self.swap_read_bytes == 0 and self.faults_per_request < FAULTS_PER_REQUEST_IN_CORE


def host_us_per_fault(window: Window, cpu_us: float) -> float | None:
    """What a busy window's second left after its requests (`cpu_us` each) and wakes (the
    model's wake CPU each), shared by its faults; None without faults or time left."""
    if window.faults_per_request <= 0:
        return None
    per_request_us = cpu_us + window.wakes_per_request * DEFAULT_WAKE_CPU_US
    spare = 1.0 - window.rps * per_request_us * 1e-6
    return spare / (window.rps * window.faults_per_request) * 1e6 if spare > 0 else None


@dataclass(frozen=True)
class HibernationWindow:
    """Hibernation over the measurement window (--idle-after; RESULTS.md)."""

    hibernated: int  # VMs asleep at its end
    live: int  # VMs awake at its end
    wakes: int
    hibernations: int
    wake_failures: int
    wake_fraction: float | None  # wakes per request served: the model's wake_fraction
    wake_us_p50: int | None  # of the window's wakes, in densevm (within 1%)
    wake_us_p99: int | None
    clones_started: int  # VMs started as clones of the template by its end (0 without --clone-boot)


def hibernation_window(before: dict, after: dict, requests: int) -> HibernationWindow:
    """Hibernation between two Sampler rows: counts at `after`, counters and wake latencies
    over the window (the difference of densevm's cumulative histograms)."""
    wakes = after["wakes"] - before["wakes"]
    histogram = wakes_between(before["wake_us"], after["wake_us"])
    return HibernationWindow(
        hibernated=after["hibernated"],
        live=after["running"],
        wakes=wakes,
        hibernations=after["hibernations"] - before["hibernations"],
        wake_failures=after["wake_failures"] - before["wake_failures"],
        wake_fraction=wakes / requests if requests > 0 else None,
        wake_us_p50=wake_quantile_us(histogram, 0.5),
        wake_us_p99=wake_quantile_us(histogram, 0.99),
        clones_started=after["clones_started"],
    )


def swap_io_us_per_block(first: dict, last: dict, block_bytes: int) -> float | None:
    """The swap device's time per block moved between two Sampler rows: densevm's I/O seconds
    over the blocks read and written, µs; None without swap traffic."""
    moved = sum(last[k] - first[k] for k in ("swap_read_bytes", "swap_write_bytes"))
    if moved <= 0:
        return None
    return (last["io_seconds"] - first["io_seconds"]) / (moved / block_bytes) * 1e6


def drive_usage(delta: dict, wall: float) -> dict:
    """The modeled drives over a window: how busy the busiest was, and what a positioning cost.

    Beside the model's miss cost this tells a drive that idles (the pager did not
    keep it fed) from one that worked harder per miss than the model charges.
    """
    if wall <= 0 or delta["requests"] <= 0:
        return {}
    positioned = delta["positioned"]
    return {
        "utilization": delta["busy_seconds"] / wall,
        "requests": delta["requests"],
        "positioned": positioned,
        "positioning_ms": 1e3 * delta["positioning_seconds"] / positioned if positioned else 0.0,
    }


def summarize_load(doc: dict) -> dict:
    """The part of a zipfperf document worth keeping per phase."""
    return {
        k: doc.get(k)
        for k in ("duration_s", "connections", "requests", "replies", "latency_ms", "errors")
    }


class Run:
    """One run of the main job; `execute()` returns its result (also written to disk)."""

    def __init__(self, cfg: RunConfig, bins: Binaries, reporter: Reporter | None = None) -> None:
        self.cfg, self.bins = cfg, bins
        self.reporter = reporter or Reporter()
        self.run_id = new_run_id(cfg)
        self.out = Path(cfg.out) if cfg.out else Path.cwd() / "runs" / self.run_id
        self.result = RunResult(self.run_id, cfg.as_dict())
        self.load = LoadSpec(
            targets=cfg.vms,
            addr_base=cfg.addr_base,
            port=cfg.port,
            alpha=cfg.alpha,
            seed=cfg.seed,
            duration_s=cfg.duration,
            concurrency=cfg.concurrency,
            calls_per_conn=cfg.calls_per_conn,
            uri=OBJECT_URI[cfg.object],
            timeout_s=cfg.timeout,
        )
        self.dvm: DenseVM | None = None
        self.containment: Containment | None = None
        self.sampler: Sampler | None = None
        self.calibration: dict | None = None
        self._boot_started: float | None = None

    # -- top level ---------------------------------------------------------

    def execute(self) -> RunResult:
        self.out.mkdir(parents=True, exist_ok=True)
        r = self.result
        try:
            with ExitStack() as stack:
                self._run(stack)
            r.status = "ok"
        except (KeyboardInterrupt, Terminated) as e:
            r.fail(interrupted(e))
            with stop_signals_deferred():
                self._finish()
            raise
        except (DenseVMError, ZipfperfError) as e:
            r.fail(self._explain(str(e)))
        except Exception as e:  # noqa: BLE001 - any failure (db guests, this code) is a failed result
            (self.out / "scalebench-traceback.txt").write_text(traceback.format_exc())
            r.fail(f"{type(e).__name__}: {e}")
        self._finish()
        return r

    def _explain(self, message: str) -> str:
        """Add the cgroup's verdict when the memory limit is what killed densevm."""
        stats = self.result.containment.get("memory", {})
        if stats.get("oom_kills"):
            limit = self.containment.limit_bytes
            return f"{message} (the memory cgroup limit of {limit} bytes was hit)"
        return message

    def _finish(self) -> None:
        from .plots import run_plot  # matplotlib is slow to import; only needed here

        r = self.result
        r.finished_at = now_iso()
        path = self.out / "result.json"
        r.files.update(result=str(path), out=str(self.out))
        try:
            if r.timeseries:
                plot = self.out / "run.png"
                run_plot(r, plot)
                r.files["plot"] = str(plot)
        except Exception as e:  # noqa: BLE001 - a plot must not lose the result
            r.files["plot_error"] = str(e)
        r.write(path)
        if self.cfg.json:
            r.write(Path(self.cfg.json))

    def _run(self, stack: ExitStack) -> None:
        cfg, r = self.cfg, self.result
        bench = self._start(stack)
        if cfg.db_guests:
            from .db.alongside import db_guests  # libvirt is only needed with --db-guests

            guests = db_guests(cfg.db_guests, cfg.db_workload, cfg.db_mix, self.out / "db")
            stack.callback(lambda: setattr(r, "db", list(getattr(guests, "results", []) or [])))
            stack.enter_context(guests)

        # Out of core the warm-up pages; with hibernation it wakes VMs, whose working sets come
        # back from swap: either way it cannot measure the in-core cost.
        if cfg.cpu_us is None and (
            cfg.vms * estimate_footprint(cfg.ws_bytes, cfg.block_bytes) > cfg.mem_bytes
            or cfg.idle_after is not None
        ):
            with self._timed("calibrate"):
                self._calibrate_before_touch()
        if cfg.touch:
            self._touch()
        # Warm-up and measurement are one zipfperf run, split by densevm's counters:
        # restarting zipfperf would abandon the warm-up's requests stuck on cold VMs,
        # whose paging then goes on while the new run's free slots race through hits.
        with self._timed("load"):
            doc = self._phase(
                "load",
                replace(self.load, duration_s=cfg.warmup + cfg.duration),
                measure_from=cfg.warmup,
            )
        stats = self.dvm.stats()  # per-VM state at the end of the measurement
        window = [row for row in r.timeseries if row["phase"] == "measure"]
        self._record_measurement(doc, window[0], window[-1], stats)
        cpu_us, source = self._cpu_us()
        fault_us, fault_source = self._fault_us(cpu_us)
        r.calibration = {
            "cpu_us": cpu_us,
            "source": source,
            "fault_us": fault_us,
            "fault_source": fault_source,
        }
        self._check_swap_io(window[0], window[-1])
        if cpu_us is None:
            r.model = {"error": f"no in-core CPU cost: {source}"}
            r.warnings.append(r.model["error"])
        else:
            self._record_model(cpu_us, bench)

    def _start(self, stack: ExitStack) -> diskbench.DiskBench:
        """Disk microbenchmark, cgroup, densevm booted inside it; teardown registered on `stack`."""
        cfg, r = self.cfg, self.result
        _raise_fd_limit()
        fp_est = estimate_footprint(cfg.ws_bytes, cfg.block_bytes)
        swap = self.out / "swap.img"
        stack.callback(swap.unlink, missing_ok=True)
        self.reporter.note(f"run {self.run_id}: results in {self.out}")
        bench = diskbench.measure(self.out, cfg.block_bytes, fp_est)
        r.diskbench = bench.as_dict()

        self.containment = Containment.create(
            self.run_id, memory_limit(cfg.mem_bytes, cfg.vms, cfg.max_live)
        )
        stack.callback(self._release_containment)
        r.containment = self.containment.describe()
        if self.containment.warning:
            self.reporter.note(f"[yellow]warning:[/] {self.containment.warning}")
        r.psi["before"] = self.containment.pressure()

        api = self.out / "densevm.sock"
        api.unlink(
            missing_ok=True
        )  # left by an earlier attempt at this point: densevm could not bind it
        args = DenseVMArgs(
            vms=cfg.vms,
            addr_base=cfg.addr_base,
            port=cfg.port,
            ws=cfg.ws,
            mem=cfg.mem,
            block=cfg.block,
            policy=cfg.policy,
            disk=cfg.disk,
            swap=swap,
            api=api,
            extra=hibernation_flags(cfg),
        )
        self._boot_started = time.monotonic()
        self.dvm = DenseVM(
            self.bins.densevm, args, self.out / "densevm.log", wrap=self.containment.wrap
        )
        stack.callback(self.dvm.stop)
        with self.reporter.phase("boot", cfg.vms, "VMs") as update:
            ready = self.dvm.wait_ready(boot_timeout_s(cfg.vms), update)
        r.boot_seconds = ready.get("boot_seconds")
        r.phases["boot"] = ready
        self._check_pager()
        self.sampler = Sampler(self.dvm, r.timeseries, hibernation=cfg.idle_after is not None)
        r.timeline.append(
            {"phase": "boot", "from_s": round(self._boot_started - self.sampler.t0, 3), "to_s": 0.0}
        )
        self.sampler.sample("boot")
        return bench

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Record where `phase` starts and ends on the time series' clock (result.timeline),
        also when it fails part way."""
        entry = {"phase": phase, "from_s": self._clock(), "to_s": None}
        self.result.timeline.append(entry)
        try:
            yield
        finally:
            entry["to_s"] = self._clock()

    def _clock(self) -> float:
        return round(time.monotonic() - self.sampler.t0, 3)

    def _check_pager(self) -> None:
        """Record the pager's settings; warn if its disk model is not the one the model charges."""
        r = self.result
        try:
            r.pager = self.dvm.pager()
        except (
            DenseVMError
        ) as e:  # informational: a monitor without the request can still be measured
            self._alive()
            r.pager = {"error": str(e)}
        pager_disk = (r.pager.get("pager") or {}).get("disk")
        diff = differences(disk_model(self.cfg.disk), pager_disk) if pager_disk else []
        if diff:
            r.warnings.append(
                f"the pager's disk model differs from the performance model's "
                f"(disks.py): {'; '.join(diff)}"
            )

    # -- phases --------------------------------------------------------------

    def _alive(self) -> None:
        why = self.dvm.failure()
        if why:
            raise DenseVMError(why)

    def _phase(self, name: str, spec: LoadSpec, measure_from: float | None = None) -> dict:
        """One zipfperf run, with densevm sampled at its start, about every second, and its end.

        With measure_from, the samples are tagged "warmup" until that many seconds
        into the run and "measure" from then on (a sample is taken at the switch).
        """
        tag = name if measure_from is None else "warmup"
        self.sampler.sample(tag)
        with self.reporter.phase(name, spec.duration_s, "s") as update:

            def tick(elapsed: float) -> None:
                nonlocal tag
                update(elapsed)
                if tag == "warmup" and elapsed >= measure_from:
                    tag = "measure"
                    self.sampler.sample(tag)
                self.sampler.maybe(tag)

            doc = run_load(self.bins.zipfperf, spec, self.out, name, tick=tick, alive=self._alive)
        self.sampler.sample(tag)
        self.result.phases[name] = summarize_load(doc)
        return doc

    def _touch(self) -> None:
        """One request to every VM (see touch.py), with progress and densevm watched.

        The disk model is suspended meanwhile: the touch is there for the state it
        leaves (every working set made, the LRU order set, the same swap layout),
        which does not depend on how long the swap I/O took; at 4,000 VMs on the
        modeled 7,200 RPM disk it took 6 minutes, against seconds without the model.
        """
        self.sampler.sample("touch")
        self.dvm.set_disk_modeled(False)
        try:
            with self._timed("touch"):
                self._touch_all()
            self._settle()
        finally:
            if self.dvm.failure() is None:
                self.dvm.set_disk_modeled(True)

    def _touch_all(self) -> None:
        cfg = self.cfg
        with self.reporter.phase("touch", cfg.vms, "VMs") as update:

            def progress(done: int) -> None:
                update(done)
                self._alive()
                self.sampler.maybe("touch")

            order = lru_order(cfg.vms, cfg.alpha, cfg.seed)
            failed = touch_all(
                cfg.addr_base, cfg.port, order, min(cfg.concurrency, 64), cfg.timeout, progress
            )
        self.sampler.sample("touch")
        self._alive()
        if failed:
            self.result.warnings.append(
                f"{len(failed)} VM(s) did not answer the touch request "
                f"(first: {', '.join(map(str, failed[:5]))})"
            )

    def _settle(self) -> None:
        """Zipf load until the pager has swapped in SETTLE_TURNS times the VMs the budget holds
        and SETTLE_MIN_REQUESTS were served (at most SETTLE_MAX_S): its policy then starts the
        warm-up in its own steady state."""
        cfg = self.cfg
        footprint = estimate_footprint(cfg.ws_bytes, cfg.block_bytes)
        fit = cfg.mem_bytes // footprint
        if cfg.vms <= fit:
            return  # everything fits: nothing is ever evicted
        with self._timed("settle"):
            self._settle_to(footprint, int(SETTLE_TURNS * fit))

    def _settle_to(self, footprint: int, target: int) -> None:
        cfg = self.cfg
        first = self.sampler.sample("settle")

        def swapped_in():
            return int(
                (self.sampler.samples[-1]["swap_read_bytes"] - first["swap_read_bytes"]) / footprint
            )

        def served():
            return self.sampler.samples[-1]["requests"] - first["requests"]

        spec = replace(
            self.load,
            duration_s=SETTLE_MAX_S,
            concurrency=max(cfg.concurrency, SETTLE_CONCURRENCY),
            seed=cfg.seed + SETTLE_SEED_OFFSET,
        )
        with self.reporter.phase("settle", target, "swap-ins") as update:

            def tick(_elapsed: float) -> None:
                self.sampler.maybe("settle")
                # Both ends count: the bar fills as the slower of the two does.
                requests_done = target * served() // SETTLE_MIN_REQUESTS
                update(min(swapped_in(), requests_done, target))

            doc = run_load(
                self.bins.zipfperf,
                spec,
                self.out,
                "settle",
                tick=tick,
                alive=self._alive,
                until=lambda: swapped_in() >= target and served() >= SETTLE_MIN_REQUESTS,
            )
        self.sampler.sample("settle")
        done = swapped_in()
        self.result.phases["settle"] = {**summarize_load(doc), "swap_ins": done, "target": target}
        if done < target:
            self.result.warnings.append(
                f"the settle phase swapped in {done} VMs in {SETTLE_MAX_S:.0f} s, not "
                f"{target}: the pager's policy may start the warm-up short of its "
                f"steady state"
            )

    def _calibrate_before_touch(self) -> None:
        """The calibration phase of a run that is out of core by construction, or whose
        warm-up wakes hibernated VMs: the in-core CPU cost per request, measured while memory
        still has room, on no more VMs than --max-live keeps awake.

        Right after boot every VM holds only what booting touched, so a window of
        VMs whose working sets fit in a quarter of the budget serves in core, with
        no eviction; the touch that follows sets the steady state whatever the
        window did. Measured after the run instead, among thousands of paging VMs,
        busy VMs touch connection state beyond their footprint, every such fault
        waits for an eviction, and the phase measured many times the in-core cost
        (docs/measurements/2026-11-27.md#controller).
        """
        cfg = self.cfg
        width = max(
            1,
            min(
                cfg.vms,
                CALIBRATION_MAX_VMS,
                cfg.mem_bytes // estimate_footprint(cfg.ws_bytes, cfg.block_bytes) // 4,
                self._awake_in_first_cell(),
            ),
        )
        # The window's VMs make their working sets first (zero-fill faults, no eviction), so
        # the phase is in core however slowly a loaded host serves those first requests.
        touch_all(
            cfg.addr_base,
            cfg.port,
            range(width),
            min(cfg.concurrency, 64),
            cfg.timeout,
            lambda done: self._alive(),
        )
        self._phase("calibrate", self.load.window(0, width, 0.0, cfg.calibration_s))
        window = self.sampler.late_window("calibrate")
        if window is None:
            raise DenseVMError("the calibration phase served no requests")
        self.calibration = {
            "cpu_us": 1e6 / window.rps,
            "source": f"calibration phase ({width} VMs, before the touch)",
            "faults_per_request": window.faults_per_request,
            "paged": not window.in_core,
        }
        if not self.calibration["paged"]:
            calibration.store_cpu_us(
                cfg.object, self.calibration["cpu_us"], width, "calibration phase"
            )
        else:
            self.result.warnings.append(
                f"the calibration phase paged ({window.faults_per_request:.2f} faults per request, "
                f"{window.swap_read_bytes} bytes from swap): "
                "its CPU cost is an overestimate and was not stored"
            )

    def _awake_in_first_cell(self) -> int:
        """The VMs --max-live keeps awake in the cell that holds VM 0 (all VMs without a cap).

        The calibration window's VMs share the first cell (cells hold consecutive VMs). Until
        densevm's first cut over all cells, the cell's even share of the cap is its cap; then
        the window's VMs are the host's most recently used, which the cut keeps awake. More of
        them than the share would wake one another at the start of the phase."""
        cfg = self.cfg
        if cfg.max_live is None:
            return cfg.vms
        cells = int(self.result.phases.get("boot", {}).get("cells", 1))
        return max(1, cfg.max_live // max(cells, 1))

    def _cpu_us(self) -> tuple[float | None, str]:
        """In-core CPU microseconds per request: --cpu-us, an in-core warm-up, this run's
        calibration phase, the host's stored calibration, or (an overestimate) this run's
        calibration phase that paged, in that order (calibration.cpu_us)."""
        cfg, cal = self.cfg, self.calibration
        fallback = calibration.NO_CPU_US
        if cal and cal["paged"]:
            fallback = cal["cpu_us"], cal["source"] + ", paged: an overestimate"
        return calibration.cpu_us(cfg.cpu_us, cfg.object, self._measured_cpu_us(), fallback)

    def _measured_cpu_us(self) -> Iterator[tuple[float | None, str]]:
        """This run's in-core CPU costs, best first; the warm-up's is stored when it is taken."""
        cfg = self.cfg
        window = self.sampler.late_window("warmup")
        if window and window.in_core:
            cpu_us = 1e6 / window.rps
            calibration.store_cpu_us(cfg.object, cpu_us, cfg.vms, "warm-up")
            yield cpu_us, "warm-up"
        if self.calibration and not self.calibration["paged"]:
            yield self.calibration["cpu_us"], self.calibration["source"]

    def _fault_us(self, cpu_us: float | None) -> tuple[float, str]:
        """Host microseconds per pager fault: --fault-us, this run's settle phase, the host's
        stored calibration, or the default, in that order (calibration.fault_us)."""
        cfg = self.cfg
        fault_us, source = calibration.fault_us(
            cfg.fault_us, cfg.block_bytes, self._measured_fault_us(cpu_us)
        )
        assert fault_us is not None  # the default has a value
        return fault_us, source

    def _measured_fault_us(self, cpu_us: float | None) -> Iterator[tuple[float | None, str]]:
        """The settle phase's host time per fault, stored when it is taken.

        The settle phase pages with the disk model off and enough requests in flight to keep
        the host busy, so its second half spends the host's time on requests, faults and (with
        hibernation) wakes alone: 1 s = requests/s x cpu_us + faults/s x fault_us + wakes/s x
        the model's wake CPU. That is what bounds throughput with --disk none, and the CPU side
        of a modeled disk's misses. The model charges wakes apart (its wake term), so their
        CPU is taken out here rather than counted twice.
        """
        cfg = self.cfg
        window = self.sampler.late_window("settle")
        fault_us = host_us_per_fault(window, cpu_us) if window and cpu_us is not None else None
        if window and fault_us is not None:
            calibration.store_fault_us(cfg.block_bytes, fault_us, cfg.vms, "settle phase")
            faults_s = window.rps * window.faults_per_request
            yield fault_us, f"settle phase ({faults_s:,.0f} faults/s, disk model off)"

    # -- results ---------------------------------------------------------------

    def _record_measurement(self, doc: dict, before: dict, after: dict, stats: dict) -> None:
        """Throughput and paging from densevm's counters over the measurement window;
        latency and errors from zipfperf (its whole run, warm-up included)."""
        r, totals = self.result, stats["totals"]
        wall = after["t"] - before["t"]
        missing = [k for k in CONTRACT_TOTALS if k not in totals]
        if missing:
            r.warnings.append(
                f"densevm's stats lack {', '.join(missing)} (INTERFACES.md): "
                "paging figures are zero and the regime is unreliable"
            )
        d = {k: after[k] - before[k] for k in Sampler.KEYS if k != "resident_bytes"}
        replies = doc.get("replies", {})
        r.throughput_rps = d["requests"] / wall if wall > 0 else None
        r.client_rps = replies.get("rate")
        r.replies = replies.get("total")
        r.duration_s = wall
        r.latency_ms = doc.get("latency_ms", {})
        r.error_detail = doc.get("errors", {})
        r.errors = r.error_detail.get("total")
        r.resident_bytes = totals.get("resident_bytes")
        r.budget_bytes = totals.get("budget_bytes")
        r.swap_used_bytes = totals.get("swap_used_bytes")
        if r.swap_used_bytes is not None and totals.get("vms"):
            r.swap_bytes_per_vm = r.swap_used_bytes / totals["vms"]
        r.faults = d["faults"]
        r.faults_per_s = d["faults"] / wall
        r.swap_read_bytes, r.swap_write_bytes = d["swap_read_bytes"], d["swap_write_bytes"]
        r.swap_read_mbps = d["swap_read_bytes"] / wall / 1e6
        r.swap_write_mbps = d["swap_write_bytes"] / wall / 1e6
        r.disk_busy = d["io_seconds"] / wall
        r.drive = drive_usage(
            {k: after[f"disk_{k}"] - before[f"disk_{k}"] for k in Sampler.DISK_KEYS}, wall
        )
        r.fault_latency_us = totals.get("fault_latency_us", {})
        r.footprint_bytes = hot_footprint(stats.get("vms", []))
        if r.footprint_bytes and d["requests"] > 0:
            # Each miss reads the whole footprint back (demand block by block, wsswap at once).
            r.hit_ratio = max(0.0, 1.0 - d["swap_read_bytes"] / r.footprint_bytes / d["requests"])
            r.resident_mass = resident_mass(stats.get("vms", []), r.footprint_bytes, self.cfg.alpha)
        r.regime = classify(d["requests"], d["swap_read_bytes"], footprint_of(r, self.cfg))
        connections = (doc.get("connections") or {}).get("total") or 0
        if self.cfg.calls_per_conn == 1 and r.replies and connections < 0.9 * r.replies:
            # Each connection is bound to one VM: Zipf then chose VMs per connection,
            # not per request.
            r.warnings.append(
                f"zipfperf reused connections ({connections} connections for {r.replies} replies): "
                "VMs were drawn per connection, not per request"
            )
        r.phases["measure"] = {"from_s": before["t"], "to_s": after["t"], "requests": d["requests"]}
        if self.cfg.idle_after is not None:
            for name, value in asdict(hibernation_window(before, after, d["requests"])).items():
                setattr(r, name, value)

    def _check_swap_io(self, before: dict, after: dict) -> None:
        """Records the swap device's time per block in the settle phase's second half and in
        the measurement, and warns when the host time per fault was calibrated in the former
        and the device moved by more than SWAP_IO_DRIFT between them: the model's fault cost
        then no longer describes the measurement (measured/model reads off by the drift).
        Only with --disk none: a modeled disk's service time counts in the measurement and
        not in the settle phase, which runs with the model suspended."""
        r, block = self.result, self.cfg.block_bytes
        settle = self.sampler.late_rows("settle")
        r.swap_io_us_per_block = {
            "settle": settle and swap_io_us_per_block(*settle, block),
            "measure": swap_io_us_per_block(before, after, block),
        }
        then, now = r.swap_io_us_per_block["settle"], r.swap_io_us_per_block["measure"]
        calibrated = r.calibration["fault_source"].startswith("settle phase")
        real_disk_only = disk_model(self.cfg.disk).drive is None
        drifted = then and now and max(now / then, then / now) > SWAP_IO_DRIFT
        if calibrated and real_disk_only and drifted:
            r.warnings.append(
                f"the swap device's time a block went from {then / 1e3:.2f} ms in the settle "
                f"phase to {now / 1e3:.2f} ms in the measurement (x{now / then:.2f}): the "
                "host time per fault was calibrated before it moved, so measured/model "
                "reflects the host's disk as much as the model"
            )

    def _record_model(self, cpu_us: float, bench: diskbench.DiskBench) -> None:
        apply_model(self.result, self.cfg, cpu_us, bench)

    def _release_containment(self) -> None:
        """Record PSI and the memory group's counters, then remove the groups, killing what
        outlived densevm; a second stop signal waits, or the groups would be left behind."""
        with stop_signals_deferred():
            self._remove_containment()

    def _remove_containment(self) -> None:
        c, r = self.containment, self.result
        r.psi["after"] = c.pressure()
        if r.psi.get("before") and r.psi.get("after"):
            r.psi["delta_total_us"] = {
                kind: r.psi["after"][kind]["total"] - r.psi["before"][kind]["total"]
                for kind in r.psi["after"]
            }
        r.containment["memory"] = c.memory_stats()
        stayed = c.remove()
        if stayed:
            r.warnings.append(stayed)


def footprint_of(r: RunResult, cfg: RunConfig) -> int:
    """The footprint the run measured, else the estimate from the guest's layout."""
    return r.footprint_bytes or estimate_footprint(cfg.ws_bytes, cfg.block_bytes)


def apply_model(r: RunResult, cfg: RunConfig, cpu_us: float, bench: diskbench.DiskBench) -> None:
    """The model's prediction for a measured run, from what the run recorded, into `r`."""
    error = unmodeled(cfg.policy)
    if error:
        r.model = {"error": error}
        return
    p = predict(
        model_input(
            cfg,
            footprint_of(r, cfg),
            cpu_us,
            recorded_fault_us(r, cfg),
            bench,
            swap_bytes=(r.pager.get("pager") or {}).get("swap_bytes"),
        )
    )
    r.model = p.as_dict()
    r.model["footprint_source"] = "measured" if r.footprint_bytes else "estimated"
    r.model["steady_window"] = p.regime == "in-core" or p.miss_wait_s <= cfg.warmup
    r.model_rps = p.model_rps
    if r.throughput_rps is not None and p.model_rps > 0:
        r.measured_over_model = r.throughput_rps / p.model_rps
    # A remodeled run keeps no verdict of the model it had before.
    r.warnings = [w for w in r.warnings if not w.startswith(UNSTEADY_WINDOW)]
    if not r.model["steady_window"]:
        r.warnings.append(unsteady_window(p, cfg))


def unsteady_window(p: Prediction, cfg: RunConfig) -> str:
    """Why a disk-bound run's window did not measure the steady state the model predicts:
    its warm-up was shorter than the time a miss waits (model.py, W). Starts with
    UNSTEADY_WINDOW."""
    timeout = (
        f"; past the {cfg.timeout:g} s --timeout, the steady state's misses would time out"
        if p.miss_wait_s > cfg.timeout
        else ""
    )
    return (
        f"{UNSTEADY_WINDOW}{p.miss_wait_s:.0f} s in the steady state ({cfg.concurrency} "
        f"requests in flight, {p.miss_s:.2f} s of swap I/O a miss), longer than the "
        f"{cfg.warmup:g} s warm-up: the window measured the closed loop filling with misses, "
        f"not the steady state the model predicts (warm up for longer, or put fewer requests "
        f"in flight){timeout}"
    )


def recorded_fault_us(r: RunResult, cfg: RunConfig) -> float:
    """The host time per fault a run's model uses: its calibration (runs before it was
    calibrated recorded none), else the configuration's, else the default."""
    for value in ((r.calibration or {}).get("fault_us"), cfg.fault_us):
        if value is not None:
            return value
    return DEFAULT_FAULT_US


def remodel(path: Path) -> RunResult | None:
    """Re-evaluate the model and the regime of the run stored at `path` (result.json) with
    this version of them, from the inputs and counters the run recorded; rewrite it. None if
    it has no model to redo (a failed run, or one that never had an in-core CPU cost)."""
    r = RunResult(**json.loads(path.read_text()))
    cpu_us = (r.calibration or {}).get("cpu_us")
    if r.status != "ok" or cpu_us is None or not r.diskbench:
        return None
    cfg = RunConfig(**{k: v for k, v in r.config.items() if k in RunConfig.field_names()})
    before = r.model_rps
    requests = (r.phases.get("measure") or {}).get("requests")
    if requests is not None and r.swap_read_bytes is not None:
        r.regime = classify(requests, r.swap_read_bytes, footprint_of(r, cfg))
    apply_model(r, cfg, cpu_us, diskbench.DiskBench(**r.diskbench))
    r.model["remodeled"] = {"at": now_iso(), "model_rps_before": before}
    r.write(path)
    return r


def _raise_fd_limit() -> None:
    """densevm needs 4 descriptors per VM: give children the hard limit as their soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def run(
    cfg: RunConfig, reporter: Reporter | None = None, bins: Binaries | None = None
) -> RunResult:
    """Library entry: one configuration, one result. It is validated (again) here, which
    also resolves its defaults, so a sweep's point runs as `scalebench` would run it."""
    return Run(validate(cfg), bins or Binaries.find(), reporter).execute()
