"""A group-by over more records than memory should hold: records spilled to disk in hash partitions, read back
one partition at a time (the dedup index at 10^6-10^8 rows: the rows' digests, and their LSH band keys).

Why by hand: the standard out-of-core way (Spark's shuffle, datatrove's MinHash buckets) is to partition by
a hash of the grouping key so equal keys land in one partition, and to sort each partition in memory; no
library of this stack does it over numpy records without a cluster (``datasets``' ``map`` and ``sort`` hold
their indices in memory, and ``pyarrow``'s group-by is in memory too). Partition sizes are set from the
expected record count so that one partition holds about ``per_part`` records whatever the dataset's size.
Records wait in memory until ``buffer_bytes`` of them do (8 KB a partition, at most 16 MiB) and then go out a
partition at a time: the LSH bands at 10^8 rows (25 bands in ~4,800 partitions) are written ~3.5 KB at a
time, 1/7 of the opens of a ~500-byte append to every partition after every 8,192 rows, while a pool of
10^6 rows (48 partitions) holds nothing back (a chunk of rows is more than 48 x 8 KB).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

PER_PART = 1 << 19  # records a partition holds on average (12-20 bytes each: 6-10 MB read back at once)
WRITE_BYTES = 8 << 10  # the append a partition should get at once: records wait until parts x this ...
BUFFER_BYTES = 16 << 20  # ... or this many bytes of them wait, whichever is less


class Partitions:
    """Records of one numpy dtype appended to ``parts`` files by ``key % parts`` (held in memory until
    ``buffer_bytes`` of them wait); iterating reads each file back whole (then deletes it), so records of equal
    key are always read together."""

    def __init__(self, folder: Path, dtype: np.dtype, records: int, per_part: int | None = None,
                 buffer_bytes: int | None = None) -> None:
        self.dtype, self.parts = np.dtype(dtype), max(1, -(-records // (per_part or PER_PART)))
        self.budget = min(BUFFER_BYTES, self.parts * WRITE_BYTES) if buffer_bytes is None else buffer_bytes
        self.waiting: list[tuple[np.ndarray, np.ndarray]] = []  # (records by partition, bounds)
        self.waiting_bytes = 0
        folder.mkdir(parents=True, exist_ok=True)
        self.files = [folder / f"part-{p:05d}.bin" for p in range(self.parts)]
        for f in self.files:
            f.write_bytes(b"")

    def add(self, recs: np.ndarray, key: np.ndarray) -> None:
        """Append ``recs`` (of this dtype), each to the partition of its ``key`` (uint64, hash-like)."""
        part = (key % np.uint64(self.parts)).astype(np.int64)
        order = np.argsort(part, kind="stable")  # records keep their order within a partition
        self.waiting.append((recs[order], np.searchsorted(part[order], np.arange(self.parts + 1))))
        self.waiting_bytes += recs.nbytes
        if self.waiting_bytes >= self.budget:
            self._write()

    def _write(self) -> None:
        """The waiting records to their partitions' files: each partition opened once, its records appended in
        the order they came (no copy of the waiting records is made)."""
        for p in range(self.parts):
            if any(b[p + 1] > b[p] for _, b in self.waiting):
                with self.files[p].open("ab") as f:
                    for recs, b in self.waiting:
                        recs[b[p]:b[p + 1]].tofile(f)
        self.waiting.clear()
        self.waiting_bytes = 0

    def __iter__(self) -> Iterator[np.ndarray]:
        self._write()
        for f in self.files:
            yield np.fromfile(f, dtype=self.dtype)
            f.unlink()
