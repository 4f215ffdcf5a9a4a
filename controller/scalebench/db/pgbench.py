"""PostgreSQL's own pgbench, run on the host against the guest's database.

The guest's PostgreSQL is reachable from the host through the domain's
127.0.0.1 port forward (the same path the workload clients use), so the host's
pgbench (Debian's postgresql-client, packages.apt) drives it; running the
guest's binary would put the client on the emulated CPU beside the server.

The ``pgbench`` database is created and loaded (``pgbench -i -s SCALE``) in the
guest on first use; ``--mix`` names one of pgbench's built-in scripts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import DbTraceError
from .sql import connect

DATABASE = "pgbench"
MIXES = ("tpcb-like", "simple-update", "select-only")
DEFAULT_MIX = "tpcb-like"
DEFAULT_SCALE = 1
PER_MINUTE_LABEL = "transactions/min"


@dataclass(frozen=True)
class PgbenchResult:
    """What pgbench printed at the end of a run."""

    transactions: int
    failed: int
    latency_ms: float
    tps: float
    duration_s: float


def _binary() -> str:
    path = shutil.which("pgbench")
    if path is None:
        raise DbTraceError("pgbench is not installed: run `make deps` (postgresql-client)")
    return path


def _base_args(port: int) -> list[str]:
    return [_binary(), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres"]


def _env() -> dict[str, str]:
    return dict(os.environ, PGCONNECT_TIMEOUT="60", PGAPPNAME="scalebench-pgbench")


def scale_of(port: int) -> int | None:
    """The loaded database's scale (branches), or None when there is none yet."""
    conn = connect(port, "postgres", timeout=120)
    try:
        if not conn.run("SELECT 1 FROM pg_database WHERE datname = :db", db=DATABASE):
            return None
    finally:
        conn.close()
    conn = connect(port, DATABASE, timeout=120)
    try:
        if not conn.run("SELECT 1 FROM pg_class WHERE relname = 'pgbench_branches'"):
            return None
        return int(conn.run("SELECT count(*) FROM pgbench_branches")[0][0])
    finally:
        conn.close()


def initialise(port: int, scale: int) -> None:
    """Create and load the ``pgbench`` database at ``scale`` (kept if it already is)."""
    if scale_of(port) == scale:
        return
    conn = connect(port, "postgres", timeout=120)
    try:
        if not conn.run("SELECT 1 FROM pg_database WHERE datname = :db", db=DATABASE):
            conn.run(f"CREATE DATABASE {DATABASE}")
    finally:
        conn.close()
    proc = subprocess.run(
        [*_base_args(port), "-i", "-q", "-s", str(scale), DATABASE],
        capture_output=True,
        text=True,
        env=_env(),
        check=False,
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise DbTraceError(f"pgbench -i failed: {lines[-1] if lines else proc.returncode}")


def command(port: int, mix: str, clients: int, duration_s: float) -> list[str]:
    """The pgbench command line for a timed run (prepared statements, no vacuum first)."""
    if mix not in MIXES:
        raise DbTraceError(f"pgbench has no mix {mix!r} (choose from {', '.join(MIXES)})")
    return [
        *_base_args(port),
        "-n",
        "-M",
        "prepared",
        "-b",
        mix,
        "-c",
        str(clients),
        "-j",
        str(min(clients, os.cpu_count() or 1)),
        "-T",
        str(max(1, round(duration_s))),
        DATABASE,
    ]


def _number(pattern: str, text: str) -> float | None:
    match = re.search(pattern, text, re.MULTILINE)
    return float(match.group(1)) if match else None


def parse(text: str) -> PgbenchResult:
    """pgbench's closing report (PostgreSQL 15's format)."""
    transactions = _number(r"^number of transactions actually processed: (\d+)", text)
    duration = _number(r"^duration: (\d+) s", text)
    if transactions is None or duration is None:
        raise DbTraceError(f"pgbench printed no result: {text.strip()[-200:]!r}")
    return PgbenchResult(
        transactions=int(transactions),
        failed=int(_number(r"^number of failed transactions: (\d+)", text) or 0),
        latency_ms=_number(r"^latency average = ([\d.]+) ms", text) or 0.0,
        tps=_number(r"^tps = ([\d.]+)", text) or 0.0,
        duration_s=duration,
    )


def run(
    port: int,
    mix: str,
    clients: int,
    duration_s: float,
    check: Callable[[], None] | None = None,
    progress: Callable[[], bool] | None = None,
) -> PgbenchResult | None:
    """Run pgbench for ``duration_s`` seconds; ``check`` and ``progress`` are called about once
    a second (``check`` raises when the guest has died; ``progress`` returning True ends the
    run early, and then there is no result: pgbench reports only runs that end by themselves).
    """
    proc = subprocess.Popen(
        command(port, mix, clients, duration_s),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            if check is not None:
                check()
            if progress is not None and progress():
                proc.terminate()
                proc.communicate(timeout=30)
                return None
        out, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        lines = err.strip().splitlines()
        raise DbTraceError(f"pgbench failed: {lines[-1] if lines else proc.returncode}")
    return parse(out)
