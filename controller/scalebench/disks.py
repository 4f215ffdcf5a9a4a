"""Disk models as the performance model charges them.

densevm's pager (`--disk MODEL`, paging-policy/src/disk.rs) adds a modeled
service time to each real swap I/O, so that results of Denali's era (7,200 RPM
IDE disks) are reproducible on a fast SSD. The performance model must charge
the same times, so the drive parameters and the stripe unit are the pager's
own, read from `densevm describe` (describe.py), never copied here.

The pager's service time of a non-sequential request on a rotating drive is
command overhead + seek + rotational latency (uniform over one revolution) +
transfer; a random request's seek averages `seek_ms`, so its expected time is
overhead + seek + half a revolution + transfer. Flash: latency + transfer.
Each drive is a FIFO queue, so independent requests proceed in parallel on as
many drives as the layout has; one request is split in stripe units over the
data drives, which transfer their parts at the same time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .describe import fact

# E[sqrt(|x - y|)] for x, y uniform on [0, 1]: random requests over the whole span.
UNIFORM_SQRT_DISTANCE = 8 / 15


@dataclass(frozen=True)
class Drive:
    """One drive's parameters, as the pager's DriveParams."""

    seek_ms: float  # average seek over uniformly random requests
    track_ms: float  # track-to-track seek
    rpm: float
    mb_s: float  # media rate, 10^6 bytes/s
    overhead_ms: float  # per-command controller overhead
    lat_ms: float  # flash access latency (0 for rotating drives)

    @property
    def full_stroke_ms(self) -> float:
        """Seek across the whole span: chosen so that uniformly random requests average
        `seek_ms` on the pager's square-root seek curve."""
        return self.track_ms + (self.seek_ms - self.track_ms) / UNIFORM_SQRT_DISTANCE

    @property
    def revolution_s(self) -> float:
        """One revolution of the spindle (0 for flash)."""
        return 60.0 / self.rpm if self.rpm else 0.0

    def seek_ms_at(self, sqrt_distance: float) -> float:
        """Seek time for a distance of sqrt_distance**2 of the span: the pager's seek curve."""
        if not self.seek_ms:
            return 0.0
        return self.track_ms + (self.full_stroke_ms - self.track_ms) * sqrt_distance

    def positioning_s(self, sqrt_distance: float = UNIFORM_SQRT_DISTANCE) -> float:
        """Expected time before a request's transfer starts, given E[sqrt(seek distance / span)]:
        overhead, seek, half a revolution of rotational latency, and flash latency."""
        ms = self.overhead_ms + self.seek_ms_at(sqrt_distance) + self.lat_ms
        return ms / 1e3 + self.revolution_s / 2


DRIVE_NAMES = ("hdd", "hdd15k", "ssd")


def drive(name: str) -> Drive:
    """The pager's drive `name` (hdd, hdd15k, ssd), with its parameters."""
    p = fact(f"pager.disks.drives.{name}")
    return Drive(
        seek_ms=p["seek_ms"],
        track_ms=p["track_ms"],
        rpm=p["rpm"],
        mb_s=p["mb_s"],
        overhead_ms=p["overhead_ms"],
        lat_ms=p["lat_ms"],
    )


def stripe_bytes() -> int:
    """The pager's stripe unit for arrays."""
    return int(fact("pager.disks.stripe_bytes"))


@dataclass(frozen=True)
class DiskModel:
    """A named disk configuration as `--disk` spells it ("hdd", "array:3", "none")."""

    name: str
    drive: Drive | None  # None: no modeled time, the real device only
    drives: int = 1  # drives in the layout
    data_drives: int = 1  # drives a request's stripe units spread over (raid5: drives - 1)

    @property
    def parallelism(self) -> int:
        """Independent requests served at once: one per drive queue."""
        return self.drives

    def request_s(self, size: int, sqrt_distance: float = UNIFORM_SQRT_DISTANCE) -> float:
        """Expected modeled time of one request of `size` bytes (read, or a full-stripe write)
        whose seek distance averages E[sqrt(distance / span)] = sqrt_distance (default: uniform)."""
        if self.drive is None:
            return 0.0
        spread = max(1, min(self.data_drives, -(-size // stripe_bytes())))
        return self.drive.positioning_s(sqrt_distance) + size / (self.drive.mb_s * 1e6 * spread)


def differences(model: DiskModel, pager: dict) -> list[str]:
    """Where the pager's reported disk model (`{"cmd":"pager"}` -> pager.disk) differs from ours.

    An empty list means the model charges what the pager adds; anything else
    means the run's densevm was another build than the one described.
    """
    if model.drive is None:
        return (
            [] if pager.get("model", "none") == "none" else [f"model {pager.get('model')} vs none"]
        )
    ours = {
        "seek_ms": model.drive.seek_ms,
        "track_ms": model.drive.track_ms,
        "rpm": model.drive.rpm,
        "mb_s": model.drive.mb_s,
        "overhead_ms": model.drive.overhead_ms,
        "lat_ms": model.drive.lat_ms,
        "drives": model.drives,
        "stripe_bytes": stripe_bytes(),
    }
    return [
        f"{k} {pager[k]} vs {v}"
        for k, v in ours.items()
        if k in pager and float(pager[k]) != float(v)
    ]


_ARRAY = re.compile(r"^(array|raid5):(\d+)$")


def disk_model(name: str) -> DiskModel:
    """The model `--disk NAME` selects; ValueError for an unknown name.

    The pager also accepts `,key=value` overrides; the model does not, so they are refused here.
    """
    if name in ("none", ""):
        return DiskModel("none", None)
    if name in DRIVE_NAMES:
        return DiskModel(name, drive(name))
    m = _ARRAY.match(name)
    if m and 1 <= int(m.group(2)) <= 64:
        kind, n = m.group(1), int(m.group(2))
        member = drive(fact("pager.disks.array_drive"))
        if kind == "array":
            return DiskModel(name, member, drives=n, data_drives=n)
        if n >= 3:
            return DiskModel(name, member, drives=n, data_drives=n - 1)
    raise ValueError(
        f"unknown disk model {name!r} (none, hdd, hdd15k, ssd, array:N, raid5:N with 3 <= N <= 64)"
    )
