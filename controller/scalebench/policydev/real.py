"""`scalebench policy compare --real`: the simulator's best points rerun on densevm.

For each policy, the synthetic grid points where pagesim predicted its highest
throughput are run again as real scalebench runs (densevm + zipfperf, the same
VMs, memory, block, alpha, policy and disk), and the two are shown side by
side: request hit ratio and throughput, simulated against measured. Trace
workloads are not rerun: a trace fixes its own VMs and working sets, which a
synthetic real run does not reproduce.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from .. import runner
from ..config import RunConfig, validate
from .grid import GridSpec, PointResult, policy_label


@dataclass
class RealPoint:
    """One grid point, simulated and measured."""

    policy: str  # the grid's label
    block: str
    alpha: float
    sim_hit_ratio: float | None
    sim_rps: float | None
    real_hit_ratio: float | None = None
    real_rps: float | None = None
    run_dir: str = ""
    error: str = ""

    @property
    def measured_over_sim(self) -> float | None:
        if self.real_rps is None or not self.sim_rps:
            return None
        return self.real_rps / self.sim_rps


def best_points(points: list[PointResult], per_policy: int) -> list[PointResult]:
    """Each policy's `per_policy` synthetic points of highest predicted throughput."""
    chosen: list[PointResult] = []
    for policy in dict.fromkeys(p.policy for p in points):
        ranked = sorted(
            (
                p
                for p in points
                if p.policy == policy and p.alpha is not None and p.predicted_rps is not None
            ),
            key=lambda p: -(p.predicted_rps or 0.0),
        )
        chosen += ranked[:per_policy]
    return chosen


def run_config(
    spec: GridSpec, point: PointResult, out: Path, duration: float, addr_base: str
) -> RunConfig:
    """The real run of a grid point (validated: a bad setting fails before anything starts).
    A point names its policy by label; the run gets the policy as the grid ran it."""
    assert point.alpha is not None
    policy = next(p for p in spec.policies if policy_label(p) == point.policy)
    label = f"{point.policy}-{point.block}-alpha{point.alpha:g}"
    return validate(
        RunConfig(
            vms=spec.vms,
            alpha=point.alpha,
            block=point.block,
            mem=spec.mem,
            policy=policy,
            disk=spec.disk,
            duration=duration,
            seed=spec.seed,
            addr_base=addr_base,
            out=str(out / "real" / label),
            labels={"policy_compare": label},
        )
    )


def rerun(
    spec: GridSpec,
    chosen: list[PointResult],
    out: Path,
    duration: float,
    addr_base: str,
    progress: Callable[[int, int, RealPoint], None] | None = None,
) -> list[RealPoint]:
    """Runs each chosen point on densevm, one after the other (each run takes the host)."""
    results = []
    for i, point in enumerate(chosen, 1):
        cfg = run_config(spec, point, out, duration, addr_base)
        real = RealPoint(
            policy=point.policy,
            block=point.block,
            alpha=point.alpha or 0.0,
            sim_hit_ratio=point.request_hit_ratio,
            sim_rps=point.predicted_rps,
            run_dir=cfg.out or "",
        )
        r = runner.run(cfg)
        if r.status == "ok":
            real.real_hit_ratio, real.real_rps = r.hit_ratio, r.throughput_rps
        else:
            real.error = r.error or "run failed"
        results.append(real)
        if progress:
            progress(i, len(chosen), real)
    return results


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(real: list[RealPoint]) -> str:
    """Simulated against measured, one line per point."""
    head = (
        f"{'policy':<14} {'block':>6} {'alpha':>5}  {'hit sim':>7} {'hit real':>8}  "
        f"{'req/s sim':>10} {'req/s real':>10} {'real/sim':>8}"
    )
    lines = [head, "-" * len(head)]
    for p in real:
        lines.append(
            f"{p.policy:<14} {p.block:>6} {p.alpha:>5g}  "
            f"{_fmt(p.sim_hit_ratio, '.3f'):>7} {_fmt(p.real_hit_ratio, '.3f'):>8}  "
            f"{_fmt(p.sim_rps, '.1f'):>10} {_fmt(p.real_rps, '.1f'):>10} "
            f"{_fmt(p.measured_over_sim, '.2f'):>8}" + (f"  error: {p.error}" if p.error else "")
        )
    return "\n".join(lines)


def write_csv(path: Path, real: list[RealPoint]) -> None:
    """real.csv: every point's simulated and measured figures and its run directory."""
    names = [f.name for f in fields(RealPoint)] + ["measured_over_sim"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=names)
        w.writeheader()
        for p in real:
            w.writerow({**asdict(p), "measured_over_sim": p.measured_over_sim})
