#!/usr/bin/env python3
"""Where a wake's time goes (issue 40): the phases of wakes from hibernation, read from the
kernel's trace events, at several VM counts in one run (so a phase that grows with N shows).

For each --vms N, densevm serves N VMs with --idle-after. Every VM is sent one GET, and all
of them hibernate. Then --wakes of them are requested one at a time at --wake-rate, with
tracing on. For each wake, measured from the client's connect (the kernel's TCP_SYN_SENT to
the VM's address):
  - swap read: the prefetch's first preadv of the swap file;
  - memslots: the first KVM_SET_USER_MEMORY_REGION, and the time spent in them (each waits
    for an SRCU grace period);
  - KVM_RUN: the new vCPU's first entry;
  - UFFDIO_COPY: the first and the last (the prefetch installing the working set);
  - guest RAM faults: the first and the last shadow PTE that KVM sets on guest RAM, and how
    many it sets (PVM shadow-pages the guest, and KVM maps up to 8 pages a fault);
  - guest exits: every time the guest left for KVM (a shadow page walk after a quiet spell),
    by why: a fault on RAM, on a system page or on the image's code, or an instruction
    emulated (a walk that maps nothing: the instruction's fetch); and their spacing;
  - answered: the last byte at the client.
The median of each is printed for each N.

The trace uses tracefs events: kvmmmu:kvm_mmu_set_spte, kvm_mmu_pagetable_walk and
kvm_mmu_spte_requested, the ioctl and preadv system calls, and sock:inet_sock_set_state. It
uses the mono clock. What it changes (the events, the clock, the buffer size, the mount if
tracefs was not mounted) is put back on exit.

Usage: experiments/bench/wake_timeline.py [--vms 200,4000] [--wakes 200] [--wake-rate 50]
       [--cell-vms N]
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import itertools
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "controller"))
from scalebench.procs import install_signal_handlers  # noqa: E402
from scalebench.scaling import Build, Session, paced_gets, wait_until_hibernated  # noqa: E402
from scalebench.touch import touch_all  # noqa: E402

ADDR_BASE = "127.160.0.0"
TRACEFS = Path("/sys/kernel/tracing")
# ioctl numbers (linux/kvm.h, linux/userfaultfd.h).
KVM_RUN = 0xAE80
KVM_SET_USER_MEMORY_REGION = 0x4020AE46
UFFDIO_COPY = 0xC028AA03
# First guest frames of a VM's RAM and of the shared image (RAM_GPA, IMAGE_GPA in
# hypervisor/src/guest/abi.rs); below the image, its system pages.
RAM_FIRST_GFN = 0x400
IMAGE_FIRST_GFN = 0x200
# Shadow-MMU events this close after another belong to the same exit (one exit's walks and
# SPTEs take a few µs; exits come ~25 µs or more apart under PVM).
SAME_EXIT_MS = 0.008
# The events and their filters; sys_exit_ioctl has no cmd field and is matched to its enter.
EVENTS = {
    "kvmmmu/kvm_mmu_set_spte": "",
    "kvmmmu/kvm_mmu_pagetable_walk": "",
    "kvmmmu/kvm_mmu_spte_requested": "",
    "syscalls/sys_enter_ioctl": f"cmd == {KVM_RUN} || cmd == {KVM_SET_USER_MEMORY_REGION}"
    f" || cmd == {UFFDIO_COPY}",
    "syscalls/sys_exit_ioctl": "",
    "syscalls/sys_enter_preadv": "",
    # TCP_SYN_SENT: a connect.
    "sock/inet_sock_set_state": "newstate == 2",
}
BUFFER_KB_PER_CPU = 32768
# A trace line: "comm-tid [cpu] flags seconds: event: fields" ("event(args)" for a syscall).
LINE = re.compile(
    r"\s*(?P<comm>.+?)-(?P<tid>\d+)\s+\[\d+\]\s+\S+\s+(?P<ts>\d+\.\d+): "
    r"(?P<event>\w+)[:( ]\s*(?P<rest>.*)"
)


def exit_kind(gfn: int | None) -> str:
    """Why the guest left, from the first frame the exit mapped (None: it mapped none)."""
    if gfn is None:
        return "emulated"
    return "ram" if gfn >= RAM_FIRST_GFN else "code" if gfn >= IMAGE_FIRST_GFN else "system"


@dataclass
class Wake:
    """One wake's phases, in milliseconds from the client's connect."""

    swap_read: float | None = None
    memslot_first: float | None = None
    memslot_ms: float = 0.0
    kvm_run: float | None = None
    copy_first: float | None = None
    copy_last: float | None = None
    ram_pte_first: float | None = None
    ram_pte_last: float | None = None
    ram_ptes: int = 0
    exits: int = 0
    ram_exits: int = 0
    system_exits: int = 0
    code_exits: int = 0
    emulated: int = 0
    exit_gap_us: float | None = None
    answered: float | None = None

    def count_exits(self, starts: list[float], gfns: list[int | None]) -> None:
        """The guest's exits, each from its start (ms) and the first frame it mapped."""
        kinds = Counter(map(exit_kind, gfns))
        self.exits = len(starts)
        self.ram_exits, self.system_exits = kinds["ram"], kinds["system"]
        self.code_exits, self.emulated = kinds["code"], kinds["emulated"]
        gaps = [1000 * (b - a) for a, b in itertools.pairwise(starts)]
        self.exit_gap_us = statistics.median(gaps) if gaps else None


@dataclass
class Phases:
    """The wakes of one VM count."""

    vms: int
    wakes: list[Wake] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        values = [getattr(w, name) for w in self.wakes if getattr(w, name) is not None]
        return statistics.median(values) if values else None


@contextlib.contextmanager
def tracing() -> Iterator[Path]:
    """Tracefs with EVENTS on, the mono clock and a large buffer; all put back on exit."""
    mounted = (TRACEFS / "trace").exists()
    if not mounted:
        subprocess.run(["mount", "-t", "tracefs", "nodev", str(TRACEFS)], check=True)
    clock = re.search(r"\[(\w+)\]", (TRACEFS / "trace_clock").read_text())
    # "7 (expanded: 1408)" until the buffer is first used: the size it then has.
    size = re.findall(r"\d+", (TRACEFS / "buffer_size_kb").read_text())
    saved = {
        "trace_clock": clock.group(1) if clock else "local",
        "buffer_size_kb": size[-1],
    }
    for event in EVENTS:
        saved[f"events/{event}/filter"] = "0"
        enable = TRACEFS / "events" / event / "enable"
        saved[f"events/{event}/enable"] = enable.read_text().strip()
    try:
        (TRACEFS / "trace_clock").write_text("mono")
        (TRACEFS / "buffer_size_kb").write_text(str(BUFFER_KB_PER_CPU))
        for event, condition in EVENTS.items():
            if condition:
                (TRACEFS / "events" / event / "filter").write_text(condition)
        yield TRACEFS
    finally:
        for event in EVENTS:
            (TRACEFS / "events" / event / "enable").write_text("0")
        (TRACEFS / "trace").write_text("")
        for name, value in saved.items():
            (TRACEFS / name).write_text(value)
        if not mounted:
            subprocess.run(["umount", str(TRACEFS)], check=False)


def set_events(tracefs: Path, on: bool) -> None:
    for event in EVENTS:
        (tracefs / "events" / event / "enable").write_text("1" if on else "0")


def earliest(seen: float | None, ms: float) -> float:
    """The first time of an event: `seen` if it came already, else `ms`."""
    return ms if seen is None else seen


def phases(trace: str, vms: int, latencies: dict[int, float]) -> Phases:
    """Each wake's phases from the trace's text: the events between one connect to a VM's
    address and the next (the wakes are paced, one at a time)."""
    base = ipaddress.IPv4Address(ADDR_BASE)
    events = [m.groupdict() for m in map(LINE.match, trace.splitlines()) if m]
    connects = []
    for i, e in enumerate(events):
        addr = re.search(r"daddr=([\d.]+) ", e["rest"])
        if e["event"] == "inet_sock_set_state" and addr:
            vm = int(ipaddress.IPv4Address(addr.group(1))) - int(base)
            if 0 <= vm < vms:
                connects.append((i, vm))
    result = Phases(vms)
    # Each wake's events end where the next wake's connect begins.
    bounds = [i for i, _ in connects] + [len(events)]
    for (start, vm), end in zip(connects, bounds[1:], strict=True):
        t0 = float(events[start]["ts"])
        wake = Wake(answered=1000 * latencies[vm] if vm in latencies else None)
        in_memslot: dict[str, float] = {}
        # Each exit's start and the first frame it mapped (None: it mapped none).
        exit_starts: list[float] = []
        exit_gfns: list[int | None] = []
        last_mmu = -1.0
        for e in events[start + 1 : end]:
            ms = (float(e["ts"]) - t0) * 1000
            rest = e["rest"]
            if e["event"].startswith("kvm_mmu_"):
                if e["event"] == "kvm_mmu_pagetable_walk" and ms - last_mmu > SAME_EXIT_MS:
                    exit_starts.append(ms)
                    exit_gfns.append(None)
                elif e["event"] == "kvm_mmu_spte_requested" and exit_gfns[-1:] == [None]:
                    exit_gfns[-1] = int(rest.split()[1], 16)
                last_mmu = ms
            if e["event"] == "kvm_mmu_set_spte":
                if int(rest.split()[1], 16) >= RAM_FIRST_GFN:
                    wake.ram_pte_first = earliest(wake.ram_pte_first, ms)
                    wake.ram_pte_last, wake.ram_ptes = ms, wake.ram_ptes + 1
            elif e["event"] == "sys_preadv" and wake.swap_read is None:
                wake.swap_read = ms
            elif e["event"] == "sys_ioctl" and rest.startswith("->"):
                if e["tid"] in in_memslot:
                    wake.memslot_ms += ms - in_memslot.pop(e["tid"])
            elif e["event"] == "sys_ioctl":
                cmd = int(re.search(r"cmd: (0x[0-9a-f]+)", rest).group(1), 16)
                if cmd == KVM_SET_USER_MEMORY_REGION:
                    wake.memslot_first = earliest(wake.memslot_first, ms)
                    in_memslot[e["tid"]] = ms
                elif cmd == KVM_RUN and wake.kvm_run is None:
                    wake.kvm_run = ms
                elif cmd == UFFDIO_COPY:
                    wake.copy_first = earliest(wake.copy_first, ms)
                    wake.copy_last = ms
        wake.count_exits(exit_starts, exit_gfns)
        result.wakes.append(wake)
    return result


def measure(n: int, args: argparse.Namespace, workdir: Path) -> Phases:
    build = Build.in_dir(ROOT / "target" / "release")
    vms = list(range(n))
    flags = ("--mem", args.mem, "--idle-after", str(args.idle_after))
    if args.cell_vms:
        flags += ("--cell-vms", str(args.cell_vms))
    with Session(build, workdir, n, ADDR_BASE, *flags) as session, tracing() as tracefs:
        failed = touch_all(ADDR_BASE, session.port, vms, 64, 30.0)
        wait_until_hibernated(session, n, timeout_s=120 + n / 20)
        (tracefs / "trace").write_text("")
        set_events(tracefs, True)
        woken = paced_gets(ADDR_BASE, session.port, vms[: min(args.wakes, n)], args.wake_rate)
        set_events(tracefs, False)
        trace = (tracefs / "trace").read_text()
    latencies = {vm: times[0] for vm, times in woken.items() if times[0] is not None}
    failed += [vm for vm, times in woken.items() if times[0] is None]
    if failed:
        raise RuntimeError(f"--vms {n}: {len(failed)} GETs failed (VMs {failed[:5]})")
    return phases(trace, n, latencies)


ROWS = (
    ("swap read", "swap_read"),
    ("first memslot set", "memslot_first"),
    ("  in memslot sets", "memslot_ms"),
    ("KVM_RUN", "kvm_run"),
    ("first UFFDIO_COPY", "copy_first"),
    ("last UFFDIO_COPY", "copy_last"),
    ("first guest RAM PTE", "ram_pte_first"),
    ("last guest RAM PTE", "ram_pte_last"),
    ("  guest RAM PTEs set", "ram_ptes"),
    ("guest exits", "exits"),
    ("  faults on RAM", "ram_exits"),
    ("  faults on system pages", "system_exits"),
    ("  faults on code", "code_exits"),
    ("  instructions emulated", "emulated"),
    ("  us between exits", "exit_gap_us"),
    ("answered", "answered"),
)


def report(rows: list[Phases]) -> None:
    print("median per wake, ms from connect" + "".join(f"  {r.vms:>8} VMs" for r in rows))
    for label, name in ROWS:
        cells = []
        for r in rows:
            value = r.median(name)
            cells.append("       -" if value is None else f"{value:8.2f}")
        print(f"{label:32s}" + "".join(f"  {c:>12}" for c in cells))
    print("wakes traced" + " " * 20 + "".join(f"  {len(r.wakes):>12}" for r in rows))


def main() -> int:
    install_signal_handlers()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vms", default="200,4000", help="VM counts, comma-separated")
    parser.add_argument("--mem", default="1G")
    parser.add_argument("--idle-after", type=float, default=1.0)
    parser.add_argument("--wakes", type=int, default=200)
    parser.add_argument("--wake-rate", type=float, default=50.0)
    parser.add_argument("--cell-vms", type=int, help="VMs a cell (default: densevm's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wake-timeline-") as tmp:
        rows = []
        for n in args.vms.split(","):
            rows.append(measure(int(n), args, Path(tmp)))
            print(f"--vms {n}: {len(rows[-1].wakes)} wakes traced", flush=True)
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
