"""Hostile guests: one VM of 101 misbehaves on purpose (webguest-hostile.elf,
the behaviour chosen at boot through --guest-arg); it is stopped or
throttled, and its 100 neighbours keep serving exact bytes.

Latency bounds (neighbours' p99 within 2x) are measured by
experiments/bench/hostile_neighbours.py, not here: timed assertions do not
belong in tests on a shared host."""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import time
from enum import IntEnum
from pathlib import Path

import pytest
from conftest import release_binary
from scalebench.webobject import SMALL
from support.densevm import HttpClient, Monitor, get, kvm_available, start

# `alone`: a guest that burns a core starves the kworkers that fault in its
# neighbours' pages whenever anything else keeps the host busy
# (docs/host-facts.md, "Guest faults go through KVM's async page faults").
pytestmark = [
    pytest.mark.skipif(
        not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
    ),
    pytest.mark.alone,
]

VMS = 101
HOSTILE_VM = 0


class Behaviour(IntEnum):
    """guest-images/webguest/hostile.h."""

    RING_FLOOD = 1
    WINDOW = 2
    COUNTER = 3
    NEVER_CLOSE = 4
    NEVER_BOOT = 5
    DIRTY_SYSTEM = 6
    FAULT_STORM = 7
    SPIN = 8
    WRITE_IMAGE = 11


def start_hostile(
    tmp_path: Path, behaviour: Behaviour, addr_base: str, *extra: str, count: int = 1
) -> Monitor:
    """VMs HOSTILE_VM .. HOSTILE_VM + count - 1 misbehave as `behaviour`."""
    guest_arg = (count << 40) | (int(behaviour) << 32) | HOSTILE_VM
    return start(
        tmp_path,
        VMS,
        addr_base,
        "--guest",
        str(release_binary("webguest-hostile.elf")),
        "--guest-arg",
        str(guest_arg),
        *extra,
    )


def vm_entry(m: Monitor, vm: int) -> dict:
    return next(v for v in m.control({"cmd": "list"})["vms"] if v["id"] == vm)


def wait_for_state(m: Monitor, vm: int, state: str, timeout: float = 20) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = vm_entry(m, vm)
        if entry["state"] == state:
            return entry
        time.sleep(0.1)
    raise AssertionError(f"VM {vm} is {entry['state']}, not {state}: {entry}")


def neighbours_serve(m: Monitor) -> None:
    for vm in range(1, VMS):
        assert get(m.addr(vm)).body == SMALL, f"neighbour {vm}"


SCHED_BATCH = 3  # every cell thread's policy (hypervisor/src/scheduling.rs)
SCHED_IDLE = 5


def vcpu_thread(m: Monitor, vm: int) -> Path:
    """VM `vm`'s vCPU thread in /proc (in a holder, a child of a cell,
    itself a child of the monitor process)."""
    parents: dict[int, int] = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                stat = (proc / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            parents[int(proc.name)] = int(stat.rpartition(")")[2].split()[1])

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == m.proc.pid:
                return True
            pid = parents.get(pid, 0)
        return False

    for pid in filter(descends, parents):
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                if (task / "comm").read_text().strip() == f"vcpu{vm}":
                    return task
        except (FileNotFoundError, ProcessLookupError):
            continue
    raise AssertionError(f"no vCPU thread of VM {vm} under process {m.proc.pid}")


def vcpu_sched_policy(m: Monitor, vm: int) -> int:
    """The kernel's scheduling policy of VM `vm`'s vCPU thread."""
    return int((vcpu_thread(m, vm) / "stat").read_text().rpartition(")")[2].split()[38])


def vcpu_cpus(m: Monitor, vm: int) -> set[int]:
    """The CPUs VM `vm`'s vCPU thread may run on."""
    return os.sched_getaffinity(int(vcpu_thread(m, vm).name))


def wait_for_background(m: Monitor, vm: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not vm_entry_stats(m, vm)["vcpu_background"]:
        assert time.monotonic() < deadline, f"VM {vm}'s vCPU never went to the background"
        time.sleep(0.1)
    assert vcpu_sched_policy(m, vm) == SCHED_IDLE


def vm_entry_stats(m: Monitor, vm: int) -> dict:
    return next(v for v in m.control({"cmd": "stats"})["vms"] if v["id"] == vm)


def stop_quickly(m: Monitor) -> None:
    started = time.monotonic()
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(30) == 0
    assert time.monotonic() - started < 10, "SIGTERM took more than 10 s"


def test_a_ring_flood_is_throttled_and_its_neighbours_keep_serving(tmp_path):
    m = start_hostile(tmp_path, Behaviour.RING_FLOOD, "127.245.0.0")
    try:
        time.sleep(1)
        neighbours_serve(m)
        assert m.control({"cmd": "stats"})["ok"]
        assert vm_entry(m, HOSTILE_VM)["state"] == "running", "flooding is legal, only bounded"
        # Flooding serves nothing: the flooder's CPU is what nobody else wants.
        wait_for_background(m, HOSTILE_VM)
    finally:
        stop_quickly(m)


def test_a_guest_sending_past_its_window_is_stopped(tmp_path):
    m = start_hostile(tmp_path, Behaviour.WINDOW, "127.246.0.0")
    try:
        client = HttpClient(m.addr(HOSTILE_VM))
        client.send(b"GET / HTTP/1.1\r\n\r\n")  # never read: the host must buffer or refuse
        entry = wait_for_state(m, HOSTILE_VM, "crashed")
        assert "unacknowledged" in entry["reason"]
        client.close()
        neighbours_serve(m)
    finally:
        stop_quickly(m)


def traced_requests(trace: Path) -> list[int]:
    data = trace.read_bytes()
    assert data[:8] == b"SBTRACE1"
    (header_len,) = struct.unpack_from("<I", data, 8)
    body = data[12 + header_len :]
    return list(struct.unpack(f"<{len(body) // 4}I", body))


def test_a_lying_request_counter_is_bounded_by_what_the_vm_was_sent(tmp_path):
    trace = tmp_path / "requests.trace"
    m = start_hostile(tmp_path, Behaviour.COUNTER, "127.247.0.0", "--record-trace", str(trace))
    sent = 5
    try:
        for _ in range(sent):
            assert get(m.addr(HOSTILE_VM)).body == SMALL
        neighbours_serve(m)
    finally:
        stop_quickly(m)
    per_vm = traced_requests(trace)
    assert per_vm.count(HOSTILE_VM) <= sent, "the guest's counter was believed"
    assert per_vm.count(1) == 1


def test_a_guest_that_never_closes_loses_the_host_socket(tmp_path):
    m = start_hostile(tmp_path, Behaviour.NEVER_CLOSE, "127.248.0.0")
    try:
        with socket.create_connection(m.addr(HOSTILE_VM), timeout=20) as s:
            s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            s.shutdown(socket.SHUT_WR)
            started = time.monotonic()
            assert s.recv(1) == b"", "the host should close the socket"
            assert time.monotonic() - started < 15
        neighbours_serve(m)
    finally:
        stop_quickly(m)


def test_a_guest_that_never_boots_fails_alone(tmp_path):
    m = start_hostile(tmp_path, Behaviour.NEVER_BOOT, "127.249.0.0", "--boot-timeout", "3")
    try:
        assert m.ready["vms"] == VMS - 1 and m.ready["failed"] == 1
        entry = vm_entry(m, HOSTILE_VM)
        assert entry["state"] == "crashed" and "did not boot" in entry["reason"]
        neighbours_serve(m)
    finally:
        stop_quickly(m)


def test_a_guest_writing_unused_system_pages_is_stopped(tmp_path):
    m = start_hostile(tmp_path, Behaviour.DIRTY_SYSTEM, "127.250.0.0")
    try:
        wait_for_state(m, HOSTILE_VM, "crashed")
        neighbours_serve(m)
    finally:
        stop_quickly(m)


def test_a_fault_storm_under_a_budget_leaves_neighbours_exact(tmp_path):
    m = start_hostile(
        tmp_path, Behaviour.FAULT_STORM, "127.251.0.0", "--mem", "64M", "--block", "32k"
    )
    try:
        time.sleep(1)
        neighbours_serve(m)
        neighbours_serve(m)
        pager = m.control({"cmd": "stats", "vms": False})["totals"]
        assert pager["faults"] > 0, "the storm should make the pager work"
        assert pager["resident_bytes"] <= 64 << 20, "the budget holds"
        assert vm_entry(m, HOSTILE_VM)["state"] == "running"
    finally:
        stop_quickly(m)


def test_a_resident_quota_makes_a_fault_storm_page_against_itself(tmp_path):
    """With --vm-resident-max, the storming VM evicts its own blocks: it never
    holds more than its quota, while a neighbour keeps what it touched."""
    quota = 1 << 20
    m = start_hostile(
        tmp_path,
        Behaviour.FAULT_STORM,
        "127.252.0.0",
        "--mem",
        "64M",
        "--block",
        "32k",
        "--vm-resident-max",
        "1M",
    )
    try:
        time.sleep(1)
        neighbours_serve(m)
        vms = {v["id"]: v for v in m.control({"cmd": "stats"})["vms"]}
        storm = vms[HOSTILE_VM]
        assert storm["state"] == "running"
        assert storm["blocks_out"] > 0, "the storm should have paged against itself"
        assert storm["resident_bytes"] <= quota
        assert m.control({"cmd": "pager"})["pager"]["vm_resident_max_bytes"] == quota
        neighbours_serve(m)
    finally:
        stop_quickly(m)


def test_a_spinning_guest_leaves_neighbours_serving(tmp_path):
    m = start_hostile(tmp_path, Behaviour.SPIN, "127.253.0.0")
    try:
        neighbours_serve(m)
        with pytest.raises(OSError):
            HttpClient(m.addr(HOSTILE_VM), timeout=2).response()
        wait_for_background(m, HOSTILE_VM)
        # Neighbours that served just now, with little CPU each, stay in the foreground, and
        # never left it (the spinner may go back and forth if a loaded host starves it).
        stats = m.control({"cmd": "stats"})
        assert stats["totals"]["vcpus_background"] == 1
        demotions = {vm["id"]: vm["vcpu_demotions"] for vm in stats["vms"]}
        assert demotions.pop(HOSTILE_VM) >= 1 and set(demotions.values()) == {0}, demotions
        assert vcpu_sched_policy(m, 1) == SCHED_BATCH
        # Demoted, it leaves its pinned cell's CPU for every CPU densevm may
        # use; a neighbour in its cell (cell 0: the first CPU) stays.
        allowed = os.sched_getaffinity(m.proc.pid)
        assert vcpu_cpus(m, HOSTILE_VM) == allowed
        assert vcpu_cpus(m, 1) == {min(allowed)}
    finally:
        stop_quickly(m)


def test_spinners_that_share_the_cores_are_all_sent_to_the_background(tmp_path):
    # Eight spinners on their cell's one CPU each run an eighth of it: under
    # any threshold on CPU used, while each wants a whole core.
    spinners = range(HOSTILE_VM, HOSTILE_VM + 8)
    m = start_hostile(tmp_path, Behaviour.SPIN, "127.208.0.0", count=len(spinners))
    try:
        for vm in spinners:
            wait_for_background(m, vm, timeout=20)
        for vm in range(spinners.stop, VMS):
            assert get(m.addr(vm)).body == SMALL, f"neighbour {vm}"
        stats = m.control({"cmd": "stats"})
        demotions = {vm["id"]: vm["vcpu_demotions"] for vm in stats["vms"]}
        assert all(demotions.pop(vm) >= 1 for vm in spinners), demotions
        assert set(demotions.values()) == {0}, demotions
    finally:
        stop_quickly(m)


@pytest.fixture
def small_filesystem(tmp_path):
    """A 16 MiB tmpfs: too small for the swap of 101 VMs of 4 MiB."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_swap_without_room_for_every_vm_refuses_to_start(tmp_path, small_filesystem):
    argv = [
        str(release_binary("densevm")),
        "serve",
        "--vms",
        str(VMS),
        "--addr-base",
        "127.254.0.0",
        "--mem",
        "64M",
        "--swap",
        str(small_filesystem / "swap"),
        "--api",
        str(tmp_path / "api.sock"),
        "--cell-vms",
        "10",
    ]
    done = subprocess.run(argv, capture_output=True, timeout=120, check=False)
    assert done.returncode != 0
    # One line from the parent, none from the cells it had started.
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 1 and "cannot reserve" in lines[0], lines
    assert not (small_filesystem / "swap").exists(), "the swap file is removed"


@pytest.mark.parametrize(
    "readonly_slots", [True, False], ids=["readonly-slots", "no-readonly-slots"]
)
def test_a_guest_writing_the_image_leaves_neighbours_exact(tmp_path, monkeypatch, readonly_slots):
    """The image every VM runs is shared. Where KVM maps it read-only the
    writer stops; where it cannot (forced here, as on a KVM without
    KVM_CAP_READONLY_MEM), each VM has a copy-on-write mapping of its own."""
    if not readonly_slots:
        monkeypatch.setenv("DENSEVM_TEST_NO_READONLY_MEM", "1")
    m = start_hostile(tmp_path, Behaviour.WRITE_IMAGE, "127.255.0.0")
    try:
        time.sleep(0.5)
        neighbours_serve(m)
        if readonly_slots:
            entry = vm_entry(m, HOSTILE_VM)
            assert entry["state"] == "crashed", "a write to the read-only image stops the writer"
        # Otherwise the writer broke only its own copy (its HTTP strings
        # too): whatever it does now, its neighbours above served exact bytes.
        neighbours_serve(m)
    finally:
        stop_quickly(m)
