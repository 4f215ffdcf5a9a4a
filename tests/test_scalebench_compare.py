"""`scalebench compare`: a 10% slowdown is flagged (exit 1), an unchanged rerun passes (exit 0)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from scalebench.result import RunResult


def result_doc(throughput: float, p50: float, errors: int = 0) -> dict:
    r = RunResult("r", {"vms": 20})
    r.status = "ok"
    r.throughput_rps, r.replies, r.errors = throughput, int(throughput * 60), errors
    r.latency_ms = {"p50": p50, "p99": p50 * 4}
    r.boot_seconds = 1.0
    return r.as_dict()


def compare(tmp: Path, base: dict, new: dict, *extra: str) -> subprocess.CompletedProcess:
    (tmp / "base.json").write_text(json.dumps(base))
    (tmp / "new.json").write_text(json.dumps(new))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "scalebench.cli",
            "compare",
            str(tmp / "base.json"),
            str(tmp / "new.json"),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_injected_ten_percent_slowdown_is_a_regression(tmp_path):
    proc = compare(tmp_path, result_doc(1000.0, 2.0), result_doc(900.0, 2.2))
    assert proc.returncode == 1
    assert "REGRESSION" in proc.stdout and "-10.0%" in proc.stdout


def test_unchanged_rerun_passes(tmp_path):
    proc = compare(tmp_path, result_doc(1000.0, 2.0), result_doc(985.0, 2.03))  # run-to-run noise
    assert proc.returncode == 0, proc.stdout
    assert "REGRESSION" not in proc.stdout


def test_tolerance_is_configurable(tmp_path):
    assert (
        compare(
            tmp_path, result_doc(1000.0, 2.0), result_doc(900.0, 2.0), "--tolerance", "15"
        ).returncode
        == 0
    )


def test_new_errors_and_failed_points_are_regressions(tmp_path):
    assert (
        compare(tmp_path, result_doc(1000.0, 2.0), result_doc(1000.0, 2.0, errors=600)).returncode
        == 1
    )
    failed = result_doc(1000.0, 2.0)
    failed.update(status="failed", error="densevm died")
    assert compare(tmp_path, result_doc(1000.0, 2.0), failed).returncode == 1


def test_sweeps_compare_point_by_point(tmp_path):
    def sweep(points: dict) -> dict:
        return {"schema": "scalebench.sweep/1", "points": points}

    base = sweep({"vms=4": result_doc(1000.0, 2.0), "vms=8": result_doc(2000.0, 2.0)})
    slower = sweep({"vms=4": result_doc(1000.0, 2.0), "vms=8": result_doc(1800.0, 2.0)})
    assert compare(tmp_path, base, base).returncode == 0
    proc = compare(tmp_path, base, slower)
    assert proc.returncode == 1 and "vms=8" in proc.stdout


def test_unreadable_input_is_a_usage_error(tmp_path):
    (tmp_path / "x.json").write_text("{}")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalebench.cli",
            "compare",
            str(tmp_path / "x.json"),
            str(tmp_path / "missing.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1


def test_points_from_different_kinds_of_host_are_refused_unless_told(tmp_path):
    base, new = result_doc(1000.0, 2.0), result_doc(1000.0, 2.0)
    base["host"]["kind"], new["host"]["kind"] = (
        "AMD EPYC x2, 24 GiB, Linux 6.1, pvm",
        "Xeon x64, 512 GiB, Linux 6.8, kvm",
    )
    proc = compare(tmp_path, base, new)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "different kinds of host" in proc.stderr and "--mixed-hosts" in proc.stderr
    assert compare(tmp_path, base, new, "--mixed-hosts").returncode == 0
    del base["host"][
        "kind"
    ]  # a result from before host kinds were recorded: nothing to tell them apart by
    assert compare(tmp_path, base, new).returncode == 0
