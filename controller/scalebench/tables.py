"""Tables derived from a sweep's rows (CSV-like dicts): groups and cliff positions."""

from __future__ import annotations

import itertools
import statistics

from .model import CLIFF_FRACTION


def group_by(rows: list[dict], keys: list[str]) -> dict[tuple, list[dict]]:
    """Rows grouped by their values of `keys`, in first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return groups


def cliff_rows(rows: list[dict], series: list[str]) -> list[dict]:
    """Per group of points that differ only in vms: measured and modeled cliff positions.

    Measured: the vms at which throughput first falls below CLIFF_FRACTION of the
    best throughput at fewer VMs, interpolated linearly between the two grid
    points around the crossing. None when it never falls.
    """
    groups = group_by(
        [r for r in rows if r.get("status") == "ok" and r.get("throughput_rps") not in (None, "")],
        series,
    )
    out = []
    for key, group in groups.items():
        group.sort(key=lambda r: int(r["vms"]))
        measured, best = None, 0.0
        for prev, cur in itertools.pairwise(group):
            best = max(best, float(prev["throughput_rps"]))
            level = CLIFF_FRACTION * best
            if float(cur["throughput_rps"]) < level:
                tp, tc = float(prev["throughput_rps"]), float(cur["throughput_rps"])
                vp, vc = int(prev["vms"]), int(cur["vms"])
                measured = vp + (vc - vp) * (tp - level) / (tp - tc) if tp > level else vp
                break
        models = [float(r["cliff_vms"]) for r in group if r.get("cliff_vms") not in (None, "")]
        model = statistics.median(models) if models else None
        out.append(
            {
                **dict(zip(series, key, strict=False)),
                "measured_cliff_vms": measured,
                "model_cliff_vms": model,
                "measured_over_model": measured / model if measured and model else None,
            }
        )
    return out
