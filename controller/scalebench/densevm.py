"""densevm as the controller drives it: start, wait until ready, query, stop.

The contract is INTERFACES.md: JSON events on stdout (`ready`, `exit`), one-line
errors on stderr, and a Unix-socket control API with newline-delimited JSON.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import queue
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .procs import Child


class DenseVMError(RuntimeError):
    """densevm failed: it exited, refused a request or did not become ready."""


@dataclass(frozen=True)
class DenseVMArgs:
    """The densevm serve flags a caller sets (INTERFACES.md `densevm serve`); a flag left None
    takes densevm's default, and `extra` is appended as it is."""

    vms: int
    addr_base: str
    port: int
    api: Path
    ws: str | None = None
    mem: str | None = None
    block: str | None = None
    policy: str | None = None
    disk: str | None = None
    swap: Path | None = None
    extra: tuple[str, ...] = ()

    def argv(self, binary: Path) -> list[str]:
        argv = [str(binary), "serve"]
        for flag, value in (
            ("--vms", self.vms),
            ("--addr-base", self.addr_base),
            ("--port", self.port),
            ("--ws", self.ws),
            ("--mem", self.mem),
            ("--block", self.block),
            ("--policy", self.policy),
            ("--disk", self.disk),
            ("--swap", self.swap),
            ("--api", self.api),
        ):
            if value is not None:
                argv += [flag, str(value)]
        return [*argv, *self.extra]


def boot_timeout_s(vms: int) -> float:
    """How long densevm may take to report ready with `vms` VMs."""
    return 120 + 0.1 * vms


def wake_quantile_us(histogram: list[list[int]], q: float) -> int | None:
    """The `q` quantile (0 < q <= 1) of a stats wake-latency histogram (`wake_us`: [[us, count],
    ...] ascending, each bucket named by the largest latency it holds, within 1%), read as
    densevm reads its own (`wake_us_p99`); None when it is empty."""
    counts = [count for _, count in histogram]
    total = sum(counts)
    if total == 0:
        return None
    rank = min(max(math.ceil(q * total), 1), total)
    return next(
        us
        for (us, _), seen in zip(histogram, itertools.accumulate(counts), strict=True)
        if seen >= rank
    )


def wakes_between(before: list[list[int]], after: list[list[int]]) -> list[list[int]]:
    """The wakes of two samples of densevm's cumulative `wake_us` that the later one counts
    beyond the earlier: the histogram of the window between them."""
    earlier = {us: count for us, count in before}
    return [[us, count - earlier.get(us, 0)] for us, count in after if count > earlier.get(us, 0)]


def control(api: Path, request: dict, timeout_s: float = 30.0) -> dict:
    """One control-API request; DenseVMError for an error reply or a broken socket."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(api))
            s.sendall(json.dumps(request).encode() + b"\n")
            chunks = []
            while not chunks or not chunks[-1].endswith(b"\n"):
                data = s.recv(1 << 20)
                if not data:
                    break
                chunks.append(data)
    except OSError as e:
        raise DenseVMError(f"control API {api}: {e}") from e
    try:
        reply = json.loads(b"".join(chunks))
    except ValueError as e:
        raise DenseVMError(f"control API {api}: unreadable reply to {request['cmd']}") from e
    if not reply.get("ok"):
        raise DenseVMError(f"control API {request['cmd']}: {reply.get('error', 'no ok in reply')}")
    return reply


class DenseVM:
    """A running densevm, in its own process group; whoever starts it must call stop() on every
    path. The one way the controller launches densevm: runs, trace recording and the scaling
    sessions (scaling.Session) all start it here."""

    def __init__(
        self,
        binary: Path,
        args: DenseVMArgs,
        log_path: Path,
        wrap=lambda argv: argv,
        stop_grace_s: float = 30.0,
    ) -> None:
        self.args = args
        self.stop_grace_s = stop_grace_s
        self.log_path = log_path
        self.events: queue.Queue[dict] = queue.Queue()
        self.exit_event: dict | None = None
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed by close()
        self.child = Child(wrap(args.argv(binary)), stdout=subprocess.PIPE, stderr=self._log)
        self._reader = threading.Thread(target=self._read_events, daemon=True)
        self._reader.start()

    def _read_events(self) -> None:
        for line in self.child.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not an event: densevm may print other lines
            if event.get("event") == "exit":
                self.exit_event = event
            self.events.put(event)

    def stop(self) -> int | None:
        # Destroying thousands of VMs takes seconds; only then is SIGKILL the answer.
        code = self.child.stop(grace_s=self.stop_grace_s)
        self._reader.join(timeout=5)
        self._log.close()
        return code

    def failure(self) -> str | None:
        """Why densevm is gone, or None while it runs."""
        code = self.child.poll()
        if code is None:
            return None
        return f"densevm exited with status {code}: {self.last_error()}"

    def last_error(self) -> str:
        """densevm's `densevm: error: ...` line, else the last line of its stderr."""
        try:
            lines = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        errors = [x for x in lines if "error" in x]
        return (errors or lines or ["(empty log)"])[-1].strip()

    def wait_ready(self, timeout_s: float, on_progress=None) -> dict:
        """Block until the `ready` event; reports booted VMs through on_progress meanwhile (with
        none, the control API is left alone during the boot)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.5)
                if event.get("event") == "ready":
                    return event
            except queue.Empty:
                pass
            why = self.failure()
            if why:
                raise DenseVMError(why)
            if on_progress is not None and self.args.api.exists():
                # The API may not answer until the monitor is set up. With --idle-after a
                # booted VM may already be asleep: it counts as booted all the same.
                with contextlib.suppress(DenseVMError):
                    totals = self.totals()
                    on_progress(totals.get("running", 0) + totals.get("hibernated", 0))
        raise DenseVMError(f"densevm did not report ready within {timeout_s:.0f} s")

    def request(self, request: dict, timeout_s: float = 30.0) -> dict:
        """A control-API request; if densevm has died, the error says how instead of "connection
        refused"."""
        try:
            return control(self.args.api, request, timeout_s)
        except DenseVMError:
            why = self.failure()
            if why:
                raise DenseVMError(why) from None
            raise

    def stats(self) -> dict:
        """Totals and every VM's figures."""
        return self.request({"cmd": "stats"})

    def totals(self) -> dict:
        """The totals alone: cheap enough to ask every second (no pass over the VMs' memory,
        the pager's lock held only for its counters)."""
        return self.request({"cmd": "stats", "vms": False})["totals"]

    def pager(self) -> dict:
        return self.request({"cmd": "pager"})

    def set_disk_modeled(self, on: bool) -> None:
        """Charge (True) or suspend (False) the pager's disk model."""
        self.request({"cmd": "disk", "modeled": on})
