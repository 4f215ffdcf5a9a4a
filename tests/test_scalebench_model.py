"""The performance model: Che's approximation, miss costs and the throughput prediction."""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict

import numpy as np
import pytest
from scalebench.disks import disk_model, drive
from scalebench.model import (
    ModelInput,
    che_hit_ratio,
    che_time,
    closed_loop,
    closed_loop_misses,
    estimate_footprint,
    estimate_written,
    miss_sqrt_distance,
    predict,
    zipf_popularity,
)
from scalebench.units import GIB, KIB, MIB


def simulated_lru_hit_ratio(n: int, k: int, alpha: float, requests: int, seed: int = 7) -> float:
    """Brute force: an LRU cache of k items fed independent Zipf(alpha) requests."""
    rng = np.random.default_rng(seed)
    stream = rng.choice(n, size=requests, p=zipf_popularity(n, alpha))
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    warm = requests // 10  # skip the cold start: Che's approximation is for the steady state
    for i, item in enumerate(stream):
        if item in cache:
            cache.move_to_end(item)
            hits += i >= warm
        else:
            cache[item] = None
            if len(cache) > k:
                cache.popitem(last=False)
    return hits / (requests - warm)


@pytest.mark.parametrize(
    "n,k,alpha", [(100, 10, 0.8), (200, 50, 1.0), (100, 30, 0.0), (300, 60, 1.5)]
)
def test_che_matches_brute_force_lru(n, k, alpha):
    simulated = simulated_lru_hit_ratio(n, k, alpha, 200_000)
    assert che_hit_ratio(n, k, alpha) == pytest.approx(simulated, abs=0.015)


def simulated_closed_loop(
    n: int, k: int, alpha: float, clients: int, requests: int
) -> tuple[float, float]:
    """Brute force: `clients` requests in flight over an LRU cache of k VMs whose misses queue
    on one drive (1 s each, so it stays busy). A VM enters the cache when its miss is served;
    requests that reach it meanwhile wait and then hit. Hits take 0.1 ms. Returns the misses
    per request and the mean time from a miss to its VM's arrival."""
    rng = np.random.default_rng(3)
    picks = iter(rng.choice(n, size=requests + clients, p=zipf_popularity(n, alpha)).tolist())
    cache: OrderedDict[int, None] = OrderedDict()
    waiting: dict[int, list[int]] = {}
    events = [(0.0, client, -1) for client in range(clients)]  # (time, client, paged-in VM)
    drive_free, served, misses, waited = 0.0, 0, 0, 0.0
    while served < requests:
        t, client, vm = heapq.heappop(events)
        if vm >= 0:
            cache[vm] = None
            if len(cache) > k:
                cache.popitem(last=False)
            for waiter in waiting.pop(vm):
                heapq.heappush(events, (t + 1e-4, waiter, -1))
                served += 1
            continue
        vm = next(picks)
        if vm in cache:
            cache.move_to_end(vm)
            heapq.heappush(events, (t + 1e-4, client, -1))
            served += 1
        elif vm in waiting:
            waiting[vm].append(client)
        else:
            misses += 1
            waiting[vm] = [client]
            drive_free = max(drive_free, t) + 1.0
            waited += drive_free - t
            heapq.heappush(events, (drive_free, -1, vm))
    return misses / served, waited / misses


@pytest.mark.parametrize("n,k,clients", [(400, 340, 16), (400, 360, 32)])
def test_closed_loop_misses_match_a_simulated_closed_loop(n, k, clients):
    simulated, wait = simulated_closed_loop(n, k, 1.0, clients, 300_000)
    assert closed_loop_misses(n, k, 1.0, clients, 0.0) == pytest.approx(simulated, rel=0.15)
    # Che alone (no requests wait on a miss) overstates the misses near the cliff.
    assert 1 - che_hit_ratio(n, k, 1.0) > 1.15 * simulated
    # A miss waits W = u / X, and the drive (1 s a miss) bounds X at 1 / misses per request.
    profile, u = closed_loop(n, k, 1.0, clients, 0.0)
    modeled = u * float(np.sum(zipf_popularity(n, 1.0) * profile))
    assert modeled == pytest.approx(wait, rel=0.15)
    assert wait > 0.25 * clients  # several misses queue ahead of each


def test_closed_loop_limits():
    assert closed_loop_misses(100, 100, 1.0, 64, 0.0) == 0.0
    # Few requests in flight: hardly any wait, Che's misses.
    assert closed_loop_misses(1000, 800, 1.0, 1, 0.0) == pytest.approx(
        1 - che_hit_ratio(1000, 800, 1.0), rel=0.02
    )
    # A VM that holds memory while it pages in leaves less room for the others.
    assert closed_loop_misses(1000, 800, 1.0, 64, 0.5) > closed_loop_misses(1000, 800, 1.0, 64, 0)


@pytest.mark.parametrize("paging_in", [0.0, 0.03, 0.5, 1.0])
@pytest.mark.parametrize("in_flight", [1, 64, 512])
@pytest.mark.parametrize("n", [3, 16, 2000])
def test_closed_loop_misses_fall_as_the_cache_grows(n, in_flight, paging_in):
    # Every input a run can record: a share of requests, never rising with the room.
    misses = [
        closed_loop_misses(n, max(1.0, n * share), 1.0, in_flight, paging_in)
        for share in (0.05, 0.3, 0.7, 0.95)
    ]
    assert all(0.0 <= m <= 1.0 for m in misses)
    assert misses == sorted(misses, reverse=True)


def test_vms_paging_in_can_fill_the_cache_on_their_own():
    # 64 requests in flight on 16 VMs, room for 2: the VMs paging in hold more than the
    # cache, so nothing stays between requests. Each VM then misses once per burst of
    # requests that wait on it (1 + p u of them), not on every request.
    p = zipf_popularity(16, 1.0)
    assert che_time(p, 2, 1_000.0, 0.5) == 0.0
    misses = closed_loop_misses(16, 2, 1.0, 64, 0.5)
    assert 0.0 < misses < 1.0
    assert misses > closed_loop_misses(16, 2, 1.0, 64, 0.0)


def test_che_limits():
    assert che_hit_ratio(100, 100, 1.0) == 1.0
    assert che_hit_ratio(100, 0, 1.0) == 0.0
    assert che_hit_ratio(1000, 250, 0.0) == pytest.approx(0.25, abs=1e-6)  # uniform: k/n


def hdd_input(**changes) -> ModelInput:
    block = changes.pop("block_bytes", 32 * KIB)
    values = dict(
        vms=4000,
        alpha=1.0,
        block_bytes=block,
        budget_bytes=GIB,
        footprint_bytes=estimate_footprint(896 * KIB, block),
        policy="demand",
        disk=disk_model("hdd"),
        cpu_s=100e-6,
        bench=None,
    )
    values.update(changes)
    return ModelInput(**values)


def test_throughput_rises_with_alpha():
    rps = [predict(hdd_input(alpha=a)).model_rps for a in (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5)]
    assert all(b > a for a, b in itertools.pairwise(rps)), rps


def test_throughput_rises_with_block_size():
    blocks = [4 * KIB, 8 * KIB, 16 * KIB, 32 * KIB, 64 * KIB, 128 * KIB]
    rps = [predict(hdd_input(block_bytes=b)).model_rps for b in blocks]
    assert all(b > a for a, b in itertools.pairwise(rps)), rps


def test_in_core_until_the_budget_is_full_then_disk_bound():
    fp = estimate_footprint(896 * KIB, 32 * KIB)
    cliff = GIB // fp
    below = predict(hdd_input(vms=cliff))
    above = predict(hdd_input(vms=int(cliff * 1.2)))
    assert below.regime == "in-core" and below.model_rps == pytest.approx(10_000)
    assert above.regime == "disk-bound" and above.model_rps < below.model_rps / 2
    assert below.cache_vms == cliff and cliff < below.cliff_vms < 1.2 * cliff


def test_a_miss_waits_for_its_own_io_in_core_and_for_the_queue_past_the_cliff():
    fp = estimate_footprint(896 * KIB, 32 * KIB)
    below = predict(hdd_input(vms=GIB // fp))
    assert below.miss_wait_s == below.miss_s
    # Past the cliff the 64 requests in flight nearly all wait on misses, served one by one.
    for block in (4 * KIB, 32 * KIB):
        past = predict(hdd_input(vms=1250, alpha=1.5, block_bytes=block, in_flight=64))
        assert past.regime == "disk-bound"
        assert 0.5 * 64 * past.miss_s < past.miss_wait_s <= 64 * past.miss_s
    # At 4k a miss is 233 random reads, so the wait is minutes: a 30 s warm-up does not reach it.
    assert predict(hdd_input(vms=1250, alpha=1.5, block_bytes=4 * KIB)).miss_wait_s > 60


def test_a_cliff_past_what_this_host_could_run_is_found():
    """The cliff search asks about counts this host could not boot (40 GiB of budget: ~42,000
    VMs fit); the model only needs the swap's size for them, not densevm's consent."""
    far = predict(hdd_input(vms=100, budget_bytes=40 * GIB))
    assert far.cliff_vms > 30_000


def test_miss_cost_is_denalis_random_reads_plus_one_sequential_write():
    # Uniform popularity, VM regions filling the drive: the drive's average seek.
    p = predict(hdd_input(alpha=0.0, swap_bytes=4000 * 4 * MIB))
    fp = p.footprint_bytes
    hdd = drive("hdd")
    random_read = (hdd.overhead_ms + hdd.seek_ms) / 1e3 + 30 / hdd.rpm + 32 * KIB / (hdd.mb_s * 1e6)
    assert p.miss_read_s == pytest.approx(fp // (32 * KIB) * random_read, rel=0.005)
    assert p.miss_write_s == pytest.approx(random_read - 32 * KIB / 40e6 + fp / 40e6, rel=0.005)


def test_skewed_misses_seek_shorter():
    """Zipf popularity by VM number clusters the misses' swap regions: shorter seeks."""
    assert miss_sqrt_distance(1000, 250, 0.0) == pytest.approx(8 / 15, rel=0.01)
    assert miss_sqrt_distance(1000, 250, 1.0) < 0.97 * 8 / 15
    assert predict(hdd_input(alpha=1.0)).miss_read_s < predict(hdd_input(alpha=0.0)).miss_read_s


def test_wsswap_beats_demand_out_of_core():
    assert predict(hdd_input(policy="wsswap")).model_rps > 2 * predict(hdd_input()).model_rps


def test_arrays_serve_in_parallel():
    one, three = predict(hdd_input()), predict(hdd_input(disk=disk_model("array:3")))
    assert three.model_rps == pytest.approx(3 * one.model_rps, rel=0.1)


def test_disk_names():
    assert disk_model("raid5:4").data_drives == 3
    for bad in ("floppy", "raid5:2", "array:0", "hdd,seek_ms=3"):
        with pytest.raises(ValueError):
            disk_model(bad)


def test_smaller_blocks_fit_more_vms():
    footprints = [estimate_footprint(896 * KIB, b * KIB) for b in (4, 8, 16, 32, 64, 128, 256)]
    assert footprints == sorted(footprints) and footprints[0] < footprints[-1]
    # 4k: 224 working-set pages + 2 of connection state + 8 of stack.
    assert footprints[0] == (224 + 2 + 8) * 4 * KIB
    # 32k: the working set starts mid-block (0x87000) and so spans 29 blocks, + bss head + stack.
    assert footprints[3] == 31 * 32 * KIB


def test_disk_model_difference_report():
    from scalebench.disks import differences

    # The pager's {"cmd":"pager"} reply for --disk hdd, as densevm reports it.
    pager_hdd = {
        "drives": 1,
        "kind": "rotating",
        "lat_ms": 0.0,
        "mb_s": 40.0,
        "model": "hdd",
        "overhead_ms": 0.1,
        "rpm": 7200.0,
        "seek_ms": 8.9,
        "span_bytes": 0,
        "stripe_bytes": 65536,
        "track_ms": 1.0,
    }
    assert differences(disk_model("hdd"), pager_hdd) == []
    assert differences(disk_model("hdd"), {**pager_hdd, "seek_ms": 9.5}) == ["seek_ms 9.5 vs 8.9"]
    assert differences(disk_model("none"), {**pager_hdd, "model": "none", "drives": 0}) == []


def test_written_blocks_follow_the_write_stride_joined_across_short_gaps():
    # 4k: every 4th of the 224 working-set pages is written, 0 to 220, and the pager joins them
    # into one write of pages 0..220; + 2 blocks of connection state + 8 of stack, far from them.
    assert estimate_written(896 * KIB, 4 * KIB) == (221 + 2 + 8) * 4 * KIB
    # A stride wider than the gap the pager bridges: only the changed blocks.
    assert estimate_written(896 * KIB, 4 * KIB, stride=100) == (3 + 2 + 8) * 4 * KIB
    # 16k: every block holds a written page but the last, whose 3 pages follow the last written one.
    assert (
        estimate_written(896 * KIB, 16 * KIB) == estimate_footprint(896 * KIB, 16 * KIB) - 16 * KIB
    )
    for block in (32 * KIB, 128 * KIB):
        assert estimate_written(896 * KIB, block) == estimate_footprint(896 * KIB, block)
    # Only changed blocks are written back (joined): a sparse writer writes less per eviction.
    small = hdd_input(
        block_bytes=4 * KIB, written_bytes=estimate_written(896 * KIB, 4 * KIB, stride=100)
    )
    assert predict(small).miss_write_s < predict(hdd_input(block_bytes=4 * KIB)).miss_write_s


def test_wsswap_miss_is_two_single_faults_then_one_read_of_the_set():
    fp = estimate_footprint(896 * KIB, 32 * KIB)
    random_block = disk_model("hdd").request_s(32 * KIB)
    whole = predict(hdd_input(policy="wsswap", swap_bytes=4000 * fp))  # the log fills the drive
    assert whole.footprint_bytes == fp
    assert whole.miss_read_s == pytest.approx(
        2 * random_block + disk_model("hdd").request_s(fp - 2 * 32 * KIB)
    )
    # Partly dirty: the log rewrites the whole set all the same (one extent, one write of all
    # of it).
    half = predict(hdd_input(policy="wsswap", written_bytes=fp // 2, swap_bytes=4000 * fp))
    assert half.miss_read_s == pytest.approx(whole.miss_read_s, rel=1e-9)
    assert half.miss_write_s == pytest.approx(whole.miss_write_s, rel=1e-9)
    # demand keeps unchanged blocks' copies: a half-dirty VM costs a shorter write.
    assert (
        predict(hdd_input(written_bytes=fp // 2)).miss_write_s < predict(hdd_input()).miss_write_s
    )


def test_seeks_span_only_the_used_part_of_the_swap_device():
    from scalebench.model import densevm_swap_bytes

    # densevm sizes swap for twice the VMs (and the log twice that): the regions fill half of it.
    assert densevm_swap_bytes(4000, "demand") == 8000 * 4 * MIB
    assert densevm_swap_bytes(4000, "wsswap") == 2 * 8000 * 4 * MIB
    full, half = predict(hdd_input(swap_bytes=4000 * 4 * MIB)), predict(hdd_input())
    reads = full.footprint_bytes // (32 * KIB)
    spread = miss_sqrt_distance(4000, GIB // full.footprint_bytes, 1.0)
    drive = disk_model("hdd").drive
    # Seek time grows with sqrt(distance / span): regions filling half the span, sqrt(1/2) of
    # the spread.
    expected = reads * (drive.positioning_s(spread) - drive.positioning_s(spread * 0.5**0.5))
    assert full.miss_read_s - half.miss_read_s == pytest.approx(expected, rel=1e-6)
    # The log's extents (a footprint per VM) fill an eighth of densevm's log device: shorter seeks.
    fp = full.footprint_bytes
    assert (
        predict(hdd_input(policy="wsswap")).model_rps
        > predict(hdd_input(policy="wsswap", swap_bytes=4000 * fp)).model_rps
    )
