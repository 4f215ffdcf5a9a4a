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
steady state is counted and named in the summary.

    python3 experiments/bench/dbtrace_findings.py [--clients 4] [--duration 60] [--rounds 3]
        [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MIXES = (
    ("tpcw", "browsing"),
    ("tpcw", "ordering"),
    ("rubis", "browsing"),
    ("tpcc", "standard"),
    ("tpcc", "highwrite"),
)


def run_default(workload: str, mix: str, clients: int, duration: float, out: Path) -> dict:
    """One default dbtrace run in a child process (its progress lines pass through)."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "scalebench",
        "dbtrace",
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
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "controller"), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True, check=False)
    (out / "stdout.txt").write_text(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"dbtrace_findings: {workload} {mix} failed (exit {proc.returncode})")
    return json.loads((out / "result.json").read_text())


def share(doc: dict[str, Any]) -> float:
    return float(doc["metrics"]["read_share"])


def verdict(doc: dict[str, Any]) -> str:
    s = doc["steady"]
    return (
        f"steady after {s['steady_after_s']:.0f} s" if s["reached"] else f"NOT steady ({s['mode']})"
    )


def mark(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def main() -> int:
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
    signal.signal(signal.SIGTERM, lambda _sig, _frame: sys.exit("dbtrace_findings: terminated"))
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {m: [] for m in MIXES}
    total = len(MIXES) * args.rounds
    print(
        f"{total} runs of {args.duration:g} s, {args.clients} clients, into {args.out}", flush=True
    )
    done = 0
    for rnd in range(1, args.rounds + 1):
        for workload, mix in MIXES:
            done += 1
            print(f"[{done}/{total}] round {rnd}: {workload} {mix} ...", flush=True)
            doc = run_default(
                workload, mix, args.clients, args.duration, args.out / f"{workload}-{mix}-r{rnd}"
            )
            runs[(workload, mix)].append(doc)
            m = doc["metrics"]
            print(
                f"[{done}/{total}] {workload} {mix}: read share {m['read_share']:.3f}, "
                f"{m['regions_per_1000']:.1f} MiB-regions/1k req, "
                f"{doc['throughput']['per_minute']:.1f} {doc['throughput']['per_minute_label']}; "
                f"{verdict(doc)}",
                flush=True,
            )
    (args.out / "results.json").write_text(
        json.dumps([d for v in runs.values() for d in v], indent=2) + "\n"
    )

    def shares(w: str, m: str) -> list[float]:
        return [share(d) for d in runs[(w, m)]]

    def fmt(values: list[float]) -> str:
        return ", ".join(f"{v:.3f}" for v in values)

    print("\nfindings (by sectors), each from every round:")
    for w in ("tpcw", "rubis"):
        s = shares(w, "browsing")
        print(f"  {w} browsing >= 95% reads: {fmt(s)}  {mark(all(x >= 0.95 for x in s))}")
    std, hw = shares("tpcc", "standard"), shares("tpcc", "highwrite")
    print(
        f"  tpcc standard read share in 0.50-0.75: {fmt(std)}  "
        f"{mark(all(0.50 <= x <= 0.75 for x in std))}"
    )
    print(
        f"  tpcc highwrite writes a larger share: {fmt(hw)} (read share)  "
        f"{mark(all(h < s for h, s in zip(hw, std, strict=True)))}"
    )
    b = [d["metrics"]["regions_per_1000"] for d in runs[("tpcw", "browsing")]]
    o = [d["metrics"]["regions_per_1000"] for d in runs[("tpcw", "ordering")]]
    print(
        f"  tpcw footprint grows browsing -> ordering (MiB-regions/1k req): {fmt(b)} -> {fmt(o)}  "
        f"{mark(all(y > x for x, y in zip(b, o, strict=True)))}"
    )
    unsteady = [
        f"{d['options']['workload']} {d['options']['mix']}"
        for v in runs.values()
        for d in v
        if not d["steady"]["reached"]
    ]
    print(
        f"  steady state reached in {total - len(unsteady)} of {total} runs"
        + (f"; not in: {', '.join(unsteady)}" if unsteady else "")
    )
    print(f"results: {args.out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
