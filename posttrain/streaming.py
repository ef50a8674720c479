"""A stage's output written chunk by chunk, resumable after a kill: :class:`PartialParquet`.

A long generating stage (rollout: G samples of 10^5-10^6 prompts) writes its finished chunks as Parquet parts
(``part-<first chunk>-<end chunk>.parquet``, atomically: a part that exists is complete) in a *partial* folder
beside a ``cursor.json`` naming what the parts belong to (the run's key: params, input digests, code
format). The parts are the cursor: a re-run with the same key skips the chunks ``0 .. done-1`` already on disk
and continues at chunk ``done``; a re-run with another key starts over (one log line names what changed).
When every chunk is written, :meth:`PartialParquet.assemble` streams the parts, in chunk order, into the final
file through one ``pyarrow.parquet.ParquetWriter`` (row groups of ``ROW_GROUP_ROWS`` rows, whatever the chunks
were, so the file is byte-identical whether or not a kill happened) inside ``outputs.atomic_path``: the final
output is still replaced whole (and with the stage's other outputs, inside ``outputs.output_set``).

The partial folder is a path of its own (``paths.rollout_checkpoints``), not a DVC out and outside the stage's
output set: ``dvc repro`` removes a stage's outs before running it, and an output set removes its twins when
it fails, and both would lose the finished chunks.

Why by hand: pyarrow writes a Parquet file's footer only when the writer closes, so a killed ``ParquetWriter``
leaves an unreadable file, and no library of this stack resumes a chunked write; the part-per-chunk layout is
the standard way (Spark's and Ray's task outputs) to make finished work survive a kill.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from posttrain.outputs import atomic_path
from posttrain.schema import batches

log = logging.getLogger("posttrain.streaming")

ROW_GROUP_ROWS = 8192  # rows per row group of an assembled file (bounds a reader's batch, too)
FORMAT = 2  # the part/cursor layout; bump when it changes (an old partial run then starts over)
CURSOR = "cursor.json"


class PartialParquet:
    """The finished chunks of one run of a chunked stage, in ``folder``.

    ``key``: what the chunks depend on, by name (``{"params": ..., "train": <digest>, "policy": <digest>}``);
    ``total``: the number of chunks the run writes. Chunks are buffered and written together as one part once
    ``flush_rows`` rows are buffered or ``flush_seconds`` have passed since the buffer's first chunk (0: a part per
    chunk): a kill loses at most that much sampling, and a fast sampler does not pay a file per chunk. Opening
    with another key (or total, or format) removes
    the parts of the other run first and logs which entries changed.
    """

    def __init__(self, folder: str | Path, key: dict[str, str], total: int, schema: pa.Schema,
                 flush_rows: int = ROW_GROUP_ROWS, flush_seconds: float = 0.0) -> None:
        self.folder, self.total, self.schema = Path(folder), total, schema
        self.flush_rows, self.flush_seconds = flush_rows, flush_seconds
        self._buf: list[pa.Table] = []
        self._rows = self._first = self._next = 0
        self._since = 0.0
        self.key = {**key, "format": str(FORMAT), "schema": schema.to_string(), "total": str(total)}
        old = self._read_cursor()
        if old is not None and old != self.key:
            changed = sorted(k for k in self.key.keys() | old.keys() if old.get(k) != self.key.get(k))
            log.warning("%s holds a partial run of another configuration (changed: %s): starting over",
                        self.folder, ", ".join(changed))
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        if old != self.key:
            with atomic_path(self.folder / CURSOR, now=True) as tmp:
                tmp.write_text(json.dumps(self.key, indent=1, sort_keys=True) + "\n")

    def _read_cursor(self) -> dict[str, str] | None:
        f = self.folder / CURSOR
        if not f.is_file():
            return {} if self.folder.exists() and any(self.folder.iterdir()) else None
        try:
            return json.loads(f.read_text())
        except (OSError, ValueError):
            return {}  # unreadable: another configuration, as far as resuming goes

    def part(self, c0: int, c1: int) -> Path:
        """The part holding chunks ``c0 .. c1-1``."""
        return self.folder / f"part-{c0:07d}-{c1:07d}.parquet"

    def _parts(self) -> list[tuple[int, int]]:
        """The (first, end) chunk ranges of the parts that continue each other from chunk 0."""
        ends: dict[int, int] = {}
        for f in self.folder.glob("part-*-*.parquet"):
            c0, c1 = (int(x) for x in f.stem.split("-")[1:])
            ends[c0] = max(c1, ends.get(c0, c1))
        out, c = [], 0
        while c in ends and c < self.total:
            out.append((c, ends[c]))
            c = ends[c]
        return out

    def done(self) -> int:
        """Chunks ``0 .. done()-1`` are on disk (the first missing chunk is where the run continues)."""
        parts = self._parts()
        return min(parts[-1][1], self.total) if parts else 0

    def write(self, c: int, rows: Sequence[dict[str, Any]]) -> None:
        """Chunk ``c``'s rows: buffered, and written as a part (with the chunks buffered before it) once the
        buffer holds ``flush_rows`` rows or ``flush_seconds`` have passed since the last part."""
        if self._buf and c != self._next:
            self.flush()
        if not self._buf:
            self._first, self._since = c, time.monotonic()
        self._buf.append(pa.Table.from_pylist(list(rows), schema=self.schema))
        self._rows, self._next = self._rows + len(rows), c + 1
        if self._rows >= self.flush_rows or time.monotonic() - self._since >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the buffered chunks as one part (atomically: written in full, fsynced, renamed)."""
        if not self._buf:
            return
        with atomic_path(self.part(self._first, self._next), now=True) as tmp:
            pq.write_table(pa.concat_tables(self._buf), tmp)
        self._buf, self._rows = [], 0

    def batches(self, columns: Sequence[str] | None = None) -> Iterator[pa.RecordBatch]:
        """The finished chunks' rows, in chunk order, as record batches."""
        for c0, c1 in self._parts():
            yield from batches(pq.ParquetFile(self.part(c0, c1)), 65_536, columns)  # (iter_batches' default)

    def assemble(self, path: str | Path) -> int:
        """Stream every part into ``path`` (replaced whole; inside an output set, with the set). Returns rows."""
        self.flush()
        if self.done() < self.total:
            raise RuntimeError(f"{self.folder}: {self.done()} of {self.total} chunks written; cannot assemble")
        n = 0
        with atomic_path(path) as tmp, pq.ParquetWriter(tmp, self.schema) as w:
            for batch in rebatch(self.batches(), ROW_GROUP_ROWS):
                w.write_batch(batch, row_group_size=ROW_GROUP_ROWS)
                n += batch.num_rows
        return n

    def remove(self) -> None:
        """Drop the partial run (after its final output is in place)."""
        shutil.rmtree(self.folder, ignore_errors=True)


def rebatch(batches: Iterator[pa.RecordBatch], rows: int) -> Iterator[pa.RecordBatch]:
    """The same rows in batches of exactly ``rows`` (the last one shorter), whatever the input's batch sizes."""
    buf: list[pa.RecordBatch] = []
    have = 0
    for b in batches:
        while b.num_rows:
            take = min(rows - have, b.num_rows)
            buf.append(b.slice(0, take))
            have += take
            b = b.slice(take)
            if have == rows:
                yield pa.Table.from_batches(buf).combine_chunks().to_batches()[0]
                buf, have = [], 0
    if have:
        yield pa.Table.from_batches(buf).combine_chunks().to_batches()[0]
