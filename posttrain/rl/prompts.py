"""The prompt pool of the rl and distill loops as an Arrow table, not a list of dicts.

At 10^6 prompts a list of Python dicts is about a GB of objects on every rank, and tokenizing every prompt up
front takes minutes before the first step. ``PromptPool`` keeps the train split's columns in Arrow buffers (about
the file's bytes); a row becomes a dict only when a step draws it (``pool[i]``); the ids are searchable through
one sorted array (``index``, a binary search); ``PromptTokens`` tokenizes a prompt when an update first asks for
it (an LRU of recent ones), never the whole pool. The selections (``select.PROMPT_SELECTIONS``) filter the table
with Arrow compute, and the pass rates are read as columns (``read_rates``).

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

from posttrain.schema import PROBLEM_SCHEMA

RATE_COLUMNS = ("prompt_id", "pass_rate", "mean_reward", "scorable")


class PromptPool(Sequence[dict[str, Any]]):
    """Problems (``schema.PROBLEM_SCHEMA`` columns) by position: ``pool[i]`` is row ``i`` as a dict."""

    def __init__(self, table: pa.Table) -> None:
        self.table = table.select(PROBLEM_SCHEMA.names).cast(PROBLEM_SCHEMA).combine_chunks()

    @classmethod
    def read(cls, path: str | Path) -> PromptPool:
        """A curated split's problems; a file without the problem columns is a ValueError naming them."""
        missing = set(PROBLEM_SCHEMA.names) - set(pq.read_schema(path).names)
        if missing:
            raise ValueError(f"{path}: not a problems file (missing columns {sorted(missing)})")
        return cls(pq.read_table(path, columns=PROBLEM_SCHEMA.names))

    @classmethod
    def of(cls, rows: Sequence[dict[str, Any]]) -> PromptPool:
        return cls(pa.Table.from_pylist(list(rows), schema=PROBLEM_SCHEMA))

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.table.slice(i % len(self), 1).to_pylist()[0]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.table.to_batches(max_chunksize=4096):
            yield from batch.to_pylist()

    @property
    def ids(self) -> pa.Array:
        return self.table.column("id").combine_chunks()

    @functools.cached_property
    def _sorted(self) -> tuple[np.ndarray, np.ndarray]:
        order = pc.sort_indices(self.ids).to_numpy()
        return self.ids.take(order).to_numpy(zero_copy_only=False).astype(str), order

    def index(self, pid: str) -> int:
        """The row of prompt ``pid`` (a KeyError if none): a binary search of the sorted ids."""
        keys, order = self._sorted
        k = int(np.searchsorted(keys, pid))
        if k == len(keys) or keys[k] != pid:
            raise KeyError(pid)
        return int(order[k])

    def digest(self) -> str:
        """sha256 of the sorted ids, one a line: which prompts the pool holds (the resume fingerprint's part)."""
        h = hashlib.sha256()
        for part in np.array_split(self._sorted[0], max(1, len(self) // 65536)):
            h.update(("\n".join(part.tolist()) + "\n").encode())
        return h.hexdigest()


class PromptTokens(Mapping[str, list[int]]):
    """Prompt id -> its chat-formatted token ids (``rollout.chat_prompt_ids``), tokenized when first asked for;
    the ``cache`` most recent are kept (a step asks for each of its prompts once per sample)."""

    def __init__(self, pool: PromptPool, tokenizer: Any, cache: int = 4096) -> None:
        from posttrain.rollout import chat_prompt_ids

        self.pool = pool

        @functools.lru_cache(maxsize=cache)
        def tokens(pid: str) -> tuple[int, ...]:
            text = pool.table.column("prompt")[pool.index(pid)].as_py()
            return tuple(chat_prompt_ids(tokenizer, [text])[0])

        self._tokens = tokens

    def __getitem__(self, pid: str) -> list[int]:
        return list(self._tokens(pid))

    def __iter__(self) -> Iterator[str]:
        return iter(self.pool.ids.to_pylist())

    def __len__(self) -> int:
        return len(self.pool)


def read_rates(path: str | Path, pool: PromptPool | None = None) -> pa.Table:
    """The reward stage's pass rates (its ``RATE_COLUMNS`` only), of ``pool`` 's prompts when given."""
    names = pq.read_schema(path).names
    rates = pq.read_table(path, columns=[c for c in RATE_COLUMNS if c in names])
    return rates if pool is None else rates.filter(pc.is_in(rates.column("prompt_id"), value_set=pool.ids))
