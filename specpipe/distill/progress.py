"""Progress display for distillation: a rich bar per phase with loss, agreement and tokens/s.

The library reports through the small `DistillProgress` interface; `RichDistillProgress` draws it on
the terminal, `SilentProgress` drops it (tests, scripts).
"""

from __future__ import annotations

from typing import Optional


class DistillProgress:
    """What distill() reports. Phases: "teacher" (answers being generated) and "train"."""

    def phase(self, name: str, total: float, description: str) -> None: ...

    def update(self, completed: float, **fields: float) -> None: ...

    def log(self, message: str) -> None: ...

    def close(self) -> None: ...


class SilentProgress(DistillProgress):
    pass


class RichDistillProgress(DistillProgress):
    def __init__(self, console=None):
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

        self.console = console or Console(stderr=True)
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            TimeElapsedColumn(),
            TextColumn("/"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[stats]}"),
            console=self.console,
            transient=False,
        )
        self.progress.start()
        self.task: Optional[int] = None

    def phase(self, name: str, total: float, description: str) -> None:
        self.task = self.progress.add_task(description, total=total, stats="")

    def update(self, completed: float, **fields: float) -> None:
        if self.task is None:
            return
        stats = "  ".join(_format(name, value) for name, value in fields.items())
        self.progress.update(self.task, completed=completed, stats=stats)

    def log(self, message: str) -> None:
        self.progress.console.log(message)

    def close(self) -> None:
        self.progress.stop()


def _format(name: str, value: float) -> str:
    if name in ("tok_s", "tokens"):
        return f"{name.replace('_', '/')} {value:,.0f}"
    return f"{name} {value:.3f}"
