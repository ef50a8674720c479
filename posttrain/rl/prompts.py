"""The prompt pool of the rl and distill loops as an Arrow table, not a list of dicts.

At 10^6 prompts a list of Python dicts is about a GB of objects on every rank, and tokenizing every prompt up
front takes minutes before the first step. ``PromptPool`` reads only the columns a loop uses (``COLUMNS``: about
the file's bytes of them, no solutions) and a selection is a view on it (row positions, no copy); a row becomes a
dict only when a step draws it (``pool[i]``); ids are found by a binary search of one sorted copy of the id column
(``IdIndex``); ``PromptTokens`` tokenizes a prompt when an update first asks for it (an LRU of recent ones), never
the whole pool. The selections (``select.PROMPT_SELECTIONS``) work on the table with Arrow compute, the pass
rates are read as columns (``read_rates``), and the selected prompts are written by filtering the split's file a
batch at a time (``write_selected``).

Written here rather than with ``datasets``: a ``Dataset`` would do the storage, but the loops need a positional
row, an id search and a digest of the id set for the resume fingerprint, each a few lines over the table.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from posttrain.outputs import atomic_path
from posttrain.rollout import chat_prompt_ids
from posttrain.schema import PROBLEM_SCHEMA, parquet_file, read_columns

COLUMNS = ("id", "task", "prompt", "answer")  # what a loop reads of a problem (rollout rows, rewards)
SCHEMA = pa.schema([PROBLEM_SCHEMA.field(c) for c in COLUMNS])
RATE_COLUMNS = ("prompt_id", "pass_rate", "mean_reward", "scorable")


class IdIndex:
    """Ids -> their position, by a binary search of one sorted copy of the ids (an Arrow string array: the
    ids' bytes plus 8 a row, where a dict of a million Python strings would be ~100 MB)."""

    def __init__(self, ids: pa.Array) -> None:
        self.order = pc.sort_indices(ids).to_numpy()
        self.sorted = ids.take(pa.array(self.order))

    def find(self, key: str) -> int:
        """The position of ``key`` (-1: absent)."""
        lo, hi = 0, len(self.sorted)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.sorted[mid].as_py() < key:
                lo = mid + 1
            else:
                hi = mid
        return int(self.order[lo]) if lo < len(self.sorted) and self.sorted[lo].as_py() == key else -1

    def digest(self) -> str:
        """sha256 of the sorted ids, one a line: which ids these are, in any order."""
        h = hashlib.sha256()
        for k in range(0, len(self.sorted), 65536):
            h.update(("\n".join(self.sorted.slice(k, 65536).to_pylist()) + "\n").encode())
        return h.hexdigest()


class PromptPool(Sequence[dict[str, Any]]):
    """Problems by position: ``pool[i]`` is row ``i`` as a dict of ``COLUMNS``. ``table``: the split's columns;
    ``rows``: the positions of this pool in it (None: every row; a selection is ``subset``, not a copy)."""

    def __init__(self, table: pa.Table, rows: np.ndarray | None = None, source: str | Path | None = None) -> None:
        self.table, self.rows, self.source = table, rows, source

    @classmethod
    def read(cls, path: str | Path) -> PromptPool:
        """A curated split's problems; a missing or unreadable file is a StageError (one line), a file without
        the problem columns a ValueError naming them."""
        f = parquet_file(path)
        missing = set(PROBLEM_SCHEMA.names) - set(f.schema_arrow.names)
        if missing:
            raise ValueError(f"{path}: not a problems file (missing columns {sorted(missing)})")
        return cls(f.read(columns=list(COLUMNS)).cast(SCHEMA), source=path)

    @classmethod
    def of(cls, rows: Sequence[dict[str, Any]]) -> PromptPool:
        return cls(pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in rows], schema=SCHEMA))

    def subset(self, rows: np.ndarray) -> PromptPool:
        """The pool of this pool's rows ``rows`` (positions in this pool), in that order."""
        rows = np.asarray(rows, dtype=np.int64)
        return PromptPool(self.table, rows if self.rows is None else self.rows[rows], self.source)

    def __len__(self) -> int:
        return self.table.num_rows if self.rows is None else len(self.rows)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        i %= len(self)
        return self.table.slice(i if self.rows is None else int(self.rows[i]), 1).to_pylist()[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for k in range(0, len(self), 4096):
            part = self.table.slice(k, 4096) if self.rows is None else self.table.take(self.rows[k : k + 4096])
            yield from part.to_pylist()

    @functools.cached_property
    def ids(self) -> pa.Array:
        ids = self.table.column("id").combine_chunks()
        return ids if self.rows is None else ids.take(pa.array(self.rows))

    @functools.cached_property
    def index(self) -> IdIndex:
        return IdIndex(self.ids)

    def digest(self) -> str:
        """Which prompts the pool holds (the resume fingerprint's part): ``IdIndex.digest``."""
        return self.index.digest()

    def write_selected(self, dst: str | Path, batch_rows: int = 65536) -> None:
        """This pool's problems, every column of the split file it was read from, in the file's order (a
        selection keeps it), replaced whole: the file filtered and written a batch (a row group) at a time."""
        if self.source is None:
            raise ValueError("write_selected: this pool was built in memory (PromptPool.of), not read from a split")
        wanted = self.ids
        with atomic_path(dst) as tmp, pq.ParquetWriter(tmp, PROBLEM_SCHEMA) as w:
            for b in pq.ParquetFile(self.source).iter_batches(batch_size=batch_rows, columns=PROBLEM_SCHEMA.names):
                w.write_table(pa.Table.from_batches([b.filter(pc.is_in(b.column("id"), value_set=wanted))])
                              .cast(PROBLEM_SCHEMA))


class PromptTokens(Mapping[str, list[int]]):
    """Prompt id -> its chat-formatted token ids (``rollout.chat_prompt_ids``), tokenized when first asked for;
    the ``cache`` most recent are kept (a step asks for each of its prompts once per sample)."""

    def __init__(self, pool: PromptPool, tokenizer: Any, cache: int = 4096) -> None:
        self.pool = pool

        @functools.lru_cache(maxsize=cache)
        def tokens(pid: str) -> tuple[int, ...]:
            i = pool.index.find(pid)
            if i < 0:
                raise KeyError(pid)
            return tuple(chat_prompt_ids(tokenizer, [pool[i]["prompt"]])[0])

        self._tokens = tokens

    def __getitem__(self, pid: str) -> list[int]:
        return list(self._tokens(pid))

    def __iter__(self) -> Iterator[str]:
        return iter(self.pool.ids.to_pylist())

    def __len__(self) -> int:
        return len(self.pool)


def read_rates(path: str | Path, pool: PromptPool | None = None) -> pa.Table:
    """The reward stage's pass rates (its ``RATE_COLUMNS`` only), of ``pool`` 's prompts when given; a prompt
    with two rows is a ValueError (the reward stage writes one a prompt: which one to trust is not guessed)."""
    names = parquet_file(path).schema_arrow.names
    rates = read_columns(path, ["prompt_id", *(c for c in RATE_COLUMNS[1:] if c in names)])
    if pc.count_distinct(rates.column("prompt_id")).as_py() != rates.num_rows:
        raise ValueError(f"{path}: a prompt_id appears in more than one row")
    return rates if pool is None else rates.filter(pc.is_in(rates.column("prompt_id"), value_set=pool.ids))
