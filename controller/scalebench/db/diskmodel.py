"""Disk models applied on the traced block path.

A model turns each request (arrival time, operation, LBA, length) into a
completion time; the NBD server holds the reply until then, so the guest, and
the database clients above it, feel the modelled device. Real I/O on the host
still happens; its time is small next to the modelled one (the host's disk is
a fast SSD).

The rotating drive is the pager's own `hdd15k` (the study's Seagate
ST373453LC), its parameters read from `densevm describe` (disks.drive), so a
database trace and a paging run on `hdd15k` use one disk: the pager's seek
curve, rotation speed, media rate and command overhead. The names of the
layouts are the pager's `--disk` strings for the same layout, stripe unit and
RAID-5 placement (left-asymmetric). What only the database path models, because
only a file system issues them, is the drive's write-back cache and flushes:

- a write completes once transferred to the cache (interface rate); the drive
  destages it in order with the reads; a flush completes when the last cached
  write is destaged (reads queued after it do not hold it up);
- rotational latency is its expectation, half a revolution (the pager draws it
  from a seeded generator, with the same mean);
- a seek's distance is a fraction of the drive's capacity (73 GB), not of a
  swap file's span.

Models (times in seconds, LBAs in 512-byte sectors):

- ``hdd15k``: one such drive.
- ``array:4,drive=hdd15k``: four of them striped (RAID-0, the pager's stripe unit).
- ``raid5:4,drive=hdd15k``: four of them with rotating parity; a write that
  does not cover a whole row reads old data and old parity first
  (read-modify-write), then writes both through the members' caches.
- ``flash8``: an SSD with eight parallel flash channels (90 us per read plus
  250 MB/s, 30 us per write plus 200 MB/s; a flush waits for queued writes
  plus 100 us). It is not the pager's single-queue `ssd`, hence its own name.
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

from ..disks import Drive, drive, stripe_bytes

SECTOR = 512
READ, WRITE, FLUSH = "R", "W", "F"
ARRAY, RAID5 = "array:4,drive=hdd15k", "raid5:4,drive=hdd15k"
MODEL_NAMES = ("none", "hdd15k", ARRAY, RAID5, "flash8")
HDD15K_CAPACITY_SECTORS = 73_400_000_000 // SECTOR
ULTRA320_BYTES_PER_S = 320e6  # the study's SCSI interface: a cached write's transfer


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


def hdd15k() -> Drive:
    """The pager's hdd15k drive parameters."""
    return drive("hdd15k")


@dataclass
class Spindle:
    """One rotating drive with a FIFO queue and a write-back cache."""

    drive: Drive = field(default_factory=hdd15k)
    capacity_sectors: int = HDD15K_CAPACITY_SECTORS
    interface_bytes_per_s: float = ULTRA320_BYTES_PER_S
    busy_until: float = 0.0
    destaged_at: float = 0.0  # when the last cached write reaches the media
    head_lba: int = 0
    last_end_lba: int = -1

    def seek_time(self, lba: int) -> float:
        distance = abs(lba - self.head_lba)
        if distance == 0:
            return 0.0
        return self.drive.seek_ms_at(math.sqrt(distance / self.capacity_sectors)) / 1e3

    def media_service(self, lba: int, sectors: int) -> float:
        """Time the mechanism needs for one access (overhead + positioning + transfer)."""
        busy = self.drive.overhead_ms / 1e3 + sectors * SECTOR / (self.drive.mb_s * 1e6)
        if lba == self.last_end_lba:
            return busy
        return busy + self.seek_time(lba) + self.drive.revolution_s / 2

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
    """A single hdd15k drive (the study's)."""

    name: str = "hdd15k"
    disk: Spindle = field(default_factory=Spindle)

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        if op == READ:
            return self.disk.read(now, lba, sectors)
        if op == WRITE:
            return self.disk.write(now, lba, sectors)
        return self.disk.flush(now)


def _unit_sectors() -> int:
    return stripe_bytes() // SECTOR


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
    unit_sectors: int = field(default_factory=_unit_sectors)
    name: str = ARRAY
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
    unit_sectors: int = field(default_factory=_unit_sectors)
    name: str = RAID5
    members: list[Spindle] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.members:
            self.members = [Spindle() for _ in range(self.disks)]

    def locate(self, unit_index: int) -> tuple[int, int, int]:
        """(data disk, parity disk, row) of a logical stripe unit: the pager's left-asymmetric
        layout, parity moving one disk left per row and data filling the others in order."""
        row, k = divmod(unit_index, self.disks - 1)
        parity = (self.disks - 1 - row) % self.disks
        return (k if k < parity else k + 1), parity, row

    def submit(self, now: float, op: str, lba: int, sectors: int) -> float:
        if op == FLUSH:
            return max([now] + [d.flush(now) for d in self.members])
        pieces = _stripe_pieces(lba, sectors, self.unit_sectors)
        if op == READ:
            done = now
            for unit_index, offset, take in pieces:
                data, _, row = self.locate(unit_index)
                member_lba = row * self.unit_sectors + offset
                done = max(done, self.members[data].read(now, member_lba, take))
            return done
        rows: dict[int, list[tuple[int, int, int]]] = {}
        for unit_index, offset, take in pieces:
            rows.setdefault(unit_index // (self.disks - 1), []).append((unit_index, offset, take))
        return max([now] + [self._write_row(now, row, part) for row, part in rows.items()])

    def _write_row(self, now: float, row: int, pieces: list[tuple[int, int, int]]) -> float:
        """Write one row's pieces; parity from the new data alone when they cover the row."""
        base = row * self.unit_sectors
        parity = self.locate(pieces[0][0])[1]
        if sum(take for _, _, take in pieces) == (self.disks - 1) * self.unit_sectors:
            ends = [self.members[self.locate(u)[0]].write(now, base, take) for u, _, take in pieces]
            return max([*ends, self.members[parity].write(now, base, self.unit_sectors)])
        done = now
        for unit_index, offset, take in pieces:
            data = self.locate(unit_index)[0]
            # Read-modify-write: old data and old parity, then new data and new parity.
            old = max(
                self.members[data].read(now, base + offset, take),
                self.members[parity].read(now, base + offset, take),
            )
            done = max(
                done,
                self.members[data].write(old, base + offset, take),
                self.members[parity].write(old, base + offset, take),
            )
        return done


@dataclass
class Flash8:
    """A flash SSD with eight parallel channels; no positioning cost."""

    channels: int = 8
    read_s: float = 90e-6
    write_s: float = 30e-6
    read_bytes_per_s: float = 250e6
    write_bytes_per_s: float = 200e6
    flush_s: float = 100e-6
    name: str = "flash8"
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
    factories = {"none": NoDisk, "hdd15k": Hdd15k, ARRAY: DiskArray, RAID5: Raid5, "flash8": Flash8}
    if name not in factories:
        raise ValueError(f"unknown disk model {name!r} (choose from {', '.join(MODEL_NAMES)})")
    return factories[name]()  # type: ignore[return-value]
