"""Row types of the pipeline's data artifacts and their atomic Parquet / JSON I/O.

Every artifact is written to a temporary sibling, fsynced and renamed into place (``atomic_path``), so a
killed stage never leaves a half-written file that a later stage (or DVC) would take for a finished one,
and a machine crash right after a stage cannot leave a renamed-but-empty file.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.errors import StageError
from posttrain.outputs import atomic_path

log = logging.getLogger("posttrain.schema")


class Problem(TypedDict):
    """One curated problem. ``id`` is ``<source>:<row index in the source>`` (traceable to the raw line)."""

    id: str
    source: str
    task: str  # key of posttrain.tasks.TASKS: how to verify it
    prompt: str
    answer: str
    solution: str | None


PROBLEM_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("source", pa.string()),
        ("task", pa.string()),
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("solution", pa.string()),
    ]
)

# One generated completion, as the evaluate stage (and later rollout) records it.
GENERATION_SCHEMA = pa.schema(
    [
        ("model", pa.string()),
        ("split", pa.string()),
        ("id", pa.string()),
        ("mode", pa.string()),  # greedy | sample
        ("sample", pa.int32()),
        ("completion", pa.string()),
        ("num_tokens", pa.int32()),
        ("finish_reason", pa.string()),  # stop | length
        ("extracted", pa.string()),
        ("correct", pa.bool_()),  # null = unscorable
    ]
)


# One sampled completion (rollout stage, and every RL step's shard), then the columns later stages add.
ROLLOUT_SCHEMA = pa.schema(
    [
        ("prompt_id", pa.string()),
        ("sample", pa.int32()),
        ("prompt", pa.string()),
        ("answer", pa.string()),
        ("task", pa.string()),
        ("completion", pa.string()),
        ("token_ids", pa.list_(pa.int32())),  # null where not kept: rollout.keep_tokens, rl.shard_tokens
        ("logprobs", pa.list_(pa.float32())),  # sampler log-prob of each token in token_ids (null: as token_ids)
        ("num_tokens", pa.int32()),  # len(token_ids), kept either way: what lengths are read from
        ("finish_reason", pa.string()),
        ("policy", pa.string()),  # digest of the weights that sampled it (+ "@step<N>" inside rl)
        ("temperature", pa.float32()),
        ("top_p", pa.float32()),
        ("max_new_tokens", pa.int32()),
        ("seed", pa.int64()),
    ]
)
SCORED_SCHEMA = ROLLOUT_SCHEMA.append(pa.field("reward", pa.float32())).append(  # null = unscorable
    pa.field("rewards", pa.string()))  # JSON: each configured reward's value
# What the reward stage writes: the reward columns only, keyed by (prompt_id, sample) of rollouts.parquet (join
# there for the completion, tokens and log-probs: ``join_rollouts``).
REWARD_SCHEMA = pa.schema([("prompt_id", pa.string()), ("sample", pa.int32()),
                           SCORED_SCHEMA.field("reward"), SCORED_SCHEMA.field("rewards")])
SHARD_SCHEMA = (SCORED_SCHEMA.append(pa.field("step", pa.int32())).append(pa.field("advantage", pa.float32()))
                .append(pa.field("used", pa.bool_())))  # used = entered the update (not skipped/unscorable)

PER_TOKEN = ("token_ids", "logprobs", "loss_mask")  # left null where per-token data is not kept (rollout.keep_tokens,
# rl.shard_tokens): num_tokens, the text, the rewards stay
TOOL_FIELDS = [pa.field("loss_mask", pa.list_(pa.int8())),  # 1: a model token of token_ids, 0: an observation's
               pa.field("tool_calls", pa.int32()),  # tool calls the completion made
               pa.field("model_text", pa.string()),  # the model's turns alone: what rewards score
               pa.field("model_tokens", pa.int32())]  # its tokens (loss_mask's 1s): what lengths count


def with_tool_fields(schema: pa.Schema, tools: bool) -> pa.Schema:
    """``schema`` with the multi-turn columns (``TOOL_FIELDS``) appended when ``tools`` (``tools.enabled``); without
    them (single-turn: every token the model's) the files are those written before tools existed."""
    for f in TOOL_FIELDS if tools else []:
        schema = schema.append(f)
    return schema


VERSION_FIELD = pa.field("version", pa.int32())  # rl.overlap: the policy version (updates applied) that sampled it


def with_version_field(schema: pa.Schema, overlap: bool) -> pa.Schema:
    """``schema`` with the ``version`` column appended under ``rl.overlap`` (asynchronous RL: the sample's policy
    version); the synchronous loop's shards (version = step - 1, always) stay the files written before."""
    return schema.append(VERSION_FIELD) if overlap else schema


PASS_RATE_SCHEMA = pa.schema(
    [("prompt_id", pa.string()), ("n", pa.int32()), ("scorable", pa.int32()), ("n_correct", pa.int32()),
     ("pass_rate", pa.float32()), ("mean_reward", pa.float32())]
)


BATCH_ROWS = 8192  # rows converted between Python and Arrow at a time (bounds the Python objects alive)


def write_parquet(path: str | Path, rows: Iterable[dict[str, Any]], schema: pa.Schema) -> None:
    """Write ``rows`` (any iterable: a generator streams) as one Parquet file, replaced whole. Rows become
    Arrow ``BATCH_ROWS`` at a time, so only one batch of them is ever Python objects here; the file's layout is
    ``pq.write_table``'s (the same bytes as writing the whole table at once)."""
    batches = [pa.RecordBatch.from_pylist(b, schema=schema) for b in _slices(rows, BATCH_ROWS)]
    table = pa.Table.from_batches(batches, schema=schema).combine_chunks()
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp)


@contextmanager
def parquet_sink(path: str | Path, schema: pa.Schema) -> Iterator[Callable[[Sequence[dict[str, Any]]], None]]:
    """A Parquet file written batch by batch (``pyarrow.parquet.ParquetWriter``), replaced whole when the block
    ends (``atomic_path``): yields ``write(rows)``, which converts and writes one batch of rows (a row group)."""
    with atomic_path(path) as tmp, pq.ParquetWriter(tmp, schema) as w:
        yield lambda rows: w.write_batch(pa.RecordBatch.from_pylist(list(rows), schema=schema))


def join_rollouts(rollouts: str | Path, rewards: str | Path, columns: Sequence[str] | None = None) -> pa.Table:
    """The rollout rows (``columns`` of them, plus the key; None: all) with their reward columns, joined on
    (prompt_id, sample), in the rollouts' order. An Arrow table: for an audit or a test, not a whole dataset."""
    cols = list(dict.fromkeys(["prompt_id", "sample", *(columns or ROLLOUT_SCHEMA.names)]))
    r = read_columns(rollouts, cols)
    keys = r.select(["prompt_id", "sample"]).append_column("_row", pa.array(range(r.num_rows), pa.int64()))
    # Acero joins no list columns (token ids, log-probs): join the keys, then take the rollout rows by index
    j = keys.join(read_columns(rewards, REWARD_SCHEMA.names), ["prompt_id", "sample"], join_type="inner")
    j = j.sort_by("_row")
    out = r.take(j.column("_row"))
    for name in REWARD_SCHEMA.names[2:]:
        out = out.append_column(REWARD_SCHEMA.field(name), j.column(name))
    return out


def _slices(rows: Iterable[dict[str, Any]], n: int) -> Iterator[list[dict[str, Any]]]:
    it = iter(rows)
    while chunk := list(itertools.islice(it, n)):
        yield chunk


def parquet_file(path: str | Path) -> pq.ParquetFile:
    """An open Parquet file (metadata read, no rows). Missing or unreadable: a :class:`StageError` naming it."""
    if not Path(path).is_file():
        raise StageError(f"{path}: not found (has the stage that writes it run? `dvc repro <this stage>` runs "
                         "the upstream stages first)")
    try:
        return pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise StageError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0][:200]})") from None


def read_columns(path: str | Path, columns: Sequence[str]) -> pa.Table:
    """``columns`` of a Parquet file as an Arrow table (compact: no Python objects per row). A missing column is
    a :class:`StageError` naming the file and the columns it lacks."""
    f = parquet_file(path)
    missing = sorted(set(columns) - set(f.schema_arrow.names))
    if missing:
        raise StageError(f"{path}: missing columns {missing}")
    return f.read(columns=list(columns))


def batches(f: pq.ParquetFile, batch_rows: int, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
    """The record batches of ``f`` (``columns``; None: all), read a row group at a time: pyarrow's
    ``iter_batches`` over a whole file reads ahead and held more the longer the file (Arrow's pool peaked at
    44 MiB after one batch and at 128 MiB by the end of a 3,000,000-row file of 50,000-row groups; 14 MiB
    throughout a row group at a time)."""
    for rg in range(f.num_row_groups):
        yield from f.iter_batches(batch_size=batch_rows, columns=columns, row_groups=[rg])


def iter_rows(path: str | Path, columns: Sequence[str] | None = None,
              batch_rows: int = BATCH_ROWS) -> Iterator[list[dict[str, Any]]]:
    """The rows of a Parquet file (only ``columns``; None: all), a record batch of ``batch_rows`` at a time, as
    lists of dicts: what a stage that streams a dataset converts, one batch alive at a time."""
    f = parquet_file(path)
    missing = sorted(set(columns or ()) - set(f.schema_arrow.names))
    if missing:
        raise StageError(f"{path}: missing columns {missing}")
    for batch in batches(f, batch_rows, columns):
        yield batch.to_pylist()


class Column:
    """One column of a Parquet file as a sized, re-iterable sequence of Python values, read a record batch at a
    time: what ``dedup.find_duplicates`` walks twice over a curated pool, never whole in memory."""

    def __init__(self, path: str | Path, name: str) -> None:
        self.path, self.name = Path(path), name

    def __len__(self) -> int:
        return parquet_file(self.path).metadata.num_rows

    def __iter__(self) -> Iterator[Any]:
        for batch in batches(parquet_file(self.path), BATCH_ROWS, [self.name]):
            yield from batch.column(0).to_pylist()


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a (small: one RL step's shard, the pass rates, a test's fixture) Parquet file. Data that
    scales with the dataset is read with :func:`iter_rows` or :func:`read_columns` instead."""
    return [r for batch in iter_rows(path) for r in batch]


def read_problems(path: str | Path, limit: int | None = None) -> list[Problem]:
    """The problems of a curated split (the first ``limit``; None: all), read a record batch at a time up to
    ``limit``. A file without the problem columns is a ValueError naming the ones it lacks."""
    missing = set(PROBLEM_SCHEMA.names) - set(parquet_file(path).schema_arrow.names)
    if missing:
        raise ValueError(f"{path}: not a problems file (missing columns {sorted(missing)})")
    rows: list[dict[str, Any]] = []
    for batch in iter_rows(path):
        if limit is not None and len(rows) >= limit:
            break
        rows += batch
    return rows[:limit]  # type: ignore[return-value]


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]], fields: Sequence[str], now: bool = False) -> None:
    """A training log as CSV (``dvc plots`` reads it); ``now``: replaced at once even inside an output set (the
    live log, appended to while the stage runs)."""
    import csv

    with atomic_path(path, now=now) as tmp, tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(fields))
        w.writeheader()
        w.writerows(rows)


def json_line(row: dict[str, Any]) -> str:
    """One JSONL line (``write_jsonl``'s format)."""
    return json.dumps(row, ensure_ascii=False, default=str) + "\n"


def write_jsonl(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    with atomic_path(path) as tmp, tmp.open("w") as f:
        for r in rows:
            f.write(json_line(r))
