"""Python policies on pagesim (the `pagesim` extension, pagesim-py/): the demand mirror
against the Rust demand, and how a broken policy is stopped."""

from __future__ import annotations

import csv
import json
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pagesim
import pytest
from conftest import release_binary
from scalebench.policydev.pypolicy import Demand, Fifo, Policy
from test_policydev import scalebench

TRACES = Path(__file__).resolve().parent.parent / "experiments" / "traces"
SYNTHETIC = {"vms": 300, "alpha": 1.0, "requests": 20_000, "mem": "96M"}


def hit_ratios(options: dict[str, object]) -> tuple[float, float]:
    """Hit ratios of the Rust demand and of the Python mirror on the same setting."""
    rust = pagesim.simulate("demand", **options)
    python = pagesim.simulate(Demand(), **options)
    assert (rust["policy"], python["policy"]) == ("demand", "py-demand")
    assert python["requests"] == rust["requests"] > 0
    return rust["hit_ratio"], python["hit_ratio"]


@pytest.mark.parametrize(
    "options",
    [
        {"trace": TRACES / "densevm-128vm-a1.0.trace", "mem": "64M"},
        {"trace": TRACES / "zipf-4000vm-a1.5.trace", "mem": "1G"},
        {"trace": TRACES / "densevm-128vm-a1.0.trace", "mem": "64M", "vm_resident_max": "2M"},
    ],
    ids=["densevm-128vm", "zipf-a1.5", "densevm-128vm-quota"],
)
def test_the_demand_mirror_matches_rust_demand_on_shipped_traces(options: dict[str, object]):
    rust, python = hit_ratios(options)
    assert rust < 0.99, "the budget must make the policy choose"
    assert abs(rust - python) <= 0.005, (rust, python)


@pytest.mark.parametrize("block", ["4k", "32k", "128k"])
def test_the_demand_mirror_matches_rust_demand_on_a_synthetic_trace(block: str):
    rust, python = hit_ratios({**SYNTHETIC, "block": block})
    assert rust < 0.99
    assert abs(rust - python) <= 0.005, (rust, python)


def test_a_builtin_policy_gives_what_the_pagesim_binary_prints():
    argv = ["--vms", "300", "--alpha", "1.0", "--requests", "20000", "--mem", "96M"]
    proc = subprocess.run(
        [str(release_binary("pagesim")), "--json", *argv],
        check=True,
        capture_output=True,
        text=True,
    )
    binary = json.loads(proc.stdout)
    ours = pagesim.simulate("demand", **SYNTHETIC)
    for key in ("policy", "requests", "faults", "hit_ratio", "blocks_out", "swap_write_bytes"):
        assert ours[key] == binary[key], key


def test_fifo_evicts_what_it_installed_first():
    r = pagesim.simulate(Fifo(), **SYNTHETIC)
    assert r["policy"] == "py-fifo"
    assert r["blocks_out"] > 0 and 0 < r["hit_ratio"] < 1


class Counting(Fifo):
    """Fifo that counts its accesses."""

    def __init__(self) -> None:
        super().__init__()
        self.accesses = 0

    def on_access(self, vm: int) -> None:
        self.accesses += 1


def test_every_request_is_an_access_and_the_report_counts_them():
    policy = Counting()
    r = pagesim.simulate(policy, vms=50, requests=3000, mem="64M")
    assert policy.accesses == r["requests"] == 3000


class Raising(Demand):
    """Demand whose 100th fault raises."""

    def __init__(self) -> None:
        super().__init__()
        self.faults = 0

    def on_fault(self, vm: int, block: int) -> None:
        self.faults += 1
        if self.faults == 100:
            raise ZeroDivisionError("no room to think")


def test_an_exception_in_the_policy_is_a_one_line_error_with_its_cause():
    with pytest.raises(pagesim.SimulationError) as info:
        pagesim.simulate(Raising(), **SYNTHETIC)
    text = str(info.value)
    assert text == "policy py-demand failed: on_fault raised ZeroDivisionError: no room to think"
    assert isinstance(info.value.__cause__, ZeroDivisionError)


class Victims(Fifo):
    """Fifo whose victims are replaced by a fixed answer."""

    def __init__(self, answer: object) -> None:
        super().__init__()
        self.answer = answer

    def choose_victims(self, need: int, faulting_vm: int) -> Iterable[tuple[int, int]]:
        return self.answer  # type: ignore[return-value]


@pytest.mark.parametrize(
    ("answer", "message"),
    [
        # Requests touch blocks 0-15 of a 32-block VM: block 20 is never resident.
        ([(0, 20)], r"victim VM 0 block 20 is not resident"),
        ([(7, 3)], "victim VM 7 block 3 does not exist"),
        ([3, 4], "choose_victims raised TypeError"),
        (None, "no victim while 1 block"),
    ],
    ids=["not-resident", "wrong-vm", "not-pairs", "nothing"],
)
def test_bad_victims_are_refused(answer: object, message: str):
    with pytest.raises(pagesim.SimulationError, match=message):
        pagesim.simulate(
            Victims(answer),
            vms=6,
            alpha=0,
            requests=500,
            mem="2M",
            guest_mem="1M",
            ws="512K",
            extra=0,
        )


class FarPrefetch(Fifo):
    def on_fault(self, vm: int, block: int) -> Iterable[int]:
        return [10**6]


def test_a_prefetch_beyond_the_vm_is_refused():
    with pytest.raises(pagesim.SimulationError, match="prefetch of block 1000000 beyond VM"):
        pagesim.simulate(FarPrefetch(), **SYNTHETIC)


class NoVictims(Policy):
    pass


class BadLayout(Fifo):
    layout = "scattered"  # type: ignore[assignment]


@pytest.mark.parametrize(
    ("policy", "options", "message"),
    [
        (NoVictims(), {}, "choose_victims"),
        (BadLayout(), {}, 'layout must be "per-vm" or "log"'),
        (Fifo(), {"blokc": "32k"}, "--blokc"),
        (Fifo(), {"dirty": 2}, "--dirty must be between 0 and 1"),
        ("lru", {}, "unknown policy 'lru'"),
    ],
    ids=["no-choose-victims", "bad-layout", "unknown-option", "bad-value", "unknown-builtin"],
)
def test_a_bad_setting_is_a_value_error(policy: object, options: dict[str, object], message: str):
    with pytest.raises(ValueError, match=message):
        pagesim.simulate(policy, **options)


MINE = """
from scalebench.policydev.pypolicy import Demand


class Mine(Demand):
    name = "mine"
"""


def test_policy_compare_runs_a_python_policy_beside_the_rust_ones(tmp_path):
    (tmp_path / "mine.py").write_text(MINE)
    proc = scalebench(
        *("policy", "compare", "--policies", "py:./mine.py:Mine,wsswap", "--blocks", "32k"),
        *("--alpha", "1.0", "--vms", "300", "--requests", "8000", "--mem", "64M", "--out", "o"),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    with open(tmp_path / "o" / "compare.csv") as f:
        rows = {r["policy"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"demand", "wsswap", "Mine"}
    assert abs(float(rows["Mine"]["hit_ratio"]) - float(rows["demand"]["hit_ratio"])) <= 0.005


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--policies", "py:nosuchmodule:X"], "ModuleNotFoundError"),
        (["--policies", "py:scalebench.policydev.pypolicy:Demand", "--real"], "Rust version"),
    ],
)
def test_policy_compare_refuses_a_bad_or_real_python_policy(tmp_path, args, fragment):
    proc = scalebench("policy", "compare", *args, cwd=tmp_path)
    assert proc.returncode == 2, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


class RaisingAtRegistration(Fifo):
    def on_vm_registered(self, vm: int, blocks: int) -> None:
        raise KeyError(vm)


def test_an_exception_while_the_vms_register_stops_the_run_too():
    with pytest.raises(pagesim.SimulationError, match="on_vm_registered raised KeyError: 0"):
        pagesim.simulate(RaisingAtRegistration(), **SYNTHETIC)
