#!/usr/bin/env python3
"""Scale to zero (issue 40): what a hibernated VM costs the host and how fast it wakes.

For each --vms N (several sizes in one run, so a cost that grows with N shows), densevm
serves N VMs with --idle-after; every VM is sent one GET (its working set is touched and
written), then all hibernate. Printed per N:
  - host memory per VM, awake (after the first GET, before any hibernates: measured in a
    run without --idle-after) and hibernated: MemAvailable's drop from before densevm
    started, less what the pager holds resident for the guests, over N (slab, page
    tables and vmalloc included; the page cache is dropped before each reading);
  - threads, descriptors and mappings of densevm's processes, awake and hibernated;
  - swap per VM: what the pager uses, and the swap file's allocated blocks;
  - wake latency at the client, connect to last byte, one hibernated VM per request at
    --wake-rate requests/s: p50, p99, max; beside it a second GET to each of those VMs, sent
    as the first is answered, which finds it awake with its working set resident: the
    baseline that takes the host's speed out;
  - a wake storm: --storm VMs (all hibernated) requested at once: answered, refused, p99.

Usage: experiments/bench/hibernation.py [--vms 500,2000] [--mem 1G] [--wakes 300]
       [--wake-rate 100] [--storm 2000] [--idle-after 1]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import (  # noqa: E402
    Build,
    KernelObjects,
    Session,
    dropped_meminfo,
    paced_gets,
    settled_meminfo,
    swap_file_bytes,
    wait_until_hibernated,
)
from scalebench.touch import touch_all  # noqa: E402

ADDR_BASE = "127.160.0.0"
REQUEST = b"GET / HTTP/1.1\r\nHost: b\r\n\r\n"
SMALL_BYTES = 2258  # the body of GET / (guest-images/webguest: object.h)
GET_TIMEOUT_S = 30.0
# /proc/meminfo fields whose growth per VM is reported, besides MemAvailable's drop.
BREAKDOWN = ("Slab", "SUnreclaim", "PageTables", "KernelStack", "Shmem", "AnonPages", "VmallocUsed")


async def get(vm: int) -> float | None:
    """One GET to VM `vm`: seconds from connect to last byte, None if it failed."""
    t0 = time.perf_counter()
    addr = str(ipaddress.IPv4Address(ADDR_BASE) + vm)
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(addr, 8080), GET_TIMEOUT_S)
        writer.write(REQUEST)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), GET_TIMEOUT_S)
        length = int(head.split(b"Content-Length:")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), GET_TIMEOUT_S)
        writer.close()
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError, IndexError):
        return None
    ok = length == SMALL_BYTES and head.startswith(b"HTTP/1.1 200")
    return time.perf_counter() - t0 if ok else None


async def storm(vms: list[int]) -> list[float | None]:
    """Every VM of `vms` asked at once."""
    return await asyncio.gather(*(get(vm) for vm in vms))


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] if len(values) > 1 else values[0]


def measure(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    build = Build.in_dir(ROOT / "target" / "release")
    vms = list(range(n))
    # Awake: every VM served once, none hibernates.
    before = settled_meminfo()
    with Session(build, workdir, n, ADDR_BASE, "--mem", args.mem) as session:
        failed = touch_all(ADDR_BASE, session.port, vms, 64, GET_TIMEOUT_S)
        # Less what the pager holds resident for the guests (within its budget).
        resident = session.totals()["resident_bytes"]
        awake_mem = (before["MemAvailable"] - dropped_meminfo()["MemAvailable"] - resident) / n
        awake = KernelObjects.of(session.proc.pid)
    # Hibernated: the same, then all sleep.
    before = settled_meminfo()
    flags = ("--mem", args.mem, "--idle-after", str(args.idle_after))
    with Session(build, workdir, n, ADDR_BASE, *flags) as session:
        t0 = time.monotonic()
        failed += touch_all(ADDR_BASE, session.port, vms, 64, GET_TIMEOUT_S)
        wait_until_hibernated(session, n, timeout_s=120 + n / 20)
        asleep_s = time.monotonic() - t0
        after = dropped_meminfo()
        totals = session.totals()
        asleep_mem = (before["MemAvailable"] - after["MemAvailable"] - totals["resident_bytes"]) / n
        breakdown = {k: (after[k] - before[k]) / n / 1024 for k in BREAKDOWN}
        asleep = KernelObjects.of(session.proc.pid)
        swap_allocated = swap_file_bytes(session.proc.pid, totals["swap_capacity_bytes"])
        # Wakes, one VM a request, at a steady rate; each then sleeps again. Each VM's
        # second GET, sent as its first is answered, finds it awake with its working set
        # just touched: the baseline that takes the host's speed out of the wake.
        woken = paced_gets(
            ADDR_BASE, session.port, vms[: min(args.wakes, n)], args.wake_rate, gets_each=2
        )
        wake_s = [t for t, _ in woken.values() if t is not None]
        awake_s = [t for _, t in woken.values() if t is not None]
        failed += [vm for vm, times in woken.items() if None in times]
        wait_until_hibernated(session, n, timeout_s=120)
        t_storm = time.perf_counter()
        stormed = asyncio.run(storm(vms[: min(args.storm, n)]))
        storm_s = time.perf_counter() - t_storm
        monitor = session.totals()
    storm_ok = [t for t in stormed if t is not None]
    return {
        "vms": n,
        "awake_kib_per_vm": awake_mem / 1024,
        "asleep_kib_per_vm": asleep_mem / 1024,
        "awake": awake,
        "asleep": asleep,
        "breakdown": breakdown,
        "swap_kib_per_vm": swap_allocated / n / 1024,
        "swap_used_kib_per_vm": totals["swap_used_bytes"] / n / 1024,
        "asleep_after_s": asleep_s,
        "wake_ms": [1000 * pct(wake_s, q) for q in (0.5, 0.99)] + [1000 * max(wake_s)],
        "awake_get_ms": [1000 * pct(awake_s, q) for q in (0.5, 0.99)],
        "wakes": len(wake_s),
        "storm": (
            len(stormed),
            len(storm_ok),
            len(stormed) - len(storm_ok),
            1000 * pct(storm_ok, 0.99) if storm_ok else float("nan"),
            storm_s,
        ),
        "failed": failed,
        "monitor": {
            k: monitor.get(k)
            for k in ("wakes", "wake_failures", "wake_us_p50", "wake_us_p99", "hibernations")
        },
    }


def report(r: dict, rate: float) -> None:
    a, s = r["awake"], r["asleep"]
    p50, p99, worst = r["wake_ms"]
    awake50, awake99 = r["awake_get_ms"]
    n, ok, bad, p99s, took = r["storm"]
    lines = [
        f"--vms {r['vms']}: all hibernated {r['asleep_after_s']:.1f} s after the first GETs",
        f"  host memory per VM: awake {r['awake_kib_per_vm']:.1f} KiB,"
        f" hibernated {r['asleep_kib_per_vm']:.1f} KiB",
        "  of which, hibernated (KiB a VM): "
        + ", ".join(f"{k} {v:.1f}" for k, v in r["breakdown"].items()),
        f"  threads/fds/maps: awake {a.threads}/{a.fds}/{a.maps},"
        f" hibernated {s.threads}/{s.fds}/{s.maps}",
        f"  swap per VM: {r['swap_used_kib_per_vm']:.1f} KiB used by the pager,"
        f" {r['swap_kib_per_vm']:.1f} KiB allocated on disk",
        f"  wake at {rate:.0f}/s ({r['wakes']} wakes): p50 {p50:.2f} ms, p99 {p99:.2f} ms,"
        f" max {worst:.2f} ms",
        f"  a second GET to each, awake: p50 {awake50:.2f} ms, p99 {awake99:.2f} ms"
        f" (wake p50 over awake p50: {p50 / awake50:.1f}x)",
        f"  wake storm of {n}: {ok} answered, {bad} failed, p99 {p99s:.1f} ms, all in {took:.2f} s",
        f"  monitor: {r['monitor']}",
        f"  failed GETs: {len(r['failed'])} (VMs {r['failed'][:5]})",
    ]
    print("\n".join(lines), flush=True)


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", default="500,2000", help="VM counts, comma-separated")
    parser.add_argument("--mem", default="1G")
    parser.add_argument("--idle-after", type=float, default=1.0)
    parser.add_argument("--wakes", type=int, default=300)
    parser.add_argument("--wake-rate", type=float, default=100.0)
    parser.add_argument("--storm", type=int, default=2000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="hibernation-") as tmp:
        rows = []
        for n in args.vms.split(","):
            rows.append(measure(int(n), args, Path(tmp)))
            report(rows[-1], args.wake_rate)
    return 0 if all(not r["failed"] and not r["storm"][2] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
