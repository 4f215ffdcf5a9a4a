"""The gallery of baseline policy plugins (paging-policy/examples): each loads in pagesim
and under densevm, where self-checking guests find no memory mismatch at 32k blocks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import RELEASE_DIR, REPO_ROOT, release_binary
from scalebench.webobject import SMALL
from support.densevm import get, kvm_available, start

GALLERY = ("fifo", "lru", "wsclock", "arc", "reap")
VMS = 6


@pytest.fixture(scope="module")
def gallery() -> dict[str, Path]:
    libs = {name: RELEASE_DIR / "examples" / f"lib{name}_policy.so" for name in GALLERY}
    if not all(lib.exists() for lib in libs.values()):
        subprocess.run(
            ["cargo", "build", "--release", "-q", "-p", "paging-policy", "--examples"],
            cwd=REPO_ROOT,
            check=True,
            timeout=900,
        )
    return libs


def pagesim(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(release_binary("pagesim")), *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize("name", GALLERY)
def test_gallery_policy_replays_a_trace_in_pagesim(gallery, name):
    proc = pagesim(
        "--json",
        "--policy",
        str(gallery[name]),
        *("--vms", "400", "--requests", "20000", "--mem", "96M", "--block", "32k"),
    )
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["policy"] == name
    # 400 VMs of 1 MiB working set in 96 MiB: some requests hit, some fault.
    assert 0.0 < r["hit_ratio"] < 1.0 and r["blocks_out"] > 0, r


@pytest.mark.parametrize(
    "name, args", [("lru", "x"), ("wsclock", "window=soon"), ("arc", "p=1"), ("reap", "after=0")]
)
def test_gallery_policy_refuses_bad_arguments(gallery, name, args):
    proc = pagesim("--policy", f"{gallery[name]},{args}", "--requests", "10")
    assert proc.returncode == 2
    assert name in proc.stderr or "refused" in proc.stderr, proc.stderr


def test_reap_prefetch_saves_faults_over_demand(gallery):
    """REAP brings a restored VM's recorded window back in one operation: fewer faults."""
    common = ("--json", "--vms", "400", "--requests", "20000", "--mem", "96M", "--block", "4k")
    demand = json.loads(pagesim(*common, "--policy", "demand").stdout)
    reap = json.loads(pagesim(*common, "--policy", str(gallery["reap"])).stdout)
    assert reap["faults"] < 0.5 * demand["faults"], (demand, reap)


@pytest.mark.skipif(not kvm_available(), reason="/dev/kvm is absent or not accessible")
@pytest.mark.parametrize("name", GALLERY)
def test_gallery_policy_keeps_guest_memory_intact(tmp_path, gallery, name):
    """densevm's integrity check (self-checking guests) at 32k blocks, a budget of a quarter
    of the working sets: every request evicts someone, no page may come back wrong."""
    m = start(
        tmp_path,
        VMS,
        "127.215.0.0",
        "--selfcheck",
        "--policy",
        str(gallery[name]),
        "--block",
        "32k",
        "--mem",
        str(VMS * (1 << 20) // 4),
        "--guest-mem",
        str(4 << 20),
        "--cell-vms",
        "2",
    )
    try:
        for _ in range(4):
            for vm in range(VMS):
                assert get(m.addr(vm)).body == SMALL
        totals = m.control({"cmd": "stats"})["totals"]
    finally:
        assert m.stop() == 0
    assert totals["policy"] == name
    assert totals["selfcheck_errors"] == 0, totals
    assert totals["selfcheck_pages"] >= VMS * 4 * 200, totals
    assert totals["faults"] > VMS * 3 and totals["swap_read_bytes"] > 0, totals
