"""Microbenchmark of the swap device: what one VM's miss costs on the real disk.

Denali's model charges each miss the VM's working set read with random reads of
the block size and written out with one sequential write. This measures both on
the file system (or block device) that holds densevm's swap, with O_DIRECT as
the pager uses, so the page cache does not hide the device.
"""

from __future__ import annotations

import mmap
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from .units import MIB, round_up

# Big enough that random reads do not all land in the device's cache line,
# small enough to write in a fraction of a second on the SSDs this runs on.
BENCH_FILE_BYTES = 64 * MIB
RANDOM_READS = 200
SEQUENTIAL_WRITES = 5
# Rounds of the above, apart in time; the quietest one is kept.
ROUNDS = 3
ROUND_GAP_S = 0.5
_ALIGN = 4096


@dataclass(frozen=True)
class DiskBench:
    """Measured cost of the two I/O patterns of a miss on the real device."""

    path: str
    block_bytes: int
    random_read_s: float  # median of one O_DIRECT random read of block_bytes
    write_bytes: int
    sequential_write_s: float  # median of one O_DIRECT sequential write of write_bytes
    sequential_read_s: float  # median of one O_DIRECT sequential read of write_bytes

    def as_dict(self) -> dict:
        return asdict(self)


def _aligned_buffer(size: int) -> mmap.mmap:
    """Anonymous mmap: page aligned, as O_DIRECT requires."""
    buf = mmap.mmap(-1, round_up(size, _ALIGN))
    buf.write(os.urandom(len(buf)))  # incompressible, in case the device compresses
    return buf


class ScratchFile:
    """A BENCH_FILE_BYTES file of random bytes under `directory`, opened with O_DIRECT as the
    pager opens its swap, removed on exit. A context manager; `fd` is the open descriptor."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.path = directory / f".scalebench-diskbench-{os.getpid()}"
        self.fd = -1

    def __enter__(self) -> ScratchFile:
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        except OSError as e:
            raise OSError(
                e.errno,
                f"cannot open a file with O_DIRECT in {self.directory} (tmpfs?), "
                f"as the pager's swap needs: {e.strerror}",
            ) from None
        try:
            # Fill the file so the reads hit allocated blocks, one MiB at a time.
            chunk = _aligned_buffer(MIB)
            for off in range(0, BENCH_FILE_BYTES, MIB):
                os.pwrite(self.fd, chunk, off)
            os.fsync(self.fd)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.path.unlink(missing_ok=True)


def measure(directory: Path, block_bytes: int, write_bytes: int, seed: int = 1) -> DiskBench:
    """Benchmark the device under `directory` with a scratch file that is removed afterwards."""
    write_bytes = round_up(write_bytes, _ALIGN)
    chunk = _aligned_buffer(max(MIB, write_bytes))
    with ScratchFile(directory) as scratch:
        rounds = []
        for _ in range(ROUNDS):
            rounds.append(_round(scratch.fd, chunk, block_bytes, write_bytes, random.Random(seed)))
            time.sleep(ROUND_GAP_S)
    # The quietest round: right after a run the host may still be freeing the last
    # swap file, and one such round measured a sequential read 40x too slow.
    read, write, seqread = min(rounds, key=sum)
    return DiskBench(str(directory), block_bytes, read, write_bytes, write, seqread)


def random_io_rate(scratch: ScratchFile, block_bytes: int, seconds: float, seed: int) -> float:
    """Random O_DIRECT reads and writes of `block_bytes` on `scratch`, alternating, one at a
    time as the pager's misses and evictions go, for `seconds`: operations per second. The
    host's own swap-path speed, with no densevm in it (the nightly's disk reference)."""
    buf = _aligned_buffer(block_bytes)
    view = memoryview(buf)[:block_bytes]
    slots = BENCH_FILE_BYTES // block_bytes
    rng = random.Random(seed)
    ops = 0
    started = time.perf_counter()
    deadline = started + seconds
    while (now := time.perf_counter()) < deadline:
        off = rng.randrange(slots) * block_bytes
        if ops % 2:
            os.pwritev(scratch.fd, [view], off)
        else:
            os.preadv(scratch.fd, [view], off)
        ops += 1
    return ops / (now - started)


def _round(
    fd: int, chunk: mmap.mmap, block_bytes: int, write_bytes: int, rng: random.Random
) -> tuple[float, float, float]:
    """Medians of one round: (random read of a block, sequential write, sequential read)."""
    writes, seqreads = [], []
    for i in range(SEQUENTIAL_WRITES):
        off = (i * write_bytes) % (BENCH_FILE_BYTES - write_bytes)
        off -= off % _ALIGN
        t0 = time.perf_counter()
        os.pwrite(fd, memoryview(chunk)[:write_bytes], off)
        t1 = time.perf_counter()
        os.preadv(fd, [memoryview(chunk)[:write_bytes]], off)
        seqreads.append(time.perf_counter() - t1)
        writes.append(t1 - t0)
    readbuf = _aligned_buffer(block_bytes)
    slots = BENCH_FILE_BYTES // block_bytes
    reads = []
    for _ in range(RANDOM_READS):
        off = rng.randrange(slots) * block_bytes
        t0 = time.perf_counter()
        os.preadv(fd, [memoryview(readbuf)[:block_bytes]], off)
        reads.append(time.perf_counter() - t0)
    return statistics.median(reads), statistics.median(writes), statistics.median(seqreads)
