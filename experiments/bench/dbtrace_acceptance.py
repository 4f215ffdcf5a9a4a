#!/usr/bin/env python3
"""Acceptance figures for the traced database guests (scalebench dbtrace).

Prints four tables:

1. the study's qualitative findings on our traces (single 15k disk model):
   browsing mixes of TPC-W and RUBiS >= 95% reads by sectors; TPC-C standard
   between 50/50 and 75/25 and its high-write mix with a larger written share;
   TPC-W browsing -> ordering grows the distinct 1 MiB regions touched per
   1,000 requests (browsing and ordering run --rounds times, interleaved; it
   must hold in every round);
2. TPC-C standard under heavy load on each disk model (throughput; the disks
   interleaved, --rounds rounds, the second in reverse order, means compared),
   in real time, or with --dilate with the disk model slowed by the guest's
   measured CPU slowdown (an emulated guest's CPU is tens of times slower than
   the machine the model's disk belongs to): one factor for every run, the
   one given (--dilate F) or the slowdown the section's first run measured;
3. tracing overhead: throughput with tracing on and off on the same disk
   model (--overhead-disk), on one guest: after the warm-up, windows of
   --window seconds with recording switched on, off, off, on, ... (--rounds
   pairs). Off, our NBD server still serves every request through the model;
   it only does not record. One guest, because throughput varies more from
   one boot to the next (+-30% here) than tracing could change it;
4. our block metrics beside the study's (heavy load tables).

Every run boots a fresh guest (copy-on-write overlay) under libvirt. The
host's load average is printed at the start and the end: other work on the
machine shifts the throughputs.

    python3 experiments/bench/dbtrace_acceptance.py [--duration 45] [--warmup S]
        [--clients 8] [--heavy-clients 16] [--memory MIB] [--rounds 2]
        [--sections 1,2,3] [--dilate [F]] [--overhead-disk hdd15k] [--window 30] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))

from scalebench.db.daemon import Libvirt  # noqa: E402
from scalebench.db.diskmodel import ARRAY, RAID5  # noqa: E402
from scalebench.db.guest import DbGuest, GuestConfig  # noqa: E402
from scalebench.db.image import ensure_image  # noqa: E402
from scalebench.db.report import compare_table, load_study, steady_verdict  # noqa: E402
from scalebench.db.run import WORKLOADS, RunOptions, RunResult, run_on_guest, warm_up  # noqa: E402
from scalebench.db.workload import run_workload  # noqa: E402
from scalebench.procs import install_signal_handlers  # noqa: E402


def run_one(conn, image, opts: RunOptions) -> RunResult:  # type: ignore[no-untyped-def]
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    with DbGuest(opts.guest, conn) as guest:
        result = run_on_guest(guest, opts)
    tp = result.throughput
    m = result.metrics
    extra = (
        f" reads {m.read_share * 100:5.1f}% of sectors, {m.regions_per_1000:6.1f} MiB-regions/1k "
        "req"
        if m
        else ""
    )
    dilation = f" dilated x{result.dilation:4.1f}" if opts.guest.dilate else ""
    print(
        f"  {opts.workload:5} {opts.mix:11} disk {opts.guest.disk:6}{dilation} trace "
        f"{'on ' if opts.guest.trace else 'off'} steady {steady_verdict(result.to_json()):9} "
        f"c{opts.clients:<3} {tp.per_minute:8.1f} {tp.per_minute_label}{extra}",
        flush=True,
    )
    return result


# Short labels for the models' names (the pager's --disk strings for the same layouts).
DISK_MODELS = {"hdd15k": "hdd15k", "array": ARRAY, "raid5": RAID5, "flash8": "flash8"}
DISKS = tuple(DISK_MODELS)


def load_average() -> str:
    return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=45.0)
    parser.add_argument(
        "--warmup",
        type=float,
        help="a fixed warm-up in seconds (default: until steady state, as dbtrace does)",
    )
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--heavy-clients", type=int, default=16)
    parser.add_argument(
        "--memory", type=int, default=GuestConfig.memory_mib, help="guest memory in MiB"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="interleaved repetitions in sections 1-3"
    )
    parser.add_argument(
        "--sections", default="1,2,3", help="which of sections 1-3 to run (4 comes with 1)"
    )
    parser.add_argument(
        "--dilate",
        nargs="?",
        type=float,
        const=0.0,
        metavar="F",
        help="section 2: time-dilate the disk models by F, or by the CPU slowdown the first "
        "run measures",
    )
    parser.add_argument(
        "--overhead-disk",
        default="hdd15k",
        choices=DISKS,
        help="section 3's disk model (tracing off: our NBD server applies it without recording)",
    )
    parser.add_argument(
        "--window", type=float, default=30.0, help="section 3: seconds of each on or off window"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / time.strftime("dbtrace-acceptance-%Y%m%d-%H%M%S", time.gmtime()),
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, not {args.rounds}")
    if args.dilate is not None and 0 < args.dilate < 1:
        parser.error(f"--dilate must be at least 1, not {args.dilate}")
    image = ensure_image()
    base = RunOptions(
        workload="tpcc",
        mix="standard",
        clients=args.clients,
        duration_s=args.duration,
        guest=GuestConfig(image=image, run_dir=args.out, disk="hdd15k", memory_mib=args.memory),
        warmup_s=args.warmup,
    )

    def opts(
        workload: str, mix: str, seed: int = 1, clients: int | None = None, **guest: object
    ) -> RunOptions:
        g = replace(base.guest, **guest)  # type: ignore[arg-type]
        o = replace(base, workload=workload, mix=mix, seed=seed, clients=clients or base.clients)
        tag = (
            f"{o.workload}-{o.mix}-{g.disk}{'-dilated' if g.dilate else ''}-c{o.clients}-"
            f"{'trace' if g.trace else 'notrace'}-s{o.seed}"
        )
        return replace(o, guest=replace(g, run_dir=args.out / tag))

    sections = {int(x) for x in args.sections.split(",")}
    rounds = range(1, args.rounds + 1)
    results: dict[str, RunResult] = {}
    print(f"start: {load_average()}; guest memory {args.memory} MiB", flush=True)
    with Libvirt() as lv:
        if 1 in sections:
            print("1. qualitative findings (disk hdd15k):", flush=True)
            for key, (w, m) in {
                "rubis-browsing": ("rubis", "browsing"),
                "rubis-highbidding": ("rubis", "highbidding"),
                "tpcc-standard": ("tpcc", "standard"),
                "tpcc-highwrite": ("tpcc", "highwrite"),
            }.items():
                results[key] = run_one(lv.conn, image, opts(w, m))
            for rep in rounds:
                for mix in ("browsing", "ordering"):
                    results[f"tpcw-{mix}-{rep}"] = run_one(
                        lv.conn, image, opts("tpcw", mix, seed=rep)
                    )
        if 2 in sections:
            dilate = args.dilate is not None
            print(
                f"2. TPC-C standard, heavy load ({args.heavy_clients} clients), "
                f"{time_base(dilate)}:",
                flush=True,
            )
            factor = args.dilate or None
            for rep in rounds:
                for disk in DISKS if rep % 2 else DISKS[::-1]:
                    r = results[f"disk-{disk}-{rep}"] = run_one(
                        lv.conn,
                        image,
                        opts(
                            "tpcc",
                            "standard",
                            disk=DISK_MODELS[disk],
                            clients=args.heavy_clients,
                            seed=rep,
                            dilate=dilate,
                            dilation=factor,
                        ),
                    )
                    factor = (
                        factor or r.dilation
                    )  # the first run's measured slowdown, for all the others
        if 3 in sections:
            print(
                f"3. tracing overhead (TPC-C standard, disk {args.overhead_disk}, one guest, "
                f"{args.window:g} s "
                f"windows: on, off, off, on, ...):",
                flush=True,
            )
            windows = tracing_windows(
                lv.conn,
                image,
                opts("tpcc", "standard", disk=args.overhead_disk),
                args.rounds,
                args.window,
            )

    if 1 in sections:
        print_findings(results, args.rounds)
    if 2 in sections:
        print_disks(results, args.heavy_clients, args.rounds, time_base(args.dilate is not None))
    if 3 in sections:
        print_overhead(windows, args.overhead_disk)
    if 1 in sections:
        print("\n== 4. ours beside the study's (heavy load) ==")
        docs = [
            results[k].to_json()
            for k in (
                "tpcw-browsing-1",
                "tpcw-ordering-1",
                "rubis-browsing",
                "rubis-highbidding",
                "tpcc-standard",
                "tpcc-highwrite",
            )
        ]
        print(compare_table(docs, load_study(), "heavy"))
    print(f"\nend: {load_average()}")
    save(results, args.out)
    return 0


def share(results: dict[str, RunResult], key: str) -> float:
    """Reads' share of the sectors moved, in percent."""
    m = results[key].metrics
    assert m is not None
    return m.read_share * 100.0


def tpm(results: dict[str, RunResult], key: str) -> float:
    return results[key].throughput.per_minute


def mean_tpm(results: dict[str, RunResult], prefix: str, rounds: int) -> float:
    return sum(tpm(results, f"{prefix}-{rep}") for rep in range(1, rounds + 1)) / rounds


def print_findings(results: dict[str, RunResult], rounds: int) -> None:
    print("\n== 1. qualitative findings ==")
    std, hw = share(results, "tpcc-standard"), share(results, "tpcc-highwrite")
    checks = [
        (
            "TPC-W browsing reads >= 95% of sectors",
            f"{share(results, 'tpcw-browsing-1'):.1f}%",
            share(results, "tpcw-browsing-1") >= 95,
        ),
        (
            "RUBiS browsing reads >= 95% of sectors",
            f"{share(results, 'rubis-browsing'):.1f}%",
            share(results, "rubis-browsing") >= 95,
        ),
        ("TPC-C standard reads in [50%, 75%]", f"{std:.1f}%", 50 <= std <= 75),
        (
            "TPC-C high write: larger written share",
            f"{100 - hw:.1f}% vs {100 - std:.1f}% written",
            hw < std,
        ),
    ]
    for rep in range(1, rounds + 1):
        fb, fo = results[f"tpcw-browsing-{rep}"].metrics, results[f"tpcw-ordering-{rep}"].metrics
        assert fb is not None and fo is not None
        checks.append(
            (
                f"TPC-W browsing -> ordering, round {rep}: MiB regions / 1k requests grow",
                f"{fb.regions_per_1000:.1f} -> {fo.regions_per_1000:.1f}",
                fo.regions_per_1000 > fb.regions_per_1000,
            )
        )
        checks.append(
            (
                f"  (4K blocks / 1k requests, information; requests {fb.reads + fb.writes} -> "
                f"{fo.reads + fo.writes})",
                f"{fb.blocks_per_1000:.1f} -> {fo.blocks_per_1000:.1f}",
                None,
            )
        )
    for text, value, ok in checks:
        print(f"  {text:72} {value:28} {'' if ok is None else ('PASS' if ok else 'FAIL')}")


def time_base(dilate: bool) -> str:
    return (
        "disk models time-dilated by one factor, the guest's CPU slowdown"
        if dilate
        else "real time"
    )


def print_disks(results: dict[str, RunResult], clients: int, rounds: int, base: str) -> None:
    print(f"\n== 2. disk configurations, TPC-C standard, {clients} clients, {base} ==")
    single = mean_tpm(results, "disk-hdd15k", rounds)
    for disk in DISKS:
        each = ", ".join(
            f"{tpm(results, f'disk-{disk}-{rep}'):.1f}" for rep in range(1, rounds + 1)
        )
        value = mean_tpm(results, f"disk-{disk}", rounds)
        print(
            f"    {disk:7} mean {value:8.1f} transactions/min ({each})  x{value / single:5.2f} of "
            "the single disk"
        )
    print(
        "    array > single: "
        f"{'PASS' if mean_tpm(results, 'disk-array', rounds) > single else 'FAIL'}; "
        "raid5 > single: "
        f"{'PASS' if mean_tpm(results, 'disk-raid5', rounds) > single else 'FAIL'}; "
        "flash8 >= 5x single: "
        f"{'PASS' if mean_tpm(results, 'disk-flash8', rounds) >= 5 * single else 'FAIL'}"
    )


def tracing_windows(
    conn, image, o: RunOptions, rounds: int, window_s: float
) -> list[tuple[bool, float]]:  # type: ignore[no-untyped-def]
    """Throughput (transactions/min) of consecutive windows on one guest, recording switched on and
    off between them: on, off / off, on / ..., so a drift during the section favours neither."""
    o.out_dir.mkdir(parents=True, exist_ok=True)
    workload = WORKLOADS[o.workload]
    windows = []
    with DbGuest(o.guest, conn) as guest:
        steady = warm_up(guest, o)
        print(f"  {steady_verdict({'steady': asdict(steady)})} after the warm-up", flush=True)
        for rep in range(rounds):
            for i, on in enumerate((True, False) if rep % 2 == 0 else (False, True)):
                guest.set_tracing(on)
                tp = run_workload(
                    workload,
                    o.mix,
                    guest.port,
                    o.clients,
                    window_s,
                    seed=o.seed + 2 * rep + i,
                    check=guest.check_alive,
                )
                windows.append((on, tp.per_minute))
                print(
                    f"  window {len(windows):2}  tracing {'on ' if on else 'off'} "
                    f"{tp.per_minute:8.1f} "
                    f"{tp.per_minute_label}",
                    flush=True,
                )
    return windows


def print_overhead(windows: list[tuple[bool, float]], disk: str) -> None:
    print(f"\n== 3. tracing overhead, TPC-C standard, disk model {disk}, one guest ==")
    on = [x for traced, x in windows if traced]
    off = [x for traced, x in windows if not traced]
    mean_on, mean_off = sum(on) / len(on), sum(off) / len(off)
    pairs = [(a - b) / b * 100 for a, b in zip(on, off, strict=False)]
    print(
        f"  tracing on: {', '.join(f'{x:.1f}' for x in on)}  off (the model applied, nothing "
        "recorded): "
        f"{', '.join(f'{x:.1f}' for x in off)} transactions/min"
    )
    print(f"  on beside off, round by round: {', '.join(f'{d:+.1f}%' for d in pairs)}")
    print(
        f"  mean on {mean_on:.1f}, off {mean_off:.1f}: difference "
        f"{(mean_on - mean_off) / mean_off * 100:+.1f}%  "
        f"{'PASS' if abs(mean_on - mean_off) <= 0.10 * mean_off else 'FAIL'} (within 10%)"
    )


def save(results: dict[str, RunResult], out: Path) -> None:
    """A list of dbtrace result documents: `scalebench dbtrace --compare --results PATH` reads
    it."""
    out.mkdir(parents=True, exist_ok=True)
    for key, result in results.items():
        result.extra["acceptance_key"] = key
    (out / "results.json").write_text(
        json.dumps([r.to_json() for r in results.values()], indent=2, default=str) + "\n"
    )
    print(f"\nresults: {out / 'results.json'}")


if __name__ == "__main__":
    sys.exit(main())
