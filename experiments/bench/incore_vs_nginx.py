#!/usr/bin/env python3
"""In-core aggregate throughput of densevm against nginx on the same addresses.

densevm boots N VMs (default 4,000) with a budget that holds them all, every
VM is touched once (its working set made), and zipfperf drives Zipf(1.0) load
over the N addresses, a new connection per request, 64 in flight. Then nginx
with 2 workers listens on the same N addresses and the same zipfperf run
measures it. Rounds alternate the order (densevm, nginx, nginx, densevm, ...)
so a drifting host load favours neither. The cells issue asks for densevm >=
0.7 of nginx.

Each round also prints where the machine's CPU went per request served, from
/proc/stat over the load window (guest code, other user code, kernel, softirq,
idle) and the share of it the host's DAMON monitor (kdamond) took: its access
checks visit every KVM VM of the process that maps a page, so its cost grows
with the VMs per cell (`--cell-vms`, docs/host-facts.md). `--cell-placement`
compares pinned cells with floating ones (hypervisor/README.md, "Pinned cells").

Usage: experiments/bench/incore_vs_nginx.py [--vms 4000] [--rounds 2] [--seconds 30]
[--cell-vms K] [--cell-placement pinned|floating] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.densevm import control  # noqa: E402
from scalebench.nginx import NginxServer  # noqa: E402
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import children, descendants  # noqa: E402
from scalebench.touch import touch_all  # noqa: E402

DENSEVM = ROOT / "target" / "release" / "densevm"
ZIPFPERF = ROOT / "target" / "release" / "zipfperf"
ADDR_BASE = "127.6.0.0"
PORT = 8080


# /proc/stat's CPU columns; `user` and `nice` include `guest` and `guest_nice`.
STAT_COLUMNS = (
    "user",
    "nice",
    "system",
    "idle",
    "iowait",
    "irq",
    "softirq",
    "steal",
    "guest",
    "guest_nice",
)


@dataclass
class Round:
    """One server's load window: its rate, the machine's CPU per request in µs,
    and (densevm only, else 0) how often its cells' event loops and vCPU
    threads went to sleep per request."""

    rate: float
    guest_us: float
    user_us: float
    system_us: float
    softirq_us: float
    idle_us: float
    kdamond_us: float
    loop_sleeps: float = 0.0
    vcpu_sleeps: float = 0.0


def cpu_ticks() -> dict[str, int]:
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    return dict(zip(STAT_COLUMNS, map(int, fields[: len(STAT_COLUMNS)]), strict=True))


def kdamond_ticks() -> int:
    """User and system ticks of the host's DAMON threads (none: 0)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if stat[stat.index("(") + 1 :].startswith("kdamond"):
            fields = stat[stat.rindex(")") + 2 :].split()
            total += int(fields[11]) + int(fields[12])
    return total


def voluntary_switches(pid: int) -> tuple[int, int]:
    """Voluntary context switches so far of the cells' event loops (each
    cell's main thread) and of the vCPU threads (in the cells' holders),
    under densevm `pid`."""
    loops = vcpus = 0
    for cell in children(pid):
        for process in descendants(cell):
            try:
                tasks = os.listdir(f"/proc/{process}/task")
            except OSError:
                continue
            for tid in tasks:
                try:
                    with open(f"/proc/{process}/task/{tid}/status") as f:
                        status = dict(line.split(":\t", 1) for line in f if ":\t" in line)
                except OSError:
                    continue
                switches = int(status["voluntary_ctxt_switches"])
                if int(tid) == cell:
                    loops += switches
                elif status["Name"].startswith("vcpu"):
                    vcpus += switches
    return loops, vcpus


def zipfperf(vms: int, seconds: float, densevm_pid: int | None = None) -> Round:
    before, kdamond_before = cpu_ticks(), kdamond_ticks()
    switches_before = voluntary_switches(densevm_pid) if densevm_pid else (0, 0)
    out = subprocess.run(
        [
            str(ZIPFPERF),
            "--targets",
            str(vms),
            "--addr-base",
            ADDR_BASE,
            "--port",
            str(PORT),
            "--alpha",
            "1.0",
            "--concurrency",
            "64",
            "--num-calls",
            "1",
            "--duration",
            str(seconds),
            "--json",
            "-",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    after, kdamond_after = cpu_ticks(), kdamond_ticks()
    switches_after = voluntary_switches(densevm_pid) if densevm_pid else (0, 0)
    doc = json.loads(out.stdout)
    if doc["errors"]["total"]:
        print(f"  zipfperf errors: {doc['errors']}", flush=True)
    rate = doc["replies"]["rate"]
    replies = max(doc["replies"]["total"], 1)
    ticks = {k: after[k] - before[k] for k in STAT_COLUMNS}
    # A column's share of all cores' time, times the cores' µs per request served.
    guest = ticks["guest"] + ticks["guest_nice"]
    total = max(1, sum(ticks.values()) - guest)
    per_request = (os.cpu_count() or 1) * 1e6 / max(rate, 1.0) / total
    return Round(
        rate=rate,
        guest_us=guest * per_request,
        user_us=(ticks["user"] + ticks["nice"] - guest) * per_request,
        system_us=(ticks["system"] + ticks["irq"]) * per_request,
        softirq_us=ticks["softirq"] * per_request,
        idle_us=(ticks["idle"] + ticks["iowait"] + ticks["steal"]) * per_request,
        kdamond_us=(kdamond_after - kdamond_before) * per_request,
        loop_sleeps=(switches_after[0] - switches_before[0]) / replies,
        vcpu_sleeps=(switches_after[1] - switches_before[1]) / replies,
    )


def densevm_round(vms: int, flags: list[str], seconds: float, workdir: Path) -> Round:
    api = workdir / "densevm.sock"
    proc = subprocess.Popen(
        [
            str(DENSEVM),
            "serve",
            "--vms",
            str(vms),
            "--addr-base",
            ADDR_BASE,
            "--port",
            str(PORT),
            "--api",
            str(api),
            "--mem",
            str(vms * 2 << 20),
            "--boot-timeout",
            "600",
            *flags,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=workdir,
    )
    try:
        if not proc.stdout.readline():
            raise SystemExit(f"densevm failed: {proc.stderr.read().strip()}")
        failed = touch_all(ADDR_BASE, PORT, range(vms), 64, 30.0, lambda done: None)
        if failed:
            raise SystemExit(f"{len(failed)} VMs did not answer the touch")
        before = control(api, {"cmd": "stats", "vms": False})["totals"]["faults"]
        result = zipfperf(vms, seconds, proc.pid)
        faults = control(api, {"cmd": "stats", "vms": False})["totals"]["faults"] - before
        if faults > 0.05 * result.rate * seconds:
            print(f"  warning: densevm paged during the window ({faults} faults)", flush=True)
        return result
    finally:
        proc.terminate()
        proc.wait(300)


def nginx_round(vms: int, seconds: float) -> Round:
    with NginxServer(PORT, extra_targets=vms, workers=2, addr_base=ADDR_BASE):
        return zipfperf(vms, seconds)


def describe(server: str, r: Round) -> str:
    sleeps = (
        f"; sleeps per request: cell loops {r.loop_sleeps:.2f}, vCPUs {r.vcpu_sleeps:.2f}"
        if server == "densevm"
        else ""
    )
    return (
        f"{server:<8} {r.rate:>9,.0f} requests/s; CPU µs per request: guest {r.guest_us:.0f}, "
        f"user {r.user_us:.0f}, kernel {r.system_us:.0f}, softirq {r.softirq_us:.0f}, "
        f"idle {r.idle_us:.0f} (kdamond {r.kdamond_us:.0f}){sleeps}"
    )


def mean_round(rounds: list[Round]) -> Round:
    return Round(**{k: statistics.mean(getattr(r, k) for r in rounds) for k in asdict(rounds[0])})


def main() -> None:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=4000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--cell-vms", type=int, help="densevm's --cell-vms (default: its own)")
    parser.add_argument(
        "--cell-placement",
        choices=("pinned", "floating"),
        help="densevm's --cell-placement (default: its own)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    flags = [
        *(["--cell-vms", str(args.cell_vms)] if args.cell_vms else []),
        *(["--cell-placement", args.cell_placement] if args.cell_placement else []),
    ]
    results: dict[str, list[Round]] = {"densevm": [], "nginx": []}
    with tempfile.TemporaryDirectory(prefix="incore-bench-") as tmp:
        for r in range(args.rounds):
            order = ("densevm", "nginx") if r % 2 == 0 else ("nginx", "densevm")
            for server in order:
                result = (
                    densevm_round(args.vms, flags, args.seconds, Path(tmp))
                    if server == "densevm"
                    else nginx_round(args.vms, args.seconds)
                )
                results[server].append(result)
                print(f"round {r + 1}: {describe(server, result)}", flush=True)
    d, n = mean_round(results["densevm"]), mean_round(results["nginx"])
    print(f"mean:    {describe('densevm', d)}")
    print(f"mean:    {describe('nginx', n)}")
    print(
        f"{args.vms} VMs in core, Zipf 1.0, 64 in flight, a connection per request: densevm "
        f"{d.rate:,.0f} requests/s, "
        f"nginx (2 workers) {n.rate:,.0f}: ratio {d.rate / n.rate:.2f} (target >= 0.7)"
    )
    if args.json:
        doc = {
            "vms": args.vms,
            "cell_vms": args.cell_vms,
            "cell_placement": args.cell_placement,
            **{server: [asdict(r) for r in rounds] for server, rounds in results.items()},
            "ratio": d.rate / n.rate,
        }
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
