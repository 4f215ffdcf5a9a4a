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


# Parallel runs (pytest-xdist, `make test`): the tests fall into lanes that
# run one after another on one worker each, so two tests that contend for
# the same thing never overlap. The KVM tests ("host", the default) share
# the host's cores and memory, and their timings bound what they check.
# The QEMU lane holds the tests that share one libvirtd and the database
# image. The cluster tests start fleets of processes. Tests that need the
# host to themselves are marked `alone` and run after the lanes. Modules
# that need none of these float: each is a work unit of its own, on
# whichever worker is free. Lanes overlap in time, so no two modules of
# different lanes share a loopback address range.
FLOATING = None
LANES: dict[str, str | None] = {
    "test_db_guest.py": "qemu",
    "test_db_pgbench.py": "qemu",
    "test_db_image_cache.py": "qemu",
    "test_db_nbd_xml.py": "qemu",
    "test_scalebench_cluster.py": "cluster",
    "test_results_store.py": "cluster",
    "test_db_analysis.py": FLOATING,
    "test_db_diskmodel.py": FLOATING,
    "test_db_report.py": FLOATING,
    "test_db_steady.py": FLOATING,
    "test_describe.py": FLOATING,
    "test_pagesim.py": FLOATING,
    "test_python_policy.py": FLOATING,
    "test_scalebench_cli.py": FLOATING,
    "test_scalebench_compare.py": FLOATING,
    "test_scalebench_model.py": FLOATING,
    "test_scalebench_report.py": FLOATING,
    "test_scalebench_sweep.py": FLOATING,
}


def lane(nodeid: str) -> str:
    """The work unit of a test: its lane, or its module when it floats."""
    module = nodeid.split("::", 1)[0]
    name = LANES.get(Path(module).name, "host")
    return module if name is FLOATING else name


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):  # type: ignore[no-untyped-def]
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return lane(nodeid)

    return LaneScheduling(config, log)
