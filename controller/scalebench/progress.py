"""Progress of long phases (boot, warm-up, measurement), on stderr with rich."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn


class Reporter:
    """Silent progress: what library callers and tests get by default."""

    @contextmanager
    def phase(self, name: str, total: float, unit: str) -> Iterator[Callable[[float], None]]:
        yield lambda completed: None

    def note(self, text: str) -> None:
        pass


class ConsoleReporter(Reporter):
    """One bar per phase on stderr; notes as plain lines above the bars."""

    def __init__(self) -> None:
        self.console = Console(stderr=True)

    @contextmanager
    def phase(self, name: str, total: float, unit: str) -> Iterator[Callable[[float], None]]:
        columns = (
            TextColumn(f"[bold]{name:<12}"),
            BarColumn(),
            TextColumn(f"{{task.completed:>7.0f}}/{{task.total:.0f}} {unit}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=self.console, transient=False) as bar:
            task = bar.add_task(name, total=total)
            yield lambda completed: bar.update(task, completed=min(completed, total))
            bar.update(task, completed=total)

    def note(self, text: str) -> None:
        self.console.print(text, highlight=False)
