"""Demonstrations (a curated split's ``sft.parquet``) as SFT reads them: an Arrow table of ``DEMO_COLUMNS`` on every
rank, never a Python dict per demo (10^6 demos cost their strings' bytes, not ~1 KB of objects each). The sft and
distill stages read them with :func:`read_demos`; ``training.sft_train`` and ``sft_data.tokenize`` take the
table (or, for tests and small callers, a list of dicts, converted by :func:`as_table`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from posttrain.errors import StageError
from posttrain.schema import parquet_file, read_columns

DEMO_COLUMNS = ("id", "prompt", "answer", "solution", "task")  # what SFT reads of a demo (a curated problem)
Demos = pa.Table | Sequence[dict[str, Any]]


def as_table(demos: Demos) -> pa.Table:
    """The demos as an Arrow table of ``DEMO_COLUMNS``, strings (a column they lack: null): what the sft and
    distill stages read from ``sft.parquet`` (``schema.read_columns``: no Python object per demo on any rank,
    10^6 demos are their strings' bytes); a list of dicts (tests, small callers) is converted. ``id`` and
    ``solution`` may be missing (null); a prompt, an answer or a task may not."""
    t = demos if isinstance(demos, pa.Table) else pa.Table.from_pylist(
        [{c: x.get(c) for c in DEMO_COLUMNS if c in x} for x in demos])
    lacking = [c for c in ("prompt", "answer", "task") if c not in t.column_names]
    if lacking and t.num_rows:
        raise ValueError(f"demos without {lacking}: every demo needs a prompt, an answer and a task")
    return pa.table({c: t.column(c).cast(pa.string()) if c in t.column_names else pa.nulls(t.num_rows, pa.string())
                     for c in DEMO_COLUMNS})


def read_demos(path: str | Path) -> pa.Table:
    """The demonstrations of a curated split (``sft.parquet``) as Arrow (:func:`as_table`); a file without demos
    or without a column SFT reads is a :class:`StageError` naming it."""
    names = parquet_file(path).schema_arrow.names
    t = read_columns(path, [c for c in DEMO_COLUMNS if c != "solution" or c in names])
    if not t.num_rows:
        raise StageError(f"{path}: no demonstrations")
    return as_table(t)
