"""Child processes that are always torn down: each leads its own process group.

A process group lets teardown reach everything a child started (a wrapper
shell, helper threads' processes) with one signal, and keeps a terminal's
Ctrl-C from reaching the children before scalebench has decided the order of
teardown. SIGTERM to scalebench is turned into an exception (`Terminated`) so
that the same `finally` blocks run as for Ctrl-C.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO


class Terminated(BaseException):
    """scalebench received SIGTERM or SIGHUP; raised like KeyboardInterrupt."""


def _raise_terminated(signum: int, _frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


def install_signal_handlers() -> None:
    """Make SIGTERM/SIGHUP/SIGINT unwind the stack (and so tear children down).

    SIGINT gets Python's KeyboardInterrupt even when it was inherited as ignored
    (a background job of a non-interactive shell): whoever sends it to a
    scalebench wants that run stopped.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_terminated)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def interrupted(stop: BaseException) -> str:
    """A result's error for a run stopped by Ctrl-C (KeyboardInterrupt) or a signal (Terminated)."""
    return f"interrupted by {'SIGINT' if isinstance(stop, KeyboardInterrupt) else stop}"


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Hold SIGTERM, SIGHUP and SIGINT until the block ends: a second signal
    during the writing of a result must not lose it. The first that came
    meanwhile is sent again as the block ends, to the handlers of before.

    The handlers are swapped rather than the signals masked: a signal sent to
    the process may be taken by any thread, and only the handlers are
    per-process. Outside the main thread (no handlers to swap) nothing is held.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, _: held.append(signum)) for sig in STOP_SIGNALS
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:
        signal.raise_signal(held[0])


class Child:
    """A started child process in its own process group."""

    def __init__(self, argv: list[str], stdout: IO | int | None, stderr: IO | int | None) -> None:
        self.popen = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, process_group=0
        )
        self.pid = self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def interrupt(self) -> None:
        """SIGINT the leader: a program that ends early on it (zipfperf) finishes its report."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGINT)

    def finish(self, grace_s: float) -> tuple[bytes | None, int]:
        """Waits for it to end (reading its stdout if piped) and returns that and its exit
        status. Interrupted or terminated meanwhile, stops it (`stop`, grace_s for its own
        teardown) before the exception goes on: killed outright, what it started (a guest,
        a daemon) would be left running."""
        try:
            stdout, _ = self.popen.communicate()
        except BaseException:
            self.stop(grace_s)
            raise
        return stdout, self.popen.returncode

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, wait up to grace_s, then SIGKILL it; returns the exit status."""
        self._signal_group(signal.SIGTERM)
        try:
            code = self.popen.wait(grace_s)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            code = self.popen.wait()
        # The leader is gone; anything else left in its group goes too, and
        # is waited for: a process killed with thousands of KVM VMs takes
        # seconds to exit, and until it has, its sockets (a next run's
        # addresses) are still bound.
        self._signal_group(signal.SIGKILL)
        wait_until(lambda: not group_members(self.pid), GROUP_EXIT_TIMEOUT_S)
        return code

    def _signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)


GROUP_EXIT_TIMEOUT_S = 60.0


def group_members(pgid: int) -> list[int]:
    """Processes of process group `pgid` that still run a thread. A zombie
    counts only while another of its threads lives (stuck in the kernel, say):
    until then it holds the process's descriptors."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state, pgrp = _state_and_group(entry / "stat")
            if pgrp == pgid and (
                state != "Z"
                or any(_state_and_group(t / "stat")[0] != "Z" for t in (entry / "task").iterdir())
            ):
                members.append(int(entry.name))
        except OSError:
            continue  # gone meanwhile
    return members


def _state_and_group(stat: Path) -> tuple[str, int]:
    text = stat.read_text()
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    state, _ppid, pgrp = text[text.rindex(")") + 2 :].split()[:3]
    return state, int(pgrp)


def wait_until(predicate, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll predicate until true or timeout; returns its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
