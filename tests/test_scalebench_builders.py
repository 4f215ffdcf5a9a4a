"""The controller's single builders: the model's input, the cost fallback, densevm's argv."""

from __future__ import annotations

from pathlib import Path

import pytest
from scalebench import calibration
from scalebench.config import RunConfig, validate
from scalebench.densevm import DenseVMArgs
from scalebench.model import DEFAULT_FAULT_US, model_input, unmodeled


@pytest.fixture(autouse=True)
def own_calibration(tmp_path, monkeypatch):
    monkeypatch.setenv("SCALEBENCH_CALIBRATION", str(tmp_path / "calibration.json"))


def test_the_cpu_cost_is_the_flag_then_measured_then_stored_then_the_fallback():
    assert calibration.cpu_us(7.0, "small", [(1.0, "warm-up")]) == (7.0, "flag")
    assert calibration.cpu_us(None, "small", [(None, "x"), (2.0, "warm-up")]) == (2.0, "warm-up")
    assert calibration.cpu_us(None, "small") == calibration.NO_CPU_US
    assert calibration.cpu_us(None, "small", fallback=calibration.UNCALIBRATED) == (
        calibration.UNCALIBRATED
    )
    calibration.store_cpu_us("small", 250.0, 100, "an earlier run")
    assert calibration.cpu_us(None, "small", [(None, "x")]) == (250.0, "stored")


def test_measurements_past_the_chosen_one_are_not_taken():
    taken = []

    def measured():
        taken.append("first")
        yield 3.0, "first"
        taken.append("second")
        yield 4.0, "second"

    assert calibration.cpu_us(None, "small", measured()) == (3.0, "first")
    assert taken == ["first"]
    calibration.cpu_us(1.0, "small", measured())
    assert taken == ["first"]  # a flag takes no measurement


def test_the_fault_cost_falls_back_to_the_stored_then_the_default():
    assert calibration.fault_us(None, 32768) == (DEFAULT_FAULT_US, "default")
    calibration.store_fault_us(32768, 80.0, 100, "settle phase")
    assert calibration.fault_us(None, 32768) == (80.0, "stored")
    assert calibration.fault_us(None, 32768, [(60.0, "settle phase")]) == (60.0, "settle phase")
    assert calibration.fault_us(40.0, 32768, [(60.0, "settle phase")]) == (40.0, "flag")


def test_the_model_input_comes_from_the_configuration():
    cfg = validate(RunConfig(vms=300, alpha=0.8, block="64k", mem="256M", disk="hdd"))
    inp = model_input(cfg, 1 << 20, 100.0, 50.0, None, swap_bytes=1 << 30)
    assert (inp.vms, inp.alpha, inp.block_bytes, inp.budget_bytes) == (300, 0.8, 65536, 256 << 20)
    assert inp.footprint_bytes == 1 << 20 and inp.disk.name.startswith("hdd")
    assert inp.cpu_s == pytest.approx(100e-6) and inp.fault_s == pytest.approx(50e-6)
    assert inp.swap_bytes == 1 << 30 and inp.in_flight == cfg.concurrency
    assert inp.written_bytes is not None and 0 < inp.written_bytes <= inp.footprint_bytes * 2


def test_only_the_builtin_policies_are_modeled():
    assert unmodeled("demand") is None and unmodeled("wsswap") is None
    assert "not ./lib.so" in unmodeled("./lib.so")


def test_densevm_argv_leaves_unset_flags_to_densevm():
    api = Path("/tmp/d.sock")
    bare = DenseVMArgs(vms=8, addr_base="127.9.0.0", port=8080, api=api, extra=("--mem", "3M"))
    assert bare.argv(Path("densevm")) == [
        "densevm", "serve", "--vms", "8", "--addr-base", "127.9.0.0", "--port", "8080",
        "--api", str(api), "--mem", "3M",
    ]  # fmt: skip
    full = DenseVMArgs(8, "127.9.0.0", 8080, api, "896K", "1G", "32k", "demand", "hdd", Path("s"))
    argv = full.argv(Path("densevm"))
    for flag, value in (("--ws", "896K"), ("--disk", "hdd"), ("--swap", "s"), ("--mem", "1G")):
        assert argv[argv.index(flag) + 1] == value
