#!/usr/bin/env python3
"""What installing guest memory costs the host's kernel, per MiB, the way a wake's prefetch does it.

A wake's prefetch puts the working set (~1 MiB, 256 pages) back into the VM's memfd-backed RAM.
This measures, into fresh (hole-punched) pages of a shared memfd mapping registered with
userfaultfd as the pager registers guest RAM: UFFDIO_COPY in 32 KiB pieces (one block each) and
in one 1 MiB piece, both write-protected as the pager installs clean blocks; pwrite(2) into the
memfd; pwrite over pages already there; and a user-space memcpy of the same MiB, the copy
alone. Printed: the p50 over --rounds of microseconds per MiB and per page.

Usage: experiments/bench/page_install_cost.py [--rounds 40]
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import mmap
import os
import statistics
import struct
import sys
import time
from collections.abc import Callable

MIB = 1 << 20
PAGE = 4096
BLOCK = 32 << 10
# <linux/userfaultfd.h>
UFFD_API = 0xAA
UFFDIO_API = 0xC018AA3F
UFFDIO_REGISTER = 0xC020AA00
UFFDIO_COPY = 0xC028AA03
UFFDIO_REGISTER_MODE_MISSING = 1
UFFDIO_REGISTER_MODE_WP = 2
UFFDIO_COPY_MODE_WP = 2
UFFD_FEATURE_MISSING_SHMEM = 1 << 5
UFFD_FEATURE_WP_HUGETLBFS_SHMEM = 1 << 12
SYS_USERFAULTFD = 323  # x86-64
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def checked(rc: int, what: str) -> int:
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return rc


def userfaultfd(base: int, length: int) -> int:
    """A userfaultfd registered over [base, base+length) for missing pages and write-protect."""
    fd = checked(libc.syscall(SYS_USERFAULTFD, os.O_CLOEXEC | os.O_NONBLOCK), "userfaultfd")
    features = UFFD_FEATURE_MISSING_SHMEM | UFFD_FEATURE_WP_HUGETLBFS_SHMEM
    fcntl.ioctl(fd, UFFDIO_API, bytearray(struct.pack("QQQ", UFFD_API, features, 0)))
    mode = UFFDIO_REGISTER_MODE_MISSING | UFFDIO_REGISTER_MODE_WP
    fcntl.ioctl(fd, UFFDIO_REGISTER, bytearray(struct.pack("QQQQ", base, length, mode, 0)))
    return fd


def uffd_copy(fd: int, dst: int, src: int, length: int) -> None:
    fcntl.ioctl(
        fd, UFFDIO_COPY, bytearray(struct.pack("QQQQq", dst, src, length, UFFDIO_COPY_MODE_WP, 0))
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    if args.rounds < 2:
        print("error: --rounds must be at least 2", file=sys.stderr)
        return 2
    size = args.rounds * MIB
    memfd = os.memfd_create("page-install-cost")
    os.ftruncate(memfd, size)
    rw = mmap.PROT_READ | mmap.PROT_WRITE
    base = libc.mmap(None, size, rw, mmap.MAP_SHARED, memfd, 0)
    if base in (None, ctypes.c_void_p(-1).value):
        print(f"error: mmap of the memfd: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    try:
        return measure(memfd, base, args.rounds)
    finally:
        libc.munmap(base, size)
        os.close(memfd)


def measure(memfd: int, base: int, rounds: int) -> int:
    """Prints each way's median over `rounds` MiB of the memfd mapped at `base`."""
    try:
        uffd = userfaultfd(base, rounds * MIB)
    except OSError as e:
        print(f"error: userfaultfd on shared memory: {e}", file=sys.stderr)
        return 1
    source = ctypes.create_string_buffer(os.urandom(MIB), MIB)
    src, data = ctypes.addressof(source), source.raw
    scratch = ctypes.create_string_buffer(MIB)

    def fresh(at: int) -> None:
        checked(libc.fallocate(memfd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, at, MIB), "punch")

    def copy_blocks(at: int) -> None:
        for o in range(0, MIB, BLOCK):
            uffd_copy(uffd, base + at + o, src + o, BLOCK)

    def copy_whole(at: int) -> None:
        uffd_copy(uffd, base + at, src, MIB)

    def write(at: int) -> None:
        os.pwrite(memfd, data, at)

    def memcpy(_at: int) -> None:
        ctypes.memmove(scratch, source, MIB)

    # (what, on fresh pages, how)
    ways: list[tuple[str, bool, Callable[[int], None]]] = [
        ("UFFDIO_COPY, 32 KiB pieces", True, copy_blocks),
        ("UFFDIO_COPY, one 1 MiB piece", True, copy_whole),
        ("pwrite into fresh pages", True, write),
        ("pwrite over resident pages", False, write),
        ("memcpy in user space", False, memcpy),
    ]
    try:
        for name, punch, install in ways:
            times = []
            for k in range(rounds):
                at = k * MIB
                if punch:
                    fresh(at)
                t0 = time.perf_counter()
                install(at)
                times.append((time.perf_counter() - t0) * 1e6)
            us = statistics.median(times)
            print(f"{name:30s} {us:8.1f} us a MiB, {us / (MIB // PAGE):5.2f} us a page")
    finally:
        os.close(uffd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
