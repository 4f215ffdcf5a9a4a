"""Scale to zero: an idle VM is hibernated (its vCPU, thread and KVM VM released, its
memory moved to swap) and its next connection wakes it on a new vCPU, with its memory
intact. Real densevm, real KVM guests, real TCP."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
from conftest import release_binary
from scalebench.densevm import wake_quantile_us
from scalebench.scaling import children, swap_file_bytes
from scalebench.webobject import SMALL
from support.densevm import fd_targets, get, kvm_available, start, wait_for

pytestmark = pytest.mark.skipif(
    not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
)


def totals(m) -> dict:
    return m.control({"cmd": "stats"})["totals"]


def states(m) -> dict[int, str]:
    return {vm["id"]: vm["state"] for vm in m.control({"cmd": "list"})["vms"]}


def threads_each(pid: int) -> dict[int, int]:
    """The threads of each process below densevm's parent `pid`; one that exits while they
    are read (a holder leaving as its last VM falls asleep) is left out."""
    counts = {}
    for p in descendants(pid):
        with contextlib.suppress(FileNotFoundError):
            counts[p] = len(os.listdir(f"/proc/{p}/task"))
    return counts


def task_names(pids: list[int]) -> dict[int, list[str]]:
    """Each process's threads, by name."""
    return {
        pid: sorted(
            Path(f"/proc/{pid}/task/{task}/comm").read_text().strip()
            for task in os.listdir(f"/proc/{pid}/task")
        )
        for pid in pids
    }


def kvm_objects(pids: list[int]) -> dict[str, int]:
    """The KVM VMs and vCPUs the processes hold descriptors of."""
    counts = {"kvm-vm": 0, "kvm-vcpu": 0}
    for target in fd_targets(pids):
        for kind in counts:
            counts[kind] += target.startswith(f"anon_inode:{kind}")
    return counts


def uffds(pids: list[int]) -> int:
    return sum(t == "anon_inode:[userfaultfd]" for t in fd_targets(pids))


def memfds(pids: list[int]) -> int:
    return sum("memfd:densevm-guest-ram" in t for t in fd_targets(pids))


def kinds(targets: Counter) -> Counter:
    """Descriptors by kind (`socket`, `anon_inode:[eventfd]`, a path), without the
    inode numbers that tell two sockets apart."""
    out: Counter = Counter()
    for target, n in targets.items():
        out[target.split(":[")[0] if target.startswith(("socket:", "pipe:")) else target] += n
    return out


def descendants(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def shmem_kib(pid: int) -> int:
    """Shared memory resident in the processes below densevm's parent `pid`."""
    total = 0
    for p in descendants(pid):
        with contextlib.suppress(FileNotFoundError):
            status = Path(f"/proc/{p}/status").read_text()
            total += int(status.split("RssShmem:")[1].split()[0])
    return total


def settled_swap_used(m) -> int:
    """swap_used_bytes once the pager has written what the VMs' hibernations queued (the
    monitor counts a VM hibernated when it asks the pager, which writes in the background):
    the figure no longer moving for half a second."""
    last = totals(m)["swap_used_bytes"]
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = totals(m)["swap_used_bytes"]
        if now == last:
            return now
        last = now
    raise AssertionError(f"swap use still moving after 20 s: {last}")


def settled_fd_targets(pids: list[int]) -> Counter:
    """The descriptors of `pids` once two readings 0.1 s apart agree: the parent closes its
    end of a control connection the test has just closed a moment later."""
    last = Counter(fd_targets(pids))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = Counter(fd_targets(pids))
        if now == last:
            return now
        last = now
    raise AssertionError(f"descriptors still changing after 10 s: {last}")


def serve_every_vm(m, vms: range) -> None:
    for vm in vms:
        r = get(m.addr(vm))
        assert (r.status, r.body) == (200, SMALL), vm


def test_idle_vms_hibernate_release_their_threads_and_wake_intact(tmp_path):
    m = start(tmp_path, 12, "127.150.0.0", "--mem", "64M", "--idle-after", "0.3", "--selfcheck")
    try:
        serve_every_vm(m, range(12))
        assert wait_for(lambda: totals(m)["hibernated"] == 12, timeout=20), totals(m)
        assert set(states(m).values()) == {"hibernated"}
        assert totals(m)["running"] == 0
        # The pager moves a hibernated VM's memory out: nothing of theirs stays resident.
        assert wait_for(lambda: totals(m)["resident_bytes"] == 0, timeout=20), totals(m)
        # No VM holds a thread or a KVM object: the cell and its holders are one thread each
        # (a holder whose VMs all sleep leaves, maybe only now), and none keeps an empty KVM
        # VM for the next wake either.
        one_each = wait_for(lambda: set(threads_each(m.proc.pid).values()) == {1}, timeout=10)
        assert one_each, task_names(list(threads_each(m.proc.pid)))
        assert kvm_objects(descendants(m.proc.pid)) == {"kvm-vm": 0, "kvm-vcpu": 0}
        # Nor a page of shared memory: the RAM went to swap, and what the system pages held
        # of its rings and counters waits in a pack on the cell's heap.
        assert wait_for(lambda: shmem_kib(m.proc.pid) == 0, timeout=10), shmem_kib(m.proc.pid)
        # Every VM wakes on its next request, its working set read back from swap intact.
        for _ in range(3):
            serve_every_vm(m, range(12))
            assert wait_for(lambda: totals(m)["hibernated"] == 12, timeout=20), totals(m)
        assert wait_for(lambda: totals(m)["hibernations"] == 48, timeout=10), totals(m)
        t = totals(m)
        # Twelve first boots (VMs are created asleep) and 36 wakes.
        assert t["wakes"] == 48 and t["wake_failures"] == 0, t
        assert t["selfcheck_errors"] == 0 and t["selfcheck_pages"] > 0, t
        assert t["wake_us_p50"] is not None and t["wake_us_p99"] >= t["wake_us_p50"], t
        # Every wake in the histogram, and the controller reads it as densevm does.
        assert sum(count for _, count in t["wake_us"]) == 48, t["wake_us"]
        assert wake_quantile_us(t["wake_us"], 0.5) == t["wake_us_p50"], t
        assert wake_quantile_us(t["wake_us"], 0.99) == t["wake_us_p99"], t
        assert t["swap_write_bytes"] > 0 and t["swap_read_bytes"] > 0, t
    finally:
        assert m.stop() == 0, m.stderr()


def test_vms_hibernate_and_wake_under_load_without_a_lost_request(tmp_path):
    vms = 40
    m = start(tmp_path, vms, "127.151.0.0", "--mem", "16M", "--idle-after", "0.1", "--selfcheck")
    failures: list[str] = []
    served = [0]

    def client(seed: int) -> None:
        rng = random.Random(seed)
        end = time.monotonic() + 6
        while time.monotonic() < end:
            vm = rng.randrange(vms)
            try:
                r = get(m.addr(vm))
            except OSError as e:
                failures.append(f"VM {vm}: {e}")
                continue
            if (r.status, r.body) != (200, SMALL):
                failures.append(f"VM {vm}: {r.status}")
            served[0] += 1
            time.sleep(rng.random() * 0.05)

    try:
        clients = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for c in clients:
            c.start()
        for c in clients:
            c.join()
        t = totals(m)
        assert failures == [], failures[:5]
        assert served[0] > 200 and t["wakes"] > 50, (served, t)
        assert t["selfcheck_errors"] == 0 and t["wake_failures"] == 0, t
        assert t["crashed"] == 0, states(m)
    finally:
        assert m.stop() == 0, m.stderr()


def test_max_live_caps_the_vms_awake(tmp_path):
    # One cell: the cap is its own, and the least recently used VMs sleep first.
    flags = ("--idle-after", "600", "--max-live", "3", "--cell-placement", "floating")
    m = start(tmp_path, 10, "127.152.0.0", *flags)
    try:
        serve_every_vm(m, range(10))
        assert wait_for(lambda: totals(m)["running"] == 3, timeout=10), totals(m)
        s = states(m)
        assert [vm for vm in range(10) if s[vm] == "running"] == [7, 8, 9], s
        serve_every_vm(m, range(10))
        assert totals(m)["wake_failures"] == 0
    finally:
        assert m.stop() == 0, m.stderr()


def test_max_live_keeps_the_hosts_most_recently_used_whichever_cell_holds_them(tmp_path):
    # Two cells of 5 VMs, at most 4 awake: an even split would keep 2 a cell. Cell 1's VMs
    # are used first, then cell 0's, so the host's 4 most recently used are all cell 0's;
    # each cell keeps a quarter of its share (1) whatever the others report, so cell 1
    # keeps its last one and cell 0 its 3 most recent.
    m = start(tmp_path, 10, "127.155.0.0", "--idle-after", "600", "--max-live", "4")
    try:
        assert m.ready["cells"] == 2, m.ready
        time.sleep(2)  # the cells' first reports and the parent's first cut
        serve_every_vm(m, range(5, 10))
        serve_every_vm(m, range(5))
        assert wait_for(lambda: totals(m)["running"] == 4, timeout=10), totals(m)
        s = states(m)
        assert [vm for vm in range(10) if s[vm] == "running"] == [2, 3, 4, 9], s
    finally:
        assert m.stop() == 0, m.stderr()


def test_holders_leave_when_their_vms_all_sleep_and_come_back_for_a_wake(tmp_path):
    m = start(tmp_path, 24, "127.209.0.0", "--idle-after", "0.3", "--selfcheck", "--mem", "16M")
    try:
        serve_every_vm(m, range(24))
        assert wait_for(lambda: totals(m)["hibernated"] == 24, timeout=20)
        cells = children(m.proc.pid)
        # Sleeping VMs keep no process: each cell is its front alone.
        assert wait_for(lambda: all(children(c) == [] for c in cells), timeout=10)
        # Nor a descriptor of their holders': the pager (in the parent) drops a departed
        # holder's userfaultfd, and the front its link.
        monitor = [m.proc.pid, *cells]
        assert wait_for(lambda: uffds(monitor) == 0, timeout=10), fd_targets(monitor)
        away = settled_fd_targets(monitor)
        # One guest-RAM memfd a cell, in the parent's pager; each front maps it and its
        # system pages' memfd once, however many holders the cell has.
        assert memfds(monitor) == memfds([m.proc.pid]) == len(cells), fd_targets(monitor)
        for cell in cells:
            maps = Path(f"/proc/{cell}/maps").read_text().count("densevm-guest-ram")
            assert maps == 2, (cell, maps)
        # A wake starts the VM's holder again, and the VM answers from its memory intact.
        for round in range(3):
            vm = 5 + round
            assert get(m.addr(vm)).body == SMALL
            assert sum(len(children(c)) for c in cells) == 1
            assert uffds(monitor) == 1
            assert wait_for(lambda: all(children(c) == [] for c in cells), timeout=10)
            assert wait_for(lambda: uffds(monitor) == 0, timeout=10), fd_targets(monitor)
        assert kinds(settled_fd_targets(monitor)) == kinds(away)
        # Every holder comes back for its VMs, several at once.
        serve_every_vm(m, range(24))
        t = totals(m)
        assert t["selfcheck_errors"] == 0 and t["wake_failures"] == 0, t
        assert t["selfcheck_pages"] > 0
    finally:
        assert m.stop() == 0, m.stderr()


def test_a_vm_costs_swap_only_once_it_has_run_and_then_only_its_difference(tmp_path):
    # Booted each (without --clone-boot), 40 VMs created asleep hold no swap. The first to
    # sleep is the compact store's template: its blocks are stored whole (compressed) until
    # it sleeps again. From then on every VM that has run stores only how its blocks differ
    # from the template's: a sector or so a block.
    m = start(tmp_path, 40, "127.206.0.0", "--idle-after", "0.3")
    try:
        capacity = totals(m)["swap_capacity_bytes"]
        assert totals(m)["swap_used_bytes"] == 0
        assert swap_file_bytes(m.proc.pid, capacity) == 0
        serve_every_vm(m, [3])
        assert wait_for(lambda: totals(m)["hibernated"] == 40, timeout=20)
        whole = settled_swap_used(m)
        compact = totals(m)["compact_swap"]
        assert swap_file_bytes(m.proc.pid, capacity) >= whole
        # The working set is honest content: LZ4 alone shrinks it 2-3x, not to nothing.
        assert 2.0 <= compact["template_lz4_ratio"] <= 3.0, compact
        assert whole >= 256 << 10, compact
        serve_every_vm(m, [3, 5])
        assert wait_for(lambda: totals(m)["hibernated"] == 40, timeout=20)
        two = settled_swap_used(m)
        assert 0 < two <= 2 * (64 << 10), (two, totals(m)["compact_swap"])
        serve_every_vm(m, range(40))
        assert wait_for(lambda: totals(m)["hibernated"] == 40, timeout=20)
        used = settled_swap_used(m)
        assert 38 * two // 4 <= used <= 40 * (64 << 10), (used, totals(m)["compact_swap"])
        # Each wakes from its records and serves again.
        serve_every_vm(m, range(40))
    finally:
        assert m.stop() == 0, m.stderr()


def test_vms_start_as_clones_of_the_template_and_store_only_their_difference(tmp_path):
    # Clone boot: VM 0 boots as the image's template at the start and sleeps at once; its
    # memory, saved whole, is what every other VM starts from at its first connection (no
    # boot), and what each then stores is its difference from it.
    m = start(tmp_path, 40, "127.207.0.0", "--idle-after", "0.3", "--clone-boot")
    try:
        t = totals(m)
        assert t["clone_template"] == "ready" and t["clones_started"] == 0, t
        assert t["hibernations"] == 1 and t["wakes"] == 1, t
        template = settled_swap_used(m)
        assert template >= 256 << 10, totals(m)["compact_swap"]
        serve_every_vm(m, range(1, 40))
        assert wait_for(lambda: totals(m)["hibernated"] == 40, timeout=20)
        clones = settled_swap_used(m) - template
        assert 0 < clones <= 39 * (64 << 10), (clones, totals(m)["compact_swap"])
        t = totals(m)
        assert t["clones_started"] == 39 and t["wake_failures"] == 0, t
        serve_every_vm(m, range(40))
        assert totals(m)["clones_started"] == 39
    finally:
        assert m.stop() == 0, m.stderr()


def test_a_clone_starts_with_exactly_the_templates_memory(tmp_path):
    # Self-checking guests: the template stamps its working set at its boot; each clone
    # verifies, at its first start, that its memory holds the template's stamps (memory of
    # zeros counts every page as a mismatch), then stamps its own; every request checks them.
    m = start(
        tmp_path,
        20,
        "127.205.0.0",
        "--idle-after",
        "0.3",
        "--clone-boot",
        "--selfcheck",
        "--mem",
        "16M",
    )
    try:
        pages = totals(m)["selfcheck_pages"]
        assert pages > 0, totals(m)
        serve_every_vm(m, range(1, 20))
        t = totals(m)
        assert t["clones_started"] == 19 and t["selfcheck_errors"] == 0, t
        assert t["selfcheck_pages"] == pages * (1 + 19 + 19), t
        for _ in range(2):
            assert wait_for(lambda: totals(m)["hibernated"] == 20, timeout=20)
            serve_every_vm(m, range(20))
        t = totals(m)
        assert t["selfcheck_errors"] == 0 and t["wake_failures"] == 0, t
    finally:
        assert m.stop() == 0, m.stderr()


def test_without_clone_boot_no_vm_is_a_clone(tmp_path):
    m = start(tmp_path, 6, "127.208.0.0", "--idle-after", "0.3", "--selfcheck")
    try:
        serve_every_vm(m, range(6))
        t = totals(m)
        assert t["clone_template"] == "off" and t["clones_started"] == 0, t
        assert t["wakes"] == 6 and t["selfcheck_errors"] == 0, t
    finally:
        assert m.stop() == 0, m.stderr()


def test_a_wake_that_fails_is_a_clear_error_and_the_others_serve_on(tmp_path):
    # Swap for two VMs' regions: the third VM to run cannot have its own.
    m = start(tmp_path, 4, "127.219.0.0", "--idle-after", "0.3", "--swap-size", "8M")
    try:
        serve_every_vm(m, [0, 1])
        r = get(m.addr(2))
        assert (r.status, r.body) == (503, b"VM is not running\n")
        vm = next(v for v in m.control({"cmd": "list"})["vms"] if v["id"] == 2)
        assert vm["state"] == "crashed" and "no swap for its memory" in vm["reason"], vm
        assert "\n" not in vm["reason"]
        for _ in range(3):
            serve_every_vm(m, [0, 1])
            assert wait_for(lambda: totals(m)["hibernated"] == 3, timeout=20)
        t = totals(m)
        assert t["crashed"] == 1 and t["fatal_error"] is None, t
    finally:
        assert m.stop() == 0, m.stderr()


def test_a_vm_destroyed_while_asleep_is_gone_and_its_neighbours_wake(tmp_path):
    m = start(tmp_path, 6, "127.153.0.0", "--idle-after", "0.3")
    try:
        serve_every_vm(m, range(6))
        assert wait_for(lambda: totals(m)["hibernated"] == 6, timeout=20)
        assert m.control({"cmd": "destroy", "vm": 2}) == {"ok": True, "vm": 2}
        assert wait_for(lambda: states(m)[2] == "stopped", timeout=10), states(m)
        with pytest.raises(OSError):
            get(m.addr(2))
        serve_every_vm(m, [0, 1, 3, 4, 5])
        assert totals(m)["vms"] == 6 and totals(m)["stopped"] == 1
    finally:
        assert m.stop() == 0, m.stderr()


def test_a_cell_killed_while_its_vms_sleep_takes_only_them(tmp_path):
    m = start(tmp_path, 8, "127.154.0.0", "--cell-vms", "4", "--idle-after", "0.3", "--selfcheck")
    try:
        serve_every_vm(m, range(8))
        assert wait_for(lambda: totals(m)["hibernated"] == 8, timeout=20)
        victim = children(m.proc.pid)[0]  # VMs 0-3
        os.kill(victim, signal.SIGKILL)
        assert wait_for(lambda: totals(m)["crashed"] == 4, timeout=20), totals(m)
        s = states(m)
        assert [s[vm] for vm in range(4)] == ["crashed"] * 4, s
        serve_every_vm(m, range(4, 8))
        t = totals(m)
        assert t["selfcheck_errors"] == 0 and t["wakes"] >= 4, t
    finally:
        assert m.stop() == 0, m.stderr()


def test_the_tasks_densevm_takes_are_within_what_its_vm_limit_counts(tmp_path):
    """densevm's most VMs (`config.max_vms`) counts tasks against kernel.pid_max: each live
    VM's, each holder's and each cell's (`config.tasks`). KVM gives every VM a worker
    thread of its own, in the holder's thread group; counted short, 100,000 VMs with
    10,000 live passed the check and then ran out of pids at their wakes."""
    flags = ("--idle-after", "600")
    done = subprocess.run(
        [str(release_binary("densevm")), "describe", "--json", "--vms", "24", *flags],
        capture_output=True,
        text=True,
        check=True,
    )
    tasks = json.loads(done.stdout)["config"]["tasks"]
    m = start(tmp_path, 24, "127.211.0.0", *flags)
    try:
        live = [0, 1, 2, 9, 17]
        for vm in live:
            assert get(m.addr(vm)).body == SMALL, vm
        assert totals(m)["running"] == len(live)
        cells = children(m.proc.pid)

        def present_holders() -> list[int]:
            return [h for c in cells for h in children(c)]

        # VMs 0-2, 9 and 17 are in three holders of 8; the cells' first holders, forked
        # before any VM woke, leave as they find their VMs all asleep.
        assert wait_for(lambda: len(present_holders()) == 3, timeout=20), present_holders()
        holders = present_holders()
        counted = (
            len(cells) * tasks["per_cell"]
            + len(holders) * tasks["per_holder"]
            + len(live) * tasks["per_live_vm"]
        )
        names = task_names(cells + holders)
        assert sum(len(n) for n in names.values()) <= counted, names
        # Each live VM has its vCPU thread among them.
        vcpus = sum(name.startswith("vcpu") for h in holders for name in names[h])
        assert vcpus == len(live)
    finally:
        assert m.stop() == 0, m.stderr()


@pytest.mark.parametrize(
    "flags, why",
    [
        (["--idle-after", "0"], "--idle-after 0"),
        (["--idle-after", "nan"], "--idle-after NaN"),
        (["--max-live", "4"], "--max-live needs --idle-after"),
        (["--idle-after", "1", "--max-live", "0"], "--max-live must be at least 1"),
        (["--idle-after", "1", "--vcpu-stats"], "--vcpu-stats cannot follow"),
        (["--clone-boot"], "--clone-boot needs --idle-after"),
    ],
)
def test_bad_hibernation_flags_are_refused(tmp_path, flags, why):
    done = subprocess.run(
        [str(release_binary("densevm")), "describe", "--vms", "2", *flags],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and why in done.stderr, done.stderr
