"""scalebench nightly: change-point detection on synthetic series, the history store, verdicts
and exit codes, and the history report in headless Chromium."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import RELEASE_DIR, release_binary
from scalebench.changepoint import Finding, assess, assess_host, estimate
from scalebench.config import ConfigError
from scalebench.history import History, Run
from scalebench.nightly import (
    EXIT_CLEAN,
    EXIT_NOISY,
    EXIT_REGRESSION,
    METRICS,
    HostNoise,
    Metric,
    Outcome,
    Probe,
    Spec,
    decide,
    gate,
    judge,
    load_spec,
    run_probe,
)
from scalebench.scaling import Build, Session, descendants, tree_cpu
from test_scalebench_report import images_state

RUNS, TRIALS = 10, 9


def noisy_runs(seed: int, runs: int, level: float = 100.0) -> list[list[float]]:
    """`runs` runs of TRIALS samples around `level` with 5% noise."""
    rng = np.random.default_rng(seed)
    return [list(rng.normal(level, 0.05 * level, TRIALS)) for _ in range(runs)]


@pytest.mark.parametrize("seed", range(5))
def test_a_10pct_step_under_5pct_noise_is_found(seed):
    history = noisy_runs(seed, RUNS) + noisy_runs(seed + 100, 1, level=90.0)
    finding = assess("rps", history, higher_is_better=True)
    assert finding.regression, finding
    assert finding.change is not None and -0.15 < finding.change < -0.05
    assert finding.newest is not None and finding.newest.ci_high < 100


@pytest.mark.parametrize("seed", range(5))
def test_a_step_that_began_inside_the_previous_run_is_found_on_the_newest(seed):
    """The previous run's later rounds already shifted, too few for its own confidence interval
    to exclude the earlier median: the step is raised on the newest run, not lost for good."""
    before, after = noisy_runs(seed, RUNS + 1), noisy_runs(seed + 100, 2, level=88.0)
    previous = before[-1][:4] + after[0][4:]
    finding = assess("rps", [*before[:-1], previous, after[1]], higher_is_better=True)
    assert finding.regression, finding
    assert finding.earlier_median is not None and finding.earlier_median > 95


@pytest.mark.parametrize("seed", range(5))
def test_a_step_at_the_start_of_a_too_noisy_previous_run_is_judged_on_the_newest(seed):
    """The previous run was judged too noisy, so the step it began with was not reported then:
    the newest run judges it. Had the previous run been judged, the step was its to report."""
    history = noisy_runs(seed, RUNS) + noisy_runs(seed + 100, 2, level=88.0)
    finding = assess("rps", history, higher_is_better=True, previous_noisy=True)
    assert finding.regression, finding
    assert finding.earlier_median is not None and finding.earlier_median > 95
    assert not assess("rps", history, higher_is_better=True).regression


@pytest.mark.parametrize("seed", range(5))
def test_pure_noise_is_not_flagged(seed):
    assert not assess("rps", noisy_runs(seed, RUNS + 1), higher_is_better=True).regression


def test_a_step_in_the_good_direction_is_not_a_regression():
    history = noisy_runs(1, RUNS) + noisy_runs(101, 1, level=110.0)
    assert not assess("rps", history, higher_is_better=True).regression
    assert assess("latency", history, higher_is_better=False).regression


def test_a_short_history_is_not_judged():
    finding = assess("rps", noisy_runs(1, 2) + noisy_runs(101, 1, level=50.0), True)
    assert not finding.regression and "history too short" in finding.reason


@pytest.mark.parametrize("seed", range(3))
def test_a_slower_host_is_seen_without_a_change_point(seed):
    runs = noisy_runs(seed, RUNS)
    slower = [v * 0.8 for v in noisy_runs(seed + 100, 1)[0]]
    assert assess_host("h", [*runs, slower], higher_is_better=True).regression
    assert not assess_host("h", noisy_runs(seed, RUNS + 1), higher_is_better=True).regression
    assert not assess_host("h", [*runs[:3], slower], higher_is_better=True).regression


def test_estimate_is_the_median_inside_its_interval():
    e = estimate([10.0, 11.0, 9.0, 10.5, 9.5])
    assert e.median == 10.0 and e.ci_low <= 10.0 <= e.ci_high and e.n == 5
    assert estimate([3.0]).ci_low == estimate([3.0]).ci_high == 3.0


def make_run(verdict: str, samples: dict[str, list[float]], busy: str | None = None) -> Run:
    return Run(
        "2026-11-24T00:00:00+00:00",
        "2026-11-24T00:05:00+00:00",
        "quick",
        "abc123",
        {"load_start": [0.5, 0.4, 0.3], "steal_fraction": 0.01, "busy": busy},
        verdict,
        samples,
    )


def test_history_round_trip(tmp_path):
    path = tmp_path / "h.sqlite"
    store = History(path)
    first = store.append(make_run("baseline", {"a": [1.0, 2.0, 3.0], "b": [5.0]}))
    store.append(make_run("noisy", {"a": [100.0]}, busy="steal time 30% of CPU time"))
    store.append(make_run("clean", {"a": [4.0, 5.0]}))
    store.append(make_run("noisy", {"a": [6.0]}))
    store.close()
    store = History(path)
    runs = store.runs()
    assert [r.verdict for r in runs] == ["baseline", "noisy", "clean", "noisy"]
    assert runs[0].id == first and runs[0].samples == {"a": [1.0, 2.0, 3.0], "b": [5.0]}
    assert runs[0].host["load_start"] == [0.5, 0.4, 0.3] and runs[0].mode == "quick"
    # A busy host's run is left out; one whose suspects the host explained counts.
    assert store.series("a") == [[1.0, 2.0, 3.0], [4.0, 5.0], [6.0]]
    assert store.previous_noisy("a") and not store.previous_noisy("b")
    store.close()


HOST_SHIFT = Spec(
    1,
    {},
    [Metric("host_nginx", "higher", host=True), Metric("incore", "higher", host_ref="host_nginx")],
)


def night(store: History, seed: int, host: float, incore: float) -> tuple[str, int]:
    """One nightly judged against `store` and appended to it: the host reference and the in-core
    metric measured at the given levels, 1% noise."""
    rng = np.random.default_rng(seed)
    samples = {"host_nginx": list(rng.normal(host, 0.01 * host, TRIALS))}
    samples["incore"] = list(rng.normal(incore, 0.01 * incore, TRIALS))
    names = [m.name for m in HOST_SHIFT.metrics]
    verdict, code = decide(gate(HOST_SHIFT, judge(HOST_SHIFT, names, [samples], store)), None)
    store.append(make_run(verdict, samples))
    return verdict, code


def test_a_lasting_host_slowdown_becomes_the_history(tmp_path):
    """The host measures 6% slower from one night on, and the in-core point 10% slower with it:
    the first two nights are too noisy to judge, then the host's new level is the history (before,
    every later night was judged against the old host and reported too noisy for good)."""
    store = History(tmp_path / "h.sqlite")
    for seed in range(5):
        assert night(store, seed, 100.0, 100.0)[1] == EXIT_CLEAN
    verdicts = [night(store, 10 + seed, 94.0, 90.0)[1] for seed in range(4)]
    assert verdicts == [EXIT_NOISY, EXIT_NOISY, EXIT_CLEAN, EXIT_CLEAN]
    store.close()


def test_a_step_the_host_hid_is_reported_once_the_host_recovers(tmp_path):
    """A 10% step lands on a night the host measured 6% slower (too noisy to judge); the next
    night the host is back and the step stayed: the build's, reported then."""
    store = History(tmp_path / "h.sqlite")
    for seed in range(5):
        night(store, seed, 100.0, 100.0)
    assert night(store, 10, 94.0, 90.0) == ("noisy", EXIT_NOISY)
    assert night(store, 11, 100.0, 90.0) == ("regression", EXIT_REGRESSION)
    store.close()


def test_a_file_that_is_not_a_history_is_refused(tmp_path):
    bad = tmp_path / "h.sqlite"
    bad.write_text("not a database " * 100)
    with pytest.raises(ValueError, match="not a nightly history"):
        History(bad)


def outcome(regression: bool, reason: str = "x", host: bool = False, name: str = "") -> Outcome:
    name = name or ("host_ref" if host else "m")
    change, earlier = (-0.12, 1.7) if regression else (None, None)
    finding = Finding(name, regression, reason, change, earlier_median=earlier)
    return Outcome(name, estimate([1.0, 2.0]), finding, host=host)


# Two host references, each gating its own path, and one metric gated by every host metric.
GATED = Spec(
    1,
    {},
    [
        Metric("host_nginx", "higher", host=True),
        Metric("host_disk", "higher", host=True),
        Metric("incore", "higher", host_ref="host_nginx"),
        Metric("ooc", "higher", host_ref="host_disk"),
        Metric("faults", "higher"),
    ],
)


def test_verdicts_and_exit_codes():
    assert decide([outcome(False), outcome(True)], None) == ("regression", EXIT_REGRESSION)
    assert decide([outcome(True)], "load average 9.0 on 2 CPUs") == ("noisy", EXIT_NOISY)
    assert decide([outcome(False)], "load average 9.0 on 2 CPUs") == ("clean", EXIT_CLEAN)
    assert decide([outcome(False, "history too short (0)")], None) == ("baseline", EXIT_CLEAN)


def test_a_slower_host_makes_a_regression_noisy_and_is_never_one_itself():
    slower_disk = outcome(True, host=True, name="host_disk")
    quiet_nginx = outcome(False, host=True, name="host_nginx")
    ooc = gate(GATED, [quiet_nginx, slower_disk, outcome(True, name="ooc")])
    assert ooc[2].host_slower == "the host itself measured slower: host_disk -12.0%"
    assert ooc[2].line().endswith("not judged, the host itself measured slower: host_disk -12.0%")
    assert decide(ooc, None) == ("noisy", EXIT_NOISY)
    assert decide(gate(GATED, [slower_disk, outcome(False, name="ooc")]), None) == (
        "clean",
        EXIT_CLEAN,
    )
    assert gate(GATED, [quiet_nginx, outcome(True, name="ooc")])[1].host_slower is None
    assert slower_disk.line().endswith("HOST SLOWER")


def test_a_host_reference_that_dropped_by_half_the_change_explains_it():
    """The disk reference is noisier than the out-of-core point: a -7% drop is within its own
    noise, yet it explains most of the point's -8%."""
    disk = outcome(False, host=True, name="host_disk")
    suspect = outcome(True, name="ooc")
    for change, gated in ((-0.073, True), (-0.03, False), (+0.07, False)):
        disk_now = replace(disk, finding=replace(disk.finding, change=change))
        judged = gate(
            GATED, [disk_now, replace(suspect, finding=replace(suspect.finding, change=-0.083))]
        )
        assert bool(judged[1].host_slower) is gated, change


def test_a_flagged_host_explains_up_to_four_times_its_own_change_not_more():
    """Measured: nginx flagged at -2.2% beside the unchanged build's +5.5% (the host's), and at
    -3.3% beside a 9 us per request slowdown's +61% of the monitor's CPU per reply (the build's)."""
    nginx = outcome(True, host=True, name="host_nginx")
    suspect = outcome(True, name="incore")
    for ref_change, change, gated in ((-0.022, 0.055, True), (-0.033, 0.61, False)):
        host_now = replace(nginx, finding=replace(nginx.finding, change=ref_change))
        judged = gate(
            GATED, [host_now, replace(suspect, finding=replace(suspect.finding, change=change))]
        )
        assert bool(judged[1].host_slower) is gated, (ref_change, change)
        assert decide(judged, None)[1] == (EXIT_NOISY if gated else EXIT_REGRESSION)


def test_a_host_reference_gates_only_the_metrics_that_name_it():
    slower_disk = outcome(True, host=True, name="host_disk")
    # The disk being slow says nothing about the in-core path: its regression stands.
    both = gate(GATED, [slower_disk, outcome(True, name="incore"), outcome(True, name="ooc")])
    assert both[1].host_slower is None and both[2].host_slower
    assert decide(both, None) == ("regression", EXIT_REGRESSION)
    # A metric with no host_ref is gated by any host metric measured slower.
    faults = gate(GATED, [slower_disk, outcome(True, name="faults")])
    assert faults[1].host_slower and decide(faults, None) == ("noisy", EXIT_NOISY)


def test_host_noise_names_a_busy_host():
    host = HostNoise(2, [7.5, 6.0, 5.0], others_fraction=0.7)
    assert "other tenants used 70% of the host's CPU time" in (host.busy() or "")
    assert HostNoise(2, [7.5, 6.0, 5.0], others_fraction=0.2).busy() is None
    # One busy core of two (measured: 46-47%) cuts the tiny in-core probe fivefold.
    assert "47%" in (HostNoise(2, [2.0, 2.0, 2.0], others_fraction=0.47).busy() or "")
    assert "steal" in (HostNoise(2, [0.1, 0.1, 0.1], steal_fraction=0.3).busy() or "")


def test_host_noise_measures_a_span():
    host = HostNoise.start()
    sum(i * i for i in range(200_000))  # some CPU of our own
    host.finish()
    record = host.record()
    assert 0.0 <= record["others_fraction"] <= 1.0 and 0.0 <= record["steal_fraction"] <= 1.0
    assert len(record["load_end"]) == 3 and "stat_start" not in record


def test_the_repository_metrics_file_is_valid():
    spec = load_spec(METRICS)
    names = {m.name for m in spec.metrics}
    assert {"incore16_rps", "ooc64_rps", "fault_scaling_4000_over_250"} <= names
    quick = {m.name: m for m in spec.quick().metrics}
    assert "incore16_cpu_us_per_reply" in quick and quick["host_nginx16_rps"].host
    assert {p.name for p in spec.probes_of([m.name for m in spec.quick().metrics])} == {
        "nginx16",
        "disk32k",
        "incore16",
        "ooc64",
    }
    assert (
        quick["ooc64_rps"].host_ref == "host_disk_ios_per_s" and quick["host_disk_ios_per_s"].host
    )


def test_the_disk_reference_measures_random_io_on_a_scratch_file(tmp_path):
    probe = Probe("disk", server="disk", block="32k", windows=2, window_s=0.3)
    values = run_probe(Build(Path("unused"), Path("unused")), probe, tmp_path, "127.91.0.0")
    assert len(values["ios_per_s"]) == 2 and min(values["ios_per_s"]) > 10, values
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('metrics = [{name = "a", probe = "p", field = "boot_seconds", better = "up"}]', "better"),
        (
            'metrics = [{name = "a", probe = "nope", field = "boot_seconds", better = "higher"}]',
            "probe",
        ),
        ('metrics = [{name = "a", ratio = ["x", "y"], better = "higher"}]', "ratio"),
        ("rounds = 0", "rounds"),
        (
            'metrics = [{name = "a", probe = "p", field = "boot_seconds", better = "higher", '
            'host_ref = "a"}]',
            "host_ref must name a host metric defined above it",
        ),
    ],
)
def test_bad_metrics_files_are_refused(tmp_path, text, message):
    path = tmp_path / "m.toml"
    path.write_text(f'{text}\n[probe.p]\nvms = 2\nmem = "16M"\n')
    with pytest.raises(ConfigError, match=message):
        load_spec(path)


@pytest.mark.parametrize(
    ("probe", "field", "message"),
    [
        ('server = "nginx"', "boot_seconds", "probe p measures only replies_per_s, cpu_us_per_"),
        ('server = "disk"', "replies_per_s", "probe p measures only ios_per_s"),
        ('server = "apache"', "replies_per_s", "server must be one of densevm, nginx, disk"),
    ],
)
def test_the_host_reference_probe_is_checked(tmp_path, probe, field, message):
    path = tmp_path / "m.toml"
    metric = f'{{name = "a", probe = "p", field = "{field}", better = "higher"}}'
    path.write_text(f"metrics = [{metric}]\n[probe.p]\nvms = 2\nwindows = 1\n{probe}\n")
    with pytest.raises(ConfigError, match=message):
        load_spec(path)


TINY = """
rounds = 1
addr_base = "127.91.0.0"  # not the real nightly's
metrics = [
  { name = "tiny_rps", probe = "tiny", field = "replies_per_s", better = "higher", quick = true },
]
[probe.tiny]
vms = 2
mem = "16M"
concurrency = 4
windows = 3
window_s = 0.5
"""


def nightly_cli(tmp: Path, *args: str, metrics_text: str = TINY) -> subprocess.CompletedProcess:
    metrics = tmp / "tiny.toml"
    metrics.write_text(metrics_text)
    return subprocess.run(
        [sys.executable, "-m", "scalebench.cli", "nightly", "--metrics", str(metrics), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp,
        env={**os.environ, "SCALEBENCH_BIN_DIR": str(RELEASE_DIR)},
    )


def test_bad_input_exits_2(tmp_path):
    proc = nightly_cli(tmp_path, "--rounds", "0")
    assert proc.returncode == 2 and proc.stderr.startswith("scalebench: error: --rounds")


def test_a_probe_that_cannot_run_exits_1_naming_it(tmp_path):
    release_binary("densevm")
    bad = TINY.replace('mem = "16M"', 'mem = "lots"')
    proc = nightly_cli(tmp_path, "--history", str(tmp_path / "h.sqlite"), metrics_text=bad)
    assert proc.returncode == 1
    assert "scalebench: nightly: probe tiny failed: densevm failed: " in proc.stderr


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_injected_fault_work_is_kernel_cpu_per_fault(tmp_path):
    # The lever for "kernel CPU per fault rose": its work must show as kernel time, per fault.
    release_binary("densevm")
    build = Build.in_dir(RELEASE_DIR, ("--inject-fault-us", "1000"))
    # 8 working sets of 896 KiB in a 3 MiB budget: every request faults.
    with Session(build, tmp_path, 8, "127.91.0.0", "--mem", "3M") as session:
        window = session.window(2.0, alpha=0.0, concurrency=8)
    assert window.faults > 100
    assert window.kernel_us_per_fault > 800, window
    # The pager is densevm's parent: the work is its kernel time, not the cells'.
    assert 800 < window.pager_kernel_us_per_fault <= window.kernel_us_per_fault, window
    assert window.user_us_per_fault < 500, window


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_injected_request_work_is_monitor_cpu_per_reply(tmp_path):
    # The lever for "the in-core path slowed": its work is the monitor's, per reply.
    release_binary("densevm")
    build = Build.in_dir(RELEASE_DIR, ("--inject-request-us", "1000"))
    with Session(build, tmp_path, 8, "127.91.0.0", "--mem", "16M") as session:
        window = session.window(2.0, alpha=0.0, concurrency=8)
    assert window.replies > 100
    assert 900 < window.monitor_us_per_reply < 2000, window
    assert window.monitor_us_per_reply < window.cpu_us_per_reply, window


SPINNERS = """
import ctypes, sys, threading, time
libc = ctypes.CDLL(None)
def spin(name):
    libc.prctl(15, name.encode(), 0, 0, 0)  # PR_SET_NAME: this thread's comm
    end = time.monotonic() + 3.0
    while time.monotonic() < end:
        pass
threads = [threading.Thread(target=spin, args=(n,)) for n in ("vcpu0", "eventloop")]
for t in threads:
    t.start()
print("go", flush=True)
for t in threads:
    t.join()
"""


def test_tree_cpu_counts_grandchildren(tmp_path):
    # densevm's vCPU threads run in holders, children of its cells: two levels down.
    spinner = "import time\nend = time.monotonic() + 3.0\nwhile time.monotonic() < end:\n    pass\n"
    run = "import subprocess, sys; subprocess.run([sys.executable, '-c', {!r}])"
    proc = subprocess.Popen([sys.executable, "-c", run.format(run.format(spinner))])
    try:
        deadline = time.monotonic() + 5.0
        while len(descendants(proc.pid)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(descendants(proc.pid)) == 3
        # The grandchild is the one spinning: whatever CPU a loaded host gives it, the
        # tree's figure includes it.
        [grandchild] = [p for p in descendants(proc.pid)[1:] if parent_of(p) != proc.pid]
        before, spun_before = tree_cpu(proc.pid), own_cpu(grandchild)
        time.sleep(1.5)
        spun = own_cpu(grandchild) - spun_before
        after = tree_cpu(proc.pid)
    finally:
        proc.wait()
    assert spun > 0.05, spun
    assert (after.user + after.kernel) - (before.user + before.kernel) >= spun - 0.02, (
        before,
        after,
        spun,
    )


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def own_cpu(pid: int) -> float:
    """User and kernel CPU seconds of process `pid` alone."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_tree_cpu_leaves_vcpu_threads_out_of_the_monitor_share(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SPINNERS], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "go\n"
    before = tree_cpu(proc.pid)
    time.sleep(1.5)
    after = tree_cpu(proc.pid)
    proc.wait()
    total = (after.user + after.kernel) - (before.user + before.kernel)
    monitor = after.monitor - before.monitor
    # Two spinning threads share the GIL: the one named vcpu0 has about half of the time.
    assert total > 0.5, (before, after)
    assert 0.2 * total < monitor < 0.8 * total, (before, after)


@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_nightly_records_history_and_flags_a_collapse(tmp_path):
    release_binary("densevm")
    history = tmp_path / "h.sqlite"
    # A/B against the same binaries, interleaved: judged by the comparison, recorded in history.
    proc = nightly_cli(
        tmp_path,
        *("--compare-bin", str(RELEASE_DIR), "--history", str(history)),
        *("--out", str(tmp_path / "r0")),
    )
    assert proc.returncode in (EXIT_CLEAN, EXIT_REGRESSION, EXIT_NOISY), proc.stderr
    assert "vs comparison build" in proc.stdout and "build B" in proc.stderr
    doc = json.loads((tmp_path / "r0" / "nightly.json").read_text())
    assert len(doc["samples"]["tiny_rps"]) == len(doc["comparison"]["tiny_rps"]) == 3
    assert {"load_start", "steal_fraction", "others_fraction", "cpu_mhz"} <= doc["host"].keys()
    # An earlier history ten times faster than this build: the newest run is a collapse.
    store = History(history)
    for seed in range(6):
        rng = np.random.default_rng(seed)
        level = 10 * max(doc["samples"]["tiny_rps"])
        store.append(make_run("clean", {"tiny_rps": list(rng.normal(level, 0.02 * level, 3))}))
    store.close()
    proc = nightly_cli(tmp_path, "--history", str(history), "--out", str(tmp_path / "r1"))
    assert proc.returncode in (EXIT_REGRESSION, EXIT_NOISY), proc.stdout + proc.stderr
    assert "measuring once more" in proc.stderr
    doc = json.loads((tmp_path / "r1" / "nightly.json").read_text())
    assert doc["host"]["remeasured"] == ["tiny_rps"]
    if proc.returncode == EXIT_REGRESSION:
        change = re.search(r"REGRESSION in tiny_rps (-[\d.]+)%", proc.stdout)
        assert change and -97 < float(change.group(1)) < -75, proc.stdout  # about -90%
    else:
        assert "host too noisy" in proc.stdout and doc["host"]["busy"]
    assert len(History(history).runs()) == 8
    assert History(history).runs()[-1].host["remeasured"] == ["tiny_rps"]


def test_history_report_images_load_in_headless_chromium(tmp_path):
    history = tmp_path / "h.sqlite"
    store = History(history)
    for i, run in enumerate(noisy_runs(3, 8) + noisy_runs(4, 3, level=90.0)):
        store.append(make_run("noisy" if i == 2 else "clean", {"a": run, "b": run[:3]}))
    store.close()
    out = tmp_path / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "scalebench.cli",
            "report",
            "--history",
            str(history),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    page = out / "index.html"
    assert 'src="a.png"' in page.read_text() and 'src="b.png"' in page.read_text()
    assert images_state(page, tmp_path / "profile") == "ok:2"
