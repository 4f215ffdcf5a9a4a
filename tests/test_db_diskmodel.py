"""Disk-model arithmetic: service times, queueing, striping, RAID-5 read-modify-write, flash
channels; and that the database path's drive and layouts are the pager's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.binaries import binary
from scalebench.db.diskmodel import (
    ARRAY,
    MODEL_NAMES,
    RAID5,
    SECTOR,
    Dilated,
    DiskArray,
    Flash8,
    Hdd15k,
    NoDisk,
    Raid5,
    Spindle,
    make_model,
)

ROT_HALF = 0.002  # half a rotation at 15,000 RPM


def test_hdd_random_read_is_seek_rotation_transfer() -> None:
    disk = Hdd15k()
    capacity = disk.disk.capacity_sectors
    lba = capacity // 4
    done = disk.submit(0.0, "R", lba, 8)
    seek = 0.0002 + 0.0072 * math.sqrt(0.25)
    assert done == pytest.approx(seek + ROT_HALF + 4096 / 75e6)


def test_hdd_sequential_read_pays_transfer_only() -> None:
    disk = Hdd15k()
    first = disk.submit(0.0, "R", 1000, 8)
    second = disk.submit(first, "R", 1008, 8)
    assert second - first == pytest.approx(4096 / 75e6)


def test_hdd_queues_fifo() -> None:
    disk = Hdd15k()
    a = disk.submit(0.0, "R", 10_000_000, 8)
    b = disk.submit(0.0, "R", 20_000_000, 8)
    assert b > a
    assert b - a == pytest.approx(Spindle(head_lba=10_000_008).media_service(20_000_000, 8))


def test_hdd_write_cache_and_flush() -> None:
    disk = Hdd15k()
    ack = disk.submit(0.0, "W", 5_000_000, 8)
    assert ack == pytest.approx(4096 / 320e6)  # acknowledged from the cache
    flushed = disk.submit(ack, "F", 0, 0)
    assert flushed == pytest.approx(disk.disk.busy_until)
    assert flushed > 0.002  # had to wait for the destage (rotation at least)


def test_hdd_flush_does_not_wait_for_reads_queued_after_the_last_write() -> None:
    disk = Hdd15k()
    disk.submit(0.0, "W", 5_000_000, 8)
    destaged = disk.disk.busy_until
    disk.submit(0.0, "R", 50_000_000, 8)  # queued behind the destage
    assert disk.submit(0.0, "F", 0, 0) == pytest.approx(destaged)
    assert disk.disk.busy_until > destaged


def test_array_serves_stripes_in_parallel() -> None:
    single, array = Hdd15k(), DiskArray()
    # Four random reads in four different stripe units: one spindle each in the array.
    lbas = [unit * 128 + 1_000_000 * 128 * i for i, unit in enumerate(range(4))]
    single_done = max(single.submit(0.0, "R", lba, 8) for lba in lbas)
    array_done = max(array.submit(0.0, "R", lba, 8) for lba in lbas)
    assert array_done < single_done / 2


def test_array_splits_a_request_across_members() -> None:
    array = DiskArray()
    array.submit(0.0, "R", 64, 256)  # 128 KiB from sector 64: units 0, 1 and 2
    busy = [d.busy_until > 0 for d in array.members]
    assert busy == [True, True, True, False]


def test_raid5_layout_is_left_asymmetric() -> None:
    raid = Raid5()
    # Parity moves one disk left per row; data fills the other disks from disk 0.
    assert [raid.locate(u) for u in range(9)] == [
        (0, 3, 0),
        (1, 3, 0),
        (2, 3, 0),
        (0, 2, 1),
        (1, 2, 1),
        (3, 2, 1),
        (0, 1, 2),
        (2, 1, 2),
        (3, 1, 2),
    ]


def test_raid5_full_row_write_reads_nothing() -> None:
    raid = Raid5()
    row = 3 * raid.unit_sectors
    ack = raid.submit(0.0, "W", 0, row)
    assert ack == pytest.approx(raid.unit_sectors * SECTOR / 320e6)  # cache transfer only
    assert all(d.busy_until > 0 for d in raid.members)  # three data units and the parity
    # A row plus one sector: the extra sector, in the next row, pays read-modify-write.
    assert Raid5().submit(0.0, "W", 0, row + 1) > ack + ROT_HALF


def test_raid5_small_write_reads_before_writing() -> None:
    raid, single = Raid5(), Hdd15k()
    ack = raid.submit(0.0, "W", 0, 8)
    # Old data and old parity are read first (positioning + transfer), so the write is not a
    # cache hit.
    assert ack > single.submit(0.0, "W", 0, 8)
    assert ack >= ROT_HALF
    touched = [d.busy_until > 0 for d in raid.members]
    assert touched == [True, False, False, True]


def test_ssd_channels_and_costs() -> None:
    ssd = Flash8()
    first = [ssd.submit(0.0, "R", i * 8, 8) for i in range(8)]
    assert all(t == pytest.approx(90e-6 + 4096 / 250e6) for t in first)
    ninth = ssd.submit(0.0, "R", 800, 8)
    assert ninth == pytest.approx(2 * (90e-6 + 4096 / 250e6))
    w = ssd.submit(0.0, "W", 0, 8)
    assert ssd.submit(0.0, "F", 0, 0) == pytest.approx(w + 100e-6)


def test_ssd_is_far_faster_than_hdd_on_random_reads() -> None:
    hdd, ssd = Hdd15k(), Flash8()
    lbas = [(i * 7919 * 1024) % 6_000_000 for i in range(200)]
    assert max(hdd.submit(0.0, "R", x, 8) for x in lbas) > 20 * max(
        ssd.submit(0.0, "R", x, 8) for x in lbas
    )


def test_none_adds_nothing_and_names() -> None:
    assert NoDisk().submit(1.5, "R", 0, 8) == 1.5
    for name in MODEL_NAMES:
        assert make_model(name).name == name
    with pytest.raises(ValueError, match="unknown disk model"):
        make_model("floppy")


def test_dilation_scales_service_and_queueing() -> None:
    plain, dilated = Hdd15k(), Dilated(Hdd15k(), 10.0)
    a = plain.submit(0.0, "R", 10_000_000, 8)
    b = plain.submit(0.0, "R", 20_000_000, 8)
    assert dilated.submit(0.0, "R", 10_000_000, 8) == pytest.approx(10 * a)
    assert dilated.submit(0.0, "R", 20_000_000, 8) == pytest.approx(
        10 * b
    )  # waits behind the first, dilated too
    assert dilated.name == "hdd15kx10.0"
    assert Dilated(NoDisk(), 30.0).submit(2.0, "R", 0, 8) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 1"):
        Dilated(Flash8(), 0.5)


def _densevm_describe(*flags: str) -> dict:
    out = subprocess.run(
        [str(binary("densevm")), "describe", "--json", *flags],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return json.loads(out)


def test_hdd15k_is_the_pagers_drive() -> None:
    """A database trace and a paging run on hdd15k time the mechanism alike: the pager's
    parameters, from densevm itself, give the database model's seek curve, rotation,
    transfer and overhead."""
    pager = _densevm_describe()["pager"]["disks"]["drives"]["hdd15k"]
    full_stroke_s = (pager["track_ms"] + (pager["seek_ms"] - pager["track_ms"]) * 15 / 8) / 1e3
    half_rotation_s = 30.0 / pager["rpm"]
    transfer_s = 4096 / (pager["mb_s"] * 1e6)
    overhead_s = pager["overhead_ms"] / 1e3
    spindle = Spindle()
    assert spindle.seek_time(spindle.capacity_sectors) == pytest.approx(full_stroke_s)
    assert spindle.seek_time(1) == pytest.approx(pager["track_ms"] / 1e3, rel=1e-2)
    far = Hdd15k().submit(0.0, "R", spindle.capacity_sectors - 8, 8)
    assert far == pytest.approx(overhead_s + full_stroke_s + half_rotation_s + transfer_s)
    seq = Spindle(last_end_lba=1000, head_lba=1000)
    assert seq.media_service(1000, 8) == pytest.approx(overhead_s + transfer_s)
    # The study's ST373453LC: 0.2 ms track to track, 7.4 ms full stroke, 15,000 RPM, 75 MB/s.
    assert (full_stroke_s, half_rotation_s, transfer_s) == pytest.approx(
        (0.0074, 0.002, 4096 / 75e6)
    )


@pytest.mark.parametrize("name", [ARRAY, RAID5])
def test_layout_names_are_the_pagers_disk_strings(name: str) -> None:
    described = _densevm_describe("--disk", name)
    assert described["config"]["disk"] == name
    disks = described["pager"]["disks"]
    model = make_model(name)
    assert isinstance(model, DiskArray | Raid5)
    assert model.unit_sectors * SECTOR == disks["stripe_bytes"]
    assert disks["raid5_parity"] == "left-asymmetric"
    assert len(model.members) == int(name.split(":")[1].split(",")[0])
