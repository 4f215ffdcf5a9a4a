"""The touch phase: one request to every VM before the warm-up, in an order that
leaves the pager in its steady state.

A webguest materializes its working set only when it serves a request, so a VM
that was never asked is served from zero-filled pages, with no swap read. In a
disk-bound run with thousands of VMs most of the tail would still be untouched
after the warm-up, and those cheap first misses would inflate the measured
throughput above what Denali's booted guests (whose memory was all in use)
could do. One request per VM brings every VM to its steady state: its working
set exists, in memory or in swap.

The order matters too: out of core on a modeled disk the pager replaces a few
VMs a second, so reaching the steady state from an arbitrary set of resident
VMs takes many minutes of warm-up (from the k most popular VMs, it still took
more than two minutes and measured 2.3x the steady-state throughput at 4,000
VMs). The pager keeps recently used VMs, like LRU, and an LRU cache holds the
k VMs requested most recently. So the touch follows a simulated Zipf(alpha)
request stream (zipfperf gives rank r to VM r): VMs in the order of their last
request in that stream, those never requested first. The VMs left resident are
then a sample of the LRU steady state the model assumes. The pager's clock
needs one more turn of its hand to reach its own steady state: the run's
settle phase that follows (runner.py).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .model import zipf_popularity

# Simulated requests per VM: enough that the order of the popular VMs' last
# requests is settled; the never-requested tail is touched first anyway.
STREAM_PER_VM = 20

REQUEST = b"GET / HTTP/1.1\r\nHost: touch\r\nConnection: close\r\n\r\n"


def touch_one(addr: str, port: int, timeout_s: float) -> bool:
    """One request; True when a complete 200 reply came back (Content-Length bytes of body)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s) as s:
            s.sendall(REQUEST)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = s.recv(65536)
                if not chunk:
                    return False
                data += chunk
            head, body = data.split(b"\r\n\r\n", 1)
            length = next(
                (
                    int(line.split(b":", 1)[1])
                    for line in head.split(b"\r\n")[1:]
                    if line.lower().startswith(b"content-length:")
                ),
                0,
            )
            while len(body) < length:
                chunk = s.recv(65536)
                if not chunk:
                    return False
                body += chunk
    except (OSError, ValueError):
        return False
    return head.startswith((b"HTTP/1.0 200", b"HTTP/1.1 200"))


def lru_order(vms: int, alpha: float, seed: int) -> list[int]:
    """Every VM once: unrequested ones (least popular first), then by last request in a Zipf
    stream."""
    rng = np.random.default_rng(seed)
    stream = rng.choice(vms, size=STREAM_PER_VM * vms, p=zipf_popularity(vms, alpha))
    last = np.full(vms, -1)
    last[stream] = np.arange(stream.size)  # numpy keeps the last write of repeated indices
    never = [int(i) for i in np.flatnonzero(last < 0)[::-1]]
    seen = np.flatnonzero(last >= 0)
    return never + [int(i) for i in seen[np.argsort(last[seen])]]


def touch_all(
    addr_base: str,
    port: int,
    order: Sequence[int],
    parallel: int,
    timeout_s: float,
    progress: Callable[[int], None] = lambda done: None,
) -> list[int]:
    """Request each VM of `order` once, `parallel` at a time; returns the VMs that did not
    answer."""
    base = ipaddress.IPv4Address(addr_base)
    failed: list[int] = []
    pool = ThreadPoolExecutor(max_workers=parallel)
    try:
        answers = pool.map(lambda i: touch_one(str(base + i), port, timeout_s), order)
        for done, (i, ok) in enumerate(zip(order, answers, strict=False), 1):
            if not ok:
                failed.append(i)
            progress(done)  # may raise (densevm died, Ctrl-C): then drop what is still queued
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    return sorted(failed)
