"""A sweep point on a cluster worker: the dask task, and the child process that runs the point.

The task runs the point in a child process (`python -m scalebench.cluster_worker`)
and waits for it. The child asks the kernel for SIGTERM when the worker dies
(PR_SET_PDEATHSIG), and scalebench's SIGTERM unwinds a run as Ctrl-C does, so a
worker killed outright still stops its densevm and zipfperf and removes their
cgroup; a task the client cancels (an interrupted sweep) SIGTERMs the child too.
The point's directory is sent back to the client whole, as a gzipped tar, and
removed from the worker.

A worker's host can be configured through its environment:
SCALEBENCH_HOST_NAME / SCALEBENCH_HOST_KIND (result.py) name it and its kind,
SCALEBENCH_HOST_ADDR_BASE gives its VMs their own loopback range (several
"hosts" on one machine), SCALEBENCH_WORK_DIR is where points run (default
runs/cluster under the worker's working directory: a disk, as for local runs).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .config import REPO_ROOT, ConfigError, RunConfig, check_addresses_free
from .result import RunResult, host_info, now_iso

HOST_RESOURCE = "host"  # a worker holding a whole host offers host=1; every point asks for it
EVENT_TOPIC = (
    "scalebench.point"  # one event per attempt at a point, logged by the worker that starts it
)
WORK_DIR_ENV = "SCALEBENCH_WORK_DIR"
ADDR_BASE_ENV = "SCALEBENCH_HOST_ADDR_BASE"
POLL_S = 0.5
STOP_GRACE_S = (
    60.0  # a SIGTERMed run stops densevm (10 s grace) and zipfperf, then writes its result
)
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class PointTask:
    """What the client sends: one point of one sweep invocation."""

    sweep_id: str
    key: str
    config: RunConfig
    commit: str | None  # the client's; a worker at another commit refuses the point


@dataclass(frozen=True)
class PointOutcome:
    """What the worker sends back: the result document and the point's files."""

    result: dict
    archive: bytes  # the point directory, tar.gz
    worker: str  # the dask worker's address
    out: str  # the point directory on the worker (the result's paths start with it)


def repo_commit() -> str | None:
    """The commit this checkout is at, or None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def worker_facts() -> dict:
    """What a worker's host offers, for the client's check before a sweep (run on each worker)."""
    from .config import binary

    try:
        binary("densevm")
        binary("zipfperf")
        binaries = None
    except ConfigError as e:
        binaries = str(e)
    return {
        "host": host_info(),
        "commit": repo_commit(),
        "kvm": os.access("/dev/kvm", os.R_OK | os.W_OK),
        "binaries": binaries,
    }


def work_dir() -> Path:
    return Path(os.environ.get(WORK_DIR_ENV) or Path.cwd() / "runs" / "cluster")


def run_point(task: PointTask) -> PointOutcome:
    """The dask task: run one point on this worker's host and return its result and files."""
    from distributed import get_worker

    worker = get_worker()
    host = host_info()
    worker.log_event(
        EVENT_TOPIC,
        {
            "sweep": task.sweep_id,
            "point": task.key,
            "host": host["hostname"],
            "worker": worker.address,
            "at": now_iso(),
        },
    )
    # Short: densevm's control socket is in it, and a socket's path has at most 107 bytes.
    out = work_dir() / task.sweep_id / hashlib.sha1(task.key.encode()).hexdigest()[:8]
    shutil.rmtree(out, ignore_errors=True)  # left by an attempt whose worker died
    out.mkdir(parents=True)
    cfg = task.config.with_(
        out=str(out), addr_base=os.environ.get(ADDR_BASE_ENV) or task.config.addr_base
    )
    commit = repo_commit()
    if task.commit and commit and commit != task.commit:
        refuse = RunResult(f"refused-{out.name}", cfg.as_dict(), finished_at=now_iso())
        refuse.fail(
            f"host {host['hostname']} is at commit {commit[:12]}, the client at {task.commit[:12]}"
        )
        refuse.write(out / "result.json")
    else:
        key = worker.get_current_task()
        _run_child(cfg, out, lambda: _cancelled(worker, key))
    outcome = PointOutcome(_result(out, cfg), _pack(out), worker.address, str(out))
    shutil.rmtree(out, ignore_errors=True)
    with contextlib.suppress(OSError):
        out.parent.rmdir()  # the sweep's last point on this host
    return outcome


def _cancelled(worker, key: str) -> bool:
    """Whether the client gave this task up (cancelled, or the client itself is gone).

    dask cannot stop a running task's thread; the task sees the scheduler's
    release as its state turning "cancelled" in the worker's state machine."""
    ts = worker.state.tasks.get(key)
    return ts is None or ts.state == "cancelled"


def _run_child(cfg: RunConfig, out: Path, cancelled) -> None:
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    with open(out / "scalebench.log", "w") as log:
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scalebench.cluster_worker",
                str(out / "config.json"),
                str(os.getpid()),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            while child.poll() is None:
                if cancelled():
                    break
                time.sleep(POLL_S)
        finally:
            if child.poll() is None:
                child.terminate()
                try:
                    child.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    child.kill()
                    child.wait()


def _result(out: Path, cfg: RunConfig) -> dict:
    """The point's result document; a failed one if the child wrote none."""
    try:
        return json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        r = RunResult(f"lost-{out.name}", cfg.as_dict(), finished_at=now_iso())
        r.fail(f"the point's process wrote no result on {r.host['hostname']} (see scalebench.log)")
        return r.as_dict()


def _pack(out: Path) -> bytes:
    """The point directory's regular files as a gzipped tar: not densevm's socket and swap, and not
    the
    result, sent on its own (the client writes it last: a point without it is not done)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path in sorted(out.rglob("*")):
            if (
                path.is_file()
                and not path.is_symlink()
                and path.name not in ("swap.img", "result.json")
            ):
                tar.add(path, arcname=str(path.relative_to(out)))
    return buffer.getvalue()


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the worker that started it dies (also if it already has)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str]) -> int:
    """The child process: `python -m scalebench.cluster_worker CONFIG.json WORKER_PID`."""
    from .procs import Terminated, install_signal_handlers, interrupted
    from .progress import ConsoleReporter
    from .runner import Binaries, new_run_id, run

    config_path, parent_pid = argv
    install_signal_handlers()
    cfg: RunConfig | None = None
    try:
        _die_with_parent(int(parent_pid))
        cfg = RunConfig(**json.loads(Path(config_path).read_text()))
        try:
            bins = Binaries.find()
            check_addresses_free(cfg)
        except ConfigError as e:
            r = RunResult(new_run_id(cfg), cfg.as_dict(), finished_at=now_iso())
            r.fail(str(e))
            r.write(Path(cfg.out) / "result.json")
            return 2
        result = run(cfg, ConsoleReporter(), bins)
    except (KeyboardInterrupt, Terminated) as e:
        # Stopped before the run had a result of its own to write: the point still leaves one.
        if cfg is not None and not (Path(cfg.out) / "result.json").exists():
            r = RunResult(new_run_id(cfg), cfg.as_dict(), finished_at=now_iso())
            r.fail(interrupted(e))
            r.write(Path(cfg.out) / "result.json")
        return 130
    return 0 if result.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
