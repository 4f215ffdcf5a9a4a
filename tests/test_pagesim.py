"""pagesim, the pager's trace-driven simulator: flags, synthetic and recorded
traces, and the behaviour its numbers must show."""

from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path

import pytest
from conftest import release_binary
from support.plugins import fifo_plugin as build_fifo_plugin


def pagesim(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [str(release_binary("pagesim")), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def sim_json(*args: str) -> dict:
    return json.loads(pagesim(*args, "--json").stdout)


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--bogus"], "--bogus"),
        (["--block", "3000"], "block size"),
        (["--block", "512k"], "block size"),
        (["--mem", "64k"], "budget"),
        (["--mem", "lots"], "invalid size"),
        (["--policy", "lru"], "unknown policy"),
        (["--policy", "/nonexistent/libp.so"], "not found"),
        (["--disk", "floppy"], "floppy"),
        (["--disk", "hdd,rpm=fast"], "rpm"),
        (["--alpha=-1"], "alpha"),
        (["--trace", "/nonexistent/trace.bin"], "trace"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, fragment):
    proc = pagesim(*args, "--requests", "10", check=False)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagesim: error:"), proc.stderr
    assert fragment in lines[0]
    assert proc.stdout == ""


def test_synthetic_run_prints_hit_ratio():
    out = pagesim("--vms", "2000", "--requests", "100000", "--disk", "hdd").stdout
    m = re.search(r"^hit ratio ([0-9.]+)", out, re.M)
    assert m, out
    assert 0.0 <= float(m.group(1)) <= 1.0
    assert re.search(r"^predicted throughput [0-9.]+ requests/s", out, re.M), out


def test_higher_alpha_gives_higher_hit_ratio():
    ratios = [
        sim_json("--vms", "4000", "--alpha", str(a), "--requests", "200000", "--warmup", "50000")[
            "hit_ratio"
        ]
        for a in (0.0, 0.5, 1.0, 1.5)
    ]
    assert ratios == sorted(ratios) and ratios[-1] > ratios[0] + 0.2, ratios
    assert all(0.0 <= r <= 1.0 for r in ratios)


def test_everything_fits_in_core():
    r = sim_json("--vms", "100", "--requests", "50000")
    # Only the cold faults: one per block of every VM.
    assert r["faults"] == 100 * r["request_blocks"]
    assert r["blocks_out"] == 0 and r["swap_write_bytes"] == 0


def test_wsswap_reads_working_sets_sequentially():
    common = [
        "--vms",
        "4000",
        "--alpha",
        "1.0",
        "--block",
        "32k",
        "--mem",
        "1G",
        "--disk",
        "hdd",
        "--requests",
        "200000",
        "--warmup",
        "100000",
    ]
    demand = sim_json(*common, "--policy", "demand")
    wsswap = sim_json(*common, "--policy", "wsswap")
    # The same clock decides who is resident; wsswap needs three faults per
    # swapped-in VM (the third brings the rest of the set) instead of one
    # per block.
    assert abs(demand["request_hit_ratio"] - wsswap["request_hit_ratio"]) < 0.02
    assert wsswap["faults"] * 5 < demand["faults"]
    assert wsswap["predicted_rps"] >= 3 * demand["predicted_rps"], (demand, wsswap)


def test_clean_blocks_cost_no_writes():
    common = ["--vms", "2000", "--requests", "100000", "--mem", "512M"]
    dirty = sim_json(*common, "--dirty", "1.0")
    clean = sim_json(*common, "--dirty", "0.0")
    assert dirty["swap_write_bytes"] > 0
    assert clean["swap_write_bytes"] == 0
    assert clean["hit_ratio"] == dirty["hit_ratio"]


def write_trace(
    path: Path, vms: int, records: list[int], block: int = 32768, ram: int = 4 << 20
) -> None:
    header = json.dumps(
        {
            "block_bytes": block,
            "vm_ram_bytes": ram,
            "vms": vms,
            "request_ranges": [[0, 896 << 10], [ram - (128 << 10), 128 << 10]],
        }
    ).encode()
    with path.open("wb") as f:
        f.write(b"SBTRACE1" + struct.pack("<I", len(header)) + header)
        f.write(struct.pack(f"<{len(records)}I", *records))


def test_replays_a_recorded_trace(tmp_path):
    trace = tmp_path / "t.bin"
    records = [i % 50 for i in range(5000)]
    write_trace(trace, 50, records)
    r = sim_json("--trace", str(trace), "--mem", "16M")
    assert r["requests"] == len(records) and r["vms"] == 50
    # 50 VMs of 32 blocks round-robin through a 16-VM budget: nothing hits.
    assert r["request_hit_ratio"] == 0.0
    r = sim_json("--trace", str(trace), "--mem", "64M")
    assert r["faults"] == 50 * 32


def test_trace_with_bad_record_is_an_error(tmp_path):
    trace = tmp_path / "t.bin"
    write_trace(trace, 2, [0, 1, 7])
    proc = pagesim("--trace", str(trace), check=False)
    assert proc.returncode == 1
    assert "VM 7" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


@pytest.fixture(scope="module")
def fifo_plugin() -> Path:
    return build_fifo_plugin()


def test_plugin_policy(fifo_plugin):
    r = sim_json(
        "--policy", str(fifo_plugin), "--vms", "500", "--requests", "20000", "--mem", "128M"
    )
    assert r["policy"] == "fifo"
    assert 0.0 < r["hit_ratio"] < 1.0 and r["blocks_out"] > 0
