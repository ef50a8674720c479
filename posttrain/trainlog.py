"""A training loop's per-step log, written as it goes: what a user watches during a multi-hour run, and what a
crashed run keeps.

``TrainLog.append(row)`` appends the row to the CSV at once (``dvc plots`` reads it; flushed, so a killed
process leaves every row it logged) and hands it to the listeners: ``posttrain.tracking`` registers one per
stage run that logs the row's numbers to the stage's MLflow run, live. ``resume(rows)`` starts a resumed run
from its checkpoint's rows (the CSV is rewritten with them and the listeners get them again, so the new
MLflow run has the whole curve). ``close()`` writes the finished CSV whole (atomically), byte for byte what
the appends wrote. A log with no path (other ranks, a loop whose rows only go to MLflow) keeps the rows only.

Kept apart from ``posttrain.tracking`` on purpose: stages import this module (it shapes an output, the CSV),
while MLflow tracking never changes an output and is not a dependency of any stage.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from posttrain.schema import write_csv

# fn(log name, row): called for every row appended (and every row a resume restores), in order
LISTENERS: list[Callable[[str, dict[str, Any]], None]] = []


class TrainLog:
    """Rows of one training loop (``fields``: the CSV's columns). ``name`` tells the listeners which loop it is
    ("" for the stage's own log; e.g. "student_sft" for distill's cold start)."""

    def __init__(self, path: Path | None, fields: Sequence[str], name: str = "") -> None:
        self.path, self.fields, self.name = path, list(fields), name
        self.rows: list[dict[str, Any]] = []
        if path is not None:
            write_csv(path, [], self.fields, now=True)  # the header: a watcher sees the file from the first step

    def resume(self, rows: list[dict[str, Any]]) -> None:
        """Start from a checkpoint's rows."""
        self.rows = list(rows)
        if self.path is not None:
            write_csv(self.path, self.rows, self.fields, now=True)
        for row in self.rows:
            self._notify(row)

    def append(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        if self.path is not None:
            with self.path.open("a", newline="") as f:
                csv.DictWriter(f, fieldnames=self.fields).writerow(row)
        self._notify(row)

    def close(self) -> None:
        """The finished log, written whole."""
        if self.path is not None:
            write_csv(self.path, self.rows, self.fields)

    def _notify(self, row: dict[str, Any]) -> None:
        for fn in LISTENERS:
            fn(self.name, row)
