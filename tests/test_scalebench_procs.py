"""Signal handling of scalebench's own process (procs.py)."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from scalebench.procs import (
    Child,
    Terminated,
    group_members,
    install_signal_handlers,
    stop_signals_deferred,
    wait_until,
)


@pytest.fixture
def scalebench_handlers():
    """scalebench's handlers in this process for one test, pytest's again after it."""
    previous = {
        sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    }
    install_signal_handlers()
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_sigterm_while_a_result_is_written_is_raised_after_it(scalebench_handlers):
    written = False
    with pytest.raises(Terminated, match="SIGTERM"), stop_signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGHUP)
        written = True
    assert written, "the signal cut the block short"
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL


def test_without_a_signal_the_block_ends_normally(scalebench_handlers):
    with stop_signals_deferred():
        pass
    with pytest.raises(Terminated):
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0.1)  # a point where Python runs the pending handler


def test_stop_returns_once_nothing_of_the_group_runs():
    # A helper that ignores SIGTERM and outlives its leader, as a densevm cell
    # does while its parent tears down.
    child = Child(
        ["sh", "-c", "(trap '' TERM; sleep 60) & trap '' TERM; sleep 60"],
        subprocess.DEVNULL,
        subprocess.DEVNULL,
    )
    assert wait_until(lambda: len(group_members(child.pid)) == 3, 10.0)
    child.stop(grace_s=0.5)
    assert group_members(child.pid) == []
