"""SFT data: demonstrations tokenized once, the ``sft.max_seq_len`` policy, and the micro-batch tensors.

- ``tokenize``: every demo's prompt and both renderings of its completion (``cot``: the full solution,
  ``direct``: the bare answer; with tool demos a third, ``tool``: a tool call, the observation the tool returns,
  then the bare answer, with the observation's span) through the chat template, once, by a batched
  ``datasets.Dataset.map`` into an Arrow file (one per rank) named by a digest of the demos, the tokenizer, its
  chat template and ``ENCODING_VERSION``. Under torchrun each rank tokenizes only its contiguous shard into its
  own file and, after a barrier, memory-maps every shard's file (the checkpoint folder is on storage every rank sees, as
  ``checkpoint.load_resumable`` already requires): no rank redoes another's work, none holds Python lists
  of the whole set.
- ``SftDemos``: the tokens as flat arrays + offsets (zero-copy views of the Arrow buffers) and the
  ``max_seq_len`` policy (``sft.overlong``): ``drop`` removes demos with a rendering longer than the limit,
  ``truncate`` keeps the prompt and cuts the completion; a demo whose prompt alone leaves no completion token
  within the limit is dropped either way. Every case is counted (``counts``, into ``metrics/sft.json``).
- ``group_by_length``: a step's demos ordered so every rank's micro-batches hold similar lengths.
- ``collate_packed``: a micro-batch packed with ``logprobs.pack_rows`` (first-fit decreasing) into
  block-diagonal rows (position ids restart at 0 per demo) of at most ``max_seq_len`` tokens, in the packed
  input format ``logprobs.token_logp_entropy`` takes.

Why ``datasets.map`` into the run's checkpoint folder, and not a DVC-tracked tokenized artifact: the
tokenizer is the one the sft stage itself resolves from ``model.base`` (distill's student uses the
teacher's), so a separate tokenize stage would move model resolution out of two stages and keep a second,
tokenizer-specific copy of the demos in the DVC cache, for work that costs seconds per 10^5 demos
(``benchmarks/sft_data.py``) against hours of training. The file is scratch with the checkpoints' life: a
resumed run finds it by its digest and reuses it, a finished run deletes it with the checkpoints (DVC stays
the one cache of results). ``datasets`` gives the batched map, the Arrow file and memory-mapped reading.
Why the packed collate is written here: ``logprobs.batch_tensors`` packs RL ``Seq`` rows (sampler log-probs,
advantages); SFT has (ids, prompt length) pairs and a row-width cap, and shares the packing itself
(``pack_rows``) and the packed input format.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
import torch
from transformers import PreTrainedTokenizerBase

from posttrain import distributed, logprobs
from posttrain.config import ToolsCfg
from posttrain.demos import Demos, as_table
from posttrain.tasks import get_task
from posttrain.tools.demos import demo_turn

IGNORE = -100
STYLES = ("cot", "direct")
TOOL = "tool"  # the tool-use rendering (sft.phases[*].tool_frac > 0): call + observation (masked) + bare answer
ENCODING_VERSION = 2  # bump when the rendering or encoding of a demo changes (it names the cache file)
log = logging.getLogger("posttrain.sft_data")

Example = tuple[list[int], list[int]]  # (input ids, labels: IGNORE on the prompt)


def encode_sft(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str) -> Example:
    """Chat-template ``prompt`` + ``completion``; labels are IGNORE on the prompt (loss on completion only).

    Works for any chat template whose rendering of [user] + generation prompt is a prefix of the
    rendering of [user, assistant].
    """
    (p,) = _heads(tokenizer, [prompt])
    (full,) = _fulls(tokenizer, [prompt], [completion], [p])
    return full, [IGNORE] * len(p) + full[len(p) :]


def _heads(tok: PreTrainedTokenizerBase, prompts: Sequence[str]) -> list[list[int]]:
    """Token ids of each [user] + generation prompt (one batched call)."""
    msgs = [[{"role": "user", "content": p}] for p in prompts]
    return _ids(tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True))


def _fulls(tok: PreTrainedTokenizerBase, prompts: Sequence[str], completions: Sequence[str],
           heads: Sequence[list[int]]) -> list[list[int]]:
    """Token ids of each [user, assistant] conversation (one batched call); each must start with its head."""
    msgs = [[{"role": "user", "content": p}, {"role": "assistant", "content": c}]
            for p, c in zip(prompts, completions, strict=True)]
    fulls = _ids(tok.apply_chat_template(msgs, tokenize=True))
    for h, full in zip(heads, fulls, strict=True):
        if full[: len(h)] != h:
            raise ValueError("chat template: the generation prompt is not a prefix of the full conversation")
    return fulls


def _ids(enc: Any) -> list[list[int]]:
    return [list(x) for x in (enc["input_ids"] if hasattr(enc, "keys") else enc)]


def _encode_batch(batch: dict[str, list[Any]], tok: PreTrainedTokenizerBase, tools: ToolsCfg | None = None
                  ) -> dict[str, list[Any]]:
    """``datasets.map`` function: a batch of demo rows -> prompt lengths and both renderings' ids. Each
    prompt is rendered once and each (demo, style) conversation once: three batched template calls.
    With ``tools`` also the ``tool`` rendering (:func:`tool_demo`) and its observation's ``[start, end)``."""
    rows = list(zip(batch["prompt"], batch["answer"], batch["solution"], batch["task"], strict=True))
    heads = _heads(tok, batch["prompt"])
    out: dict[str, list[Any]] = {"prompt_len": [len(h) for h in heads]}
    for style in STYLES:
        comps = [get_task(t).render(p, a, s, style) for p, a, s, t in rows]
        out[style] = _fulls(tok, batch["prompt"], comps, heads)
    if tools is not None:
        demos = [tool_demo(tok, tools, row[3], row[0], h, d) for row, h, d in zip(rows, heads, out["direct"],
                                                                                  strict=True)]
        out[TOOL], out["tool_obs"] = [d[0] for d in demos], [list(d[1]) for d in demos]
    return out


def tool_demo(tok: PreTrainedTokenizerBase, tools: ToolsCfg, task: str, prompt: str, head: list[int],
              direct: list[int]) -> tuple[list[int], tuple[int, int]]:
    """The ``tool`` rendering of a demo and its observation's ``[start, end)``: the prompt's ``head``, the task's
    tool call (``Task.tool_call``), the observation the tool returns (ids as the rollout loop appends them:
    ``tools.demos.demo_turn``), then the ``direct`` rendering's completion (bare answer + the template's end),
    so ``4821*7=`` -> ``<tool=calc>4821*7</tool><obs>33747</obs>answer: 33747``. Built from ids, not re-tokenized
    text: what the model sees after the call is what a rollout would show it, for any tokenizer."""
    make = get_task(task).tool_call
    call = make(prompt) if make is not None else None
    if call is None:
        raise ValueError(f"task {task!r} has no tool demo for {prompt!r}")
    call_ids, obs_ids = demo_turn(tok, tools, *call)
    start = len(head) + len(call_ids)
    return head + call_ids + obs_ids + direct[len(head) :], (start, start + len(obs_ids))


def features(tool: bool) -> datasets.Features:
    """The tokenized demos' columns: ``prompt_len``, one id list per style, and (tool demos) ``tool_obs``."""
    ids = datasets.List(datasets.Value("int32"))
    return datasets.Features({"prompt_len": datasets.Value("int32"), **{s: ids for s in STYLES},
                              **({TOOL: ids, "tool_obs": ids} if tool else {})})


def digest(tok: PreTrainedTokenizerBase, demos: Demos, tools: ToolsCfg | None = None) -> str:
    """What the tokenized demos depend on: the demos, the tokenizer (its vocabulary and rules), its chat
    template and special tokens, ``ENCODING_VERSION``, and the tools section when tool demos are made."""
    h = hashlib.sha256(f"v{ENCODING_VERSION}".encode())
    if tools is not None:
        h.update(tools.model_dump_json().encode())
    backend = getattr(tok, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(tok.get_vocab(), sort_keys=True)).encode())
    h.update(json.dumps([tok.chat_template, tok.special_tokens_map], sort_keys=True, default=str).encode())
    for batch in as_table(demos).to_batches(max_chunksize=10_000):  # Python objects for one batch at a time
        cols = [batch.column(c).to_pylist() for c in ("prompt", "answer", "solution", "task")]
        for row in zip(*cols, strict=True):
            h.update(json.dumps(list(row)).encode())
    return h.hexdigest()[:16]


def tokenize(tok: PreTrainedTokenizerBase, demos: Demos, cache_dir: Path,
             batch_size: int = 1000, progress: bool = True, tools: ToolsCfg | None = None) -> datasets.Dataset:
    """The demos tokenized (columns ``prompt_len``, ``cot``, ``direct``, in the demos' order; with ``tools``
    also ``tool`` and ``tool_obs``: the tool-use rendering, in ``tools.format``), from
    ``cache_dir`` when a previous call (an earlier attempt of this run) left the files there. Under torchrun
    each rank tokenizes only its contiguous shard into its own file; after a barrier every rank memory-maps
    all shards' files."""
    d = distributed.current()
    demos = as_table(demos)
    key = digest(tok, demos, tools)

    def shard_file(rank: int) -> Path:
        return Path(cache_dir) / f"tokenized-{key}-{rank:05d}-of-{d.world:05d}.arrow"

    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    cols = ("prompt", "answer", "solution", "task")
    src = datasets.Dataset(demos.select(list(cols)))  # the Arrow table itself: no copy through Python
    quiet = not progress and not datasets.are_progress_bars_disabled()
    if quiet:
        datasets.disable_progress_bars()
    try:
        src.shard(d.world, d.rank, contiguous=True).map(
            _encode_batch, batched=True, batch_size=batch_size, fn_kwargs={"tok": tok, "tools": tools},
            remove_columns=list(cols), features=features(tools is not None), cache_file_name=str(shard_file(d.rank)),
            new_fingerprint=f"{key}-{d.rank}-{d.world}", desc="tokenize demos")
    finally:
        if quiet:
            datasets.enable_progress_bars()
    d.barrier()
    return datasets.concatenate_datasets([datasets.Dataset.from_file(str(shard_file(r))) for r in range(d.world)])


class _Lists:
    """A list<int32> Arrow column as per-chunk (flat values, offsets) numpy views of the memory-mapped
    buffers (no copy of the tokens), with row lookup across chunks."""

    def __init__(self, col: pa.ChunkedArray) -> None:
        self.chunks = [(c.values.to_numpy(), c.offsets.to_numpy()) for c in col.chunks]
        self.starts = np.cumsum([0] + [len(c) for c in col.chunks])
        self.lengths = np.concatenate([np.diff(off) for _, off in self.chunks] or [np.zeros(0, np.int32)])

    def row(self, j: int) -> np.ndarray:
        k = int(np.searchsorted(self.starts, j, side="right")) - 1
        flat, off = self.chunks[k]
        r = j - int(self.starts[k])
        return flat[off[r] : off[r + 1]]


@dataclass
class SftDemos:
    """Tokenized demos after the ``max_seq_len`` policy: ``example(i, style)`` of the ``i``-th kept demo."""

    prompt_len: np.ndarray  # [N] int32
    tokens: dict[str, _Lists]  # style -> its ids per demo
    keep: np.ndarray  # [n] indices of the demos that train
    max_len: int | None
    counts: dict[str, int] = field(default_factory=dict)
    obs: np.ndarray | None = None  # [N, 2] each tool rendering's observation span [start, end) (tool demos)

    def __len__(self) -> int:
        return len(self.keep)

    def example(self, i: int, style: str) -> Example:
        j = int(self.keep[i])
        ids = self.tokens[style].row(j)[: self.max_len].tolist()  # truncate: the completion's tail goes
        p = int(self.prompt_len[j])
        labels = [IGNORE] * p + ids[p:]
        if style == TOOL and self.obs is not None:  # the observation is the tool's, not the model's: no loss
            a, b = (int(x) for x in self.obs[j])
            labels[a:b] = [IGNORE] * len(labels[a:b])
        return ids, labels


def select(ds: datasets.Dataset, max_len: int | None, overlong: str) -> SftDemos:
    """Apply ``sft.max_seq_len`` / ``sft.overlong`` to the tokenized demos, counting what each rule did.

    A demo is overlong when either rendering is longer than ``max_len``: ``drop`` removes it, ``truncate``
    keeps the first ``max_len`` tokens of each rendering (the prompt whole, the completion cut). A demo whose
    prompt takes ``max_len - 1`` tokens or more has no completion token left to learn and is dropped either
    way (``dropped_prompt_overlong``)."""
    table = ds.data.table
    prompt_len = table.column("prompt_len").to_numpy()
    styles = [s for s in (*STYLES, TOOL) if s in table.column_names]
    tokens = {s: _Lists(table.column(s)) for s in styles}
    obs = np.asarray(table.column("tool_obs").to_pylist(), dtype=np.int64) if TOOL in styles else None
    n = len(prompt_len)
    longest = np.max([tokens[s].lengths for s in styles], axis=0) if n else np.zeros(0, int)
    counts = {"demos_tokenized": n, "dropped_overlong": 0, "dropped_prompt_overlong": 0, "truncated": 0,
              "truncated_tokens": 0}
    if max_len is None:
        keep = np.arange(n)
    else:
        prompt_over = prompt_len >= max_len  # no completion target left within the limit
        over = (longest > max_len) & ~prompt_over
        counts["dropped_prompt_overlong"] = int(prompt_over.sum())
        if overlong == "drop":
            counts["dropped_overlong"] = int(over.sum())
            keep = np.flatnonzero(~prompt_over & ~over)
        else:
            counts["truncated"] = int(over.sum())
            counts["truncated_tokens"] = int(sum(np.clip(tokens[s].lengths[~prompt_over] - max_len, 0, None)
                                                 .sum() for s in styles))
            keep = np.flatnonzero(~prompt_over)
    counts["demos_trained"] = len(keep)
    if len(keep) < n or counts["truncated"]:
        log.warning("sft.max_seq_len %s (%s): %s", max_len, overlong, counts)
    return SftDemos(prompt_len, tokens, keep, max_len, counts, obs)


def group_by_length(examples: Sequence[Example], world: int) -> list[Example]:
    """The step's examples reordered so that each rank's contiguous share (``distributed.Dist.shard``) is sorted
    by length (its micro-batches pad little) and the shares are balanced: examples are dealt in length order,
    round-robin, to shares of ``Dist.shard``'s sizes. One process: simply sorted by length (stable)."""
    n = len(examples)
    sizes = [(r + 1) * n // world - r * n // world for r in range(world)]
    shares: list[list[Example]] = [[] for _ in range(world)]
    r = 0
    for i in sorted(range(n), key=lambda i: len(examples[i][0])):
        while len(shares[r]) == sizes[r]:
            r = (r + 1) % world
        shares[r].append(examples[i])
        r = (r + 1) % world
    return [ex for share in shares for ex in share]


def collate_packed(examples: Sequence[Example], pad_id: int, max_len: int | None) -> dict[str, torch.Tensor]:
    """Pack (ids, labels) pairs into rows (``logprobs.pack_rows``) of W = twice the longest, capped at
    ``max_len`` (never below the longest): ``ids``, ``pos`` [R, W] (positions restart at 0 per demo, so each
    attends only to itself), ``gather`` [B, T-1] (each demo position's flat index in the [R, W-1]
    predictions) and ``mask`` [B, T-1]. Every token of every demo is in exactly one row."""
    lens = [len(x) for x, _ in examples]
    longest = max(lens)
    w = max(longest, min(2 * longest, max_len)) if max_len else 2 * longest
    rows = logprobs.pack_rows(lens, w)
    ids = torch.full((len(rows), w), pad_id, dtype=torch.long)
    pos = torch.zeros((len(rows), w), dtype=torch.long)
    gather = torch.zeros((len(examples), longest - 1), dtype=torch.long)
    mask = torch.zeros((len(examples), longest - 1), dtype=torch.bool)
    for r, members in enumerate(rows):
        off = 0
        for i in members:
            (x, y), n = examples[i], lens[i]
            ids[r, off : off + n] = torch.tensor(x)
            pos[r, off : off + n] = torch.arange(n)
            gather[i, : n - 1] = r * (w - 1) + off + torch.arange(n - 1)
            mask[i, : n - 1] = torch.tensor(y[1:]) != IGNORE
            off += n
        pos[r, off:] = torch.arange(w - off)  # the tail is a block of its own, never gathered
    return {"ids": ids, "pos": pos, "gather": gather, "mask": mask}

