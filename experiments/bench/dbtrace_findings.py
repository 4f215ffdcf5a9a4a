#!/usr/bin/env python3
"""The storage study's findings, each from 3 runs of dbtrace's default command.

Every run is ``scalebench dbtrace --workload W --mix M --clients C --duration D``
and nothing else that changes what is measured (``--json`` and ``--out`` only
say where the result goes): so the warm-up is dbtrace's default, until steady
state. The mixes are interleaved round by round. Findings (by sectors):

- TPC-W browsing and RUBiS browsing: >= 95% reads, in every run;
- TPC-C standard: read share between 0.50 and 0.75 (50/50 to 75/25), in every
  run; TPC-C high-write writes a larger share than standard (round by round);
- TPC-W: the footprint (distinct 1 MiB regions per 1,000 requests) grows from
  browsing to ordering (round by round).

Each run's steady-state verdict is printed beside it; a run that did not reach
steady state is counted and named in the summary. Run again with the same --out,
the bench keeps the runs an earlier invocation completed with the same options
and runs the rest, so an interrupted bench resumes.

    python3 experiments/bench/dbtrace_findings.py [--clients 4] [--duration 60] [--rounds 3]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(ROOT / "controller"), os.environ.get("PYTHONPATH", "")]
)

from scalebench.db.cli import described_options  # noqa: E402
from scalebench.procs import Child, install_signal_handlers  # noqa: E402

# How long a terminated dbtrace run may take to tear its guest and libvirtd down.
DBTRACE_TEARDOWN_S = 120.0
MIXES = (
    ("tpcw", "browsing"),
    ("tpcw", "ordering"),
    ("rubis", "browsing"),
    ("tpcc", "standard"),
    ("tpcc", "highwrite"),
)


def dbtrace_argv(workload: str, mix: str, clients: int, duration: float, out: Path) -> list[str]:
    """The arguments after ``scalebench dbtrace`` of one default run into ``out``."""
    return [
        "--workload",
        workload,
        "--mix",
        mix,
        "--clients",
        str(clients),
        "--duration",
        f"{duration:g}",
        "--json",
        str(out / "result.json"),
        "--out",
        str(out),
    ]


def expected_options(
    workload: str, mix: str, clients: int, duration: float, out: Path
) -> dict[str, Any]:
    """The options that run records, all of them, as the current build's defaults make them
    (but where it went: a kept run may have been moved)."""
    options = described_options(dbtrace_argv(workload, mix, clients, duration, out))
    options.pop("out_dir")
    return options


def run_default(
    workload: str, mix: str, clients: int, duration: float, out: Path
) -> dict[str, Any] | None:
    """One default dbtrace run in a child process (its progress lines pass through); None when
    it failed (its error is on stderr)."""
    out.mkdir(parents=True, exist_ok=True)
    argv = dbtrace_argv(workload, mix, clients, duration, out)
    cmd = [sys.executable, "-m", "scalebench", "dbtrace", *argv]
    stdout, code = Child(cmd, stdout=subprocess.PIPE, stderr=None).finish(DBTRACE_TEARDOWN_S)
    (out / "stdout.txt").write_text((stdout or b"").decode(errors="replace"))
    if code != 0:
        print(f"dbtrace_findings: {workload} {mix} failed (exit {code})", flush=True)
        return None
    return json.loads((out / "result.json").read_text())


def kept_run(
    workload: str, mix: str, clients: int, duration: float, out: Path
) -> dict[str, Any] | None:
    """The run an earlier invocation completed in `out` with these options, else None (none,
    unreadable, or made with other options, the defaults of an older build included: it is run
    again)."""
    try:
        doc = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        return None
    options = doc.get("options") if isinstance(doc, dict) else None
    if not isinstance(options, dict) or not all(
        isinstance(doc.get(k), dict) for k in ("metrics", "steady", "throughput")
    ):
        return None
    made_with = {k: v for k, v in options.items() if k != "out_dir"}
    return doc if made_with == expected_options(workload, mix, clients, duration, out) else None


def verdict(doc: dict[str, Any]) -> str:
    s = doc["steady"]
    return (
        f"steady after {s['steady_after_s']:.0f} s" if s["reached"] else f"NOT steady ({s['mode']})"
    )


def mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / time.strftime("dbtrace-findings-%Y%m%d-%H%M%S", time.gmtime()),
    )
    args = parser.parse_args()
    if args.duration < 60:
        parser.error(
            f"--duration must be at least 60 s (the findings' runs), not {args.duration:g}"
        )
    if args.rounds < 1 or args.clients < 1:
        parser.error("--rounds and --clients must be at least 1")
    runs: dict[tuple[str, str], list[dict[str, Any] | None]] = {m: [] for m in MIXES}
    failed: list[str] = []
    total = len(MIXES) * args.rounds
    print(
        f"{total} runs of {args.duration:g} s, {args.clients} clients, into {args.out}", flush=True
    )
    done = 0
    for rnd in range(1, args.rounds + 1):
        for workload, mix in MIXES:
            done += 1
            run_dir = args.out / f"{workload}-{mix}-r{rnd}"
            doc = kept_run(workload, mix, args.clients, args.duration, run_dir)
            if doc is None:
                print(f"[{done}/{total}] round {rnd}: {workload} {mix} ...", flush=True)
                doc = run_default(workload, mix, args.clients, args.duration, run_dir)
            else:
                print(f"[{done}/{total}] round {rnd}: {workload} {mix}: kept from {run_dir}")
            runs[(workload, mix)].append(doc)
            if doc is None:
                failed.append(f"{workload} {mix} round {rnd}")
                continue
            m = doc["metrics"]
            print(
                f"[{done}/{total}] {workload} {mix}: read share {m['read_share']:.3f}, "
                f"{m['regions_per_1000']:.1f} MiB-regions/1k req, "
                f"{doc['throughput']['per_minute']:.1f} {doc['throughput']['per_minute_label']}; "
                f"{verdict(doc)}",
                flush=True,
            )
    done_runs = [d for v in runs.values() for d in v if d is not None]
    (args.out / "results.json").write_text(json.dumps(done_runs, indent=2) + "\n")

    def values(w: str, m: str, key: str) -> list[float | None]:
        return [None if d is None else float(d["metrics"][key]) for d in runs[(w, m)]]

    def fmt(values: list[float | None]) -> str:
        return ", ".join("failed" if v is None else f"{v:.3f}" for v in values)

    def holds(pairs: list[tuple[float | None, float | None]], test: Any) -> str:
        """PASS when the test holds in every round where both runs completed."""
        done = [(a, b) for a, b in pairs if a is not None and b is not None]
        return "n/a" if not done else mark(all(test(a, b) for a, b in done))

    print("\nfindings (by sectors), each from every round:")
    for w in ("tpcw", "rubis"):
        s = values(w, "browsing", "read_share")
        print(
            f"  {w} browsing >= 95% reads: {fmt(s)}  "
            f"{holds([(x, x) for x in s], lambda a, _b: a >= 0.95)}"
        )
    std = values("tpcc", "standard", "read_share")
    hw = values("tpcc", "highwrite", "read_share")
    print(
        f"  tpcc standard read share in 0.50-0.75: {fmt(std)}  "
        f"{holds([(x, x) for x in std], lambda a, _b: 0.50 <= a <= 0.75)}"
    )
    print(
        f"  tpcc highwrite writes a larger share: {fmt(hw)} (read share)  "
        f"{holds(list(zip(hw, std, strict=True)), lambda h, s: h < s)}"
    )
    b = values("tpcw", "browsing", "regions_per_1000")
    o = values("tpcw", "ordering", "regions_per_1000")
    print(
        f"  tpcw footprint grows browsing -> ordering (MiB-regions/1k req): {fmt(b)} -> {fmt(o)}  "
        f"{holds(list(zip(b, o, strict=True)), lambda x, y: y > x)}"
    )
    unsteady = [
        f"{d['options']['workload']} {d['options']['mix']}"
        for d in done_runs
        if not d["steady"]["reached"]
    ]
    print(
        f"  steady state reached in {len(done_runs) - len(unsteady)} of {len(done_runs)} runs"
        + (f"; not in: {', '.join(unsteady)}" if unsteady else "")
    )
    if failed:
        print(f"  failed runs: {', '.join(failed)}")
    print(f"results: {args.out / 'results.json'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
