"""`scalebench report DIR`: the page shows every plot and table, and the images load in headless
Chromium.

The sweep directory is produced by run_sweep with a FAKE point runner (made-up
results, nothing started): this test is about the report, not about runs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from conftest import require_tool
from scalebench.report import render
from scalebench.sweep import load_experiment, run_sweep
from test_scalebench_sweep import EXPERIMENT, FakePointRunner

CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--virtual-time-budget=10000",
]


def sweep_dir(tmp: Path) -> Path:
    exp_file = tmp / "t.toml"
    exp_file.write_text(EXPERIMENT)
    out = tmp / "sweep"
    run_sweep(load_experiment(exp_file), out, FakePointRunner())
    return out


def images_state(page: Path, profile: Path) -> str:
    """The body's data-images attribute after the page's load handler ran, as Chromium renders
    it."""
    chromium = require_tool("chromium")
    proc = subprocess.run(
        [chromium, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    m = re.search(r'<body[^>]*data-images="([^"]*)"', proc.stdout)
    assert m, f"no data-images marker in Chromium's DOM: {proc.stderr[-2000:]}"
    return m.group(1)


def test_report_images_load_in_headless_chromium(tmp_path):
    out = sweep_dir(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "scalebench.cli", "report", str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    page = out / "report.html"
    html = page.read_text()
    pngs, csvs = sorted(out.glob("*.png")), sorted(out.glob("*.csv"))
    assert len(pngs) == 2 and len(csvs) == 2
    for f in pngs:
        assert f'src="{f.name}"' in html
    for f in csvs:
        assert f.name in html
    assert html.count("<table>") == len(csvs)
    assert images_state(page, tmp_path / "profile") == f"ok:{len(pngs)}"


def test_report_flags_a_missing_image(tmp_path):
    out = sweep_dir(tmp_path)
    page = render(out)
    (out / "tput.png").unlink()
    assert images_state(page, tmp_path / "profile").startswith("broken:tput.png")
