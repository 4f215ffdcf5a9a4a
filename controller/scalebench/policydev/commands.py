"""argparse layer of `scalebench policy ...` and `scalebench trace ...` (thin: the work is in
scaffold, traces, record and grid)."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime
from pathlib import Path

from ..config import ConfigError, RunConfig
from ..units import parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def policy_parser(parser_class) -> argparse.ArgumentParser:
    p = parser_class(prog="scalebench policy", description="Develop and compare paging policies.")
    sub = p.add_subparsers(dest="action", required=True)
    new = sub.add_parser("new", help="create a standalone plugin crate")
    new.add_argument("name", help="crate and policy name (lowercase, digits, _)")
    new.add_argument("--dir", default=".", help="parent directory (default: the current one)")
    cmp = sub.add_parser("compare", help="pagesim over policies x blocks x alphas (or traces)")
    cmp.add_argument(
        "--policies",
        default="demand,wsswap",
        help="demand, wsswap, PATH.so, py:MODULE:CLASS (a Python policy), ...",
    )
    cmp.add_argument("--blocks", default="4k,32k,128k", help="block sizes (default 4k,32k,128k)")
    cmp.add_argument("--alpha", default=None, help="Zipf alphas of synthetic runs (default 1.0)")
    cmp.add_argument(
        "--trace", action="append", default=[], help="trace file (repeatable), instead of --alpha"
    )
    cmp.add_argument("--disk", default="hdd", help="disk model (default hdd)")
    cmp.add_argument("--mem", default="1G", help="memory budget (default 1G)")
    cmp.add_argument("--vms", type=int, default=4000, help="synthetic: VMs (default 4000)")
    cmp.add_argument(
        "--requests", type=int, default=200_000, help="synthetic: requests (default 200000)"
    )
    cmp.add_argument("--warmup", type=int, default=None, help="requests not counted (default R/4)")
    cmp.add_argument("--seed", type=int, default=1)
    cmp.add_argument("--workers", type=int, default=None, help="parallel pagesims (default: cores)")
    cmp.add_argument("--out", default=None, help="output directory (default policy-compare-STAMP)")
    cmp.add_argument(
        "--real",
        action="store_true",
        help="rerun each policy's best synthetic points on densevm, simulated beside measured",
    )
    cmp.add_argument(
        "--real-points", type=int, default=1, help="with --real: points per policy (default 1)"
    )
    cmp.add_argument(
        "--real-duration",
        type=float,
        default=30.0,
        help="with --real: measured seconds of each run (default 30)",
    )
    cmp.add_argument(
        "--addr-base",
        default=RunConfig.addr_base,
        help=f"with --real: the VMs' first address (default {RunConfig.addr_base})",
    )
    return p


def trace_parser(parser_class) -> argparse.ArgumentParser:
    p = parser_class(prog="scalebench trace", description="Make request traces for pagesim.")
    sub = p.add_subparsers(dest="action", required=True)
    syn = sub.add_parser("synth", help="a synthetic Zipf trace")
    syn.add_argument("--vms", type=int, required=True)
    syn.add_argument("--alpha", type=float, required=True)
    syn.add_argument("--requests", type=int, required=True)
    syn.add_argument("--seed", type=int, default=1)
    syn.add_argument("--ws", type=_size, default="896K", help="working set per request (896K)")
    syn.add_argument("--extra", type=_size, default="128K", help="stack/bss per request (128K)")
    syn.add_argument("--guest-mem", type=_size, default="4M", help="RAM of every VM (4M)")
    syn.add_argument("--block", type=_size, default="32k", help="nominal block size (32k)")
    syn.add_argument("--out", required=True, help="trace file to write")
    rec = sub.add_parser("record", help="record a short real densevm run")
    rec.add_argument("--vms", type=int, default=64)
    rec.add_argument("--alpha", type=float, default=1.0)
    rec.add_argument("--seconds", type=float, default=10.0)
    rec.add_argument("--seed", type=int, default=1)
    rec.add_argument("--block", default="32k")
    rec.add_argument("--mem", default="1G")
    rec.add_argument("--ws", default="896K")
    rec.add_argument("--policy", default="demand")
    rec.add_argument("--concurrency", type=int, default=16)
    rec.add_argument("--addr-base", default="127.30.0.0")
    rec.add_argument("--port", type=int, default=8080)
    rec.add_argument("--out", required=True, help="trace file to write")
    return p


def run_policy(args: argparse.Namespace) -> int:
    if args.action == "new":
        from .scaffold import new_policy

        crate = new_policy(args.name, Path(args.dir))
        print(f"created {crate}: cd {crate} && cargo build --release")
        print(f"plugin: {crate / 'target' / 'release' / f'lib{args.name}.so'}")
        return 0
    return _compare(args)


def _compare(args: argparse.Namespace) -> int:
    from . import grid

    if args.vms < 1 or args.requests < 1 or (args.workers is not None and args.workers < 1):
        raise ConfigError("--vms, --requests and --workers must be >= 1")
    warmup = args.requests // 4 if args.warmup is None else args.warmup
    if not 0 <= warmup < args.requests:
        raise ConfigError("--warmup must be >= 0 and below --requests")
    spec = grid.GridSpec(
        policies=grid.parse_policies(args.policies),
        blocks=grid.parse_blocks(args.blocks),
        workloads=grid.parse_workloads(args.alpha, args.trace),
        disk=args.disk,
        mem=args.mem,
        vms=args.vms,
        requests=args.requests,
        warmup=warmup,
        seed=args.seed,
        **({"workers": args.workers} if args.workers else {}),
    )
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    out = Path(args.out or f"policy-compare-{stamp}")
    if args.real:
        _check_real(args, spec, out)
    total = len(spec.policies) * len(spec.blocks) * len(spec.workloads)
    done = []

    def progress(point: grid.PointResult) -> None:
        done.append(point)
        print(f"[{len(done)}/{total}] {point.policy} {point.block} {point.workload}", flush=True)

    points = grid.run_grid(spec, progress)
    print(grid.table(points))
    grid.write_outputs(out, spec, points)
    failed = [p for p in points if p.error]
    print(
        f"{len(points) - len(failed)} point(s) ok, {len(failed)} failed; results in {out} "
        f"(scalebench report {out})"
    )
    real_failed = _compare_real(args, spec, points, out) if args.real else False
    return 1 if failed or real_failed else 0


def _check_real(args: argparse.Namespace, spec, out: Path) -> None:
    """--real's settings, checked before the grid runs: a real run that could not start
    should not cost the simulations first."""
    from . import grid, pypolicy, real

    if args.real_points < 1 or args.real_duration <= 0:
        raise ConfigError("--real-points must be >= 1 and --real-duration > 0")
    python = [p for p in spec.policies if p.startswith(pypolicy.PREFIX)]
    if python:
        raise ConfigError(
            f"--real: {', '.join(python)} runs only in the simulator; densevm needs the Rust "
            "version of a policy (paging-policy/README.md, porting a Python policy)"
        )
    synthetic = [w for w in spec.workloads if w.alpha is not None and w.trace is None]
    if not synthetic:
        raise ConfigError("--real reruns synthetic points: give --alpha, not only --trace")
    for policy in spec.policies:
        probe = grid.PointResult(grid.policy_label(policy), spec.blocks[0], synthetic[0].alpha, "")
        real.run_config(spec, probe, out, args.real_duration, args.addr_base)


def _compare_real(args: argparse.Namespace, spec, points, out: Path) -> bool:
    """Reruns the best points on densevm and prints them beside the simulator; True if any
    real run failed."""
    from . import real

    chosen = real.best_points(points, args.real_points)
    print(
        f"--real: {len(chosen)} point(s) on densevm, {spec.vms} VMs, "
        f"{args.real_duration:g} s measured each (plus boot, touch and warm-up)",
        flush=True,
    )

    def progress(i: int, n: int, p: real.RealPoint) -> None:
        outcome = f"error: {p.error}" if p.error else f"{p.real_rps or 0:.1f} requests/s"
        print(f"[real {i}/{n}] {p.policy} {p.block} alpha={p.alpha:g}: {outcome}", flush=True)

    results = real.rerun(spec, chosen, out, args.real_duration, args.addr_base, progress)
    print(real.table(results))
    real.write_csv(out / "real.csv", results)
    print(f"simulated vs measured in {out / 'real.csv'}; each run's files under {out / 'real'}")
    return any(p.error for p in results)


def run_trace(args: argparse.Namespace) -> int:
    from . import traces

    if args.action == "synth":
        try:
            info = traces.synth(
                Path(args.out),
                args.vms,
                args.alpha,
                args.requests,
                args.seed,
                args.ws,
                args.extra,
                args.guest_mem,
                args.block,
            )
        except traces.TraceError as e:
            raise ConfigError(str(e)) from None
    else:
        from .record import RecordSpec, record

        spec = RecordSpec(
            vms=args.vms,
            alpha=args.alpha,
            seconds=args.seconds,
            seed=args.seed,
            block=args.block,
            mem=args.mem,
            ws=args.ws,
            policy=args.policy,
            concurrency=args.concurrency,
            addr_base=args.addr_base,
            port=args.port,
        )
        from ..densevm import DenseVMError
        from ..zipfperf import ZipfperfError

        try:
            info = record(Path(args.out), spec)
        except (DenseVMError, ZipfperfError, traces.TraceError) as e:
            sys.stderr.write(f"scalebench: error: trace record: {e}\n")
            return 1
    h = info.header
    print(
        f"{info.path}: {info.requests} requests, {h['vms']} VMs, "
        f"working set {h.get('working_set_bytes', 0) // 1024} KiB per request, "
        f"source {h.get('source', '?')}, alpha {h.get('alpha')}, seed {h.get('seed')}"
    )
    return 0
