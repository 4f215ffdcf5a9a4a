"""PNG plots of a run (time series) and of a sweep (metric against a swept knob)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on the hosts this runs on
import itertools

import matplotlib.pyplot as plt

from .units import MIB


def _rates(samples: list[dict], key: str) -> tuple[list[float], list[float]]:
    """Per-interval rate of a counter, placed at each interval's end."""
    ts, rates = [], []
    for a, b in itertools.pairwise(samples):
        dt = b["t"] - a["t"]
        if dt > 0:
            ts.append(b["t"])
            rates.append((b[key] - a[key]) / dt)
    return ts, rates


def run_plot(result, path: Path) -> None:
    """Requests/s and faults/s over the run, and resident memory against the budget."""
    samples = result.timeseries
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    t, req = _rates(samples, "requests")
    _, faults = _rates(samples, "faults")
    top.plot(t, req, label="requests/s (densevm)")
    top.plot(t, faults, label="faults/s")
    top.set_ylabel("per second")
    top.set_yscale("symlog")
    if result.model_rps:
        top.axhline(result.model_rps, color="k", linestyle="--", linewidth=1, label="model")
    top.legend(loc="best", fontsize=8)
    bottom.plot(
        [s["t"] for s in samples], [s["resident_bytes"] / MIB for s in samples], label="resident"
    )
    if result.budget_bytes:
        bottom.axhline(
            result.budget_bytes / MIB, color="r", linestyle="--", linewidth=1, label="budget"
        )
    bottom.set_ylabel("MiB")
    bottom.set_xlabel("seconds since densevm was ready")
    bottom.legend(loc="best", fontsize=8)
    for ax in (top, bottom):
        _shade_phases(ax, samples)
    c = result.config
    fig.suptitle(
        f"{c['vms']} VMs, alpha {c['alpha']}, block {c['block']}, {c['policy']}, disk {c['disk']}: "
        f"{result.regime or result.status}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _shade_phases(ax, samples: list[dict]) -> None:
    """Light background on the measurement phase."""
    ts = [s["t"] for s in samples if s["phase"] == "measure"]
    if ts:
        ax.axvspan(min(ts), max(ts), color="0.9", zorder=0)


def line_plot(
    rows: list[dict],
    x: str,
    ys: list[str],
    series: list[str],
    path: Path,
    title: str,
    logx: bool = False,
    logy: bool = False,
    ylabel: str | None = None,
) -> None:
    """One line per (series value, y metric) of y against x; rows are CSV-like dicts."""
    fig, ax = plt.subplots(figsize=(8, 5))
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(s) for s in series), []).append(row)
    for index, (key, group) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        group = sorted(group, key=lambda r: float(r[x]))
        for yi, y in enumerate(ys):
            points = [(float(r[x]), float(r[y])) for r in group if r.get(y) not in (None, "")]
            if not points:
                continue
            label = ", ".join(f"{s}={v}" for s, v in zip(series, key, strict=False))
            label = f"{label} {y}" if len(ys) > 1 else label
            # One colour per series; measured solid, the model (and other metrics) dashed/dotted.
            ax.plot(
                *zip(*points, strict=False),
                ("-", "--", ":")[yi % 3],
                color=f"C{index % 10}",
                marker="o",
                markersize=3,
                label=label.strip() or y,
            )
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or ", ".join(ys))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
