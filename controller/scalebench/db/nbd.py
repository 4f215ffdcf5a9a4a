"""Our NBD server in front of the guest's disk: copy-on-write, traced, modelled.

QEMU connects to it over a Unix socket (``nbd+unix:///?socket=PATH``). The
server

- serves the base image read-only and keeps every written 4 KiB block in a
  per-run overlay file (sparse), so the base image is never modified;
- records every request: arrival time, read/write/flush, LBA, length in
  sectors and latency (arrival to reply);
- holds each reply until the disk model's completion time.

Protocol: fixed newstyle negotiation (NBD_OPT_GO / NBD_OPT_EXPORT_NAME, simple
replies only), commands READ, WRITE, FLUSH, DISC. One thread reads and serves
requests and answers those already due; a second sends the others when they
are due, so requests overlap in the model as they do on a real queue.
"""

from __future__ import annotations

import contextlib
import heapq
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from .diskmodel import FLUSH, READ, SECTOR, WRITE, DiskModel

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC = 0x3E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
FLAG_FIXED_NEWSTYLE, FLAG_NO_ZEROES = 1, 2
OPT_EXPORT_NAME, OPT_ABORT, OPT_GO = 1, 2, 7
REP_ACK, REP_INFO, REP_ERR_UNSUP = 1, 3, 2**31 + 1
TX_HAS_FLAGS, TX_SEND_FLUSH = 1, 4
CMD_READ, CMD_WRITE, CMD_DISC, CMD_FLUSH = 0, 1, 2, 3
EINVAL = 22
BLOCK = 4096


@dataclass(frozen=True)
class TraceRecord:
    """One block request as the host saw it."""

    t: float  # arrival, seconds since the server started
    op: str  # "R", "W" or "F"
    lba: int  # first 512-byte sector (0 for a flush)
    sectors: int  # length in sectors (0 for a flush)
    latency: float  # seconds from arrival to reply


class CowImage:
    """A read-only base image with a sparse overlay of 4 KiB blocks."""

    def __init__(self, base: Path, overlay: Path) -> None:
        self.size = base.stat().st_size
        if self.size % BLOCK:
            raise ValueError(f"{base}: size {self.size} is not a multiple of {BLOCK}")
        self.base_fd = os.open(base, os.O_RDONLY)
        self.overlay_fd = os.open(overlay, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(self.overlay_fd, self.size)
        self.copied = bytearray(self.size // BLOCK)

    def close(self) -> None:
        os.close(self.base_fd)
        os.close(self.overlay_fd)

    def read(self, offset: int, length: int) -> bytes:
        out = bytearray()
        end = offset + length
        while offset < end:
            block = offset // BLOCK
            source = self.copied[block]
            run_end = min(end, (block + 1) * BLOCK)
            while run_end < end and self.copied[run_end // BLOCK] == source:
                run_end = min(end, (run_end // BLOCK + 1) * BLOCK)
            fd = self.overlay_fd if source else self.base_fd
            out += os.pread(fd, run_end - offset, offset)
            offset = run_end
        return bytes(out)

    def write(self, offset: int, data: bytes) -> None:
        end = offset + len(data)
        first, last = offset // BLOCK, (end - 1) // BLOCK
        partial = {first} if offset % BLOCK else set()
        if end % BLOCK:
            partial.add(last)
        for block in partial:
            if not self.copied[block]:
                os.pwrite(
                    self.overlay_fd, os.pread(self.base_fd, BLOCK, block * BLOCK), block * BLOCK
                )
                self.copied[block] = 1
        os.pwrite(self.overlay_fd, data, offset)
        self.copied[first : last + 1] = b"\x01" * (last - first + 1)

    def flush(self) -> None:
        os.fdatasync(self.overlay_fd)


@dataclass
class _Pending:
    due: float
    seq: int
    handle: int
    error: int
    payload: bytes
    arrival: float
    op: str
    lba: int
    sectors: int

    def __lt__(self, other: _Pending) -> bool:
        return (self.due, self.seq) < (other.due, other.seq)


@dataclass
class NbdServer:
    """Serve one QEMU client on a Unix socket until it disconnects or stop() is called."""

    socket_path: Path
    base: Path
    overlay: Path
    model: DiskModel
    record: bool = True
    real_flush: bool = True
    records: list[TraceRecord] = field(default_factory=list)
    error: str | None = None

    def __post_init__(self) -> None:
        self.image = CowImage(self.base, self.overlay)
        self.t0 = time.monotonic()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        self._listener.listen(1)
        self._conn: socket.socket | None = None
        self._queue: list[_Pending] = []
        self._cv = threading.Condition()
        self._send_lock = threading.Lock()
        self._stopping = False
        self._seq = 0
        self._threads = [
            threading.Thread(target=self._serve, name="nbd-serve", daemon=True),
            threading.Thread(target=self._reply_loop, name="nbd-reply", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # -- public -----------------------------------------------------------
    def now(self) -> float:
        """Seconds since the server started (the trace's clock)."""
        return time.monotonic() - self.t0

    def alive(self) -> bool:
        return self._threads[0].is_alive() and self.error is None

    def stop(self) -> None:
        """Close the connection and the files; idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        for sock in (self._conn, self._listener):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)
        if self.image is not None:
            self.image.close()
            self.image = None  # type: ignore[assignment]
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()

    # -- negotiation -------------------------------------------------------
    def _recv(self, n: int) -> bytes:
        assert self._conn is not None
        buf = bytearray()
        while len(buf) < n:
            chunk = self._conn.recv(n - len(buf))
            if not chunk:
                raise EOFError("client closed the connection")
            buf += chunk
        return bytes(buf)

    def _option_reply(self, option: int, kind: int, data: bytes = b"") -> None:
        assert self._conn is not None
        self._conn.sendall(struct.pack(">QIII", REPLY_MAGIC, option, kind, len(data)) + data)

    def _negotiate(self) -> None:
        assert self._conn is not None
        tx_flags = TX_HAS_FLAGS | TX_SEND_FLUSH
        self._conn.sendall(
            struct.pack(">QQH", NBDMAGIC, IHAVEOPT, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES)
        )
        (client_flags,) = struct.unpack(">I", self._recv(4))
        while True:
            magic, option, length = struct.unpack(">QII", self._recv(16))
            if magic != IHAVEOPT:
                raise ValueError("bad option magic from client")
            self._recv(
                length
            )  # the export name and info requests: there is one export, served whatever asked
            if option == OPT_EXPORT_NAME:
                pad = b"" if client_flags & FLAG_NO_ZEROES else b"\0" * 124
                self._conn.sendall(struct.pack(">QH", self.image.size, tx_flags) + pad)
                return
            if option == OPT_GO:
                self._option_reply(
                    option, REP_INFO, struct.pack(">HQH", 0, self.image.size, tx_flags)
                )
                self._option_reply(option, REP_ACK)
                return
            if option == OPT_ABORT:
                self._option_reply(option, REP_ACK)
                raise EOFError("client aborted negotiation")
            self._option_reply(option, REP_ERR_UNSUP)

    # -- transmission ----------------------------------------------------------
    def _serve(self) -> None:
        try:
            self._conn, _ = self._listener.accept()
            self._negotiate()
            while True:
                magic, _flags, kind, handle, offset, length = struct.unpack(
                    ">IHHQQI", self._recv(28)
                )
                if magic != REQUEST_MAGIC:
                    raise ValueError("bad request magic from client")
                arrival = self.now()
                if kind == CMD_DISC:
                    return
                self._handle(kind, handle, offset, length, arrival)
        except (EOFError, OSError):
            if not self._stopping and self._conn is None:
                self.error = "NBD client never connected"
        except Exception as err:  # noqa: BLE001 - a protocol violation or an I/O error ends the device
            self.error = f"NBD server failed: {err}"
        finally:
            with self._cv:
                self._cv.notify_all()

    def _handle(self, kind: int, handle: int, offset: int, length: int, arrival: float) -> None:
        payload, error = b"", 0
        if kind == CMD_WRITE:
            data = self._recv(length)
            op = WRITE
            self._check(offset, length)
            self.image.write(offset, data)
        elif kind == CMD_READ:
            op = READ
            self._check(offset, length)
            payload = self.image.read(offset, length)
        elif kind == CMD_FLUSH:
            op, offset, length = FLUSH, 0, 0
            if self.real_flush:
                self.image.flush()
        else:
            op, error = "?", EINVAL
        due = (
            self.now()
            if error
            else self.model.submit(arrival, op, offset // SECTOR, length // SECTOR)
        )
        pending = _Pending(
            due, 0, handle, error, payload, arrival, op, offset // SECTOR, length // SECTOR
        )
        if (
            due <= self.now()
        ):  # nothing to wait for: answer from this thread, saving a thread hand-off
            self._reply(pending)
            return
        with self._cv:
            self._seq += 1
            pending.seq = self._seq
            heapq.heappush(self._queue, pending)
            self._cv.notify_all()

    def _reply(self, item: _Pending) -> None:
        assert self._conn is not None
        with self._send_lock:
            self._conn.sendall(
                struct.pack(">IIQ", SIMPLE_REPLY_MAGIC, item.error, item.handle) + item.payload
            )
        if self.record and item.op != "?":
            self.records.append(
                TraceRecord(
                    item.arrival, item.op, item.lba, item.sectors, self.now() - item.arrival
                )
            )

    def _check(self, offset: int, length: int) -> None:
        if offset + length > self.image.size:
            raise ValueError(f"request beyond the end of the disk: offset {offset} length {length}")

    def _reply_loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (not self._queue or self._queue[0].due > self.now()):
                    if not self._queue and not self._threads[0].is_alive():
                        return
                    timeout = None if not self._queue else max(0.0, self._queue[0].due - self.now())
                    self._cv.wait(timeout if timeout is not None else 0.5)
                if self._stopping:
                    return
                item = heapq.heappop(self._queue)
            try:
                self._reply(item)
            except OSError:
                return
