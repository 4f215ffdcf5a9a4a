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


# The database guest tests' shared set-up: one image lookup and one libvirtd per session.
@pytest.fixture(scope="session")
def db_image():  # type: ignore[no-untyped-def]
    """The database guest image from the build cache outside the checkout
    (guest-images/dbguest/README.md): built once on a fresh host, a lookup afterwards. Guests boot
    it through copy-on-write overlays; the cached file is read-only."""
    from scalebench.db.image import ensure_image

    return ensure_image()


@pytest.fixture(scope="session")
def libvirt_conn():  # type: ignore[no-untyped-def]
    """A connection to libvirtd, started for the session when none is running (and stopped at its
    end); the command-line runs the tests make find it running too."""
    from scalebench.db.daemon import Libvirt

    with Libvirt() as lv:
        yield lv.conn
