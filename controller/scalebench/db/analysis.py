"""The study's block-level metrics, the trace file and the LBA-over-time plot.

Definitions (after Zhang, Riska, Riedel, QEST 2008, section 5), per
operation type (reads, writes) in arrival order; flushes carry no sectors and
are only counted:

- a request is *sequential* when it starts at the sector right after the
  previous request of the same type ended;
- a *stream* is a maximal run of such requests; its size is its total
  sectors; the average stream size is sectors / streams;
- sequentiality = sequential requests / requests;
- the average interarrival time is taken over reads and writes together.

Footprint (for the browsing-to-ordering finding): distinct 1 MiB regions and
distinct 4 KiB blocks touched per window of 1,000 consecutive requests,
averaged over the windows (a last partial window counts in proportion).
"""

from __future__ import annotations

import csv
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .nbd import TraceRecord

STUDY_COLUMNS = (
    "sectors_read",
    "sectors_written",
    "avg_read_stream",
    "avg_write_stream",
    "read_seq",
    "write_seq",
    "avg_interarrival_ms",
)
REGION_SECTORS = 2048  # 1 MiB
BLOCK_SECTORS = 8  # 4 KiB
WINDOW = 1000


@dataclass(frozen=True)
class BlockMetrics:
    """The study's columns plus counts, read share and footprint."""

    sectors_read: int
    sectors_written: int
    avg_read_stream: float
    avg_write_stream: float
    read_seq: float
    write_seq: float
    avg_interarrival_ms: float
    reads: int
    writes: int
    flushes: int
    read_share: float  # reads' share of all sectors moved
    regions_per_1000: float  # distinct 1 MiB regions per 1,000 requests
    blocks_per_1000: float  # distinct 4 KiB blocks per 1,000 requests
    mean_read_latency_ms: float
    mean_write_latency_ms: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _streams(requests: Sequence[TraceRecord]) -> tuple[int, int]:
    """(sequential requests, streams) of one operation type."""
    sequential, streams, last_end = 0, 0, None
    for r in requests:
        if last_end is not None and r.lba == last_end:
            sequential += 1
        else:
            streams += 1
        last_end = r.lba + r.sectors
    return sequential, streams


def _footprint(requests: Sequence[TraceRecord], unit: int) -> float:
    if not requests:
        return 0.0
    distinct_total, weight = 0.0, 0.0
    for start in range(0, len(requests), WINDOW):
        window = requests[start : start + WINDOW]
        units: set[int] = set()
        for r in window:
            units.update(range(r.lba // unit, (r.lba + max(r.sectors, 1) - 1) // unit + 1))
        distinct_total += len(units)
        weight += len(window) / WINDOW
    return distinct_total / weight


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return sum(values) / len(values) if values else 0.0


def block_metrics(records: Sequence[TraceRecord]) -> BlockMetrics:
    """The metrics of a trace (records in arrival order)."""
    ordered = sorted(records, key=lambda r: r.t)
    reads = [r for r in ordered if r.op == "R"]
    writes = [r for r in ordered if r.op == "W"]
    data = [r for r in ordered if r.op in ("R", "W")]
    read_sectors = sum(r.sectors for r in reads)
    write_sectors = sum(r.sectors for r in writes)
    read_seq, read_streams = _streams(reads)
    write_seq, write_streams = _streams(writes)
    gaps = [b.t - a.t for a, b in itertools.pairwise(data)]
    moved = read_sectors + write_sectors
    return BlockMetrics(
        sectors_read=read_sectors,
        sectors_written=write_sectors,
        avg_read_stream=read_sectors / read_streams if read_streams else 0.0,
        avg_write_stream=write_sectors / write_streams if write_streams else 0.0,
        read_seq=read_seq / len(reads) if reads else 0.0,
        write_seq=write_seq / len(writes) if writes else 0.0,
        avg_interarrival_ms=_mean(gaps) * 1000.0,
        reads=len(reads),
        writes=len(writes),
        flushes=sum(1 for r in ordered if r.op == "F"),
        read_share=read_sectors / moved if moved else 0.0,
        regions_per_1000=_footprint(data, REGION_SECTORS),
        blocks_per_1000=_footprint(data, BLOCK_SECTORS),
        mean_read_latency_ms=_mean(r.latency for r in reads) * 1000.0,
        mean_write_latency_ms=_mean(r.latency for r in writes) * 1000.0,
    )


def write_trace_csv(records: Sequence[TraceRecord], path: Path) -> None:
    """One row per request: t_s (since the measured interval began), op, lba, sectors,
    latency_ms."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = records[0].t if records else 0.0
    with path.open("w", newline="") as out:
        writer = csv.writer(out)
        writer.writerow(["t_s", "op", "lba", "sectors", "latency_ms"])
        for r in records:
            writer.writerow(
                [f"{r.t - t0:.6f}", r.op, r.lba, r.sectors, f"{r.latency * 1000.0:.3f}"]
            )


def read_trace_csv(path: Path) -> list[TraceRecord]:
    """The inverse of write_trace_csv (times relative to the first request)."""
    with path.open(newline="") as src:
        return [
            TraceRecord(
                float(row["t_s"]),
                row["op"],
                int(row["lba"]),
                int(row["sectors"]),
                float(row["latency_ms"]) / 1000.0,
            )
            for row in csv.DictReader(src)
        ]


def plot_lba(records: Sequence[TraceRecord], path: Path, title: str, disk_sectors: int) -> None:
    """LBA of each request against its issue time, reads and writes apart (the study's Figures
    3-5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = records[0].t if records else 0.0
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for op, colour, label in (("R", "tab:blue", "read"), ("W", "tab:red", "write")):
        chosen = [r for r in records if r.op == op]
        ax.scatter(
            [r.t - t0 for r in chosen],
            [r.lba for r in chosen],
            s=1.5,
            c=colour,
            label=label,
            linewidths=0,
            alpha=0.7,
        )
    ax.set_xlabel("time (s)")
    ax.set_ylabel("LBA (512-byte sectors)")
    ax.set_ylim(0, disk_sectors)
    ax.set_title(title)
    ax.legend(loc="upper right", markerscale=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
