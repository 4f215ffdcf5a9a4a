#!/usr/bin/env python3
"""How fast pagesim replays with a policy written in Python: simulated requests per second
for the trivial Python policy (`Fifo`), the Python mirror of `demand` and, for reference,
the Rust `demand`, with each one's hit ratio, on the shipped traces.

A Python policy costs one Python call per notification (on_access per request; on_fault,
on_installed, choose_victims and on_evicted per fault and eviction), so its speed depends
on how many faults a request takes: the table prints faults per request beside the speed.
Each figure is the best of --repeats runs (the host is shared), per wall second and per
CPU second of this process. Needs `make build` (the pagesim extension).

Usage: experiments/bench/python_policy_speed.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import pagesim

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.policydev.pypolicy import Demand, Fifo, Policy  # noqa: E402

TRACES = ROOT / "experiments" / "traces"
# (trace, budget): mostly hits, all in core, a recorded densevm run, heavy paging.
SETTINGS = [
    ("zipf-4000vm-a1.5.trace", "1G"),
    ("zipf-4000vm-a1.0.trace", "4G"),
    ("densevm-128vm-a1.0.trace", "64M"),
    ("zipf-4000vm-a1.0.trace", "1G"),
]
POLICIES: dict[str, type[Policy] | str] = {
    "rust demand": "demand",
    "py fifo": Fifo,
    "py demand": Demand,
}


@dataclass
class Row:
    trace: str
    mem: str
    policy: str
    hit_ratio: float
    faults_per_request: float
    requests_per_second: float
    requests_per_cpu_second: float


def measure(trace: str, mem: str, label: str, policy: type[Policy] | str, repeats: int) -> Row:
    runs = [
        pagesim.simulate(
            policy if isinstance(policy, str) else policy(), trace=TRACES / trace, mem=mem
        )
        for _ in range(repeats)
    ]
    r = runs[0]
    return Row(
        trace,
        mem,
        label,
        r["hit_ratio"],
        r["faults"] / r["requests"],
        max(x["sim_requests_per_second"] for x in runs),
        max(x["sim_requests_per_cpu_second"] for x in runs),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()
    rows = []
    print(
        f"{'trace':26} {'mem':>4} {'policy':12} {'hit ratio':>9} {'faults/req':>10} "
        f"{'req/s':>10} {'req/CPU s':>10}"
    )
    for trace, mem in SETTINGS:
        for label, policy in POLICIES.items():
            row = measure(trace, mem, label, policy, args.repeats)
            rows.append(row)
            print(
                f"{trace:26} {mem:>4} {label:12} {row.hit_ratio:9.4f} "
                f"{row.faults_per_request:10.2f} {row.requests_per_second:10.0f} "
                f"{row.requests_per_cpu_second:10.0f}",
                flush=True,
            )
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


if __name__ == "__main__":
    main()
