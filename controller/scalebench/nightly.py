"""`scalebench nightly`: scaling regressions found in a history of noisy measurements.

The probes and metrics are experiments/nightly/metrics.toml. Every probe runs once per round,
rounds interleaved (and, with a comparison build, the two builds alternate which goes first).
Each metric's samples give its median and bootstrap confidence interval; the run is appended to
the history (SQLite, history.py) and E-Divisive looks for a change point on the newest run
(changepoint.py). A suspected regression is measured once more (its probes only) and reported
only if the re-measurement confirms it. Exit status: 0 clean, 1 regression, 3 the host was too
busy to tell (a suspected regression measured on a busy host), 2 bad input.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import time
import tomllib
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from .changepoint import (
    NOISE_FACTOR,
    TOO_SHORT,
    Estimate,
    Finding,
    assess_host,
    estimate,
    ratio_estimate,
    run_noise,
)
from .changepoint import assess as assess_history
from .config import REPO_ROOT, ConfigError
from .diskbench import ScratchFile, random_io_rate
from .history import NOISY, History, Run, default_path
from .progress import Reporter
from .scaling import TICKS, Build, LoadTarget, NginxReference, Session, hibernated_density
from .units import parse_size

METRICS = REPO_ROOT / "experiments" / "nightly" / "metrics.toml"
ADDR_BASE = "127.90.0.0"  # away from the default, which interactive runs and other tests use
WINDOW_FIELDS = (
    "replies_per_s",
    "cpu_us_per_reply",
    "monitor_us_per_reply",
    "faults_per_s",
    "faults_per_cpu_s",
    "kernel_us_per_fault",
    "pager_kernel_us_per_fault",
)
BOOT_FIELDS = ("boot_seconds", "host_bytes_per_vm")
NGINX_FIELDS = ("replies_per_s", "cpu_us_per_reply")
DISK_FIELDS = ("ios_per_s",)
HIBERNATION_FIELDS = ("hibernated_bytes_per_vm", "wake_p99_ms")
SERVERS = {
    "densevm": WINDOW_FIELDS + BOOT_FIELDS,
    "nginx": NGINX_FIELDS,
    "disk": DISK_FIELDS,
    "hibernation": HIBERNATION_FIELDS,
}
ONCE_FIELDS = BOOT_FIELDS + HIBERNATION_FIELDS  # measured once per boot: no load windows
STEAL_LIMIT = 0.10  # steal time above this share of CPU time: the host is too busy
# Other tenants using more than this share of the host's CPU time: too busy. One busy core of
# this 2-core host (47%) cut the tiny in-core probe fivefold and went unflagged at 50%.
OTHERS_LIMIT = 0.25
EXIT_CLEAN, EXIT_REGRESSION, EXIT_NOISY = 0, 1, 3
HOST_SHARE = 0.5  # a host reference worse by this share of a suspect's change explains it,
FLAGGED_HOST_SHARE = 0.25  # or by this share when its own history flags it slower


class ProbeError(RuntimeError):
    """A probe could not be measured (densevm or zipfperf failed)."""


@dataclass(frozen=True)
class Probe:
    name: str
    vms: int = 0  # a disk probe has none
    mem: str = ""  # densevm's --mem; "": its default
    alpha: float = 1.0
    concurrency: int = 64
    warmup_s: float = 0.0
    windows: int = 0
    window_s: float = 0.0
    disk: str = "none"
    block: str = "32k"
    cell_vms: int | None = None
    # "densevm"; a host reference with no densevm in it, "nginx" or "disk"; or "hibernation",
    # densevm with --idle-after (scaling.hibernated_density)
    server: str = "densevm"
    idle_after: float = 0.5  # hibernation: densevm --idle-after
    wakes: int = 100  # hibernation: hibernated VMs woken, one GET each
    wake_rate: float = 100.0  # hibernation: wakes per second

    def serve_args(self) -> tuple[str, ...]:
        args = ("--block", self.block, "--disk", self.disk) + (
            ("--mem", self.mem) if self.mem else ()
        )
        args += ("--boot-timeout", "600")
        return args + (("--cell-vms", str(self.cell_vms)) if self.cell_vms else ())


@dataclass(frozen=True)
class Metric:
    name: str
    better: str  # "higher" or "lower"
    quick: bool = False
    probe: str | None = None
    field: str | None = None
    ratio: tuple[str, str] | None = None
    host: bool = False  # measures the host, not the build: a drop means a noisy host
    host_ref: str | None = None  # the host metric that gates this one; None: every host metric

    @property
    def higher_is_better(self) -> bool:
        return self.better == "higher"


@dataclass(frozen=True)
class Spec:
    rounds: int
    probes: dict[str, Probe]
    metrics: list[Metric]
    addr_base: str = ADDR_BASE

    def quick(self) -> Spec:
        return Spec(self.rounds, self.probes, [m for m in self.metrics if m.quick], self.addr_base)

    def probes_of(self, names: list[str]) -> list[Probe]:
        """The probes the metrics `names` read (ratios: both of theirs), in file order."""
        by_name = {m.name: m for m in self.metrics}
        wanted: set[str] = set()
        todo = list(names)
        while todo:
            m = by_name[todo.pop()]
            if m.ratio:
                todo.extend(m.ratio)
            elif m.probe:
                wanted.add(m.probe)
        return [p for name, p in self.probes.items() if name in wanted]


def load_spec(path: Path) -> Spec:
    """experiments/nightly/metrics.toml, checked; ConfigError naming the first problem."""
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read metrics file {path}: {e}") from None
    try:
        probes = {name: Probe(name, **p) for name, p in doc.get("probe", {}).items()}
        metrics = [
            Metric(**{**m, "ratio": tuple(m["ratio"]) if "ratio" in m else None})
            for m in doc.get("metrics", [])
        ]
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None
    for probe in probes.values():
        if probe.server not in SERVERS:
            raise ConfigError(
                f"{path}: probe {probe.name}: server must be one of {', '.join(SERVERS)}"
            )
        if probe.server != "disk" and probe.vms < 1:
            raise ConfigError(f"{path}: probe {probe.name} needs vms >= 1")
        if probe.server == "hibernation" and not (
            probe.idle_after > 0 and probe.wakes >= 1 and probe.wake_rate > 0
        ):
            raise ConfigError(
                f"{path}: probe {probe.name} needs idle_after > 0, wakes >= 1 and wake_rate > 0"
            )
    names: set[str] = set()
    by_name: dict[str, Metric] = {}
    for m in metrics:
        where = f"{path}: metric {m.name}"
        if m.name in names:
            raise ConfigError(f"{where} is defined twice")
        if m.better not in ("higher", "lower"):
            raise ConfigError(f"{where}: better must be 'higher' or 'lower'")
        if m.ratio:
            if len(m.ratio) != 2 or not set(m.ratio) <= names:
                raise ConfigError(f"{where}: ratio must name two metrics defined above it")
        elif m.probe not in probes:
            raise ConfigError(f"{where}: unknown probe {m.probe!r}")
        elif m.field not in SERVERS[probes[m.probe].server]:
            fields = ", ".join(SERVERS[probes[m.probe].server])
            raise ConfigError(f"{where}: probe {m.probe} measures only {fields}, not {m.field!r}")
        elif m.field not in ONCE_FIELDS and probes[m.probe].windows < 1:
            raise ConfigError(f"{where}: probe {m.probe} has no load windows")
        if m.host_ref is not None and not (m.host_ref in names and by_name[m.host_ref].host):
            raise ConfigError(f"{where}: host_ref must name a host metric defined above it")
        names.add(m.name)
        by_name[m.name] = m
    rounds = doc.get("rounds", 3)
    if not isinstance(rounds, int) or rounds < 1 or not metrics:
        raise ConfigError(f"{path}: needs rounds >= 1 and at least one metric")
    return Spec(rounds, probes, metrics, str(doc.get("addr_base", ADDR_BASE)))


def run_probe(build: Build, probe: Probe, workdir: Path, addr_base: str) -> dict[str, list[float]]:
    """One boot of `probe`: every field's values (boot fields once, window fields per window)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if probe.server == "disk":
        with ScratchFile(workdir) as scratch:
            block = parse_size(probe.block)
            return {
                "ios_per_s": [
                    random_io_rate(scratch, block, probe.window_s, seed)
                    for seed in range(probe.windows)
                ]
            }
    if probe.server == "nginx":
        with NginxReference(build, probe.vms, addr_base) as reference:
            return load_windows(reference, probe, {})
    if probe.server == "hibernation":
        return hibernation_values(build, probe, workdir, addr_base)
    with Session(build, workdir, probe.vms, addr_base, *probe.serve_args()) as session:
        boot = {
            "boot_seconds": [session.boot.boot_seconds],
            "host_bytes_per_vm": [session.boot.host_bytes_per_vm],
        }
        return load_windows(session, probe, boot)


def hibernation_values(
    build: Build, probe: Probe, workdir: Path, addr_base: str
) -> dict[str, list[float]]:
    """One boot of a hibernation probe: host memory per hibernated VM and the client's wake
    p99; RuntimeError if a VM did not answer, since a failed wake is a regression of its own."""
    d = hibernated_density(
        build,
        workdir,
        probe.vms,
        addr_base,
        probe.idle_after,
        probe.wakes,
        probe.wake_rate,
        *probe.serve_args(),
    )
    if d.failed:
        raise RuntimeError(
            f"{len(d.failed)} VM(s) did not answer a GET, first or wake "
            f"(first: {', '.join(map(str, d.failed[:5]))})"
        )
    return {
        "hibernated_bytes_per_vm": [d.hibernated_bytes_per_vm],
        "wake_p99_ms": [d.wake_p99_ms],
    }


def load_windows(
    target: LoadTarget, probe: Probe, values: dict[str, list[float]]
) -> dict[str, list[float]]:
    """`values` with the window fields of `probe`'s warm-up and windows on `target` added."""
    if probe.warmup_s > 0:
        target.load(probe.warmup_s, probe.alpha, probe.concurrency)
    for _ in range(probe.windows):
        w = target.window(probe.window_s, probe.alpha, probe.concurrency)
        for name in WINDOW_FIELDS:
            values.setdefault(name, []).append(float(getattr(w, name)))
    return values


def measure(
    spec: Spec,
    metrics: list[str],
    builds: list[Build],
    rounds: int,
    workdir: Path,
    reporter: Reporter,
) -> list[dict[str, list[float]]]:
    """Samples of `metrics` for each build: every probe once per round, builds alternating."""
    probes = spec.probes_of(metrics)
    raw: list[dict[str, dict[str, list[float]]]] = [{} for _ in builds]
    for r in range(rounds):
        order = list(range(len(builds)))
        if r % 2:
            order.reverse()
        for probe in probes:
            for b in order:
                label = "" if len(builds) == 1 else f" build {'AB'[b]}"
                reporter.note(f"round {r + 1}/{rounds}: {probe.name}{label}")
                try:
                    values = run_probe(
                        builds[b], probe, workdir / f"{probe.name}-{b}", spec.addr_base
                    )
                except (RuntimeError, OSError, subprocess.SubprocessError, KeyError) as e:
                    raise ProbeError(f"probe {probe.name}{label} failed: {e}") from None
                for name, vs in values.items():
                    raw[b].setdefault(probe.name, {}).setdefault(name, []).extend(vs)
    out: list[dict[str, list[float]]] = []
    for per_probe in raw:
        samples: dict[str, list[float]] = {}
        for m in spec.metrics:  # in file order: a ratio's parts come before it
            if m.ratio and set(m.ratio) <= samples.keys():
                num, den = samples[m.ratio[0]], samples[m.ratio[1]]
                samples[m.name] = [a / b for a, b in zip(num, den, strict=False) if b]
            elif m.probe in per_probe and m.field:
                samples[m.name] = per_probe[m.probe][m.field]
        out.append({k: v for k, v in samples.items() if k in metrics})
    return out


@dataclass
class HostNoise:
    """The host's noise indicators over a nightly run. Other tenants' share is the host's busy
    CPU time less this process's and its descendants' (densevm with its cells and holders,
    zipfperf), over the host's CPU time: the load average cannot tell them apart (a nightly's own
    load alone is above the 2 CPUs of the development host)."""

    cpus: int
    load_start: list[float]
    load_end: list[float] = field(default_factory=list)
    steal_fraction: float = 0.0
    others_fraction: float = 0.0
    cpu_mhz: float | None = None
    stat_start: tuple[int, int, int] = (0, 0, 0)
    own_start: float = 0.0

    @classmethod
    def start(cls) -> HostNoise:
        return cls(
            os.cpu_count() or 1,
            list(os.getloadavg()),
            stat_start=cpu_jiffies(),
            own_start=own_cpu(),
        )

    def finish(self) -> None:
        self.load_end = list(os.getloadavg())
        steal, busy, total = cpu_jiffies()
        d_total = (total - self.stat_start[2]) / TICKS
        if d_total > 0:
            self.steal_fraction = (steal - self.stat_start[0]) / TICKS / d_total
            others = (busy - self.stat_start[1]) / TICKS - (own_cpu() - self.own_start)
            self.others_fraction = max(others, 0.0) / d_total
        self.cpu_mhz = cpu_mhz()

    def busy(self) -> str | None:
        """Why measurements now are not comparable, or None."""
        if self.others_fraction > OTHERS_LIMIT:
            return f"other tenants used {self.others_fraction:.0%} of the host's CPU time"
        if self.steal_fraction > STEAL_LIMIT:
            return f"steal time {self.steal_fraction:.0%} of CPU time during the run"
        return None

    def record(self) -> dict:
        d = asdict(self)
        del d["stat_start"], d["own_start"]
        return {**d, "busy": self.busy()}


def cpu_jiffies() -> tuple[int, int, int]:
    """(steal, busy, total) jiffies of all CPUs, /proc/stat (busy: neither idle nor iowait)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    total = sum(f)
    return f[7], total - f[3] - f[4], total


def own_cpu() -> float:
    """CPU seconds of this process and its finished descendants (densevm with its cells and
    holders, zipfperf): each level reaps the one below."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_mhz() -> float | None:
    """Mean current CPU clock: cpufreq when readable, else /proc/cpuinfo; None if neither."""
    freqs = sorted(Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cpufreq/scaling_cur_freq"))
    try:
        if freqs:
            return statistics.mean(int(f.read_text()) / 1000 for f in freqs)
        mhz = re.findall(r"^cpu MHz\s*:\s*([\d.]+)", Path("/proc/cpuinfo").read_text(), re.M)
        return statistics.mean(float(x) for x in mhz) if mhz else None
    except OSError:
        return None


@dataclass
class Outcome:
    """One metric's verdict in this run."""

    metric: str
    estimate: Estimate
    finding: Finding
    ab: Estimate | None = None  # candidate / comparison build, A/B mode
    host: bool = False  # a host metric: its "regression" is a slower host
    host_slower: str | None = None  # a suspected regression whose host reference measured slower

    def line(self) -> str:
        e, f = self.estimate, self.finding
        text = f"{self.metric}: median {e.median:,.4g} [{e.ci_low:,.4g}, {e.ci_high:,.4g}] n={e.n}"
        if self.ab:
            text += (
                f"; vs comparison build {self.ab.median - 1:+.1%} "
                f"[{self.ab.ci_low - 1:+.1%}, {self.ab.ci_high - 1:+.1%}]"
            )
        elif f.change is not None:
            text += f"; {f.change:+.1%} vs earlier median {f.earlier_median:,.4g}"
        if f.noise is not None:
            text += f", noise {f.noise:.1%}"
        if self.host_slower:
            return f"{text}: not judged, {self.host_slower}"
        flagged = "HOST SLOWER" if self.host else "REGRESSION"
        return f"{text}: {flagged if f.regression else f.reason}"


def assess_ab(
    metric: Metric, new: list[float], old: list[float], history: list[list[float]]
) -> tuple[Finding, Estimate]:
    """A/B verdict: the ratio's CI lies wholly on the bad side and beyond the metric's noise."""
    ratio = ratio_estimate(new, old)
    noise = run_noise([statistics.median(r) for r in history]) if len(history) >= 3 else 0.0
    change = ratio.median - 1
    worse = ratio.ci_high < 1 if metric.higher_is_better else ratio.ci_low > 1
    regression = worse and abs(change) > NOISE_FACTOR * noise
    reason = "A/B: no difference beyond the confidence interval and noise"
    if regression:
        reason = "A/B: worse than the comparison build beyond its CI and noise"
    return Finding(metric.name, regression, reason, change, estimate(new), None, noise), ratio


@dataclass
class Options:
    quick: bool = False
    history: Path | None = None
    compare_bin: Path | None = None
    inject_request_us: int = 0
    inject_fault_us: int = 0
    metrics_file: Path = METRICS
    out_dir: Path | None = None
    rounds: int | None = None


def build_label(bin_dir: Path, extra: tuple[str, ...]) -> str:
    rev = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    return " ".join([rev or "unknown", str(bin_dir), *extra])


def judge(
    spec: Spec,
    names: list[str],
    samples: list[dict[str, list[float]]],
    history: History,
) -> list[Outcome]:
    by_name = {m.name: m for m in spec.metrics}
    outcomes = []
    for name in names:
        metric, new = by_name[name], samples[0][name]
        past = history.series(name)
        if len(samples) > 1:
            finding, ab = assess_ab(metric, new, samples[1][name], past)
            outcomes.append(Outcome(name, estimate(new), finding, ab, metric.host))
        else:
            if metric.host:
                finding = assess_host(name, [*past, new], metric.higher_is_better)
            else:
                finding = assess_history(
                    name, [*past, new], metric.higher_is_better, history.previous_noisy(name)
                )
            outcomes.append(Outcome(name, estimate(new), finding, host=metric.host))
    return outcomes


def gate(spec: Spec, outcomes: list[Outcome]) -> list[Outcome]:
    """`outcomes`, each suspected regression whose host reference (its `host_ref`, else every host
    metric) measured slower in this run by enough to explain it marked with why: that says
    nothing about the build. Enough is HOST_SHARE of the metric's change (a reference noisier than
    what it gates is rarely flagged, yet its drop explains the metric's), or FLAGGED_HOST_SHARE
    when the reference's own history flags it slower: a host a few percent slower moves a metric
    by a few times that at most, so a step many times larger is the build's."""
    by_name = {m.name: m for m in spec.metrics}
    hosts = {o.metric: o for o in outcomes if o.host}
    gated = []
    for o in outcomes:
        metric = by_name[o.metric]
        if o.finding.regression and not o.host:
            ref = metric.host_ref
            refs = [hosts[ref]] if ref in hosts else [] if ref else list(hosts.values())
            why = [h for h in refs if explains(by_name[h.metric], h, o)]
            if why:
                o = replace(o, host_slower=host_slower_reason(why))
        gated.append(o)
    return gated


def explains(reference: Metric, host: Outcome, suspect: Outcome) -> bool:
    """The host reference changed in its bad direction by at least HOST_SHARE of the suspect's
    change, or FLAGGED_HOST_SHARE of it if the reference's history flags it slower."""
    ref_change, change = host.finding.change, suspect.finding.change
    if ref_change is None or change is None:
        return False
    worse = ref_change < 0 if reference.higher_is_better else ref_change > 0
    share = FLAGGED_HOST_SHARE if host.finding.regression else HOST_SHARE
    return worse and abs(ref_change) >= share * abs(change)


def host_slower_reason(slower: list[Outcome]) -> str:
    return "the host itself measured slower: " + ", ".join(
        f"{o.metric} {o.finding.change or 0.0:+.1%}" for o in slower
    )


def decide(outcomes: list[Outcome], busy: str | None) -> tuple[str, int]:
    """The run's verdict and exit status: a regression seen on a busy host, or whose host
    reference measured slower, is "noisy" (3)."""
    suspects = [o for o in outcomes if o.finding.regression and not o.host]
    if suspects and not busy and any(not o.host_slower for o in suspects):
        return "regression", EXIT_REGRESSION
    if suspects:
        return NOISY, EXIT_NOISY
    if all(o.finding.reason.startswith(TOO_SHORT) for o in outcomes):
        return "baseline", EXIT_CLEAN
    return "clean", EXIT_CLEAN


def nightly(opts: Options, candidate_dir: Path, reporter: Reporter) -> int:
    """Run the nightly check; EXIT_CLEAN, EXIT_REGRESSION or EXIT_NOISY."""
    spec = load_spec(opts.metrics_file)
    if opts.quick:
        spec = spec.quick()
    rounds = opts.rounds or spec.rounds
    extra: tuple[str, ...] = ()
    if opts.inject_request_us:
        extra += ("--inject-request-us", str(opts.inject_request_us))
    if opts.inject_fault_us:
        extra += ("--inject-fault-us", str(opts.inject_fault_us))
    try:
        builds = [Build.in_dir(candidate_dir, extra)]
        if opts.compare_bin:
            builds.append(Build.in_dir(opts.compare_bin))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    history = History(opts.history or default_path())
    started = datetime.now(UTC)
    out_dir = opts.out_dir or Path.cwd() / "runs" / f"nightly-{started:%Y%m%dT%H%M%S}"
    names = [m.name for m in spec.metrics]
    host = HostNoise.start()
    t0 = time.monotonic()
    samples = measure(spec, names, builds, rounds, out_dir / "work", reporter)
    outcomes = judge(spec, names, samples, history)
    suspects = [o.metric for o in outcomes if o.finding.regression and not o.host]
    remeasured: list[str] = []
    if suspects:
        reporter.note(f"suspected regression of {', '.join(suspects)}: measuring once more")
        # The host metrics are measured again too: the host's state now is what counts.
        again_names = suspects + [m.name for m in spec.metrics if m.host and m.name not in suspects]
        again = measure(spec, again_names, builds, rounds, out_dir / "work-again", reporter)
        for b, per_build in enumerate(again):
            samples[b].update(per_build)
        again_outcomes = {o.metric: o for o in judge(spec, again_names, samples, history)}
        outcomes = [again_outcomes.get(o.metric, o) for o in outcomes]
        remeasured = suspects
    host.finish()
    outcomes = gate(spec, outcomes)
    busy = host.busy()
    verdict, code = decide(outcomes, busy)
    regressions = [o for o in outcomes if o.finding.regression and not (o.host or o.host_slower)]
    run = Run(
        started.isoformat(timespec="seconds"),
        datetime.now(UTC).isoformat(timespec="seconds"),
        "quick" if opts.quick else "full",
        build_label(candidate_dir, extra),
        {**host.record(), "wall_s": time.monotonic() - t0, "remeasured": remeasured},
        verdict,
        samples[0],
    )
    history.append(run)
    history.close()
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": "scalebench.nightly/1",
        **asdict(run),
        "history": str(opts.history or default_path()),
        "outcomes": [asdict(o) for o in outcomes],
        "comparison": samples[1] if len(samples) > 1 else None,
    }
    (out_dir / "nightly.json").write_text(json.dumps(doc, indent=2) + "\n")
    for o in outcomes:
        print(o.line())
    wall = time.monotonic() - t0
    if code == EXIT_NOISY:
        why = busy or "; ".join(sorted({o.host_slower for o in outcomes if o.host_slower}))
        print(f"nightly: host too noisy to judge ({why}); not a regression [{wall:.0f} s]")
    elif code == EXIT_REGRESSION:
        print(
            "nightly: REGRESSION in "
            + "; ".join(
                f"{o.metric} {o.finding.change:+.1%} (CI of the median "
                f"[{o.estimate.ci_low:,.4g}, {o.estimate.ci_high:,.4g}])"
                for o in regressions
            )
            + f" [{wall:.0f} s]"
        )
    else:
        print(f"nightly: {verdict} [{wall:.0f} s]; results in {out_dir}")
    return code
