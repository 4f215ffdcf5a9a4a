"""Splitting the trace's reads by PostgreSQL's relation files: filefrag's extents parsed and
the reads within them counted (pure functions; the real guest's run is in test_db_pgbench)."""

from __future__ import annotations

from scalebench.db.nbd import TraceRecord
from scalebench.db.relfiles import parse_filefrag, sectors_within

# `filefrag -e -b512` over two files, as e2fsprogs 1.47 prints it.
FILEFRAG_OUTPUT = """\
Filesystem type is: ef53
File size of /var/lib/postgresql/15/main/base/5/1259 is 16384 (32 blocks of 512 bytes)
 ext:     logical_offset:        physical_offset: length:   expected: flags:
   0:        0..      15:       1000..      1015:     16:
   1:       16..      31:       1016..      1031:     16:             last,eof
/var/lib/postgresql/15/main/base/5/1259: 2 extents found
File size of /var/lib/postgresql/15/main/base/5/16384 is 24576 (48 blocks of 512 bytes)
 ext:     logical_offset:        physical_offset: length:   expected: flags:
   0:        0..      15:       5000..      5015:     16:
   1:       16..      31:          0..        15:     16:       5016: unknown_loc,delalloc
   2:       32..      47:       2000..      2015:     16:       5032: last,eof
/var/lib/postgresql/15/main/base/5/16384: 3 extents found
"""


def test_extents_are_parsed_merged_and_sorted_and_unplaced_ones_dropped() -> None:
    extents = parse_filefrag(FILEFRAG_OUTPUT.splitlines())
    assert extents == [(1000, 1032), (2000, 2016), (5000, 5016)]


def read(lba: int, sectors: int, op: str = "R") -> TraceRecord:
    return TraceRecord(t=0.0, op=op, lba=lba, sectors=sectors, latency=0.0)


def test_only_the_sectors_of_reads_inside_the_extents_count() -> None:
    extents = [(1000, 1032), (2000, 2016), (5000, 5016)]
    records = [
        read(1000, 8),  # inside
        read(990, 20),  # 10 of its 20 inside
        read(1024, 1000),  # 8 in the first extent, 16 in the second
        read(3000, 256),  # between extents
        read(5010, 100),  # its first 6
        read(0, 4),  # before every extent
        read(1000, 32, "W"),  # a write
    ]
    assert sectors_within(records, extents) == 8 + 10 + 24 + 6
    assert sectors_within(records, []) == 0
