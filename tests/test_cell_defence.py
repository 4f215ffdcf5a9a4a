"""Defence in depth between cells (issue 39): a guest, a client, a holder or a
cell that turns hostile harms only itself, and the parent survives every
word a cell says.

Each test here failed on 30b27ac. The hostile cell is played by this test
process: with pidfd_getfd(2) it takes a copy of a real cell's end of its link
to the parent and writes what a compromised cell could write."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import release_binary
from scalebench.scaling import children
from scalebench.webobject import SMALL
from support.densevm import Monitor, get, kvm_available, start, wait_for

pytestmark = pytest.mark.skipif(
    not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
)

HOSTILE_VM = 0
LYING_COUNTER = 9  # guest-images/webguest/hostile.h
OUTPUT_AFTER_CLOSE = 10
MAX_SLOTS = 64  # connections per VM (abi.h DV_MAX_SLOTS)
HELD_PER_VM = 256  # accepted connections a VM may have waiting for a slot (cell/listener.rs)


def fd_targets(pid: int) -> dict[int, tuple[str, int]]:
    """Each descriptor of `pid`: what it points at and the inode."""
    out: dict[int, tuple[str, int]] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            inode = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
        except (FileNotFoundError, PermissionError, OSError):
            continue
        out[int(fd)] = (target, inode)
    return out


def guest_mappings(pid: int) -> list[tuple[int, int, int]]:
    """The guest-memory memfds `pid` maps: (inode, first byte, end) in the memfd,
    a mapping each."""
    out = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5].startswith("/memfd:densevm-guest-ram"):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            offset = int(fields[2], 16)
            out.append((int(fields[4]), offset, offset + end - start))
    return out


def guest_memory(pids: list[int]) -> tuple[set[int], int]:
    """Inodes of the guest-memory memfds these processes hold or map, and how
    many userfaultfds they hold."""
    memfds: set[int] = set()
    uffds = 0
    for pid in pids:
        memfds |= {inode for inode, _, _ in guest_mappings(pid)}
        for target, inode in fd_targets(pid).values():
            # The guest image (one read-only memfd per cell) is no guest's memory.
            if target.startswith("/memfd:") and not target.startswith("/memfd:densevm-image"):
                memfds.add(inode)
            elif "userfaultfd" in target:
                uffds += 1
    return memfds, uffds


def test_a_cell_started_at_runtime_holds_no_other_cells_memory(tmp_path):
    m = start(tmp_path, 200, "127.231.0.0", "--cell-vms", "100", "--cell-placement", "floating")
    try:
        first_cells = children(m.proc.pid)
        assert len(first_cells) == 2
        first_tree = [c for cell in first_cells for c in (cell, *children(cell))]
        first_memfds, _ = guest_memory(first_tree)
        # Each cell's RAM and system pages: a memfd each.
        assert len(first_memfds) == 4, "the first cells map their guest memory from memfds"
        own_memfds, own_uffds = guest_memory([first_cells[0], *children(first_cells[0])])

        assert len(m.control({"cmd": "create", "count": 100})["created"]) == 100
        new_cell = next(c for c in children(m.proc.pid) if c not in first_cells)
        new_tree = [new_cell, *children(new_cell)]
        new_memfds, new_uffds = guest_memory(new_tree)
        assert not new_memfds & first_memfds, "a new cell holds an earlier cell's guest RAM"
        # A cell of the same size holds as many userfaultfds as the first did.
        assert new_uffds == own_uffds, (new_uffds, own_uffds)
        assert len(new_memfds) == len(own_memfds)
        assert get(m.addr(250)).body == SMALL
    finally:
        assert m.stop() == 0


def swap_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("densevm-swap-*"))


def test_the_swap_file_is_private_and_even_sigkill_leaves_none(tmp_path):
    m = start(tmp_path, 20, "127.232.0.0", "--mem", "16M", "--cell-vms", "10")
    tree = [p for cell in children(m.proc.pid) for p in (cell, *children(cell))]
    try:
        for vm in range(20):
            assert get(m.addr(vm)).body == SMALL
        assert m.control({"cmd": "stats", "vms": False})["totals"]["blocks_out"] > 0
        # Unlinked once open: no name a local user could open or a crash leave.
        assert swap_files(tmp_path) == []
    finally:
        m.proc.send_signal(signal.SIGKILL)
        m.proc.wait(30)
    assert wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in tree))
    assert swap_files(tmp_path) == []


def test_a_kept_swap_file_is_the_owners_alone(tmp_path):
    swap = tmp_path / "kept.img"
    m = start(tmp_path, 4, "127.233.0.0", "--mem", "8M", "--swap", str(swap), "--keep-swap")
    try:
        mode = stat.S_IMODE(swap.stat().st_mode)
        assert mode == 0o600, oct(mode)
    finally:
        assert m.stop() == 0
    assert swap.exists()
    swap.unlink()


def test_a_planted_link_is_not_followed_for_the_swap_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    swap = tmp_path / "swap.img"
    swap.symlink_to(victim)
    argv = [
        str(release_binary("densevm")),
        *("serve", "--vms", "2", "--addr-base", "127.234.0.0", "--mem", "8M"),
        *("--swap", str(swap), "--api", str(tmp_path / "api.sock")),
    ]
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert done.returncode != 0
    assert len(done.stderr.decode().strip().splitlines()) == 1, done.stderr
    assert victim.read_bytes() == b"precious"


def test_a_burst_of_vanished_control_clients_leaves_the_api_responsive(tmp_path):
    m = start(tmp_path, 200, "127.235.0.0", "--cell-placement", "floating")
    try:
        burst = b'{"cmd":"stats"}\n' * 50
        for _ in range(1000):
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(str(m.api))
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    s.sendall(burst)
        started = time.monotonic()
        reply = m.control({"cmd": "stats"})
        waited = time.monotonic() - started
        assert reply["ok"] and reply["totals"]["vms"] == 200
        # On 30b27ac this took 113 s; the 1 s target is measured by
        # experiments/bench/control_fuzz.py. Here: no work for gone clients.
        assert waited < 10, f"stats answered after {waited:.1f} s"
        started = time.monotonic()
        m.proc.send_signal(signal.SIGTERM)
        assert m.proc.wait(30) == 0
        assert time.monotonic() - started < 10
    finally:
        if m.proc.poll() is None:
            m.proc.kill()
    assert swap_files(tmp_path) == []


NEIGHBOURS = 20  # VMs 1-20 beside the hostile VM 0


def hostile(tmp_path: Path, behaviour: int, addr_base: str, *extra: str) -> Monitor:
    return start(
        tmp_path,
        1 + NEIGHBOURS,
        addr_base,
        *("--guest", str(release_binary("webguest-hostile.elf"))),
        *("--guest-arg", str((behaviour << 32) | HOSTILE_VM)),
        *extra,
    )


def neighbours_serve(m: Monitor) -> None:
    for vm in range(1, 1 + NEIGHBOURS):
        assert get(m.addr(vm)).body == SMALL, f"neighbour {vm}"


def test_a_guest_lying_about_its_requests_is_still_demoted(tmp_path):
    m = hostile(tmp_path, LYING_COUNTER, "127.236.0.0")
    clients: list[socket.socket] = []
    try:
        # Bytes sent to the VM let the host believe some of its counter.
        for _ in range(8):
            s = socket.create_connection(m.addr(HOSTILE_VM), timeout=5)
            s.setblocking(False)
            clients.append(s)

        def demoted() -> bool:
            for s in clients:
                with contextlib.suppress(OSError):
                    s.send(b"GET / HTTP/1.1\r\n\r\n" * 16)
            vm = next(v for v in m.control({"cmd": "stats"})["vms"] if v["id"] == HOSTILE_VM)
            return bool(vm["vcpu_background"])

        assert wait_for(demoted, 20), "a guest counting requests it never served kept its CPU"
        # Requests keep coming and its counter keeps lying: it stays in the background.
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            assert demoted(), "a lying request counter won the vCPU back"
            time.sleep(0.05)
        neighbours_serve(m)
    finally:
        for s in clients:
            s.close()
        assert m.stop() == 0


def test_output_held_for_clients_that_never_read_is_bounded(tmp_path):
    m = hostile(
        tmp_path,
        OUTPUT_AFTER_CLOSE,
        "127.237.0.0",
        *("--cell-vms", "21", "--cell-placement", "floating"),
    )
    clients: list[socket.socket] = []
    try:
        (cell,) = children(m.proc.pid)
        fds_before = len(os.listdir(f"/proc/{cell}/fd"))
        # More than its slots and its queue of held connections together.
        refused = 0
        for _ in range(MAX_SLOTS + HELD_PER_VM + 64):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            # A small segment size keeps the host's send buffer small (on
            # loopback it would otherwise take the whole window at once),
            # so the output the guest left behind stays in the cell.
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
            s.settimeout(5)
            try:
                s.connect(m.addr(HOSTILE_VM))
                s.sendall(b"GET / HTTP/1.1\r\n\r\n")
            except OSError:
                s.close()
                refused += 1
                continue
            clients.append(s)
        time.sleep(2)
        held = len(os.listdir(f"/proc/{cell}/fd")) - fds_before
        assert held <= MAX_SLOTS + HELD_PER_VM + 8, f"the cell holds {held} more descriptors"
        # Those past the bound were turned away with a reset, not left hanging.
        reset = 0
        readable, _, _ = select.select(clients, [], [], 1.0)
        for s in readable:
            try:
                reset += s.recv(1, socket.MSG_PEEK) == b""
            except ConnectionResetError:
                reset += 1
        assert refused + reset >= 64 - 8, (refused, reset)
        neighbours_serve(m)
    finally:
        for s in clients:
            s.close()
        assert m.stop() == 0


SYS_PIDFD_GETFD = 438


def steal_link(cell: int) -> socket.socket:
    """A copy of cell `cell`'s end of its link to the parent (its stdin)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(cell)
    try:
        fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, 0, 0)
        if fd < 0:
            pytest.skip(f"pidfd_getfd: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(pidfd)
    return socket.socket(fileno=fd)


@pytest.mark.parametrize(
    "words",
    [
        pytest.param(b"\x00\xffnot json at all\n", id="garbage"),
        pytest.param(b"x" * (70 << 20), id="oversized-line"),
        pytest.param(b'{"ev":"booted","ready":4294967295,"failed":4294967295}\n', id="lying-boot"),
        pytest.param(
            b'{"ev":"access","counts":[[4000000000,1],[0,18446744073709551615]]}\n',
            id="lying-access",
        ),
        pytest.param(b'{"ev":"stopped","vm":0}\n', id="stopping-another-cells-vm"),
        pytest.param(b'{"ev":"failed","error":"' + b"e" * 100 + b'"}\n', id="failed-after-boot"),
        pytest.param(
            b'{"ev":"reply","reply":{"ok":true,"created":[]}}\n{"ev":"reply"}\n',
            id="unasked-replies",
        ),
    ],
)
def test_the_parent_survives_every_word_a_cell_says(tmp_path, words):
    m = start(tmp_path, 12, "127.238.0.0", "--cell-vms", "4", "--cell-placement", "floating")
    try:
        cells = children(m.proc.pid)
        assert len(cells) == 3
        link = steal_link(cells[1])  # VMs 4-7
        try:
            link.settimeout(30)
            link.sendall(words)
        except OSError:
            pass
        finally:
            link.close()
        time.sleep(0.5)
        assert m.proc.poll() is None, f"the parent died: {m.stderr()[-500:]}"
        # Whatever that cell said, the others serve and the API answers.
        for vm in (0, 1, 2, 3, 8, 9, 10, 11):
            assert get(m.addr(vm)).body == SMALL
        listed = {v["id"]: v for v in m.control({"cmd": "list"})["vms"]}
        assert len(listed) == 12
        assert all(listed[v]["state"] == "running" for v in (0, 1, 2, 3, 8, 9, 10, 11))
        totals = m.control({"cmd": "stats", "vms": False})["totals"]
        assert totals["vms"] == 12 and totals["running"] <= 12
        assert m.control({"cmd": "create", "count": 1})["ok"]
    finally:
        assert m.stop() == 0


def test_a_stopped_cell_does_not_make_the_parent_deaf(tmp_path):
    m = start(tmp_path, 8, "127.239.0.0", "--cell-vms", "4", "--cell-placement", "floating")
    cells = children(m.proc.pid)
    try:
        os.kill(cells[1], signal.SIGSTOP)
        started = time.monotonic()
        reply = m.control({"cmd": "stats"})
        assert time.monotonic() - started < 25, "the parent waited on a stopped cell"
        assert "totals" in reply or "error" in reply
        for vm in range(4):
            assert get(m.addr(vm)).body == SMALL
        started = time.monotonic()
        assert m.control({"cmd": "list"})["ok"]
        assert time.monotonic() - started < 25
    finally:
        # The parent kills a cell that misses its deadline.
        with contextlib.suppress(ProcessLookupError):
            os.kill(cells[1], signal.SIGCONT)
        assert m.stop() == 0


def test_a_guest_memfd_cannot_be_shrunk_and_no_holder_holds_one(tmp_path):
    """Guest RAM is a memfd sealed against shrinking wherever a descriptor of it is
    (the parent's pager); a holder holds none: the cell's one memfd would let it map
    the other holders' memory."""
    m = start(tmp_path, 20, "127.240.0.0", "--cell-vms", "20", "--cell-placement", "floating")
    try:
        (cell,) = children(m.proc.pid)
        holders = children(cell)
        assert len(holders) == 3
        F_GET_SEALS = 1034
        F_SEAL_SHRINK = 0x2
        sealed = 0
        for pid in (m.proc.pid, cell, *holders):
            for fd, (target, _) in fd_targets(pid).items():
                if target.startswith("/memfd:densevm-guest"):
                    assert pid not in holders, f"holder {pid} holds {target}"
                    with open(f"/proc/{pid}/fd/{fd}", "rb") as f:
                        seals = fcntl.fcntl(f.fileno(), F_GET_SEALS)
                    assert seals & F_SEAL_SHRINK, f"process {pid}'s {target} can shrink"
                    sealed += 1
        assert sealed == 1, "the parent holds the cell's guest-RAM memfd, once"
    finally:
        assert m.stop() == 0


def test_api_path_that_is_not_a_socket_is_left_alone(tmp_path):
    precious = tmp_path / "notes.txt"
    precious.write_text("keep me")
    argv = [
        str(release_binary("densevm")),
        *("serve", "--vms", "1", "--addr-base", "127.241.0.0", "--api", str(precious)),
    ]
    done = subprocess.run(argv, capture_output=True, timeout=60, check=False)
    assert done.returncode == 2, done.stderr
    assert precious.read_text() == "keep me"
    assert len(done.stderr.decode().strip().splitlines()) == 1


def test_replies_answer_their_own_request(tmp_path):
    """Requests carry ids over the link: a reply is matched to its request,
    never to the next one."""
    m = start(tmp_path, 8, "127.242.0.0", "--cell-vms", "4", "--cell-placement", "floating")
    try:
        for _ in range(20):
            listed = m.control({"cmd": "list"})
            assert [v["id"] for v in listed["vms"]] == list(range(8))
            stats = m.control({"cmd": "stats", "vms": False})
            assert "vms" not in stats and stats["totals"]["vms"] == 8
        # A reply the parent never asked for is ignored (or ends that cell), not
        # taken as the answer to the next request.
        link = steal_link(children(m.proc.pid)[0])
        try:
            link.sendall(b'{"ev":"reply","reply":{"ok":true,"vms":[]}}\n')
        finally:
            link.close()
        listed = m.control({"cmd": "list"})
        assert len(listed["vms"]) == 8
    finally:
        assert m.stop() == 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_doorbell_storm_is_put_off_and_costs_its_cell_little(tmp_path):
    """The lying-counter guest rings its doorbell in a loop with nothing to
    say (no client sends it anything): the cell puts its doorbell off with
    backoff instead of waking for every ring."""
    m = hostile(tmp_path, LYING_COUNTER, "127.243.0.0", "--cell-placement", "floating")
    try:
        (cell,) = children(m.proc.pid)
        time.sleep(1)
        before = cpu_seconds(cell)
        time.sleep(2)
        share = (cpu_seconds(cell) - before) / 2
        assert share < 0.1, f"the cell used {share:.0%} of a core on a doorbell storm"
        vm = next(v for v in m.control({"cmd": "stats"})["vms"] if v["id"] == HOSTILE_VM)
        assert vm["doorbells_deferred"] > 0
        assert m.control({"cmd": "stats", "vms": False})["totals"]["doorbells_deferred"] > 0
        neighbours_serve(m)
    finally:
        assert m.stop() == 0


def fd_flags(pid: int, fd: int) -> int:
    for line in Path(f"/proc/{pid}/fdinfo/{fd}").read_text().splitlines():
        if line.startswith("flags:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no flags for fd {fd} of {pid}")


def test_each_holder_holds_only_its_own_descriptors(tmp_path):
    """Holders are forked with every descriptor they do not need closed: no
    other holder's interrupts or doorbells, and no memfd (the cell's one
    memfd would map every holder's memory); each maps only its own part of
    the cell's memory; and what the cell receives from its holders is
    close-on-exec."""
    per_holder = 8  # hypervisor/src/holder/mod.rs HOLDER_VMS
    m = start(
        tmp_path,
        20,
        "127.244.0.0",
        *("--cell-vms", "20", "--cell-placement", "floating", "--vcpu-stats"),
    )
    try:
        (cell,) = children(m.proc.pid)
        holders = children(cell)
        assert len(holders) == 3
        seen: list[tuple[int, int, int]] = []
        for holder in holders:
            targets = [t for t, _ in fd_targets(holder).values()]
            eventfds = sum("[eventfd]" in t for t in targets)
            assert eventfds <= 2 * per_holder, f"holder {holder} holds {eventfds} eventfds"
            assert not any(t.startswith("/memfd:densevm-guest") for t in targets), targets
            _, uffds = guest_memory([holder])
            assert uffds == 0, "the pager's userfaultfd is the only one"
            mapped = guest_mappings(holder)
            # Its RAM, and its system pages (with guard pages between them).
            assert len({inode for inode, _, _ in mapped}) == 2, mapped
            for inode, first, end in mapped:
                assert not any(inode == i and first < e and s < end for i, s, e in seen), (
                    "another holder's memory"
                )
            seen += mapped
            sockets = sum(t.startswith("socket:") for t in targets)
            assert sockets == 1, f"holder {holder} holds more than its link: {targets}"
        stats = [fd for fd, (t, _) in fd_targets(cell).items() if "kvm-vcpu-stats" in t]
        assert len(stats) == 20
        O_CLOEXEC = 0o2000000
        assert all(fd_flags(cell, fd) & O_CLOEXEC for fd in stats), "received without CLOEXEC"
        for vm in range(20):
            assert get(m.addr(vm)).body == SMALL
    finally:
        assert m.stop() == 0


def test_a_crashed_vm_destroyed_is_forgotten(tmp_path):
    """Crashed VMs are destroyed to forget them, so a host whose holders keep
    dying returns to what it held (experiments/bench/cell_chaos.py)."""
    m = start(tmp_path, 16, "127.244.0.0", "--cell-vms", "16", "--cell-placement", "floating")
    try:
        (cell,) = children(m.proc.pid)
        os.kill(children(cell)[0], signal.SIGKILL)  # VMs 0-7

        def crashed() -> list[int]:
            vms = m.control({"cmd": "list"})["vms"]
            return [v["id"] for v in vms if v["state"] == "crashed"]

        assert wait_for(lambda: len(crashed()) == 8)
        for vm in crashed():
            assert m.control({"cmd": "destroy", "vm": vm}) == {"ok": True, "vm": vm}
        listed = [v["id"] for v in m.control({"cmd": "list"})["vms"]]
        assert listed == list(range(8, 16))
        assert m.control({"cmd": "stats", "vms": False})["totals"]["vms"] == 8
        assert "no running VM 3" in m.raw_control(b'{"cmd":"destroy","vm":3}\n')["error"]
        # A VM destroyed while it ran stays listed as stopped.
        assert m.control({"cmd": "destroy", "vm": 9})["ok"]
        assert {v["id"]: v["state"] for v in m.control({"cmd": "list"})["vms"]}[9] == "stopped"
        assert get(m.addr(10)).body == SMALL
    finally:
        assert m.stop() == 0
