"""densevm + webguest: exact bytes, HTTP edge cases, fault containment, control
API errors and clean shutdown, against real KVM guests."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time

import pytest
from conftest import release_binary
from scalebench.webobject import LARGE, SMALL
from support.densevm import HttpClient, get, kvm_available, start

pytestmark = pytest.mark.skipif(
    not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
)


@pytest.fixture(scope="module")
def monitor(tmp_path_factory):
    m = start(tmp_path_factory.mktemp("densevm"), 4, "127.201.0.0")
    yield m
    assert m.stop() == 0


def test_ready_line_describes_the_boot(monitor):
    assert monitor.ready["event"] == "ready"
    assert monitor.ready["vms"] == 4
    assert monitor.ready["failed"] == 0
    assert monitor.ready["boot_seconds"] > 0
    assert monitor.ready["platform"] in ("pvm", "kvm")
    # Four VMs' working sets fit in the default budget: the in-core cell size.
    assert monitor.ready["cell_vms"] == 500


def test_objects_are_exact_over_keep_alive(monitor):
    client = HttpClient(monitor.addr(0))
    for path, expected in [("/", SMALL), ("/large", LARGE), ("/", SMALL), ("/large?x=1", LARGE)]:
        client.send(f"GET {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        r = client.response()
        assert r.status == 200
        assert r.headers["content-length"] == str(len(expected))
        assert r.headers["connection"] == "keep-alive"
        assert r.body == expected
    client.close()


def test_pipelined_requests_are_answered_in_order(monitor):
    rng = random.Random(7)
    paths = [rng.choice(["/", "/large", "/missing"]) for _ in range(60)]
    client = HttpClient(monitor.addr(1))
    client.send(b"".join(f"GET {p} HTTP/1.1\r\nHost: t\r\n\r\n".encode() for p in paths))
    for p in paths:
        r = client.response()
        if p == "/missing":
            assert r.status == 404
        else:
            assert r.status == 200
            assert r.body == (SMALL if p == "/" else LARGE)
    client.close()


def test_a_response_held_back_by_a_slow_reader_resumes_when_it_reads(monitor):
    """Twenty large responses (2.7 MB) exceed the connection's 256 KiB window:
    the guest idles with output held back, and each time the client reads,
    the host's acknowledgements must wake it to send more."""
    client = HttpClient(monitor.addr(2))
    client.send(b"GET /large HTTP/1.1\r\nHost: t\r\n\r\n" * 20)
    time.sleep(1)  # nothing read: the guest fills the window and halts
    for _ in range(20):
        assert client.response().body == LARGE
    client.close()


def test_head_returns_headers_only(monitor):
    client = HttpClient(monitor.addr(0))
    client.send(b"HEAD /large HTTP/1.1\r\nHost: t\r\n\r\nGET / HTTP/1.1\r\n\r\n")
    head = client.response(head=True)
    assert (
        head.status == 200
        and head.headers["content-length"] == str(len(LARGE))
        and head.body == b""
    )
    assert client.response().body == SMALL
    client.close()


def test_http10_closes_unless_keep_alive(monitor):
    client = HttpClient(monitor.addr(2))
    client.send(b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
    assert client.response().headers["connection"] == "keep-alive"
    client.send(b"GET / HTTP/1.0\r\n\r\n")
    r = client.response()
    assert r.body == SMALL and r.headers["connection"] == "close"
    assert client.closed_by_peer()
    client.close()


def test_http11_connection_close_is_honoured(monitor):
    client = HttpClient(monitor.addr(2))
    client.send(b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
    assert client.response().headers["connection"] == "close"
    assert client.closed_by_peer()
    client.close()


@pytest.mark.parametrize(
    "request_bytes, status",
    [
        (b"GET /\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nNoColonHere\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 400),
        (b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
        (b"GET\x00/ HTTP/1.1\r\n\r\n", 400),
        (b"BREW /pot HTTP/1.1\r\n\r\n", 501),
        (b"GET / HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", 400),
    ],
)
def test_bad_requests_get_an_error_and_the_connection_closes(monitor, request_bytes, status):
    client = HttpClient(monitor.addr(3))
    client.send(request_bytes)
    r = client.response()
    assert r.status == status
    assert r.headers["connection"] == "close"
    assert client.closed_by_peer()
    client.close()


def test_malformed_corpus_leaves_the_vm_serving(monitor):
    addr = monitor.addr(3)
    rng = random.Random(2024)
    # Binary garbage, with and without line breaks.
    answers = []
    for _ in range(20):
        with socket.create_connection(addr, timeout=5) as s:
            reply = b""
            try:  # the guest may answer 400 and close while we are still sending
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 20000))))
                s.shutdown(socket.SHUT_WR)
                while chunk := s.recv(65536):
                    reply += chunk
            except OSError:
                pass
            answers.append(reply[:12])
    assert all(a in (b"", b"HTTP/1.1 400") for a in answers), answers
    # Truncated requests, then the client goes away.
    for partial in [b"GET / HT", b"GET / HTTP/1.1\r\nHost: x\r\n", b"\r\n\r\n\r\n"]:
        with socket.create_connection(addr, timeout=5) as s:
            s.sendall(partial)
    # A header block that never ends (over the 8 KiB limit).
    client = HttpClient(addr)
    client.send(b"GET / HTTP/1.1\r\n" + b"X-Long: " + b"b" * 20000)
    assert client.response().status == 400
    client.close()
    # A slow client, one byte at a time.
    client = HttpClient(addr)
    for byte in b"GET /large HTTP/1.1\r\nHost: slow\r\n\r\n":
        client.send(bytes([byte]))
        time.sleep(0.002)
    assert client.response().body == LARGE
    client.close()
    # A client that pipelines far more than it reads, then leaves.
    with socket.create_connection(addr, timeout=5) as s:
        s.sendall(b"GET /large HTTP/1.1\r\n\r\n" * 300)
        time.sleep(0.5)
    # Many pipelined requests read back completely.
    client = HttpClient(addr)
    client.send(b"GET / HTTP/1.1\r\n\r\n" * 1000)
    for _ in range(1000):
        assert client.response().body == SMALL
    client.close()
    assert get(addr).body == SMALL
    assert get(monitor.addr(0)).body == SMALL


def test_more_connections_than_slots_are_all_served(monitor):
    clients = [HttpClient(monitor.addr(1)) for _ in range(150)]
    for c in clients:
        c.send(b"GET / HTTP/1.1\r\n\r\n")
    for c in clients[:64]:
        assert c.response().body == SMALL
    for c in clients[:64]:
        c.close()
    for c in clients[64:]:
        assert c.response().body == SMALL
        c.close()


def test_bad_control_requests_get_error_replies(monitor):
    for line in [
        b"garbage\n",
        b"{}\n",
        b'{"cmd":"reboot"}\n',
        b'{"cmd":"destroy"}\n',
        b'{"cmd":"destroy","vm":999}\n',
        b'{"cmd":"crash","vm":0,"how":"x"}\n',
        b'{"cmd":"create","count":0}\n',
        b"\xff\xfe\n",
    ]:
        reply = monitor.raw_control(line)
        assert "error" in reply and "ok" not in reply, (line, reply)
    totals = monitor.control({"cmd": "stats"})["totals"]
    assert totals["vms"] == 4 and totals["requests"] > 0


def wait_until_guests_are_quiet(monitor, timeout_s: float = 30) -> None:
    """Until the guests' request counters stop moving: earlier tests leave pipelined requests
    in rings whose clients have gone, and guests serve them for a while."""
    deadline = time.monotonic() + timeout_s
    last = None
    while (now := monitor.control({"cmd": "stats", "vms": False})["totals"]["requests"]) != last:
        assert time.monotonic() < deadline, "the guests never stopped serving"
        last = now
        time.sleep(0.5)


def test_stats_report_each_vm(monitor):
    get(monitor.addr(0))
    wait_until_guests_are_quiet(monitor)
    reply = monitor.control({"cmd": "stats"})
    vm0 = reply["vms"][0]
    assert vm0["addr"] == "127.201.0.0:8080"
    assert vm0["state"] == "running"
    assert vm0["requests"] >= 1
    assert reply["totals"]["requests"] == sum(v["requests"] for v in reply["vms"])
    # The light request: the same totals, no per-VM list and no mincore pass.
    light = monitor.control({"cmd": "stats", "vms": False})
    assert "vms" not in light and "ram_resident_bytes" not in light["totals"]
    assert light["totals"]["requests"] == reply["totals"]["requests"]
    assert light["totals"]["running"] == reply["totals"]["running"]


def test_a_busy_vm_keeps_reusing_the_front_of_its_rings(monitor):
    """An empty ring starts again at its front: the system pages a VM holds
    do not grow with the requests it serves (every ring page touched for the
    first time is a host fault and stays host memory)."""
    addr = monitor.addr(3)

    def sys_resident() -> int:
        vms = monitor.control({"cmd": "stats"})["vms"]
        return next(v["sys_resident_bytes"] for v in vms if v["id"] == 3)

    assert get(addr).body == SMALL
    before = sys_resident()
    for _ in range(300):
        assert get(addr).body == SMALL
    # ~700 KiB of responses: walking the rings would touch all 320 KiB of them.
    grown = sys_resident() - before
    assert grown <= 64 << 10, f"system pages grew by {grown} bytes"


def test_a_crashing_guest_stops_only_its_vm(tmp_path):
    m = start(tmp_path, 4, "127.202.0.0")
    try:
        m.control({"cmd": "crash", "vm": 1})
        m.control({"cmd": "crash", "vm": 2, "how": "triple"})
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            states = {v["id"]: v for v in m.control({"cmd": "list"})["vms"]}
            if states[1]["state"] == "crashed" and states[2]["state"] == "crashed":
                break
            time.sleep(0.05)
        assert "vector 6" in states[1]["reason"]
        assert "triple fault" in states[2]["reason"]
        for vm in (0, 3):
            assert get(m.addr(vm)).body == SMALL
        with pytest.raises(OSError):
            get(m.addr(1))
        totals = m.control({"cmd": "stats"})["totals"]
        assert totals["crashed"] == 2 and totals["running"] == 2
        m.control({"cmd": "destroy", "vm": 3})
        created = m.control({"cmd": "create", "count": 1})["created"]
        assert created == [4]
        assert get(m.addr(4), "/large").body == LARGE
    finally:
        assert m.stop() == 0
    assert "VM 1 (127.202.0.1:8080) stopped" in m.stderr()


def test_sigterm_tears_everything_down(tmp_path):
    m = start(tmp_path, 8, "127.203.0.0")
    open_conn = HttpClient(m.addr(5))
    open_conn.send(b"GET / HTTP/1.1\r\n\r\n")
    assert open_conn.response().body == SMALL
    started = time.monotonic()
    m.proc.send_signal(signal.SIGTERM)
    assert m.proc.wait(30) == 0
    assert time.monotonic() - started < 10
    assert not m.api.exists()
    open_conn.close()
    # Every listener is gone: the addresses can be listened on again.
    for vm in range(8):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(m.addr(vm))
            s.listen()
    exit_line = m.proc.stdout.read().decode()
    assert '"event":"exit"' in exit_line and '"signal":15' in exit_line


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--vms", "0"], "--vms must be at least 1"),
        (["--vms", "2", "--ws", "3k"], "multiples of 4 KiB"),
        (["--vms", "2", "--guest-mem", "1M"], "cannot hold the guest"),
        (["--vms", "2", "--addr-base", "10.0.0.1"], "127.0.0.0/8"),
        (["--vms", "2", "--guest", "/nonexistent/webguest.elf"], "cannot read guest image"),
        (["--vms", "2", "--ws", "lots"], "invalid size"),
        (["--vms", "100000"], "kernel memory"),
        (["--vms", "2", "--cell-vms", "0"], "--cell-vms must be at least 1"),
        (["--vms", "2", "--bogus-flag"], "--bogus-flag"),
    ],
)
def test_bad_configuration_fails_before_boot_with_one_line(tmp_path, args, fragment):
    proc = subprocess.run(
        [str(release_binary("densevm")), "serve", "--api", str(tmp_path / "s.sock"), *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("densevm: "), proc.stderr
    assert fragment in lines[0]
    assert proc.stdout == ""
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--vms", "0"], "--vms must be at least 1"),
        (["--vms", "2", "--addr-base", "10.0.0.1"], "127.0.0.0/8"),
        (["--vms", "2", "--cell-vms", "0"], "--cell-vms must be at least 1"),
        (["--vms", "100000"], "kernel memory"),
    ],
)
def test_describe_refuses_what_serve_refuses(args, fragment):
    proc = subprocess.run(
        [str(release_binary("densevm")), "describe", "--json", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert proc.stdout == ""


def test_a_second_monitor_cannot_steal_a_live_control_socket(monitor, tmp_path):
    proc = subprocess.run(
        [
            str(release_binary("densevm")),
            "serve",
            "--vms",
            "1",
            "--addr-base",
            "127.204.0.0",
            "--api",
            str(monitor.api),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode == 2 and "in use" in proc.stderr
    assert monitor.control({"cmd": "stats"})["ok"]


def test_the_control_socket_is_the_owners_alone(monitor):
    assert os.stat(monitor.api).st_mode & 0o777 == 0o600


def test_control_clients_beyond_the_limit_are_turned_away(monitor):
    clients = []
    try:
        for _ in range(300):
            s = socket.socket(socket.AF_UNIX)
            s.settimeout(10)
            s.connect(str(monitor.api))
            clients.append(s)
        # The monitor has seen every connection once the last one is answered or refused.
        clients[-1].sendall(b'{"cmd":"list"}\n')
        assert "more than 256 control clients" in clients[-1].makefile("rb").readline().decode()
        clients[0].sendall(b'{"cmd":"list"}\n')
        assert json.loads(clients[0].makefile("rb").readline())["ok"]
    finally:
        for s in clients:
            s.close()
    assert monitor.control({"cmd": "stats"})["ok"]


def test_a_client_that_never_reads_its_replies_is_not_read_from(monitor):
    requests = 30000  # replies far past what a client may leave unread
    payload = b'{"cmd":"stats"}\n' * requests
    sent = 0
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(10)
        s.connect(str(monitor.api))
        # Backpressure (issue 39): once its unread replies pass the limit, its
        # requests are not read any more, so its sends stop going through.
        with contextlib.suppress(TimeoutError, BrokenPipeError, ConnectionResetError):
            while sent < len(payload):
                sent += s.send(payload[sent:])
    assert sent < len(payload), "the monitor read every request of a client that reads nothing"
    started = time.monotonic()
    assert monitor.control({"cmd": "stats"})["ok"]
    assert time.monotonic() - started < 5, "the gone client's requests were still answered"


def test_guest_runs_natively_on_pvm(monitor):
    if monitor.ready["platform"] != "pvm":
        pytest.skip("not a PVM host")
    assert monitor.ready["pvm"] is True
    assert os.path.exists("/dev/kvm")


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    """One VM whose KVM counters (`--vcpu-stats`) the tests read."""
    m = start(tmp_path_factory.mktemp("counted"), 1, "127.237.0.0", "--vcpu-stats")
    yield m
    assert m.stop() == 0


def kept_alive_requests(m, n: int) -> dict[str, int]:
    """Sends n requests one after another on one connection; returns how the
    VM's request count and KVM counters grew meanwhile."""

    def counters() -> dict[str, int]:
        vm = m.control({"cmd": "stats"})["vms"][0]
        return {"requests": vm["requests"], **vm["kvm"]}

    client = HttpClient(m.addr(0))

    def one_request() -> None:
        client.send(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        assert client.response().body == SMALL

    one_request()
    before = counters()
    for _ in range(n):
        one_request()
    after = counters()
    client.close()
    return {k: after[k] - before[k] for k in before if isinstance(before[k], int)}


def test_a_kept_alive_request_wakes_its_guest_once(counted):
    """The guest is interrupted for the request, not again once its response
    has gone out: tx progress is news only to a guest with output held back."""
    grew = kept_alive_requests(counted, 200)
    assert grew["requests"] == 200
    assert grew["halt_exits"] >= 100, "the guest did not halt between requests"
    # Before the guest said when it waits for tx progress: 2.00 a request.
    assert grew["irq_injections"] <= 1.1 * 200


def test_pvm_guests_trap_only_for_the_doorbell_and_the_halt(counted):
    """On PVM a guest traps to the host for its doorbell `out` (one a request)
    and its `hlt`, and for nothing else: PVM completes the EOI as it
    delivers the interrupt, so an EOI `wrmsr` (a trap and an exit for every
    interrupt) would end nothing."""
    if counted.ready["platform"] != "pvm":
        pytest.skip("not a PVM host")
    grew = kept_alive_requests(counted, 200)
    assert grew["requests"] == 200
    assert grew["irq_injections"] >= 100, "the guest was not woken by interrupts"
    doorbells = grew["insn_emulation"] - grew["halt_exits"]
    # With an EOI: 2.00 a request here (one interrupt a request, one doorbell).
    assert doorbells <= 1.1 * 200, f"{doorbells / 200:.2f} traps a request besides halts"
