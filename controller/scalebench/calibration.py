"""The per-host in-core CPU cost per request, stored between runs.

Every run that measures its in-core throughput (an in-core warm-up, or a
calibration phase on a resident window of VMs) records it here, so that
`scalebench model` and out-of-core runs can use it without measuring again.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from .result import now_iso


def calibration_path() -> Path:
    """$SCALEBENCH_CALIBRATION, else ~/.cache/scalebench/calibration-<hostname>.json."""
    override = os.environ.get("SCALEBENCH_CALIBRATION")
    if override:
        return Path(override)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "scalebench" / f"calibration-{socket.gethostname()}.json"


def load_cpu_us(obj: str) -> float | None:
    """Stored in-core CPU microseconds per request for object size `obj`, if any."""
    try:
        doc = json.loads(calibration_path().read_text())
        return float(doc[obj]["cpu_us"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def store_cpu_us(obj: str, cpu_us: float, vms: int, source: str) -> None:
    path = calibration_path()
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    doc[obj] = {"cpu_us": cpu_us, "vms": vms, "source": source, "at": now_iso()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
