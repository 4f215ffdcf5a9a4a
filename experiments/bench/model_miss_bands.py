#!/usr/bin/env python3
"""Misses per request by popularity band: one run measured beside the model's closed loop and Che.

Runs one scalebench point (every flag but --bands and --every passes through),
samples densevm's per-VM counters over the control API meanwhile, and over the
run's measurement phase prints, per band of VM popularity ranks, the share of
requests that missed (swap reads over the footprint) beside what the model's
closed loop (controller/scalebench/model.py) and Che's approximation alone give
for the run's own k. This is the evidence behind the closed-loop disk bound.

Usage: experiments/bench/model_miss_bands.py --vms 1100 --policy wsswap --disk hdd --mem 1G
           [--bands 0.45,0.73,0.86,0.95] [--every 5] [other scalebench flags]
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from scalebench.densevm import DenseVMError, control
from scalebench.disks import disk_model
from scalebench.model import ModelInput, che_time, closed_loop, zipf_popularity
from scalebench.procs import Child, install_signal_handlers

ROOT = Path(__file__).resolve().parents[2]
# How long the stopped scalebench run may take to tear its densevm down before it is killed.
SCALEBENCH_TEARDOWN_S = 120.0


def sample(api: Path, every_s: float, done: threading.Event, out: list[dict]) -> None:
    """Per-VM counters every `every_s` seconds while the run lives."""
    while not api.exists() and not done.is_set():
        time.sleep(0.2)
    while not done.is_set():
        try:
            stats = control(api, {"cmd": "stats"}, timeout_s=30)
        except DenseVMError:
            if out:
                return  # densevm is gone: the run ended
        else:
            out.append(
                {
                    "requests": stats["totals"]["requests"],
                    "vms": {
                        v["id"]: (v.get("requests", 0), v.get("swap_read_bytes", 0))
                        for v in stats["vms"]
                    },
                }
            )
        done.wait(every_s)


def main() -> int:
    install_signal_handlers()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bands", default="0.45,0.73,0.86,0.95", help="band edges, shares of VMs")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    args, passthrough = ap.parse_known_args()
    out = ROOT / "runs" / f"miss-bands-{datetime.now(UTC):%Y%m%dT%H%M%S}"
    snapshots: list[dict] = []
    done = threading.Event()
    sampler = threading.Thread(
        target=sample, args=(out / "densevm.sock", args.every, done, snapshots)
    )
    sampler.start()
    try:
        # Stopped (Ctrl-C, SIGTERM), the bench SIGTERMs the run, which stops its densevm:
        # subprocess.run would SIGKILL it and leave densevm running.
        cmd = ["scalebench", *passthrough, "--out", str(out)]
        _, code = Child(cmd, stdout=None, stderr=None).finish(SCALEBENCH_TEARDOWN_S)
    finally:
        done.set()
        sampler.join()
    if code != 0:
        print(f"model_miss_bands: the run failed (exit {code}); see {out}")
        return 1
    r = json.loads((out / "result.json").read_text())
    measure = [row["requests"] for row in r["timeseries"] if row["phase"] == "measure"]
    inside = [s for s in snapshots if measure[0] <= s["requests"] <= measure[-1]]
    if len(inside) < 2:
        print(f"model_miss_bands: fewer than 2 samples in the measurement phase ({out})")
        return 1
    first, last = inside[0]["vms"], inside[-1]["vms"]
    cfg, model = r["config"], r["model"]
    n, fp = cfg["vms"], r["footprint_bytes"]
    ids = np.arange(n)
    requests = np.array([last[i][0] - first[i][0] for i in ids], float)
    misses = np.array([last[i][1] - first[i][1] for i in ids], float) / fp
    p = zipf_popularity(n, cfg["alpha"])
    k = model["cache_vms"]
    inp = ModelInput(
        n,
        cfg["alpha"],
        cfg["block_bytes"],
        cfg["mem_bytes"],
        fp,
        cfg["policy"],
        disk_model(cfg["disk"]),
        model["cpu_us"] * 1e-6,
        None,
    )
    closed, _ = closed_loop(n, k, cfg["alpha"], cfg["concurrency"], inp.paging_in)
    che = np.exp(-p * che_time(p, k))
    edges = [0, *(round(float(x) * n) for x in args.bands.split(",")), n]
    print(
        f"{n} VMs, {cfg['policy']}, k {k} (footprint {fp / cfg['block_bytes']:.2f} blocks), "
        f"{int(requests.sum()):,} requests in the measurement phase: misses per request"
    )
    print(f"{'ranks':>11} {'requests':>9} {'measured':>9} {'closed':>8} {'Che':>8}")
    for lo, hi in [*itertools.pairwise(edges), (0, n)]:
        band = slice(lo, hi)
        weight = p[band] / p[band].sum()
        print(
            f"{lo:>5}-{hi:<5} {int(requests[band].sum()):>9,} "
            f"{misses[band].sum() / max(requests[band].sum(), 1):9.4f} "
            f"{float(weight @ closed[band]):8.4f} {float(weight @ che[band]):8.4f}"
        )
    print(f"result: {out / 'result.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
