#!/usr/bin/env python3
"""The control API under fuzzing for minutes: random bytes, huge lines, floods
of short lines, never-reading and slow clients, 1,000 clients at once
(tests/support/control_fuzz.py), against densevm with 100 VMs. Prints the
monitor's RSS over time and its growth after the first minute (the warm-up
that sets the allocator's high-water marks). Acceptance (issue 14): 10
minutes without a monitor restart, RSS growth under 5%.

Then the burst of issue 39: 1,000 control clients each pipeline 50
`{"cmd":"stats"}` (per-VM stats on 200 VMs) and hang up; it prints how long a
new client's `stats` then takes (113 s on 30b27ac; target: within 1 s), how
long SIGTERM takes, and whether a swap file is left.

And a pipelining flood: one client streams `list` requests faster than they
are answered while two spinning processes per core keep the host busy (as
the other test worker does in CI); it prints how long a newcomer's `list`
takes. Up to
e827dc0 the flooder's own events were served ahead of the newcomer's turn:
seconds under CPU load, once over a 10 s timeout in CI.

Usage: experiments/bench/control_fuzz.py [--minutes 10] [--vms 100]
       [--only burst|pipelining|fuzz]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from support.control_fuzz import PipeliningFlood, fuzz, good_request  # noqa: E402
from support.densevm import start  # noqa: E402


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def burst(clients: int = 1000, pipelined: int = 50, vms: int = 200) -> bool:
    """The vanished-clients burst; prints its figures, True when the target is met."""
    with tempfile.TemporaryDirectory() as tmp:
        m = start(Path(tmp), vms, "127.232.0.0", "--cell-placement", "floating")
        try:
            payload = b'{"cmd":"stats"}\n' * pipelined
            started = time.monotonic()
            for _ in range(clients):
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(str(m.api))
                    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                        s.sendall(payload)
            sent = time.monotonic() - started
            started = time.monotonic()
            reply = m.control({"cmd": "stats"})
            answered = time.monotonic() - started
            ok = bool(reply.get("ok")) and reply["totals"]["vms"] == vms
            started = time.monotonic()
            m.proc.send_signal(signal.SIGTERM)
            code = m.proc.wait(60)
            stopped = time.monotonic() - started
        finally:
            if m.proc.poll() is None:
                m.proc.kill()
                m.proc.wait()
        left = sorted(p.name for p in Path(tmp).glob("densevm-swap-*"))
    met = "met" if ok and answered < 1 else "NOT met"
    print(
        f"burst: {clients} clients x {pipelined} pipelined stats on {vms} VMs "
        f"sent in {sent:.2f} s; a new stats answered {'ok' if ok else 'WRONG'} "
        f"in {answered:.2f} s (30b27ac: 113 s; target: within 1 s: {met}); "
        f"SIGTERM: exit {code} in {stopped:.1f} s; swap files left: {left or 'none'}",
        flush=True,
    )
    return ok and answered < 1 and code == 0 and not left


def _spin(until: float) -> None:
    # Forked: SIGTERM (p.terminate()) ends it, not the bench's handler (a Terminated traceback).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while time.monotonic() < until:
        pass


def pipelining(requests: int = 200, vms: int = 4) -> bool:
    """A newcomer's `list` beside a pipelining flood on a busy host; prints
    its latencies, True when every one was answered."""
    latencies = []
    with tempfile.TemporaryDirectory() as tmp:
        m = start(Path(tmp), vms, "127.229.0.0")
        spinners = [
            multiprocessing.Process(target=_spin, args=(time.monotonic() + 600,))
            for _ in range(2 * (os.cpu_count() or 1))
        ]
        try:
            for p in spinners:
                p.start()
            with PipeliningFlood(m.api) as flood:
                for _ in range(requests):
                    started = time.monotonic()
                    if good_request(m.api):
                        latencies.append((time.monotonic() - started) * 1000)
                flooded = flood.replies
        finally:
            for p in spinners:
                p.terminate()
                p.join()
            m.stop()
    cuts = statistics.quantiles(latencies, n=100) if len(latencies) > 1 else [0.0] * 99
    print(
        f"pipelining: {len(latencies)}/{requests} newcomer lists answered beside a flood "
        f"({flooded} flood replies) with {len(spinners)} spinning processes: "
        f"p50 {cuts[49]:.1f} ms, p99 {cuts[98]:.1f} ms, max {max(latencies, default=0):.1f} ms",
        flush=True,
    )
    return len(latencies) == requests


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--vms", type=int, default=100)
    parser.add_argument(
        "--only", choices=["burst", "pipelining", "fuzz"], help="run one part (default: all)"
    )
    args = parser.parse_args()
    if args.only in (None, "burst") and not burst() and args.only:
        return 1
    if args.only in (None, "pipelining") and not pipelining() and args.only:
        return 1
    if args.only not in (None, "fuzz"):
        return 0
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
