#!/usr/bin/env python3
"""How a fault's cost grows with the VM count: densevm's CPU per fault,
kernel and user, at several VM counts in one run.

Each point boots N VMs with a budget that holds a quarter of their working
sets, primes them, then drives uniform load (Zipf alpha 0, a new connection
per request, 64 in flight) for a window with the disk model off (`--disk
none`, 32k blocks), and divides the CPU time of densevm's whole process tree
(parent, cells and holders) by the faults the pager served in that window. This is the
measurement of the cells issue's table; the acceptance is that kernel CPU per
fault at 4,000 VMs stays within 1.5x of that at 250, at >= 5,000 faults/s.

Usage: experiments/bench/cells_scaling.py [--vms 250,4000] [--cell-vms K,...] [--window 30]
[--cell-placement pinned|floating] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import WS_BYTES, Build, Session  # noqa: E402

BUILD = Build(ROOT / "target" / "release" / "densevm", ROOT / "target" / "release" / "zipfperf")


@dataclass
class Point:
    vms: int
    cell_vms: int
    cells: int
    boot_seconds: float
    faults: int
    faults_per_s: float
    cpu_us_per_fault: float
    kernel_us_per_fault: float
    user_us_per_fault: float
    requests_per_s: float
    load_before: float


def measure(
    vms: int,
    cell_vms: int | None,
    placement: list[str],
    window: float,
    workdir: Path,
    addr_base: str,
) -> Point:
    load_before = os.getloadavg()[0]
    budget = vms * WS_BYTES // 4
    with Session(
        BUILD,
        workdir,
        vms,
        addr_base,
        *(("--cell-vms", str(cell_vms)) if cell_vms else ()),
        *("--mem", str(budget), "--block", "32k"),
        *("--disk", "none", "--boot-timeout", "600"),
        *placement,
    ) as session:
        # Prime: every VM's working set goes through the pager once.
        session.load(max(10.0, vms / 400), 0.0)
        w = session.window(window, 0.0)
    return Point(
        vms,
        int(session.ready["cell_vms"]),
        session.boot.cells,
        session.boot.boot_seconds,
        w.faults,
        w.faults_per_s,
        w.kernel_us_per_fault + w.user_us_per_fault,
        w.kernel_us_per_fault,
        w.user_us_per_fault,
        w.replies_per_s,
        load_before,
    )


def main() -> None:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", default="250,4000", help="VM counts, comma-separated")
    parser.add_argument(
        "--cell-vms", default="", help="densevm's --cell-vms, comma-separated (default: its own)"
    )
    parser.add_argument("--window", type=float, default=30.0, help="measurement window, seconds")
    parser.add_argument(
        "--cell-placement",
        choices=("pinned", "floating"),
        help="densevm's --cell-placement (default: its own)",
    )
    parser.add_argument("--json", type=Path, help="also write the points here")
    args = parser.parse_args()
    placement = ["--cell-placement", args.cell_placement] if args.cell_placement else []
    points = []
    with tempfile.TemporaryDirectory(prefix="cells-bench-") as tmp:
        for cell_vms in [int(k) for k in args.cell_vms.split(",") if k] or [None]:
            for vms in (int(n) for n in args.vms.split(",")):
                point = measure(vms, cell_vms, placement, args.window, Path(tmp), "127.3.0.0")
                points.append(point)
                print(
                    f"{vms:>6} VMs  cells of {point.cell_vms:>4} ({point.cells:>3}): "
                    f"{point.faults_per_s:>8,.0f} faults/s  "
                    f"CPU/fault {point.cpu_us_per_fault:6.0f} us (kernel "
                    f"{point.kernel_us_per_fault:5.0f}, "
                    f"user {point.user_us_per_fault:5.0f})  {point.requests_per_s:>7,.0f} req/s  "
                    f"boot {point.boot_seconds:5.1f} s  load {point.load_before:.1f}",
                    flush=True,
                )
    by_cells: dict[int, list[Point]] = {}
    for p in points:
        by_cells.setdefault(p.cell_vms, []).append(p)
    for cell_vms, group in by_cells.items():
        small, large = min(group, key=lambda p: p.vms), max(group, key=lambda p: p.vms)
        if small is not large:
            ratio = large.kernel_us_per_fault / small.kernel_us_per_fault
            print(
                f"cells of {cell_vms}: kernel CPU per fault at {large.vms} VMs / at {small.vms} "
                f"VMs = {ratio:.2f} "
                f"(target <= 1.5); faults/s at {large.vms} = {large.faults_per_s:,.0f} (target >= "
                "5,000)"
            )
    if args.json:
        args.json.write_text(json.dumps([asdict(p) for p in points], indent=2))


if __name__ == "__main__":
    main()
