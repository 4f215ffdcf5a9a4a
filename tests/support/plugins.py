"""Example policy plugins of paging-policy, built once for the tests that load them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import RELEASE_DIR, REPO_ROOT


def fifo_plugin() -> Path:
    """paging-policy's FIFO example as a shared library (built if missing)."""
    lib = RELEASE_DIR / "examples" / "libfifo_policy.so"
    if not lib.exists():
        subprocess.run(
            ["cargo", "build", "--release", "-q", "-p", "paging-policy", "--examples"],
            cwd=REPO_ROOT,
            check=True,
            timeout=900,
        )
    return lib
