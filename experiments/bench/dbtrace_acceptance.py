#!/usr/bin/env python3
"""Acceptance figures for the traced database guests (scalebench dbtrace).

Prints four tables:

1. the study's qualitative findings on our traces (single 15k disk model):
   browsing mixes of TPC-W and RUBiS >= 95% reads by sectors; TPC-C standard
   between 50/50 and 75/25 and its high-write mix with a larger written share;
   TPC-W browsing -> ordering grows the distinct blocks touched per 1,000
   requests;
2. TPC-C standard under heavy load on each disk model (throughput);
   (in real time, and time-dilated by the guest's measured CPU slowdown);
3. tracing overhead: throughput with tracing on (our NBD server) and off
   (QEMU opens the qcow2 overlay itself), no disk model;
4. our block metrics beside the study's (heavy load tables).

Every run boots a fresh guest (copy-on-write overlay) under libvirt.

    python3 experiments/bench/dbtrace_acceptance.py [--duration 45] [--warmup 15]
        [--clients 8] [--heavy-clients 16] [--out runs/dbtrace-acceptance]
"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))

from scalebench.db.daemon import Libvirt  # noqa: E402
from scalebench.db.guest import DbGuest, GuestConfig  # noqa: E402
from scalebench.db.image import ensure_image  # noqa: E402
from scalebench.db.report import compare_table, load_study  # noqa: E402
from scalebench.db.run import RunOptions, RunResult, run_on_guest  # noqa: E402


def run_one(conn, image, opts: RunOptions) -> RunResult:  # type: ignore[no-untyped-def]
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    config = GuestConfig(image=image, run_dir=opts.out_dir, disk=opts.disk, trace=opts.trace, dilate=opts.dilate)
    with DbGuest(config, conn) as guest:
        result = run_on_guest(guest, opts, opts.out_dir)
    tp = result.throughput
    m = result.metrics
    extra = (f" reads {m.read_share * 100:5.1f}% of sectors, {m.regions_per_1000:6.1f} MiB-regions/1k req"
             if m else "")
    dilation = f" dilated x{result.dilation:.1f}" if result.dilation > 1 else ""
    print(f"  {opts.workload:5} {opts.mix:11} disk {opts.disk:6}{dilation} trace {'on ' if opts.trace else 'off'} "
          f"c{opts.clients:<3} {tp.per_minute:8.1f} {tp.per_minute_label}{extra}", flush=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument("--warmup", type=float, default=15.0)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--heavy-clients", type=int, default=16)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / time.strftime("dbtrace-acceptance-%Y%m%d-%H%M%S",
                                                                                   time.gmtime()))
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit("dbtrace_acceptance: terminated"))
    image = ensure_image()
    base = RunOptions(workload="tpcc", mix="standard", clients=args.clients, duration_s=args.duration,
                      disk="hdd15k", warmup_s=args.warmup, out_dir=args.out)

    def opts(workload: str, mix: str, **kw: object) -> RunOptions:
        o = replace(base, workload=workload, mix=mix, **kw)  # type: ignore[arg-type]
        tag = (f"{o.workload}-{o.mix}-{o.disk}{'-dilated' if o.dilate else ''}-c{o.clients}-"
               f"{'trace' if o.trace else 'notrace'}")
        return replace(o, out_dir=args.out / tag)

    results: dict[str, RunResult] = {}
    with Libvirt() as lv:
        print("1. qualitative findings (disk hdd15k):", flush=True)
        for key, (w, m) in {"tpcw-browsing": ("tpcw", "browsing"), "tpcw-ordering": ("tpcw", "ordering"),
                            "rubis-browsing": ("rubis", "browsing"), "rubis-highbidding": ("rubis", "highbidding"),
                            "tpcc-standard": ("tpcc", "standard"), "tpcc-highwrite": ("tpcc", "highwrite")}.items():
            results[key] = run_one(lv.conn, image, opts(w, m))
        print(f"2. TPC-C standard, heavy load ({args.heavy_clients} clients):", flush=True)
        for dilate in (False, True):
            for disk in ("hdd15k", "array", "raid5", "ssd"):
                results[f"disk-{disk}-{dilate}"] = run_one(lv.conn, image, opts("tpcc", "standard", disk=disk,
                                                                                clients=args.heavy_clients,
                                                                                dilate=dilate))
        print("3. tracing overhead (TPC-C standard):", flush=True)
        for disk in ("none",):
            for trace in (True, False):
                results[f"trace-{disk}-{trace}"] = run_one(lv.conn, image, opts("tpcc", "standard", disk=disk,
                                                                                trace=trace))

    def share(key: str) -> float:
        m = results[key].metrics
        assert m is not None
        return m.read_share * 100.0

    def tpm(key: str) -> float:
        return results[key].throughput.per_minute

    print("\n== 1. qualitative findings ==")
    checks = [
        ("TPC-W browsing reads >= 95% of sectors", f"{share('tpcw-browsing'):.1f}%", share("tpcw-browsing") >= 95),
        ("RUBiS browsing reads >= 95% of sectors", f"{share('rubis-browsing'):.1f}%", share("rubis-browsing") >= 95),
        ("TPC-C standard reads in [50%, 75%]", f"{share('tpcc-standard'):.1f}%",
         50 <= share("tpcc-standard") <= 75),
        ("TPC-C high write: larger written share", f"{100 - share('tpcc-highwrite'):.1f}% vs "
         f"{100 - share('tpcc-standard'):.1f}% written", share("tpcc-highwrite") < share("tpcc-standard")),
    ]
    fb = results["tpcw-browsing"].metrics
    fo = results["tpcw-ordering"].metrics
    assert fb is not None and fo is not None
    checks.append(("TPC-W browsing -> ordering: MiB regions / 1k requests grow",
                   f"{fb.regions_per_1000:.1f} -> {fo.regions_per_1000:.1f}",
                   fo.regions_per_1000 > fb.regions_per_1000))
    checks.append(("TPC-W browsing -> ordering: 4K blocks / 1k requests (for information)",
                   f"{fb.blocks_per_1000:.1f} -> {fo.blocks_per_1000:.1f}", None))
    for text, value, ok in checks:
        print(f"  {text:62} {value:28} {'' if ok is None else ('PASS' if ok else 'FAIL')}")

    print(f"\n== 2. disk configurations, TPC-C standard, {args.heavy_clients} clients ==")
    for dilate in (False, True):
        single = tpm(f"disk-hdd15k-{dilate}")
        factor = results[f"disk-hdd15k-{dilate}"].dilation
        print("  disk model in real time (the guest's CPU is emulated: TCG here)" if not dilate else
              f"  disk model time-dilated by the guest's measured CPU slowdown (x{factor:.1f})")
        for disk in ("hdd15k", "array", "raid5", "ssd"):
            value = tpm(f"disk-{disk}-{dilate}")
            print(f"    {disk:7} {value:8.1f} transactions/min  x{value / single:5.2f} of the single disk")
        print(f"    array > single: {'PASS' if tpm(f'disk-array-{dilate}') > single else 'FAIL'}; "
              f"raid5 > single: {'PASS' if tpm(f'disk-raid5-{dilate}') > single else 'FAIL'}; "
              f"ssd >= 5x single: {'PASS' if tpm(f'disk-ssd-{dilate}') >= 5 * single else 'FAIL'}")

    print("\n== 3. tracing overhead, TPC-C standard ==")
    on, off = tpm("trace-none-True"), tpm("trace-none-False")
    print(f"  disk none: tracing on (our NBD server) {on:8.1f}  off (qcow2 overlay opened by QEMU) {off:8.1f}  "
          f"difference {(on - off) / off * 100:+5.1f}%  {'PASS' if abs(on - off) <= 0.10 * off else 'FAIL'}")

    print("\n== 4. ours beside the study's (heavy load) ==")
    docs = [results[k].to_json() for k in ("tpcw-browsing", "tpcw-ordering", "rubis-browsing", "rubis-highbidding",
                                           "tpcc-standard", "tpcc-highwrite")]
    print(compare_table(docs, load_study(), "heavy"))
    args.out.mkdir(parents=True, exist_ok=True)
    for key, result in results.items():
        result.extra["acceptance_key"] = key
    # A list of dbtrace result documents: `scalebench dbtrace --compare --results PATH` reads it.
    (args.out / "results.json").write_text(json.dumps([r.to_json() for r in results.values()], indent=2,
                                                      default=str) + "\n")
    print(f"\nresults: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
