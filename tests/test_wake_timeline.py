"""experiments/bench/wake_timeline.py reads a wake's phases from the kernel's trace text. The
trace here is a FAKE, written by hand in tracefs's line format: this tests the reading, not
the kernel."""

from __future__ import annotations

import importlib.util
import sys
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
approx = partial(pytest.approx, abs=1e-6)


def timeline_bench():
    """experiments/bench/wake_timeline.py as a module."""
    path = ROOT / "experiments" / "bench" / "wake_timeline.py"
    spec = importlib.util.spec_from_file_location("wake_timeline", path)
    module = importlib.util.module_from_spec(spec)
    # Its dataclasses look their module up by name.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def connect(ts: float, vm: int) -> str:
    return (
        f"  python3-900 [000] ..s2. {ts:.6f}: inet_sock_set_state: family=AF_INET "
        f"protocol=IPPROTO_TCP sport=0 dport=8080 saddr=127.0.0.1 daddr=127.160.0.{vm} "
        "saddrv6=::1 daddrv6=::1 oldstate=TCP_CLOSE newstate=TCP_SYN_SENT"
    )


def ioctl(ts: float, tid: int, cmd: int) -> str:
    return f"  exe-{tid} [001] ..... {ts:.6f}: sys_ioctl(fd: 6, cmd: {cmd:#x}, arg: 0x7ffd)"


def returned(ts: float, tid: int) -> str:
    return f"  exe-{tid} [001] ..... {ts:.6f}: sys_ioctl -> 0x0"


def spte(ts: float, gfn: int) -> str:
    return (
        f"  vcpu0-77 [000] ...1. {ts:.6f}: kvm_mmu_set_spte: gfn {gfn:x} spte 1d6d0c825 "
        "(rwxu) level 1 at 12f508000"
    )


def walk(ts: float, addr: int, pferr: str = "0 ") -> str:
    return f"  vcpu0-77 [000] ...1. {ts:.6f}: kvm_mmu_pagetable_walk: addr {addr:x} pferr {pferr}"


def requested(ts: float, gfn: int) -> str:
    return (
        f"  vcpu0-77 [000] ...1. {ts:.6f}: kvm_mmu_spte_requested: gfn {gfn:x} pfn 45200e level 1"
    )


def test_the_guests_exits_are_counted_by_why_and_spaced():
    bench = timeline_bench()
    t = 50.0
    lines = [
        connect(t, 1),
        # Its first fetch, on the image's code.
        walk(t + 0.001000, 0x200000, "10 F"),
        requested(t + 0.001001, 0x200),
        spte(t + 0.001002, 0x200),
        # A system page, then an emulated instruction (two walks, nothing mapped).
        walk(t + 0.001030, 0x1000),
        requested(t + 0.001031, 0x1),
        spte(t + 0.001032, 0x1),
        walk(t + 0.001060, 0x200303),
        walk(t + 0.001061, 0x200303, "10 F"),
        # RAM: one exit maps 8 pages, its walk and SPTEs a few µs apart.
        walk(t + 0.001095, 0x488000),
        requested(t + 0.001096, 0x488),
        *(spte(t + 0.001097 + i * 0.000001, 0x488 + i) for i in range(8)),
        connect(t + 0.020, 2),
    ]
    wake, other = bench.phases("\n".join(lines), vms=10, latencies={}).wakes
    counts = (wake.exits, wake.ram_exits, wake.system_exits, wake.code_exits, wake.emulated)
    assert counts == (4, 1, 1, 1, 1)
    assert wake.ram_ptes == 8
    assert wake.exit_gap_us == approx(30.0), "gaps of 30, 30 and 35 us"
    assert (other.exits, other.exit_gap_us) == (0, None)


def test_each_wake_gets_the_events_between_its_connect_and_the_next():
    bench = timeline_bench()
    t = 100.0
    lines = [
        connect(t, 3),
        f"  pager-prefetch-50 [000] ..... {t + 0.0002:.6f}: sys_preadv(fd: 9, vec: 0x1)",
        ioctl(t + 0.0003, 60, bench.KVM_SET_USER_MEMORY_REGION),
        # Another thread's ioctl returns meanwhile: not the memslot's.
        returned(t + 0.00035, 61),
        returned(t + 0.0005, 60),
        ioctl(t + 0.0006, 60, bench.KVM_SET_USER_MEMORY_REGION),
        returned(t + 0.0007, 60),
        ioctl(t + 0.0008, 60, bench.KVM_RUN),
        ioctl(t + 0.0009, 50, bench.UFFDIO_COPY),
        ioctl(t + 0.0012, 50, bench.UFFDIO_COPY),
        spte(t + 0.0010, 0x200),  # the image: not guest RAM
        spte(t + 0.0011, 0x400),
        spte(t + 0.0015, 0x4FF),
        "# a comment line",
        connect(t + 0.020, 4),
        ioctl(t + 0.0203, 60, bench.KVM_RUN),
    ]
    got = bench.phases("\n".join(lines), vms=10, latencies={3: 0.0019})
    assert len(got.wakes) == 2
    first, second = got.wakes
    assert first.swap_read == approx(0.2)
    assert first.memslot_first == approx(0.3)
    assert first.memslot_ms == approx(0.3), "0.2 + 0.1 ms, the other thread's not"
    assert first.kvm_run == approx(0.8)
    assert (first.copy_first, first.copy_last) == (approx(0.9), approx(1.2))
    assert (first.ram_pte_first, first.ram_pte_last) == (approx(1.1), approx(1.5))
    assert first.ram_ptes == 2
    assert first.answered == approx(1.9)
    assert second.kvm_run == approx(0.3), "timed from its own connect"
    assert second.answered is None and second.swap_read is None
    assert got.median("kvm_run") == approx(0.55)


def test_a_connect_to_an_address_past_the_vms_starts_no_wake():
    bench = timeline_bench()
    got = bench.phases("\n".join([connect(1.0, 12), ioctl(1.001, 5, bench.KVM_RUN)]), 10, {})
    assert got.wakes == []
    assert got.median("kvm_run") is None
