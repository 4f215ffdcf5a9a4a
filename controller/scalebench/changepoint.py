"""Statistics of the nightly check: medians with bootstrap confidence intervals
(scipy.stats.bootstrap) and change points in a metric's history (E-Divisive, MongoDB's
signal-processing-algorithms package).

A metric's history is a list of runs, each a list of trial values (oldest first). E-Divisive runs
on the trial values laid end to end; a regression is a change point that lands on the newest
run (within PLACEMENT trials of its start: the estimator places a step to within a trial or
two) or inside the run before it (past its first PLACEMENT trials; anywhere in it if that run was
judged too noisy, since its own steps were not reported then), whose change is in the
metric's bad direction, larger than NOISE_FACTOR times the metric's own run-to-run noise (the
spread of the earlier runs' medians since the previous change point, or of all earlier runs when
fewer than MIN_RUNS follow it), and whose newest-run confidence interval excludes the median of
the whole runs before the change point.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np
from scipy.stats import bootstrap
from signal_processing_algorithms.energy_statistics.energy_statistics import e_divisive

CONFIDENCE = 0.95
PVALUE = 0.05
PERMUTATIONS = 100
PLACEMENT = 2
NOISE_FACTOR = 1.5
MIN_RUNS = 4  # earlier runs needed before a change can be told from noise
TOO_SHORT = "history too short"
SEED = 19  # E-Divisive's permutation test and the bootstrap are seeded: same data, same verdict


@dataclass(frozen=True)
class Estimate:
    median: float
    ci_low: float
    ci_high: float
    n: int

    @property
    def rel_halfwidth(self) -> float:
        return (self.ci_high - self.ci_low) / 2 / abs(self.median) if self.median else 0.0


def estimate(values: list[float]) -> Estimate:
    """Median and its percentile-bootstrap confidence interval (scipy.stats.bootstrap)."""
    if not values:
        raise ValueError("no values")
    med = float(statistics.median(values))
    if len(values) < 2 or min(values) == max(values):
        return Estimate(med, med, med, len(values))
    res = bootstrap(
        (np.asarray(values, dtype=float),),
        np.median,
        confidence_level=CONFIDENCE,
        n_resamples=2000,
        method="percentile",
        random_state=SEED,
    )
    ci = res.confidence_interval
    return Estimate(med, float(ci.low), float(ci.high), len(values))


def ratio_estimate(new: list[float], old: list[float]) -> Estimate:
    """median(new) / median(old) with a bootstrap CI over both samples (A/B comparisons)."""
    med = float(statistics.median(new) / statistics.median(old))
    if min(len(new), len(old)) < 2:
        return Estimate(med, med, med, len(new))
    res = bootstrap(
        (np.asarray(new, dtype=float), np.asarray(old, dtype=float)),
        lambda a, b, axis=-1: np.median(a, axis=axis) / np.median(b, axis=axis),
        confidence_level=CONFIDENCE,
        n_resamples=2000,
        method="percentile",
        random_state=SEED,
    )
    ci = res.confidence_interval
    return Estimate(med, float(ci.low), float(ci.high), len(new))


def change_points(values: list[float]) -> list[int]:
    """Indices where E-Divisive finds the distribution of `values` changes (sorted)."""
    if len(values) < 4:
        return []
    np.random.seed(SEED)
    return sorted(int(i) for i in e_divisive(values, pvalue=PVALUE, permutations=PERMUTATIONS))


@dataclass(frozen=True)
class Finding:
    """What the history says about a metric's newest run."""

    metric: str
    regression: bool
    reason: str
    change: float | None = None  # relative, newest median vs the earlier median
    newest: Estimate | None = None
    earlier_median: float | None = None
    noise: float | None = None  # relative run-to-run spread of the earlier medians
    change_point: int | None = None  # trial index, in the concatenated series


def run_noise(medians: list[float]) -> float:
    """Relative run-to-run spread of run medians: 1.4826 * MAD / median (robust sigma)."""
    center = statistics.median(medians)
    mad = statistics.median(abs(m - center) for m in medians)
    return 1.4826 * mad / abs(center) if center else 0.0


def assess(
    metric: str, runs: list[list[float]], higher_is_better: bool, previous_noisy: bool = False
) -> Finding:
    """Is the newest run of `runs` a regression of `metric`? `previous_noisy`: the run before it
    was judged too noisy, so a step at its start was not reported then."""
    if len(runs) <= MIN_RUNS:
        return Finding(metric, False, f"{TOO_SHORT} ({len(runs) - 1} earlier run(s))")
    series = [v for run in runs for v in run]
    ends = np.cumsum([len(r) for r in runs])
    newest_start, previous_start = int(ends[-2]), int(ends[-2]) - len(runs[-2])
    cps = change_points(series)
    # A step the estimator places inside the previous run (its later rounds already shifted)
    # counts too: judged on the newest run alone, it would never be raised on any later night.
    # A step at the start of the previous run was that run's to report, unless the host explained
    # it then: if the host has recovered since and the step stayed, it is the build's.
    if previous_noisy:
        first = previous_start - PLACEMENT
    else:
        first = min(previous_start + PLACEMENT + 1, newest_start - PLACEMENT)
    landed = [c for c in cps if c >= first]
    newest = estimate(runs[-1])
    if not landed:
        return Finding(metric, False, "no change point on the newest run", newest=newest)
    cp = landed[0]
    prior = max((c for c in cps if c < cp), default=0)
    # The whole earlier runs since the previous change point, up to this one.
    earlier = [
        r
        for r, end in zip(runs[:-1], ends[:-1], strict=True)
        if end - len(r) >= prior and end <= cp + PLACEMENT
    ]
    if len(earlier) < 2:
        earlier = runs[-3:-1]
    base = statistics.median(v for r in earlier for v in r)
    # Noise from too few runs reads near zero: then every earlier run counts (conservative).
    noise_runs = earlier if len(earlier) >= MIN_RUNS else runs[:-1]
    change = newest.median / base - 1
    noise = run_noise([statistics.median(r) for r in noise_runs])
    worse = change < 0 if higher_is_better else change > 0
    outside = not newest.ci_low <= base <= newest.ci_high
    regression = worse and abs(change) > NOISE_FACTOR * noise and outside
    if not worse:
        reason = "change point on the newest run, in the good direction"
    elif not abs(change) > NOISE_FACTOR * noise:
        reason = f"change within {NOISE_FACTOR:g}x the metric's noise ({noise:.1%})"
    elif not outside:
        reason = "the newest confidence interval holds the earlier median"
    elif cp <= previous_start + PLACEMENT:
        reason = "change point where the previous, too noisy run began; beyond the noise now"
    elif cp < newest_start - PLACEMENT:
        reason = "change point in the previous run, beyond the metric's noise in the newest"
    else:
        reason = "change point on the newest run, beyond the metric's noise"
    return Finding(metric, regression, reason, change, newest, base, noise, cp)


def assess_host(metric: str, runs: list[list[float]], higher_is_better: bool) -> Finding:
    """Did the host measure slower in the newest run of `runs`? A host metric needs no change
    point: the newest median worse than the earlier runs' median by more than NOISE_FACTOR times
    their run-to-run noise, with a confidence interval that excludes it, is enough, since it only
    ever turns a suspected regression into "host too noisy"."""
    if len(runs) <= MIN_RUNS:
        return Finding(metric, False, f"{TOO_SHORT} ({len(runs) - 1} earlier run(s))")
    medians = [statistics.median(r) for r in runs[:-1]]
    base = statistics.median(medians)
    newest = estimate(runs[-1])
    change = newest.median / base - 1
    noise = run_noise(medians)
    worse = change < 0 if higher_is_better else change > 0
    outside = not newest.ci_low <= base <= newest.ci_high
    slower = worse and abs(change) > NOISE_FACTOR * noise and outside
    reason = "host slower than in earlier runs" if slower else "host as in earlier runs"
    return Finding(metric, slower, reason, change, newest, base, noise)
