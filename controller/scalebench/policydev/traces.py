"""Request traces (paging-policy's SBTRACE1 format) with their metadata.

Layout: 8 bytes `SBTRACE1`, u32 LE header length, header JSON, then one u32 LE
VM id per request. pagesim reads `block_bytes`, `vm_ram_bytes`, `vms` and
`request_ranges` from the header and ignores other keys, so the metadata
(`source`, `seed`, `alpha`, `requests`, `working_set_bytes`, how it was made)
travels in the same header.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"SBTRACE1"
_HEADER_MAX = 1 << 20


class TraceError(ValueError):
    """Not a readable trace, or a bad request for one."""


@dataclass(frozen=True)
class TraceInfo:
    """A trace's header (metadata included) and its request count."""

    path: Path
    header: dict
    requests: int

    @property
    def alpha(self) -> float | None:
        value = self.header.get("alpha")
        return None if value is None else float(value)


def write(path: Path, header: dict, vm_ids: np.ndarray) -> TraceInfo:
    """Writes a trace; every id must be below header['vms']."""
    ids = np.asarray(vm_ids, dtype="<u4")
    if ids.size and int(ids.max()) >= int(header["vms"]):
        raise TraceError(f"VM id {int(ids.max())} out of range for {header['vms']} VMs")
    body = json.dumps({**header, "requests": int(ids.size)}, sort_keys=True).encode()
    with open(path, "wb") as f:
        f.write(MAGIC + struct.pack("<I", len(body)) + body)
        f.write(ids.tobytes())
    return TraceInfo(Path(path), json.loads(body), int(ids.size))


def read(path: Path) -> tuple[TraceInfo, np.ndarray]:
    """The trace's header and its VM ids; TraceError if it is not a trace."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise TraceError(f"{path}: {e.strerror}") from None
    if len(data) < 12 or data[:8] != MAGIC:
        raise TraceError(f"{path}: not a trace (no SBTRACE1 magic)")
    (length,) = struct.unpack("<I", data[8:12])
    if length > _HEADER_MAX or 12 + length > len(data):
        raise TraceError(f"{path}: truncated or oversized header")
    try:
        header = json.loads(data[12 : 12 + length])
    except ValueError as e:
        raise TraceError(f"{path}: unreadable header: {e}") from None
    ids = np.frombuffer(data[12 + length :], dtype="<u4", count=(len(data) - 12 - length) // 4)
    return TraceInfo(Path(path), header, int(ids.size)), ids


def add_metadata(path: Path, metadata: dict) -> TraceInfo:
    """Rewrites the trace's header with `metadata` merged in (same requests)."""
    info, ids = read(path)
    return write(path, {**info.header, **metadata}, ids)


def request_ranges(ws_bytes: int, extra_bytes: int, guest_mem_bytes: int) -> list[list[int]]:
    """What every request touches, as pagesim's synthetic workload has it: the working set at
    the bottom of RAM and the stack/bss pages at its top."""
    if ws_bytes <= 0 or extra_bytes < 0 or ws_bytes + extra_bytes > guest_mem_bytes:
        raise TraceError("need 0 < ws, 0 <= extra and ws + extra <= guest memory")
    ranges = [[0, ws_bytes]]
    if extra_bytes:
        ranges.append([guest_mem_bytes - extra_bytes, extra_bytes])
    return ranges


def zipf_ids(vms: int, alpha: float, requests: int, seed: int) -> np.ndarray:
    """`requests` VM ids, VM i (0-based) drawn with probability proportional to (i+1)^-alpha."""
    if vms < 1 or requests < 1 or not alpha >= 0:
        raise TraceError("need vms >= 1, requests >= 1 and alpha >= 0")
    weights = np.arange(1, vms + 1, dtype=np.float64) ** -alpha
    rng = np.random.default_rng(seed)
    return rng.choice(vms, size=requests, p=weights / weights.sum()).astype("<u4")


def synth(
    path: Path,
    vms: int,
    alpha: float,
    requests: int,
    seed: int,
    ws_bytes: int,
    extra_bytes: int,
    guest_mem_bytes: int,
    block_bytes: int,
) -> TraceInfo:
    """Writes a synthetic Zipf trace with its metadata."""
    ranges = request_ranges(ws_bytes, extra_bytes, guest_mem_bytes)
    header = {
        "block_bytes": block_bytes,
        "vm_ram_bytes": guest_mem_bytes,
        "vms": vms,
        "request_ranges": ranges,
        "source": "synthetic",
        "generator": "scalebench trace synth (numpy default_rng, bounded Zipf)",
        "alpha": alpha,
        "seed": seed,
        "working_set_bytes": sum(length for _, length in ranges),
    }
    return write(path, header, zipf_ids(vms, alpha, requests, seed))
