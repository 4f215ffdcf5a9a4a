"""Database guests running next to a microVM run (``--db-guests K --db-workload NAME``).

    with db_guests(2, "tpcc", None, out_dir) as dbs:
        ...  # the microVM run
    for r in dbs.results: ...

On entry the image is made ready, libvirtd started if needed and K traced
guests booted; each then runs its workload in the background until the block
exits. On exit the workloads stop, every guest is destroyed, the libvirtd we
started is stopped, and ``results`` holds one dict per guest: guest, workload,
mix, throughput (per minute), per_second, throughput_label, metrics (the
study's block metrics), trace_csv, error (None when the guest ran to the end).
While the block runs, ``completed`` gives each guest's interactions so far. A
guest that fails mid-run is reported in its result; it does not abort the
microVM run.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from .daemon import Libvirt
from .errors import DbTraceError
from .guest import DbGuest, GuestConfig
from .image import ensure_image
from .run import READ_INTENSIVE, RunOptions, run_on_guest, validate


@dataclass
class DbGuests:
    """K traced database guests with background workloads (see the module doc string)."""

    count: int
    workload: str
    mix: str | None
    out_dir: Path
    clients: int = 4
    disk: str = "hdd15k"
    results: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mix = self.mix or READ_INTENSIVE.get(self.workload, "")
        if self.count < 1:
            raise ValueError(f"--db-guests must be at least 1, not {self.count}")
        validate(self.workload, self.mix, self.clients, 1.0, self.disk)
        self._stack = ExitStack()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._guests: list[DbGuest] = []
        self._completed: list[int] = []

    @property
    def completed(self) -> list[int]:
        """Each guest's interactions completed so far (updated about once a second)."""
        return list(self._completed)

    def __enter__(self) -> DbGuests:
        try:
            image = ensure_image()
            lv = self._stack.enter_context(Libvirt())
            self.out_dir.mkdir(parents=True, exist_ok=True)
            for index in range(self.count):
                guest_dir = self.out_dir / f"dbguest-{index}"
                config = GuestConfig(image=image, run_dir=guest_dir, disk=self.disk)
                self._guests.append(self._stack.enter_context(DbGuest(config, lv.conn)))
        except BaseException:
            self._stack.close()
            raise
        self.results = [{} for _ in self._guests]
        self._completed = [0 for _ in self._guests]
        for index, guest in enumerate(self._guests):
            thread = threading.Thread(
                target=self._drive, args=(index, guest), name=f"dbguest-{index}", daemon=True
            )
            self._threads.append(thread)
            thread.start()
        return self

    def _drive(self, index: int, guest: DbGuest) -> None:
        assert self.mix is not None
        # A background load for as long as the microVM run lasts: measured from its start, with
        # no warm-up (the result says steady state was not established).
        opts = RunOptions(
            workload=self.workload,
            mix=self.mix,
            clients=self.clients,
            duration_s=float("inf"),
            guest=guest.config,
            warmup_s=0.0,
            seed=index + 1,
        )
        record: dict[str, Any] = {
            "guest": guest.name,
            "workload": self.workload,
            "mix": self.mix,
            "error": None,
        }
        try:
            result = run_on_guest(
                guest, opts, stop=self._stop, on_progress=self._completed_setter(index)
            )
            record.update(
                throughput=result.throughput.per_minute,
                per_second=result.throughput.per_second,
                throughput_label=result.throughput.per_minute_label,
                metrics=result.metrics.as_dict() if result.metrics else None,
                trace_csv=result.trace_csv,
            )
        except (DbTraceError, OSError) as err:
            record.update(
                throughput=None, per_second=None, metrics=None, trace_csv=None, error=str(err)
            )
        self.results[index] = record

    def _completed_setter(self, index: int) -> Callable[[int], None]:
        def record(completed: int) -> None:
            self._completed[index] = completed

        return record

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
        self._stack.close()


def db_guests(count: int, workload: str, mix: str | None, out_dir: Path) -> DbGuests:
    """Context manager: K database guests with their workloads in the background."""
    return DbGuests(count=count, workload=workload, mix=mix, out_dir=out_dir)
