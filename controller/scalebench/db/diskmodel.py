"""Disk models applied on the traced block path.

A model turns each request (arrival time, operation, LBA, length) into a
completion time; the NBD server holds the reply until then, so the guest, and
the database clients above it, feel the modelled device. Real I/O on the host
still happens; its time is small next to the modelled one (the host's disk is
a fast SSD).

Models (times in seconds, LBAs in 512-byte sectors):

- ``hdd15k``: the study's Seagate ST373453LC (73 GB, 15,000 RPM): seek
  ``0.2 ms + 7.2 ms * sqrt(distance / capacity)``, half a rotation (2 ms) of
  latency, 75 MB/s media rate; a request that starts where the previous one
  ended pays neither seek nor rotation; write cache on (as in the study):
  a write completes once transferred to the cache (320 MB/s), the disk
  destages it in order with the reads; a flush completes when the last
  cached write is destaged (reads queued after it do not hold it up).
- ``array``: four such disks striped (64 KiB stripe unit), no redundancy.
- ``raid5``: four such disks, 64 KiB stripe unit, rotating parity; a write
  smaller than a stripe reads old data and old parity first (read-modify-
  write), then writes both through the member disks' caches.
- ``ssd``: eight parallel flash channels; 90 us per read plus 250 MB/s,
  30 us per write plus 200 MB/s; a flush waits for queued writes plus 100 us.
- ``none``: no added time (the host's own disk).

``Dilated`` runs any model in slowed-down time (time dilation): every service
time, and so every queueing delay, is multiplied by a factor. With the
factor set to the guest's CPU slowdown under emulation (TCG), the balance
between CPU and disk time is that of a native machine.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field
from typing import Protocol

SECTOR = 512
READ, WRITE, FLUSH = "R", "W", "F"
MODEL_NAMES = ("none", "hdd15k", "array", "raid5", "ssd")


class DiskModel(Protocol):
    """A device that completes requests at modelled times."""

    name: str

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        """Completion time (>= now) of a request arriving at ``now``."""
        ...


@dataclass
class NoDisk:
    """Adds nothing: requests complete as soon as the host has done them."""

    name: str = "none"

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        return now


@dataclass
class Spindle:
    """One 15,000 RPM SCSI disk with a FIFO queue and a write-back cache."""

    capacity_sectors: int = 73_400_000_000 // SECTOR
    track_to_track_s: float = 0.0002
    full_stroke_extra_s: float = 0.0072
    rotation_s: float = 60.0 / 15_000
    media_bytes_per_s: float = 75e6
    interface_bytes_per_s: float = 320e6
    busy_until: float = 0.0
    destaged_at: float = 0.0  # when the last cached write reaches the media
    head_lba: int = 0
    last_end_lba: int = -1

    def seek_time(self, lba: int) -> float:
        distance = abs(lba - self.head_lba)
        if distance == 0:
            return 0.0
        return self.track_to_track_s + self.full_stroke_extra_s * math.sqrt(
            distance / self.capacity_sectors
        )

    def media_service(self, lba: int, sectors: int) -> float:
        """Time the mechanism needs for one access (positioning + transfer)."""
        transfer = sectors * SECTOR / self.media_bytes_per_s
        if lba == self.last_end_lba:
            return transfer
        return self.seek_time(lba) + self.rotation_s / 2 + transfer

    def access(self, now: float, lba: int, sectors: int) -> float:
        """Queue one media access; returns when it is done."""
        start = max(now, self.busy_until)
        self.busy_until = start + self.media_service(lba, sectors)
        self.head_lba = lba + sectors
        self.last_end_lba = lba + sectors
        return self.busy_until

    def read(self, now: float, lba: int, sectors: int) -> float:
        return self.access(now, lba, sectors)

    def write(self, now: float, lba: int, sectors: int) -> float:
        """Write-back: the host sees the interface transfer; the destage is queued."""
        self.destaged_at = self.access(now, lba, sectors)
        return now + sectors * SECTOR / self.interface_bytes_per_s

    def flush(self, now: float) -> float:
        """Cached writes on the media; reads queued behind the last write need not finish first."""
        return max(now, self.destaged_at)


@dataclass
class Hdd15k:
    """A single 15,000 RPM SCSI disk (the study's)."""

    name: str = "hdd15k"
    disk: Spindle = field(default_factory=Spindle)

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        if op == READ:
            return self.disk.read(now, lba, sectors)
        if op == WRITE:
            return self.disk.write(now, lba, sectors)
        return self.disk.flush(now)


def _stripe_pieces(lba: int, sectors: int, unit: int) -> list[tuple[int, int, int]]:
    """Split a request into (stripe index, offset in unit, sectors) pieces."""
    pieces = []
    while sectors > 0:
        stripe, offset = divmod(lba, unit)
        take = min(sectors, unit - offset)
        pieces.append((stripe, offset, take))
        lba += take
        sectors -= take
    return pieces


@dataclass
class DiskArray:
    """N disks striped (RAID-0), each request split across them."""

    disks: int = 4
    unit_sectors: int = 64 * 1024 // SECTOR
    name: str = "array"
    members: list[Spindle] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [Spindle() for _ in range(self.disks)]

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        if op == FLUSH:
            return max([now] + [d.flush(now) for d in self.members])
        done = now
        for stripe, offset, take in _stripe_pieces(lba, sectors, self.unit_sectors):
            disk = self.members[stripe % self.disks]
            member_lba = (stripe // self.disks) * self.unit_sectors + offset
            end = (
                disk.read(now, member_lba, take)
                if op == READ
                else disk.write(now, member_lba, take)
            )
            done = max(done, end)
        return done


@dataclass
class Raid5:
    """N disks with rotating parity; small writes do read-modify-write."""

    disks: int = 4
    unit_sectors: int = 64 * 1024 // SECTOR
    name: str = "raid5"
    members: list[Spindle] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [Spindle() for _ in range(self.disks)]

    def locate(self, unit_index: int) -> tuple[int, int, int]:
        """(data disk, parity disk, row) of a logical stripe unit (left-symmetric layout)."""
        data_per_row = self.disks - 1
        row, k = divmod(unit_index, data_per_row)
        parity = (self.disks - 1 - row) % self.disks
        data = (parity + 1 + k) % self.disks
        return data, parity, row

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        if op == FLUSH:
            return max([now] + [d.flush(now) for d in self.members])
        done = now
        for unit_index, offset, take in _stripe_pieces(lba, sectors, self.unit_sectors):
            data, parity, row = self.locate(unit_index)
            member_lba = row * self.unit_sectors + offset
            if op == READ:
                done = max(done, self.members[data].read(now, member_lba, take))
                continue
            # Read-modify-write: old data and old parity, then new data and new parity.
            old = max(
                self.members[data].read(now, member_lba, take),
                self.members[parity].read(now, member_lba, take),
            )
            done = max(
                done,
                self.members[data].write(old, member_lba, take),
                self.members[parity].write(old, member_lba, take),
            )
        return done


@dataclass
class Ssd:
    """A flash SSD with parallel channels; no positioning cost."""

    channels: int = 8
    read_s: float = 90e-6
    write_s: float = 30e-6
    read_bytes_per_s: float = 250e6
    write_bytes_per_s: float = 200e6
    flush_s: float = 100e-6
    name: str = "ssd"
    free_at: list[float] = field(default_factory=list)
    last_write_done: float = 0.0

    def __post_init__(self) -> None:
        if not self.free_at:
            self.free_at = [0.0] * self.channels
            heapq.heapify(self.free_at)

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        if op == FLUSH:
            return max(now, self.last_write_done) + self.flush_s
        nbytes = sectors * SECTOR
        service = (
            self.read_s + nbytes / self.read_bytes_per_s
            if op == READ
            else self.write_s + nbytes / self.write_bytes_per_s
        )
        start = max(now, heapq.heappop(self.free_at))
        done = start + service
        heapq.heappush(self.free_at, done)
        if op == WRITE:
            self.last_write_done = max(self.last_write_done, done)
        return done


@dataclass
class Dilated:
    """A model whose clock runs ``factor`` times slower than real time."""

    inner: DiskModel
    factor: float

    def __post_init__(self) -> None:
        if self.factor < 1.0:
            raise ValueError(f"a dilation factor must be at least 1, not {self.factor}")
        self.name = f"{self.inner.name}x{self.factor:.1f}"

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        return self.inner.submit(now / self.factor, op, lba, sectors) * self.factor


def make_model(name: str) -> DiskModel:
    """A fresh model by name (see MODEL_NAMES); ValueError for an unknown one."""
    factories = {"none": NoDisk, "hdd15k": Hdd15k, "array": DiskArray, "raid5": Raid5, "ssd": Ssd}
    if name not in factories:
        raise ValueError(f"unknown disk model {name!r} (choose from {', '.join(MODEL_NAMES)})")
    return factories[name]()  # type: ignore[return-value]
