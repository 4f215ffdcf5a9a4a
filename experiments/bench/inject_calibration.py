#!/usr/bin/env python3
"""What a size of the nightly's injected slowdown does on this host, measured on a nightly probe.

`scalebench nightly --inject-request-us N` / `--inject-fault-us N` are checked against the
slowdown they cause, not their size (README "Nightly regression check"): a slower event loop
serves more requests per wake-up, and fault work costs more than its size. This boots the
probe of experiments/nightly/metrics.toml once per size per round, sizes interleaved (the
order reversed every other round, so a drifting host favours none), and prints each size's
median of each field over all windows, with its bootstrap CI and its change against size 0.

Usage: experiments/bench/inject_calibration.py --kind request|fault --sizes 0,10,20
       [--probe incore16] [--fields replies_per_s,monitor_us_per_reply] [--rounds 2]
       [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.changepoint import estimate  # noqa: E402
from scalebench.nightly import METRICS, load_spec, run_probe  # noqa: E402
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import Build  # noqa: E402

RELEASE = ROOT / "target" / "release"


def main() -> int:
    install_signal_handlers()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=("request", "fault"), required=True)
    ap.add_argument("--sizes", required=True, help="comma-separated µs, 0 included as the base")
    ap.add_argument("--probe", default="incore16")
    ap.add_argument("--fields", default="replies_per_s", help="comma-separated probe fields")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = sorted({int(s) for s in args.sizes.split(",")} | {0})
    spec = load_spec(METRICS)
    if args.probe not in spec.probes:
        ap.error(f"unknown probe {args.probe!r} (see {METRICS})")
    probe = spec.probes[args.probe]
    fields = args.fields.split(",")
    flag = f"--inject-{args.kind}-us"
    values = {name: {size: [] for size in sizes} for name in fields}
    with tempfile.TemporaryDirectory(prefix="inject-cal-", dir=ROOT / "target") as tmp:
        for r in range(args.rounds):
            for size in sizes if r % 2 == 0 else reversed(sizes):
                extra = (flag, str(size)) if size else ()
                got = run_probe(
                    Build.in_dir(RELEASE, extra), probe, Path(tmp) / str(size), spec.addr_base
                )
                missing = [name for name in fields if name not in got]
                if missing:
                    ap.error(f"probe {args.probe} does not measure {', '.join(missing)}")
                for name in fields:
                    values[name][size] += got[name]
                medians = ", ".join(f"{statistics.median(got[n]):,.1f}" for n in fields)
                print(f"round {r + 1}: {flag} {size}: {medians}", file=sys.stderr)
    rows = []
    for name in fields:
        base = statistics.median(values[name][0])
        print(f"{args.probe} {name}, {args.rounds} boots x {probe.windows} windows per size:")
        for size in sizes:
            e = estimate(values[name][size])
            change = e.median / base - 1
            rows.append(
                {
                    "field": name,
                    "size_us": size,
                    "median": e.median,
                    "ci": [e.ci_low, e.ci_high],
                    "change": change,
                }
            )
            print(
                f"  {flag} {size:>4}: {e.median:>10,.1f} "
                f"[{e.ci_low:,.1f}, {e.ci_high:,.1f}] {change:+.1%}"
            )
    if args.json:
        args.json.write_text(json.dumps({"probe": args.probe, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
