"""The control API under a hostile client population keeps answering a
well-behaved client, and its memory stays bounded. The 10-minute version
with RSS figures is experiments/bench/control_fuzz.py."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from support.control_fuzz import fuzz, good_request
from support.densevm import kvm_available, start

pytestmark = pytest.mark.skipif(
    not kvm_available(), reason="/dev/kvm is absent or not accessible on this host"
)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_the_control_api_survives_a_fuzzing_client_population(tmp_path):
    m = start(tmp_path, 4, "127.220.0.0")
    try:
        fuzz(m.api, seconds=10, seed=7)  # warm-up: the allocator's high-water marks
        before = rss_kib(m.proc.pid)
        result = fuzz(m.api, seconds=10, seed=8)
        after = rss_kib(m.proc.pid)
        assert result.good_failures <= result.good_requests // 20, result
        assert m.proc.poll() is None, "the monitor died"
        # Bounded, not flat: a never-reading client may hold up to 64 MiB of replies.
        assert after < before * 1.5 + 16384, f"RSS grew from {before} to {after} KiB"
        assert m.control({"cmd": "stats"})["ok"]
    finally:
        assert m.stop() == 0


def test_a_pipelining_client_cannot_starve_the_others(tmp_path):
    """A client that streams requests faster than they are answered (and reads
    its replies, so it is not cut off as a non-reader) is served a bounded
    number per turn: other clients are still answered, and SIGTERM still ends
    the monitor."""
    m = start(tmp_path, 4, "127.226.0.0")
    flood = socket.socket(socket.AF_UNIX)
    flood.connect(str(m.api))
    stop = threading.Event()
    replies = [0]

    def write() -> None:
        burst = b'{"cmd":"list"}\n' * 4096
        while not stop.is_set():
            try:
                flood.sendall(burst)
            except OSError:
                return

    def read() -> None:
        while not stop.is_set():
            try:
                chunk = flood.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            replies[0] += chunk.count(b"\n")

    threads = [threading.Thread(target=write), threading.Thread(target=read)]
    try:
        for t in threads:
            t.start()
        time.sleep(1)  # the flood is under way
        answered = sum(good_request(m.api) for _ in range(10))
        assert answered == 10, f"{10 - answered} of 10 requests beside the flood went unanswered"
        assert replies[0] > 0, "the flooding client itself was never answered"
    finally:
        stop.set()
        flood.shutdown(socket.SHUT_RDWR)
        flood.close()
        for t in threads:
            t.join()
        assert m.stop(timeout=10) == 0
