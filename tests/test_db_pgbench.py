"""pgbench, PostgreSQL's own client, as an external reference for the tracer.

``scalebench dbtrace --workload pgbench`` against a real guest under libvirt
(one boot for the module): pgbench's transaction count, PostgreSQL's own
counters for the same window (pg_stat_bgwriter + pg_stat_database on the
guest's PostgreSQL 15, pg_stat_io from 16) and the trace's sectors must agree,
within the gaps the trace is expected to show:

- writes: the trace sees every data block PostgreSQL wrote (the window closes
  with a checkpoint and the guest's ``sync``, so the kernel's delayed write-back
  falls inside it), plus the WAL, whose partial last page is rewritten at every
  commit, plus ext4's journal and metadata: at least PostgreSQL's figure, at
  most a few times it;
- reads: PostgreSQL counts blocks it asked the kernel for; the guest's page
  cache serves many of them (the pgbench database is smaller than the guest's
  memory), so the trace reads at most that much (plus readahead), usually less.

Needs root, libvirtd, QEMU (TCG where KVM cannot run the guest) and pgbench;
it skips only without root, like test_db_guest.py, and fails when a tool
``make deps`` installs is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.db import cli
from scalebench.db.pgbench import parse

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (libvirtd, debootstrap, chroot)"
)

CLIENTS = 2
DURATION_S = 30

# pgbench 15's closing report, as printed by the host's pgbench in this test's run.
REPORT = """\
pgbench (15.18 (Debian 15.18-0+deb12u1))
transaction type: <builtin: TPC-B (sort of)>
scaling factor: 1
query mode: prepared
number of clients: 2
number of threads: 2
maximum number of tries: 1
duration: 30 s
number of transactions actually processed: 1234
number of failed transactions: 0 (0.000%)
latency average = 48.625 ms
initial connection time = 35.950 ms
tps = 41.130112 (without initial connection time)
"""


def test_pgbench_report_is_parsed() -> None:
    result = parse(REPORT)
    assert (result.transactions, result.failed, result.duration_s) == (1234, 0, 30.0)
    assert result.latency_ms == pytest.approx(48.625) and result.tps == pytest.approx(41.130112)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One traced pgbench run through the command line (a fixed 10 s warm-up to keep CI short)."""
    for tool in ("libvirtd", "qemu-system-x86_64", "pgbench"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not installed: run `make deps` first")
    out = tmp_path_factory.mktemp("pgbench")
    code = cli.main(
        [
            "dbtrace",
            "--workload",
            "pgbench",
            "--clients",
            str(CLIENTS),
            "--duration",
            str(DURATION_S),
            "--warmup",
            "10",
            "--disk",
            "ssd",
            "--json",
            str(out / "result.json"),
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return json.loads((out / "result.json").read_text())


@needs_root
@pytest.mark.timeout(1500)
def test_pgbench_transactions_match_postgresql_commits(run: dict[str, Any]) -> None:
    tp, pg = run["throughput"], run["postgres"]["pg"]
    assert run["options"]["workload"] == "pgbench" and run["options"]["mix"] == "tpcb-like"
    assert tp["completed"] > 0 and tp["errors"] == 0
    # Every transaction pgbench counted committed in the pgbench database; beyond them, only
    # pgbench's own set-up queries (one per client at most) and the window's CHECKPOINT.
    assert tp["completed"] <= pg["commits"] <= tp["completed"] + CLIENTS + 2


@needs_root
@pytest.mark.timeout(1500)
def test_trace_sectors_agree_with_postgresql_io_counters(run: dict[str, Any]) -> None:
    agreement, pg, m = run["postgres"], run["postgres"]["pg"], run["metrics"]
    assert pg["source"] in ("pg_stat_database + pg_stat_bgwriter", "pg_stat_io")
    assert pg["checkpoints"] >= 1  # the window's closing checkpoint
    assert pg["write_sectors"] > 0 and pg["wal_sectors"] > 0
    assert m["sectors_written"] == agreement["trace_write_sectors"]
    # Writes: everything PostgreSQL wrote (data and WAL) reached the traced disk, and the
    # surplus (WAL page rewrites, the file system's journal) stays within 3x.
    assert 1.0 <= agreement["write_ratio"] <= 3.0, agreement
    # Reads: no more than PostgreSQL asked the kernel for, give or take readahead.
    assert m["sectors_read"] <= 2 * pg["read_sectors"] + 2048, agreement
    print(
        f"\npgbench cross-check: {tp_line(run)}; trace/PostgreSQL written sectors "
        f"{agreement['write_ratio']:.2f}, read sectors {agreement['read_ratio']}"
    )


def tp_line(run: dict[str, Any]) -> str:
    tp = run["throughput"]
    return f"{tp['completed']} transactions in {tp['duration_s']:.0f} s"
