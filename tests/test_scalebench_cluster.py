"""`scalebench sweep --cluster` on a real dask cluster of two "hosts" on this machine.

Each test starts a dask scheduler and two workers (`python -m dask scheduler|worker`,
as the README's fleet does), each worker a "host" of its own by configuration:
its name (SCALEBENCH_HOST_NAME), its VMs' loopback range (SCALEBENCH_HOST_ADDR_BASE)
and its work directory. Points are real, tiny scalebench runs (densevm and zipfperf).
Workers run without a nanny, so a killed worker stays dead, as a lost host does.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import dask
import distributed  # the cluster extra, which `make test` installs
import pytest
from conftest import release_binary
from test_scalebench_e2e import processes_mentioning

HOSTS = {"host-a": "127.63.0.0", "host-b": "127.64.0.0"}
GRID = """
name = "cl"
[base]
mem = "64M"
duration = {duration}
warmup = 0.5
cpu_us = 100.0
concurrency = 8
addr_base = "127.65.0.0"
[grid]
vms = [4, 6, 8]
policy = ["demand", "wsswap"]
[[plot]]
name = "tput"
x = "vms"
y = ["throughput_rps", "model_rps"]
series = ["policy"]
[[check]]
kind = "model_agreement"
"""


@dataclass
class Cluster:
    scheduler_file: Path
    workers: dict[str, subprocess.Popen]  # host name -> its worker process
    work_dirs: dict[str, Path]


@contextmanager
def local_cluster(tmp: Path, kinds: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A scheduler and a worker per HOSTS entry; `kinds` gives some hosts a kind of their own."""
    bindir = release_binary("densevm").parent
    release_binary("zipfperf")
    env = {
        **os.environ,
        "SCALEBENCH_BIN_DIR": str(bindir),
        "SCALEBENCH_CALIBRATION": str(tmp / "cal.json"),
        # dask's scratch space (default: /tmp/dask-scratch-space, whose lock files outlive
        # the processes) in the test's own directory.
        "DASK_TEMPORARY_DIRECTORY": str(tmp / "dask"),
    }
    scheduler_file = tmp / "scheduler.json"
    started: list[subprocess.Popen] = []
    logs = tmp / "logs"
    logs.mkdir()

    def start(name: str, argv: list[str], extra_env: dict) -> subprocess.Popen:
        with open(logs / f"{name}.log", "w") as log:
            command = [
                sys.executable,
                "-m",
                "dask",
                *argv,
                "--scheduler-file",
                str(scheduler_file),
                "--no-dashboard",
            ]
            proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**env, **extra_env}, cwd=tmp
            )
        started.append(proc)
        return proc

    try:
        start("scheduler", ["scheduler", "--host", "127.0.0.1", "--port", "0"], {})
        workers, work_dirs = {}, {}
        for host, addr_base in HOSTS.items():
            work_dirs[host] = tmp / host
            host_env = {"SCALEBENCH_HOST_NAME": host, "SCALEBENCH_HOST_ADDR_BASE": addr_base}
            host_env["SCALEBENCH_WORK_DIR"] = str(work_dirs[host])
            if kinds and host in kinds:
                host_env["SCALEBENCH_HOST_KIND"] = kinds[host]
            workers[host] = start(
                host, ["worker", "--nthreads", "1", "--resources", "host=1", "--no-nanny"], host_env
            )
        deadline = time.monotonic() + 60
        while not scheduler_file.exists():
            assert time.monotonic() < deadline, (logs / "scheduler.log").read_text()
            time.sleep(0.2)
        with distributed.Client(scheduler_file=str(scheduler_file), timeout=60) as client:
            client.wait_for_workers(len(HOSTS), timeout=60)
        yield Cluster(scheduler_file, workers, work_dirs)
    finally:
        # Workers first: a worker whose scheduler is gone spends half a minute reconnecting
        # before it exits.
        for proc in reversed(started):
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def experiment(tmp: Path, duration: float = 1) -> Path:
    path = tmp / "grid.toml"
    path.write_text(GRID.format(duration=duration))
    return path


def sweep_command(tmp: Path, exp: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "scalebench.cli", "sweep", str(exp), "--out", str(out), *extra]


def sweep(tmp: Path, exp: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "SCALEBENCH_BIN_DIR": str(release_binary("densevm").parent),
        "SCALEBENCH_CALIBRATION": str(tmp / "cal.json"),
    }
    return subprocess.run(
        sweep_command(tmp, exp, out, *extra),
        check=False,
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )


def points(out: Path) -> dict[str, dict]:
    """The stored point results by point key."""
    docs = [json.loads(path.read_text()) for path in out.glob("points/*/result.json")]
    return {d["config"]["labels"]["point"]: d for d in docs}


def rows(path: Path) -> list[dict]:
    with open(path) as f:
        return list(csv.DictReader(f))


def wait_until_gone(text: str, timeout_s: float = 60) -> list[int]:
    """The processes still mentioning text after up to timeout_s (teardown takes seconds)."""
    deadline = time.monotonic() + timeout_s
    while processes_mentioning(text) and time.monotonic() < deadline:
        time.sleep(0.5)
    return processes_mentioning(text)


def test_a_grid_on_two_hosts_has_the_schema_of_a_local_sweep(tmp_path):
    exp = experiment(tmp_path)
    with local_cluster(tmp_path, kinds={"host-b": "host-b's kind"}) as cluster:
        proc = sweep(tmp_path, exp, tmp_path / "out", "--cluster", str(cluster.scheduler_file))
    assert proc.returncode == 0, proc.stderr
    assert "scalebench: warning: the points ran on 2 kinds of host" in proc.stderr
    done = points(tmp_path / "out")
    assert len(done) == 6 and all(
        d["status"] == "ok" and d["throughput_rps"] > 0 for d in done.values()
    )
    # Each point ran exactly once, on the host it names, in that host's address range.
    assert proc.stderr.count("  started ") == 6
    for d in done.values():
        assert [a["host"] for a in d["placement"]["attempts"]] == [d["host"]["hostname"]]
        assert d["placement"]["retried"] is False
        assert d["config"]["addr_base"] == HOSTS[d["host"]["hostname"]]
        assert (
            Path(d["files"]["plot"]).is_file()
            and Path(d["files"]["out"]).parent == tmp_path / "out" / "points"
        )
    assert {d["host"]["hostname"] for d in done.values()} == set(HOSTS)
    for host, work_dir in cluster.work_dirs.items():
        assert processes_mentioning(str(work_dir)) == [], host
        assert (
            list(work_dir.iterdir()) == []
        )  # each point's files went to the client and left the worker
    cluster_rows = rows(tmp_path / "out" / "results.csv")
    assert [r["retried"] for r in cluster_rows] == ["False"] * 6
    kinds = {r["host"]: r["host_kind"] for r in cluster_rows}
    assert kinds["host-b"] == "host-b's kind" and kinds["host-a"].endswith(("pvm", "kvm"))
    hosts = json.loads((tmp_path / "out" / "sweep.json").read_text())["hosts"]
    assert hosts == {kinds["host-a"]: ["host-a"], "host-b's kind": ["host-b"]}

    # One point of the same grid run locally: the same CSV columns, the same checks. (A short
    # directory name: densevm's control socket is in the point's directory, within 107 bytes.)
    local = sweep(tmp_path, exp, tmp_path / "l", "--only", "vms=4", "--only", "policy=demand")
    assert local.returncode == 0, local.stderr
    local_rows = rows(tmp_path / "l" / "results.csv")
    assert list(local_rows[0]) == list(cluster_rows[0])
    local_checks, cluster_checks = (
        rows(tmp_path / "l" / "checks.csv"),
        rows(tmp_path / "out" / "checks.csv"),
    )
    assert list(local_checks[0]) == list(cluster_checks[0])
    assert [(c["check"], c["group"]) for c in local_checks] == [
        (c["check"], c["group"]) for c in cluster_checks
    ]
    for name in ("tput.png", "sweep.json", "experiment.json"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    report = [sys.executable, "-m", "scalebench.cli", "report", str(tmp_path / "out")]
    assert subprocess.run(report, check=False, capture_output=True, timeout=120).returncode == 0
    assert "vms=8__policy=wsswap/result.json" in (tmp_path / "out" / "report.html").read_text()


def test_a_point_whose_worker_is_killed_is_run_again_elsewhere(tmp_path):
    exp = experiment(tmp_path, duration=3)
    with local_cluster(tmp_path) as cluster:
        env = {**os.environ, "SCALEBENCH_CALIBRATION": str(tmp_path / "cal.json")}
        client = subprocess.Popen(
            sweep_command(
                tmp_path,
                exp,
                tmp_path / "out",
                "--cluster",
                str(cluster.scheduler_file),
                "--only",
                "vms=4",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        victim = cluster.work_dirs["host-a"]
        deadline = time.monotonic() + 120
        while not any("densevm" in cmdline(pid) for pid in processes_mentioning(str(victim))):
            assert time.monotonic() < deadline and client.poll() is None, (
                "no point started on host-a"
            )
            time.sleep(0.1)
        killed_point = json.loads(next(victim.glob("*/*/config.json")).read_text())["labels"][
            "point"
        ]
        cluster.workers["host-a"].send_signal(signal.SIGKILL)
        _, stderr = client.communicate(timeout=300)
        # The worker's death reached the point's process: densevm, zipfperf and it are gone.
        assert processes_mentioning(str(victim)) == []
    assert client.returncode == 0, stderr
    done = points(tmp_path / "out")
    assert set(done) == {"vms=4,policy=demand", "vms=4,policy=wsswap"}
    assert all(d["status"] == "ok" for d in done.values())
    retried = done[killed_point]
    assert [a["host"] for a in retried["placement"]["attempts"]] == ["host-a", "host-b"]
    assert retried["placement"]["retried"] is True and retried["host"]["hostname"] == "host-b"
    (other,) = set(done) - {killed_point}
    assert done[other]["placement"]["retried"] is False
    by_point = {r["point"]: r["retried"] for r in rows(tmp_path / "out" / "results.csv")}
    assert sorted(by_point.values()) == ["False", "True"]
    assert "(retried)" in stderr
    # The killed attempt's own result, left on host-a: interrupted, its cgroup removed.
    (partial,) = victim.glob("*/*/result.json")
    partial_doc = json.loads(partial.read_text())
    assert partial_doc["error"] == "interrupted by SIGTERM"
    group = partial_doc["containment"].get("memory_group")
    assert group is None or not Path(group).exists()


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_an_interrupted_cluster_sweep_resumes_without_redoing_points(tmp_path):
    exp = experiment(tmp_path)
    out = tmp_path / "out"
    with local_cluster(tmp_path) as cluster:
        env = {**os.environ, "SCALEBENCH_CALIBRATION": str(tmp_path / "cal.json")}
        client = subprocess.Popen(
            sweep_command(tmp_path, exp, out, "--cluster", str(cluster.scheduler_file)),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        deadline = time.monotonic() + 200
        while len(list(out.glob("points/*/result.json"))) < 2:
            assert time.monotonic() < deadline and client.poll() is None, "no two points finished"
            time.sleep(0.1)
        client.send_signal(signal.SIGINT)
        _, stderr = client.communicate(timeout=120)
        assert client.returncode == 130, stderr
        assert "run the same command again to resume" in stderr
        kept = {name: d["run_id"] for name, d in points(out).items()}
        assert 2 <= len(kept) < 6
        # The points that were running when the client stopped are stopped on their hosts too.
        for work_dir in cluster.work_dirs.values():
            assert wait_until_gone(str(work_dir)) == []
        again = sweep(tmp_path, exp, out, "--cluster", str(cluster.scheduler_file))
    assert again.returncode == 0, again.stderr
    assert f"{len(kept)} of 6 point(s) already done: kept" in again.stderr
    done = points(out)
    assert len(done) == 6 and all(d["status"] == "ok" for d in done.values())
    assert {name: done[name]["run_id"] for name in kept} == kept  # not redone
    assert again.stderr.count("  started ") == 6 - len(kept)
    assert len(rows(out / "results.csv")) == 6


def test_workers_that_cannot_take_a_point_are_refused(tmp_path):
    from scalebench.cluster import check_hosts
    from scalebench.config import ConfigError

    def refused(resources: dict | None, workers: int, commit: str | None, message: str) -> None:
        with (
            dask.config.set({"temporary-directory": str(tmp_path)}),
            distributed.LocalCluster(
                n_workers=workers, processes=False, resources=resources, dashboard_address=None
            ) as cluster,
            distributed.Client(cluster) as client,
            pytest.raises(ConfigError, match=message),
        ):
            check_hosts(client, commit)

    refused(None, 1, None, "no worker offers the resource host=1")
    refused({"host": 1}, 2, None, "several of them")  # two workers on one host
    refused({"host": 1}, 1, "0" * 40, "at commit .* this client at 000000000000")
