#!/usr/bin/env python3
"""Density (issue 40): how many VMs one densevm registers, what each costs before and after
it has run, and whether a sample of them serves.

For each --vms N (several sizes in one run, so a cost that grows with N shows), densevm
registers N VMs with --idle-after (every VM created asleep: no boot, no KVM object, no
swap) under --max-live. Printed per N:
  - registration: seconds from launch to ready;
  - threads, descriptors and mappings of densevm's processes;
  - host memory per VM: MemAvailable's drop from before densevm started, over N, with the
    slab, page-table, kernel-stack, shmem, anon and vmalloc growth (page cache dropped
    before each reading);
  - swap: what the pager uses and what the swap file has allocated on disk;
  - the same once more after --settle seconds of idle: on some hosts MemAvailable moves on
    its own by several KiB a VM for a minute or two after a densevm starts, either way, while
    what densevm's processes hold does not (docs/measurements/2026-12-08.md);
then --sample VMs spread over the N are sent one GET each at --rate a second (the first
GET of a VM created asleep is its first start: its boot, or with --clone-boot its start as
a clone of the image's template), every answer checked for the exact body of GET /, the
seconds of the sweep in which GETs slower than 50 ms started listed, and once all
sleep again the same figures per N and per VM served, with the host's CPU time (all of
it, the client's included) from the first of those GETs until all slept, per VM served.

Usage: experiments/bench/density.py [--vms 1000,60000] [--sample 300] [--rate 50]
       [--max-live 2000] [--cell-vms 1000] [--settle 60] [--clone-boot] [--selfcheck]
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import (  # noqa: E402
    Build,
    KernelObjects,
    Session,
    dropped_meminfo,
    settled_meminfo,
    swap_file_bytes,
    wait_until_hibernated,
)
from scalebench.webobject import SMALL  # noqa: E402

ADDR_BASE = "127.161.0.0"
REQUEST = b"GET / HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n"
GET_TIMEOUT_S = 30.0
SLOW_S = 0.05
BREAKDOWN = ("Slab", "PageTables", "KernelStack", "Shmem", "AnonPages", "VmallocUsed")


@dataclass
class Host:
    """What densevm holds of the host at one moment."""

    objects: KernelObjects
    mem_kib_per_vm: float
    breakdown: dict[str, float]
    swap_used: int
    swap_allocated: int


def snapshot(session: Session, before: dict[str, int], n: int) -> Host:
    objects = KernelObjects.of(session.proc.pid)
    after = dropped_meminfo()
    totals = session.totals()
    drop = before["MemAvailable"] - after["MemAvailable"] - totals["resident_bytes"]
    return Host(
        objects,
        drop / n / 1024,
        {k: (after[k] - before[k]) / n / 1024 for k in BREAKDOWN},
        totals["swap_used_bytes"],
        swap_file_bytes(session.proc.pid, totals["swap_capacity_bytes"]),
    )


def exact_get(addr: str) -> float | None:
    """One GET /: seconds from connect to the last byte when the reply is 200 with exactly
    the body of GET /, else None."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection((addr, 8080), timeout=GET_TIMEOUT_S) as s:
            s.sendall(REQUEST)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
    except OSError:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    return time.perf_counter() - t0 if head.startswith(b"HTTP/1.1 200") and body == SMALL else None


def paced(vms: list[int], rate: float) -> list[tuple[float, float | None]]:
    """One exact GET to each of `vms`, started `rate` a second however long answers take:
    for each, seconds from the first start to its start, and what `exact_get` returned."""
    base = ipaddress.IPv4Address(ADDR_BASE)
    with ThreadPoolExecutor(max_workers=64) as pool:
        futures = []
        start = time.monotonic()
        for i, vm in enumerate(vms):
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
            futures.append((time.monotonic() - start, pool.submit(exact_get, str(base + vm))))
        return [(at, f.result()) for at, f in futures]


def host_busy_s() -> float:
    """CPU seconds the whole host has spent not idle (/proc/stat), over all CPUs."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q * 100) - 1] if len(values) > 1 else values[0]


def run(n: int, args: argparse.Namespace, workdir: Path) -> None:
    build = Build.in_dir(ROOT / "target" / "release")
    flags = ("--mem", args.mem, "--idle-after", str(args.idle_after))
    flags += ("--max-live", str(args.max_live), "--cell-vms", str(args.cell_vms))
    flags += ("--clone-boot",) if args.clone_boot else ()
    flags += ("--selfcheck",) if args.selfcheck else ()
    before = settled_meminfo()
    t0 = time.monotonic()
    with Session(build, workdir, n, ADDR_BASE, *flags) as session:
        ready_s = time.monotonic() - t0
        registered = snapshot(session, before, n)
        time.sleep(args.settle)
        settled = snapshot(session, before, n)
        k = min(args.sample, n)
        sample = [i * n // k for i in range(k)]
        busy0 = host_busy_s()
        answers = paced(sample, args.rate)
        wait_until_hibernated(session, n, timeout_s=120)
        cpu_ms = (host_busy_s() - busy0) / len(sample) * 1000
        served = snapshot(session, before, n)
        totals = session.totals()
    ok = [t * 1000 for _, t in answers if t is not None]
    # When the slow answers came says whether a tail is the host's moment or the run's shape.
    slow_at = [at for at, t in answers if t is None or t > SLOW_S]
    ran = len(sample)
    boot_s = session.boot.boot_seconds
    print(f"--vms {n}: ready in {ready_s:.1f} s (densevm's boot_seconds {boot_s:.1f})")
    for name, h in (
        ("registered", registered),
        (f"registered, {args.settle:.0f} s later", settled),
        (f"after {ran} served", served),
    ):
        print(
            f"  {name}: threads/fds/maps {h.objects.threads}/{h.objects.fds}/{h.objects.maps};"
            f" host memory {h.mem_kib_per_vm:.1f} KiB a VM ("
            + ", ".join(f"{k} {v:.1f}" for k, v in h.breakdown.items())
            + f"); swap committed {h.swap_used / 2**20:.0f} MiB,"
            f" allocated on disk {h.swap_allocated / 2**20:.0f} MiB"
        )
    per_served = (served.swap_used - registered.swap_used) / ran / 1024
    print(
        f"  served {len(ok)} of {ran} with the exact {len(SMALL)} bytes"
        f" (first GET of each: its {'start as a clone' if args.clone_boot else 'boot'}),"
        f" p50 {pct(ok, 0.5):.1f} ms, p99 {pct(ok, 0.99):.1f} ms;"
        f" host CPU {cpu_ms:.1f} ms a VM served, until asleep;"
        f" swap committed per VM served {per_served:.0f} KiB;"
        f" monitor: wakes {totals.get('wakes')}, wake failures {totals.get('wake_failures')},"
        f" clones {totals.get('clones_started')} (template {totals.get('clone_template')}),"
        f" self-check mismatches {totals.get('selfcheck_errors')}",
        flush=True,
    )
    if slow_at:
        seconds = sorted({int(at) for at in slow_at})
        shown = ", ".join(str(v) for v in seconds[:20]) + (" ..." if len(seconds) > 20 else "")
        print(
            f"  {len(slow_at)} GETs failed or took over {SLOW_S * 1000:.0f} ms; they started"
            f" in {len(seconds)} distinct seconds of the sweep: {shown}",
            flush=True,
        )
    compact = totals.get("compact_swap")
    if compact:
        print(
            f"  compact swap: {compact['copies']} copies"
            f" in {compact['stored_bytes'] / 2**20:.1f} MiB,"
            f" {compact['blocks_same_as_template']} of {compact['blocks_written']} blocks written"
            f" were the template's; template LZ4 ratio {compact['template_lz4_ratio'] or 0:.2f};"
            f" compress {compact['compress_us_per_block']:.1f} us/block,"
            f" decompress {compact['decompress_us_per_block']:.1f} us/block",
            flush=True,
        )


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", default="1000,60000", help="VM counts, comma-separated")
    parser.add_argument("--sample", type=int, default=300, help="VMs sent one GET each")
    parser.add_argument("--rate", type=float, default=50.0, help="GETs started a second")
    parser.add_argument("--max-live", type=int, default=2000)
    parser.add_argument("--cell-vms", type=int, default=1000)
    parser.add_argument("--mem", default="1G")
    parser.add_argument("--idle-after", type=float, default=1.0)
    parser.add_argument(
        "--settle", type=float, default=60.0, help="seconds idle before the second reading"
    )
    parser.add_argument(
        "--clone-boot", action="store_true", help="densevm --clone-boot: VMs start as clones"
    )
    parser.add_argument(
        "--selfcheck",
        action="store_true",
        help="self-checking guests (densevm --selfcheck): GET bodies are the same, and the "
        "monitor counts working-set pages that did not hold what the guest last wrote",
    )
    args = parser.parse_args()
    counts = [int(v) for v in args.vms.split(",")]
    if min(counts) < 1 or args.sample < 1 or args.rate <= 0 or args.settle < 0:
        parser.error("--vms, --sample and --rate must be positive, --settle not negative")
    with tempfile.TemporaryDirectory(prefix="density-", dir=ROOT / "target") as workdir:
        for n in counts:
            run(n, args, Path(workdir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
