"""The run orchestration: phases, result document, failures and teardown.

densevm and zipfperf are replaced here by small FAKE Python programs that keep
their contract (INTERFACES.md: ready/exit events, control socket, zipfperf's
JSON document), because these tests are about the controller's orchestration,
not about the binaries; the real ones are exercised by test_scalebench_e2e.py.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import release_binary
from scalebench.config import RunConfig
from scalebench.runner import Binaries, classify, hot_footprint, run

FAKE_DENSEVM = textwrap.dedent("""\
    #!{python}
    # FAKE densevm for orchestration tests: keeps the stdout/API contract; each "VM" is a
    # listener that answers any request with a fixed 200 reply.
    import ipaddress, json, os, signal, socket, sys, threading, time
    argv = sys.argv[1:]
    if argv[0] == "describe":  # facts, not a run: the real binary's
        os.execv("{real}", ["densevm", *argv])
    opt = lambda name: argv[argv.index(name) + 1]
    vms, api = int(opt("--vms")), opt("--api")
    die_after = float(os.environ.get("FAKE_DENSEVM_DIE_AFTER", "0"))
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"densevm {{os.getpid()}}\\n")
    with open(os.environ["FAKE_PIDS"] + ".cgroup", "w") as f:
        f.write(open("/proc/self/cgroup").read())
    t0 = time.monotonic()
    # Faults begin with the touch (bracketed by "disk" requests), after the calibration.
    touched = []
    # The swap device slows 4x once the FAKE zipfperf marks its load phase (FAKE_IO_SLOWS).
    slowed_at = []
    def io_slowed(t):
        mark = os.environ.get("FAKE_IO_SLOWS")
        if mark and not slowed_at and os.path.exists(mark):
            slowed_at.append(t)
        return 0.3 * (t - slowed_at[0]) if slowed_at else 0.0
    def stats():
        t = time.monotonic() - t0
        # Paging from boot on: the calibration pages.
        early = os.environ.get("FAKE_DENSEVM_PAGES_EARLY")
        paging = max(0.0, t - touched[0]) if touched else (t if early else 0.0)
        per = [{{"id": i, "addr": "", "state": "running", "requests": int(t * 100) if i < 10 else 0,
                 "resident_bytes": 1 << 20 if i < 10 else 4096, "faults": 0,
                 "swap_read_bytes": 0, "swap_write_bytes": 0}} for i in range(vms)]
        return {{"ok": True, "totals": {{"vms": vms, "running": vms, "stopped": 0,
                 "requests": int(t * 1000),
                 "resident_bytes": 512 << 20, "budget_bytes": 1 << 30, "block_bytes": 32768,
                 "faults": int(paging * 100), "blocks_in": 0, "blocks_out": 0,
                 "swap_read_bytes": int(paging * 100) * 32768, "swap_write_bytes": 0,
                 "io_seconds": t * 0.1 + io_slowed(t),
                 "disk_usage": {{"busy_seconds": paging * 0.5, "requests": int(paging * 100),
                                "positioned": int(paging * 50),
                                "positioning_seconds": int(paging * 50) * 0.01}},
                 "fault_latency_us": {{"p50": 100, "p90": 200, "p99": 300, "max": 400, "count": 1}},
                 "selfcheck_errors": 0}}, "vms": per}}
    def serve():
        srv = socket.socket(socket.AF_UNIX); srv.bind(api); srv.listen(16)
        while True:
            c, _ = srv.accept()
            req = json.loads(c.makefile().readline())
            if req["cmd"] == "disk" and not req["modeled"] and not touched:
                touched.append(time.monotonic() - t0)
            reply = stats() if req["cmd"] == "stats" else {{"ok": True, "block": 32768}}
            if req.get("vms") is False:
                reply.pop("vms")
            c.sendall(json.dumps(reply).encode() + b"\\n"); c.close()
    threading.Thread(target=serve, daemon=True).start()
    def vm(addr):
        srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind((addr, int(opt("--port")))); srv.listen(64)
        while True:
            c, _ = srv.accept(); c.recv(4096)
            c.sendall(b"HTTP/1.0 200 OK\\r\\nContent-Length: 2\\r\\n\\r\\nok"); c.close()
    for i in range(vms):
        addr = str(ipaddress.IPv4Address(opt("--addr-base")) + i)
        threading.Thread(target=vm, args=(addr,), daemon=True).start()
    def bye(*_):
        print(json.dumps({{"event": "exit", "reason": "signal"}}), flush=True); os._exit(0)
    signal.signal(signal.SIGTERM, bye)
    time.sleep(0.3)
    ready = {{"event": "ready", "vms": vms, "boot_seconds": 0.3, "api": api, "pvm": True}}
    print(json.dumps(ready), flush=True)
    while True:
        time.sleep(0.1)
        if die_after and time.monotonic() - t0 > die_after:
            print("densevm: error: simulated pager failure", file=sys.stderr); sys.exit(1)
    """)

FAKE_ZIPFPERF = textwrap.dedent("""\
    #!{python}
    # FAKE zipfperf for orchestration tests: sleeps --duration (SIGINT ends it early, as it ends the
    # real one's run), writes a zipfperf/1 document.
    import json, os, signal, sys, time
    argv = sys.argv[1:]
    opt = lambda name: argv[argv.index(name) + 1]
    with open(os.environ["FAKE_PIDS"], "a") as f:
        f.write(f"zipfperf {{os.getpid()}}\\n")
    if os.environ.get("FAKE_ZIPFPERF_FAIL"):
        print("zipfperf: error: simulated failure", file=sys.stderr); sys.exit(1)
    interrupted = []
    signal.signal(signal.SIGINT, lambda *_: interrupted.append(1))
    t0, d = time.monotonic(), float(opt("--duration"))
    if os.environ.get("FAKE_IO_SLOWS") and d < 60:  # the load phase, not the settle phase
        open(os.environ["FAKE_IO_SLOWS"], "w").close()
    while time.monotonic() - t0 < d and not interrupted:
        time.sleep(0.02)
    d = time.monotonic() - t0
    doc = {{"schema": "zipfperf/1", "config": {{"argv": argv}}, "duration_s": d,
           "connections": {{"total": 1000, "rate": 1000 / d}},
           "requests": {{"total": 1000, "rate": 1000 / d}},
           "replies": {{"total": 1000, "rate": 1000 / d, "status": {{"2xx": 1000}}}},
           "latency_ms": {{"mean": 1.0, "p50": 0.9, "p90": 1.5, "p99": 3.0, "p999": 5.0,
                          "max": 9.0}},
           "errors": {{"total": 0}}, "bytes": {{"sent": 0, "received": 0}}, "per_target": []}}
    open(opt("--json"), "w").write(json.dumps(doc))
    """)


def install_fakes(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp / "bin"
    bindir.mkdir()
    for name, text in (("densevm", FAKE_DENSEVM), ("zipfperf", FAKE_ZIPFPERF)):
        path = bindir / name
        path.write_text(text.format(python=sys.executable, real=release_binary("densevm")))
        path.chmod(0o755)
    monkeypatch.setenv("SCALEBENCH_BIN_DIR", str(bindir))
    monkeypatch.setenv("FAKE_PIDS", str(tmp / "pids"))
    monkeypatch.setenv("SCALEBENCH_CALIBRATION", str(tmp / "calibration.json"))
    return tmp


@pytest.fixture
def fakes(tmp_path, monkeypatch) -> Path:
    """A bin directory holding the FAKE densevm and zipfperf; their pids go to tmp/pids."""
    return install_fakes(tmp_path, monkeypatch)


@pytest.fixture(scope="module")
def completed_run(tmp_path_factory):  # type: ignore[no-untyped-def]
    """One run of small_config() on the fakes, as `fakes` sets them up, for the tests that read
    a completed run: its directory (tmp/run, the fakes' pids in tmp) and its RunResult."""
    tmp = tmp_path_factory.mktemp("completed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        install_fakes(tmp, monkeypatch)
        result = run(small_config(tmp), bins=Binaries.find())
    return tmp, result


def started_pids(tmp: Path) -> list[int]:
    pids = tmp / "pids"
    return [int(line.split()[1]) for line in pids.read_text().splitlines()] if pids.exists() else []


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def small_config(tmp: Path, **changes) -> RunConfig:
    # Out of core by construction (20 VMs of ~1 MiB in 8 MiB): the run calibrates before the touch.
    settings = {
        "vms": 20,
        "mem": "8M",
        "duration": 1.5,
        "warmup": 1.0,
        "calibration_s": 1.0,
        "out": str(tmp / "run"),
        "addr_base": "127.43.0.0",
        **changes,
    }
    return RunConfig(**settings)


def test_run_completes_and_records_everything(completed_run):
    fakes, result = completed_run
    assert result.status == "ok", result.error
    doc = json.loads((fakes / "run" / "result.json").read_text())
    assert doc["schema"] == "scalebench.result/1"
    for key in (
        "throughput_rps",
        "model_rps",
        "regime",
        "errors",
        "boot_seconds",
        "resident_bytes",
        "swap_read_bytes",
        "swap_write_bytes",
    ):
        assert doc[key] is not None, key
    assert doc["latency_ms"]["p50"] == 0.9 and doc["latency_ms"]["p99"] == 3.0
    assert doc["config"]["vms"] == 20 and doc["config"]["block"] == "32k"
    assert doc["boot_seconds"] == 0.3
    # The fake serves 1000 requests/s and 100 faults/s with swap reads: disk-bound by definition.
    assert doc["regime"] == "disk-bound"
    # Its modeled drive works half of each second, 10 ms per positioning.
    assert doc["drive"]["utilization"] == pytest.approx(0.5, rel=0.1)
    assert doc["drive"]["positioning_ms"] == pytest.approx(10.0, rel=0.1)
    assert doc["footprint_bytes"] == 1 << 20
    assert doc["calibration"]["source"].startswith("calibration phase")
    assert doc["measured_over_model"] == pytest.approx(doc["throughput_rps"] / doc["model_rps"])
    assert [s["phase"] for s in doc["timeseries"]].count("measure") >= 2
    assert "touch" in [s["phase"] for s in doc["timeseries"]] and doc["warnings"] == []
    # 20 VMs of ~1 MiB in 8 MiB: the settle phase ran until 1.5 times the 8 that fit were
    # swapped in.
    assert "settle" in [s["phase"] for s in doc["timeseries"]]
    assert doc["phases"]["settle"]["target"] == 12 and doc["phases"]["settle"]["swap_ins"] >= 12
    assert (fakes / "run" / "run.png").stat().st_size > 0
    # Containment: densevm was started inside the run's memory group, which is gone now.
    group = doc["containment"]["memory_group"]
    if group:
        rel = group.split("/sys/fs/cgroup/memory", 1)[1]
        assert f"memory:{rel}" in (fakes / "pids.cgroup").read_text()
        assert not Path(group).exists()
    assert not (fakes / "run" / "swap.img").exists()
    assert started_pids(fakes) and not any(alive(p) for p in started_pids(fakes))


def test_a_stored_run_is_remodeled_from_what_it_recorded(completed_run, tmp_path):
    from scalebench.runner import remodel

    # A copy of the completed run's result document, which this test rewrites.
    ran, result = completed_run
    path = tmp_path / "result.json"
    shutil.copyfile(ran / "run" / "result.json", path)
    doc = json.loads(path.read_text())
    # Pretend an older model had predicted something else: remodel restores this model's figure.
    doc["model_rps"], doc["measured_over_model"] = 1.0, doc["throughput_rps"]
    path.write_text(json.dumps(doc))
    again = remodel(path)
    assert again.model_rps == pytest.approx(result.model_rps)
    assert again.measured_over_model == pytest.approx(result.throughput_rps / result.model_rps)
    stored = json.loads(path.read_text())
    assert (
        stored["model"]["remodeled"]["model_rps_before"] == 1.0
        and stored["model_rps"] == again.model_rps
    )
    stored["status"] = "failed"
    path.write_text(json.dumps(stored))
    assert remodel(path) is None


def test_a_window_before_the_closed_loops_steady_state_is_flagged(completed_run, tmp_path):
    from scalebench.runner import remodel
    from scalebench.sweep import point_line

    ran, _ = completed_run
    path = tmp_path / "result.json"
    shutil.copyfile(ran / "run" / "result.json", path)

    def remodeled_with(**config):
        doc = json.loads(path.read_text())
        doc["config"].update(config)
        path.write_text(json.dumps(doc))
        return remodel(path)

    # On the modeled drive the out-of-core run's misses queue: a 1 s warm-up is too short.
    short = remodeled_with(disk="hdd", warmup=1.0)
    assert short.model["regime"] == "disk-bound" and short.model["steady_window"] is False
    (warning,) = [w for w in short.warnings if "filling with misses" in w]
    assert f"a miss waits about {short.model['miss_wait_s']:.0f} s" in warning
    assert remodel(path).warnings.count(warning) == 1  # remodeled again, warned once
    assert "the window is before the steady state" in point_line(short)
    long = remodeled_with(warmup=short.model["miss_wait_s"] + 1)
    assert long.model["steady_window"] is True and warning not in long.warnings


def test_densevm_dying_mid_run_gives_failed_partial_result(fakes, monkeypatch):
    monkeypatch.setenv("FAKE_DENSEVM_DIE_AFTER", "1.2")
    result = run(small_config(fakes, duration=5), bins=Binaries.find())
    assert result.status == "failed"
    assert "simulated pager failure" in result.error
    assert result.boot_seconds == 0.3  # what was measured before the failure is kept
    doc = json.loads((fakes / "run" / "result.json").read_text())
    assert doc["status"] == "failed" and doc["error"] == result.error
    assert not any(alive(p) for p in started_pids(fakes))


def test_zipfperf_failure_ends_the_run_cleanly(fakes, monkeypatch):
    monkeypatch.setenv("FAKE_ZIPFPERF_FAIL", "1")
    result = run(small_config(fakes), bins=Binaries.find())
    assert result.status == "failed" and "zipfperf (calibrate) exited with status 1" in result.error
    assert "simulated failure" in result.error
    assert not any(alive(p) for p in started_pids(fakes))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_scalebench_tears_everything_down(fakes, sig):
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "scalebench.cli",
            "--vms",
            "20",
            "--duration",
            "30",
            "--warmup",
            "30",
            "-q",
            "--out",
            str(fakes / "run"),
            "--addr-base",
            "127.43.0.0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 20
    while (
        len(started_pids(fakes)) < 2 and time.monotonic() < deadline
    ):  # densevm and warm-up zipfperf
        time.sleep(0.1)
    assert len(started_pids(fakes)) >= 2
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    doc = json.loads((fakes / "run" / "result.json").read_text())
    assert doc["status"] == "failed" and doc["error"] == f"interrupted by {sig.name}"
    assert not any(alive(p) for p in started_pids(fakes))


def test_cli_reports_failure_with_exit_1(fakes, monkeypatch):
    monkeypatch.setenv("FAKE_ZIPFPERF_FAIL", "1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalebench.cli",
            "--vms",
            "5",
            "--duration",
            "1",
            "-q",
            "--out",
            str(fakes / "run"),
            "--json",
            str(fakes / "copy.json"),
            "--addr-base",
            "127.43.0.0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("scalebench: error: zipfperf")
    assert json.loads((fakes / "copy.json").read_text())["status"] == "failed"


def test_a_calibration_phase_that_paged_gives_way_to_the_stored_one(fakes, monkeypatch):
    from scalebench import calibration

    calibration.store_cpu_us("small", 250.0, 100, "an earlier run")
    monkeypatch.setenv("FAKE_DENSEVM_PAGES_EARLY", "1")
    result = run(small_config(fakes), bins=Binaries.find())
    assert result.status == "ok", result.error
    doc = json.loads((fakes / "run" / "result.json").read_text())
    assert {k: doc["calibration"][k] for k in ("cpu_us", "source")} == {
        "cpu_us": 250.0,
        "source": "stored",
    }
    assert any("calibration phase paged" in w for w in doc["warnings"])
    assert calibration.load_cpu_us("small") == 250.0  # the overestimate was not stored


def test_the_host_time_per_fault_is_calibrated_by_the_settle_phase(fakes):
    from scalebench import calibration

    # The fake serves as fast paging as in core, so the in-core cost comes from the flag:
    # what the settle phase's requests leave of its time must be positive.
    result = run(small_config(fakes, cpu_us=1.0), bins=Binaries.find())
    assert result.status == "ok", result.error
    cal = result.calibration
    assert cal["fault_source"].startswith("settle phase"), cal
    # What the requests left of the settle phase's time, shared by its faults.
    settle = [row for row in result.timeseries if row["phase"] == "settle"]
    first, last = settle[len(settle) // 2], settle[-1]
    dt = last["t"] - first["t"]
    rps, faults_s = (
        (last["requests"] - first["requests"]) / dt,
        (last["faults"] - first["faults"]) / dt,
    )
    expected = (1 - rps * cal["cpu_us"] * 1e-6) / faults_s * 1e6
    assert cal["fault_us"] == pytest.approx(expected, rel=0.35)
    assert result.model["fault_us"] == pytest.approx(cal["fault_us"])
    assert calibration.load_fault_us(result.config["block_bytes"]) == pytest.approx(cal["fault_us"])
    # A flag still wins.
    flagged = run(small_config(fakes, cpu_us=1.0, fault_us=40.0), bins=Binaries.find())
    assert flagged.calibration["fault_source"] == "flag" and flagged.model["fault_us"] == 40.0


def test_the_swap_devices_time_a_block_is_recorded_and_a_drift_after_calibration_warned(
    fakes, monkeypatch
):
    # The FAKE densevm spends 0.1 s of I/O a second on 100 blocks: 1 ms a block throughout.
    steady = run(small_config(fakes, cpu_us=1.0), bins=Binaries.find())
    assert steady.status == "ok", steady.error
    assert steady.swap_io_us_per_block["settle"] == pytest.approx(1000.0, rel=0.2)
    assert steady.swap_io_us_per_block["measure"] == pytest.approx(1000.0, rel=0.2)
    assert not [w for w in steady.warnings if "swap device" in w]
    # Its device slows 4x when the load begins, after the settle phase calibrated.
    monkeypatch.setenv("FAKE_IO_SLOWS", str(fakes / "slow"))
    drifted = run(small_config(fakes, cpu_us=1.0), bins=Binaries.find())
    assert drifted.status == "ok", drifted.error
    then, now = (drifted.swap_io_us_per_block[k] for k in ("settle", "measure"))
    assert now / then == pytest.approx(4.0, rel=0.25)
    [warning] = [w for w in drifted.warnings if "swap device" in w]
    assert "in the settle phase" in warning and "measured/model" in warning
    # A modeled disk's time counts in the measurement only (the settle phase suspends the
    # model): no warning for that.
    (fakes / "slow").unlink()
    modeled = run(small_config(fakes, cpu_us=1.0, disk="hdd"), bins=Binaries.find())
    assert modeled.status == "ok", modeled.error
    assert modeled.swap_io_us_per_block["measure"] > 2 * modeled.swap_io_us_per_block["settle"]
    assert not [w for w in modeled.warnings if "swap device" in w]


def test_swap_io_a_block_is_the_io_time_over_blocks_read_and_written():
    from scalebench.runner import swap_io_us_per_block

    first = {"swap_read_bytes": 0, "swap_write_bytes": 0, "io_seconds": 1.0}
    last = {"swap_read_bytes": 3 << 15, "swap_write_bytes": 1 << 15, "io_seconds": 1.008}
    assert swap_io_us_per_block(first, last, 1 << 15) == pytest.approx(2000.0)
    assert swap_io_us_per_block(first, first, 1 << 15) is None


def test_regime_counts_misses_not_faults():
    mib = 1 << 20
    assert classify(requests=10_000, swap_read_bytes=0, footprint_bytes=mib) == "in-core"
    assert classify(requests=10_000, swap_read_bytes=19 * mib, footprint_bytes=mib) == "in-core"
    assert classify(requests=10_000, swap_read_bytes=20 * mib, footprint_bytes=mib) == "disk-bound"
    # Fig 8's wsswap at 1,100 VMs: 3 faults per miss, one miss per 185 requests. Counting
    # faults (0.017 per request) called this in core at a sixth of the in-core throughput.
    assert classify(requests=144_400, swap_read_bytes=820_412_416, footprint_bytes=mib) == (
        "disk-bound"
    )


def test_a_faults_host_time_is_what_the_requests_and_wakes_leave_of_the_second():
    from scalebench.model import DEFAULT_WAKE_CPU_US
    from scalebench.runner import Window, host_us_per_fault

    # 200 requests/s of 100 us each, 10 faults each: 0.98 s for 2,000 faults.
    assert host_us_per_fault(Window(200.0, 10.0, 1), 100.0) == pytest.approx(490.0)
    # A quarter of them woke a VM: the model charges those apart, so they are taken out.
    woke = Window(200.0, 10.0, 1, wakes_per_request=0.25)
    spare = 1.0 - 200 * (100.0 + 0.25 * DEFAULT_WAKE_CPU_US) * 1e-6
    assert host_us_per_fault(woke, 100.0) == pytest.approx(spare / 2000 * 1e6)
    assert host_us_per_fault(Window(200.0, 0.0, 0), 100.0) is None
    assert host_us_per_fault(Window(20_000.0, 1.0, 1), 100.0) is None  # no time left


def test_a_phase_that_read_from_swap_does_not_calibrate_the_in_core_cost():
    from scalebench.runner import Window

    assert Window(14_000.0, 0.001, 0).in_core
    assert not Window(14_000.0, 0.2, 0).in_core  # zero-fill faults cost CPU too
    # wsswap's warm-up at 1,100 VMs: few faults per request, disk-bound all the same.
    assert not Window(2_554.0, 0.017, 200 << 20).in_core


def test_footprint_and_calibration_window_helpers():
    vms = [
        {"id": i, "requests": 100 - i, "resident_bytes": (1 << 20) if i < 30 else 0}
        for i in range(100)
    ]
    assert hot_footprint(vms) == 1 << 20
    # Out of core (as densevm reported for 40 VMs in 16M): evicted VMs keep 2 blocks, resident
    # ones 31-33.
    blocks = (
        [2] * 13 + [31] * 3 + [32] * 3 + [9, 4, 4, 15, 8, 29, 24, 1, 27, 33, 10, 14, 23, 30, 17, 3]
    )
    out_of_core = [
        {"id": i, "requests": 7, "resident_bytes": 32768 * b} for i, b in enumerate(blocks)
    ]
    # The mean of the sizes near the most common (31-33 and 29-30 blocks), not the largest.
    assert hot_footprint(out_of_core) == round(32768 * (3 * 31 + 3 * 32 + 29 + 30 + 33) / 9)
    # In core: a few busy VMs hold extra connection state; the typical VM is the footprint.
    in_core = [
        {"id": i, "requests": 9, "resident_bytes": 32768 * (31 if i > 5 else 40 + i)}
        for i in range(50)
    ]
    assert hot_footprint(in_core) == 31 * 32768
    # Near the cliff most resident VMs hold an extra block: the mean tells how many fit.
    near_cliff = [
        {"id": i, "requests": 3, "resident_bytes": 32768 * b}
        for i, b in enumerate([32] * 720 + [31] * 286 + [33] * 20 + [0] * 38 + [2] * 27 + [39])
    ]
    assert (1 << 30) // hot_footprint(near_cliff) == 1032
    assert hot_footprint([{"id": 0, "requests": 0, "resident_bytes": 5}]) is None


def test_touch_reports_vms_that_do_not_answer():
    import socket
    import threading

    from scalebench.touch import touch_all

    srv = socket.socket()
    srv.bind(("127.43.200.1", 0))
    srv.listen(4)
    port = srv.getsockname()[1]

    def answer_once() -> None:
        c, _ = srv.accept()
        c.recv(4096)
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello")
        c.close()

    threading.Thread(target=answer_once, daemon=True).start()
    done = []
    # VM 1 (127.43.200.1) answers; VMs 0 and 2 have nothing listening.
    assert touch_all("127.43.200.0", port, [2, 1, 0], 2, 5.0, done.append) == [0, 2]
    assert done == [1, 2, 3]
    srv.close()


def test_touch_order_leaves_an_lru_steady_state():
    from scalebench.model import che_hit_ratio, zipf_popularity
    from scalebench.touch import lru_order

    n, k, alpha = 400, 100, 1.0
    order = lru_order(n, alpha, seed=3)
    assert sorted(order) == list(range(n))
    # The k VMs touched last are what an LRU cache holds: their request share is its hit ratio.
    resident = order[-k:]
    share = float(zipf_popularity(n, alpha)[resident].sum())
    assert share == pytest.approx(che_hit_ratio(n, k, alpha), abs=0.04)
    assert 0 in resident  # the most popular VM


def test_resident_mass():
    from scalebench.runner import resident_mass

    vms = [{"id": i, "resident_bytes": (1 << 20) if i in (0, 2) else 65536} for i in range(3)]
    # Zipf(1) over 3 VMs: 1, 1/2, 1/3 over 11/6.
    assert resident_mass(vms, 1 << 20, 1.0) == pytest.approx((1 + 1 / 3) / (11 / 6))
