"""The progress bar of the training job."""

from __future__ import annotations

from typing import Any

__all__ = ["Progress"]


class Progress:
    """A rich progress bar with loss, step time and skipped steps (no-op when disabled)."""

    def __init__(self, total: int, start: int, label: str, enabled: bool) -> None:
        self.enabled = enabled
        if not enabled:
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[ms]} ms/step"),
            TextColumn("skipped {task.fields[skipped]}"),
            TimeRemainingColumn(),
        )
        self.task = self.progress.add_task(
            label, total=total, completed=start, loss="-", ms="-", skipped=0
        )

    def __enter__(self) -> Progress:
        if self.enabled:
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.progress.stop()

    def update(self, step: int, rec: dict[str, Any], skipped: int) -> None:
        if self.enabled:
            self.progress.update(
                self.task,
                completed=step,
                loss=f"{rec['loss']:.4f}",
                ms=f"{1e3 * rec['step_time']:.0f}",
                skipped=skipped,
            )
