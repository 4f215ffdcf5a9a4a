"""Warm-up until steady state: throughput and read/write mix agree over windows, after a
checkpoint.

The warm-up is cut into windows of at least ``window_s`` seconds and
``min_completed`` completed interactions (a slow mix, such as TPC-W browsing
under emulation at about one interaction a second, some of them 25 s long,
gets longer windows). Each window records the interactions completed in it
(user-level throughput) and, from the trace, the sectors read and written (the
mix). The workload is *steady* when

- the last ``windows`` windows all began after a checkpoint had completed,
- each of their throughputs is within ``throughput_tolerance`` (relative) of
  their mean, or within twice the counting noise of a window's completions
  (2 / sqrt(mean completions per window)) when that is larger, and
- each of their read shares by sectors is within ``read_share_tolerance``
  (absolute) of their mean.

The guest image checkpoints every 30 minutes (guest-images/dbguest/README.md),
so no timed checkpoint falls inside a capped warm-up: once the windows first
agree, the controller requests one (``CHECKPOINT``) and the windows after it
must agree again. The warm-up ends when steady, or at ``cap_s`` with the verdict
"not reached". A fixed warm-up (``--warmup S``) is cut into the same windows and
assessed the same way, but requests no checkpoint and never ends early.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_WINDOW_S = 15.0
DEFAULT_WINDOWS = 3
DEFAULT_THROUGHPUT_TOLERANCE = 0.15
DEFAULT_READ_SHARE_TOLERANCE = 0.05
DEFAULT_MIN_COMPLETED = 40
DEFAULT_CAP_S = 600.0


@dataclass(frozen=True)
class SteadyCriteria:
    """When a warm-up counts as steady (the module doc string says how they combine)."""

    window_s: float = DEFAULT_WINDOW_S
    min_completed: int = DEFAULT_MIN_COMPLETED  # interactions per window, at least
    windows: int = DEFAULT_WINDOWS
    throughput_tolerance: float = DEFAULT_THROUGHPUT_TOLERANCE  # relative to the windows' mean
    read_share_tolerance: float = DEFAULT_READ_SHARE_TOLERANCE  # absolute, read share by sectors
    cap_s: float = DEFAULT_CAP_S

    def validate(self) -> None:
        """Raise ValueError with a one-line message for impossible criteria."""
        if self.window_s <= 0:
            raise ValueError(f"the steady-state window must be positive, not {self.window_s}")
        if self.windows < 2:
            raise ValueError(f"steady state needs at least 2 windows, not {self.windows}")
        if self.min_completed < 1:
            raise ValueError(
                f"a steady-state window needs at least 1 interaction, not {self.min_completed}"
            )
        if self.cap_s <= 0:
            raise ValueError(f"--warmup-cap must be positive, not {self.cap_s}")


@dataclass(frozen=True)
class Window:
    """One warm-up window (times in seconds since the warm-up began)."""

    start_s: float
    end_s: float
    completed: int
    per_second: float
    sectors_read: int | None  # None: not traced
    sectors_written: int | None
    after_checkpoint: bool

    @property
    def read_share(self) -> float | None:
        if self.sectors_read is None or self.sectors_written is None:
            return None
        moved = self.sectors_read + self.sectors_written
        return self.sectors_read / moved if moved else 0.0


@dataclass
class SteadyState:
    """The warm-up's verdict and its evidence (part of the result JSON)."""

    mode: str  # "detect": until steady or the cap; "fixed": --warmup S; "none": --warmup 0
    reached: bool
    warmup_s: float  # how long the warm-up actually ran
    steady_after_s: float | None  # when the criteria first held in full
    checkpoints: int  # checkpoints completed during the warm-up (PostgreSQL's counters)
    checkpoint_requested: bool
    evidence: str  # one line: why steady, or why not
    criteria: SteadyCriteria = field(default_factory=SteadyCriteria)
    windows: list[Window] = field(default_factory=list)

    @classmethod
    def no_warmup(cls) -> SteadyState:
        """The verdict of ``--warmup 0``: measured from a cold start."""
        return cls("none", False, 0.0, None, 0, False, "no warm-up (--warmup 0)")


def _spread(values: list[float]) -> float:
    """Largest distance of a value from the values' mean."""
    mean = sum(values) / len(values)
    return max(abs(v - mean) for v in values)


def throughput_tolerance(windows: list[Window], criteria: SteadyCriteria) -> float:
    """The configured tolerance, or twice the relative counting noise of the windows'
    completions when that is larger."""
    mean_completed = sum(w.completed for w in windows) / len(windows)
    noise = 2.0 / mean_completed**0.5 if mean_completed > 0 else 1.0
    return max(criteria.throughput_tolerance, noise)


def assess(windows: list[Window], criteria: SteadyCriteria, checkpoint_done: bool) -> str | None:
    """None when the last windows meet the criteria, else the first reason they do not.

    ``checkpoint_done=False`` skips the after-checkpoint condition (used to decide
    when to request the checkpoint).
    """
    n = criteria.windows
    if len(windows) < n:
        return f"{len(windows)} of {n} windows"
    last = windows[-n:]
    if checkpoint_done and not all(w.after_checkpoint for w in last):
        done = sum(1 for w in last if w.after_checkpoint)
        return f"{done} of {n} windows after a checkpoint"
    rates = [w.per_second for w in last]
    mean_rate = sum(rates) / n
    if mean_rate <= 0:
        return "no interactions completed"
    tp = _spread(rates) / mean_rate
    tolerance = throughput_tolerance(last, criteria)
    if tp > tolerance:
        return (
            f"throughput varies {tp * 100:.0f}% > {tolerance * 100:.0f}% "
            f"({', '.join(f'{r:.2f}' for r in rates)}/s)"
        )
    shares = [w.read_share for w in last]
    if all(s is not None for s in shares):
        mix = _spread([s for s in shares if s is not None])
        if mix > criteria.read_share_tolerance:
            return (
                f"read share varies {mix:.3f} > {criteria.read_share_tolerance:.3f} "
                f"({', '.join(f'{s:.2f}' for s in shares if s is not None)})"
            )
    return None


def evidence(windows: list[Window], criteria: SteadyCriteria, checkpoints: int) -> str:
    """The evidence line of a steady verdict: the windows' throughputs, shares and checkpoints."""
    last = windows[-criteria.windows :]
    rates = ", ".join(f"{w.per_second:.2f}" for w in last)
    shares = [w.read_share for w in last]
    mix = (
        "read share " + ", ".join(f"{s:.2f}" for s in shares if s is not None)
        if all(s is not None for s in shares)
        else "mix not traced"
    )
    span = sum(w.end_s - w.start_s for w in last)
    return (
        f"last {len(last)} windows ({span:.0f} s): {rates}/s "
        f"(within {throughput_tolerance(last, criteria) * 100:.0f}%), {mix} "
        f"(within {criteria.read_share_tolerance:.2f}); {checkpoints} checkpoint(s) completed "
        "before them"
    )


class SteadyDetector:
    """Cuts a running warm-up into windows and decides when it is steady.

    ``on_window(window, reason)`` is told of each window as it closes, with the reason the
    windows so far are not steady (None: they agree). Call ``poll(completed)`` about once a
    second with the running total of interactions completed; it returns True once the warm-up
    may end (steady in ``detect`` mode). ``finish()`` gives the verdict.
    """

    def __init__(
        self,
        criteria: SteadyCriteria,
        mode: str,
        clock: Callable[[], float],
        sectors: Callable[[float, float], tuple[int, int] | None],
        checkpoints: Callable[[], int],
        request_checkpoint: Callable[[], None],
        on_window: Callable[[Window, str | None], None] | None = None,
    ) -> None:
        self.criteria = criteria
        self.mode = mode
        self._clock = clock
        self._sectors = sectors
        self._checkpoints = checkpoints
        self._request = request_checkpoint
        self._on_window = on_window
        self.began = clock()
        self._window_start = self.began
        self._completed_at_start = 0
        self._checkpoints_at_start = checkpoints()
        self._checkpoint_seen_at: float | None = None  # warm-up seconds, at a window boundary
        self._requested = False
        self._request_error: str | None = None
        self.windows: list[Window] = []
        self.steady_after_s: float | None = None

    def _completed_checkpoints(self) -> int:
        return self._checkpoints() - self._checkpoints_at_start

    def poll(self, completed: int) -> bool:
        now = self._clock()
        if (
            now - self._window_start < self.criteria.window_s
            or completed - self._completed_at_start < self.criteria.min_completed
        ):
            return False
        checkpoint_done = self._checkpoint_seen_at is not None
        traced = self._sectors(self._window_start, now)
        self.windows.append(
            Window(
                start_s=round(self._window_start - self.began, 3),
                end_s=round(now - self.began, 3),
                completed=completed - self._completed_at_start,
                per_second=(completed - self._completed_at_start) / (now - self._window_start),
                sectors_read=traced[0] if traced else None,
                sectors_written=traced[1] if traced else None,
                after_checkpoint=checkpoint_done,
            )
        )
        self._window_start, self._completed_at_start = now, completed
        if not checkpoint_done and self._completed_checkpoints() > 0:
            # Windows from this boundary on began after a completed checkpoint.
            self._checkpoint_seen_at = now - self.began
        if self._on_window is not None:
            self._on_window(self.windows[-1], assess(self.windows, self.criteria, checkpoint_done))
        if self.mode != "detect":
            return False
        if self._checkpoint_seen_at is None:
            if not self._requested and assess(self.windows, self.criteria, False) is None:
                # Synchronous: the clients go on meanwhile; the window open now is longer.
                self._requested = True
                try:
                    self._request()
                except Exception as err:  # noqa: BLE001 - reported in the verdict
                    self._request_error = str(err)
            return False
        if assess(self.windows, self.criteria, True) is None:
            self.steady_after_s = now - self.began
            return True
        return False

    def finish(self) -> SteadyState:
        """The verdict for the warm-up that just ended."""
        elapsed = self._clock() - self.began
        checkpoints = self._completed_checkpoints()
        if self._checkpoint_seen_at is None:
            agree = assess(self.windows, self.criteria, False)
            missing = (
                "no checkpoint completed"
                if checkpoints == 0
                else "no window began after a checkpoint"
            )
            reason: str | None = missing if agree is None else f"{agree}; {missing}"
        else:
            reason = assess(self.windows, self.criteria, True)
        if reason is None and self.steady_after_s is None:  # a fixed warm-up that got there
            self.steady_after_s = self.windows[-1].end_s
        if reason is not None and self._request_error:
            reason += f"; the checkpoint request failed: {self._request_error}"
        return SteadyState(
            mode=self.mode,
            reached=reason is None,
            warmup_s=round(elapsed, 1),
            steady_after_s=round(self.steady_after_s, 1) if reason is None else None,
            checkpoints=checkpoints,
            checkpoint_requested=self._requested,
            evidence=evidence(self.windows, self.criteria, checkpoints)
            if reason is None
            else reason,
            criteria=self.criteria,
            windows=list(self.windows),
        )
