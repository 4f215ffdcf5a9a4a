"""The traced block path in its own process.

The NBD server (nbd.py) answers every guest I/O; in the controller's process
it would compete for the interpreter lock with the database clients and the
guest would wait for its disk behind them. Here it runs in a child Python
process (``python -m scalebench.db.tracer``: a fresh interpreter that imports
nothing of the caller's main module) driven over a socket pair: records, sectors
moved in a window, status, disk-model changes, recording on or off, stop. The trace clock is
CLOCK_MONOTONIC in both processes, so the parent reads it directly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from .diskmodel import Dilated, make_model
from .errors import DbTraceError
from .nbd import NbdServer, TraceRecord

START_TIMEOUT_S = 30.0
CONTROLLER_DIR = Path(__file__).resolve().parents[2]


def _child(
    conn: Connection,
    socket_path: str,
    base: str,
    overlay: str,
    disk: str,
    record: bool,
    real_flush: bool,
) -> None:
    try:
        server = NbdServer(
            Path(socket_path),
            Path(base),
            Path(overlay),
            make_model(disk),
            record=record,
            real_flush=real_flush,
        )
    except Exception as err:  # noqa: BLE001 - reported to the parent, whatever it is
        conn.send(("error", f"the NBD server could not start: {err}"))
        return
    conn.send(("ready", server.t0))
    while True:
        try:
            command, *args = conn.recv()
        except EOFError:  # the parent is gone: stop serving
            server.stop()
            return
        if command == "records":
            conn.send(list(server.records))
        elif command == "sectors":
            start, end = float(args[0]), float(args[1])
            moved = {"R": 0, "W": 0}
            for r in server.records:
                if start <= r.t < end and r.op in moved:
                    moved[r.op] += r.sectors
            conn.send((moved["R"], moved["W"]))
        elif command == "status":
            conn.send((server.alive(), server.error))
        elif command == "dilate":
            server.model = Dilated(make_model(disk), float(args[0]))
            conn.send(True)
        elif command == "record":
            server.record = bool(args[0])
            conn.send(True)
        elif command == "stop":
            server.stop()
            conn.send(list(server.records))
            return


class TracedDisk:
    """Parent-side handle of the NBD server process (same interface the guest needs)."""

    def __init__(
        self,
        socket_path: Path,
        base: Path,
        overlay: Path,
        disk: str,
        record: bool = True,
        real_flush: bool = True,
    ) -> None:
        self.socket_path = socket_path
        self._lock = threading.Lock()
        parent_sock, child_sock = socket.socketpair()
        settings = {
            "socket_path": str(socket_path),
            "base": str(base),
            "overlay": str(overlay),
            "disk": disk,
            "record": record,
            "real_flush": real_flush,
        }
        env = dict(
            os.environ,
            PYTHONPATH=os.pathsep.join([str(CONTROLLER_DIR), os.environ.get("PYTHONPATH", "")]),
        )
        self._proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "scalebench.db.tracer",
                str(child_sock.fileno()),
                json.dumps(settings),
            ],
            pass_fds=(child_sock.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        child_sock.close()
        self._conn = Connection(parent_sock.detach())
        self._final: list[TraceRecord] | None = None
        self.error: str | None = None
        try:
            if not self._conn.poll(START_TIMEOUT_S):
                raise DbTraceError(f"the NBD server did not start within {START_TIMEOUT_S:.0f} s")
            kind, value = self._conn.recv()
        except (EOFError, OSError) as err:
            self.stop()
            raise DbTraceError(
                f"the NBD server process exited at start-up (code {self._proc.returncode})"
            ) from err
        except DbTraceError:
            self.stop()
            raise
        if kind != "ready":
            self.stop()
            raise DbTraceError(str(value))
        self.t0 = float(value)

    def now(self) -> float:
        """Seconds since the server started (the trace's clock)."""
        return time.monotonic() - self.t0

    def _ask(self, *message: Any) -> Any:
        with self._lock:
            try:
                self._conn.send(message)
                return self._conn.recv()
            except (EOFError, OSError) as err:
                raise DbTraceError("the NBD server process is gone") from err

    @property
    def records(self) -> list[TraceRecord]:
        if self._final is not None:
            return self._final
        return list(self._ask("records"))

    def sectors(self, start: float, end: float) -> tuple[int, int]:
        """(sectors read, sectors written) by requests recorded within [start, end)."""
        read, written = self._ask("sectors", start, end)
        return int(read), int(written)

    def alive(self) -> bool:
        if self._final is not None or self._proc.poll() is not None:
            return False
        try:
            alive, self.error = self._ask("status")
        except DbTraceError as err:
            self.error = str(err)
            return False
        return bool(alive)

    def dilate(self, factor: float) -> None:
        """Run the disk model in time dilated by ``factor`` from now on (a fresh model)."""
        self._ask("dilate", factor)

    def set_recording(self, on: bool) -> None:
        """Record requests from now on, or serve them (disk model and all) without recording."""
        self._ask("record", on)

    def stop(self) -> None:
        """Stop the server process (records stay readable); idempotent."""
        if self._final is None:
            try:
                self._final = list(self._ask("stop")) if self._proc.poll() is None else []
            except DbTraceError:
                self._final = []
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
        self.socket_path.unlink(missing_ok=True)


if __name__ == "__main__":
    _child(Connection(int(sys.argv[1])), **json.loads(sys.argv[2]))
