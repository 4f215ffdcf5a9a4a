"""A hostile control-API client population: random bytes, huge lines, floods
of short lines, slow readers and many clients at once, against a live densevm.

Used by tests/test_control_fuzz.py (seconds) and
experiments/bench/control_fuzz.py (minutes, with RSS figures)."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class FuzzResult:
    """What a fuzz run did, and what the monitor's good client saw meanwhile."""

    rounds: int
    attacks: int
    good_requests: int
    good_failures: int


def _open(api: Path) -> socket.socket | None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(2)
    try:
        s.connect(str(api))
    except OSError:
        s.close()
        return None
    return s


def _attack(api: Path, rng: random.Random) -> None:
    s = _open(api)
    if s is None:
        return
    try:
        kind = rng.randrange(5)
        if kind == 0:
            s.sendall(rng.randbytes(rng.randrange(1, 4096)))
        elif kind == 1:
            s.sendall(b"x" * (256 << 10))  # a line past the 64 KiB limit
        elif kind == 2:
            s.sendall(b'{"cmd":"list"}\n' * rng.randrange(1, 5000))  # never read
        elif kind == 3:
            request = {"cmd": rng.choice(["stats", "list", "create", "destroy", "crash", "x"])}
            request[rng.choice(["vm", "count", "how", "vms"])] = rng.choice(
                [-1, 0, 2**63, "a", None, [], 10**9]
            )
            s.sendall(json.dumps(request).encode() + b"\n")
            s.recv(1 << 16)
        else:
            s.sendall(b'{"cmd":"stats"}\n')  # a slow reader: one byte, then gone
            s.recv(1)
    except OSError:
        pass
    finally:
        s.close()


def good_request(api: Path) -> bool:
    """One `list` request from a well-behaved client: True when it is answered with ok."""
    s = _open(api)
    if s is None:
        return False
    try:
        s.settimeout(10)
        s.sendall(b'{"cmd":"list"}\n')
        return bool(json.loads(s.makefile("rb").readline()).get("ok"))
    except (OSError, ValueError):
        return False
    finally:
        s.close()


def hold_many_clients(api: Path, count: int) -> list[socket.socket]:
    """Opens up to `count` idle clients (the monitor turns away those past its limit)."""
    held = []
    for _ in range(count):
        s = _open(api)
        if s is not None:
            held.append(s)
    # The monitor has seen every connection once the last one is answered or
    # refused: which ones it holds no longer depends on when the caller
    # closes some of them.
    if held:
        try:
            held[-1].sendall(b'{"cmd":"list"}\n')
            held[-1].recv(1 << 16)
        except OSError:
            pass
    return held


def fuzz(api: Path, seconds: float, seed: int = 1, idle_clients: int = 1000) -> FuzzResult:
    """Attacks the control API for `seconds`, checking after each round that a
    well-behaved client is still answered."""
    rng = random.Random(seed)
    held = hold_many_clients(api, idle_clients)
    for s in held[: len(held) // 2]:
        s.close()
    result = FuzzResult(0, 0, 0, 0)
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            for _ in range(20):
                _attack(api, rng)
                result.attacks += 1
            result.rounds += 1
            result.good_requests += 1
            if not good_request(api):
                result.good_failures += 1
    finally:
        for s in held:
            s.close()
    return result


class PipeliningFlood:
    """A client that streams `list` requests faster than they are answered,
    and reads its replies (so it is not cut off as a non-reader), for as long
    as the `with` block lasts."""

    def __init__(self, api: Path) -> None:
        self.replies = 0
        self._stop = threading.Event()
        self._socket = socket.socket(socket.AF_UNIX)
        self._socket.connect(str(api))
        self._threads = [
            threading.Thread(target=self._write),
            threading.Thread(target=self._read),
        ]

    def _write(self) -> None:
        burst = b'{"cmd":"list"}\n' * 4096
        while not self._stop.is_set():
            try:
                self._socket.sendall(burst)
            except OSError:
                return

    def _read(self) -> None:
        while not self._stop.is_set():
            try:
                chunk = self._socket.recv(1 << 20)
            except OSError:
                return
            if not chunk:
                return
            self.replies += chunk.count(b"\n")

    def __enter__(self) -> PipeliningFlood:
        for t in self._threads:
            t.start()
        time.sleep(1)  # the flood is under way
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._socket.shutdown(socket.SHUT_RDWR)
        self._socket.close()
        for t in self._threads:
            t.join()
