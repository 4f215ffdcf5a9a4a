"""Closed-loop database clients on the host, and their user-level results.

A workload is a set of named interactions (each a function running SQL on a
pg8000 connection inside one transaction), mixes of weights over them, and a
per-client session state. N client threads each hold one connection to the
guest, pick interactions by the mix's weights, run them back to back (no
think time: the study's heavy-load set-up) and record response times.
"""

from __future__ import annotations

import contextlib
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import DbTraceError
from .sql import connect

Interaction = Callable[[Any, random.Random, dict[str, Any]], None]


class ExpectedRollback(Exception):
    """An interaction that ends in a rollback by design; it counts as completed."""


class Workload(Protocol):
    """What tpcc.py, tpcw.py and rubis.py provide."""

    name: str
    database: str
    mixes: dict[str, dict[str, float]]
    interactions: dict[str, Interaction]
    per_minute_label: str

    def session(self, conn: Any, client: int, rng: random.Random) -> dict[str, Any]:
        """Per-client state (reads the database's scale table)."""
        ...


def scale_of(conn: Any) -> dict[str, int]:
    """The build-time cardinalities stored in the database's ``scale`` table."""
    return {str(name): int(value) for name, value in conn.run("SELECT name, value FROM scale")}


@dataclass
class InteractionStats:
    """Completed interactions of one kind and their response times (ms)."""

    count: int = 0
    errors: int = 0
    mean_ms: float = 0.0
    p50_ms: float = 0.0
    p90_ms: float = 0.0
    p99_ms: float = 0.0


@dataclass
class WorkloadResult:
    """User-level outcome of one run."""

    workload: str
    mix: str
    clients: int
    duration_s: float
    completed: int
    errors: int
    per_minute: float
    per_second: float
    per_minute_label: str
    response_ms: InteractionStats
    by_interaction: dict[str, InteractionStats] = field(default_factory=dict)


def _stats(samples: list[float], errors: int) -> InteractionStats:
    if not samples:
        return InteractionStats(errors=errors)
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return InteractionStats(
        len(samples), errors, statistics.fmean(samples), pick(0.5), pick(0.9), pick(0.99)
    )


def choose(mix: dict[str, float], rng: random.Random) -> str:
    """An interaction name drawn with the mix's weights."""
    names = list(mix)
    return rng.choices(names, weights=[mix[n] for n in names])[0]


@dataclass
class _Client:
    samples: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)
    failure: str | None = None


def run_workload(
    workload: Workload,
    mix_name: str,
    port: int,
    clients: int,
    duration_s: float,
    seed: int = 1,
    check: Callable[[], None] | None = None,
    on_start: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
    progress: Callable[[int], bool] | None = None,
) -> WorkloadResult:
    """Run ``clients`` closed-loop clients for ``duration_s`` seconds against 127.0.0.1:``port``.

    ``check`` is called about once a second from the driving thread (it raises
    when the guest or the tracer has died); ``on_start`` when the measured
    interval begins (all clients connected and set up); setting ``stop`` ends
    the run early (``duration_s`` may then be infinite). ``progress`` is called
    about once a second from the driving thread with the interactions completed
    so far; when it returns True, the run ends there.
    """
    stop = stop or threading.Event()
    if mix_name not in workload.mixes:
        raise DbTraceError(
            f"{workload.name} has no mix {mix_name!r} (choose from {', '.join(workload.mixes)})"
        )
    mix = workload.mixes[mix_name]
    conns = []
    try:
        for _ in range(clients):
            conns.append(connect(port, workload.database, timeout=300))
    except Exception as err:
        for conn in conns:
            conn.close()
        raise DbTraceError(f"cannot connect to the guest's database: {err}") from err
    results = [_Client() for _ in range(clients)]
    stop_at = [0.0]
    start_barrier = threading.Barrier(clients + 1)

    def client(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        conn, out = conns[index], results[index]
        try:
            state = workload.session(conn, index, rng)
        except Exception as err:  # noqa: BLE001 - the client's failure is its result
            out.failure = f"session set-up failed: {err}"
            start_barrier.abort()
            return
        try:
            start_barrier.wait()
        except threading.BrokenBarrierError:
            return
        while time.monotonic() < stop_at[0] and not stop.is_set():
            name = choose(mix, rng)
            t0 = time.monotonic()
            try:
                conn.run("BEGIN")
                workload.interactions[name](conn, rng, state)
                conn.run("COMMIT")
            except ExpectedRollback:
                conn.run("ROLLBACK")
            except Exception as err:  # noqa: BLE001 - a failed interaction is counted, not fatal
                out.errors[name] = out.errors.get(name, 0) + 1
                try:
                    conn.run("ROLLBACK")
                except Exception:  # noqa: BLE001 - a connection that cannot roll back is done
                    out.failure = f"{name}: {err}"
                    return
                continue
            if time.monotonic() <= stop_at[0] and not stop.is_set():
                out.samples.setdefault(name, []).append((time.monotonic() - t0) * 1000.0)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    stop_at[0] = float("inf")
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        start_barrier.wait(timeout=600)
    if on_start is not None:
        on_start()
    began = time.monotonic()
    stop_at[0] = began + duration_s
    try:
        while any(t.is_alive() for t in threads):
            if check is not None:
                check()
            if progress is not None and progress(
                sum(len(v) for r in results for v in list(r.samples.values()))
            ):
                stop_at[0] = min(stop_at[0], time.monotonic())
            for t in threads:
                t.join(timeout=1.0 / max(1, len(threads)))
    finally:
        ended = min(time.monotonic(), stop_at[0])
        stop_at[0] = 0.0
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.close()
    elapsed = max(ended - began, 1e-9)
    failures = [r.failure for r in results if r.failure]
    if failures and not any(r.samples for r in results):
        raise DbTraceError(f"the {workload.name} clients failed: {failures[0]}")
    by_name: dict[str, list[float]] = {}
    errors: dict[str, int] = {}
    for r in results:
        for name, values in r.samples.items():
            by_name.setdefault(name, []).extend(values)
        for name, n in r.errors.items():
            errors[name] = errors.get(name, 0) + n
    everything = [v for values in by_name.values() for v in values]
    completed = len(everything)
    return WorkloadResult(
        workload=workload.name,
        mix=mix_name,
        clients=clients,
        duration_s=elapsed,
        completed=completed,
        errors=sum(errors.values()),
        per_minute=completed * 60.0 / elapsed,
        per_second=completed / elapsed,
        per_minute_label=workload.per_minute_label,
        response_ms=_stats(everything, sum(errors.values())),
        by_interaction={
            n: _stats(by_name.get(n, []), errors.get(n, 0))
            for n in sorted(set(by_name) | set(errors))
        },
    )
