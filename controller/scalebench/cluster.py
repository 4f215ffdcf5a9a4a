"""Sweeps on a fleet: `scalebench sweep FILE --cluster ADDRESS`, each point on a host of its own.

The engine is dask distributed: a scheduler and one worker per host, each
started with `--resources host=1`; every point asks for that resource, so a
host never runs two points at once. Points are submitted all at once and
collected as they finish, each into the sweep's directory on this client, as
a local sweep stores them: resuming, the CSV, plots, checks and reports are
the same. A worker lost mid-point is dask's to handle: the point is run again
on another worker (up to dask's `allowed-failures`, then it is a failed point);
every attempt logs an event, so the stored result says where each ran and
whether it was retried. `--cluster local` starts a one-worker LocalCluster here
and tears it down after the sweep. See cluster_worker.py for the worker's side.
"""

from __future__ import annotations

import io
import shutil
import tarfile
import tempfile
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from distributed import Client, Future, as_completed

from .cluster_worker import (
    EVENT_TOPIC,
    HOST_RESOURCE,
    PointOutcome,
    PointTask,
    repo_commit,
    run_point,
    worker_facts,
)
from .config import ConfigError, RunConfig
from .progress import Reporter
from .result import RunResult, now_iso
from .sweep import Experiment, finish_sweep, pending_points, point_line, point_record, slug

CONNECT_TIMEOUT_S = 30.0
# `--cluster local`: a dask LocalCluster that the sweep starts and tears down itself, one
# worker process holding this whole host (densevm wants all of it), so that the fleet path
# (scheduler, worker, task, point shipped back) is what runs the points on one machine.
LOCAL = "local"


@contextmanager
def cluster_client(address: str) -> Iterator[Client]:
    """A client of the cluster at `address`; for "local", of a LocalCluster started here and
    closed (its worker and any point it runs stopped) when the block exits, however it exits."""
    if address != LOCAL:
        with connect(address) as client:
            yield client
        return
    import dask
    from distributed import LocalCluster

    # The cluster's scratch space (dask's default: /tmp/dask-scratch-space, whose lock files
    # outlive the cluster) goes with it.
    with (
        tempfile.TemporaryDirectory(prefix="scalebench-dask-") as scratch,
        dask.config.set({"temporary-directory": scratch}),
    ):
        cluster = LocalCluster(
            n_workers=1,
            threads_per_worker=1,
            processes=True,
            resources={HOST_RESOURCE: 1},
            dashboard_address=None,
            host="127.0.0.1",
        )
        try:
            with Client(cluster, timeout=CONNECT_TIMEOUT_S) as client:
                client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
                yield client
        finally:
            cluster.close()


def connect(address: str) -> Client:
    """A client of the scheduler at `address` (tcp://HOST:PORT, or a scheduler file), with a
    worker."""
    try:
        if Path(address).is_file():
            client = Client(scheduler_file=address, timeout=CONNECT_TIMEOUT_S)
        else:
            client = Client(address, timeout=CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as e:  # TimeoutError is an OSError
        raise ConfigError(f"--cluster {address}: cannot reach a dask scheduler: {e}") from None
    try:
        client.wait_for_workers(1, timeout=CONNECT_TIMEOUT_S)
    except TimeoutError:
        client.close()
        raise ConfigError(
            f"--cluster {address}: no worker joined within {CONNECT_TIMEOUT_S:.0f} s"
        ) from None
    return client


def check_hosts(client: Client, commit: str | None) -> dict[str, dict]:
    """{worker address: facts} of the workers that offer a whole host; ConfigError if they cannot
    run points."""
    workers = client.scheduler_info(n_workers=-1)["workers"]
    hosts = [
        addr for addr, w in workers.items() if (w.get("resources") or {}).get(HOST_RESOURCE, 0) >= 1
    ]
    if not hosts:
        raise ConfigError(
            f"no worker offers the resource {HOST_RESOURCE}=1: start one worker per host with "
            f"`dask worker ADDRESS --nthreads 1 --resources {HOST_RESOURCE}=1`"
        )
    try:
        facts = client.run(worker_facts, workers=hosts)
    # dask passes a worker's failure on as a bare Exception: typically scalebench not
    # installed there.
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"a worker cannot run scalebench ({e}): each host needs this repository, `make run`"
        ) from None
    shared = [
        name for name, n in Counter(f["host"]["hostname"] for f in facts.values()).items() if n > 1
    ]
    if shared:
        raise ConfigError(
            f"{len(hosts)} workers offer {HOST_RESOURCE}=1 but host {shared[0]} has several of "
            "them: "
            "a point measures its host, so one worker per host"
        )
    for f in facts.values():
        name = f["host"]["hostname"]
        if commit and f["commit"] and f["commit"] != commit:
            raise ConfigError(
                f"host {name} is at commit {f['commit'][:12]}, this client at {commit[:12]}: "
                "every host needs the same commit"
            )
        if f["binaries"]:
            raise ConfigError(f"host {name}: {f['binaries']}")
        if not f["kvm"]:
            raise ConfigError(f"host {name} has no usable /dev/kvm")
    return facts


def run_sweep_on_cluster(
    exp: Experiment, out_dir: Path, address: str, reporter: Reporter | None = None
) -> dict:
    """run_sweep's counterpart on a dask cluster: every point not done yet, one per host at a
    time."""
    reporter = reporter or Reporter()
    commit = repo_commit()
    with cluster_client(address) as client:
        hosts = check_hosts(client, commit)
        reporter.note(
            f"cluster {address}: {len(hosts)} host(s): "
            + ", ".join(sorted(f["host"]["hostname"] for f in hosts.values()))
        )
        todo = pending_points(exp, out_dir, reporter)
        sweep_id = f"{exp.name}-{uuid.uuid4().hex[:8]}"
        client.subscribe_topic(EVENT_TOPIC, lambda event: _note_start(reporter, sweep_id, event[1]))
        futures: dict[Future, tuple[int, str, RunConfig]] = {}
        total = len(exp.points())
        try:
            for i, key, cfg in todo:
                task = PointTask(sweep_id, key, cfg, commit)
                future = client.submit(
                    run_point,
                    task,
                    pure=False,
                    key=f"scalebench-{sweep_id}-{slug(key)}",
                    resources={HOST_RESOURCE: 1},
                )
                futures[future] = (i, key, cfg)
            for future in as_completed(list(futures)):
                i, key, cfg = futures.pop(future)
                result = _collect(client, future, out_dir, key, cfg, sweep_id, address)
                reporter.note(
                    f"[bold]point {i + 1}/{total}[/]: {key} on {result.host.get('hostname')}"
                    + (" (retried)" if result.placement["retried"] else "")
                )
                reporter.note(point_line(result))
        finally:
            if futures:  # interrupted: the workers stop the points still running
                client.cancel(list(futures))
    return finish_sweep(exp, out_dir)


def _note_start(reporter: Reporter, sweep_id: str, event: dict) -> None:
    if event.get("sweep") == sweep_id:
        reporter.note(f"  started {event['point']} on {event['host']}")


def _collect(
    client: Client,
    future: Future,
    out_dir: Path,
    key: str,
    cfg: RunConfig,
    sweep_id: str,
    address: str,
) -> RunResult:
    """Store a finished point in the sweep directory, with where it ran; return its result."""
    attempts = [
        {k: e.get(k) for k in ("host", "worker", "at")}
        for _, e in client.get_events(EVENT_TOPIC)
        if e.get("sweep") == sweep_id and e.get("point") == key
    ]
    record = point_record(out_dir, key)
    shutil.rmtree(record.parent, ignore_errors=True)  # an earlier failed attempt's files
    record.parent.mkdir(parents=True)
    try:
        outcome: PointOutcome = future.result()
    # The task failed: dask gave up after losing workers (KilledWorker), or the worker's code
    # raised (anything).
    except Exception as e:  # noqa: BLE001
        result = RunResult(f"cluster-{slug(key)}", cfg.as_dict(), host={}, finished_at=now_iso())
        result.fail(f"{type(e).__name__}: {e}")
        worker = None
    else:
        with tarfile.open(fileobj=io.BytesIO(outcome.archive), mode="r:gz") as tar:
            tar.extractall(record.parent, filter="data")
        result = RunResult(**outcome.result)
        # The result names its files where the worker wrote them: name them where they are now.
        result.files = {
            k: v.replace(outcome.out, str(record.parent)) if isinstance(v, str) else v
            for k, v in result.files.items()
        }
        worker = outcome.worker
    result.placement = {
        "cluster": address,
        "worker": worker,
        "attempts": attempts,
        "retried": len(attempts) > 1,
    }
    result.write(record)
    return result
