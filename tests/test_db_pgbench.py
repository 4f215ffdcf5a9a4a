"""pgbench, PostgreSQL's own client, as an external reference for the tracer.

``scalebench dbtrace --workload pgbench`` against a real guest under libvirt
(one boot for the module): pgbench's transaction count, PostgreSQL's own
counters for the same window (pg_stat_bgwriter + pg_stat_database on the
guest's PostgreSQL 15, pg_stat_io from 16) and the trace's sectors must agree,
within the gaps the trace is expected to show:

- writes: the trace sees every data block PostgreSQL wrote (the window starts
  after the guest's ``sync`` and closes with a checkpoint and ``sync``, so the
  kernel's delayed write-back falls inside it) and the WAL, whose partly filled
  last page is rewritten at every commit;
- reads: PostgreSQL counts the blocks it asked the kernel for; the guest's page
  cache serves some of them (the pgbench database, ~150 MiB at scale 10, is
  larger than the 128 MiB guest but not than its memory and disk together),
  and readahead reads more than was asked for.

The run leaves the guest's page cache unheld (``--db-cache 0``), as when these
bands were set: the 12 MiB hold that dbtrace applies by default reclaims
readahead before PostgreSQL uses it, and the re-reads put the read ratio at
1.73 and 2.13 in two runs (2.13 in CI, beside the other tests), where unheld
it read 1.37 and 1.44. The hold has its own test (test_db_guest.py).

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
from scalebench.db.pgstat import IoAgreement, PgCounters, PgWindow

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root (libvirtd, debootstrap, chroot)"
)

CLIENTS = 2
DURATION_S = 30
# A pgbench database of ~150 MiB in a 128 MiB guest: most of PostgreSQL's reads miss the guest's
# page cache and reach the traced disk, so the read figures can be compared too.
SCALE = 10
MEMORY_MIB = 128

# pgbench 15's closing report (its format; the figures are made up).
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


def test_counters_become_sectors_with_one_wal_page_rewritten_per_write() -> None:
    a = PgCounters(150000, 8192, 3, 1000, 2000, 16 * 2**20, 10, 10, 500, "pg_stat_bgwriter")
    b = PgCounters(150000, 8192, 4, 1100, 2300, 16 * 2**20 + 51200, 110, 110, 600, a.source)
    w = PgWindow.between(a, b)
    assert (w.checkpoints, w.commits, w.read_sectors, w.write_sectors) == (1, 100, 1600, 4800)
    assert (w.wal_sectors, w.wal_writes, w.wal_disk_sectors) == (100, 100, 100 * 16 + 100)
    # 1000 sectors read in all, 800 of them in PostgreSQL's relation files: those are compared.
    agreement = IoAgreement.of(1000, 800, 6500, w)
    assert agreement.read_ratio == 0.5 and agreement.write_ratio == 1.0


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, libvirt_conn: object) -> dict[str, Any]:
    """One traced pgbench run through the command line (a fixed 10 s warm-up keeps CI short; the
    cross-check needs no steady state). It finds the session's libvirtd (conftest.libvirt_conn)
    running."""
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
            "--scale",
            str(SCALE),
            "--memory",
            str(MEMORY_MIB),
            "--disk",
            "flash8",
            "--db-cache",
            "0",
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
    # Every transaction pgbench counted committed in the pgbench database. Beyond them (7 of
    # 3,198 here): pgbench's start-up queries, and transactions that committed but that pgbench
    # no longer counted when -T ran out.
    extra = pg["commits"] - tp["completed"]
    assert 0 <= extra <= max(10, 0.01 * tp["completed"]), (tp["completed"], pg["commits"])


@needs_root
@pytest.mark.timeout(1500)
def test_trace_sectors_agree_with_postgresql_io_counters(run: dict[str, Any]) -> None:
    agreement, pg, m = run["postgres"], run["postgres"]["pg"], run["metrics"]
    assert pg["source"] in ("pg_stat_database + pg_stat_bgwriter", "pg_stat_io")
    assert pg["checkpoints"] >= 1  # the window's closing checkpoint
    assert pg["write_sectors"] > 0 and pg["wal_sectors"] > 0
    assert m["sectors_written"] == agreement["trace_write_sectors"]
    # Writes: the data blocks PostgreSQL wrote plus its WAL writes (each rewrites the partly
    # filled page: one 8 KiB page per commit here) against the trace's written sectors: 0.96
    # and 0.985 in the runs that set this band (the WAL estimate counts a page twice when a
    # write ends on a page boundary; ext4's journal adds little: WAL files are preallocated).
    assert 0.85 <= agreement["write_ratio"] <= 1.15, agreement
    # Reads of PostgreSQL's relation files (the trace's reads elsewhere, program text faulted
    # back in at the window's close above all, are no PostgreSQL counter's: relfiles): the
    # guest's page cache serves some of PostgreSQL's reads (fewer sectors in the trace), the
    # kernel's readahead fetches more than the 8 KiB asked for (more). The band was set on all
    # reads (1.37 then), which read 1.44 and 2.01 since: 13-15 MiB of other reads each time
    # over 12-36 MiB of PostgreSQL's. Its files' reads alone: 0.97.
    relation = agreement["trace_relation_read_sectors"]
    assert 0 < relation <= agreement["trace_read_sectors"], agreement
    assert 0.3 <= agreement["read_ratio"] <= 2.0, agreement
