#!/usr/bin/env python3
"""Hibernation integrity (issue 40): self-checking guests through many hibernate/wake cycles.

densevm serves --vms self-checking VMs (--selfcheck: every request verifies, then rewrites,
stamps at both ends of every working-set page) with --idle-after short, so a VM sleeps
between most of its requests. Client threads send GETs to random VMs, pausing a little
longer than the idle time now and then, until the monitor counts --cycles wakes. Printed
per policy: wakes and hibernations, requests, self-checked pages and mismatches, failed
requests, and the rate. Exit 1 on any mismatch or failed request.

Usage: experiments/bench/hibernation_integrity.py [--policies demand,wsswap]
       [--cycles 100000] [--vms 200] [--mem 64M] [--idle-after 0.1] [--clients 16]
"""

from __future__ import annotations

import argparse
import ipaddress
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import Build, Session  # noqa: E402
from scalebench.touch import touch_one  # noqa: E402

ADDR_BASE = "127.161.0.0"
GET_TIMEOUT_S = 30.0


def run(policy: str, args: argparse.Namespace, workdir: Path) -> bool:
    flags = ("--mem", args.mem, "--policy", policy, "--selfcheck")
    flags += ("--idle-after", str(args.idle_after))
    build = Build.in_dir(ROOT / "target" / "release")
    with Session(build, workdir, args.vms, ADDR_BASE, *flags) as session:
        stop = threading.Event()
        failed: list[int] = []
        sent = [0] * args.clients

        def client(i: int) -> None:
            rng = random.Random(i)
            while not stop.is_set():
                vm = rng.randrange(args.vms)
                addr = str(ipaddress.IPv4Address(ADDR_BASE) + vm)
                if not touch_one(addr, session.port, GET_TIMEOUT_S):
                    failed.append(vm)
                sent[i] += 1
                # Mostly past the idle time: the next request to that VM wakes it.
                time.sleep(rng.random() * 2 * args.idle_after / args.clients)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        started = time.monotonic()
        for t in threads:
            t.start()
        wakes = 0
        try:
            while wakes < args.cycles and not failed:
                time.sleep(5)
                totals = session.totals()
                wakes = totals["wakes"]
                rate = wakes / (time.monotonic() - started)
                print(f"  {policy}: {wakes} wakes ({rate:.0f}/s), {sum(sent)} requests", flush=True)
        finally:  # stopped too on Ctrl-C or SIGTERM: the bench could not exit past them
            stop.set()
            for t in threads:
                t.join()
        totals = session.totals()
    took = time.monotonic() - started
    print(
        f"{policy}: {totals['wakes']} wakes and {totals['hibernations']} hibernations in "
        f"{took:.0f} s ({totals['wakes'] / took:.0f}/s), {sum(sent)} requests, "
        f"{totals['selfcheck_pages']} pages self-checked, {totals['selfcheck_errors']} "
        f"mismatches, {len(failed)} failed requests, {totals['wake_failures']} failed wakes",
        flush=True,
    )
    ok = not failed and totals["selfcheck_errors"] == 0 and totals["wake_failures"] == 0
    if not ok:
        # Its log goes with the temporary directory: what it said is printed here.
        log = workdir / f"densevm-{ADDR_BASE}.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        print("\n".join(["  densevm's log, last lines:", *lines[-40:]]), flush=True)
    return ok


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="demand,wsswap")
    parser.add_argument("--cycles", type=int, default=100_000)
    parser.add_argument("--vms", type=int, default=200)
    parser.add_argument("--mem", default="64M")
    parser.add_argument("--idle-after", type=float, default=0.1)
    parser.add_argument("--clients", type=int, default=16)
    args = parser.parse_args()
    ok = True
    with tempfile.TemporaryDirectory(prefix="hibernation-integrity-") as tmp:
        for policy in args.policies.split(","):
            ok &= run(policy, args, Path(tmp))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
