"""Where PostgreSQL's relation files lie on the guest's disk, so that the trace's reads can be
split into the reads of the files PostgreSQL's counters count and the rest.

The rest is real I/O that no PostgreSQL counter sees: program text faulted back in after the
guest's page cache dropped it (the checkpointer waking for the window's closing checkpoint,
the shell that runs ``sync``), WAL and the guest's own files. In a 128 MiB guest running
pgbench it came to 13-15 MiB in each of three runs, most of it in a burst at the window's
close, while PostgreSQL read 12-36 MiB; a ratio over all the trace's reads therefore swung with
how much PostgreSQL happened to read, not with readahead or the page cache.

The extents come from ``filefrag -e -b512`` (e2fsprogs, in the guest image) over the data
directory's ``base/`` and ``global/``, run by the server (``COPY ... FROM PROGRAM``) after the
window's closing ``sync``, when every block it wrote has its place on the disk.
"""

from __future__ import annotations

import bisect
import re
import shlex
from collections.abc import Iterable
from typing import Any

from .errors import DbTraceError
from .nbd import TraceRecord

FILEFRAG = "/usr/sbin/filefrag"

# One extent of `filefrag -e`: "  3:   16..   31:   123456..   123471:   16:   flags".
_EXTENT = re.compile(r"^\s*\d+:\s*\d+\.\.\s*\d+:\s*(\d+)\.\.\s*(\d+):\s*\d+:(.*)$")


def parse_filefrag(lines: Iterable[str]) -> list[tuple[int, int]]:
    """The physical extents, as merged and sorted sector ranges ``[start, end)``, of
    ``filefrag -e -b512`` output. Extents with no place on the disk yet (delayed allocation,
    an unknown location) are left out."""
    ranges = []
    for line in lines:
        m = _EXTENT.match(line)
        if m is None or "unknown" in m.group(3) or "delalloc" in m.group(3):
            continue
        ranges.append((int(m.group(1)), int(m.group(2)) + 1))
    ranges.sort()
    merged: list[tuple[int, int]] = []
    for start, end in ranges:
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def sectors_within(records: Iterable[TraceRecord], extents: list[tuple[int, int]]) -> int:
    """Sectors of the trace's reads that fall inside ``extents`` (merged, sorted)."""
    starts = [s for s, _ in extents]
    total = 0
    for r in records:
        if r.op != "R":
            continue
        lo, hi = r.lba, r.lba + r.sectors
        i = max(bisect.bisect_right(starts, lo) - 1, 0)
        while i < len(extents) and extents[i][0] < hi:
            total += max(0, min(hi, extents[i][1]) - max(lo, extents[i][0]))
            i += 1
    return total


def relation_extents(conn: Any) -> list[tuple[int, int]]:
    """The sector ranges of the data directory's relation files, asked of the server on
    ``conn`` (a superuser's connection)."""
    data_dir = str(conn.run("SHOW data_directory")[0][0])
    dirs = " ".join(shlex.quote(f"{data_dir}/{d}") for d in ("base", "global"))
    # A file PostgreSQL removes meanwhile makes filefrag fail on it alone: its status is not
    # the answer, the extents found are (none at all is an error below).
    program = f"find {dirs} -type f -print0 | xargs -0 {FILEFRAG} -e -b512; exit 0"
    literal = "'" + program.replace("'", "''") + "'"
    conn.run("CREATE TEMP TABLE scalebench_extents (line text)")
    try:
        conn.run(
            f"COPY scalebench_extents FROM PROGRAM {literal} WITH (FORMAT text, DELIMITER E'\\x01')"
        )
        lines = [str(row[0]) for row in conn.run("SELECT line FROM scalebench_extents")]
    finally:
        conn.run("DROP TABLE scalebench_extents")
    extents = parse_filefrag(lines)
    if not extents:
        raise DbTraceError(
            f"{FILEFRAG} found no extents of PostgreSQL's files in {data_dir}: "
            f"{' | '.join(lines[:3]) or 'no output'}"
        )
    return extents
