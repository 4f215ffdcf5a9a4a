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


def metrics_table(label: str, metrics: dict[str, Any], steady: str) -> str:
    """The study's columns for one run, with its steady-state verdict (``steady_verdict``)."""
    return _table(
        ["run", "steady", *HEADERS], [[label, steady, *(_fmt(metrics[c]) for c in STUDY_COLUMNS)]]
    )


def throughput_line(result: dict[str, Any]) -> str:
    tp = result["throughput"]
    rt = tp["response_ms"]
    # pgbench reports only the mean latency.
    percentiles = (
        f" p50 {rt['p50_ms']:.1f} p90 {rt['p90_ms']:.1f} p99 {rt['p99_ms']:.1f}"
        if rt["p99_ms"]
        else ""
    )
    return (
        f"throughput: {tp['per_minute']:.1f} {tp['per_minute_label']} ({tp['per_second']:.2f}/s), "
        f"{tp['completed']} completed, {tp['errors']} errors; response ms mean {rt['mean_ms']:.1f}"
        f"{percentiles}"
    )


def steady_verdict(result: dict[str, Any]) -> str:
    """Short form for tables: ``yes 95s``, ``NO (cap)``, ``NO (fixed)``, ``NO (none)``; ``?`` for
    results saved before steady state was recorded."""
    steady = result.get("steady")
    if not steady:
        return "?"
    if steady["reached"]:
        return f"yes {steady['steady_after_s']:.0f}s"
    return f"NO ({'cap' if steady['mode'] == 'detect' else steady['mode']})"


def steady_line(result: dict[str, Any]) -> str:
    """The run's steady-state verdict and its evidence, one line."""
    steady = result.get("steady")
    if not steady:
        return "steady state: not recorded (a result saved before scalebench-dbtrace/2)"
    if steady["mode"] == "none":
        return f"steady state: NOT reached ({steady['evidence']})"
    if steady["reached"]:
        return (
            f"steady state: reached after {steady['steady_after_s']:.0f} s of warm-up "
            f"({steady['evidence']})"
        )
    how = "fixed warm-up" if steady["mode"] == "fixed" else "cap reached"
    return f"steady state: NOT reached in {steady['warmup_s']:.0f} s ({how}; {steady['evidence']})"


def agreement_line(agreement: dict[str, Any]) -> str:
    """PostgreSQL's own I/O counters for the measured window beside the trace's sectors."""
    pg = agreement["pg"]

    def ratio(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f}"

    return (
        f"PostgreSQL ({pg['source']}) in the window: read {pg['read_sectors']} sectors, wrote "
        f"{pg['write_sectors']} data + {pg['wal_disk_sectors']} WAL sectors "
        f"({pg['wal_writes']} WAL writes of {pg['wal_sectors']} generated), "
        f"{pg['commits']} commits, "
        f"{pg['checkpoints']} checkpoint(s); trace/PostgreSQL sectors: reads "
        f"{ratio(agreement['read_ratio'])} (of its files; "
        f"{agreement['trace_read_sectors'] - agreement['trace_relation_read_sectors']} "
        f"sectors read elsewhere), writes {ratio(agreement['write_ratio'])}"
    )


def compare_table(
    results: list[dict[str, Any]], study: list[dict[str, str]], load: str = "heavy"
) -> str:
    """Each of our runs beside the study's row for the same benchmark and intensity."""
    from .run import READ_INTENSIVE, STUDY_NAMES

    rows = []
    for res in results:
        opts, metrics = res["options"], res.get("metrics")
        if not metrics or opts["workload"] not in READ_INTENSIVE:
            continue
        intensity = "read" if READ_INTENSIVE[opts["workload"]] == opts["mix"] else "write"
        bench = STUDY_NAMES[opts["workload"]]
        rows.append(
            [
                f"ours {bench} {opts['mix']}",
                steady_verdict(res),
                *(_fmt(metrics[c]) for c in STUDY_COLUMNS),
            ]
        )
        for ref in study:
            if ref["benchmark"] == bench and ref["intensity"] == intensity and ref["load"] == load:
                rows.append(
                    [f"study {bench} {load} {intensity}", "", *(ref[c] for c in STUDY_COLUMNS)]
                )
    return _table(["run", "steady", *HEADERS], rows)
