"""Acceptance checks of a sweep, declared in the experiment file as `[[check]]` tables.

Each check reads the sweep's CSV rows and yields one verdict per group of
points (points that differ only in the swept variable); the sweep writes them to
checks.csv, which the report shows. `only = {policy = "demand"}` restricts a
check to the points with those settings. Kinds:

- `rising`: y rises with x in every series (e.g. out-of-core throughput vs alpha).
- `flat_until_cliff`: in-core throughput within +-tolerance of its median, from
  `min_vms` up to the measured cliff.
- `cliff_matches_model`: measured cliff within +-tolerance of the model's.
- `disk_bound_past_cliff`: every point beyond the measured cliff is disk-bound.
- `model_agreement`: measured/model within +-within everywhere, and within
  +-most for more than half of the points; a point whose window came before the
  closed loop's steady state (`steady_window` False: the model's steady state is
  not what it measured) is left out and named.
- `above`: the `higher` policy's throughput above the `lower` one's at every
  disk-bound point with the same other settings.
- `cliff_later_with_smaller_x`: in every series, the measured cliff (over vms)
  never moves to fewer VMs as `x` shrinks, and the smallest x's is later than the
  largest's (Fig 9: smaller blocks delay the cliff); a group whose throughput
  never halves counts as a cliff at its largest vms.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass, field

from .tables import cliff_rows, group_by


@dataclass(frozen=True)
class CheckSpec:
    kind: str
    x: str = "vms"
    y: str = "throughput_rps"
    series: list[str] = field(default_factory=list)
    tolerance: float = 0.15
    min_vms: int = 0
    within: float = 0.35
    most: float = 0.15
    higher: str = "wsswap"
    lower: str = "demand"
    only: dict = field(default_factory=dict)

    def selects(self, row: dict) -> bool:
        return all(str(row.get(k)) == str(v) for k, v in self.only.items())


def _f(row: dict, key: str) -> float | None:
    v = row.get(key)
    return None if v in (None, "") else float(v)


def _verdict(check: str, group: str, ok: bool, detail: str) -> dict:
    return {"check": check, "group": group, "passed": "yes" if ok else "NO", "detail": detail}


def _label(series: list[str], key: tuple) -> str:
    return ", ".join(f"{s}={v}" for s, v in zip(series, key, strict=False)) or "all"


def run_checks(specs: list[CheckSpec], rows: list[dict]) -> list[dict]:
    ok_rows = [r for r in rows if r.get("status") == "ok" and _f(r, "throughput_rps") is not None]
    out: list[dict] = []
    for spec in specs:
        out += _CHECKS[spec.kind](spec, [r for r in ok_rows if spec.selects(r)])
    return out


def _rising(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    out = []
    for key, group in group_by(rows, spec.series).items():
        pts = sorted((_f(r, spec.x), _f(r, spec.y)) for r in group)
        falls = [(a, b) for a, b in itertools.pairwise(pts) if b[1] <= a[1]]
        out.append(
            _verdict(
                f"{spec.y} rises with {spec.x}",
                _label(spec.series, key),
                not falls,
                "; ".join(f"{a[0]:g}->{b[0]:g}: {a[1]:.4g}->{b[1]:.4g}" for a, b in falls)
                or " ".join(f"{y:.4g}" for _, y in pts),
            )
        )
    return out


def _cliffs(spec: CheckSpec, rows: list[dict]) -> list[tuple[tuple, list[dict], dict]]:
    cliffs = {tuple(c.get(s) for s in spec.series): c for c in cliff_rows(rows, spec.series)}
    return [(key, group, cliffs[key]) for key, group in group_by(rows, spec.series).items()]


def _flat_until_cliff(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    out = []
    for key, group, cliff in _cliffs(spec, rows):
        end = cliff["measured_cliff_vms"] or float("inf")
        flat = [_f(r, "throughput_rps") for r in group if spec.min_vms <= int(r["vms"]) < end]
        if not flat:
            out.append(
                _verdict(
                    "flat until the cliff", _label(spec.series, key), False, "no in-core points"
                )
            )
            continue
        mid = statistics.median(flat)
        worst = max(abs(t / mid - 1) for t in flat)
        out.append(
            _verdict(
                "flat until the cliff",
                _label(spec.series, key),
                worst <= spec.tolerance,
                f"{len(flat)} points, median {mid:,.0f}/s, worst {worst:+.1%} (limit "
                f"{spec.tolerance:.0%})",
            )
        )
    return out


def _cliff_matches_model(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    out = []
    for key, _, cliff in _cliffs(spec, rows):
        m, p = cliff["measured_cliff_vms"], cliff["model_cliff_vms"]
        ok = bool(m and p and abs(m / p - 1) <= spec.tolerance)
        out.append(
            _verdict(
                "cliff matches the model",
                _label(spec.series, key),
                ok,
                f"measured {m and round(m)}, model {p and round(p)} VMs (limit "
                f"{spec.tolerance:.0%})",
            )
        )
    return out


def _disk_bound_past_cliff(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    out = []
    for key, group, cliff in _cliffs(spec, rows):
        m = cliff["measured_cliff_vms"]
        past = [r for r in group if m and int(r["vms"]) > m]
        wrong = [r["vms"] for r in past if r.get("regime") != "disk-bound"]
        out.append(
            _verdict(
                "disk-bound past the cliff",
                _label(spec.series, key),
                bool(past) and not wrong,
                f"{len(past)} points past {m and round(m)} VMs"
                + (f"; in-core at {wrong}" if wrong else ""),
            )
        )
    return out


def _model_agreement(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    unsteady = [r for r in rows if str(r.get("steady_window")) == "False"]
    ratios = [
        _f(r, "measured_over_model")
        for r in rows
        if _f(r, "measured_over_model") and r not in unsteady
    ]
    if not ratios:
        return [_verdict("measured/model", "all", False, "no modeled points")]
    worst = max(abs(x - 1) for x in ratios)
    close = sum(abs(x - 1) <= spec.most for x in ratios)
    ok = worst <= spec.within and close > len(ratios) / 2
    left_out = (
        f"; left out, measured before the steady state: {', '.join(r['point'] for r in unsteady)}"
        if unsteady
        else ""
    )
    return [
        _verdict(
            "measured/model",
            "all",
            ok,
            f"{len(ratios)} points: worst {worst:+.0%} (limit {spec.within:.0%}), "
            f"{close} within {spec.most:.0%}; range {min(ratios):.2f}..{max(ratios):.2f}"
            + left_out,
        )
    ]


def _above(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    others = [s for s in spec.series if s != "policy"]
    out = []
    for key, group in group_by(
        [r for r in rows if r.get("regime") == "disk-bound"], others
    ).items():
        by_policy = {r["policy"]: _f(r, "throughput_rps") for r in group}
        hi, lo = by_policy.get(spec.higher), by_policy.get(spec.lower)
        if hi is None or lo is None:
            continue
        out.append(
            _verdict(
                f"{spec.higher} above {spec.lower}",
                _label(others, key),
                hi > lo,
                f"{hi:,.1f} vs {lo:,.1f} requests/s",
            )
        )
    return out or [
        _verdict(f"{spec.higher} above {spec.lower}", "all", False, "no disk-bound pairs")
    ]


def _cliff_later_with_smaller_x(spec: CheckSpec, rows: list[dict]) -> list[dict]:
    out = []
    for key, group in group_by(rows, spec.series).items():
        cliffs = []
        for c in cliff_rows(group, [spec.x]):
            past = max(int(r["vms"]) for r in group if str(r.get(spec.x)) == str(c.get(spec.x)))
            cliffs.append((float(c[spec.x]), c["measured_cliff_vms"] or float(past), c))
        cliffs.sort(key=lambda t: t[0])
        wrong = [(a, b) for a, b in itertools.pairwise(cliffs) if b[1] > a[1]]
        detail = "; ".join(
            f"{x:g}: {'>' if c['measured_cliff_vms'] is None else ''}{v:,.0f} VMs"
            for x, v, c in cliffs
        )
        out.append(
            _verdict(
                f"cliff later with smaller {spec.x}",
                _label(spec.series, key),
                len(cliffs) > 1 and not wrong and cliffs[0][1] > cliffs[-1][1],
                detail or "no points",
            )
        )
    return out


_CHECKS = {
    "rising": _rising,
    "flat_until_cliff": _flat_until_cliff,
    "cliff_matches_model": _cliff_matches_model,
    "disk_bound_past_cliff": _disk_bound_past_cliff,
    "model_agreement": _model_agreement,
    "above": _above,
    "cliff_later_with_smaller_x": _cliff_later_with_smaller_x,
}
KINDS = tuple(_CHECKS)
