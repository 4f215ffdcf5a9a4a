"""The per-host CPU costs the model needs, stored between runs: in-core CPU
per request (by object size) and the pager's host time per fault (by block
size).

Every run that measures its in-core throughput (an in-core warm-up, or a
calibration phase on a resident window of VMs) records the first, and every
run with a settle phase the second, so that `scalebench model` and later runs
can use them without measuring again.
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


def _load(key: str, field: str) -> float | None:
    try:
        doc = json.loads(calibration_path().read_text())
        return float(doc[key][field])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_cpu_us(obj: str) -> float | None:
    """Stored in-core CPU microseconds per request for object size `obj`, if any."""
    return _load(obj, "cpu_us")


def load_fault_us(block_bytes: int) -> float | None:
    """Stored host microseconds per pager fault at this block size, if any."""
    return _load(f"fault-{block_bytes}", "fault_us")


def store_cpu_us(obj: str, cpu_us: float, vms: int, source: str) -> None:
    _store(obj, {"cpu_us": cpu_us, "vms": vms, "source": source})


def store_fault_us(block_bytes: int, fault_us: float, vms: int, source: str) -> None:
    _store(f"fault-{block_bytes}", {"fault_us": fault_us, "vms": vms, "source": source})


def _store(key: str, entry: dict) -> None:
    path = calibration_path()
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = {}
    doc[key] = {**entry, "at": now_iso()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.replace(path)
