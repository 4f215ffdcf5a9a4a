"""The nightly history store: every `scalebench nightly` run appended to an SQLite file.

Default file: $XDG_DATA_HOME/scalebench/nightly-history.sqlite (~/.local/share/... when unset):
a history must outlive worktrees and checkouts, and must never be committed with one.

Tables: `runs` (one row per nightly run: when, which build, quick or full, the host's noise
indicators as JSON, the verdict) and `samples` (every trial value of every metric, in trial
order). Medians and confidence intervals are recomputed from the samples when read.
"""

from __future__ import annotations

import json
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    started_at TEXT NOT NULL,
    finished_at TEXT NOT NULL,
    mode TEXT NOT NULL,
    build TEXT NOT NULL,
    host TEXT NOT NULL,
    verdict TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS samples (
    run_id INTEGER NOT NULL REFERENCES runs(id),
    metric TEXT NOT NULL,
    seq INTEGER NOT NULL,
    value REAL NOT NULL,
    PRIMARY KEY (run_id, metric, seq)
);
"""

NOISY = "noisy"  # the verdict of a run whose suspects the host explained, or of a busy host


def default_path() -> Path:
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "scalebench" / "nightly-history.sqlite"


@dataclass
class Run:
    started_at: str
    finished_at: str
    mode: str  # "quick" or "full"
    build: str  # git revision (+dirty) and injected slowdowns, if any
    host: dict
    verdict: str  # clean, regression, noisy or baseline (history too short to judge)
    samples: dict[str, list[float]] = field(default_factory=dict)
    id: int | None = None


class History:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(path)
            self.db.executescript(SCHEMA)
        except sqlite3.DatabaseError as e:
            raise ValueError(f"{path} is not a nightly history (SQLite): {e}") from None
        self.path = path
        self.loaded: list[Run] | None = None  # read once: judging asks per metric, twice a run

    def close(self) -> None:
        self.db.close()

    def append(self, run: Run) -> int:
        with self.db:
            cur = self.db.execute(
                "INSERT INTO runs (started_at, finished_at, mode, build, host, verdict)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (
                    run.started_at,
                    run.finished_at,
                    run.mode,
                    run.build,
                    json.dumps(run.host),
                    run.verdict,
                ),
            )
            run_id = int(cur.lastrowid or 0)
            self.db.executemany(
                "INSERT INTO samples (run_id, metric, seq, value) VALUES (?, ?, ?, ?)",
                [
                    (run_id, metric, i, float(v))
                    for metric, values in run.samples.items()
                    for i, v in enumerate(values)
                ],
            )
        run.id = run_id
        if self.loaded is not None:
            self.loaded.append(run)
        return run_id

    def runs(self) -> list[Run]:
        """Every run, oldest first, with its samples."""
        if self.loaded is None:
            self.loaded = self.read()
        return list(self.loaded)

    def read(self) -> list[Run]:
        """Every run in the file, oldest first, with its samples."""
        runs = {
            row[0]: Run(row[1], row[2], row[3], row[4], json.loads(row[5]), row[6], {}, row[0])
            for row in self.db.execute(
                "SELECT id, started_at, finished_at, mode, build, host, verdict FROM runs"
                " ORDER BY id"
            )
        }
        for run_id, metric, value in self.db.execute(
            "SELECT run_id, metric, value FROM samples ORDER BY run_id, metric, seq"
        ):
            runs[run_id].samples.setdefault(metric, []).append(value)
        return list(runs.values())

    def series(self, metric: str) -> list[list[float]]:
        """The trial values of `metric` in every counted run, oldest first."""
        return [r.samples[metric] for r in self.counted(metric)]

    def previous_noisy(self, metric: str) -> bool:
        """Whether the newest counted run with `metric` was judged too noisy: a step at its start
        was not reported then, so the next run judges it."""
        runs = self.counted(metric)
        return bool(runs) and runs[-1].verdict == NOISY

    def counted(self, metric: str) -> list[Run]:
        """The runs whose samples are history and hold `metric`, oldest first."""
        return [r for r in self.runs() if counts(r) and metric in r.samples]


def counts(run: Run) -> bool:
    """Whether a run's samples are history. A busy host's are not: they measure other tenants.
    A run whose suspects the host references explained counts: its values are the host's level
    that night, and a host that stays there must become the history, or every later run is
    judged against a host that no longer exists and reported too noisy for good."""
    return not run.host.get("busy")
