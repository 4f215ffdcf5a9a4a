"""Bad input: one line `scalebench: error: ...`, exit status 2, nothing started.

The bin directory holds FAKE densevm/zipfperf scripts that only leave a marker
file when executed, to prove that nothing was started. `densevm describe`,
which starts nothing and which validation asks, is passed to the real binary.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import release_binary

MARKER_SCRIPT = '#!/bin/sh\ntouch "$(dirname "$0")/STARTED"\nsleep 30\n'
DESCRIBE_THEN_MARKER = (
    '#!/bin/sh\n[ "$1" = describe ] && exec "{real}" "$@"\n'
    'touch "$(dirname "$0")/STARTED"\nsleep 30\n'
)


@pytest.fixture
def bindir(tmp_path) -> Path:
    d = tmp_path / "bin"
    d.mkdir()
    (d / "densevm").write_text(DESCRIBE_THEN_MARKER.format(real=release_binary("densevm")))
    (d / "zipfperf").write_text(MARKER_SCRIPT)
    for name in ("densevm", "zipfperf"):
        (d / name).chmod(0o755)
    return d


BAD = [
    (["--bogus-flag"], "unrecognized arguments"),
    (["--vms", "0"], "--vms must be at least 1"),
    (["--vms", "-5"], "--vms must be at least 1"),
    (["--vms", "many"], "invalid int value"),
    (["--alpha", "-0.5"], "--alpha must be >= 0"),
    (["--block", "48k"], "power of two"),
    (["--block", "512k"], "power of two from 4k to 256k"),
    (["--block", "abc"], "not a size"),
    (["--mem", "64T"], "not within this host's memory"),
    (["--disk", "floppy"], "unknown disk model"),
    (["--object", "medium"], "invalid choice"),
    (["--vms", "100000", "--idle-after", "60", "--max-live", "100000"], "host's memory"),
    (["run", "--policy", "lru"], "--policy must be"),
    (["model", "--block", "3k", "--cpu-us", "10"], "power of two"),
    (["sweep", "/nonexistent/fig.toml"], "cannot read experiment file"),
    (["report", "/nonexistent/dir"], "is not a directory"),
    (["compare", "/nonexistent/a.json", "/nonexistent/b.json"], "No such file"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_nothing_started(tmp_path, bindir, argv, message):
    env = {**os.environ, "SCALEBENCH_BIN_DIR": str(bindir), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "scalebench.cli", *argv],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("scalebench: error: "), proc.stderr
    assert message in lines[0]
    assert proc.stdout == ""
    assert not (bindir / "STARTED").exists()
    assert not (tmp_path / "runs").exists()


def test_missing_binaries_are_reported_before_anything_starts(tmp_path):
    env = {**os.environ, "SCALEBENCH_BIN_DIR": str(tmp_path / "nowhere"), "HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "scalebench.cli", "--vms", "4"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "make build" in proc.stderr
    assert not (tmp_path / "runs").exists()


def test_help_lists_the_subcommands():
    out = subprocess.run(
        [sys.executable, "-m", "scalebench.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    for word in (
        "--vms",
        "--alpha",
        "--block",
        "model",
        "sweep",
        "report",
        "compare",
        "nightly",
        "dbtrace",
    ):
        assert word in out
