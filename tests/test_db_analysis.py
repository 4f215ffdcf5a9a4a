"""The study's block metrics on small hand-made traces (exact numbers), and the trace file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.db.analysis import block_metrics, plot_lba, read_trace_csv, write_trace_csv
from scalebench.db.nbd import TraceRecord


def rec(t: float, op: str, lba: int, sectors: int, latency: float = 0.001) -> TraceRecord:
    return TraceRecord(t, op, lba, sectors, latency)


# Reads: 0+8, 8+8 (sequential), 100+16, 116+8 (sequential), 500+8 -> 5 reads, 2 sequential, 3
# streams, 48 sectors.
# Writes: 1000+8, 2000+8, 2008+8 (sequential) -> 3 writes, 1 sequential, 2 streams, 24 sectors.
# A flush in between carries no sectors and does not break the read stream.
TRACE = [
    rec(0.000, "R", 0, 8),
    rec(0.010, "R", 8, 8),
    rec(0.020, "W", 1000, 8, 0.004),
    rec(0.030, "R", 100, 16),
    rec(0.035, "F", 0, 0),
    rec(0.040, "R", 116, 8),
    rec(0.050, "W", 2000, 8, 0.002),
    rec(0.060, "W", 2008, 8, 0.003),
    rec(0.070, "R", 500, 8),
]


def test_study_columns_exact() -> None:
    m = block_metrics(TRACE)
    assert (m.sectors_read, m.sectors_written) == (48, 24)
    assert (m.reads, m.writes, m.flushes) == (5, 3, 1)
    assert m.avg_read_stream == pytest.approx(48 / 3)
    assert m.avg_write_stream == pytest.approx(24 / 2)
    assert m.read_seq == pytest.approx(2 / 5)
    assert m.write_seq == pytest.approx(1 / 3)
    # Eight data requests from t=0 to t=0.070: seven gaps of 10 ms.
    assert m.avg_interarrival_ms == pytest.approx(10.0)
    assert m.read_share == pytest.approx(48 / 72)
    assert m.mean_read_latency_ms == pytest.approx(1.0)
    assert m.mean_write_latency_ms == pytest.approx(3.0)


def test_order_of_records_does_not_matter() -> None:
    assert block_metrics(list(reversed(TRACE))) == block_metrics(TRACE)


def test_footprint_counts_distinct_units_per_thousand_requests() -> None:
    m = block_metrics(TRACE)
    # 1 MiB regions (2048 sectors): every data request lies in region 0 -> 1 region over
    # 8/1000 of a window.
    assert m.regions_per_1000 == pytest.approx(1 / (8 / 1000))
    # 4 KiB blocks (8 sectors), unaligned requests straddle two: 0 | 1 | 125 | 12,13,14 |
    # 14,15 | 250 | 251 |
    # 62,63 -> {0, 1, 12, 13, 14, 15, 62, 63, 125, 250, 251}: 11 blocks.
    assert m.blocks_per_1000 == pytest.approx(11 / (8 / 1000))


def test_footprint_grows_when_requests_spread() -> None:
    same_region = [rec(i * 0.001, "R", (i % 4) * 8, 8) for i in range(2000)]
    spread = [rec(i * 0.001, "R", i * 4096, 8) for i in range(2000)]
    assert block_metrics(same_region).regions_per_1000 == pytest.approx(1.0)
    assert block_metrics(spread).regions_per_1000 == pytest.approx(1000.0)


def test_empty_trace() -> None:
    m = block_metrics([])
    assert (m.sectors_read, m.sectors_written, m.read_seq, m.avg_interarrival_ms) == (
        0,
        0,
        0.0,
        0.0,
    )


def test_trace_csv_round_trip_and_plot(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    write_trace_csv(TRACE, path)
    assert path.read_text().splitlines()[0] == "t_s,op,lba,sectors,latency_ms"
    back = read_trace_csv(path)
    assert [(r.op, r.lba, r.sectors) for r in back] == [(r.op, r.lba, r.sectors) for r in TRACE]
    assert back[2].latency == pytest.approx(0.004)
    assert block_metrics(back) == block_metrics(TRACE)
    png = tmp_path / "lba.png"
    plot_lba(TRACE, png, "hand-made", 4096)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
