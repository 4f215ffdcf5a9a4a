"""``scalebench dbtrace``: a thin command line over scalebench.db.run.

    scalebench dbtrace --workload tpcc|tpcw|rubis|pgbench --mix NAME --clients N --duration S
                       [--disk none|hdd15k|array:4,drive=hdd15k|raid5:4,drive=hdd15k|flash8]
                       [--json PATH] [--out DIR] [--warmup S | --warmup-cap S] [--scale N]
                       [--no-trace] [--dilate [FACTOR]]
                       [--memory MIB] [--db-cache MIB] [--boot-timeout S]
    scalebench dbtrace --compare [--results JSON ...] [--study-load heavy|light]
                       [--clients N --duration S --disk MODEL]

Without ``--results``, ``--compare`` runs the read- and write-intensive mix of
every benchmark (or of ``--workload`` alone) and prints the table beside the
study's. Without ``--warmup``, each run warms up until steady state (steady.py),
at most ``--warmup-cap`` seconds, and says whether it got there. Bad input: one
line on stderr, exit 2; a failed run: exit 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from .diskmodel import MODEL_NAMES
from .errors import DbTraceError
from .guest import DEFAULT_DB_CACHE_MIB
from .pgbench import DEFAULT_MIX as PGBENCH_MIX
from .pgbench import DEFAULT_SCALE
from .report import (
    agreement_line,
    compare_table,
    load_study,
    metrics_table,
    steady_line,
    steady_verdict,
    throughput_line,
)
from .steady import DEFAULT_CAP_S, SteadyCriteria

EXIT_BAD_INPUT, EXIT_FAILED = 2, 1


class _Usage(Exception):
    """Bad command-line input found after parsing."""


def _one_line_error(message: str) -> NoReturn:
    """argparse's error(), reduced to one line on stderr and exit code 2."""
    print(f"scalebench dbtrace: error: {message}", file=sys.stderr)
    raise SystemExit(EXIT_BAD_INPUT)


def add_parser(subparsers: Any) -> None:
    """Register the ``dbtrace`` subcommand on an argparse subparsers object."""
    p = subparsers.add_parser(
        "dbtrace",
        help="run a database guest under libvirt and trace its block I/O",
        description="Run an e-commerce database guest under libvirt/QEMU, trace its virtual "
        "disk from the host and print the storage study's block metrics.",
    )
    p.add_argument(
        "--workload",
        choices=("tpcc", "tpcw", "rubis", "pgbench"),
        help="benchmark to run (pgbench: PostgreSQL's own client, the external reference)",
    )
    p.add_argument(
        "--mix",
        help="tpcc: standard|highwrite; tpcw: browsing|shopping|ordering; "
        "rubis: browsing|bidding|highbidding; pgbench: tpcb-like (default)|simple-update|"
        "select-only",
    )
    p.add_argument(
        "--scale",
        type=int,
        default=DEFAULT_SCALE,
        help=f"pgbench: the pgbench database's scale factor (default {DEFAULT_SCALE})",
    )
    p.add_argument("--clients", type=int, default=8, help="concurrent database clients (default 8)")
    p.add_argument("--duration", type=float, default=60.0, help="measured seconds (default 60)")
    p.add_argument(
        "--disk",
        choices=MODEL_NAMES,
        default="hdd15k",
        help="disk model on the traced path (default hdd15k, the study's 15,000 RPM disk)",
    )
    p.add_argument("--json", type=Path, help="write the result document(s) here")
    p.add_argument(
        "--out",
        type=Path,
        help="directory for the trace CSV and the LBA plot (default runs/dbtrace-*)",
    )
    p.add_argument(
        "--warmup",
        type=float,
        help="a fixed warm-up of S unmeasured seconds (0: none) instead of warming up until "
        "steady state",
    )
    p.add_argument(
        "--warmup-cap",
        type=float,
        default=DEFAULT_CAP_S,
        help=f"longest warm-up while waiting for steady state (default {DEFAULT_CAP_S:g} s)",
    )
    p.add_argument(
        "--no-trace", action="store_true", help="do not record the trace (throughput only)"
    )
    p.add_argument(
        "--dilate",
        nargs="?",
        type=float,
        const=0.0,
        metavar="FACTOR",
        help="time-dilate the disk model by FACTOR, or without one by the guest's measured CPU "
        "slowdown (TCG guests)",
    )
    p.add_argument("--memory", type=int, default=256, help="guest memory in MiB (default 256)")
    p.add_argument(
        "--db-cache",
        type=int,
        default=DEFAULT_DB_CACHE_MIB,
        metavar="MIB",
        help="page cache the database server's files may keep in the guest, beside its own "
        f"buffers (default {DEFAULT_DB_CACHE_MIB}; 0: no limit)",
    )
    p.add_argument(
        "--boot-timeout", type=float, default=240.0, help="seconds to wait for the guest's database"
    )
    p.add_argument("--compare", action="store_true", help="print our metrics beside the study's")
    p.add_argument(
        "--results",
        type=Path,
        nargs="+",
        help="with --compare: saved --json results instead of runs",
    )
    p.add_argument(
        "--study-load",
        choices=("heavy", "light"),
        default="heavy",
        help="with --compare: the study's load level to compare with (default heavy)",
    )
    p.error = _one_line_error  # type: ignore[method-assign]
    p.set_defaults(func=run)


def described_options(argv: list[str]) -> dict[str, Any]:
    """The options that ``scalebench dbtrace ARGV`` records in its result, without running it
    (what a resumed bench compares a run it kept with)."""
    top = argparse.ArgumentParser(prog="scalebench")
    add_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["dbtrace", *argv])
    try:
        return _options(args, args.workload, args.mix).describe()
    except _Usage as err:
        _one_line_error(str(err))


def _options(args: argparse.Namespace, workload: str, mix: str) -> Any:
    from .guest import GuestConfig
    from .run import RunOptions, default_out_dir, validate

    steady = SteadyCriteria(cap_s=args.warmup_cap)
    try:
        validate(workload, mix, args.clients, args.duration, args.disk)
        steady.validate()
    except ValueError as err:
        raise _Usage(str(err)) from err
    if args.warmup is not None and args.warmup < 0:
        raise _Usage(f"--warmup must not be negative, not {args.warmup}")
    if args.scale < 1:
        raise _Usage(f"--scale must be at least 1, not {args.scale}")
    if args.memory < 128:
        raise _Usage(f"--memory must be at least 128 MiB, not {args.memory}")
    if not 0 <= args.db_cache <= args.memory // 2:
        raise _Usage(
            f"--db-cache must be 0 to {args.memory // 2} MiB (half of --memory), not "
            f"{args.db_cache}"
        )
    if args.dilate is not None and 0 < args.dilate < 1:
        raise _Usage(f"--dilate must be at least 1, not {args.dilate}")
    if args.boot_timeout <= 0:
        raise _Usage(f"--boot-timeout must be positive, not {args.boot_timeout}")
    guest = GuestConfig(
        image=None,
        run_dir=args.out or default_out_dir("dbtrace"),
        disk=args.disk,
        trace=not args.no_trace,
        memory_mib=args.memory,
        db_cache_mib=args.db_cache or None,
        boot_timeout_s=args.boot_timeout,
        dilate=args.dilate is not None,
        dilation=args.dilate or None,
    )
    return RunOptions(
        workload=workload,
        mix=mix,
        clients=args.clients,
        duration_s=args.duration,
        guest=guest,
        warmup_s=args.warmup,
        steady=steady,
        scale=args.scale,
    )


def _progress(window: Any, reason: str | None) -> None:
    """One line on stderr per warm-up window."""
    share = window.read_share
    agree = "windows agree" if window.after_checkpoint else "windows agree, no checkpoint yet"
    print(
        f"warm-up {window.start_s:5.0f}-{window.end_s:4.0f} s: {window.per_second:.2f}/s"
        f"{f', read share {share:.2f}' if share is not None else ''}"
        f"{', after a checkpoint' if window.after_checkpoint else ''}: {reason or agree}",
        file=sys.stderr,
        flush=True,
    )


def _db_cache(opts: dict[str, Any]) -> str:
    cache = opts.get("db_cache_mib")  # absent from results saved before the limit existed
    return f" (database page cache {cache} MiB)" if cache else ""


def _print_run(doc: dict[str, Any]) -> None:
    opts = doc["options"]
    print(
        f"dbtrace {opts['workload']} {opts['mix']}: {opts['clients']} clients, "
        f"{opts['duration_s']:g} s, "
        f"disk {opts['disk']}, domain type {doc['domain_type']}, guest "
        f"{opts['memory_mib']} MiB{_db_cache(opts)}, up in {doc['boot_seconds']:.1f} s"
    )
    if doc["dilation"] > 1.0:
        print(
            f"disk model time-dilated x{doc['dilation']:.1f} (guest CPU slowdown measured against "
            "native)"
        )
    print(steady_line(doc))
    print(throughput_line(doc))
    if doc["metrics"]:
        m = doc["metrics"]
        print(metrics_table(f"{opts['workload']} {opts['mix']}", m, steady_verdict(doc)))
        print(
            f"reads {m['reads']}, writes {m['writes']}, flushes {m['flushes']}; read share by "
            "sectors "
            f"{m['read_share'] * 100:.1f}%; footprint {m['regions_per_1000']:.0f} MiB-regions and "
            f"{m['blocks_per_1000']:.0f} 4K-blocks per 1,000 requests; mean latency read "
            f"{m['mean_read_latency_ms']:.2f} ms, write {m['mean_write_latency_ms']:.2f} ms"
        )
        if doc.get("postgres"):
            print(agreement_line(doc["postgres"]))
        print(f"trace: {doc['trace_csv']}\nLBA plot: {doc['lba_plot']}")


def _compare(args: argparse.Namespace) -> int:
    from .run import (
        READ_INTENSIVE,
        WORKLOADS,
        WRITE_INTENSIVE,
        load_results,
        run_dbtrace,
        save_json,
    )

    if args.results:
        docs = [d for path in args.results for d in load_results(path)]
    else:
        if args.workload == "pgbench":
            raise _Usage("--compare has no study figures for pgbench")
        names = [args.workload] if args.workload else list(WORKLOADS)
        plans = [(w, m) for w in names for m in (READ_INTENSIVE[w], WRITE_INTENSIVE[w])]
        options = [_options(args, w, m) for w, m in plans]
        results = []
        for opts in options:
            guest = dataclasses.replace(
                opts.guest, run_dir=opts.out_dir / f"{opts.workload}-{opts.mix}"
            )
            opts = dataclasses.replace(opts, guest=guest)
            results.append(run_dbtrace(opts, _progress))
            _print_run(results[-1].to_json())
        if args.json:
            save_json(results, args.json)
        docs = [r.to_json() for r in results]
    print(f"ours beside the study's ({args.study_load} load, Tables 10-11 / 8-9):")
    print(compare_table(docs, load_study(), args.study_load))
    return 0


def _raise_interrupt() -> NoReturn:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    """Execute ``dbtrace``; returns the exit code."""
    from .run import run_dbtrace, save_json

    if threading.current_thread() is threading.main_thread():
        # A SIGTERM unwinds like Ctrl-C: the guest is destroyed and the libvirtd we
        # started is stopped.
        signal.signal(signal.SIGTERM, lambda _sig, _frame: _raise_interrupt())
    try:
        if args.compare:
            return _compare(args)
        if args.workload == "pgbench" and not args.mix:
            args.mix = PGBENCH_MIX
        if not args.workload or not args.mix:
            raise _Usage("--workload and --mix are required (or use --compare)")
        if args.results:
            raise _Usage("--results only goes with --compare")
        result = run_dbtrace(_options(args, args.workload, args.mix), _progress)
        _print_run(result.to_json())
        if args.json:
            save_json(result, args.json)
        return 0
    except _Usage as err:
        print(f"scalebench dbtrace: error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except DbTraceError as err:
        print(f"scalebench dbtrace: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("scalebench dbtrace: error: interrupted; the guest was destroyed", file=sys.stderr)
        return EXIT_FAILED


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (``python -m scalebench.db``) until the main CLI registers add_parser."""
    parser = argparse.ArgumentParser(prog="scalebench")
    parser.error = _one_line_error  # type: ignore[method-assign]
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))
