"""Text tables: one run's metrics, and ours beside the study's."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from .analysis import STUDY_COLUMNS

# A copy of shared/reference/ecommerce_block_metrics.csv (the study's Tables 8-11).
STUDY_CSV = Path(__file__).with_name("study_block_metrics.csv")
HEADERS = (
    "sectors read",
    "sectors written",
    "avg read stream",
    "avg write stream",
    "read seq",
    "write seq",
    "avg interarrival ms",
)


def load_study(path: Path = STUDY_CSV) -> list[dict[str, str]]:
    """The study's Tables 8-11."""
    with path.open(newline="") as src:
        return list(csv.DictReader(src))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [
        max(len(header[i]), *(len(r[i]) for r in rows)) if rows else len(header[i])
        for i in range(len(header))
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(header, widths, strict=False))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=False)) for r in rows]
    return "\n".join(lines)


def metrics_table(label: str, metrics: dict[str, Any]) -> str:
    """The study's columns for one run."""
    return _table(["run", *HEADERS], [[label, *(_fmt(metrics[c]) for c in STUDY_COLUMNS)]])


def throughput_line(result: dict[str, Any]) -> str:
    tp = result["throughput"]
    rt = tp["response_ms"]
    return (
        f"throughput: {tp['per_minute']:.1f} {tp['per_minute_label']} ({tp['per_second']:.2f}/s), "
        f"{tp['completed']} completed, {tp['errors']} errors; response ms mean {rt['mean_ms']:.1f} "
        f"p50 {rt['p50_ms']:.1f} p90 {rt['p90_ms']:.1f} p99 {rt['p99_ms']:.1f}"
    )


def compare_table(
    results: list[dict[str, Any]], study: list[dict[str, str]], load: str = "heavy"
) -> str:
    """Each of our runs beside the study's row for the same benchmark and intensity."""
    from .run import READ_INTENSIVE, STUDY_NAMES

    rows = []
    for res in results:
        opts, metrics = res["options"], res.get("metrics")
        if not metrics:
            continue
        intensity = "read" if READ_INTENSIVE[opts["workload"]] == opts["mix"] else "write"
        bench = STUDY_NAMES[opts["workload"]]
        rows.append([f"ours {bench} {opts['mix']}", *(_fmt(metrics[c]) for c in STUDY_COLUMNS)])
        for ref in study:
            if ref["benchmark"] == bench and ref["intensity"] == intensity and ref["load"] == load:
                rows.append([f"study {bench} {load} {intensity}", *(ref[c] for c in STUDY_COLUMNS)])
    return _table(["run", *HEADERS], rows)
