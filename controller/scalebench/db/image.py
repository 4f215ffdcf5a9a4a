"""The cached guest image: built by guest-images/dbguest/build.py, read here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .errors import DbTraceError

REPO_ROOT = Path(__file__).resolve().parents[3]
BUILDER = REPO_ROOT / "guest-images" / "dbguest" / "build.py"


@dataclass(frozen=True)
class GuestImage:
    """A built image: paths of its read-only base artefacts, the databases in it, and its CPU
    probe. build.py makes it and prints it as JSON; ensure_image reads it back."""

    kernel: str
    initrd: str
    rootfs: str
    key: str
    databases: tuple[str, ...]
    cpu_probe_n: int  # scalebench_cpu_probe(n) in the guest's postgres database ...
    cpu_probe_native_s: float  # ... took this long natively at build time (best of 5)


def ensure_image(cache: Path | None = None, builder: Path = BUILDER) -> GuestImage:
    """Build the image if the cache lacks it (minutes the first time), else return the cached
    one."""
    cmd = [sys.executable, str(builder)]
    if cache is not None:
        cmd += ["--cache", str(cache)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy(), check=False)
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        raise DbTraceError(
            lines[-1] if lines else f"image builder failed with exit code {proc.returncode}"
        )
    try:
        data = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as err:
        raise DbTraceError(f"image builder printed no result: {proc.stdout[-200:]!r}") from err
    data["databases"] = tuple(data["databases"])
    return GuestImage(**data)
