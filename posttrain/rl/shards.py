"""One rl step persisted: ``shards/step_NNNNN.parquet`` (every sample of the step: rollout, sampler log-probs,
reward, advantage, whether it entered the update), so any update can be replayed and audited.

Under torchrun each rank holds only the rows it sampled (``collect``). They reach rank 0, the one writer, as
Arrow IPC bytes sent point to point (``Dist.stream_to_main``), one sampling call at a time, so the file keeps
the step's sampling order (rounds, then prior-budget groups; each call's groups in rank order) and no other
rank receives anything. One table written whole: with one process the file is the one ``schema.write_parquet``
wrote before.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from posttrain import distributed
from posttrain.outputs import atomic_path
from posttrain.rl.collect import StepBatch
from posttrain.schema import PER_TOKEN, SHARD_SCHEMA


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def write_shard(path: Path, sb: StepBatch, adv: torch.Tensor, step: int, schema: pa.Schema = SHARD_SCHEMA,
                tokens: bool = True) -> None:
    """Write the step's rows to ``path`` (rank 0; every rank must call it). ``adv``: the advantages
    [len(sb.used), G] of ``update.update_from_groups``; rows of groups not used get none. ``schema``: with
    ``schema.with_tool_fields`` the rows' loss masks and tool-call counts too (multi-turn tool rollouts).
    ``tokens`` (``rl.shard_tokens``): False leaves the per-token columns (``PER_TOKEN``) null, ``num_tokens`` kept."""
    d = distributed.current()
    pos = {i: k for k, i in enumerate(sb.used)}
    drop = {} if tokens else dict.fromkeys(PER_TOKEN)
    tables = []
    for lo, hi in sb.segments:
        rows = [{**row, **drop, "step": step, "advantage": float(adv[pos[i], j]) if i in pos else None,
                 "used": i in pos and row["reward"] is not None}
                for i in range(lo, hi) for j, row in enumerate(sb.rows.get(i, []))]
        for payload in d.stream_to_main(_ipc(pa.Table.from_pylist(rows, schema=schema))):
            tables.append(pa.ipc.open_stream(payload).read_all())
    if d.main:
        with atomic_path(path) as tmp:
            pq.write_table(pa.concat_tables(tables).combine_chunks(), tmp)
