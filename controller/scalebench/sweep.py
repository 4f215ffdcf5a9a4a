"""Sweeps: a grid of runs from an experiment file, resumable, with CSV and plots.

An experiment file (TOML, see controller/RESULTS.md) has `name`, `title`, a
`[base]` table of run settings, a `[grid]` table of lists whose product gives
the points, and `[[plot]]` tables. Each point's result is stored as
DIR/points/<key>/result.json as soon as it finishes; a sweep started again on
the same DIR skips every point whose stored result has status "ok", so an
interrupted sweep continues where it stopped.
"""

from __future__ import annotations

import csv
import itertools
import json
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .checks import KINDS as CHECK_KINDS
from .checks import CheckSpec, run_checks
from .config import ConfigError, RunConfig, validate
from .progress import Reporter
from .result import RunResult, now_iso
from .tables import cliff_rows

SWEEP_SCHEMA = "scalebench.sweep/1"
PLOT_KINDS = ("line", "cliff")
PER_RUN_ONLY = {"out", "json", "labels"}  # set by the sweep itself, not by experiment files
CSV_METRICS = (
    "status",
    "throughput_rps",
    "model_rps",
    "measured_over_model",
    "regime",
    "model_regime",
    "latency_p50_ms",
    "latency_p99_ms",
    "errors",
    "boot_seconds",
    "resident_bytes",
    "budget_bytes",
    "footprint_bytes",
    "faults_per_s",
    "swap_read_mbps",
    "swap_write_mbps",
    "hit_ratio",
    "cliff_vms",
    "model_cpu_us",
    "miss_wait_s",
    "steady_window",
    "error",
)


@dataclass(frozen=True)
class PlotSpec:
    name: str
    x: str
    y: list[str] = field(default_factory=list)  # not used by "cliff" plots
    series: list[str] = field(default_factory=list)
    kind: str = "line"  # "line": y against x; "cliff": cliff position (over vms) against x
    logx: bool = False
    logy: bool = False
    title: str = ""


@dataclass(frozen=True)
class Experiment:
    name: str
    title: str
    base: RunConfig
    grid: dict[str, list]
    plots: list[PlotSpec]
    checks: list[CheckSpec] = field(default_factory=list)
    # What the figure reproduces, in the paper's words, and how this host's set-up differs
    # from the paper's (shown on the plots and the results page; experiments/results/).
    claim: str = ""
    differences: str = ""

    def restricted(self, only: list[str]) -> Experiment:
        """The experiment with its grid cut to the `KEY=VALUE` settings given (sweep --only).

        Point keys stay those of the whole grid, so a later run of the whole file keeps
        what this one did and runs the rest."""
        grid = dict(self.grid)
        for item in only:
            key, sep, value = item.partition("=")
            if not sep or key not in grid:
                raise ConfigError(
                    f"--only {item}: expected KEY=VALUE with KEY one of the grid's "
                    f"({', '.join(grid)})"
                )
            kept = [v for v in grid[key] if str(v) == value]
            if not kept:
                raise ConfigError(
                    f"--only {item}: {key} takes {', '.join(map(str, grid[key]))} in this "
                    "experiment"
                )
            grid[key] = kept
        return replace(self, grid=grid)

    def overridden(self, settings: list[str]) -> Experiment:
        """The experiment with `KEY=VALUE` settings replacing its [base] ones (sweep --set).

        VALUE is read as a TOML value where it is one (30, 1.5, true, "x") and as a string
        otherwise (127.2.0.0, 64k), so it means what it would in the file. Grid keys are
        refused: a point's key must say what it ran."""
        changes: dict[str, object] = {}
        allowed = RunConfig.field_names() - PER_RUN_ONLY
        for item in settings:
            key, sep, text = item.partition("=")
            if not sep or key not in allowed:
                raise ConfigError(
                    f"--set {item}: expected KEY=VALUE with KEY a run setting "
                    f"({', '.join(sorted(allowed))})"
                )
            if key in self.grid:
                raise ConfigError(
                    f"--set {item}: {key} is a grid axis of this experiment; use --only"
                )
            try:
                changes[key] = tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                changes[key] = text
        exp = replace(self, base=self.base.with_(**changes))
        exp.validate("--set: ")
        return exp

    def validate(self, where: str) -> None:
        """ConfigError, prefixed with `where`, for the first point that is not a valid run."""
        for key, cfg in self.points():
            try:
                validate(cfg)
            except ConfigError as e:
                raise ConfigError(f"{where}point {key}: {e}") from None

    def points(self) -> list[tuple[str, RunConfig]]:
        """(key, config) for every combination of the grid, in file order."""
        names = list(self.grid)
        out = []
        for values in itertools.product(*(self.grid[n] for n in names)):
            changes = dict(zip(names, values, strict=False))
            key = ",".join(f"{n}={v}" for n, v in changes.items()) or "base"
            out.append(
                (key, self.base.with_(**changes, labels={"point": key, "experiment": self.name}))
            )
        return out


def load_experiment(path: Path) -> Experiment:
    """Parse and validate an experiment file; ConfigError (one line) for any problem."""
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"cannot read experiment file {path}: {e.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"experiment file {path} is not valid TOML: {e}") from None
    allowed = RunConfig.field_names() - PER_RUN_ONLY
    base, grid = doc.get("base", {}), doc.get("grid", {})
    for table, keys in (("base", base), ("grid", grid)):
        unknown = set(keys) - allowed
        if unknown:
            raise ConfigError(
                f"{path}: unknown setting(s) in [{table}]: {', '.join(sorted(unknown))}"
            )
    bad = [k for k, v in grid.items() if not isinstance(v, list) or not v]
    if bad:
        raise ConfigError(f"{path}: [grid] values must be non-empty lists: {', '.join(bad)}")
    try:
        plots = [PlotSpec(**p) for p in doc.get("plot", [])]
        checks = [CheckSpec(**c) for c in doc.get("check", [])]
        exp = Experiment(
            doc.get("name", Path(path).stem),
            doc.get("title", ""),
            RunConfig(**base),
            grid,
            plots,
            checks,
            " ".join(str(doc.get("claim", "")).split()),
            " ".join(str(doc.get("differences", "")).split()),
        )
    except TypeError as e:
        raise ConfigError(f"{path}: {e}") from None
    for what, kinds, known in (
        ("plot", {p.kind for p in plots}, PLOT_KINDS),
        ("check", {c.kind for c in checks}, CHECK_KINDS),
    ):
        if kinds - set(known):
            raise ConfigError(
                f"{path}: unknown {what} kind(s) {', '.join(sorted(kinds - set(known)))} "
                f"(known: {', '.join(known)})"
            )
    exp.validate(f"{path}: ")
    return exp


def slug(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", key.replace(",", "__"))


def csv_row(key: str, doc: dict) -> dict:
    """One sweep point flattened for CSV: its configuration and its figures."""
    model = doc.get("model") or {}
    lat = doc.get("latency_ms") or {}
    row = {"point": key, **{k: v for k, v in doc["config"].items() if k not in ("labels",)}}
    row.update({m: doc.get(m) for m in CSV_METRICS})
    row.update(
        latency_p50_ms=lat.get("p50"),
        latency_p99_ms=lat.get("p99"),
        model_regime=model.get("regime"),
        hit_ratio=model.get("hit_ratio"),
        cliff_vms=model.get("cliff_vms"),
        model_cpu_us=model.get("cpu_us"),
        miss_wait_s=model.get("miss_wait_s"),
        steady_window=model.get("steady_window"),
    )
    host = doc.get("host") or {}
    row.update(
        host=host.get("hostname"),
        host_kind=host.get("kind"),
        retried=bool((doc.get("placement") or {}).get("retried")),
        cluster=(doc.get("placement") or {}).get("cluster"),
    )
    return row


def hosts_by_kind(docs: dict[str, dict]) -> dict[str, list[str]]:
    """{host kind: [host names]} over the points (kind "unknown" for results older than the
    field)."""
    hosts: dict[str, list[str]] = {}
    for doc in docs.values():
        host = doc.get("host") or {}
        names = hosts.setdefault(host.get("kind") or "unknown", [])
        if host.get("hostname") not in names:
            names.append(host.get("hostname"))
    return hosts


def mixed_hosts_warning(hosts: dict[str, list[str]]) -> str:
    kinds = "; ".join(f"{kind} ({', '.join(map(str, names))})" for kind, names in hosts.items())
    return (
        f"the points ran on {len(hosts)} kinds of host: {kinds}: "
        "figures across them are not comparable"
    )


def csv_text(value: Any) -> Any:
    """A value as write_csv writes it: a float to six significant digits (more is float
    noise, 99.99999999999999 for 100), anything else as it is."""
    return f"{value:.6g}" if isinstance(value, float) else value


def write_csv(rows: list[dict], path: Path) -> None:
    if not rows:
        return
    columns = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, columns)
        w.writeheader()
        w.writerows({k: csv_text(v) for k, v in r.items()} for r in rows)


def grid_values(exp: Experiment, rows: list[dict]) -> list[dict]:
    """Rows read back from a sweep's CSV with its grid's columns as the sweep had them (the
    grid's 0.0 was written "0"), so that plots drawn from them label their lines alike."""
    known = {key: {str(csv_text(v)): v for v in values} for key, values in exp.grid.items()}
    return [{k: known.get(k, {}).get(v, v) for k, v in row.items()} for row in rows]


PointRunner = Callable[[RunConfig], RunResult]


def pending_points(
    exp: Experiment, out_dir: Path, reporter: Reporter
) -> list[tuple[int, str, RunConfig]]:
    """Start (or resume) a sweep in out_dir: (index, key, config) of every point not done yet."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "experiment.json").write_text(
        json.dumps(
            {
                "name": exp.name,
                "title": exp.title,
                "claim": exp.claim,
                "grid": exp.grid,
                "base": exp.base.as_dict(),
            },
            indent=2,
            default=str,
        )
    )
    points = exp.points()
    todo = [
        (i, key, cfg)
        for i, (key, cfg) in enumerate(points)
        if _status(point_record(out_dir, key)) != "ok"
    ]
    if len(todo) < len(points):
        reporter.note(f"{len(points) - len(todo)} of {len(points)} point(s) already done: kept")
    return todo


def point_record(out_dir: Path, key: str) -> Path:
    """Where a point's result is stored; the point's files are beside it."""
    return out_dir / "points" / slug(key) / "result.json"


def run_sweep(
    exp: Experiment, out_dir: Path, point_runner: PointRunner, reporter: Reporter | None = None
) -> dict:
    """Run every point not already done, then write results.csv, plots and sweep.json.

    Returns the sweep document (schema scalebench.sweep/1).
    """
    reporter = reporter or Reporter()
    total = len(exp.points())
    # One line per point rather than a bar: each run shows its own phase bars.
    for i, key, cfg in pending_points(exp, out_dir, reporter):
        reporter.note(f"[bold]point {i + 1}/{total}[/]: {key}")
        record = point_record(out_dir, key)
        result = point_runner(cfg.with_(out=str(record.parent)))
        result.write(record)
        reporter.note(point_line(result))
    return finish_sweep(exp, out_dir)


def point_line(r: RunResult) -> str:
    """One line per finished point: its throughput against the model, or why it failed."""
    if r.status != "ok":
        return f"  failed: {r.error}"
    ratio = f", measured/model {r.measured_over_model:.2f}" if r.measured_over_model else ""
    unsteady = (
        f" (a miss waits {r.model['miss_wait_s']:.0f} s: the window is before the steady state)"
        if r.model.get("steady_window") is False
        else ""
    )
    return f"  {r.throughput_rps or 0:,.0f} requests/s, {r.regime}{ratio}{unsteady}"


def _status(record: Path) -> str | None:
    try:
        return json.loads(record.read_text()).get("status")
    except (OSError, ValueError):
        return None


def draw_plots(
    exp: Experiment,
    rows: list[dict],
    checks: list[dict],
    tables: dict[str, list[dict]],
    out_dir: Path,
) -> None:
    """The experiment's plots (PNG) in out_dir: from the points' rows (results.csv's), with
    the checks' verdicts under each, and a cliff plot from its table in `tables` (by plot
    name, cliff_rows'). Also what `scalebench results replot` draws from a stored figure."""
    from .plots import check_verdicts, line_plot  # matplotlib is slow to import

    verdicts = check_verdicts(checks)
    for spec in exp.plots:
        title = spec.title or exp.title or exp.name
        if spec.kind == "cliff":
            line_plot(
                tables[spec.name],
                spec.x,
                ["measured_cliff_vms", "model_cliff_vms"],
                spec.series,
                out_dir / f"{spec.name}.png",
                title,
                spec.logx,
                spec.logy,
                "cliff position (VMs)",
                exp.claim,
                verdicts,
            )
        else:
            line_plot(
                [r for r in rows if r.get("status") == "ok"],
                spec.x,
                spec.y,
                spec.series,
                out_dir / f"{spec.name}.png",
                title,
                spec.logx,
                spec.logy,
                claim=exp.claim,
                verdicts=verdicts,
            )


def finish_sweep(exp: Experiment, out_dir: Path) -> dict:
    """results.csv, the plots, checks.csv and sweep.json from the stored point results."""
    docs: dict[str, dict] = {}
    for key, _ in exp.points():
        record = point_record(out_dir, key)
        if record.exists():
            doc = json.loads(record.read_text())
            doc.pop(
                "timeseries", None
            )  # kept in the point's own file; too big for the sweep document
            docs[key] = doc
    rows = [csv_row(k, d) for k, d in docs.items()]
    write_csv(rows, out_dir / "results.csv")
    checks = run_checks(exp.checks, rows) if exp.checks else []
    if checks:
        write_csv(checks, out_dir / "checks.csv")
    tables = {}
    for spec in exp.plots:
        if spec.kind == "cliff":
            tables[spec.name] = cliff_rows(rows, [spec.x, *spec.series])
            write_csv(tables[spec.name], out_dir / f"{spec.name}.csv")
    draw_plots(exp, rows, checks, tables, out_dir)
    hosts = hosts_by_kind(docs)
    warnings = [mixed_hosts_warning(hosts)] if len(hosts) > 1 else []
    doc = {
        "schema": SWEEP_SCHEMA,
        "name": exp.name,
        "title": exp.title,
        "claim": exp.claim,
        "written_at": now_iso(),
        "grid": exp.grid,
        "hosts": hosts,
        "warnings": warnings,
        "points": docs,
    }
    (out_dir / "sweep.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    return doc
