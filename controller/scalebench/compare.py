"""Regression check between two results (single runs or whole sweeps).

Gated, a regression when it moves the wrong way by more than the tolerance:
throughput (relative drop), the error rate (absolute rise beyond
ERROR_RATE_SLACK), and a point that failed or is missing. Shown but not gated:
latency (in a closed loop the median is concurrency / throughput, so it adds
nothing to the throughput check but its own noise), boot time and
measured/model (both move by 20-30% between identical runs on shared hosts).
Points that ran on different kinds of host are not comparable: `mixed_hosts`
names them, and the CLI refuses them unless told otherwise.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

# Identical 10 s runs differ by up to ~4% in throughput on these shared hosts;
# 7% passes them and still flags a 10% slowdown.
DEFAULT_TOLERANCE_PCT = 7.0
ERROR_RATE_SLACK = 0.001  # 0.1 percentage point of requests
HIGHER_BETTER, LOWER_BETTER = 1, -1
# (label, path in the result, better direction, gated)
METRICS = (
    ("throughput_rps", ("throughput_rps",), HIGHER_BETTER, True),
    ("latency p50 ms", ("latency_ms", "p50"), LOWER_BETTER, False),
    ("error rate", ("error_rate",), LOWER_BETTER, True),
    ("latency p99 ms", ("latency_ms", "p99"), LOWER_BETTER, False),
    ("boot_seconds", ("boot_seconds",), LOWER_BETTER, False),
    ("measured/model", ("measured_over_model",), HIGHER_BETTER, False),
)


@dataclass(frozen=True)
class Row:
    point: str
    metric: str
    base: float | None
    new: float | None
    delta_pct: float | None
    regression: bool
    gated: bool


def _get(doc: dict, path: tuple[str, ...]) -> float | None:
    if path == ("error_rate",):
        errors, replies = doc.get("errors"), doc.get("replies")
        if errors is None or replies is None:
            return None
        return errors / max(errors + replies, 1)
    for key in path:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(key)
    return doc if isinstance(doc, (int, float)) else None


def _points(doc: dict) -> dict[str, dict]:
    """A result is one point named "run"; a sweep document is its points by key."""
    if str(doc.get("schema", "")).startswith("scalebench.sweep/"):
        return doc["points"]
    return {"run": doc}


def load(path: Path) -> dict:
    doc = json.loads(Path(path).read_text())
    if not str(doc.get("schema", "")).startswith(("scalebench.result/", "scalebench.sweep/")):
        raise ValueError(f"{path}: not a scalebench result or sweep (schema {doc.get('schema')!r})")
    return doc


def mixed_hosts(base: dict, new: dict) -> list[tuple[str, str, str]]:
    """(point, base host kind, new host kind) for each point present in both that ran on different
    kinds
    of host; points whose results do not name their host's kind (older results) are not counted."""
    new_points = _points(new)
    mixed = []
    for point, b in _points(base).items():
        base_kind = (b.get("host") or {}).get("kind")
        new_kind = (new_points.get(point, {}).get("host") or {}).get("kind")
        if base_kind and new_kind and base_kind != new_kind:
            mixed.append((point, base_kind, new_kind))
    return mixed


def compare(base: dict, new: dict, tolerance_pct: float = DEFAULT_TOLERANCE_PCT) -> list[Row]:
    """Every metric of every point present in base, with its verdict."""
    rows = []
    base_points, new_points = _points(base), _points(new)
    for point, b in base_points.items():
        n = new_points.get(point)
        if n is None or n.get("status") != "ok":
            why = "missing" if n is None else f"status {n.get('status')}: {n.get('error')}"
            rows.append(Row(point, f"point {why}", None, None, None, True, True))
            continue
        for label, path, better, gated in METRICS:
            bv, nv = _get(b, path), _get(n, path)
            if bv is None or nv is None:
                continue
            delta = (nv - bv) / bv * 100 if bv else None
            if path == ("error_rate",):
                worse = nv - bv > ERROR_RATE_SLACK
            else:
                worse = delta is not None and -better * delta > tolerance_pct
            rows.append(Row(point, label, bv, nv, delta, gated and worse, gated))
    return rows


def print_table(rows: list[Row], tolerance_pct: float, console: Console | None = None) -> None:
    table = Table(title=f"scalebench compare (tolerance {tolerance_pct:g}%)")
    for col in ("point", "metric", "base", "new", "delta", "verdict"):
        table.add_column(col, justify="right" if col in ("base", "new", "delta") else "left")
    for r in rows:
        verdict = "[red]REGRESSION[/]" if r.regression else ("ok" if r.gated else "info")
        table.add_row(
            r.point,
            r.metric,
            _fmt(r.base),
            _fmt(r.new),
            "" if r.delta_pct is None else f"{r.delta_pct:+.1f}%",
            verdict,
        )
    (console or Console()).print(table)


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:,.4g}"


def regressed(rows: list[Row]) -> bool:
    return any(r.regression for r in rows)
