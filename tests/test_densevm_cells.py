"""densevm's cells: VMs spread over worker processes behind one control API
and one pager. A cell that dies takes only its own VMs down; a parent that
dies takes every cell with it; a reader that goes away breaks nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess

import pytest
from conftest import release_binary
from scalebench.scaling import children
from scalebench.webobject import LARGE, SMALL
from support.densevm import fd_targets, get, kvm_available, start, wait_for

pytestmark = pytest.mark.skipif(
    not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
)


def cell_processes(pid: int) -> list[int]:
    """A cell `pid` and its holders (the children that own its KVM VMs)."""
    return [pid, *children(pid)]


def alive(pid: int) -> bool:
    """Whether any thread of `pid` still runs: a leader that exited shows as a
    zombie while another thread (stuck in the kernel, say) holds the process's
    descriptors."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(") ", 1)[1][0] != "Z":
                    return True
        except FileNotFoundError:
            continue
    return False


def test_vms_over_several_cells_answer_as_one_monitor(tmp_path):
    # Floating cells: their layout does not depend on the machine's CPUs.
    m = start(tmp_path, 10, "127.221.0.0", "--cell-vms", "3", "--cell-placement", "floating")
    try:
        assert m.ready["vms"] == 10 and m.ready["failed"] == 0
        assert m.ready["cells"] == 4 and m.ready["cell_vms"] == 3
        assert len(children(m.proc.pid)) == 4
        for vm in range(10):
            assert get(m.addr(vm)).body == SMALL
        stats = m.control({"cmd": "stats"})
        assert stats["totals"]["vms"] == 10 and stats["totals"]["running"] == 10
        assert stats["totals"]["requests"] >= 10
        assert [v["id"] for v in stats["vms"]] == list(range(10))
        assert all(v["requests"] >= 1 for v in stats["vms"])
        assert stats["totals"]["faults"] > 0  # one pager serves every cell
        # Requests name VMs in any cell.
        assert m.control({"cmd": "destroy", "vm": 4}) == {"ok": True, "vm": 4}
        listed = {v["id"]: v["state"] for v in m.control({"cmd": "list"})["vms"]}
        assert listed[4] == "stopped" and listed[3] == "running" and len(listed) == 10
        assert "no running VM 4" in m.raw_control(b'{"cmd":"destroy","vm":4}\n')["error"]
        assert "no running VM 99" in m.raw_control(b'{"cmd":"crash","vm":99}\n')["error"]
        # Ten VMs spread evenly over four cells: 3, 3, 2, 2. New VMs fill the
        # last cell (VMs 8 and 9), then a new one.
        assert m.control({"cmd": "create", "count": 3})["created"] == [10, 11, 12]
        assert len(children(m.proc.pid)) == 5
        for vm in (10, 11, 12):
            assert get(m.addr(vm), "/large").body == LARGE
        light = m.control({"cmd": "stats", "vms": False})
        assert light["totals"]["vms"] == 13 and light["totals"]["cells"] == 5 and "vms" not in light
    finally:
        assert m.stop() == 0


def test_a_killed_cell_takes_only_its_vms_down(tmp_path):
    # A budget below what the VMs touch: the pager is busy in every cell.
    m = start(
        tmp_path,
        9,
        "127.222.0.0",
        *("--cell-vms", "3", "--cell-placement", "floating", "--mem", "3M", "--selfcheck"),
    )
    try:
        for vm in range(9):
            assert get(m.addr(vm)).body == SMALL
        before = m.control({"cmd": "stats"})["totals"]
        victim = children(m.proc.pid)[1]  # VMs 3, 4, 5
        os.kill(victim, signal.SIGKILL)

        def down():
            states = {v["id"]: v for v in m.control({"cmd": "list"})["vms"]}
            return all(states[i]["state"] == "crashed" for i in (3, 4, 5)), states

        assert wait_for(lambda: down()[0])
        states = down()[1]
        assert "killed by signal 9" in states[4]["reason"]
        for _ in range(3):
            for vm in (0, 1, 2, 6, 7, 8):
                assert get(m.addr(vm)).body == SMALL
        with pytest.raises(OSError):
            get(m.addr(4))
        after = m.control({"cmd": "stats"})
        totals = after["totals"]
        assert totals["crashed"] == 3 and totals["running"] == 6 and totals["vms"] == 9
        assert totals["selfcheck_errors"] == 0 and totals["fatal_error"] is None
        assert totals["faults"] > before["faults"]
        # Its budget and swap went back to the pager (demand keeps a swap region per VM).
        assert totals["resident_bytes"] <= totals["budget_bytes"] + 8 * totals["block_bytes"]
        assert totals["swap_used_bytes"] == before["swap_used_bytes"] * 6 // 9
        assert [v["state"] for v in after["vms"] if v["id"] in (3, 4, 5)] == ["crashed"] * 3
        assert m.control({"cmd": "create", "count": 1})["created"] == [9]
        assert get(m.addr(9)).body == SMALL
    finally:
        assert m.stop() == 0
    assert f"(pid {victim}) killed by signal 9" in m.stderr()


def test_a_killed_holder_takes_only_its_vms_down(tmp_path):
    # One cell of 20 VMs: holders of 8, 8 and 4 (hypervisor/src/holder/mod.rs).
    m = start(
        tmp_path,
        20,
        "127.228.0.0",
        *("--cell-vms", "20", "--cell-placement", "floating", "--mem", "3M", "--selfcheck"),
    )
    try:
        for vm in range(20):
            assert get(m.addr(vm)).body == SMALL
        before = m.control({"cmd": "stats"})["totals"]
        [cell] = children(m.proc.pid)
        holders = children(cell)
        assert len(holders) == 3
        victim = next(h for h in holders if "vcpu10" in thread_names(h))
        parent_fds = len(os.listdir(f"/proc/{m.proc.pid}/fd"))
        os.kill(victim, signal.SIGKILL)

        def down():
            states = {v["id"]: v for v in m.control({"cmd": "list"})["vms"]}
            return all(states[i]["state"] == "crashed" for i in range(8, 16)), states

        assert wait_for(lambda: down()[0])
        assert f"holder 1 (pid {victim}) killed by signal 9" in down()[1][10]["reason"]
        for _ in range(3):
            for vm in (*range(8), *range(16, 20)):
                assert get(m.addr(vm)).body == SMALL
        with pytest.raises(OSError):
            get(m.addr(10))
        totals = m.control({"cmd": "stats"})["totals"]
        assert totals["crashed"] == 8 and totals["running"] == 12
        assert totals["selfcheck_errors"] == 0 and totals["fatal_error"] is None
        assert totals["faults"] > before["faults"]
        # Their budget and swap went back to the pager.
        assert totals["resident_bytes"] <= totals["budget_bytes"] + 8 * totals["block_bytes"]
        assert totals["swap_used_bytes"] == before["swap_used_bytes"] * 12 // 20
        # Its space (its userfaultfd) went too: no VM will use it again. The cell's memfd
        # stays, for its other holders.
        assert wait_for(lambda: len(os.listdir(f"/proc/{m.proc.pid}/fd")) <= parent_fds - 1)
    finally:
        assert m.stop() == 0


def thread_names(pid: int) -> set[str]:
    """The names of the threads of process `pid`."""
    names = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/comm") as f:
            names.add(f.read().strip())
    return names


def test_a_create_that_meets_a_dead_holder_does_not_fail_every_later_one(tmp_path):
    """A cell whose idle holder died fails the create that needs that
    holder's slots; the next create goes to a new cell rather than to the
    same dead slots (on ee49149 every later create failed the same way)."""
    # One cell of 16 slots, holders of 8: VMs 0-3 in holder 0, holder 1 idle.
    m = start(tmp_path, 4, "127.207.0.0", "--cell-vms", "16", "--cell-placement", "floating")
    try:
        [cell] = children(m.proc.pid)
        idle_holder = sorted(children(cell))[1]
        os.kill(idle_holder, signal.SIGKILL)
        failed = m.raw_control(b'{"cmd":"create","count":8}\n')
        # Which words tell the holder's death depends on when the cell
        # notices it; the VMs of its living holder may be made first.
        assert "holder" in failed["error"], failed
        made = failed["created"]
        assert made == list(range(4, 4 + len(made))) and len(made) <= 4, failed
        free = 4 + len(made)
        assert m.control({"cmd": "create", "count": 8})["created"] == list(range(free, free + 8))
        assert len(children(m.proc.pid)) == 2
        for vm in range(free + 8):
            assert get(m.addr(vm)).body == SMALL, f"VM {vm}"
    finally:
        assert m.stop() == 0


def test_a_cell_whose_vms_were_all_destroyed_is_retired(tmp_path):
    """A cell no `create` will grow whose every VM was destroyed (stopped
    live, or crashed then forgotten) exits with its holders, and nothing of
    it is listed: a run that replaces VMs keeps the cells it needs, not one
    per VM ever created. The last cell, which has room, stays."""
    m = start(tmp_path, 6, "127.205.0.0", "--cell-vms", "3", "--cell-placement", "floating")
    try:
        first, last = children(m.proc.pid)
        first_processes = cell_processes(first)
        assert len(first_processes) > 1  # a cell and its holders
        assert m.control({"cmd": "destroy", "vm": 0}) == {"ok": True, "vm": 0}
        assert m.control({"cmd": "destroy", "vm": 1}) == {"ok": True, "vm": 1}
        assert m.control({"cmd": "crash", "vm": 2})["ok"]

        def listed() -> dict[int, str]:
            return {v["id"]: v["state"] for v in m.control({"cmd": "list"})["vms"]}

        assert wait_for(lambda: listed()[2] == "crashed")
        assert alive(first), "a cell with a VM not destroyed is kept"
        assert m.control({"cmd": "destroy", "vm": 2}) == {"ok": True, "vm": 2}
        assert wait_for(lambda: not any(alive(p) for p in first_processes))
        assert listed() == {3: "running", 4: "running", 5: "running"}
        assert "retired: every VM of it was destroyed" in m.stderr()
        # The last cell is full: no create grows it, so it goes too.
        for vm in (3, 4, 5):
            assert m.control({"cmd": "destroy", "vm": vm}) == {"ok": True, "vm": vm}
        assert wait_for(lambda: not alive(last))
        assert listed() == {}
        assert m.control({"cmd": "create", "count": 2})["created"] == [6, 7]
        [grown] = children(m.proc.pid)
        for vm in (6, 7):
            assert get(m.addr(vm)).body == SMALL
        # The last cell has room for one more: emptied, it is kept and grown.
        for vm in (6, 7):
            assert m.control({"cmd": "destroy", "vm": vm}) == {"ok": True, "vm": vm}
        assert m.control({"cmd": "create", "count": 1})["created"] == [8]
        assert children(m.proc.pid) == [grown]
        assert get(m.addr(8)).body == SMALL
        totals = m.control({"cmd": "stats", "vms": False})["totals"]
        assert totals["running"] == 1 and totals["resident_bytes"] <= totals["budget_bytes"]
    finally:
        assert m.stop() == 0


def test_a_killed_parent_takes_every_cell_with_it(tmp_path):
    m = start(tmp_path, 6, "127.223.0.0", "--cell-vms", "2")
    cells = children(m.proc.pid)
    assert len(cells) == m.ready["cells"] >= 3
    processes = [p for cell in cells for p in cell_processes(cell)]
    assert len(processes) == 2 * len(cells)  # each cell and its holder
    m.proc.kill()
    m.proc.wait(10)
    assert wait_for(lambda: not any(alive(pid) for pid in processes)), [
        p for p in processes if alive(p)
    ]


def test_sigterm_stops_every_cell(tmp_path):
    m = start(tmp_path, 6, "127.224.0.0", "--cell-vms", "2")
    cells = children(m.proc.pid)
    processes = [p for cell in cells for p in cell_processes(cell)]
    assert m.stop(30) == 0
    assert not any(alive(pid) for pid in processes)
    assert not list(tmp_path.glob("densevm-swap-*")) and not m.api.exists()


def test_a_reader_that_went_away_does_not_crash_the_monitor(tmp_path):
    api = tmp_path / "s.sock"
    argv = [
        str(release_binary("densevm")),
        "serve",
        "--vms",
        "2",
        "--addr-base",
        "127.225.0.0",
        "--api",
        str(api),
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    assert b'"ready"' in proc.stdout.readline()
    proc.stdout.close()  # the exit line has nowhere to go
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert b"panicked" not in proc.stderr.read()


def thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of process `pid` may run on."""
    cpus = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/status") as f:
            line = next(x for x in f if x.startswith("Cpus_allowed_list:"))
        ranges = line.split(":", 1)[1].strip().split(",")
        cpus.append(
            {c for r in ranges for c in range(int(r.split("-")[0]), int(r.split("-")[-1]) + 1)}
        )
    return cpus


def test_pinned_cells_go_round_robin_over_the_cpus_densevm_may_use(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    m = start(tmp_path, 6, "127.234.0.0", "--cell-vms", "2")
    try:
        assert m.ready["cell_placement"] == "pinned"
        cells = children(m.proc.pid)
        # Three cells would hold the six VMs; pinned ones come in a multiple
        # of the CPUs (at most one per VM), so every CPU serves as many VMs.
        assert len(cells) == m.ready["cells"]
        assert len(cells) == min(6, -(-3 // len(allowed)) * len(allowed))
        for index, pid in enumerate(cells):
            # The loop, the vCPU threads in the cell's holders, every thread:
            # on the cell's one CPU.
            processes = cell_processes(pid)
            assert len(processes) >= 2  # the front and a holder at least
            threads = [t for p in processes for t in thread_cpus(p)]
            assert len(threads) >= 2  # the loop and a vCPU at least
            assert all(t == {allowed[index % len(allowed)]} for t in threads), threads
            # ... and under SCHED_BATCH, so a kicked vCPU does not preempt its loop.
            tids = [int(t) for p in processes for t in os.listdir(f"/proc/{p}/task")]
            assert {os.sched_getscheduler(t) for t in tids} == {os.SCHED_BATCH}
        # The parent (API, pager) stays free to run anywhere, as a normal process.
        assert all(t == set(allowed) for t in thread_cpus(m.proc.pid))
        assert os.sched_getscheduler(m.proc.pid) == os.SCHED_OTHER
        for vm in range(6):
            assert get(m.addr(vm)).body == SMALL
    finally:
        assert m.stop() == 0


def test_cells_stay_within_the_cpus_densevm_was_given(tmp_path):
    allowed = os.sched_getaffinity(0)
    only = max(allowed)
    os.sched_setaffinity(0, {only})  # as `taskset -c N densevm ...` would
    try:
        m = start(tmp_path, 4, "127.235.0.0", "--cell-vms", "2")
    finally:
        os.sched_setaffinity(0, allowed)
    try:
        assert all(t == {only} for pid in children(m.proc.pid) for t in thread_cpus(pid))
        assert get(m.addr(3)).body == SMALL
    finally:
        assert m.stop() == 0


def test_floating_cells_leave_placement_to_the_scheduler(tmp_path):
    allowed = os.sched_getaffinity(0)
    m = start(tmp_path, 4, "127.236.0.0", "--cell-vms", "2", "--cell-placement", "floating")
    try:
        assert m.ready["cell_placement"] == "floating"
        assert all(t == allowed for pid in children(m.proc.pid) for t in thread_cpus(pid))
        assert get(m.addr(3)).body == SMALL
    finally:
        assert m.stop() == 0


def listening_sockets(pids: list[int]) -> int:
    """TCP sockets in LISTEN held by any of `pids`."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":
                    listening.add(fields[9])
    held = {t[8:-1] for t in fd_targets(pids) if t.startswith("socket:[")}
    return len(listening & held)


def refused(addr: tuple[str, int]) -> bool:
    try:
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            return s.recv(1) == b""
    except (ConnectionRefusedError, ConnectionResetError):
        return True


def test_every_vm_is_reached_through_one_socket_per_cell(tmp_path):
    m = start(tmp_path, 12, "127.200.0.0", "--cell-vms", "6", "--cell-placement", "floating")
    try:
        assert m.ready["cells"] == 2
        for vm in range(12):
            assert get(m.addr(vm)).body == SMALL
        # The address steering hands every VM's connections to its cell's one socket.
        procs = [m.proc.pid, *(p for c in children(m.proc.pid) for p in cell_processes(c))]
        assert listening_sockets(procs) == 2
        # An address with no VM is refused, and so is a destroyed VM's; the others serve on.
        assert refused(m.addr(12))
        assert m.control({"cmd": "destroy", "vm": 3})["ok"]
        assert wait_for(lambda: refused(m.addr(3)))
        assert get(m.addr(4)).body == SMALL
        # A VM created later is steered to the cell that takes it.
        created = m.control({"cmd": "create", "count": 1})
        assert created["ok"], created
        (new,) = created["created"]
        assert get(m.addr(new)).body == SMALL
        assert listening_sockets(procs) == 2
    finally:
        assert m.stop() == 0


def test_a_dead_cells_addresses_are_refused_not_left_hanging(tmp_path):
    m = start(tmp_path, 12, "127.200.1.0", "--cell-vms", "6", "--cell-placement", "floating")
    try:
        first, _ = sorted(children(m.proc.pid))
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: not alive(first))
        assert wait_for(lambda: all(refused(m.addr(vm)) for vm in range(6)))
        for vm in range(6, 12):
            assert get(m.addr(vm)).body == SMALL
    finally:
        m.stop()
