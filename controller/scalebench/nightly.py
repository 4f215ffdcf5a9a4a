"""`scalebench nightly`: a small fixed sweep compared with a stored baseline.

The sweep is experiments/nightly.toml (a few VMs, short phases), run REPEATS
times; each point counts with its best run, because load from other tenants of
a shared host only ever slows a run down (identical single runs here differed
by up to 40%). The baseline is experiments/baselines/nightly.json, written by
`scalebench nightly --update-baseline` on a build known to be good.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path

from . import compare, runner
from .config import REPO_ROOT, ConfigError, check_addresses_free
from .progress import Reporter
from .sweep import load_experiment, run_sweep

EXPERIMENT = REPO_ROOT / "experiments" / "nightly.toml"
BASELINE = REPO_ROOT / "experiments" / "baselines" / "nightly.json"
REPEATS = 3


def busy_host() -> str | None:
    """Why throughput measured now would not be comparable, or None: a load average above the
    number of CPUs means other work takes CPU time from the runs (both best-of-3 nightly runs
    made under other sweeps measured ~20% slow)."""
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus:
        return (
            f"the host is busy (load average {load:.1f} on {cpus} CPUs): throughput will read low "
            f"and a baseline written now would be too"
        )
    return None


def best_of(docs: list[dict]) -> dict:
    """One sweep document whose points are each point's highest-throughput successful run."""

    def score(point: dict) -> tuple[bool, float]:
        return point.get("status") == "ok", point.get("throughput_rps") or 0.0

    points = {
        key: max((d["points"][key] for d in docs if key in d["points"]), key=score)
        for key in docs[0]["points"]
    }
    return {**docs[0], "points": points, "repeats": len(docs)}


def nightly(
    out_dir: Path | None,
    update_baseline: bool,
    tolerance_pct: float,
    reporter: Reporter,
    experiment: Path = EXPERIMENT,
    baseline: Path = BASELINE,
    repeats: int = REPEATS,
) -> int:
    """Run the nightly sweep; 0 when it matches the baseline (or the baseline was updated), 1
    otherwise."""
    exp = load_experiment(experiment)
    check_addresses_free(max((cfg for _, cfg in exp.points()), key=lambda cfg: cfg.vms))
    if not update_baseline and not baseline.exists():
        raise ConfigError(
            f"no baseline at {baseline}: run `scalebench nightly --update-baseline` on a good build"
        )
    busy = busy_host()
    if busy:
        reporter.note(f"[yellow]warning:[/] {busy}")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    out_dir = out_dir or Path.cwd() / "runs" / f"nightly-{stamp}"
    docs = [
        run_sweep(exp, out_dir / f"run{i + 1}", lambda cfg: runner.run(cfg, reporter), reporter)
        for i in range(repeats)
    ]
    doc = {**best_of(docs), "host_load": list(os.getloadavg()), "busy_host": busy}
    (out_dir / "nightly.json").write_text(json.dumps(doc, indent=2, default=str) + "\n")
    failed = [k for k, p in doc["points"].items() if p.get("status") != "ok"]
    if update_baseline:
        if failed:
            reporter.note(f"not updating the baseline: point(s) failed: {', '.join(failed)}")
            return 1
        baseline.parent.mkdir(parents=True, exist_ok=True)
        baseline.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        reporter.note(f"baseline written to {baseline}")
        return 0
    rows = compare.compare(compare.load(baseline), doc, tolerance_pct)
    compare.print_table(rows, tolerance_pct)
    return 1 if compare.regressed(rows) else 0
