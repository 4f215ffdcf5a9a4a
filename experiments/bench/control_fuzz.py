#!/usr/bin/env python3
"""The control API under fuzzing for minutes: random bytes, huge lines, floods
of short lines, never-reading and slow clients, 1,000 clients at once
(tests/support/control_fuzz.py), against densevm with 100 VMs. Prints the
monitor's RSS over time and its growth after the first minute (the warm-up
that sets the allocator's high-water marks). Acceptance (issue 14): 10
minutes without a monitor restart, RSS growth under 5%.

Usage: experiments/bench/control_fuzz.py [--minutes 10] [--vms 100]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "controller"))
from support.control_fuzz import fuzz  # noqa: E402
from support.densevm import start  # noqa: E402


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--vms", type=int, default=100)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        m = start(Path(tmp), args.vms, "127.231.0.0")
        try:
            samples = []
            for minute in range(int(args.minutes)):
                result = fuzz(m.api, seconds=60, seed=minute)
                alive = m.proc.poll() is None
                samples.append(rss_kib(m.proc.pid) if alive else 0)
                print(
                    f"minute {minute + 1}: RSS {samples[-1]} KiB, {result.attacks} attacks, "
                    f"good client {result.good_requests - result.good_failures}/"
                    f"{result.good_requests} answered, monitor {'up' if alive else 'DEAD'}",
                    flush=True,
                )
                if not alive:
                    return 1
        finally:
            m.stop()
    growth = (samples[-1] - samples[0]) / samples[0] * 100 if len(samples) > 1 else 0.0
    print(f"RSS after minute 1: {samples[0]} KiB, at the end: {samples[-1]} KiB ({growth:+.1f}%)")
    print(f"target: growth < 5%: {'met' if growth < 5 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
