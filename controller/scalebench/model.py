"""Denali's performance model of web-server VMs under memory overcommit.

The memory budget holds k = floor(budget / footprint) VMs, where a VM's
footprint is its working set rounded up to the paging block (internal
fragmentation). Requests pick VMs by Zipf(alpha); the pager keeps recently used
VMs resident, which we approximate as an LRU cache of k out of N items and
estimate its hit ratio with Che's approximation (H. Che, Y. Tung, Z. Wang,
"Hierarchical Web caching systems: modeling, design and experimental results",
IEEE JSAC 20(7), 2002; C. Fricker, P. Robert, J. Roberts, "A versatile and
accurate approximation for LRU cache performance", ITC 24, 2012):

    characteristic time T solves  sum_i (1 - exp(-p_i T)) = k
    hit ratio                h = sum_i p_i (1 - exp(-p_i T))

A miss costs what Denali's model charged: the working set read back with
random reads of the block size (footprint / block of them) and the evicted VM
written out with one sequential write (of its changed blocks: the per-VM layout
keeps the swap copy of a block whose content did not change, and the pager
joins the writes across short gaps of unchanged blocks). `wsswap` writes
the whole set (its log rewrites every evicted block that holds data, so the set
lies in one extent) and reads it back sequentially, as the pager does it: the
first `after - 1` faults after an eviction are single random block reads (the
policy waits for the VM to run again), then the rest comes in one read. Each I/O costs what the swap
device measured
(diskbench) plus the service time of the modeled disk (disks.py), exactly as the
pager adds it.

Throughput is bounded by the CPU (the in-core cost per request, calibrated,
plus for misses the pager's CPU work per fault: one per block for demand, one
per miss for wsswap) and by the swap I/O (as many requests in flight as
drives, up to the pager's service threads):

    X = min(1 / (cpu_s + (1 - h) * faults_per_miss * fault_s),
            min(drives, threads) / (misses_per_request * miss_s))

When the swap I/O bounds it, the client's C requests in flight (a closed loop)
nearly all wait on misses, and a miss takes seconds (W) to be served. A VM
being paged in neither holds memory nor misses again: the requests that reach
it meanwhile wait and then hit. Per VM (rate l = p_i X, m = exp(-p_i T)) a
cycle is a miss, W of paging in, then hits until a gap longer than T, so

    misses per request  sum_i p_i m / (1 + m p_i u)
    occupancy           sum_i (1 - m) / (1 + m p_i u) = k
    requests waiting    u sum_i p_i m (1 + p_i u / 2) / (1 + m p_i u) = C

with u = X W, the requests that arrive during one miss. The last line fixes u
(Little's law over the requests that wait), the second T, and saturation then
gives X. A VM paging in holds part of its footprint meanwhile (`demand` half
on average, as its blocks arrive one by one; `wsswap` its single faults until
the set comes in one read), so the occupancy counts f m p_i u / (1 + m p_i u)
more for it. Near the cliff this is worth up to 2x: Fig 8's wsswap at 1,100
VMs measured 2,407 requests/s where Che alone (u = 0) gave 977, and the
measured misses per request by popularity band matched the formula at W = 2 s.

W is also about how long the loop takes from a warm start to reach this
steady state: its C requests are on misses within seconds, and the drive
interleaves their reads, so none is served much before W. A measurement that
starts sooner (a warm-up shorter than W) sees the loop fill and stall instead:
at 4k blocks past the cliff W is minutes (64 misses of 233 random reads each).

With hibernation (densevm --idle-after T, --max-live L) a request can find its
VM asleep and wake it. VM i's requests arrive at l_i = p_i X (Poisson), so it
has been idle longer than T when one arrives with probability exp(-p_i X T);
the cap keeps the L most recently used VMs awake, an LRU cache of L whose
characteristic time t_L (in requests) Che's approximation gives as above. Both
keep a VM awake for a while after its last request, the idle timer X T
requests and the cap about t_L, and whichever is shorter decides (when X T <
t_L the timer alone leaves fewer than L awake and the cap does not act):

    wake fraction  w = sum_i p_i exp(-p_i min(X T, t_L))

(w = 1 - h of an LRU of L when T is long). Each wake costs the request the wake
time in latency and the host the wake's CPU, charged in the CPU bound:

    cpu bound  1 / (cpu_s + (1 - h) * faults_per_miss * fault_s + w * wake_cpu_s)

X is the throughput the model predicts, so X and w are solved together. The
hit ratio stays the budget's: the wake's costs include bringing the woken VM's
working set back from swap (the client's wake time measures it), so a request
that both wakes a VM and misses the budget's LRU is charged twice, which is
rare while the budget holds the awake VMs.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from .describe import fact, vms_swap_is_sized_for
from .diskbench import DiskBench
from .disks import UNIFORM_SQRT_DISTANCE, DiskModel, disk_model
from .units import KIB

if TYPE_CHECKING:
    from .config import RunConfig

# The webguest's paged RAM as densevm lays it out (`densevm describe`, guest):
# connection state at the head of bss (RAM offset 0), the working set right
# after bss (page aligned, not block aligned), the stack at the top. A request
# touches all three, so the footprint is every block they overlap: internal
# fragmentation grows with the block, which is why small blocks delay the
# cliff. Only an estimate for `scalebench model`: runs measure the footprint,
# and this estimate takes one slot's connection buffer as the bss it touches.
GUEST_BSS_HEAD_BYTES = 8 * KIB
PAGE_BYTES = 4 * KIB

# Where "the cliff" is: throughput below half the in-core throughput. The sweep
# locates the measured cliff with the same fraction (tables.cliff_rows).
CLIFF_FRACTION = 0.5
# The model's regime is in-core while paging costs less than this share of throughput.
IN_CORE_LOSS = 0.05
# Host time per fault served, aggregate over the host, when a run has nothing
# better: runs calibrate it in their settle phase (runner.py) and `scalebench
# model` uses the stored value. A fault resolved with one 32 KiB UFFDIO_COPY
# takes 84-131 us here (docs/host-facts.md). Overridable with --fault-us.
DEFAULT_FAULT_US = 100.0
# What a wake of a hibernated VM costs the model: 5 ms of latency, from connect to last byte at
# the client (a new vCPU and KVM VM, the working set back from swap), as
# experiments/bench/hibernation.py measured it on this host; and 1 ms of host CPU, charged in the
# CPU bound (a round figure, not yet calibrated).
DEFAULT_WAKE_MS = 5.0
DEFAULT_WAKE_CPU_US = 1000.0


def densevm_swap_bytes(vms: int, policy: str, ram_bytes: int | None = None) -> int:
    """The swap device densevm sizes when none is given (`densevm describe`): a region of
    RAM size for each VM it is sized for, times the policy's layout factor (the log needs
    slack). The modeled drives span it all."""
    ram = ram_bytes or fact("guest.ram_bytes")
    layout = fact("pager.policy.layouts").get(policy, "per-vm")  # plugins: per-VM regions
    return vms_swap_is_sized_for(vms) * ram * fact("pager.swap_bytes_per_ram_byte")[layout]


def zipf_popularity(n: int, alpha: float) -> np.ndarray:
    """Request probability of ranks 1..n under Zipf(alpha) (alpha 0: uniform)."""
    weights = np.arange(1, n + 1, dtype=float) ** -alpha
    return weights / weights.sum()


def che_hit_ratio(n: int, k: float, alpha: float) -> float:
    """LRU hit ratio of a cache holding k of n items under Zipf(alpha), Che's approximation."""
    if k >= n:
        return 1.0
    if k <= 0:
        return 0.0
    p = zipf_popularity(n, alpha)
    t = che_time(p, k)
    return float(np.sum(p * -np.expm1(-p * t)))


def che_time(p: np.ndarray, k: float, u: float = 0.0, paging_in: float = 0.0) -> float:
    """The characteristic time T of an LRU cache of k items under popularities p (0 < k <
    len(p)), in requests; u: the requests that arrive while a miss is paged in, during which
    an item holds the share `paging_in` of its size."""

    def occupancy(t: float) -> float:
        m = np.exp(-p * t)
        return float(np.sum((1.0 - m + paging_in * m * p * u) / (1.0 + m * p * u)))

    # occupancy(T) rises from occupancy(0) to n. VMs paging in may fill k on their own
    # (many requests in flight on few VMs): then nothing stays cached between requests.
    if occupancy(0.0) >= k:
        return 0.0
    # Bracket k, then bisect on log T.
    lo, hi = 1.0, 2.0
    while occupancy(hi) < k:
        lo, hi = hi, hi * 2.0
    while occupancy(lo) > k:
        lo /= 2.0
        if lo < 1e-12:  # k sits at occupancy(0) within rounding
            return 0.0
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if occupancy(mid) < k:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-10:
            break
    return math.sqrt(lo * hi)


def awake_window(rps: float, idle_after_s: float, cap: float) -> float:
    """How long, in requests, a VM stays awake after its last request: the idle timer's
    rps x idle_after_s requests, or `cap` (awake_cap) when that is shorter."""
    return min(rps * idle_after_s, cap)


def awake_cap(p: np.ndarray, max_live: int | None) -> float:
    """The characteristic time (in requests) of an LRU cache of `max_live` VMs under
    popularities p: how long --max-live keeps a VM awake; infinite without a cap or with room
    for every VM."""
    if max_live is None or max_live >= len(p):
        return math.inf
    return che_time(p, max_live)


def wakes_per_request(p: np.ndarray, window: float) -> float:
    """The share of requests that find their VM asleep when each VM stays awake `window`
    requests after its last one: sum_i p_i exp(-p_i window)."""
    return float(np.sum(p * np.exp(-p * window)))


def wake_fraction(
    n: int, alpha: float, rps: float, idle_after_s: float | None, max_live: int | None = None
) -> float:
    """The share of Zipf(alpha) requests over n VMs, `rps` of them a second, that meet a
    hibernated VM under densevm --idle-after idle_after_s (None: never) --max-live max_live
    (the module docstring's wake term)."""
    if idle_after_s is None:
        return 0.0
    p = zipf_popularity(n, alpha)
    return wakes_per_request(p, awake_window(rps, idle_after_s, awake_cap(p, max_live)))


def closed_loop_misses(n: int, k: float, alpha: float, in_flight: int, paging_in: float) -> float:
    """Misses per request of an LRU cache of k of n VMs under Zipf(alpha) when the swap
    I/O is saturated and `in_flight` requests (a closed loop) wait on misses that take a
    while to serve, a VM holding the share `paging_in` of its footprint meanwhile (the
    module docstring's three equations)."""
    if k >= n:
        return 0.0
    p = zipf_popularity(n, alpha)
    return float(np.sum(p * closed_loop(n, k, alpha, in_flight, paging_in)[0]))


def closed_loop(
    n: int, k: float, alpha: float, in_flight: int, paging_in: float
) -> tuple[np.ndarray, float]:
    """The closed loop of closed_loop_misses (k < n): per VM (by popularity rank) the share
    of its requests that miss, and u = X W, the requests that arrive while one miss is
    served (the module docstring)."""
    p = zipf_popularity(n, alpha)

    def profile(u: float) -> np.ndarray:
        m = np.exp(-p * che_time(p, k, u, paging_in))
        return m / (1.0 + m * p * u)

    def waiting(u: float) -> float:
        # Per VM, a miss and the requests that join it wait W and W/2: in requests, u (1 + p u/2).
        return u * float(np.sum(p * profile(u) * (1 + p * u / 2)))

    lo, hi = 0.0, float(in_flight)
    while waiting(hi) < in_flight:
        lo, hi = hi, hi * 2.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if waiting(mid) < in_flight else (lo, mid)
        if hi - lo < 1e-6 * hi:
            break
    u = (lo + hi) / 2
    return profile(u), u


def miss_sqrt_distance(n: int, k: float, alpha: float, samples: int = 100_000) -> float:
    """E[sqrt(|x - y| / span)] for the swap regions of two independent misses.

    `demand` keeps VM i's blocks in a region of its RAM size at i's place on
    the swap device (creation order), and the pager's seek time grows with the
    square root of the distance. Misses are not uniform over the VMs: VM i
    misses with probability p_i exp(-p_i T) (Che), so with Zipf popularity by
    VM number they cluster, and the average seek is shorter than the drive's
    average over random requests (8/15 in these units).
    """
    if k >= n or n < 2:
        return 8 / 15
    p = zipf_popularity(n, alpha)
    miss = p * np.exp(-p * che_time(p, k))
    rng = np.random.default_rng(0)  # a fixed sample: the model is deterministic
    x, y = rng.choice(n, size=(2, samples), p=miss / miss.sum())
    return float(np.mean(np.sqrt(np.abs(x - y) / n)))


def _blocks(regions: list[tuple[int, int]], block_bytes: int) -> set[int]:
    blocks: set[int] = set()
    for offset, length in regions:
        blocks.update(range(offset // block_bytes, (offset + length - 1) // block_bytes + 1))
    return blocks


def _request_regions(ws_pages: list[int], ram_bytes: int | None) -> list[tuple[int, int]]:
    ram = ram_bytes or fact("guest.ram_bytes")
    stack, ws_offset = fact("guest.stack_bytes"), fact("guest.ws_offset")
    return [(0, GUEST_BSS_HEAD_BYTES), (ram - stack, stack)] + [
        (ws_offset + p * PAGE_BYTES, PAGE_BYTES) for p in ws_pages
    ]


def estimate_footprint(ws_bytes: int, block_bytes: int, ram_bytes: int | None = None) -> int:
    """Resident bytes of one VM that has served requests: the blocks its requests touch."""
    pages = list(range(-(-ws_bytes // PAGE_BYTES)))
    return len(_blocks(_request_regions(pages, ram_bytes), block_bytes)) * block_bytes


def estimate_written(
    ws_bytes: int,
    block_bytes: int,
    stride: int | None = None,
    ram_bytes: int | None = None,
) -> int:
    """Bytes the eviction of one VM writes under the per-VM layout: the blocks a request
    changes (its connection state, its stack and every `stride`-th working-set page,
    densevm's --ws-write-stride), joined across gaps of resident blocks of up to
    the pager's write-cluster gap, as the pager joins its writes."""
    stride = stride or fact("guest.ws_write_stride_default")
    gap_bytes = fact("pager.write_cluster_gap_bytes")
    pages = list(range(-(-ws_bytes // PAGE_BYTES)))
    resident = _blocks(_request_regions(pages, ram_bytes), block_bytes)
    changed = sorted(_blocks(_request_regions(pages[::stride], ram_bytes), block_bytes))
    written = set(changed)
    for a, b in itertools.pairwise(changed):
        gap = range(a + 1, b)
        if len(gap) * block_bytes <= gap_bytes and all(x in resident for x in gap):
            written.update(gap)
    return len(written) * block_bytes


@dataclass(frozen=True)
class ModelInput:
    """Everything the prediction depends on."""

    vms: int
    alpha: float
    block_bytes: int
    budget_bytes: int
    footprint_bytes: int
    policy: str
    disk: DiskModel
    cpu_s: float  # in-core aggregate CPU time per request (1 / in-core throughput)
    bench: DiskBench | None  # None: the real device's time is left out (modeled time only)
    fault_s: float = DEFAULT_FAULT_US * 1e-6  # pager CPU per fault served (aggregate)
    written_bytes: int | None = None  # of the footprint, what an eviction writes (None: all of it)
    after: int | None = None  # wsswap: the fault after an eviction that prefetches the set
    swap_bytes: int | None = (
        None  # the swap device the drives' seeks span (None: as densevm sizes it)
    )
    in_flight: int = 64  # the client's requests in flight (zipfperf --concurrency)
    idle_after_s: float | None = None  # densevm --idle-after: hibernation of idle VMs (None: off)
    max_live: int | None = None  # densevm --max-live: most VMs awake (None: no cap)
    wake_s: float = DEFAULT_WAKE_MS * 1e-3  # a wake's latency at the client
    wake_cpu_s: float = DEFAULT_WAKE_CPU_US * 1e-6  # a wake's host CPU (aggregate)

    def used_fraction(self, used_bytes: int) -> float:
        """The share of the swap device's span that `used_bytes` from its start fill."""
        span = self.swap_bytes or densevm_swap_bytes(self.vms, self.policy)
        return min(1.0, used_bytes / span)

    @property
    def written(self) -> int:
        return min(
            self.footprint_bytes,
            self.written_bytes if self.written_bytes is not None else self.footprint_bytes,
        )

    @property
    def paging_in(self) -> float:
        """The share of its footprint a VM holds while it pages in: demand's blocks arrive one
        by one (half on average), wsswap's single faults come before the set."""
        if self.policy == "wsswap":
            return self.single_faults * self.block_bytes / self.footprint_bytes
        return 0.5

    @property
    def single_faults(self) -> int:
        """wsswap: block faults served one by one before the prefetch."""
        after = self.after or fact("pager.policy.wsswap_after_default")
        return min(after - 1, self.footprint_bytes // self.block_bytes)


def unmodeled(policy: str) -> str | None:
    """Why the model cannot predict `policy` (a plugin), or None for a policy it knows."""
    known = fact("pager.policy.builtin")
    return None if policy in known else f"the model knows {' and '.join(known)}, not {policy}"


def model_input(
    cfg: RunConfig,
    footprint_bytes: int,
    cpu_us: float,
    fault_us: float,
    bench: DiskBench | None,
    swap_bytes: int | None = None,
) -> ModelInput:
    """The model's input for a run's configuration, its footprint, its costs (chosen by
    calibration.cpu_us and fault_us) and the swap device's benchmark: the one place both a run
    and `scalebench model` build it."""
    return ModelInput(
        vms=cfg.vms,
        alpha=cfg.alpha,
        block_bytes=cfg.block_bytes,
        budget_bytes=cfg.mem_bytes,
        footprint_bytes=footprint_bytes,
        policy=cfg.policy,
        disk=disk_model(cfg.disk),
        cpu_s=cpu_us * 1e-6,
        bench=bench,
        fault_s=fault_us * 1e-6,
        written_bytes=estimate_written(cfg.ws_bytes, cfg.block_bytes),
        swap_bytes=swap_bytes,
        in_flight=cfg.concurrency,
        idle_after_s=cfg.idle_after,
        max_live=cfg.max_live,
    )


@dataclass(frozen=True)
class Prediction:
    """The model's figures; JSON-ready through as_dict()."""

    footprint_bytes: int
    cache_vms: int  # k: VMs the budget holds (working sets exceed memory beyond it)
    cliff_vms: int  # the fewest VMs at which throughput falls below CLIFF_FRACTION of in-core
    hit_ratio: float
    miss_read_s: float
    miss_write_s: float
    miss_s: float
    cpu_rps: float  # CPU bound: requests plus the pager's work for the misses
    disk_rps: float  # swap I/O bound; inf when every request hits
    model_rps: float
    regime: str  # "in-core" unless paging costs more than IN_CORE_LOSS of in-core throughput
    cpu_us: float
    fault_us: float
    disk: str
    policy: str
    wake_fraction: float  # requests that wake a hibernated VM (0 without hibernation)
    wake_ms: float  # the latency each wake adds
    wake_cpu_us: float  # the host CPU each wake takes, in the CPU bound
    # How long a request that misses waits for its VM: its own I/O in core; disk-bound, W of
    # the closed loop (the module docstring). From a warm start the loop takes about as long
    # to fill with misses and reach its steady state: nothing a miss waits on is served before.
    miss_wait_s: float

    def as_dict(self) -> dict:
        d = asdict(self)
        if math.isinf(d["disk_rps"]):
            d["disk_rps"] = None  # JSON has no infinity
        return d


def miss_cost(inp: ModelInput) -> tuple[float, float]:
    """(read, write) I/O seconds one miss costs: bring the VM in, write the victim out."""
    fp, block, disk, bench = inp.footprint_bytes, inp.block_bytes, inp.disk, inp.bench
    random_read = bench.random_read_s if bench else 0.0
    if inp.policy == "wsswap":
        # The log appends: its extents lie between its start and where it has got to,
        # about one footprint per VM (each VM's set written once, holes not yet reused),
        # and a working set is wherever the log was when it was evicted: random in there.
        spread = UNIFORM_SQRT_DISTANCE * math.sqrt(inp.used_fraction(inp.vms * fp))
        write = disk.request_s(fp, spread) + (bench.sequential_write_s if bench else 0.0)
        singles = inp.single_faults * (disk.request_s(block, spread) + random_read)
        rest = fp - inp.single_faults * block
        read = singles + (
            disk.request_s(rest, spread) + (bench.sequential_read_s if bench else 0.0)
            if rest > 0
            else 0.0
        )
        return read, write
    # Consecutive requests on the drive come from different cold VMs (the pager's
    # threads interleave them): each read seeks between two misses' regions, and so
    # does the victim's write (the victim is a VM on its way to being a miss). The
    # regions, one of RAM size per VM in creation order, fill only part of the drive.
    spread = miss_sqrt_distance(
        inp.vms, inp.budget_bytes // inp.footprint_bytes, inp.alpha
    ) * math.sqrt(inp.used_fraction(inp.vms * fact("guest.ram_bytes")))
    write = disk.request_s(inp.written, spread) + (bench.sequential_write_s if bench else 0.0)
    read = (fp // block) * (disk.request_s(block, spread) + random_read)
    return read, write


@dataclass(frozen=True)
class _Bounds:
    """The two resources' limits for one input."""

    k: int
    hit: float
    read_s: float
    write_s: float
    cpu_rps: float  # CPU: requests and, for misses, the pager's work per fault
    disk_rps: float  # swap I/O over the drives the pager's threads keep busy (inf: no misses)
    wake: float = 0.0  # requests that wake a hibernated VM
    miss_wait_s: float = 0.0  # how long a request that misses waits for its VM

    @property
    def rps(self) -> float:
        return min(self.cpu_rps, self.disk_rps)


def _cpu_with_wakes(inp: ModelInput, cpu_s: float, other_rps: float) -> tuple[float, float]:
    """(CPU bound, wake fraction) for `cpu_s` of CPU per request before wakes, the throughput
    being min(CPU bound, other_rps). The wakes depend on that throughput (the busier, the
    shorter a VM's idle gaps) and the CPU bound on the wakes, so it is their fixed point
    X = min(1 / (cpu_s + w(X) wake_cpu_s), other_rps): the right side grows with X, so bisect
    between its values at X = 0 (every request wakes) and X = infinity."""
    if inp.idle_after_s is None:
        return 1.0 / cpu_s, 0.0
    idle_after_s = inp.idle_after_s
    p = zipf_popularity(inp.vms, inp.alpha)
    cap = awake_cap(p, inp.max_live)

    def wake(x: float) -> float:
        return wakes_per_request(p, awake_window(x, idle_after_s, cap))

    def throughput(x: float) -> float:
        return min(1.0 / (cpu_s + wake(x) * inp.wake_cpu_s), other_rps)

    lo, hi = throughput(0.0), throughput(math.inf)
    for _ in range(100):
        if hi / lo < 1 + 1e-10:
            break
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if throughput(mid) > mid else (lo, mid)
    w = wake(math.sqrt(lo * hi))
    return 1.0 / (cpu_s + w * inp.wake_cpu_s), w


def _bounds(inp: ModelInput) -> _Bounds:
    k = inp.budget_bytes // inp.footprint_bytes
    hit = che_hit_ratio(inp.vms, k, inp.alpha)
    read, write = miss_cost(inp)
    misses = 1.0 - hit
    # demand takes a fault per block; wsswap its single faults and one that prefetches the rest.
    faults_per_miss = (
        inp.single_faults + 1 if inp.policy == "wsswap" else inp.footprint_bytes // inp.block_bytes
    )
    cpu_s = inp.cpu_s + misses * faults_per_miss * inp.fault_s
    # The pager's service threads bound the swap I/Os in flight, whatever the drives.
    parallel = min(inp.disk.parallelism, fact("pager.service_threads"))

    def disk_rps(misses: float) -> float:
        # No misses, or misses that cost no I/O (no disk model and no device benchmark).
        return parallel / (misses * (read + write)) if misses * (read + write) > 0 else math.inf

    cpu_rps, wake = _cpu_with_wakes(inp, cpu_s, disk_rps(misses))
    if disk_rps(misses) >= cpu_rps:
        # The CPU binds: misses are served as they come, each waiting for its own I/O.
        return _Bounds(k, hit, read, write, cpu_rps, disk_rps(misses), wake, read + write)
    profile, u = closed_loop(inp.vms, k, inp.alpha, inp.in_flight, inp.paging_in)
    misses = float(np.sum(zipf_popularity(inp.vms, inp.alpha) * profile))
    cpu_rps, wake = _cpu_with_wakes(inp, cpu_s, disk_rps(misses))
    bounds = _Bounds(k, 1.0 - misses, read, write, cpu_rps, disk_rps(misses), wake)
    return replace(bounds, miss_wait_s=u / bounds.rps)


def in_core_cpu_s(inp: ModelInput) -> float:
    """CPU per request with every working set resident: the request's, and with hibernation
    its share of the wakes at the throughput that leaves (the in-core level the regime and the
    cliff compare with, so that wakes alone are neither paging nor a cliff)."""
    _, wake = _cpu_with_wakes(inp, inp.cpu_s, math.inf)
    return inp.cpu_s + wake * inp.wake_cpu_s


def cliff_vms(inp: ModelInput) -> int:
    """The fewest VMs for which the predicted throughput is below CLIFF_FRACTION of in-core.

    Throughput falls monotonically with the number of VMs, so bisect between k
    (all fit) and a bound that is doubled until it is past the cliff.
    """

    def past(n: int) -> bool:
        at = replace(inp, vms=n)
        return _bounds(at).rps < CLIFF_FRACTION / in_core_cpu_s(at)

    lo = max(1, inp.budget_bytes // inp.footprint_bytes)  # not past: everything fits
    hi = 2 * lo
    while not past(hi):
        lo, hi = hi, 2 * hi
        if hi > 1 << 20:  # never falls (a disk far faster than the CPU)
            return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not past(mid) else (lo, mid)
    return hi


def predict(inp: ModelInput) -> Prediction:
    """Predicted throughput and its parts for one configuration."""
    error = unmodeled(inp.policy)
    if error:
        raise ValueError(error)
    b = _bounds(inp)
    # In core while paging costs under IN_CORE_LOSS of the in-core throughput.
    in_core = b.rps >= (1.0 - IN_CORE_LOSS) / in_core_cpu_s(inp)
    return Prediction(
        footprint_bytes=inp.footprint_bytes,
        cache_vms=int(b.k),
        cliff_vms=cliff_vms(inp),
        hit_ratio=b.hit,
        miss_read_s=b.read_s,
        miss_write_s=b.write_s,
        miss_s=b.read_s + b.write_s,
        cpu_rps=b.cpu_rps,
        disk_rps=b.disk_rps,
        model_rps=b.rps,
        regime="in-core" if in_core else "disk-bound",
        cpu_us=inp.cpu_s * 1e6,
        fault_us=inp.fault_s * 1e6,
        disk=inp.disk.name,
        policy=inp.policy,
        wake_fraction=b.wake,
        wake_ms=inp.wake_s * 1e3,
        wake_cpu_us=inp.wake_cpu_s * 1e6,
        miss_wait_s=b.miss_wait_s,
    )
