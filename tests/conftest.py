"""Shared fixtures: where the repository and its built binaries are."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
RELEASE_DIR = REPO_ROOT / "target" / "release"

# Test the scalebench package of this checkout, in this process and in the
# CLIs the tests start, whatever an editable install elsewhere points at.
CONTROLLER = str(REPO_ROOT / "controller")
sys.path.insert(0, CONTROLLER)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [CONTROLLER, os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


def release_binary(name: str) -> Path:
    """Path of a binary built by `make build`; fails the test if it is missing."""
    path = RELEASE_DIR / name
    if not path.exists():
        pytest.fail(f"{path} is missing: run `make build` first")
    return path


def require_tool(name: str) -> str:
    """A host tool a test needs (installed by `make deps`)."""
    found = shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run `make deps` first")
    return found
