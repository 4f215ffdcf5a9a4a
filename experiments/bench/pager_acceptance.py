#!/usr/bin/env python3
"""Acceptance figures of the pager under real densevm guests.

  integrity  self-checking guests, both policies, blocks 4k/32k/256k, until the
             faults add up to --faults in total (default 1,000,000): mismatches;
             64 VMs in cells of 16, so the pager serves four processes at once
  budget     --mem at 25% of the working sets: every request succeeds, and the
             resident memory sampled during the run never exceeds the budget by
             more than faults in flight x block
  wsswap     4,000 VMs, Zipf 1.0, 32k, --disk hdd, 1 GiB: wsswap's requests/s
             over demand's, both measured in this run, each after every VM
             has served once (so working sets are on swap) and a Zipf warm-up
  pagesim    the demand run above, recorded and replayed through pagesim: its
             hit ratio against the one densevm measured

Usage: experiments/bench/pager_acceptance.py [--part all|integrity|budget|wsswap|pagesim]
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.densevm import control  # noqa: E402
from scalebench.procs import install_signal_handlers  # noqa: E402

BIN = ROOT / "target" / "release"


class Run:
    """One densevm serve with its flags; stats through the control API. A context manager
    that stops it on exit."""

    def __init__(self, workdir: Path, vms: int, *flags: str, addr_base: str = "127.1.0.0"):
        self.api = workdir / "densevm.sock"
        self.addr_base = addr_base
        self.vms = vms
        self.proc = subprocess.Popen(
            [
                str(BIN / "densevm"),
                "serve",
                "--vms",
                str(vms),
                "--addr-base",
                addr_base,
                "--api",
                str(self.api),
                "--swap",
                str(workdir / "swap.img"),
                *flags,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=workdir,
        )
        try:
            line = self.proc.stdout.readline()
            if not line:
                raise SystemExit(f"densevm failed: {self.proc.stderr.read().strip()}")
            self.ready = json.loads(line)
        except BaseException:
            self.stop()
            raise

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def totals(self) -> dict:
        return control(self.api, {"cmd": "stats"}, timeout_s=120)["totals"]

    def load(self, seconds: float, alpha: float, concurrency: int = 32, seed: int = 1) -> dict:
        out = subprocess.run(
            [
                str(BIN / "zipfperf"),
                "--targets",
                str(self.vms),
                "--addr-base",
                self.addr_base,
                "--port",
                "8080",
                "--alpha",
                str(alpha),
                "--seed",
                str(seed),
                "--concurrency",
                str(concurrency),
                "--num-calls",
                "1",
                "--duration",
                str(seconds),
                "--timeout",
                "30",
                "--json",
                "-",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out[out.index("{") :])

    def prime(self, concurrency: int = 32) -> float:
        """One request to every VM, so each has a working set and most of
        them are on swap: the state a long-running host is in."""
        started = time.monotonic()
        addrs = [str(ipaddress.IPv4Address(self.addr_base) + i) for i in range(self.vms)]
        with ThreadPoolExecutor(concurrency) as pool:
            list(
                pool.map(
                    lambda a: urllib.request.urlopen(f"http://{a}:8080/", timeout=600).read(), addrs
                )
            )
        return time.monotonic() - started

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def integrity(workdir: Path, total_faults: int) -> list[dict]:
    configs = [(p, b) for p in ("demand", "wsswap") for b in ("4k", "32k", "256k")]
    per_config = total_faults // len(configs) + 1
    rows = []
    for policy, block in configs:
        vms = 64
        with Run(
            workdir,
            vms,
            "--selfcheck",
            "--policy",
            policy,
            "--block",
            block,
            "--mem",
            str(vms * (1 << 20) // 4),
            "--cell-vms",
            "16",
        ) as run:
            started = time.monotonic()
            while run.totals()["faults"] < per_config:
                run.load(5, alpha=0.0, concurrency=16)
            t = run.totals()
        rows.append(
            {
                "policy": policy,
                "block": block,
                "faults": t["faults"],
                "requests": t["requests"],
                "pages_checked": t["selfcheck_pages"],
                "mismatches": t["selfcheck_errors"],
                "seconds": time.monotonic() - started,
            }
        )
        print(
            f"integrity {policy:6} {block:>4}: {t['faults']:>8} faults, "
            f"{t['selfcheck_pages']:>10} pages checked, "
            f"{t['selfcheck_errors']} mismatches"
        )
    print(
        f"integrity total: {sum(r['faults'] for r in rows)} faults, "
        f"{sum(r['mismatches'] for r in rows)} mismatches"
    )
    return rows


def budget(workdir: Path) -> dict:
    vms, block = 256, 32 << 10
    mem = vms * (1 << 20) // 4
    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def sample():
        # The pager's count is taken under its lock; the kernel's (mincore,
        # VM by VM) spans a few ms of faults and evictions, so it can only
        # overstate what was resident at any one moment.
        while not done.is_set():
            t = run.totals()
            samples.append((t["resident_bytes"], t["ram_resident_bytes"]))
            time.sleep(0.02)

    with Run(workdir, vms, "--mem", str(mem), "--block", "32k") as run:
        sampler = threading.Thread(target=sample)
        sampler.start()
        try:
            result = run.load(20, alpha=0.5)
        finally:
            done.set()
            sampler.join()
        t = run.totals()
    slack = 8 * block
    pager_max = max(p for p, _ in samples)
    kernel_max = max(k for _, k in samples)
    row = {
        "budget_bytes": mem,
        "max_resident_bytes": pager_max,
        "max_kernel_resident_bytes": kernel_max,
        "samples": len(samples),
        "slack_bytes": slack,
        "replies": result["replies"]["total"],
        "ok_2xx": result["replies"]["status"]["2xx"],
        "errors": result["errors"]["total"],
        "faults": t["faults"],
    }
    print(
        f"budget: {len(samples)} samples, max resident {pager_max / 2**20:.2f} MiB (kernel's "
        "non-atomic count "
        f"{kernel_max / 2**20:.2f} MiB) vs budget {mem / 2**20:.2f} MiB "
        f"(+{slack // 1024} KiB in flight allowed); {row['ok_2xx']}/{row['replies']} replies 2xx, "
        f"{row['errors']} errors, {t['faults']} faults"
    )
    return row


def policy_run(
    workdir: Path, policy: str, warmup: float, seconds: float, trace: Path | None
) -> dict:
    flags = ["--policy", policy, "--block", "32k", "--disk", "hdd", "--mem", "1G"]
    if trace:
        flags += ["--record-trace", str(trace)]
    with Run(workdir, 4000, *flags) as run:
        primed = run.prime()
        run.load(warmup, alpha=1.0, seed=7)
        before = run.totals()
        result = run.load(seconds, alpha=1.0, seed=8)
        after = run.totals()
    return {
        "policy": policy,
        "rps": result["replies"]["rate"],
        "errors": result["errors"]["total"],
        "requests": after["requests"] - before["requests"],
        "faults": after["faults"] - before["faults"],
        "warmup_requests": before["requests"],
        "boot_seconds": run.ready["boot_seconds"],
        "prime_seconds": primed,
    }


def wsswap_vs_demand(workdir: Path, warmup: float, seconds: float) -> dict:
    trace = workdir / "demand.trace"
    demand = policy_run(workdir, "demand", warmup, seconds, trace)
    wsswap = policy_run(workdir, "wsswap", warmup, seconds, None)
    ratio = wsswap["rps"] / demand["rps"] if demand["rps"] else float("inf")
    print(
        f"wsswap vs demand (4000 VMs, alpha 1.0, 32k, hdd, 1 GiB): demand {demand['rps']:.1f} "
        "req/s, "
        f"wsswap {wsswap['rps']:.1f} req/s -> {ratio:.2f}x"
    )
    return {"demand": demand, "wsswap": wsswap, "ratio": ratio, "trace": str(trace)}


def pagesim_agreement(demand: dict, trace: Path) -> dict:
    out = subprocess.run(
        [
            str(BIN / "pagesim"),
            "--trace",
            str(trace),
            "--mem",
            "1G",
            "--block",
            "32k",
            "--policy",
            "demand",
            "--disk",
            "hdd",
            "--warmup",
            str(demand["warmup_requests"]),
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    sim = json.loads(out)
    measured = 1 - demand["faults"] / (demand["requests"] * sim["request_blocks"])
    gap = abs(sim["hit_ratio"] - measured) * 100
    print(
        f"pagesim: hit ratio {sim['hit_ratio']:.4f} vs densevm {measured:.4f} -> {gap:.2f} "
        "percentage points"
    )
    return {
        "pagesim_hit_ratio": sim["hit_ratio"],
        "measured_hit_ratio": measured,
        "gap_points": gap,
    }


def main() -> None:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part", default="all", choices=["all", "integrity", "budget", "wsswap", "pagesim"]
    )
    parser.add_argument(
        "--faults", type=int, default=1_000_000, help="integrity: total faults over the six runs"
    )
    parser.add_argument("--warmup", type=float, default=30)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    figures: dict = {}
    with tempfile.TemporaryDirectory(dir=ROOT / "target") as tmp:
        workdir = Path(tmp)
        if args.part in ("all", "integrity"):
            figures["integrity"] = integrity(workdir, args.faults)
        if args.part in ("all", "budget"):
            figures["budget"] = budget(workdir)
        if args.part in ("all", "wsswap", "pagesim"):
            figures["wsswap"] = wsswap_vs_demand(workdir, args.warmup, args.seconds)
            figures["pagesim"] = pagesim_agreement(
                figures["wsswap"]["demand"], Path(figures["wsswap"]["trace"])
            )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
