"""Where the repository and its built binaries are."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]


def bin_dir() -> Path:
    """Where densevm and zipfperf are: $SCALEBENCH_BIN_DIR, else the repo's target/release."""
    return Path(os.environ.get("SCALEBENCH_BIN_DIR") or REPO_ROOT / "target" / "release")


def binary(name: str) -> Path:
    """Path of a required binary; ConfigError (nothing started yet) when it is missing."""
    path = bin_dir() / name
    if not os.access(path, os.X_OK):
        raise ConfigError(
            f"{path} is missing or not executable: run `make build` (or set SCALEBENCH_BIN_DIR)"
        )
    return path
