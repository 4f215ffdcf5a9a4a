#!/usr/bin/env python3
"""Chaos between cells under load: every few seconds a random cell or holder
of densevm is SIGKILLed or SIGSTOPped, or a cell's link to the parent carries
hostile words (garbage, an oversized line, lying counts), while zipfperf
drives Zipf 1.0 load over every VM with self-checking guests.

The VMs are split in two halves. Chaos strikes only the cells and holders of
the upper half; the lower half ("untouched") is loaded by a zipfperf of its
own, so its errors and p99 are measured apart. The same split is first run
for --baseline-minutes without chaos. VMs that die are replaced with
`create`, and the dead ones forgotten with `destroy`, so the host returns to
the same number of live VMs.

Acceptance (issue 39), printed at the end:
  - the parent is alive;
  - the untouched VMs never failed a request, and their guests' self-checks
    found 0 mismatches;
  - the untouched p99 is within 2x of the baseline's;
  - the parent's fd count and RSS and the swap file's allocated size are
    within 5% of their start once the dead VMs are destroyed.

Usage: experiments/bench/cell_chaos.py [--vms 4000] [--mem 1G] [--minutes 10]
       [--baseline-minutes 3] [--interval 5] [--seed 1]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ipaddress
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.densevm import DenseVMError, control  # noqa: E402
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import children  # noqa: E402

RELEASE = ROOT / "target" / "release"
ADDR_BASE = ipaddress.IPv4Address("127.1.0.0")
SYS_PIDFD_GETFD = 438
BATCH = 100  # VMs created at once
CREATE_TIMEOUT_S = 90  # above the parent's create deadline (link::protocol::deadline)
HOSTILE_WORDS = [
    b"\x00\xffgarbage, not json\n",
    b"x" * (70 << 20),
    b'{"ev":"booted","ready":4294967295,"failed":4294967295}\n',
    b'{"ev":"access","counts":[[4000000000,1],[0,18446744073709551615]]}\n',
    b'{"ev":"stopped","vm":0}\n',
    b'{"ev":"reply","reply":{"ok":true,"created":[]}}\n',
]


@dataclass
class Footprint:
    """What the parent holds."""

    fds: int
    rss_kib: int
    #: The parts of the RSS: heap and stacks, mapped files, and guest RAM
    #: (shared memory) the pager has touched through its own mapping.
    anon_kib: int
    file_kib: int
    shmem_kib: int
    swap_bytes: int

    def __str__(self) -> str:
        return (
            f"{self.fds} fds, RSS {self.rss_kib / 1024:.1f} MiB (anonymous "
            f"{self.anon_kib / 1024:.1f}, files {self.file_kib / 1024:.1f}, guest RAM "
            f"{self.shmem_kib / 1024:.1f}), swap {self.swap_bytes >> 20} MiB"
        )


def footprint(pid: int, workdir: str) -> Footprint:
    """The parent's descriptors and RSS, and the blocks its swap file holds
    (nameless once open: the file it has open in `workdir`)."""
    swap = 0
    fds = os.listdir(f"/proc/{pid}/fd")
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(workdir + "/"):
                swap = max(swap, os.stat(f"/proc/{pid}/fd/{fd}").st_blocks * 512)
        except OSError:
            continue
    with open(f"/proc/{pid}/status") as status:
        kib = {
            line.split(":")[0]: int(line.split()[1])
            for line in status
            if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:"))
        }
    return Footprint(len(fds), kib["VmRSS"], kib["RssAnon"], kib["RssFile"], kib["RssShmem"], swap)


def vm_ids(pids: list[int]) -> set[int]:
    """The VMs whose vCPU threads run in these processes (named vcpu<id>)."""
    ids: set[int] = set()
    for pid in pids:
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/comm") as f:
                    found = re.fullmatch(r"vcpu(\d+)", f.read().strip())
                if found:
                    ids.add(int(found.group(1)))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return ids


def zipfperf(first: int, count: int, seconds: float) -> subprocess.Popen:
    return subprocess.Popen(
        [
            str(RELEASE / "zipfperf"),
            *("--targets", str(count), "--addr-base", str(ADDR_BASE + first), "--port", "8080"),
            *("--alpha", "1.0", "--concurrency", "32", "--num-calls", "1"),
            *("--duration", str(seconds), "--json", "-"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def finish(load: subprocess.Popen, seconds: float) -> dict:
    """zipfperf's document, once its `seconds` of load are over."""
    out, _ = load.communicate(timeout=seconds + 120)
    return json.loads(out)


def error_kinds(load: dict) -> dict:
    """zipfperf's non-zero error counts by kind."""
    return {k: v for k, v in load.get("error_detail", load["errors"]).items() if v and k != "total"}


def say_hostile_words(cell: int, words: bytes) -> None:
    """Writes `words` on cell `cell`'s link to the parent, as the cell could."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(cell)
    try:
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, 0, 0)
    finally:
        os.close(pidfd)
    if fd < 0:
        return
    with socket.socket(fileno=fd) as link:
        link.settimeout(5)
        with contextlib.suppress(OSError):
            link.sendall(words)


class Chaos:
    """Strikes the cells and holders that hold none of the untouched VMs."""

    def __init__(self, parent: int, untouched: range, seed: int):
        self.parent = parent
        self.untouched = untouched
        self.rng = random.Random(seed)
        self.stopped: list[tuple[float, int]] = []
        self.counts: dict[str, int] = {}

    def targets(self) -> tuple[list[int], list[int]]:
        cells, holders = [], []
        for cell in children(self.parent):
            tree = [cell, *children(cell)]
            if vm_ids(tree) & set(self.untouched):
                continue
            cells.append(cell)
            holders.extend(children(cell))
        return cells, holders

    def strike(self) -> str:
        now = time.monotonic()
        for stopped_at, pid in [s for s in self.stopped if now - s[0] > 10]:
            self.stopped.remove((stopped_at, pid))
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cells, holders = self.targets()
        if not cells:
            return "nothing to strike"
        action = self.rng.choice(
            ["kill-cell", "kill-holder", "stop-cell", "stop-holder", "hostile-words"]
        )
        if action.endswith("holder") and not holders:
            action = action.replace("holder", "cell")
        pid = self.rng.choice(holders if action.endswith("holder") else cells)
        try:
            if action.startswith("kill"):
                os.kill(pid, signal.SIGKILL)
            elif action.startswith("stop"):
                os.kill(pid, signal.SIGSTOP)
                self.stopped.append((now, pid))
            else:
                say_hostile_words(pid, self.rng.choice(HOSTILE_WORDS))
        except ProcessLookupError:
            return f"{action}: {pid} already gone"
        self.counts[action] = self.counts.get(action, 0) + 1
        return f"{action} {pid}"

    def release(self) -> None:
        for _, pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def replace_the_dead(api: Path, replaced: set[int], refused: list[str]) -> int:
    """Destroys (forgets) the VMs that died since the last call and creates as
    many new ones; returns how many. A create the monitor refuses (its cell
    met a holder the chaos had stopped, and killed it at its deadline) is
    noted in `refused`; the VMs it left crashed are replaced by a later call."""
    dead = [
        v["id"]
        for v in control(api, {"cmd": "list"}, timeout_s=CREATE_TIMEOUT_S)["vms"]
        if v["state"] == "crashed" and v["id"] not in replaced
    ]
    for vm in dead:
        control(api, {"cmd": "destroy", "vm": vm})
        replaced.add(vm)
    # A cell's worth at a time: each create boots one new cell, which the
    # parent may take up to its create deadline (60 s) to start.
    for start in range(0, len(dead), BATCH):
        count = min(BATCH, len(dead) - start)
        try:
            control(api, {"cmd": "create", "count": count}, timeout_s=CREATE_TIMEOUT_S)
        except DenseVMError as e:
            refused.append(str(e))
    return len(dead)


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", type=int, default=4000)
    parser.add_argument("--mem", default="1G")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--baseline-minutes", type=float, default=3)
    parser.add_argument("--interval", type=float, default=5)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.vms < 4 or args.minutes <= 0 or args.baseline_minutes <= 0 or args.interval <= 0:
        raise SystemExit("cell_chaos: --vms >= 4 and positive durations, please")
    half = args.vms // 2
    with tempfile.TemporaryDirectory() as tmp:
        api = Path(tmp) / "api.sock"
        proc = subprocess.Popen(
            [
                str(RELEASE / "densevm"),
                *("serve", "--vms", str(args.vms), "--mem", args.mem, "--block", "32k"),
                *("--addr-base", str(ADDR_BASE), "--api", str(api), "--selfcheck"),
            ],
            stdout=subprocess.PIPE,
            cwd=tmp,
        )
        chaos = Chaos(proc.pid, range(half), args.seed)
        loads: list[subprocess.Popen] = []

        def load(first: int, count: int, seconds: float) -> subprocess.Popen:
            loads.append(zipfperf(first, count, seconds))
            return loads[-1]

        try:
            ready = json.loads(proc.stdout.readline() or b"null")
            if not ready:
                raise SystemExit("cell_chaos: densevm did not start")
            print(f"ready: {ready['vms']} VMs in {ready['cells']} cells", flush=True)
            finish(load(0, args.vms, 20), 20)  # warm-up: working sets in, swap written
            start = footprint(proc.pid, tmp)
            print(f"start: {start}", flush=True)

            seconds = args.baseline_minutes * 60
            calm, other = load(0, half, seconds), load(half, args.vms - half, seconds)
            baseline = finish(calm, seconds)
            finish(other, seconds)
            print(
                f"baseline ({args.baseline_minutes:g} min): untouched p99 "
                f"{baseline['latency_ms']['p99']:.2f} ms, errors {baseline['errors']['total']} "
                f"{error_kinds(baseline)}",
                flush=True,
            )

            seconds = args.minutes * 60
            calm, other = load(0, half, seconds), load(half, args.vms - half, seconds)
            deadline = time.monotonic() + seconds
            replaced: set[int] = set()
            refused: list[str] = []
            while time.monotonic() < deadline and proc.poll() is None:
                print(f"  {chaos.strike()}", flush=True)
                time.sleep(args.interval)
                if proc.poll() is None:
                    replace_the_dead(api, replaced, refused)
            chaotic = finish(calm, seconds)
            finish(other, seconds)
            chaos.release()
            alive = proc.poll() is None
            print(
                f"strikes: {chaos.counts}; VMs replaced: {len(replaced)};"
                f" creates refused: {len(refused)} {sorted(set(refused))}",
                flush=True,
            )
            if not alive:
                print("the parent DIED: NOT met")
                return 1
            time.sleep(3)
            replace_the_dead(api, replaced, refused)
            time.sleep(2)
            end = footprint(proc.pid, tmp)
            print(f"end: {end}", flush=True)
            vms = control(api, {"cmd": "stats"})["vms"]
        finally:
            chaos.release()
            for running in loads:
                if running.poll() is None:
                    running.kill()
                    running.wait()
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
        left = list(Path(tmp).glob("densevm-swap-*"))
    untouched = [v for v in vms if v["id"] < half]
    mismatches = sum(v["selfcheck_errors"] for v in untouched)
    not_running = [v["id"] for v in untouched if v["state"] != "running"]
    ratio = chaotic["latency_ms"]["p99"] / max(baseline["latency_ms"]["p99"], 1e-9)

    def within(a: int, b: int) -> bool:
        return abs(b - a) <= 0.05 * max(a, 1)

    checks = [
        ("the parent is alive", True, "alive"),
        (
            "untouched VMs never failed a request",
            chaotic["errors"]["total"] == 0 and not not_running,
            f"{chaotic['errors']['total']} errors {error_kinds(chaotic)}, "
            f"{len(not_running)} not running",
        ),
        ("untouched self-checks: 0 mismatches", mismatches == 0, f"{mismatches} mismatches"),
        (
            "untouched p99 within 2x of the baseline",
            ratio <= 2.0,
            f"{chaotic['latency_ms']['p99']:.2f} vs {baseline['latency_ms']['p99']:.2f} ms "
            f"= {ratio:.2f}x",
        ),
        ("parent fds within 5%", within(start.fds, end.fds), f"{start.fds} -> {end.fds}"),
        (
            "parent RSS within 5%",
            within(start.rss_kib, end.rss_kib),
            f"{start.rss_kib} -> {end.rss_kib} KiB",
        ),
        (
            "swap allocated within 5%",
            within(start.swap_bytes, end.swap_bytes),
            f"{start.swap_bytes >> 20} -> {end.swap_bytes >> 20} MiB",
        ),
        ("no swap file left", not left, f"{len(left)} left"),
    ]
    print(f"\nchaos at {args.vms} VMs, {args.mem}, {args.minutes:g} min, every {args.interval:g} s")
    for name, ok, figure in checks:
        print(f"  {name:<42} {'met' if ok else 'NOT met':<8} {figure}")
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
