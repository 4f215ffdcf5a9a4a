"""PNG plots of a run (time series) and of a sweep (metric against a swept knob)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on the hosts this runs on
import itertools
import textwrap

import matplotlib.pyplot as plt
from matplotlib.transforms import blended_transform_factory

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


PHASES = ("boot", "calibrate", "touch", "settle", "load")
_PHASE_COLOURS = {
    "boot": "#d9d9d9",
    "calibrate": "#fde0c5",
    "touch": "#d6e9f8",
    "settle": "#e3d7f0",
    "load": "#ffffff",
}
MEASUREMENT_LABEL = "measurement window"
# Characters of a 9-point heading line that fit over the axes of an 8-inch figure.
HEADING_CHARS = 95
# Characters of a 7-point monospace verdict line that fit across an 8-inch figure (about
# 137 at 4.2 points a character, less the margins), and the height such a line takes.
VERDICT_CHARS = 128
VERDICT_LINE_INCHES = 0.16
LIVE_LABEL = "VMs awake (live)"
UNSTEADY_LABEL = "x: window before the steady state (warm-up < a miss's wait)"
ZERO_LABEL = "v: none in the window (0 on a log axis)"


def phase_spans(result) -> list[tuple[str, float, float]]:
    """(phase, from, to) of the run's phases on the time series' clock: the run's timeline,
    or for results recorded before it, the phases the samples were tagged with (warm-up and
    measurement are the load phase; boot then ends at 0 and starts boot_seconds before)."""
    spans = [
        (e["phase"], float(e["from_s"]), float(e["to_s"]))
        for e in (getattr(result, "timeline", None) or [])
        if e.get("to_s") is not None
    ]
    if spans:
        return spans
    samples = result.timeseries or []
    if result.boot_seconds:
        spans.append(("boot", -float(result.boot_seconds), 0.0))
    for s in samples:
        phase = "load" if s["phase"] in ("warmup", "measure") else s["phase"]
        if phase == "boot":
            continue
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], s["t"])
        else:
            spans.append((phase, s["t"], s["t"]))
    return spans


def measurement_window(result) -> tuple[float, float] | None:
    m = (result.phases or {}).get("measure") or {}
    if m.get("from_s") is not None and m.get("to_s") is not None:
        return float(m["from_s"]), float(m["to_s"])
    ts = [s["t"] for s in result.timeseries or [] if s["phase"] == "measure"]
    return (min(ts), max(ts)) if ts else None


def run_plot(result, path: Path) -> list[str]:
    """Requests/s and faults/s over the run, resident memory against the budget and, with
    hibernation, the VMs awake and asleep, with the run's phases (boot, calibrate, touch,
    settle, load) labelled on the time axis and the measurement window named. Returns the
    labels drawn."""
    samples = result.timeseries
    hibernation = any("running" in s for s in samples)  # only runs with --idle-after sample it
    rows = 3 if hibernation else 2
    fig, axes = plt.subplots(rows, 1, figsize=(9, 3.25 * rows), sharex=True)
    top, memory = axes[0], axes[1]
    t, req = _rates(samples, "requests")
    _, faults = _rates(samples, "faults")
    top.plot(t, req, label="requests/s (densevm)")
    top.plot(t, faults, label="faults/s")
    top.set_ylabel("per second")
    top.set_yscale("symlog")
    if result.model_rps:
        top.axhline(result.model_rps, color="k", linestyle="--", linewidth=1, label="model")
    top.legend(loc="lower right", fontsize=8)
    memory.plot(
        [s["t"] for s in samples], [s["resident_bytes"] / MIB for s in samples], label="resident"
    )
    if result.budget_bytes:
        memory.axhline(
            result.budget_bytes / MIB, color="r", linestyle="--", linewidth=1, label="budget"
        )
    memory.set_ylabel("MiB")
    memory.legend(loc="center left", fontsize=8)
    if hibernation:
        _plot_awake(axes[2], samples)
    axes[-1].set_xlabel("seconds since densevm was ready (boot before 0)")
    labels = _draw_phases(fig, axes, phase_spans(result), measurement_window(result))
    if hibernation:
        labels.append(LIVE_LABEL)
    c = result.config
    fig.suptitle(
        f"{c['vms']} VMs, alpha {c['alpha']}, block {c['block']}, {c['policy']}, disk {c['disk']}: "
        f"{result.regime or result.status}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels


def _plot_awake(ax, samples: list[dict]) -> None:
    """The VMs awake (densevm's `running`) and hibernated at each sample."""
    rows = [s for s in samples if "running" in s]
    t = [s["t"] for s in rows]
    ax.plot(t, [s["running"] for s in rows], label=LIVE_LABEL)
    ax.plot(t, [s["hibernated"] for s in rows], linestyle="--", label="hibernated")
    ax.set_ylabel("VMs")
    ax.legend(loc="center left", fontsize=8)


def _draw_phases(fig, axes, spans, window) -> list[str]:
    """Each phase a band of its own colour, named above the top axes; the measurement window
    hatched and named below the bottom one."""
    from matplotlib.transforms import blended_transform_factory

    top, bottom = axes[0], axes[-1]
    labels = []
    if spans:
        lo, hi = min(a for _, a, _ in spans), max(b for _, _, b in spans)
        for ax in axes:
            ax.set_xlim(lo, hi + 0.02 * (hi - lo or 1))
    for i, (phase, a, b) in enumerate(spans):
        for ax in axes:
            ax.axvspan(a, b, color=_PHASE_COLOURS.get(phase, "0.95"), zorder=0, linewidth=0)
            ax.axvline(a, color="0.6", linewidth=0.6, zorder=1)
        trans = blended_transform_factory(top.transData, top.transAxes)
        top.text(
            (a + b) / 2,
            1.02 + 0.07 * (i % 2),  # alternate heights: short phases do not overlap
            phase,
            transform=trans,
            ha="center",
            va="bottom",
            fontsize=8,
        )
        labels.append(phase)
    if window:
        a, b = window
        trans = blended_transform_factory(bottom.transData, bottom.transAxes)
        for ax in axes:
            ax.axvspan(a, b, facecolor="none", edgecolor="0.4", hatch="//", alpha=0.35, zorder=0)
        bottom.text(
            (a + b) / 2,
            0.04,
            f"{MEASUREMENT_LABEL} ({b - a:.0f} s)",
            transform=trans,
            ha="center",
            va="bottom",
            fontsize=8,
            bbox={"facecolor": "white", "edgecolor": "0.6", "pad": 2},
        )
        labels.append(MEASUREMENT_LABEL)
    return labels


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
    claim: str = "",
    verdicts: list[tuple[bool, str]] | None = None,
) -> None:
    """One line per (series value, y metric) of y against x; rows are CSV-like dicts. A
    point measured before the closed loop's steady state (`steady_window` False) is crossed;
    on a log y axis a 0 is a triangle on the axis's bottom edge.

    `claim` (the paper's, which the figure reproduces) is shown under the title, and
    `verdicts` (passed, text) of the sweep's checks under the axes."""
    verdict_rows = _verdict_rows(verdicts or [])
    fig, ax = _figure(verdict_rows)
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        groups.setdefault(tuple(row.get(s) for s in series), []).append(row)
    # A log axis cannot show 0: such points sit on its bottom edge, as triangles.
    bottom = blended_transform_factory(ax.transData, ax.transAxes)
    marks: set[str] = set()
    for index, (key, group) in enumerate(sorted(groups.items(), key=lambda kv: str(kv[0]))):
        group = sorted(group, key=lambda r: float(r[x]))
        colour = f"C{index % 10}"
        for yi, y in enumerate(ys):
            valued = [r for r in group if r.get(y) not in (None, "")]
            if not valued:
                continue
            shown = [r for r in valued if not logy or float(r[y]) > 0]
            label = ", ".join(f"{s}={v}" for s, v in zip(series, key, strict=False))
            label = f"{label} {y}" if len(ys) > 1 else label
            # One colour per series; measured solid, the model (and other metrics) dashed/dotted.
            ax.plot(
                [float(r[x]) for r in shown],
                [float(r[y]) for r in shown],
                ("-", "--", ":")[yi % 3],
                color=colour,
                marker="o",
                markersize=3,
                label=label.strip() or y,
            )
            zeros = [float(r[x]) for r in valued if r not in shown]
            if zeros:
                ax.plot(
                    zeros, [0.0] * len(zeros), "v", color=colour, transform=bottom, clip_on=False
                )
                marks.add(ZERO_LABEL)
            unsteady = [r for r in valued if str(r.get("steady_window")) == "False"]
            for where, xy in (
                (ax.transData, [(float(r[x]), float(r[y])) for r in unsteady if r in shown]),
                (bottom, [(float(r[x]), 0.0) for r in unsteady if r not in shown]),
            ):
                if xy:
                    ax.plot(
                        *zip(*xy, strict=False),
                        "x",
                        color=colour,
                        ms=8,
                        transform=where,
                        clip_on=False,
                    )
                    marks.add(UNSTEADY_LABEL)
    for mark in sorted(marks):  # the markers' meaning, once each, after the series
        ax.plot([], [], mark[0], color="grey", label=mark)
    ax.set_xlabel(x)
    ax.set_ylabel(ylabel or ", ".join(ys))
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="best")
    _heading(ax, title, claim)
    _save(fig, verdict_rows, path)


def _heading(ax, title: str, claim: str) -> None:
    """The title over the axes, with the paper's claim under it, both wrapped to fit the
    8-inch figures: a 104-character title ran off the right edge unwrapped."""
    if not claim:
        ax.set_title(title)
        return
    lines = [textwrap.fill(title, HEADING_CHARS), textwrap.fill(f"Paper: {claim}", HEADING_CHARS)]
    ax.set_title("\n".join(lines), fontsize=9, loc="left")


def bar_plot(
    labels: list[str],
    bars: dict[str, list[float | None]],
    path: Path,
    title: str,
    ylabel: str,
    claim: str = "",
    verdicts: list[tuple[bool, str]] | None = None,
) -> None:
    """Grouped bars (one group per label, one bar per entry of `bars`; None: no bar), with the
    claim under the title and the verdicts under the axes as line_plot shows them."""
    verdict_rows = _verdict_rows(verdicts or [])
    fig, ax = _figure(verdict_rows)
    width = 0.8 / max(len(bars), 1)
    for i, (name, values) in enumerate(bars.items()):
        xs = [k + i * width for k, v in enumerate(values) if v is not None]
        ax.bar(xs, [v for v in values if v is not None], width, label=name, color=f"C{i}")
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(labels))], labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    _heading(ax, title, claim)
    _save(fig, verdict_rows, path)


def check_verdicts(checks: list[dict]) -> list[tuple[bool, str]]:
    """The verdicts a plot shows for checks.csv's rows: (passed, "check (group): detail")."""
    return [(c["passed"] == "yes", f"{c['check']} ({c['group']}): {c['detail']}") for c in checks]


def _verdict_rows(verdicts: list[tuple[bool, str]]) -> list[tuple[bool, str]]:
    """The lines the verdicts take under the axes: each "PASS"/"FAIL" and its text, wrapped
    to VERDICT_CHARS (its continuation lines indented), so that none runs off the figure."""
    rows = []
    for passed, text in verdicts:
        lines = textwrap.wrap(
            f"{'PASS' if passed else 'FAIL'}  {text}", VERDICT_CHARS, subsequent_indent="      "
        )
        rows += [(passed, line) for line in lines]
    return rows


def _figure(rows: list[tuple[bool, str]]):
    """An 8-inch figure and its axes, with room below them for the verdict rows."""
    return plt.subplots(figsize=(8, 5 + VERDICT_LINE_INCHES * len(rows)))


def _save(fig, rows: list[tuple[bool, str]], path: Path) -> None:
    """Writes the verdict rows under the axes, and the figure to `path`."""
    line = VERDICT_LINE_INCHES / fig.get_figheight()
    for i, (passed, text) in enumerate(rows):
        fig.text(
            0.01,
            0.01 + line * (len(rows) - 1 - i),
            text,
            fontsize=7,
            color="tab:green" if passed else "tab:red",
            family="monospace",
        )
    fig.tight_layout(rect=(0, line * len(rows) + 0.01, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)
