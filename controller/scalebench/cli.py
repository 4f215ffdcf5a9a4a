"""The scalebench command line: a thin layer over the library.

`scalebench [run flags]` (or `scalebench run ...`) runs the main job; the
subcommands are model, sweep, report, compare, nightly, dbtrace, policy and trace. Every bad
input is one line `scalebench: error: ...` on stderr and exit status 2, before
anything is started.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import NoReturn

from .config import ConfigError, RunConfig, check_addresses_free, validate
from .model import DEFAULT_FAULT_US

SUBCOMMANDS = (
    "run",
    "model",
    "sweep",
    "results",
    "report",
    "compare",
    "nightly",
    "dbtrace",
    "policy",
    "trace",
)
_DEFAULTS = RunConfig()


class Parsed(Exception):
    """parse(): the command line was parsed, and nothing is run."""

    def __init__(self, namespace: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = namespace


class Parser(argparse.ArgumentParser):
    """argparse with its errors as a single line (no usage dump), exit 2."""

    parse_only = False  # set by parse(): stop right after parsing

    def error(self, message: str) -> None:  # type: ignore[override]
        fail(message)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        if Parser.parse_only:
            raise Parsed(parsed)
        return parsed


def parse(argv: list[str]) -> argparse.Namespace:
    """The flags of `scalebench ARGV` as its subcommand parses them, with nothing run (for
    checking documented commands). Bad input exits 2 as it does for the command."""
    Parser.parse_only = True
    try:
        main(argv)
    except Parsed as p:
        return p.namespace
    finally:
        Parser.parse_only = False
    raise RuntimeError(f"scalebench {' '.join(argv)}: no parser ran")


def fail(message: str) -> NoReturn:
    sys.stderr.write(f"scalebench: error: {message}\n")
    sys.exit(2)


def _workload_flags(p: argparse.ArgumentParser) -> None:
    """Flags the main job and the model share."""
    d = _DEFAULTS
    p.add_argument("--vms", type=int, default=d.vms, help=f"number of VMs (default {d.vms})")
    p.add_argument(
        "--alpha",
        type=float,
        default=d.alpha,
        help=f"Zipf popularity parameter (default {d.alpha})",
    )
    p.add_argument(
        "--block", default=d.block, help=f"paging block size, 4k..256k (default {d.block})"
    )
    p.add_argument("--mem", default=d.mem, help=f"memory budget of all guests (default {d.mem})")
    p.add_argument("--policy", default=d.policy, help="demand, wsswap or PATH.so (default demand)")
    p.add_argument(
        "--disk", default=d.disk, help="disk model: none, hdd, hdd15k, ssd, array:N, raid5:N"
    )
    p.add_argument("--ws", default=d.ws, help=f"per-request working set of a VM (default {d.ws})")
    p.add_argument(
        "--object", choices=("small", "large"), default=d.object, help="2,258 or 134,007 bytes"
    )
    p.add_argument(
        "--cpu-us",
        type=float,
        default=None,
        help="in-core CPU microseconds per request for the model (default: calibrated)",
    )
    p.add_argument(
        "--fault-us",
        type=float,
        default=None,
        help="the model's host microseconds per pager fault (default: calibrated by the run's "
        f"settle phase, else the host's stored calibration, else {DEFAULT_FAULT_US:g})",
    )
    p.add_argument(
        "--idle-after",
        type=float,
        default=None,
        metavar="SECONDS",
        help="hibernate a VM idle this long, its next request waking it (densevm --idle-after; "
        "default: never while every VM fits live on this host, else 300 with --max-live 10000)",
    )
    p.add_argument(
        "--max-live",
        type=int,
        default=None,
        metavar="N",
        help="at most N VMs awake, the host's least recently used idle ones hibernated past it "
        "(needs --idle-after; default: no cap, or see --idle-after)",
    )
    p.add_argument(
        "--clone-boot",
        action="store_true",
        help="with hibernation, start every VM at its first request as a clone of the image's "
        "saved template instead of booting it (densevm --clone-boot)",
    )


def run_parser() -> Parser:
    d = _DEFAULTS
    p = Parser(
        prog="scalebench",
        description="Run densevm VMs under Zipf load and report throughput, "
        "paging and the model's prediction. Subcommands: " + ", ".join(SUBCOMMANDS[1:]) + ".",
    )
    _workload_flags(p)
    p.add_argument(
        "--duration", type=float, default=d.duration, help="measurement seconds (default 60)"
    )
    p.add_argument(
        "--warmup", type=float, default=d.warmup, help=f"warm-up seconds (default {d.warmup:g})"
    )
    p.add_argument(
        "--concurrency", type=int, default=d.concurrency, help="requests in flight (default 64)"
    )
    p.add_argument(
        "--calls-per-conn",
        type=int,
        default=d.calls_per_conn,
        help="requests per connection (default 1: a new connection to a Zipf-drawn VM each)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=d.timeout,
        help=f"zipfperf timeout in seconds (default {d.timeout:g}: "
        "a cold VM on a modeled disk is slow)",
    )
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument(
        "--no-touch",
        dest="touch",
        action="store_false",
        help="skip the touch phase (one request per VM so every working set exists "
        "before the warm-up)",
    )
    p.add_argument("--addr-base", default=d.addr_base)
    p.add_argument("--port", type=int, default=d.port)
    p.add_argument("--json", default=None, help="also write the result JSON here")
    p.add_argument("--out", default=None, help="run directory (default runs/<run-id>)")
    p.add_argument("--db-guests", type=int, default=0, help="database guests to run alongside")
    p.add_argument("--db-workload", default=None, help="their workload (see scalebench dbtrace)")
    p.add_argument("--db-mix", default=None, help="their workload mix")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def config_from(args: argparse.Namespace) -> RunConfig:
    known = RunConfig.field_names()
    return RunConfig(**{k: v for k, v in vars(args).items() if k in known})


def validated(args: argparse.Namespace) -> RunConfig:
    """The run's configuration from its flags, validated; says so on stderr when scale to
    zero was turned on for it."""
    cfg = validate(config_from(args))
    if args.idle_after is None and cfg.idle_after is not None:
        sys.stderr.write(
            f"scalebench: {cfg.vms} VMs cannot all be live on this host: scale to zero is on "
            f"(--idle-after {cfg.idle_after:g} --max-live {cfg.max_live}; give either to choose)\n"
        )
    return cfg


def cmd_run(argv: list[str]) -> int:
    from .procs import Terminated, install_signal_handlers
    from .progress import ConsoleReporter, Reporter
    from .runner import Binaries, run
    from .summary import summary

    args = run_parser().parse_args(argv)
    cfg = validated(args)
    bins = Binaries.find()
    check_addresses_free(cfg)
    install_signal_handlers()
    try:
        result = run(cfg, Reporter() if args.quiet else ConsoleReporter(), bins)
    except (KeyboardInterrupt, Terminated):
        sys.stderr.write("scalebench: interrupted; everything stopped, partial result written\n")
        return 130
    print(summary(result))
    if result.status != "ok":
        sys.stderr.write(f"scalebench: error: {result.error}\n")
        return 1
    return 0


def cmd_model(argv: list[str]) -> int:
    from . import calibration, diskbench
    from .model import estimate_footprint, model_input, predict, unmodeled
    from .units import parse_size

    p = Parser(prog="scalebench model", description="Predict throughput with Denali's model.")
    _workload_flags(p)
    p.add_argument(
        "--footprint", default=None, help="per-VM resident footprint (default: estimated)"
    )
    p.add_argument(
        "--bench-dir",
        default=None,
        help="directory on the swap device to microbenchmark (default runs/; 'none' to skip)",
    )
    p.add_argument("--json", action="store_true", help="print the prediction as JSON")
    args = p.parse_args(argv)
    cfg = validated(args)
    error = unmodeled(cfg.policy)
    if error:
        raise ConfigError(error)
    try:
        footprint = (
            parse_size(args.footprint)
            if args.footprint
            else estimate_footprint(cfg.ws_bytes, cfg.block_bytes)
        )
    except ValueError as e:
        raise ConfigError(f"--footprint: {e}") from None
    # Out of core the disk decides and the in-core cost hardly matters; in core it is the
    # whole answer.
    cpu_us, source = calibration.cpu_us(cfg.cpu_us, cfg.object, fallback=calibration.UNCALIBRATED)
    fault_us, fault_source = calibration.fault_us(cfg.fault_us, cfg.block_bytes)
    assert cpu_us is not None and fault_us is not None  # both fallbacks have values
    bench = None
    if args.bench_dir != "none":
        try:
            bench = diskbench.measure(
                Path(args.bench_dir or Path.cwd() / "runs"), cfg.block_bytes, footprint
            )
        except OSError as e:
            raise ConfigError(f"--bench-dir: {e}") from None
    pred = predict(model_input(cfg, footprint, cpu_us, fault_us, bench))
    if args.json:
        print(
            json.dumps(
                {
                    "prediction": pred.as_dict(),
                    "cpu_source": source,
                    "fault_source": fault_source,
                    "diskbench": bench.as_dict() if bench else None,
                },
                indent=2,
            )
        )
        return 0
    print(
        f"model: {cfg.vms} VMs, alpha {cfg.alpha}, block {cfg.block}, mem {cfg.mem}, "
        f"{cfg.policy}, disk {cfg.disk}"
    )
    print(
        f"  footprint {footprint / 2**20:.2f} MiB per VM -> {pred.cache_vms} VMs fit; "
        f"throughput halves at {pred.cliff_vms} VMs (the cliff)"
    )
    print(
        f"  hit ratio {pred.hit_ratio:.4f} (LRU under Zipf: Che's approximation, "
        "closed-loop when disk-bound)"
    )
    print(
        f"  miss: read {pred.miss_read_s * 1e3:.2f} ms + write {pred.miss_write_s * 1e3:.2f} ms"
        + (
            f" (device: {bench.random_read_s * 1e6:.0f} us per random {cfg.block} read)"
            if bench
            else ""
        )
    )
    print(
        f"  cpu {cpu_us:.1f} us/request ({source}) + {fault_us:.0f} us per fault ({fault_source}) "
        f"-> CPU bound {pred.cpu_rps:,.0f} requests/s, swap I/O bound {pred.disk_rps:,.0f} "
        "requests/s"
    )
    if cfg.idle_after is not None:
        print(
            f"  wakes {pred.wake_fraction:.4f} of requests (hibernated after {cfg.idle_after:g} s"
            + (f", at most {cfg.max_live} awake" if cfg.max_live is not None else "")
            + f"), each {pred.wake_ms:g} ms of latency and {pred.wake_cpu_us:g} us of CPU"
        )
    print(f"  predicted {pred.model_rps:,.1f} requests/s, {pred.regime}")
    return 0


def remodel_sweep(exp, out: Path) -> int:
    """sweep --remodel: the model re-evaluated on every stored point, then the sweep's files
    rewritten."""
    from .runner import remodel
    from .sweep import finish_sweep, point_record

    if not (out / "points").is_dir():
        raise ConfigError(f"--remodel: no stored points in {out}")
    for key, _ in exp.points():
        path = point_record(out, key)
        r = remodel(path) if path.exists() else None
        if r is not None:
            before = r.model["remodeled"]["model_rps_before"]
            print(
                f"{key}: measured {r.throughput_rps:,.4g}/s, model {before and f'{before:,.4g}'} "
                "-> "
                f"{r.model_rps:,.4g}/s, measured/model {r.measured_over_model:.2f}"
            )
    finish_sweep(exp, out)
    print(f"sweep {exp.name}: remodeled; results in {out}")
    return 0


def cmd_sweep(argv: list[str]) -> int:
    from .procs import Terminated, install_signal_handlers
    from .progress import ConsoleReporter
    from .runner import Binaries, run
    from .sweep import load_experiment, run_sweep

    p = Parser(prog="scalebench sweep", description="Run an experiment file's grid (resumable).")
    p.add_argument("experiment", help="experiments/FILE.toml")
    p.add_argument(
        "--out", default=None, help="sweep directory (default runs/sweep-<name>; reused to resume)"
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="run only the grid's points with this setting (repeatable); "
        "a later whole run keeps them",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        dest="settings",
        help="replace a [base] setting of the file (repeatable), e.g. --set addr_base=127.2.0.0 "
        "to run beside another sweep",
    )
    p.add_argument(
        "--remodel",
        action="store_true",
        help="run nothing: re-evaluate the model on the stored points (after a model change), "
        "then rewrite the CSV, plots and checks",
    )
    p.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run the points on a dask cluster, one per host: its scheduler (tcp://HOST:8786) or "
        "scheduler file, workers started with --resources host=1 (docs/cluster.md); or 'local': "
        "a one-worker cluster on this host, started and stopped by the sweep",
    )
    args = p.parse_args(argv)
    exp = load_experiment(Path(args.experiment)).overridden(args.settings).restricted(args.only)
    out = Path(args.out) if args.out else Path.cwd() / "runs" / f"sweep-{exp.name}"
    if args.remodel:
        return remodel_sweep(exp, out)
    reporter = ConsoleReporter()
    if args.cluster:
        try:
            from .cluster import run_sweep_on_cluster
        except ModuleNotFoundError as e:
            raise ConfigError(f"--cluster needs {e.name}: pip install -e '.[cluster]'") from None
        sweep = partial(run_sweep_on_cluster, exp, out, args.cluster, reporter)
    else:
        bins = Binaries.find()
        check_addresses_free(max((cfg for _, cfg in exp.points()), key=lambda cfg: cfg.vms))
        sweep = partial(run_sweep, exp, out, lambda cfg: run(cfg, reporter, bins), reporter)
    install_signal_handlers()
    try:
        doc = sweep()
    except (KeyboardInterrupt, Terminated):
        sys.stderr.write(f"scalebench: interrupted; run the same command again to resume ({out})\n")
        return 130
    for warning in doc["warnings"]:
        sys.stderr.write(f"scalebench: warning: {warning}\n")
    failed = [k for k, d in doc["points"].items() if d.get("status") != "ok"]
    print(
        f"sweep {exp.name}: {len(doc['points']) - len(failed)} point(s) ok, {len(failed)} failed; "
        f"results in {out} (scalebench report {out})"
    )
    return 1 if failed else 0


def cmd_results(argv: list[str]) -> int:
    from . import results
    from .procs import Terminated, install_signal_handlers

    p = Parser(
        prog="scalebench results",
        description="Stored results (experiments/results/FIGURE): `make FIGURE` runs the "
        "figure's experiment (resumable) and publishes its points CSV, plots, checks.csv and "
        "manifest.json; `list` shows each figure's command and state; `replot FIGURE` redraws "
        "a stored figure's plots.",
    )
    sub = p.add_subparsers(dest="action", required=True)
    mk = sub.add_parser("make", help="run (or resume) one figure and publish it")
    mk.add_argument("figure", choices=results.FIGURES)
    mk.add_argument(
        "--cluster",
        default=None,
        metavar="ADDRESS",
        help="run the points through dask: 'local' (a one-worker cluster started and stopped "
        "here) or a scheduler's address or file (docs/cluster.md)",
    )
    mk.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings")
    mk.add_argument("--only", action="append", default=[], metavar="KEY=VALUE")
    mk.add_argument(
        "--work", default=None, help="where the runs go (default runs/results-FIGURE; resumes)"
    )
    mk.add_argument("--dest", default=None, help=f"results folder (default {results.RESULTS_DIR})")
    sub.add_parser("list", help="each figure's command, state and estimated wall time")
    rp = sub.add_parser(
        "replot",
        help="redraw a stored figure's plots from its stored points and checks (runs nothing)",
    )
    rp.add_argument("figure", choices=results.FIGURES)
    rp.add_argument("--dest", default=None, help=f"results folder (default {results.RESULTS_DIR})")
    args = p.parse_args(argv)
    if args.action == "list":
        for figure in results.FIGURES:
            s = results.figure_state(results.RESULTS_DIR, figure)
            m = s["manifest"]
            state = (
                f"{m['finished_at']}, build {str(m['build']['commit'])[:12]}, checks "
                f"{m['checks']['passed']} passed, {m['checks']['failed']} failed"
                if m
                else f"not run (about {s['estimated_hours']:g} h)"
            )
            print(f"{figure}: {s['command']}  [{state}]")
        return 0
    if args.action == "replot":
        manifest = results.replot(args.figure, Path(args.dest) if args.dest else None)
        plots = [name for name in manifest["files"] if name.endswith(".png")]
        print(
            f"results {args.figure}: redrew {', '.join(plots)} from the stored points and checks "
            f"(made on {str(manifest['build']['commit'])[:12]})"
        )
        return 0
    install_signal_handlers()
    try:
        manifest = results.make(
            args.figure,
            ["results", *argv],
            cluster=args.cluster,
            settings=args.settings,
            only=args.only,
            work=Path(args.work) if args.work else None,
            dest_root=Path(args.dest) if args.dest else None,
        )
    except (KeyboardInterrupt, Terminated):
        sys.stderr.write("scalebench: interrupted; run the same command again to resume\n")
        return 130
    checks = manifest["checks"]
    dest = Path(args.dest or results.RESULTS_DIR) / args.figure
    print(
        f"results {args.figure}: {checks['passed']} check(s) passed, {checks['failed']} failed; "
        f"{dest} (scalebench report {dest.parent})"
    )
    return 0


def cmd_report(argv: list[str]) -> int:
    from .report import render, render_history, render_results
    from .results import is_results_root

    p = Parser(
        prog="scalebench report",
        description="Render DIR/report.html for a sweep directory, DIR/index.html for a "
        "results folder (experiments/results), or, with --history FILE, the nightly history's "
        "page (OUT/index.html).",
    )
    p.add_argument("dir", nargs="?")
    p.add_argument("--history", default=None, metavar="FILE", help="a nightly history (SQLite)")
    p.add_argument(
        "--out", default=None, metavar="OUT", help="with --history: where (default FILE-report/)"
    )
    args = p.parse_args(argv)
    if args.history:
        history = Path(args.history)
        if args.dir or not history.is_file():
            raise ConfigError(f"--history {history}: not a file (and takes no DIR)")
        out = Path(args.out) if args.out else history.with_name(f"{history.stem}-report")
        try:
            print(render_history(history, out))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        return 0
    if not args.dir or not Path(args.dir).is_dir():
        raise ConfigError(f"{args.dir} is not a directory")
    if is_results_root(Path(args.dir)):
        print(render_results(Path(args.dir)))
        return 0
    print(render(Path(args.dir)))
    return 0


def cmd_compare(argv: list[str]) -> int:
    from . import compare

    p = Parser(
        prog="scalebench compare", description="Compare two results; exit 1 on a regression."
    )
    p.add_argument("base")
    p.add_argument("new")
    p.add_argument(
        "--tolerance",
        type=float,
        default=compare.DEFAULT_TOLERANCE_PCT,
        metavar="PCT",
        help=f"allowed change in percent (default {compare.DEFAULT_TOLERANCE_PCT:g})",
    )
    p.add_argument(
        "--mixed-hosts",
        action="store_true",
        help="compare points that ran on different kinds of host",
    )
    args = p.parse_args(argv)
    if args.tolerance < 0:
        raise ConfigError("--tolerance must be >= 0")
    try:
        base, new = compare.load(Path(args.base)), compare.load(Path(args.new))
    except (OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    mixed = compare.mixed_hosts(base, new)
    if mixed and not args.mixed_hosts:
        point, base_kind, new_kind = mixed[0]
        raise ConfigError(
            f"{len(mixed)} point(s) ran on different kinds of host (first, {point}: {base_kind} "
            f"against {new_kind}); pass --mixed-hosts to compare them anyway"
        )
    rows = compare.compare(base, new, args.tolerance)
    compare.print_table(rows, args.tolerance)
    return 1 if compare.regressed(rows) else 0


def cmd_nightly(argv: list[str]) -> int:
    from .binaries import bin_dir
    from .history import default_path
    from .nightly import METRICS, Options, ProbeError, nightly
    from .procs import install_signal_handlers
    from .progress import ConsoleReporter
    from .runner import Binaries

    p = Parser(
        prog="scalebench nightly",
        description="Scaling regression check: repeated interleaved trials, medians with "
        "bootstrap CIs, history in SQLite, change points (E-Divisive). Exit 0 clean, "
        "1 regression, 3 host too noisy.",
    )
    p.add_argument("--quick", action="store_true", help="only the metrics marked quick (< 5 min)")
    p.add_argument(
        "--history", default=None, metavar="FILE", help=f"SQLite history (default {default_path()})"
    )
    p.add_argument(
        "--compare-bin",
        default=None,
        metavar="DIR",
        help="A/B: also measure the densevm and zipfperf in DIR, interleaved, and compare",
    )
    p.add_argument(
        "--inject-request-us",
        type=int,
        default=0,
        metavar="N",
        help="pass densevm --inject-request-us N (a known in-core slowdown; only to check this "
        "check)",
    )
    p.add_argument(
        "--inject-fault-us",
        type=int,
        default=0,
        metavar="N",
        help="pass densevm --inject-fault-us N (a known per-fault slowdown; only to check this "
        "check)",
    )
    p.add_argument("--metrics", default=str(METRICS), metavar="FILE", help="probes and metrics")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: the metrics file's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.inject_request_us < 0 or args.inject_fault_us < 0:
        raise ConfigError("--inject-request-us and --inject-fault-us must be >= 0")
    if args.rounds is not None and args.rounds < 1:
        raise ConfigError("--rounds must be >= 1")
    if args.compare_bin and not Path(args.compare_bin).is_dir():
        raise ConfigError(f"--compare-bin {args.compare_bin} is not a directory")
    Binaries.find()
    install_signal_handlers()
    opts = Options(
        quick=args.quick,
        history=Path(args.history) if args.history else None,
        compare_bin=Path(args.compare_bin) if args.compare_bin else None,
        inject_request_us=args.inject_request_us,
        inject_fault_us=args.inject_fault_us,
        metrics_file=Path(args.metrics),
        out_dir=Path(args.out) if args.out else None,
        rounds=args.rounds,
    )
    try:
        return nightly(opts, bin_dir(), ConsoleReporter())
    except ProbeError as e:
        sys.stderr.write(f"scalebench: nightly: {e}\n")
        return 1


def cmd_dbtrace(argv: list[str]) -> int:
    try:
        from .db import cli as db_cli  # another developer's; may need libvirt
    except ImportError as e:
        raise ConfigError(f"dbtrace is unavailable: {e}") from None
    p = Parser(prog="scalebench")
    db_cli.add_parser(p.add_subparsers(dest="command", required=True))
    return db_cli.run(p.parse_args(["dbtrace", *argv]))


def cmd_policy(argv: list[str]) -> int:
    from .policydev import commands

    return commands.run_policy(commands.policy_parser(Parser).parse_args(argv))


def cmd_trace(argv: list[str]) -> int:
    from .policydev import commands

    return commands.run_trace(commands.trace_parser(Parser).parse_args(argv))


COMMANDS = {
    "run": cmd_run,
    "model": cmd_model,
    "sweep": cmd_sweep,
    "results": cmd_results,
    "report": cmd_report,
    "compare": cmd_compare,
    "nightly": cmd_nightly,
    "dbtrace": cmd_dbtrace,
    "policy": cmd_policy,
    "trace": cmd_trace,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in COMMANDS:
        command, rest = COMMANDS[argv[0]], argv[1:]
    else:
        command, rest = cmd_run, argv
    try:
        return command(rest)
    except ConfigError as e:
        fail(str(e))


if __name__ == "__main__":
    sys.exit(main())
