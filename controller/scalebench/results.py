"""Stored results: experiments/results/<figure>/, each made by one command on one build.

`scalebench results make FIGURE` runs the figure's experiment (a resumable sweep in
runs/results-FIGURE, on this host or with `--cluster`, `local` included) or, for
`ecommerce`, the storage study's findings bench, then publishes what a reader
needs into experiments/results/FIGURE/:

- points.csv: every point's configuration and figures (the sweep's results.csv);
- the plots (PNG), each titled with the paper's claim and the checks' verdicts;
- checks.csv: one verdict per check and group;
- manifest.json: the build (commit, dirty), the host (CPU, cores, kernel, KVM
  flavour), dates, wall time, the exact command, whether it ran on a cluster;
- notes.toml (written by hand, kept across re-runs): the reason beside each
  check that fails (`[reasons]`, keyed "check | group") and free `text`.

Nothing else is stored: no traces, swap or per-run directories (they stay in
runs/). `scalebench report experiments/results` renders the whole folder as one
page (report.render_results).
"""

from __future__ import annotations

import csv
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from pathlib import Path

from .config import REPO_ROOT, ConfigError
from .db.analysis import STUDY_COLUMNS
from .procs import Child
from .result import host_info, now_iso

SCHEMA = "scalebench.results/1"
RESULTS_DIR = REPO_ROOT / "experiments" / "results"
WORK_DIR = REPO_ROOT / "runs"
SWEEP_FIGURES = ("fig08", "fig09", "fig10", "fig11")
ECOMMERCE = "ecommerce"
FIGURES = (*SWEEP_FIGURES, ECOMMERCE)
MANIFEST = "manifest.json"
NOTES = "notes.toml"
CHECKS = "checks.csv"
# The command each stored result comes from (its manifest records the one actually run);
# Fig 9 runs through the fleet path, on a cluster started here.
COMMANDS = {
    "fig08": "scalebench results make fig08",
    "fig09": "scalebench results make fig09 --cluster local",
    "fig10": "scalebench results make fig10",
    "fig11": "scalebench results make fig11",
    "ecommerce": "scalebench results make ecommerce",
}
# How long the terminated findings bench may take to stop its dbtrace run (which may take
# up to DBTRACE_TEARDOWN_S, experiments/bench/dbtrace_findings.py) before it is killed.
FINDINGS_TEARDOWN_S = 150.0
# Wall time of each command on this project's 2-core host: Fig 8, Fig 9, Fig 10 and Fig 11 as
# their stored runs took (51 min, 1.8 h, 20 and 31 min), the e-commerce findings from 15
# runs at ~8 min.
ESTIMATED_HOURS = {"fig08": 0.85, "fig09": 1.8, "fig10": 0.35, "fig11": 1.0, "ecommerce": 2.0}

ECOMMERCE_CLAIM = (
    "browsing is read-dominated (TPC-W 99.9/0.1, RUBiS 99/1 by sectors); TPC-C is 60/40 "
    "(standard) to 40/60 (high write); moving from browsing to ordering lowers I/O traffic but "
    "grows the I/O working set"
)
ECOMMERCE_DIFFERENCES = (
    "The study's database server had 512 MB of memory and one 15,000 RPM SCSI disk (ext3, "
    "anticipatory scheduler); here each database guest runs under QEMU (TCG on this PVM host) "
    "with its files' page cache held to 12 MiB beside 24 MB of shared buffers (dbtrace's "
    "default) so the databases are many times its memory as the study's were, on the host's "
    "virtual disk. Read shares "
    "and footprints compare; absolute sectors and interarrival times do not."
)
MIXES = (
    ("tpcw", "browsing", "TPC-W", "read"),
    ("tpcw", "ordering", "TPC-W", "write"),
    ("rubis", "browsing", "RUBiS", "read"),
    ("tpcc", "standard", "TPC-C", "read"),
    ("tpcc", "highwrite", "TPC-C", "write"),
)
STUDY_CSV = REPO_ROOT / "controller" / "scalebench" / "db" / "study_block_metrics.csv"


def experiment_file(figure: str) -> Path:
    return REPO_ROOT / "experiments" / f"{figure}.toml"


def figure_plots(figure: str) -> list[str]:
    """The PNG files the figure's command writes (a README may show them before they exist)."""
    if figure == ECOMMERCE:
        return ["ecommerce_read_share.png", "ecommerce_footprint.png"]
    from .sweep import load_experiment

    return [f"{p.name}.png" for p in load_experiment(experiment_file(figure)).plots]


# -- facts -----------------------------------------------------------------------------


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), *args],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def build_info(ignoring: Path | None = None) -> dict:
    """The build the result comes from: HEAD, and whether tracked files differed from it
    (those under `ignoring` aside: a redraw's own published files, say)."""
    status = _git("status", "--porcelain", "--untracked-files=no")
    changed = status.splitlines() if status else []
    if ignoring is not None and ignoring.resolve().is_relative_to(REPO_ROOT.resolve()):
        inside = f"{ignoring.resolve().relative_to(REPO_ROOT.resolve()).as_posix()}/"
        # "XY PATH" (the output's first line comes with X's blank stripped).
        changed = [line for line in changed if not line[2:].strip().startswith(inside)]
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(changed) if status is not None else None,
        "changed_files": len(changed),
    }


def host_facts(points: list[dict]) -> dict:
    """This host, with the KVM flavour densevm itself reported in its ready line where the
    points have it (phases.boot.platform), else the kernel's (result.kvm_platform)."""
    info = host_info()
    seen = sorted(
        {
            ((d.get("phases") or {}).get("boot") or {}).get("platform")
            for d in points
            if ((d.get("phases") or {}).get("boot") or {}).get("platform")
        }
    )
    return {
        "hostname": info["hostname"],
        "cpu_model": info["cpu_model"],
        "cores": info["cpus"],
        "memory_bytes": info["memory_bytes"],
        "kernel": info["kernel"],
        "kvm": seen[0] if len(seen) == 1 else (", ".join(seen) or info["kvm"]),
        "kvm_source": "densevm ready line" if seen else "kernel modules",
    }


# -- making a figure -------------------------------------------------------------------


class Invocations:
    """The commands that built one result, across interruptions (WORK/invocations.json)."""

    def __init__(self, work: Path, argv: list[str]) -> None:
        self.path = work / "invocations.json"
        work.mkdir(parents=True, exist_ok=True)
        try:
            self.items = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.items = []
        # The build as it starts: a published figure's own files are tracked, so read after
        # publishing it, the tree would always differ.
        self.entry = {
            "argv": argv,
            "started_at": now_iso(),
            "build": build_info(),
            "wall_seconds": None,
            "end": None,
        }
        self.items.append(self.entry)
        self.t0 = time.monotonic()
        self.save()

    def end(self, how: str) -> None:
        self.entry.update(end=how, wall_seconds=round(time.monotonic() - self.t0, 1))
        self.save()

    def save(self) -> None:
        self.path.write_text(json.dumps(self.items, indent=2) + "\n")


def make(
    figure: str,
    argv: list[str],
    *,
    cluster: str | None = None,
    settings: list[str] | None = None,
    only: list[str] | None = None,
    work: Path | None = None,
    dest_root: Path | None = None,
    runner: Callable | None = None,
) -> dict:
    """Run (or resume) one figure and publish it; returns its manifest. `runner(exp, work)`
    replaces the sweep (the tests' fake points)."""
    if figure not in FIGURES:
        raise ConfigError(f"unknown figure {figure!r} (known: {', '.join(FIGURES)})")
    work = Path(work) if work else WORK_DIR / f"results-{figure}"
    dest = Path(dest_root or RESULTS_DIR) / figure
    log = Invocations(work, argv)
    started = log.entry["started_at"]
    try:
        if figure == ECOMMERCE:
            if cluster or settings or only:
                raise ConfigError("ecommerce takes no --cluster, --set or --only")
            resumed, total = 0, None
            (runner or _run_findings)(work)
        else:
            from .sweep import load_experiment

            exp = load_experiment(experiment_file(figure))
            exp = exp.overridden(settings or []).restricted(only or [])
            total = len(exp.points())
            resumed = _stored_ok(exp, work)
            if runner:
                runner(exp, work)
            else:
                _run_sweep(exp, work, cluster)
    except BaseException:
        log.end("interrupted or failed")
        raise
    log.end("done")
    context = {
        "argv": argv,
        "started_at": started,
        "cluster": cluster,
        "settings": settings or [],
        "only": only or [],
        "resumed": resumed,
        "invocations": log.items,
    }
    if figure == ECOMMERCE:
        return publish_ecommerce(work / "results.json", dest, context)
    return publish_sweep(exp, work, dest, context, total)


def _stored_ok(exp, work: Path) -> int:
    from .sweep import _status, point_record

    return sum(_status(point_record(work, key)) == "ok" for key, _ in exp.points())


def _run_sweep(exp, work: Path, cluster: str | None) -> None:
    from .config import check_addresses_free
    from .progress import ConsoleReporter
    from .runner import Binaries, run
    from .sweep import run_sweep

    reporter = ConsoleReporter()
    if cluster:
        try:
            from .cluster import run_sweep_on_cluster
        except ModuleNotFoundError as e:
            raise ConfigError(f"--cluster needs {e.name}: pip install -e '.[cluster]'") from None
        run_sweep_on_cluster(exp, work, cluster, reporter)
        return
    bins = Binaries.find()
    check_addresses_free(max((cfg for _, cfg in exp.points()), key=lambda cfg: cfg.vms))
    run_sweep(exp, work, lambda cfg: run(cfg, reporter, bins), reporter)


def _run_findings(work: Path) -> None:
    """The storage study's findings bench, dbtrace's default runs, into work."""
    script = REPO_ROOT / "experiments" / "bench" / "dbtrace_findings.py"
    child = Child([sys.executable, str(script), "--out", str(work)], stdout=None, stderr=None)
    _, code = child.finish(FINDINGS_TEARDOWN_S)
    if not (work / "results.json").exists():
        raise ConfigError(f"{script.name} wrote no results.json (exit {code})")


def _copy_fresh(files: list[Path], dest: Path) -> list[str]:
    """Replace dest's published files (a re-run's, not its notes) with `files`."""
    dest.mkdir(parents=True, exist_ok=True)
    for old in dest.iterdir():
        if old.is_file() and old.name != NOTES:
            old.unlink()
    names = []
    for f in files:
        name = "points.csv" if f.name == "results.csv" else f.name
        shutil.copyfile(f, dest / name)
        names.append(name)
    return names


def _read_csv(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _checks_summary(path: Path) -> dict:
    rows = _read_csv(path)
    return {
        "passed": sum(r["passed"] == "yes" for r in rows),
        "failed": sum(r["passed"] != "yes" for r in rows),
        "verdicts": [
            {"check": r["check"], "group": r["group"], "passed": r["passed"] == "yes"} for r in rows
        ],
    }


def _manifest(figure: str, title: str, claim: str, differences: str, context: dict) -> dict:
    argv = context["argv"]
    walls = [i["wall_seconds"] or 0 for i in context["invocations"]]
    return {
        "schema": SCHEMA,
        "figure": figure,
        "title": title,
        "claim": claim,
        "differences": differences,
        "command": "scalebench " + shlex.join(argv),
        "argv": argv,
        "build": context["invocations"][-1]["build"],
        "started_at": context["started_at"],
        "finished_at": now_iso(),
        "wall_seconds": walls[-1] if walls else None,
        "wall_seconds_all_invocations": round(sum(walls), 1),
        "invocations": len(context["invocations"]),
        "settings": context["settings"],
        "only": context["only"],
    }


def publish_sweep(exp, work: Path, dest: Path, context: dict, total: int | None = None) -> dict:
    """experiments/results/FIGURE from a finished sweep directory; returns the manifest."""
    sweep = json.loads((work / "sweep.json").read_text())
    docs = list(sweep["points"].values())
    # The experiment's own plots and tables only: an earlier invocation's may be in work.
    files = [work / "results.csv", work / CHECKS]
    files += [work / f"{plot.name}{ext}" for plot in exp.plots for ext in (".png", ".csv")]
    names = _copy_fresh([f for f in files if f.exists()], dest)
    manifest = _manifest(exp.name, exp.title, exp.claim, exp.differences, context)
    on_cluster = [d for d in docs if (d.get("placement") or {}).get("cluster")]
    total = total if total is not None else len(exp.points())
    ok = sum(d.get("status") == "ok" for d in docs)
    manifest.update(
        experiment=str(experiment_file(exp.name).relative_to(REPO_ROOT)),
        host=host_facts(docs),
        hosts_of_points=sweep.get("hosts"),
        cluster=(
            {
                "address": context["cluster"],
                "engine": "dask distributed"
                + (
                    " LocalCluster started by the command: 1 worker process, resources host=1"
                    if context["cluster"] == "local"
                    else ""
                ),
                "points_on_cluster": len(on_cluster),
                "points_retried": sum(bool(d["placement"].get("retried")) for d in on_cluster),
            }
            if context["cluster"] or on_cluster
            else None
        ),
        points={
            "grid": total,
            "stored": len(docs),
            "ok": ok,
            "failed": len(docs) - ok,
            "kept_from_earlier_invocations": context["resumed"],
            "seconds": round(sum(_point_seconds(d) for d in docs), 1),
        },
        complete=bool(ok == total and not context["only"] and not context["settings"]),
        checks=_checks_summary(dest / CHECKS),
        files=sorted([*names, MANIFEST]),
    )
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _point_seconds(doc: dict) -> float:
    from datetime import datetime

    try:
        a = datetime.fromisoformat(doc["started_at"])
        b = datetime.fromisoformat(doc["finished_at"])
    except (KeyError, TypeError, ValueError):
        return 0.0
    return max(0.0, (b - a).total_seconds())


# -- the storage study -----------------------------------------------------------------


def _study_read_shares() -> dict[tuple[str, str], list[float]]:
    """{(benchmark, intensity): [read share by sectors at light and heavy load]} of the study."""
    out: dict[tuple[str, str], list[float]] = {}
    for r in _read_csv(STUDY_CSV):
        read, written = float(r["sectors_read"]), float(r["sectors_written"])
        out.setdefault((r["benchmark"], r["intensity"]), []).append(read / (read + written))
    return out


def ecommerce_findings(runs: list[dict]) -> list[dict]:
    """One verdict per finding of the study, over every run of each mix (the findings bench's
    tests: browsing >= 95% reads; TPC-C standard 50-75% reads; high write writes a larger
    share; TPC-W's footprint grows from browsing to ordering)."""
    by: dict[tuple[str, str], list[dict]] = {}
    for d in runs:
        o = d["options"]
        by.setdefault((o["workload"], o["mix"]), []).append(d["metrics"])

    def vals(w: str, m: str, key: str) -> list[float]:
        return [float(x[key]) for x in by.get((w, m), [])]

    def verdict(check: str, group: str, values: list, ok: bool, study: str) -> dict:
        detail = ", ".join(f"{v:.3f}" for v in values) or "no runs"
        return {
            "check": check,
            "group": group,
            "passed": "yes" if values and ok else "NO",
            "detail": detail,
            "study": study,
        }

    out = []
    for w, name, study in (("tpcw", "TPC-W", "99.9/0.1"), ("rubis", "RUBiS", "99/1")):
        s = vals(w, "browsing", "read_share")
        out.append(
            verdict(
                "browsing is read-dominated (>= 95% of sectors read)",
                f"{name} browsing",
                s,
                all(x >= 0.95 for x in s),
                f"{study} by sectors",
            )
        )
    std, hw = vals("tpcc", "standard", "read_share"), vals("tpcc", "highwrite", "read_share")
    out.append(
        verdict(
            "TPC-C standard reads 50-75% of sectors",
            "TPC-C standard",
            std,
            all(0.50 <= x <= 0.75 for x in std),
            "60/40",
        )
    )
    out.append(
        verdict(
            "TPC-C high write writes a larger share than standard (read share, run by run)",
            "TPC-C highwrite",
            hw,
            len(hw) == len(std) and all(h < s for h, s in zip(hw, std, strict=True)),
            "40/60",
        )
    )
    b, o = (
        vals("tpcw", "browsing", "regions_per_1000"),
        vals("tpcw", "ordering", "regions_per_1000"),
    )
    out.append(
        verdict(
            "TPC-W's I/O working set grows from browsing to ordering (MiB regions per 1k requests)",
            "TPC-W ordering",
            o,
            len(b) == len(o) and all(y > x for x, y in zip(b, o, strict=True)),
            "grows",
        )
    )
    return out


def draw_ecommerce_plots(rows: list[dict], checks: list[dict], directory: Path) -> None:
    """The storage study's two bar plots in `directory`, from its points' rows (points.csv's,
    as written or as read back) with the checks' verdicts under them."""
    from .plots import bar_plot, check_verdicts

    study = _study_read_shares()
    labels, ours, theirs, feet = [], [], [], []
    for w, mix, bench, intensity in MIXES:
        of_mix = [r for r in rows if (r["workload"], r["mix"]) == (w, mix)]
        shares = [float(r["read_share"]) for r in of_mix if r["read_share"] not in (None, "")]
        labels.append(f"{bench} {mix}")
        ours.append(statistics.median(shares) if shares else None)
        theirs.append(statistics.mean(study[(bench, intensity)]))
        regions = [
            float(r["regions_per_1000"]) for r in of_mix if r["regions_per_1000"] not in (None, "")
        ]
        feet.append(statistics.median(regions) if regions else None)
    verdicts = check_verdicts(checks)
    bar_plot(
        labels,
        {"scalebench (median of runs)": ours, "study (light and heavy, mean)": theirs},
        directory / "ecommerce_read_share.png",
        "E-commerce storage study: read share of sectors moved",
        "read share (sectors)",
        ECOMMERCE_CLAIM,
        verdicts,
    )
    bar_plot(
        labels,
        {"scalebench (median of runs)": feet},
        directory / "ecommerce_footprint.png",
        "E-commerce storage study: I/O working set (distinct 1 MiB regions per 1,000 requests)",
        "MiB regions / 1k requests",
        "moving from browsing to ordering lowers I/O traffic but grows the I/O working set",
        [v for v in verdicts if "working set" in v[1]],
    )


def publish_ecommerce(results_json: Path, dest: Path, context: dict) -> dict:
    """experiments/results/ecommerce from the findings bench's results.json."""
    from .sweep import write_csv

    runs = json.loads(Path(results_json).read_text())
    work = Path(results_json).parent
    rows = []
    for i, d in enumerate(runs):
        o, m = d["options"], d.get("metrics") or {}
        rows.append(
            {
                "workload": o.get("workload"),
                "mix": o.get("mix"),
                "run": i,
                "steady": (d.get("steady") or {}).get("reached"),
                "db_cache_mib": o.get("db_cache_mib"),
                **{k: m.get(k) for k in ("read_share", "regions_per_1000", *STUDY_COLUMNS)},
            }
        )
    staging = work / "publish"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_csv(rows, staging / "points.csv")
    shutil.copyfile(STUDY_CSV, staging / "study_block_metrics.csv")
    write_csv(ecommerce_findings(runs), staging / CHECKS)
    draw_ecommerce_plots(rows, _read_csv(staging / CHECKS), staging)
    names = _copy_fresh(sorted(staging.iterdir()), dest)
    shutil.rmtree(staging, ignore_errors=True)
    manifest = _manifest(
        ECOMMERCE,
        "E-commerce storage study: block-level findings (browsing, TPC-C, TPC-W, RUBiS)",
        ECOMMERCE_CLAIM,
        ECOMMERCE_DIFFERENCES,
        context,
    )
    manifest.update(
        experiment="experiments/bench/dbtrace_findings.py",
        host=host_facts([]),
        cluster=None,
        points={
            "runs": len(runs),
            "steady": sum(bool(r["steady"]) for r in rows),
            "mixes": len(MIXES),
        },
        complete=all(
            any((r["workload"], r["mix"]) == (w, m) for r in rows) for w, m, _, _ in MIXES
        ),
        checks=_checks_summary(dest / CHECKS),
        files=sorted([*names, MANIFEST]),
    )
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def replot(figure: str, dest_root: Path | None = None) -> dict:
    """Redraws a stored figure's plots from its stored points.csv, checks.csv and cliff
    tables, running nothing: a change to how figures are drawn reaches the stored ones
    without a re-run. Points, checks and the build they were made on stay as they are; the
    manifest records the redraw (`plots_redrawn`: when, on which build). Returns it."""
    if figure not in FIGURES:
        raise ConfigError(f"unknown figure {figure!r} (known: {', '.join(FIGURES)})")
    dest = Path(dest_root or RESULTS_DIR) / figure
    if not (dest / MANIFEST).exists():
        raise ConfigError(f"{figure} has no stored results in {dest}: {COMMANDS[figure]}")
    manifest = json.loads((dest / MANIFEST).read_text())
    # The drawing code's build: the stored results' own files (this redraw's, the other
    # figures') are not part of it.
    build = build_info(ignoring=dest.parent)
    points, checks = _read_csv(dest / "points.csv"), _read_csv(dest / CHECKS)
    if figure == ECOMMERCE:
        draw_ecommerce_plots(points, checks, dest)
    else:
        from .sweep import draw_plots, grid_values, load_experiment

        exp = load_experiment(experiment_file(figure))
        exp = exp.overridden(manifest.get("settings") or []).restricted(manifest.get("only") or [])
        tables = {
            spec.name: grid_values(exp, _read_csv(dest / f"{spec.name}.csv"))
            for spec in exp.plots
            if spec.kind == "cliff"
        }
        draw_plots(exp, grid_values(exp, points), checks, tables, dest)
    manifest["plots_redrawn"] = {"at": now_iso(), "build": build}
    (dest / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- reading the folder ----------------------------------------------------------------


def load_notes(directory: Path) -> dict:
    """A figure's hand-written notes.toml: {"text": str, "reasons": {"check | group": str}}."""
    path = Path(directory) / NOTES
    if not path.exists():
        return {"text": "", "reasons": {}}
    try:
        doc = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: {e}") from None
    return {"text": str(doc.get("text", "")), "reasons": dict(doc.get("reasons", {}))}


def figure_state(root: Path, figure: str) -> dict:
    """What the results page shows of one figure: manifest (None before its run), checks,
    plots, notes, and the paper's claim even when it has not run yet."""
    directory = Path(root) / figure
    manifest = None
    if (directory / MANIFEST).exists():
        manifest = json.loads((directory / MANIFEST).read_text())
    if figure == ECOMMERCE:
        claim, differences, title = (
            ECOMMERCE_CLAIM,
            ECOMMERCE_DIFFERENCES,
            "E-commerce storage study: block-level findings (browsing, TPC-C, TPC-W, RUBiS)",
        )
    else:
        from .sweep import load_experiment

        exp = load_experiment(experiment_file(figure))
        claim, differences, title = exp.claim, exp.differences, exp.title
    return {
        "figure": figure,
        "title": title,
        "claim": claim,
        "differences": differences,
        "command": COMMANDS[figure],
        "estimated_hours": ESTIMATED_HOURS[figure],
        "manifest": manifest,
        "checks": _read_csv(directory / CHECKS),
        "plots": [p for p in figure_plots(figure) if (directory / p).exists()],
        "tables": sorted(p.name for p in directory.glob("*.csv") if p.name != CHECKS),
        "notes": load_notes(directory),
    }


def is_results_root(directory: Path) -> bool:
    """A results folder (experiments/results), not a sweep directory."""
    d = Path(directory)
    if (d / "experiment.json").exists() or (d / "sweep.json").exists():
        return False
    return (d / "README.md").exists() or any((d / f / MANIFEST).exists() for f in FIGURES)
