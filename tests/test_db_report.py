"""The tables dbtrace prints: one run's metrics, and ours beside the study's (from saved
results)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.db import cli
from scalebench.db.analysis import block_metrics
from scalebench.db.nbd import TraceRecord
from scalebench.db.report import compare_table, load_study, metrics_table

METRICS = asdict(
    block_metrics([TraceRecord(0.0, "R", 0, 8, 0.001), TraceRecord(0.004, "W", 64, 8, 0.001)])
)


def doc(workload: str, mix: str) -> dict:
    return {
        "options": {
            "workload": workload,
            "mix": mix,
            "clients": 4,
            "duration_s": 10,
            "disk": "hdd15k",
        },
        "metrics": METRICS,
    }


def test_study_reference_has_twelve_rows() -> None:
    rows = load_study()
    assert len(rows) == 12
    assert {r["benchmark"] for r in rows} == {"TPC-W", "RUBiS", "TPC-C"}


def test_metrics_table_has_the_study_columns() -> None:
    text = metrics_table("tpcc standard", METRICS, "NO (cap)")
    header, row = text.splitlines()
    assert "steady" in header and "sectors read" in header and "avg interarrival ms" in header
    assert row.split()[2:4] == ["NO", "(cap)"]
    assert row.split()[-7:] == ["8", "8", "8.00", "8.00", "0.00", "0.00", "4.00"]


def test_compare_table_pairs_each_run_with_the_study_row() -> None:
    text = compare_table([doc("tpcc", "standard"), doc("tpcw", "ordering")], load_study(), "heavy")
    lines = text.splitlines()
    assert lines[1].strip().startswith("ours TPC-C standard")
    assert lines[2].strip().startswith("study TPC-C heavy read") and "1049287" in lines[2]
    assert lines[4].strip().startswith("study TPC-W heavy write") and "13460872" in lines[4]


def test_compare_from_saved_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "results.json"
    saved.write_text(json.dumps([doc("rubis", "browsing")]))
    assert cli.main(["dbtrace", "--compare", "--results", str(saved), "--study-load", "light"]) == 0
    out = capsys.readouterr().out
    assert "ours RUBiS browsing" in out and "study RUBiS light read" in out and "659653" in out
