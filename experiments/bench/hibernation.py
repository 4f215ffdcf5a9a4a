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
    --wake-rate requests/s: p50, p99, max;
  - a wake storm: --storm VMs (all hibernated) requested at once: answered, refused, p99.

Usage: experiments/bench/hibernation.py [--vms 500,2000] [--mem 1G] [--wakes 300]
       [--wake-rate 100] [--storm 2000] [--idle-after 1]
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.densevm import control  # noqa: E402
from scalebench.scaling import children  # noqa: E402

RELEASE = ROOT / "target" / "release"
ADDR_BASE = ipaddress.IPv4Address("127.160.0.0")
PORT = 8080
REQUEST = b"GET / HTTP/1.1\r\nHost: b\r\n\r\n"
SMALL_BYTES = 2258  # the body of GET / (guest-images/webguest: object.h)


# /proc/meminfo fields whose growth per VM is reported, besides MemAvailable's drop.
BREAKDOWN = ("Slab", "SUnreclaim", "PageTables", "KernelStack", "Shmem", "AnonPages", "VmallocUsed")


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes, once the page cache is dropped (the swap file's writes go
    through it)."""
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    time.sleep(1)
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    return fields


def tree(pid: int) -> list[int]:
    out = [pid]
    for child in children(pid):
        out += tree(child)
    return out


@dataclass
class Objects:
    threads: int
    fds: int
    maps: int

    @staticmethod
    def of(pid: int) -> Objects:
        t = f = m = 0
        for p in tree(pid):
            try:
                t += len(os.listdir(f"/proc/{p}/task"))
                f += len(os.listdir(f"/proc/{p}/fd"))
                m += len(Path(f"/proc/{p}/maps").read_text().splitlines())
            except FileNotFoundError:
                continue
        return Objects(t, f, m)


def swap_allocated(pid: int) -> int:
    """Allocated bytes of the parent's swap file (nameless: found through its fd)."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}")
        if "densevm-swap" in target or target.endswith("(deleted)"):
            st = os.stat(f"/proc/{pid}/fd/{fd}")
            if st.st_size > 0 and (st.st_mode & 0o170000) == 0o100000:
                return st.st_blocks * 512
    return 0


def addr(vm: int) -> str:
    return str(ADDR_BASE + vm)


async def get(vm: int, timeout: float = 30) -> tuple[float, str | None]:
    """One GET to VM `vm`: (seconds from connect to last byte, error or None)."""
    t0 = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(addr(vm), PORT), timeout)
        writer.write(REQUEST)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)
        length = int(head.split(b"Content-Length:")[1].split(b"\r\n")[0])
        body = await asyncio.wait_for(reader.readexactly(length), timeout)
        writer.close()
        if length != SMALL_BYTES or not head.startswith(b"HTTP/1.1 200"):
            return time.perf_counter() - t0, f"VM {vm}: {head[:20]!r} {len(body)} bytes"
        return time.perf_counter() - t0, None
    except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as e:
        return time.perf_counter() - t0, f"VM {vm}: {type(e).__name__}: {e}"


async def get_all(vms: list[int], concurrency: int) -> list[tuple[float, str | None]]:
    gate = asyncio.Semaphore(concurrency)

    async def one(vm: int) -> tuple[float, str | None]:
        async with gate:
            return await get(vm)

    return await asyncio.gather(*(one(vm) for vm in vms))


async def paced(vms: list[int], rate: float) -> list[tuple[float, str | None]]:
    tasks = []
    start = time.perf_counter()
    for i, vm in enumerate(vms):
        await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
        tasks.append(asyncio.create_task(get(vm)))
    return await asyncio.gather(*tasks)


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000)[int(q * 1000) - 1] if len(values) > 1 else values[0]


def wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise SystemExit(f"hibernation.py: timed out waiting for {what}")


def serve(n: int, mem: str, extra: list[str], workdir: Path) -> tuple[subprocess.Popen, Path]:
    api = workdir / f"densevm-{n}.sock"
    argv = [str(RELEASE / "densevm"), "serve", "--vms", str(n), "--mem", mem]
    argv += ["--addr-base", str(ADDR_BASE), "--port", str(PORT), "--api", str(api), *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=sys.stderr, cwd=workdir)
    line = proc.stdout.readline()
    if not line:
        raise SystemExit(f"hibernation.py: densevm --vms {n} did not start")
    json.loads(line)
    return proc, api


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(120)


def totals(api: Path) -> dict:
    return control(api, {"cmd": "stats"})["totals"]


def measure(n: int, args: argparse.Namespace, workdir: Path) -> dict:
    vms = list(range(n))
    # Awake: every VM served once, none hibernates.
    before = meminfo()["MemAvailable"]
    proc, api = serve(n, args.mem, [], workdir)
    errors = [e for _, e in asyncio.run(get_all(vms, 64)) if e]
    time.sleep(2)
    # Less what the pager holds resident for the guests (within its budget).
    resident = totals(api)["resident_bytes"]
    awake_mem = (before - meminfo()["MemAvailable"] - resident) / n
    awake_objects = Objects.of(proc.pid)
    stop(proc)
    time.sleep(2)
    # Hibernated: the same, then all sleep.
    before_info = meminfo()
    proc, api = serve(n, args.mem, ["--idle-after", str(args.idle_after)], workdir)
    t0 = time.monotonic()
    errors += [e for _, e in asyncio.run(get_all(vms, 64)) if e]
    wait(lambda: totals(api)["hibernated"] == n, 120 + n / 50, "every VM to hibernate")
    wait(lambda: totals(api)["resident_bytes"] == 0, 120, "the pager to empty")
    asleep_s = time.monotonic() - t0
    time.sleep(2)
    after_info = meminfo()
    resident = totals(api)["resident_bytes"]
    asleep_mem = (before_info["MemAvailable"] - after_info["MemAvailable"] - resident) / n
    breakdown = {k: (after_info[k] - before_info[k]) / n / 1024 for k in BREAKDOWN}
    asleep_objects = Objects.of(proc.pid)
    swap = swap_allocated(proc.pid)
    swap_used = totals(api)["swap_used_bytes"]
    # Wakes, one VM a request, at a steady rate; each then sleeps again.
    sample = vms[: min(args.wakes, n)]
    paced_results = asyncio.run(paced(sample, args.wake_rate))
    wake_s = [t for t, e in paced_results if e is None]
    errors += [e for _, e in paced_results if e]
    wait(lambda: totals(api)["hibernated"] == n, 120, "the woken VMs to sleep again")
    storm_vms = vms[: min(args.storm, n)]
    t_storm = time.perf_counter()
    storm = asyncio.run(get_all(storm_vms, len(storm_vms)))
    storm_s = time.perf_counter() - t_storm
    storm_ok = [t for t, e in storm if e is None]
    storm_errors = [e for _, e in storm if e]
    t = totals(api)
    stop(proc)
    p99_storm = 1000 * pct(storm_ok, 0.99) if storm_ok else float("nan")
    monitor_keys = ("wakes", "wake_failures", "wake_us_p50", "wake_us_p99", "hibernations")
    return {
        "vms": n,
        "awake_kib_per_vm": awake_mem / 1024,
        "asleep_kib_per_vm": asleep_mem / 1024,
        "awake": awake_objects,
        "asleep": asleep_objects,
        "breakdown": breakdown,
        "swap_kib_per_vm": swap / n / 1024,
        "swap_used_kib_per_vm": swap_used / n / 1024,
        "asleep_after_s": asleep_s,
        "wake_ms": [1000 * pct(wake_s, q) for q in (0.5, 0.99)] + [1000 * max(wake_s)],
        "wakes": len(wake_s),
        "storm": (len(storm_vms), len(storm_ok), len(storm_errors), p99_storm, storm_s),
        "errors": errors + storm_errors,
        "monitor": {k: t.get(k) for k in monitor_keys},
    }


def report(r: dict, rate: float) -> None:
    a, s = r["awake"], r["asleep"]
    p50, p99, worst = r["wake_ms"]
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
        f" {r['swap_kib_per_vm']:.1f} KiB allocated on disk (the file is sized up front)",
        f"  wake at {rate:.0f}/s ({r['wakes']} wakes): p50 {p50:.2f} ms, p99 {p99:.2f} ms,"
        f" max {worst:.2f} ms",
        f"  wake storm of {n}: {ok} answered, {bad} failed, p99 {p99s:.1f} ms, all in {took:.2f} s",
        f"  monitor: {r['monitor']}",
        f"  errors: {len(r['errors'])} {r['errors'][:3]}",
    ]
    print("\n".join(lines), flush=True)


def main() -> int:
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
    return 0 if all(not r["errors"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
