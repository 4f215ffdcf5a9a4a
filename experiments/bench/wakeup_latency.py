#!/usr/bin/env python3
"""What a wake-up between two threads costs on this host, by how long the woken core was idle.

Two threads pass a byte back and forth over a pipe, the other one pinned to another CPU (or
the same one), once every --gaps microseconds; printed per gap: the round trip's p10, p50 and
p90 (two wake-ups). On a host that is itself a VM, a core left idle is halted in the
hypervisor below, and waking it costs far more than waking a busy one: every hop of a wake's
path (client, cell, parent, pager, disk completion) pays it, the awake baseline included.

Usage: experiments/bench/wakeup_latency.py [--gaps 100,1000,10000] [--trips 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time


def round_trips(peer_cpu: int, own_cpu: int, gap_us: int, trips: int) -> list[float]:
    """Microseconds of each round trip to a thread on `peer_cpu`, `gap_us` apart."""
    to_peer, from_peer = os.pipe(), os.pipe()

    def peer() -> None:
        os.sched_setaffinity(0, {peer_cpu})
        while os.read(to_peer[0], 1):
            os.write(from_peer[1], b"x")

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    os.sched_setaffinity(0, {own_cpu})
    times = []
    for _ in range(trips):
        time.sleep(gap_us / 1e6)
        t0 = time.perf_counter()
        os.write(to_peer[1], b"x")
        os.read(from_peer[0], 1)
        times.append((time.perf_counter() - t0) * 1e6)
    os.close(to_peer[1])
    thread.join()
    for fd in (*to_peer[:1], *from_peer):
        os.close(fd)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gaps", default="100,1000,10000", help="microseconds between trips")
    parser.add_argument("--trips", type=int, default=300)
    args = parser.parse_args()
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        print("error: needs two CPUs to run on", file=sys.stderr)
        return 2
    own, other = cpus[0], cpus[1]
    for gap in (int(g) for g in args.gaps.split(",")):
        for name, peer in (("other core", other), ("same core", own)):
            q = statistics.quantiles(round_trips(peer, own, gap, args.trips), n=10)
            print(
                f"{name:10s} gap {gap:>6} us: round trip"
                f" p10 {q[0]:7.1f}  p50 {q[4]:7.1f}  p90 {q[8]:7.1f} us"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
