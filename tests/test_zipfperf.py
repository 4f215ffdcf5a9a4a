"""zipfperf, the real binary, against a real nginx on loopback.

Covers the httperf-compatible text output, the JSON document (INTERFACES.md),
Zipf popularity over targets, error accounting (refused, reset, garbage,
short and silent servers), --wlog, bad flags, and --duration bounding a run.
Every run is bounded in connections and time. Speed targets live in
experiments/bench/zipfperf_vs_httperf.py, not here.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import release_binary, require_tool
from scalebench.nginx import LARGE_BYTES, SMALL_BYTES, NginxServer

TARGETS = 8  # nginx also listens on 127.1.0.0 .. 127.1.0.7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def zipfperf() -> Path:
    return release_binary("zipfperf")


@pytest.fixture(scope="module")
def nginx():
    # A port free right now, so that concurrent runs of this file do not collide.
    with NginxServer(free_port(), extra_targets=TARGETS, nginx=require_tool("nginx")) as server:
        yield server


def run(
    binary: Path, *args: str, timeout: float = 60
) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    return proc, time.monotonic() - t0


def run_json(binary: Path, *args: str, timeout: float = 60) -> tuple[dict, float]:
    proc, elapsed = run(binary, *args, "--json", "-", timeout=timeout)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), elapsed


# Each httperf line zipfperf must print, as a regex capturing its numbers.
NUM = r"(-?[0-9.]+)"
HTTPERF_LINES = {
    "total": rf"^Total: connections {NUM} requests {NUM} replies {NUM} test-duration {NUM} s$",
    "conn_rate": (
        rf"^Connection rate: {NUM} conn/s \({NUM} ms/conn, <={NUM} "
        rf"concurrent connections\)$"
    ),
    "conn_time": (
        rf"^Connection time \[ms\]: min {NUM} avg {NUM} max {NUM} "
        rf"median {NUM} stddev {NUM}$"
    ),
    "conn_connect": rf"^Connection time \[ms\]: connect {NUM}$",
    "conn_length": rf"^Connection length \[replies/conn\]: {NUM}$",
    "req_rate": rf"^Request rate: {NUM} req/s \({NUM} ms/req\)$",
    "req_size": rf"^Request size \[B\]: {NUM}$",
    "reply_rate": (
        rf"^Reply rate \[replies/s\]: min {NUM} avg {NUM} max {NUM} "
        rf"stddev {NUM} \({NUM} samples\)$"
    ),
    "reply_time": rf"^Reply time \[ms\]: response {NUM} transfer {NUM}$",
    "reply_size": rf"^Reply size \[B\]: header {NUM} content {NUM} footer {NUM} \(total {NUM}\)$",
    "reply_status": rf"^Reply status: 1xx={NUM} 2xx={NUM} 3xx={NUM} 4xx={NUM} 5xx={NUM}$",
    "cpu": rf"^CPU time \[s\]: user {NUM} system {NUM} \(user {NUM}% system {NUM}% total {NUM}%\)$",
    "net": rf"^Net I/O: {NUM} KB/s \({NUM}\*10\^6 bps\)$",
    "errors1": (
        rf"^Errors: total {NUM} client-timo {NUM} socket-timo {NUM} "
        rf"connrefused {NUM} connreset {NUM}$"
    ),
    "errors2": rf"^Errors: fd-unavail {NUM} addrunavail {NUM} ftab-full {NUM} other {NUM}$",
}


def parse_httperf(text: str) -> dict[str, list[float]]:
    """Parse the way httperf-reading scripts do: one regex per line."""
    found: dict[str, list[float]] = {}
    for line in text.splitlines():
        for key, rx in HTTPERF_LINES.items():
            m = re.match(rx, line)
            if m and key not in found:
                found[key] = [float(x) for x in m.groups()]
                break
    missing = set(HTTPERF_LINES) - set(found)
    assert not missing, f"lines missing or malformed: {sorted(missing)}\n{text}"
    return found


def errors_of(doc: dict) -> dict:
    return doc["errors"]


def test_text_output_parses_like_httperf(zipfperf, nginx):
    proc, _ = run(
        zipfperf,
        "--server",
        "127.0.0.1",
        f"--port={nginx.port}",
        "--uri",
        "/",
        "--rate",
        "400",
        "--num-conns",
        "400",
        "--num-calls",
        "1",
        "--timeout",
        "5",
        "--hog",
    )
    assert proc.returncode == 0, proc.stderr
    f = parse_httperf(proc.stdout)
    conns, reqs, replies, duration = f["total"]
    assert (conns, reqs, replies) == (400, 400, 400)
    assert 0.9 < duration < 3
    assert f["reply_status"] == [0, 400, 0, 0, 0]
    assert f["reply_size"][1] == SMALL_BYTES
    assert f["conn_length"] == [1.0]
    assert f["errors1"][0] == 0 and sum(f["errors2"]) == 0
    assert proc.stdout.splitlines()[0].startswith("zipfperf ")


def test_json_document_has_the_pinned_schema(zipfperf, nginx, tmp_path):
    out = tmp_path / "run.json"
    proc, _ = run(
        zipfperf,
        "--server",
        "127.0.0.1",
        f"--port={nginx.port}",
        "--rate",
        "200",
        "--num-conns",
        "100",
        "--num-calls",
        "2",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    parse_httperf(proc.stdout)  # the text report still goes to stdout
    doc = json.loads(out.read_text())
    assert doc["schema"] == "zipfperf/1"
    for key in [
        "server",
        "port",
        "uri",
        "rate",
        "num_conns",
        "num_calls",
        "timeout",
        "think_timeout",
        "wlog",
        "hog",
        "targets",
        "addr_base",
        "alpha",
        "seed",
        "concurrency",
        "duration",
        "json",
    ]:
        assert key in doc["config"], key
    assert isinstance(doc["duration_s"], float)
    assert set(doc["connections"]) >= {"total", "rate"}
    assert set(doc["requests"]) >= {"total", "rate"}
    assert set(doc["replies"]) >= {"total", "rate", "rate_samples", "status"}
    assert set(doc["replies"]["rate_samples"]) >= {"min", "avg", "max", "stddev", "n"}
    assert set(doc["replies"]["status"]) == {"1xx", "2xx", "3xx", "4xx", "5xx"}
    assert set(doc["latency_ms"]) >= {"mean", "p50", "p90", "p99", "p999", "max"}
    assert set(doc["errors"]) >= {
        "total",
        "client_timo",
        "socket_timo",
        "connrefused",
        "connreset",
        "fd_unavail",
        "addrunavail",
        "ftab_full",
        "other",
    }
    assert set(doc["bytes"]) >= {"sent", "received"}
    assert doc["connections"]["total"] == 100
    assert doc["requests"]["total"] == doc["replies"]["total"] == 200
    assert doc["replies"]["status"]["2xx"] == 200
    assert doc["per_target"] == [200]
    lat = doc["latency_ms"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["p999"] <= lat["max"]


def zipf_pmf(n: int, alpha: float) -> list[float]:
    w = [1.0 / (k**alpha) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def assert_follows(counts: list[int], pmf: list[float]) -> None:
    """Each count within 4.5 binomial standard deviations of its expectation."""
    n = sum(counts)
    for i, (c, p) in enumerate(zip(counts, pmf, strict=False)):
        sd = (n * p * (1 - p)) ** 0.5
        assert abs(c - n * p) <= 4.5 * sd + 1, f"target {i}: {c} vs expected {n * p:.0f} ({counts})"


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_per_target_counts_follow_zipf(zipfperf, nginx, alpha):
    doc, _ = run_json(
        zipfperf,
        f"--targets={TARGETS}",
        "--addr-base=127.1.0.0",
        f"--port={nginx.port}",
        f"--alpha={alpha}",
        "--rate=2000",
        "--num-conns=4000",
        "--timeout=5",
    )
    assert errors_of(doc)["total"] == 0
    assert sum(doc["per_target"]) == doc["replies"]["total"] == 4000
    assert len(doc["per_target"]) == TARGETS
    assert_follows(doc["per_target"], zipf_pmf(TARGETS, alpha))


def test_permuted_mapping_is_seeded(zipfperf, nginx):
    args = [
        f"--targets={TARGETS}",
        f"--port={nginx.port}",
        "--alpha=1.5",
        "--mapping=permute",
        "--rate=2000",
        "--num-conns=3000",
    ]
    a, _ = run_json(zipfperf, *args, "--seed=11")
    b, _ = run_json(zipfperf, *args, "--seed=11")
    order = sorted(range(TARGETS), key=lambda i: -a["per_target"][i])
    assert order[:2] == sorted(range(TARGETS), key=lambda i: -b["per_target"][i])[:2]
    assert_follows(sorted(a["per_target"], reverse=True), zipf_pmf(TARGETS, 1.5))
    assert order != list(range(TARGETS))


def test_status_classes_keep_alive_and_large_object(zipfperf, nginx):
    doc, _ = run_json(
        zipfperf,
        "--server=127.0.0.1",
        f"--port={nginx.port}",
        "--uri=/nope",
        "--rate=500",
        "--num-conns=50",
    )
    assert doc["replies"]["status"]["4xx"] == 50 and errors_of(doc)["total"] == 0
    doc, _ = run_json(
        zipfperf,
        "--server=127.0.0.1",
        f"--port={nginx.port}",
        "--uri=/large",
        "--rate=200",
        "--num-conns=40",
        "--num-calls=3",
    )
    assert doc["replies"]["total"] == 120 and doc["connections"]["total"] == 40
    assert doc["replies"]["size_avg"]["content"] == LARGE_BYTES
    assert errors_of(doc)["total"] == 0


def test_wlog_sequence_and_uri_zipf(zipfperf, nginx, tmp_path):
    wlog = tmp_path / "uris"
    wlog.write_bytes(b"/\0/large\0/nope\0")
    doc, _ = run_json(
        zipfperf,
        "--server=127.0.0.1",
        f"--port={nginx.port}",
        f"--wlog=n,{wlog}",
        "--rate=100",
        "--num-conns=10",
    )
    assert doc["replies"]["total"] == 3, "a non-wrapping list stops the run at its end"
    assert doc["per_uri"] == [1, 1, 1]
    assert doc["replies"]["status"]["4xx"] == 1
    doc, _ = run_json(
        zipfperf,
        "--server=127.0.0.1",
        f"--port={nginx.port}",
        f"--wlog=y,{wlog}",
        "--uri-zipf=1.0",
        "--rate=1000",
        "--num-conns=1500",
    )
    assert_follows(doc["per_uri"], zipf_pmf(3, 1.0))


def test_closed_loop_keep_alive(zipfperf, nginx):
    doc, elapsed = run_json(
        zipfperf, "--server=127.0.0.1", f"--port={nginx.port}", "--concurrency=8", "--duration=1.5"
    )
    assert doc["mode"] == "closed"
    assert doc["connections"]["total"] == 8, "keep-alive: no reconnects"
    assert doc["replies"]["total"] > 1000
    assert errors_of(doc)["total"] == 0
    assert 1.4 < doc["duration_s"] < 2.0 and elapsed < 4


def test_closed_loop_one_call_per_connection_draws_targets_per_request(zipfperf, nginx):
    # How the controller drives it: each request on its own connection to a Zipf-drawn target.
    doc, elapsed = run_json(
        zipfperf,
        f"--targets={TARGETS}",
        f"--port={nginx.port}",
        "--alpha=1.0",
        "--concurrency=8",
        "--duration=2",
        "--num-calls=1",
    )
    replies = doc["replies"]["total"]
    assert replies > 500 and errors_of(doc)["total"] == 0
    assert replies <= doc["connections"]["total"] <= replies + 8
    assert_follows(doc["per_target"], zipf_pmf(TARGETS, 1.0))
    assert elapsed < 4


def test_duration_bounds_an_open_loop_run(zipfperf, nginx):
    proc, elapsed = run(
        zipfperf, "--server=127.0.0.1", f"--port={nginx.port}", "--rate=200", "--duration=2"
    )
    assert proc.returncode == 0, proc.stderr
    f = parse_httperf(proc.stdout)
    assert 1.9 < f["total"][3] < 2.3 and elapsed < 4
    assert 300 <= f["total"][2] <= 410


def test_sigint_ends_the_run_with_its_report(zipfperf, nginx, tmp_path):
    out = tmp_path / "run.json"
    proc = subprocess.Popen(
        [
            str(zipfperf),
            "--server=127.0.0.1",
            f"--port={nginx.port}",
            "--rate=200",
            "--duration=30",
            "--json",
            str(out),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0
    f = parse_httperf(stdout)
    assert 0.8 < f["total"][3] < 3 and f["total"][2] > 100
    assert json.loads(out.read_text())["ending"] == "interrupted"


def test_connection_refused_is_counted(zipfperf):
    port = free_port()  # nothing listens there
    doc, elapsed = run_json(
        zipfperf,
        "--server=127.0.0.1",
        f"--port={port}",
        "--rate=500",
        "--num-conns=200",
        "--timeout=2",
    )
    assert errors_of(doc)["connrefused"] == 200 and errors_of(doc)["total"] == 200
    assert doc["replies"]["total"] == 0
    assert elapsed < 3
    doc, elapsed = run_json(
        zipfperf, "--server=127.0.0.1", f"--port={port}", "--concurrency=4", "--duration=1"
    )
    assert errors_of(doc)["connrefused"] > 0 and elapsed < 3


class BadServer:
    """Test fixture for the error paths: a tiny misbehaving HTTP server.

    Modes: reset (RST after reading the request), garbage (non-HTTP bytes),
    short (Content-Length 1000 but 10 bytes, then close), silent (reads and
    never answers), noclose (a valid reply, then ignores `Connection: close`
    and keeps the connection open).
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> BadServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping = True
        self.sock.close()
        self.thread.join(timeout=5)
        for c in self.held:
            c.close()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(2)
            try:
                conn.recv(4096)
                if self.mode == "reset":
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif self.mode == "garbage":
                    conn.sendall(b"this is not http at all\r\n\r\n")
                elif self.mode == "short":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n0123456789")
                elif self.mode == "silent":
                    self.held.append(conn)
                    continue
                elif self.mode == "noclose":
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: keep-alive\r\n\r\nok"
                    )
                    self.held.append(conn)
                    continue
            except OSError:
                pass
            conn.close()


@pytest.mark.parametrize(
    "mode,counter",
    [
        ("reset", "connreset"),
        ("garbage", "other"),
        ("short", "connreset"),
        ("silent", "client_timo"),
    ],
)
def test_misbehaving_server_errors_are_counted(zipfperf, mode, counter):
    with BadServer(mode) as bad:
        doc, elapsed = run_json(
            zipfperf,
            "--server=127.0.0.1",
            f"--port={bad.port}",
            "--rate=50",
            "--num-conns=20",
            "--timeout=1",
        )
    errs = errors_of(doc)
    assert errs[counter] == 20 and errs["total"] == 20, errs
    assert doc["replies"]["total"] == 0
    # Last connection scheduled at 0.38 s, plus one timeout: the run ends by 1.38 s.
    assert doc["duration_s"] < 2.0 and elapsed < 3.5


def test_silent_server_closed_loop_ends_on_time(zipfperf):
    with BadServer("silent") as bad:
        doc, elapsed = run_json(
            zipfperf,
            "--server=127.0.0.1",
            f"--port={bad.port}",
            "--concurrency=4",
            "--duration=1.5",
            "--timeout=1",
        )
    assert errors_of(doc)["client_timo"] == 4
    assert doc["requests"]["abandoned"] == 4
    assert doc["duration_s"] < 2.0 and elapsed < 3.5


def test_server_that_never_closes_does_not_hold_up_the_run(zipfperf):
    with BadServer("noclose") as bad:
        doc, _elapsed = run_json(
            zipfperf,
            "--server=127.0.0.1",
            f"--port={bad.port}",
            "--rate=50",
            "--num-conns=20",
            "--timeout=5",
        )
        assert doc["replies"]["total"] == 20 and errors_of(doc)["total"] == 0
        assert doc["duration_s"] < 1.0, (
            "the run ends with the last reply, not after the close grace"
        )
        doc, _ = run_json(
            zipfperf,
            "--server=127.0.0.1",
            f"--port={bad.port}",
            "--concurrency=4",
            "--duration=1",
            "--num-calls=1",
            "--timeout=5",
        )
    assert doc["replies"]["total"] > 40, "draining connections do not hold closed-loop slots"
    assert errors_of(doc)["total"] == 0


@pytest.mark.parametrize(
    "args",
    [
        ["--rate=-5"],
        ["--num-calls=0"],
        ["--no-such-flag"],
        ["--concurrency=4"],
        ["--alpha=abc"],
        ["--targets=0"],
        ["--wlog=y,/nonexistent/file"],
        ["--timeout=0"],
        ["--uri-zipf=1.0"],
    ],
)
def test_bad_flags_give_one_line_and_exit_2(zipfperf, args):
    proc, _ = run(zipfperf, *args, timeout=10)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zipfperf: "), proc.stderr
    assert proc.stdout == ""
