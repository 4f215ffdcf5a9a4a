"""PostgreSQL's own counters, read through the guest's SQL channel, and their window deltas.

Which views, by server version:

- checkpoints completed: ``pg_stat_checkpointer`` (num_timed + num_requested) from
  PostgreSQL 17, ``pg_stat_bgwriter`` (checkpoints_timed + checkpoints_req) before;
- relation blocks read and written: ``pg_stat_io`` (reads, writes of every backend
  type) from 16; before, reads are ``pg_stat_database.blks_read`` summed over the
  databases and writes ``pg_stat_bgwriter``'s buffers_checkpoint + buffers_clean +
  buffers_backend (the guest's PostgreSQL 15 takes this path);
- WAL: the insert position (``pg_current_wal_lsn()``) and ``pg_stat_wal``'s write
  and sync calls;
- transactions: ``pg_stat_database.xact_commit`` of one database.

Blocks are converted to 512-byte sectors with the server's ``block_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SECTOR = 512


@dataclass(frozen=True)
class PgCounters:
    """One reading of the counters (cumulative since the server started)."""

    version_num: int
    block_size: int
    checkpoints: int
    blocks_read: int
    blocks_written: int
    wal_bytes: int  # WAL insert position
    wal_writes: int
    wal_syncs: int
    commits: int  # xact_commit of the database asked for
    source: str  # which views the block counts come from


@dataclass(frozen=True)
class PgWindow:
    """What PostgreSQL reports for one window (differences of two readings), in sectors."""

    source: str
    checkpoints: int
    commits: int
    read_sectors: int
    write_sectors: int  # relation blocks written (data files), not WAL
    wal_sectors: int  # WAL generated (the insert position moved this far)
    wal_writes: int
    wal_syncs: int
    wal_disk_sectors: int  # WAL written to disk: see wal_on_disk()

    @classmethod
    def between(cls, a: PgCounters, b: PgCounters) -> PgWindow:
        per_block = a.block_size // SECTOR
        wal_sectors = (b.wal_bytes - a.wal_bytes) // SECTOR
        wal_writes = b.wal_writes - a.wal_writes
        return cls(
            source=a.source,
            checkpoints=b.checkpoints - a.checkpoints,
            commits=b.commits - a.commits,
            read_sectors=(b.blocks_read - a.blocks_read) * per_block,
            write_sectors=(b.blocks_written - a.blocks_written) * per_block,
            wal_sectors=wal_sectors,
            wal_writes=wal_writes,
            wal_syncs=b.wal_syncs - a.wal_syncs,
            wal_disk_sectors=wal_on_disk(wal_sectors, wal_writes, per_block),
        )


def wal_on_disk(generated_sectors: int, writes: int, per_block: int) -> int:
    """WAL sectors a server writes for ``generated_sectors`` of WAL in ``writes`` write calls.

    Each write starts at the page holding the last flushed position, so it rewrites that
    partly filled page (at every commit, with ``synchronous_commit``) and then covers the
    pages the new WAL spans: one page per write plus the WAL generated.
    """
    return writes * per_block + generated_sectors


def _one(conn: Any, sql: str, **params: Any) -> list[Any]:
    rows = conn.run(sql, **params)
    return list(rows[0])


def checkpoints(conn: Any, version_num: int) -> int:
    """Checkpoints completed since the server started (timed and requested)."""
    if version_num >= 170000:
        sql = "SELECT num_timed + num_requested FROM pg_stat_checkpointer"
    else:
        sql = "SELECT checkpoints_timed + checkpoints_req FROM pg_stat_bgwriter"
    return int(_one(conn, sql)[0])


def version_num(conn: Any) -> int:
    return int(_one(conn, "SELECT current_setting('server_version_num')::int")[0])


def read_counters(conn: Any, database: str) -> PgCounters:
    """Read every counter once (each query sees the server's current statistics)."""
    version, block_size = (
        int(x)
        for x in _one(
            conn,
            "SELECT current_setting('server_version_num')::int, current_setting('block_size')::int",
        )
    )
    if version >= 160000:
        blocks_read, blocks_written = (
            int(x)
            for x in _one(
                conn,
                "SELECT coalesce(sum(reads), 0), coalesce(sum(writes), 0) FROM pg_stat_io "
                "WHERE object IN ('relation', 'temp relation')",
            )
        )
        source = "pg_stat_io"
    else:
        blocks_read = int(_one(conn, "SELECT coalesce(sum(blks_read), 0) FROM pg_stat_database")[0])
        blocks_written = int(
            _one(
                conn,
                "SELECT buffers_checkpoint + buffers_clean + buffers_backend FROM pg_stat_bgwriter",
            )[0]
        )
        source = "pg_stat_database + pg_stat_bgwriter"
    wal_bytes = int(_one(conn, "SELECT pg_current_wal_lsn() - '0/0'::pg_lsn")[0])
    wal_writes, wal_syncs = (
        int(x) for x in _one(conn, "SELECT wal_write, wal_sync FROM pg_stat_wal")
    )
    rows = conn.run("SELECT xact_commit FROM pg_stat_database WHERE datname = :db", db=database)
    return PgCounters(
        version_num=version,
        block_size=block_size,
        checkpoints=checkpoints(conn, version),
        blocks_read=blocks_read,
        blocks_written=blocks_written,
        wal_bytes=wal_bytes,
        wal_writes=wal_writes,
        wal_syncs=wal_syncs,
        commits=int(rows[0][0]) if rows else 0,
        source=source,
    )


@dataclass(frozen=True)
class IoAgreement:
    """The trace's sectors beside PostgreSQL's for the same window.

    ``write_ratio`` is the trace's written sectors over PostgreSQL's data-file
    writes plus its WAL writes (``PgWindow.wal_disk_sectors``); ``read_ratio`` the trace's
    reads of PostgreSQL's relation files (``trace_relation_read_sectors``: see ``relfiles``)
    over the blocks PostgreSQL read from the kernel (some of which the guest's page cache
    served without a disk read, while readahead fetched more than asked).
    ``trace_read_sectors`` counts every read, program text and WAL included.
    """

    trace_read_sectors: int
    trace_relation_read_sectors: int
    trace_write_sectors: int
    pg: PgWindow
    read_ratio: float | None
    write_ratio: float | None

    @classmethod
    def of(
        cls, trace_read: int, trace_relation_read: int, trace_written: int, pg: PgWindow
    ) -> IoAgreement:
        pg_written = pg.write_sectors + pg.wal_disk_sectors
        return cls(
            trace_read_sectors=trace_read,
            trace_relation_read_sectors=trace_relation_read,
            trace_write_sectors=trace_written,
            pg=pg,
            read_ratio=round(trace_relation_read / pg.read_sectors, 3) if pg.read_sectors else None,
            write_ratio=round(trace_written / pg_written, 3) if pg_written else None,
        )
