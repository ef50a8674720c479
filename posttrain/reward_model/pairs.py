"""Preference pairs (prompt, chosen, rejected) for a Bradley-Terry reward model: read from a preference file or
built from the reward stage's scored rollouts, then deduplicated, decontaminated against the eval split, capped
and split into train / held-out by prompt.

- **File** (:func:`read_preference_file`): JSONL read line by line (one malformed line is quarantined with its
  reason, never the whole file; as ``posttrain.sources`` reads problem files). A row is ``{prompt, chosen,
  rejected}`` strings, or the common HF preference columns: ``chosen`` / ``rejected`` as lists of chat messages
  (``[{role, content}, ...]``) whose last message is the assistant's answer and whose earlier messages (the
  same in both) are one user turn (optionally after a system message; ``prompt`` may also be given as a
  string). Multi-turn conversations are quarantined (the scorer takes a single prompt).
- **Rollouts** (:func:`rollout_pairs`): ``rollouts.parquet`` and ``rewards.parquet`` read in lockstep, a record
  batch at a time (the reward stage writes its rows in the rollouts' order, each prompt's samples together):
  per prompt, every distinct completion whose ``verifier`` component is 1 against every distinct one whose
  component is 0 (unscorable or partial values are in neither), at most ``pairs_per_prompt`` of them drawn by
  seed.
- :func:`finalize`: one row per (prompt, chosen, rejected) (the first kept), pairs whose prompt is an eval prompt
  (``decontam.normalize``d exact match) dropped, at most ``max_pairs`` kept (drawn by seed), and each prompt
  held out with probability ``heldout_frac`` by a hash of its normalised text (no seed: seed arms share one
  held-out set, and a prompt's pairs never straddle the split). Every step is counted.

Pairs are Arrow tables (``BUILT_SCHEMA``, then ``PAIR_SCHEMA`` with the split), never a Python dict per pair: rows
become Arrow ``BATCH_ROWS`` at a time as they are built (:class:`PairTable`), and ``finalize`` reads a batch of
them at a time, so 10^6 pairs at rest cost their strings' bytes (as ``posttrain.demos`` does for SFT's
demonstrations); dropping some copies the kept ones once (an Arrow ``take``).
Torch-free: building pairs never loads a model.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from posttrain.decontam import normalize
from posttrain.errors import StageError
from posttrain.schema import BATCH_ROWS, iter_rows

BUILT_SCHEMA = pa.schema([(c, pa.string()) for c in ("id", "prompt_id", "prompt", "chosen", "rejected")])
PAIR_SCHEMA = BUILT_SCHEMA.append(pa.field("split", pa.string()))  # what trains or is held out
SPLITS = ("train", "heldout")


class PairTable:
    """Pairs appended one at a time, kept as Arrow record batches of ``BATCH_ROWS`` (only the batch being filled
    is Python dicts); :meth:`table` is the whole ``BUILT_SCHEMA`` table."""

    def __init__(self) -> None:
        self.batches: list[pa.RecordBatch] = []
        self.rows: list[dict[str, str]] = []
        self.n = 0

    def append(self, row: dict[str, str]) -> None:
        self.rows.append(row)
        self.n += 1
        if len(self.rows) == BATCH_ROWS:
            self._flush()

    def _flush(self) -> None:
        if self.rows:
            self.batches.append(pa.RecordBatch.from_pylist(self.rows, schema=BUILT_SCHEMA))
            self.rows = []

    def table(self) -> pa.Table:
        self._flush()
        return pa.Table.from_batches(self.batches, schema=BUILT_SCHEMA)


# ------------------------------------------------------------------------------------------ preference file
def parse_preference(obj: dict[str, Any]) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) of one preference row; ValueError with the reason for a malformed one."""
    chosen, rejected, prompt = obj.get("chosen"), obj.get("rejected"), obj.get("prompt")
    if isinstance(chosen, list) and isinstance(rejected, list):
        c_prompt, chosen = _split_messages(chosen, "chosen")
        r_prompt, rejected = _split_messages(rejected, "rejected")
        if c_prompt != r_prompt:
            raise ValueError("chosen and rejected conversations differ before their last message")
        if c_prompt is not None:
            if isinstance(prompt, str) and prompt.strip() and prompt != c_prompt:
                raise ValueError("prompt differs from the conversations' user message")
            prompt = c_prompt
    for key, value in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected)):
        if not isinstance(value, str):
            raise ValueError(f"{key}: missing or not a string (or a list of chat messages)")
        if not value.strip():
            raise ValueError(f"{key}: empty")
    if chosen == rejected:
        raise ValueError("chosen == rejected: no preference")
    return prompt, chosen, rejected  # type: ignore[return-value]


def _split_messages(msgs: list[Any], key: str) -> tuple[str | None, str]:
    """(the user message before the answer or None when the list is the answer alone, the answer)."""
    if not msgs or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in msgs):
        raise ValueError(f"{key}: not a list of {{role, content}} messages")
    if msgs[-1].get("role") != "assistant":
        raise ValueError(f"{key}: the last message is not the assistant's")
    before = [m for m in msgs[:-1] if m.get("role") != "system"]
    if not before:
        return None, msgs[-1]["content"]
    if len(before) != 1 or before[0].get("role") != "user":
        raise ValueError(f"{key}: a multi-turn conversation (one user turn is supported)")
    return before[0]["content"], msgs[-1]["content"]


def read_preference_file(path: str | Path) -> tuple[pa.Table, list[dict[str, Any]], int]:
    """(pairs, quarantined rows ``{id, reason, line}``, lines read) of a preference JSONL file, line by line."""
    path = Path(path)
    if not path.is_file():
        raise StageError(f"{path}: preference file not found")
    pairs = PairTable()
    bad: list[dict[str, Any]] = []
    n = 0
    with path.open("rb") as f:
        for i, line in enumerate(f):
            n += 1
            rid = f"{path.name}:{i}"
            try:
                obj = json.loads(line.decode("utf-8"))
                if not isinstance(obj, dict):
                    raise ValueError("row is not a JSON object")
                prompt, chosen, rejected = parse_preference(obj)
            except UnicodeDecodeError:
                bad.append({"id": rid, "reason": "undecodable text (not UTF-8)", "line": repr(line[:200])})
            except json.JSONDecodeError as e:
                reason = "empty line" if not line.strip() else f"invalid JSON: {e.msg}"
                bad.append({"id": rid, "reason": reason, "line": line[:200].decode("utf-8", "replace")})
            except ValueError as e:
                bad.append({"id": rid, "reason": str(e), "line": line[:200].decode("utf-8", "replace")})
            else:
                pairs.append({"id": rid, "prompt_id": rid, "prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs.table(), bad, n


# ------------------------------------------------------------------------------------------ scored rollouts
def _label(rewards_json: str | None, verifier: str) -> bool | None:
    """True: the verifier's component is 1; False: 0; None: absent, unscorable or partial."""
    v = json.loads(rewards_json).get(verifier) if rewards_json else None
    return True if v == 1 else False if v == 0 else None


def _groups(rollouts: Path, rewards: Path) -> Iterator[list[dict[str, Any]]]:
    """Each prompt's rows (prompt_id, prompt, completion, rewards), the two files read in lockstep."""
    group: list[dict[str, Any]] = []
    ro = iter_rows(rollouts, ["prompt_id", "sample", "prompt", "completion"], BATCH_ROWS)
    rw = iter_rows(rewards, ["prompt_id", "sample", "rewards"], BATCH_ROWS)
    for a, b in itertools.zip_longest(_flat(ro), _flat(rw)):
        if a is None or b is None or (a["prompt_id"], a["sample"]) != (b["prompt_id"], b["sample"]):
            at = a or b
            raise StageError(f"{rewards}: rows not those of {rollouts}, in order (at {at['prompt_id']}/{at['sample']}"
                             "); was it written by the reward stage from these rollouts?")
        if group and group[-1]["prompt_id"] != a["prompt_id"]:
            yield group
            group = []
        group.append({**a, "rewards": b["rewards"]})
    if group:
        yield group


def _flat(batches: Iterable[list[dict[str, Any]]]) -> Iterator[dict[str, Any]]:
    for b in batches:
        yield from b


def rollout_pairs(rollouts: str | Path, rewards: str | Path, verifier: str, pairs_per_prompt: int, seed: list[int]
                  ) -> tuple[pa.Table, dict[str, int]]:
    """Pairs (a correct completion chosen over an incorrect one, same prompt) and their counts."""
    rng = np.random.default_rng(seed)
    pairs = PairTable()
    c = dict.fromkeys(("samples", "unlabelled", "prompts", "prompts_with_pairs", "duplicate_completions",
                       "candidate_pairs", "pairs_built"), 0)
    for group in _groups(Path(rollouts), Path(rewards)):
        c["prompts"] += 1
        c["samples"] += len(group)
        good: dict[str, None] = {}  # distinct texts, in sample order
        bad: dict[str, None] = {}
        for r in group:
            label = _label(r["rewards"], verifier)
            if label is None:
                c["unlabelled"] += 1
                continue
            side = good if label else bad
            if r["completion"] in side:
                c["duplicate_completions"] += 1
            side[r["completion"]] = None
        n = len(good) * len(bad)
        c["candidate_pairs"] += n
        if not n:
            continue
        c["prompts_with_pairs"] += 1
        take = sorted(rng.choice(n, size=pairs_per_prompt, replace=False)) if n > pairs_per_prompt else range(n)
        g, b = list(good), list(bad)
        pid, prompt = group[0]["prompt_id"], group[0]["prompt"]
        for j in take:
            pairs.append({"id": f"{pid}:{j}", "prompt_id": pid, "prompt": prompt, "chosen": g[j // len(b)],
                          "rejected": b[j % len(b)]})
    c["pairs_built"] = pairs.n
    if not c["samples"]:
        raise StageError(f"{rollouts}: no rollouts")
    return pairs.table(), c


# ------------------------------------------------------------------------------------------ dedup, decontam, split
def _key(*texts: str) -> bytes:
    return hashlib.blake2b("\x00".join(texts).encode(), digest_size=16).digest()


def heldout(prompt: str, frac: float) -> bool:
    """Whether ``prompt`` is held out: a 64-bit hash of its normalised text, as a fraction of 2^64, below ``frac``."""
    h = hashlib.blake2b(normalize(prompt).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") / 2**64 < frac


def finalize(pairs: pa.Table, eval_prompts: Iterable[str], max_pairs: int | None, heldout_frac: float,
             seed: list[int]) -> tuple[pa.Table, dict[str, int]]:
    """The pairs that train or evaluate (``PAIR_SCHEMA``: each with its ``split``), and the counts (see module
    docstring). ``pairs`` (``BUILT_SCHEMA``) is read ``BATCH_ROWS`` rows at a time; the kept rows are one Arrow
    ``take`` of it (a copy of them, beside ``pairs``, only when some were dropped)."""
    evals = {normalize(p) for p in eval_prompts}
    seen: set[bytes] = set()
    kept: list[int] = []  # row indices
    held: list[bool] = []  # of each kept row: its prompt is held out
    c = {"pairs_in": pairs.num_rows, "duplicates": 0, "contaminated": 0, "over_max_pairs": 0}
    at = 0
    for batch in pairs.select(["prompt", "chosen", "rejected"]).to_batches(max_chunksize=BATCH_ROWS):
        for i, p in enumerate(batch.to_pylist(), start=at):
            k = _key(p["prompt"], p["chosen"], p["rejected"])
            if k in seen:
                c["duplicates"] += 1
                continue
            seen.add(k)
            if normalize(p["prompt"]) in evals:
                c["contaminated"] += 1
                continue
            kept.append(i)
            held.append(heldout(p["prompt"], heldout_frac))
        at += batch.num_rows
    pick = np.arange(len(kept))
    if max_pairs is not None and len(kept) > max_pairs:
        c["over_max_pairs"] = len(kept) - max_pairs
        pick = np.sort(np.random.default_rng(seed).choice(len(kept), size=max_pairs, replace=False))
    rows = pairs if len(pick) == pairs.num_rows else pairs.take(pa.array(np.asarray(kept)[pick], pa.int64()))
    split = [SPLITS[held[j]] for j in pick]
    rows = rows.append_column(PAIR_SCHEMA.field("split"), pa.array(split, pa.string()))
    c["train"] = split.count(SPLITS[0])
    c["heldout"] = rows.num_rows - c["train"]
    return rows, c


def pairs_digest(rows: pa.Table) -> str:
    """sha256 (16 hex) of the rows as ``json.dumps(rows.to_pylist(), sort_keys=True)`` writes them, streamed a
    batch at a time (the reward model members' resume fingerprint and the manifest's ``pairs_digest``)."""
    h, sep = hashlib.sha256(b"["), b""
    for batch in rows.to_batches(max_chunksize=BATCH_ROWS):
        for r in batch.to_pylist():
            h.update(sep + json.dumps(r, sort_keys=True).encode())
            sep = b", "
    h.update(b"]")
    return h.hexdigest()[:16]
