"""Shared fixtures: where the repository and its built binaries are."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
RELEASE_DIR = REPO_ROOT / "target" / "release"


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
