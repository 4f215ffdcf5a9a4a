"""The per-host CPU costs the model needs, stored between runs: in-core CPU
per request (by object size) and the pager's host time per fault (by block
size).

Every run that measures its in-core throughput (an in-core warm-up, or a
calibration phase on a resident window of VMs) records the first, and every
run with a settle phase the second, so that `scalebench model` and later runs
can use them without measuring again.

`cpu_us` and `fault_us` choose the cost the model uses, the same way for a run
and for `scalebench model`: the flag, then the caller's own measurements, then
the stored calibration, then a fallback.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Iterable
from pathlib import Path

from .model import DEFAULT_FAULT_US
from .result import now_iso

# A cost and where it came from: (microseconds or None, source).
Cost = tuple[float | None, str]

# `scalebench model` without --cpu-us on a host with no stored calibration: about what the
# 4,000-VM main job calibrated on one development host (docs/host-facts.md).
UNCALIBRATED_CPU_US = 500.0
UNCALIBRATED = (UNCALIBRATED_CPU_US, "uncalibrated guess: pass --cpu-us or do one in-core run")
NO_CPU_US = (
    None,
    "none: the warm-up paged and no calibration is stored (pass --cpu-us, or run once in core)",
)


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


def cpu_us(
    flag: float | None, obj: str, measured: Iterable[Cost] = (), fallback: Cost = NO_CPU_US
) -> Cost:
    """In-core CPU microseconds per request for object size `obj`: the flag, else the first of
    `measured` that has a value (taken lazily: a generator's later measurements are not made
    once one answers), else the stored calibration, else `fallback`."""
    return _choose(flag, measured, lambda: load_cpu_us(obj), fallback)


def fault_us(flag: float | None, block_bytes: int, measured: Iterable[Cost] = ()) -> Cost:
    """Host microseconds per pager fault at this block size: the flag, else the first of
    `measured` that has a value, else the stored calibration, else the model's default."""
    return _choose(
        flag, measured, lambda: load_fault_us(block_bytes), (DEFAULT_FAULT_US, "default")
    )


def _choose(
    flag: float | None,
    measured: Iterable[Cost],
    stored: Callable[[], float | None],
    fallback: Cost,
) -> Cost:
    if flag is not None:
        return flag, "flag"
    for value, source in measured:
        if value is not None:
            return value, source
    value = stored()
    if value is not None:
        return value, "stored"
    return fallback


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
