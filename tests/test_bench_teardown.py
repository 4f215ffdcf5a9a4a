"""A bench under experiments/bench/ stopped by SIGTERM (a `pkill`, a job's timeout) stops what
it started, as on Ctrl-C: densevm, its VMs and its swap file do not outlive it. Real densevm,
real KVM guests."""

from __future__ import annotations

import ast
import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, release_binary
from scalebench.procs import wait_until
from scalebench.scaling import descendants
from support.densevm import kvm_available

BENCH = REPO_ROOT / "experiments" / "bench"
# Benches that start nothing that could outlive them (simulators run to completion).
# Benches that start no process: simulations, and a probe of the host's wake-ups.
STARTS_NO_PROCESS = {
    "page_install_cost.py",
    "pagesim_speed.py",
    "python_policy_speed.py",
    "scalebench_model_vs_pagesim.py",
    "wakeup_latency.py",
}


def cmdline(pid: int) -> list[str]:
    """`pid`'s argv; [] once it is gone or a zombie (whose cmdline reads empty)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def running(argv: list[str]) -> list[int]:
    """Live processes whose argv is exactly `argv`."""
    return [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and cmdline(int(p.name)) == argv
    ]


def densevms_below(pid: int, binary: Path) -> dict[int, list[str]]:
    """The processes below `pid` that run `binary`, with their argv."""
    found = {p: cmdline(p) for p in descendants(pid)[1:]}
    return {p: argv for p, argv in found.items() if argv and argv[0] == str(binary)}


@pytest.mark.skipif(not kvm_available(), reason="/dev/kvm is absent or not accessible on this host")
def test_a_sigterm_to_a_bench_stops_its_densevm(tmp_path: Path):
    densevm = release_binary("densevm")
    out = tmp_path / "bench.out"
    with open(out, "wb") as stdout, open(tmp_path / "bench.err", "wb") as stderr:
        bench = subprocess.Popen(
            [
                sys.executable,
                str(BENCH / "hibernation_integrity.py"),
                *("--policies", "demand", "--vms", "2", "--clients", "1"),
            ],
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            process_group=0,
        )
    seen: dict[int, list[str]] = {}
    try:
        # Stopped mid-measurement: densevm up, its VMs serving, the bench's first progress line out.
        assert wait_until(
            lambda: seen.update(densevms_below(bench.pid, densevm)) or bool(seen), 30
        ), f"no densevm started below the bench: {(tmp_path / 'bench.err').read_text()}"
        assert wait_until(lambda: b"wakes" in out.read_bytes() or bench.poll() is not None, 40), (
            "the bench reported no progress"
        )
        assert bench.poll() is None, f"the bench ended by itself: {out.read_text()}"
        seen.update(densevms_below(bench.pid, densevm))
        bench.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            bench.wait(30)
        err = (tmp_path / "bench.err").read_text(errors="replace")
        assert bench.returncode is not None, "the bench did not end within 30 s of its SIGTERM"
        # Its densevm processes are gone, and nothing else runs a densevm of that bench (its
        # argv names the bench's own temporary directory).
        left = {p for p, argv in seen.items() if cmdline(p) == argv}
        left |= {p for argv in seen.values() for p in running(argv)}
        assert not left, (
            f"densevm left running after the bench ended (status {bench.returncode}): "
            f"pids {sorted(left)}; its stderr: {err}"
        )
        workdirs = {Path(a).parent for argv in seen.values() for a in argv if a.endswith(".sock")}
        assert workdirs and not any(d.exists() for d in workdirs), (
            f"the bench's work directory (swap file, socket) was left: {workdirs}"
        )
        assert bench.returncode > 0, (
            f"the bench died of the signal (status {bench.returncode}) without unwinding: {err}"
        )
    finally:
        cleanup(bench, seen)


def cleanup(bench: subprocess.Popen, seen: dict[int, list[str]]) -> None:
    """What the bench left behind, should it fail to stop it: its densevm (SIGTERM, then
    SIGKILL) and the work directory named in densevm's argv."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(bench.pid, signal.SIGKILL)
    bench.wait()

    def left() -> set[int]:
        return {p for argv in seen.values() for p in running(argv)}

    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in left():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if wait_until(lambda: not left(), 30):
            break
    for argv in seen.values():
        for a in argv:
            if a.endswith(".sock") and Path(a).parent.name.startswith("hibernation-integrity-"):
                shutil.rmtree(Path(a).parent, ignore_errors=True)


def calls(tree: ast.AST, name: str) -> bool:
    return any(
        isinstance(node, ast.Call) and getattr(node.func, "id", None) == name
        for node in ast.walk(tree)
    )


@pytest.mark.parametrize(
    "script",
    sorted(p.name for p in BENCH.glob("*.py") if p.name not in STARTS_NO_PROCESS),
)
def test_every_bench_that_starts_processes_unwinds_on_sigterm(script: str):
    """The test above runs one bench; the others make the same call at the top of main()."""
    tree = ast.parse((BENCH / script).read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    first = main.body[0]
    assert isinstance(first, ast.Expr) and calls(first, "install_signal_handlers"), (
        f"{script}: main() does not begin with install_signal_handlers() "
        "(a bench that starts nothing belongs in STARTS_NO_PROCESS)"
    )
