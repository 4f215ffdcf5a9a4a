#!/usr/bin/env python3
"""The model's hit ratio and throughput beside pagesim's (the pager's own trace-driven simulator).

pagesim replays a synthetic Zipf request stream through the real policy code
and disk model, one request after another. Che's hit ratio should match its
hit ratio closely at every point. Throughput differs by design for demand: a
single request stream faults a VM's blocks back to back, which the disk model
serves sequentially, while under the main job's 64 concurrent requests the
faults of many cold VMs interleave and each block read is a random one, as
Denali's model assumes; wsswap's sequential read is the same in both.

Usage: experiments/bench/scalebench_model_vs_pagesim.py [--requests N] [--disk hdd]
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from scalebench.disks import disk_model
from scalebench.model import ModelInput, estimate_footprint, estimate_written, predict
from scalebench.units import KIB, parse_size

PAGESIM = Path(__file__).resolve().parents[2] / "target" / "release" / "pagesim"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=300_000)
    ap.add_argument("--vms", type=int, default=4000)
    ap.add_argument("--disk", default="hdd")
    ap.add_argument("--cpu-us", type=float, default=30.0)
    ap.add_argument("--fault-us", type=float, default=100.0)
    args = ap.parse_args()
    print(
        f"{'policy':7} {'alpha':>5} {'block':>5} {'hit che':>8} {'hit sim':>8} {'model rps':>10} "
        f"{'sim rps':>9}"
    )
    for policy in ("demand", "wsswap"):
        for alpha, block in [(a, "32k") for a in (0.0, 0.5, 1.0, 1.5)] + [
            (1.0, b) for b in ("4k", "16k", "128k")
        ]:
            sim = json.loads(
                subprocess.run(
                    [
                        str(PAGESIM),
                        "--vms",
                        str(args.vms),
                        "--alpha",
                        str(alpha),
                        "--block",
                        block,
                        "--policy",
                        policy,
                        "--disk",
                        args.disk,
                        "--requests",
                        str(args.requests),
                        "--warmup",
                        str(args.requests // 3),
                        "--cpu-us",
                        str(args.cpu_us),
                        "--fault-us",
                        str(args.fault_us),
                        "--json",
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
            )
            b = parse_size(block)
            p = predict(
                ModelInput(
                    args.vms,
                    alpha,
                    b,
                    parse_size("1G"),
                    estimate_footprint(896 * KIB, b),
                    policy,
                    disk_model(args.disk),
                    args.cpu_us * 1e-6,
                    None,
                    args.fault_us * 1e-6,
                    estimate_written(896 * KIB, b),
                    in_flight=1,  # pagesim replays one request after another
                )
            )
            print(
                f"{policy:7} {alpha:5.2f} {block:>5} {p.hit_ratio:8.3f} {sim['hit_ratio']:8.3f} "
                f"{p.model_rps:10.1f} {sim['predicted_rps']:9.1f}"
            )


if __name__ == "__main__":
    main()
