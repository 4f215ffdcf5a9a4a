"""zipfperf as the controller drives it: one load phase, its JSON document back.

Closed loop by default: `concurrency` requests in flight. Each request is its
own connection (`--num-calls 1`) to a VM drawn from Zipf(alpha), as Denali's
modified httperf did. A keep-alive connection is bound to one VM, so reusing
connections would repeat the same VM instead of drawing a new one per request,
and in the disk-bound regime a connection stuck on a cold VM would hold its
slot for all its calls. `calls_per_conn` > 1 is available for in-core studies.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import subprocess
import time
from dataclasses import dataclass, replace
from pathlib import Path

from .procs import Child

OBJECT_URI = {"small": "/", "large": "/large"}


class ZipfperfError(RuntimeError):
    """zipfperf failed or produced no usable JSON."""


@dataclass(frozen=True)
class LoadSpec:
    """One load phase."""

    targets: int
    addr_base: str
    port: int
    alpha: float
    seed: int
    duration_s: float
    concurrency: int
    calls_per_conn: int
    uri: str
    timeout_s: float

    def argv(self, binary: Path, json_path: Path) -> list[str]:
        return [
            str(binary),
            "--targets",
            str(self.targets),
            "--addr-base",
            self.addr_base,
            "--port",
            str(self.port),
            "--alpha",
            repr(self.alpha),
            "--seed",
            str(self.seed),
            "--concurrency",
            str(self.concurrency),
            "--duration",
            repr(self.duration_s),
            "--num-calls",
            str(self.calls_per_conn),
            "--uri",
            self.uri,
            "--timeout",
            repr(self.timeout_s),
            "--json",
            str(json_path),
        ]

    def window(self, first: int, targets: int, alpha: float, duration_s: float) -> LoadSpec:
        """The same load aimed at VMs first..first+targets-1 only (the calibration phase)."""
        base = str(ipaddress.IPv4Address(self.addr_base) + first)
        return replace(self, targets=targets, addr_base=base, alpha=alpha, duration_s=duration_s)


def run_load(
    binary: Path,
    spec: LoadSpec,
    workdir: Path,
    name: str,
    tick=lambda elapsed: None,
    alive=lambda: None,
    until=lambda: False,
) -> dict:
    """Run one phase to completion and return zipfperf's JSON document.

    tick(elapsed_s) is called about ten times a second for progress; alive() is
    called as often and may raise to abort the phase (densevm died): zipfperf is
    then stopped before the exception propagates. When until() turns true the
    phase ends early: zipfperf is interrupted and still writes its document.
    """
    json_path = workdir / f"zipfperf-{name}.json"
    log_path = workdir / f"zipfperf-{name}.log"
    json_path.unlink(missing_ok=True)
    with open(log_path, "wb") as log:
        child = Child(spec.argv(binary, json_path), stdout=log, stderr=subprocess.STDOUT)
        start = time.monotonic()
        try:
            while child.poll() is None:
                alive()
                tick(time.monotonic() - start)
                if until():
                    child.interrupt()
                    # Stopped below if it lingers; no document, so the phase fails.
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.popen.wait(30)
                    break
                time.sleep(0.1)  # the end-of-phase sample should follow zipfperf's end closely
        finally:
            child.stop()
    code = child.poll()
    if code != 0:
        lines = log_path.read_text(errors="replace").strip().splitlines()
        raise ZipfperfError(
            f"zipfperf ({name}) exited with status {code}: {lines[-1] if lines else '(no output)'}"
        )
    try:
        return json.loads(json_path.read_text())
    except (OSError, ValueError) as e:
        raise ZipfperfError(f"zipfperf ({name}) wrote no readable JSON to {json_path}: {e}") from e
