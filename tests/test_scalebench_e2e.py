"""End to end against the real densevm and zipfperf (built by `make build`): short runs.

In core (20 VMs in 1 GiB), out of core (40 VMs in a 16 MiB budget), and densevm
killed in the middle of a run. Each checks the result document and that nothing
is left running.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import release_binary


def scalebench(tmp: Path, *argv: str, on_start=None) -> tuple[subprocess.CompletedProcess, dict]:
    bindir = release_binary("densevm").parent
    release_binary("zipfperf")
    env = {
        **os.environ,
        "SCALEBENCH_BIN_DIR": str(bindir),
        "SCALEBENCH_CALIBRATION": str(tmp / "cal.json"),
    }
    out = tmp / "run"
    # Addresses of our own: the loopback network is shared with whatever else runs on the host.
    cmd = [
        sys.executable,
        "-m",
        "scalebench.cli",
        *argv,
        "--addr-base",
        "127.42.0.0",
        "-q",
        "--out",
        str(out),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if on_start:
        threading.Thread(target=on_start, args=(out,), daemon=True).start()
    stdout, stderr = proc.communicate(timeout=300)
    done = subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)
    return done, json.loads((out / "result.json").read_text())


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains text (the run directory: densevm's --api,
    zipfperf's --json)."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                if text in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def assert_nothing_left(result: dict, out: Path) -> None:
    assert processes_mentioning(str(out)) == []
    group = result["containment"].get("memory_group")
    assert group is None or not Path(group).exists()


def test_short_in_core_run(tmp_path):
    # A 2 s window: every check below is a ratio, a presence or an order, not a count.
    proc, r = scalebench(tmp_path, "--vms", "20", "--duration", "2", "--warmup", "2")
    assert proc.returncode == 0, proc.stderr
    assert r["status"] == "ok"
    assert r["throughput_rps"] > 0 and r["errors"] == 0
    assert r["regime"] == "in-core" and r["model"]["regime"] == "in-core"
    assert r["boot_seconds"] > 0
    assert 0 < r["resident_bytes"] <= r["budget_bytes"] == 2**30
    assert r["calibration"]["source"] == "warm-up"
    assert r["latency_ms"]["p50"] <= r["latency_ms"]["p99"]
    # One connection per request, each to a Zipf-drawn VM (zipfperf --num-calls 1 in the
    # closed loop).
    assert r["phases"]["load"]["connections"]["total"] >= 0.9 * r["replies"], r["warnings"]
    assert r["warnings"] == []
    assert "requests/s" in proc.stdout and "regime:      in-core" in proc.stdout
    assert (tmp_path / "run" / "run.png").exists()
    assert_nothing_left(r, tmp_path / "run")


def test_short_out_of_core_run_pages(tmp_path):
    proc, r = scalebench(
        tmp_path,
        "--vms",
        "40",
        "--mem",
        "16M",
        "--alpha",
        "0.5",
        "--duration",
        "2",
        "--warmup",
        "1",
    )  # 40 VMs where under half fit, near-uniform: any window pages; the regime is a ratio
    assert proc.returncode == 0, proc.stderr
    assert r["faults"] > 0 and r["swap_read_bytes"] > 0 and r["swap_write_bytes"] > 0
    assert r["regime"] == "disk-bound" and r["model"]["regime"] == "disk-bound"
    assert r["resident_bytes"] <= r["budget_bytes"] == 16 * 2**20
    # Demand keeps a region of each VM's RAM on swap, committed at registration.
    assert r["swap_used_bytes"] == 40 * r["swap_bytes_per_vm"] > 0
    assert r["model"]["cache_vms"] < 40
    assert_nothing_left(r, tmp_path / "run")


def test_densevm_killed_mid_run(tmp_path):
    def kill_densevm(out: Path) -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if (out / "zipfperf-load.log").exists():
                for pid in processes_mentioning(str(out / "densevm.sock")):
                    os.kill(pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    proc, r = scalebench(
        tmp_path, "--vms", "20", "--duration", "20", "--warmup", "5", on_start=kill_densevm
    )
    assert proc.returncode == 1
    assert r["boot_seconds"] is not None  # it failed mid-run, not at start-up
    assert r["status"] == "failed" and "densevm exited" in r["error"]
    assert proc.stderr.strip().splitlines()[-1].startswith("scalebench: error: densevm exited")
    assert_nothing_left(r, tmp_path / "run")
