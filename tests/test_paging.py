"""The pager under real KVM guests: guest memory survives eviction intact, the
budget holds, and bad paging configuration fails before any VM boots."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from conftest import release_binary
from scalebench.webobject import SMALL
from support.densevm import get, kvm_available, start

pytestmark = pytest.mark.skipif(
    not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
)

VMS = 6
GUEST_MEM = 4 << 20


def footprint_per_vm(stats: dict) -> int:
    """RAM one VM keeps resident when nothing is evicted, from a roomy run."""
    return stats["totals"]["resident_bytes"] // stats["totals"]["vms"]


def drive(m, rounds: int) -> None:
    for r in range(rounds):
        for vm in range(VMS):
            body = get(m.addr(vm)).body
            assert body == SMALL, f"round {r} VM {vm}: wrong bytes"


@pytest.mark.parametrize("policy", ["demand", "wsswap"])
@pytest.mark.parametrize("block", ["4k", "32k", "256k"])
def test_guest_memory_survives_eviction(tmp_path, policy, block):
    # A quarter of what the VMs touch: every request evicts someone.
    budget = VMS * (1 << 20) // 4
    # Three cells share the pager's budget.
    m = start(
        tmp_path,
        VMS,
        "127.211.0.0",
        "--selfcheck",
        "--policy",
        policy,
        "--block",
        block,
        "--mem",
        str(budget),
        "--guest-mem",
        str(GUEST_MEM),
        "--cell-vms",
        "2",
    )
    try:
        drive(m, 6)
        totals = m.control({"cmd": "stats"})["totals"]
    finally:
        assert m.stop() == 0
    assert totals["selfcheck_pages"] >= VMS * 6 * 200, totals
    assert totals["selfcheck_errors"] == 0, totals
    assert totals["faults"] > VMS * 5, totals
    assert totals["swap_write_bytes"] > 0 and totals["swap_read_bytes"] > 0, totals
    assert totals["resident_bytes"] <= totals["budget_bytes"] + 8 * totals["block_bytes"]


def test_resident_memory_stays_within_budget_during_the_run(tmp_path):
    budget = VMS * (1 << 20) // 4
    m = start(
        tmp_path, VMS, "127.212.0.0", "--mem", str(budget), "--block", "32k", "--cell-vms", "2"
    )
    samples: list[tuple[int, int]] = []
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            t = m.control({"cmd": "stats"})["totals"]
            samples.append((t["resident_bytes"], t["memfd_resident_bytes"]))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        drive(m, 5)
    finally:
        stop.set()
        sampler.join()
        totals = m.control({"cmd": "stats"})["totals"]
        assert m.stop() == 0
    slack = 8 * 32 * 1024  # faults in flight (one per service thread) x block
    assert len(samples) > 5
    assert max(r for r, _ in samples) <= budget + slack
    # What the kernel says is resident, counted under the pager's lock (a sum of each cell's
    # mincore is not one instant: blocks move between cells while they are asked), stays within
    # the budget too.
    assert max(k for _, k in samples) <= budget + slack
    # At rest the cells' mincore over their mappings agrees with the pager's count.
    assert abs(totals["ram_resident_bytes"] - totals["memfd_resident_bytes"]) <= slack, totals
    assert totals["faults"] > 0


def test_clean_blocks_are_not_written_twice(tmp_path):
    """With a working set that is only read (write stride larger than it),
    a block goes to swap once; later evictions of it cost no writes."""
    budget = VMS * (1 << 20) // 4
    m = start(tmp_path, VMS, "127.213.0.0", "--mem", str(budget), "--ws-write-stride", "100000")
    try:
        drive(m, 2)
        first = m.control({"cmd": "stats"})["totals"]
        drive(m, 4)
        later = m.control({"cmd": "stats"})["totals"]
    finally:
        assert m.stop() == 0
    assert later["faults"] > first["faults"] + VMS * 2
    faults = later["faults"] - first["faults"]
    written_per_fault_after = (later["swap_write_bytes"] - first["swap_write_bytes"]) / faults
    assert written_per_fault_after < 0.25 * 32 * 1024, (first, later)
    # The read-only pages hold content (the guest's first request loads them), so
    # faulting them back reads swap: they are not zero pages the pager fills for free.
    read_per_fault_after = (later["swap_read_bytes"] - first["swap_read_bytes"]) / faults
    assert read_per_fault_after > 0.75 * 32 * 1024, (first, later)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--block", "3k"], "block"),
        (["--block", "512k"], "block"),
        (["--mem", "64k"], "budget"),
        (["--swap", "/nonexistent-dir/swap.img"], "swap"),
        (["--policy", "nosuch"], "policy"),
        (["--policy", "/tmp/no-such-plugin.so"], "no-such-plugin.so"),
        (["--disk", "floppy"], "floppy"),
    ],
)
def test_bad_paging_configuration_fails_before_boot(tmp_path, args, fragment):
    proc = subprocess.run(
        [
            str(release_binary("densevm")),
            "serve",
            "--vms",
            "2",
            "--addr-base",
            "127.214.0.0",
            "--api",
            str(tmp_path / "s.sock"),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("densevm: error:"), proc.stderr
    assert fragment in lines[0].lower() or fragment in lines[0]
    assert proc.stdout == ""
    assert not list(tmp_path.glob("densevm-swap-*"))


def test_swap_file_is_removed_unless_kept(tmp_path):
    swap = tmp_path / "swap.img"
    m = start(tmp_path, 2, "127.215.0.0", "--swap", str(swap))
    assert not swap.exists(), "nameless from the moment it is open"
    assert m.stop() == 0
    assert not swap.exists()
    m = start(tmp_path, 2, "127.215.0.0", "--swap", str(swap), "--keep-swap")
    assert m.stop() == 0
    assert swap.exists()


def test_disk_model_can_be_suspended_and_charged_again(tmp_path):
    m = start(tmp_path, 2, "127.216.0.0", "--mem", "8M", "--disk", "hdd")
    try:
        assert m.control({"cmd": "stats"})["totals"]["disk_modeled"] is True
        assert m.control({"cmd": "disk", "modeled": False}) == {"ok": True, "modeled": False}
        assert m.control({"cmd": "stats"})["totals"]["disk_modeled"] is False
        assert get(m.addr(0)).body == SMALL
        assert m.control({"cmd": "disk", "modeled": True}) == {"ok": True, "modeled": True}
        assert m.control({"cmd": "stats"})["totals"]["disk_modeled"] is True
        # A malformed request gets an error reply and changes nothing.
        assert "modeled" in m.raw_control(b'{"cmd":"disk"}\n')["error"]
        assert "error" in m.raw_control(b'{"cmd":"disk","modeled":"off"}\n')
        assert m.control({"cmd": "stats"})["totals"]["disk_modeled"] is True
        assert get(m.addr(1)).body == SMALL
    finally:
        assert m.stop() == 0
