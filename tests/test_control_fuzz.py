"""The control API under a hostile client population keeps answering a
well-behaved client, and its memory stays bounded. The 10-minute version
with RSS figures is experiments/bench/control_fuzz.py."""

from __future__ import annotations

import pytest
from support.control_fuzz import PipeliningFlood, fuzz, good_request
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
    """A client that streams requests faster than they are answered is served
    a bounded number per turn and then waits behind the others: every other
    client is still answered, and SIGTERM still ends the monitor."""
    m = start(tmp_path, 4, "127.226.0.0")
    try:
        with PipeliningFlood(m.api) as flood:
            answered = sum(good_request(m.api) for _ in range(10))
            assert answered == 10, (
                f"{10 - answered} of 10 requests beside the flood went unanswered"
            )
            assert flood.replies > 0, "the flooding client itself was never answered"
            assert m.stop(timeout=10) == 0, "SIGTERM during the flood"
    finally:
        m.stop(timeout=10)
