"""Steady-state detection: the criteria on windows, the detector's sequence (checkpoint requested
once the windows agree, steady only with windows after it), verdicts in the tables and JSON."""

from __future__ import annotations

import sys
from dataclasses import asdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "controller"))

from scalebench.db.report import compare_table, load_study, steady_line, steady_verdict
from scalebench.db.steady import SteadyCriteria, SteadyDetector, SteadyState, Window, assess

CRITERIA = SteadyCriteria(window_s=10.0, windows=3)


def window(rate: float, read: int, written: int, after: bool = True) -> Window:
    return Window(0.0, 10.0, int(rate * 10), rate, read, written, after)


def test_agreeing_windows_after_a_checkpoint_are_steady() -> None:
    windows = [window(5.0, 100, 100), window(5.3, 105, 95), window(4.8, 98, 102)]
    assert assess(windows, CRITERIA, True) is None


@pytest.mark.parametrize(
    "windows, reason",
    [
        ([window(5.0, 100, 100)] * 2, "2 of 3 windows"),
        (
            [window(5.0, 100, 100, after=False), window(5.0, 100, 100), window(5.0, 100, 100)],
            "2 of 3 windows after a checkpoint",
        ),
        (
            [window(2.0, 100, 100), window(5.0, 100, 100), window(5.0, 100, 100)],
            "throughput varies",
        ),
        (
            [window(5.0, 40, 60), window(5.0, 50, 50), window(5.0, 60, 40)],
            "read share varies",
        ),
        ([window(0.0, 1, 1)] * 3, "no interactions completed"),
    ],
)
def test_windows_that_disagree_say_why(windows: list[Window], reason: str) -> None:
    got = assess(windows, CRITERIA, True)
    assert got is not None and got.startswith(reason)


def test_throughput_tolerance_widens_to_the_counting_noise_of_small_windows() -> None:
    """40 interactions per window: 2/sqrt(40) = 32% of counting noise is no trend; 400 per
    window: the configured 15% applies."""
    slow = [Window(0.0, 40.0, n, n / 40.0, 100, 0, True) for n in (30, 40, 50)]
    assert assess(slow, CRITERIA, True) is None
    fast = [Window(0.0, 40.0, n, n / 40.0, 100, 0, True) for n in (300, 400, 500)]
    got = assess(fast, CRITERIA, True)
    assert got is not None and got.startswith("throughput varies 25% > 15%")


def test_a_window_lasts_until_it_holds_enough_interactions() -> None:
    clock = Clock()
    detector = SteadyDetector(CRITERIA, "fixed", clock, lambda s, e: (1, 1), lambda: 0, list)
    for second in range(1, 31):
        clock.t = float(second)
        detector.poll(second)  # one interaction a second: 40 needed, 10 s are not enough
    assert detector.windows == []
    clock.t = 40.0
    detector.poll(40)
    assert [(w.end_s, w.completed) for w in detector.windows] == [(40.0, 40)]


def test_untraced_windows_are_judged_on_throughput_alone() -> None:
    untraced = [Window(0.0, 10.0, 50, 5.0, None, None, True) for _ in range(3)]
    assert assess(untraced, CRITERIA, True) is None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_detector_requests_a_checkpoint_once_steady_then_needs_windows_after_it() -> None:
    """A workload at a constant rate and mix: the checkpoint request follows the first agreement,
    and steady state is declared only when three windows began after the checkpoint."""
    clock = Clock()
    completed_checkpoints = [0]
    requests: list[float] = []

    def request() -> None:
        requests.append(clock.t)
        completed_checkpoints[0] += 1

    detector = SteadyDetector(
        CRITERIA,
        "detect",
        clock,
        lambda start, end: (int((end - start) * 60), int((end - start) * 40)),
        lambda: completed_checkpoints[0],
        request,
    )
    steady_at = None
    for second in range(1, 121):
        clock.t = float(second)
        if detector.poll(second * 5):
            steady_at = second
            break
    verdict = detector.finish()
    assert requests == [30.0]  # after the third agreeing window
    # The checkpoint is seen at the 40 s boundary; windows 40-50, 50-60, 60-70 follow it.
    assert steady_at == 70
    assert verdict.reached and verdict.steady_after_s == 70.0
    assert verdict.checkpoints == 1 and verdict.checkpoint_requested
    assert "0.60" in verdict.evidence and "5.00" in verdict.evidence


def test_fixed_warmup_requests_no_checkpoint_and_is_not_steady_without_one() -> None:
    clock = Clock()
    requests: list[float] = []
    detector = SteadyDetector(
        CRITERIA, "fixed", clock, lambda s, e: (10, 10), lambda: 0, lambda: requests.append(0)
    )
    for second in range(1, 61):
        clock.t = float(second)
        assert not detector.poll(second * 5)
    verdict = detector.finish()
    assert not verdict.reached and requests == []
    assert "no checkpoint completed" in verdict.evidence
    assert len(verdict.windows) == 6


def test_too_short_warmup_is_marked_not_steady_in_line_table_and_json() -> None:
    clock = Clock()
    detector = SteadyDetector(CRITERIA, "fixed", clock, lambda s, e: (10, 10), lambda: 0, list)
    clock.t = 12.0
    detector.poll(60)
    verdict = detector.finish()
    doc = {
        "options": {"workload": "tpcc", "mix": "standard"},
        "steady": asdict(verdict),
        "metrics": {c: 0 for c in load_study()[0] if c not in ("benchmark", "intensity", "load")},
    }
    assert doc["steady"]["reached"] is False
    assert steady_line(doc).startswith("steady state: NOT reached in 12 s (fixed warm-up; 1 of 3")
    assert steady_verdict(doc) == "NO (fixed)"
    row = compare_table([doc], load_study()).splitlines()[1]
    assert row.split()[:5] == ["ours", "TPC-C", "standard", "NO", "(fixed)"]


def test_no_warmup_is_not_steady() -> None:
    doc = {"steady": asdict(SteadyState.no_warmup())}
    assert steady_line(doc) == "steady state: NOT reached (no warm-up (--warmup 0))"
    assert steady_verdict(doc) == "NO (none)"


@pytest.mark.parametrize(
    "criteria, message",
    [
        (SteadyCriteria(cap_s=0), "--warmup-cap must be positive"),
        (SteadyCriteria(windows=1), "at least 2 windows"),
        (SteadyCriteria(window_s=0), "window must be positive"),
        (SteadyCriteria(min_completed=0), "at least 1 interaction"),
    ],
)
def test_impossible_criteria_are_refused(criteria: SteadyCriteria, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        criteria.validate()
