"""MinHash-LSH dedup (``curate.dedup.method: minhash``) whose memory does not grow with the rows: the index
lives on disk in hash partitions (``spill.Partitions``), grouped one partition at a time.

- **Pass 1** (the texts streamed once): per row its 16-byte digest goes to the *exact* partitions, and, for a
  row with informative n-grams, one 64-bit key per LSH band (the band's index in the high 32 bits, a hash of
  the band's MinHash values and, with ``numbers_must_match``, of the row's numbers in the low 32) to the
  *band* partitions. datasketch computes the signatures and picks the bands (b x r) for the threshold.
- **Exact copies**: each exact partition sorted by (digest, row); a row whose digest an earlier row has is a
  copy of the first.
- **Candidates**: each band partition (copies left out) sorted by (key, row); a row is paired with the first
  ``max_postings`` rows of its bucket. Folding the numbers into the key means a bucket only ever holds rows
  with the same numbers, so the cap is spent on rows that could be duplicates.
- **Pass 2**: the candidate rows' signatures and numbers recomputed (none is kept from pass 1), each pair
  confirmed by equal numbers (exactly: the key holds only 32 bits of a hash) and its estimated Jaccard; a row
  is dropped for its best-scoring earlier kept row.

Memory: one partition (about ``spill.PER_PART`` records) and a chunk of rows at a time, one boolean a row,
and what grows with the duplicates, not the rows: the pairs, the candidates' signatures (``num_perm x 4``
bytes each) and the result (21 bytes a duplicate). Disk: 20 + 12 x b bytes a row (320 at the defaults),
removed as it is read (``scratch``: a folder on a disk, not a tmpfs, or the index is in memory after all).
datasketch's own ``MinHashLSH`` keeps ~6 KB a row in Python dicts (6 GB at 10^6 rows).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from posttrain.dedup.found import METHOD_CODES, Found
from posttrain.dedup.spill import Partitions
from posttrain.dedup.text import Texts, features

EXACT = np.dtype([("d0", "<u8"), ("d1", "<u8"), ("row", "<u4")])
BAND = np.dtype([("key", "<u8"), ("row", "<u4")])
CHUNK = 8192  # rows between flushes to the partitions
_NUMS = np.uint64(0x9E3779B97F4A7C15)  # odd: mixes the numbers' hash into the band hash (mod 2^64)


def near_minhash(texts: Texts, cfg: Any, common: frozenset[str], scratch: Path) -> Found:
    """MinHash-LSH over informative n-grams: estimated Jaccard >= ``cfg.minhash_threshold`` with equal numbers
    (and exact copies by digest); the index spilled under ``scratch`` (module docstring)."""
    from datasketch import MinHash, MinHashLSH

    lsh = MinHashLSH(threshold=cfg.minhash_threshold, num_perm=cfg.num_perm)  # only for datasketch's b, r
    perms = MinHash(num_perm=cfg.num_perm, seed=1, scheme="affine32").permutations
    mult = np.random.default_rng(0).integers(1, 2**63, size=lsh.r, dtype=np.uint64) | np.uint64(1)  # odd
    band_ids = np.arange(lsh.b, dtype=np.uint64) << np.uint64(32)

    def signature(inf: frozenset[str]) -> np.ndarray:
        m = MinHash(num_perm=cfg.num_perm, seed=1, permutations=perms, scheme="affine32")
        m.update_batch([g.encode() for g in inf])
        return m.hashvalues

    n = len(texts)
    if n >= 2**31:
        raise ValueError(f"{n} rows: the MinHash index packs a pair of row numbers into 63 bits")
    exact = Partitions(scratch / "exact", EXACT, n)
    bands = Partitions(scratch / "bands", BAND, n * lsh.b)
    digests: list[bytes] = []
    keys: list[np.ndarray] = []
    keyed: list[int] = []

    def flush(end: int) -> None:  # the rows end - len(digests) .. end - 1
        rec = np.zeros(len(digests), EXACT)
        d = np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(-1, 2)
        rec["d0"], rec["d1"], rec["row"] = d[:, 0], d[:, 1], np.arange(end - len(digests), end)
        exact.add(rec, rec["d0"])
        if keys:
            rec = np.zeros(len(keys) * lsh.b, BAND)
            rec["key"], rec["row"] = np.concatenate(keys), np.repeat(keyed, lsh.b)
            bands.add(rec, rec["key"])
        digests.clear()
        keys.clear()
        keyed.clear()

    read = 0
    for i, t in enumerate(texts):
        f = features(t, cfg.near_ngram)
        digests.append(f.digest)
        read = i + 1
        if inf := f.grams - common:
            h = (signature(inf)[: lsh.b * lsh.r].reshape(lsh.b, lsh.r).astype(np.uint64) * mult).sum(axis=1)
            if cfg.numbers_must_match:
                h += np.full(lsh.b, f.numbers % 2**64, dtype=np.uint64) * _NUMS
            keys.append(band_ids | (h >> np.uint64(32)))
            keyed.append(i)
        if len(digests) == CHUNK:
            flush(read)
    flush(read)

    copies = _exact_copies(exact)
    kept = np.ones(n, dtype=bool)
    kept[copies.row] = False
    later, earlier = _candidates(bands, kept, cfg.max_postings)
    need = np.unique(np.concatenate([later, earlier]))
    sig = np.zeros((len(need), cfg.num_perm), dtype=np.uint32)  # (affine32: values < 2^32)
    nums = np.zeros(len(need), dtype=np.int64)
    at = 0
    for i, t in enumerate(texts):  # the candidates' signatures and numbers, recomputed (none was kept)
        if at < len(need) and need[at] == i:
            f = features(t, cfg.near_ngram)
            sig[at], nums[at] = signature(f.grams - common), f.numbers
            at += 1
    a, b = np.searchsorted(need, later), np.searchsorted(need, earlier)
    if cfg.numbers_must_match:
        same = nums[a] == nums[b]
        a, b, later, earlier = a[same], b[same], later[same], earlier[same]
    score = np.concatenate([(sig[a[k:k + 65536]] == sig[b[k:k + 65536]]).mean(axis=1)
                            for k in range(0, len(a), 65536)] or [np.zeros(0)])
    ok = score >= cfg.minhash_threshold
    later, earlier, score = later[ok], earlier[ok], score[ok]
    rows, ofs, scores = [], [], []
    for k in np.lexsort((earlier, -score, later)):  # by row; best score, then earliest row, first
        j, i = int(later[k]), int(earlier[k])
        if kept[j] and kept[i]:
            kept[j] = False
            rows.append(j)
            ofs.append(i)
            scores.append(round(float(score[k]), 3))
    near = Found(np.array(rows, np.int64), np.array(ofs, np.int64),
                 np.full(len(rows), METHOD_CODES.index("minhash"), np.uint8), np.array(scores, np.float32))
    return Found.concat([copies, near])


def _exact_copies(parts: Partitions) -> Found:
    """Rows whose digest an earlier row has, each naming the first row with it (per partition: a sort by
    digest, then row)."""
    rows, ofs = [], []
    for p in parts:
        if not len(p):
            continue
        p = p[np.lexsort((p["row"], p["d1"], p["d0"]))]
        new_run = np.r_[True, (p["d0"][1:] != p["d0"][:-1]) | (p["d1"][1:] != p["d1"][:-1])]
        first = p["row"][np.flatnonzero(new_run)][np.cumsum(new_run) - 1]
        rows.append(p["row"][~new_run])
        ofs.append(first[~new_run])
    if not rows:
        return Found.empty()
    row = np.concatenate(rows).astype(np.int64)
    return Found(row, np.concatenate(ofs).astype(np.int64), np.full(len(row), METHOD_CODES.index("exact"), np.uint8),
                 np.ones(len(row), np.float32))


def _candidates(parts: Partitions, usable: np.ndarray, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs (later row, earlier row), unique: rows sharing a band key, each row paired with the first
    ``cap`` usable rows of its bucket."""
    pairs = []
    for p in parts:
        p = p[usable[p["row"]]]
        if not len(p):
            continue
        p = p[np.lexsort((p["row"], p["key"]))]
        key, row = p["key"], p["row"].astype(np.int64)
        new_run = np.r_[True, key[1:] != key[:-1]]
        pos = np.flatnonzero(~new_run)  # positions in a bucket after its first row
        start = np.flatnonzero(new_run)[np.cumsum(new_run)[pos] - 1]  # where each one's bucket starts
        for d in range(cap):
            first = start + d
            m = first < pos
            if not m.any():
                break
            pairs.append(np.unique((row[pos[m]] << 32) | row[first[m]]))
    if not pairs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    key = np.unique(np.concatenate(pairs))
    return key >> 32, key & 0xFFFFFFFF
