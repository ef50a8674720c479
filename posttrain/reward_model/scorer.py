"""A trained reward model as one artifact: ``<dir>/member_0 .. member_{K-1}`` (HF folders of
``AutoModelForSequenceClassification`` with ``num_labels=1``) and ``<dir>/manifest.json``; and the one way a text
becomes a score, shared by training and scoring so the two never disagree.

``load_reward_model(path)`` returns a :class:`RewardScorer`: ``scorer(prompts, completions)`` is the ``[B, K]``
array of every member's score of each (prompt, completion) (combine them as you like: mean, min = WCO,
mean - lambda * std = UWO). A text is the policy's own rendering (``sft_data.encode_sft``: the chat template of
[user: prompt, assistant: completion], its end token included); the head reads the hidden state at its last
non-pad token. A text longer than the model's context keeps its last ``context`` tokens (the end, where the
answer and the read-out token are), counted in ``scorer.truncated``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain import modeling
from posttrain.config import LoraCfg
from posttrain.errors import ModelLoadError, StageError
from posttrain.modeling.models import load_hint
from posttrain.sft_data import encode_sft
from posttrain.training import collate

MANIFEST = "manifest.json"
FORMAT = 1


def load_scorer(name: str, dtype: str = "float32", device: str | torch.device = "cpu", trainable: bool = False,
                attn_implementation: str = "sdpa", pad_token_id: int | None = None) -> PreTrainedModel:
    """A scalar-head model (``AutoModelForSequenceClassification``, ``num_labels=1``) from a folder or hub id: a
    causal LM's folder gives its trunk and a new head (``score``; its init follows torch's global seed), a reward
    model's folder gives both. The head reads the hidden state of the last token that is not ``pad_token_id``
    (set into the config: the policy's folder may lack it). Weights as ``modeling.load_model`` keeps them
    (``trainable``: fp32 masters, else ``dtype``).

    Here rather than in ``posttrain.modeling`` (the home of model loading) for now: every training and sampling
    stage lists ``posttrain/modeling`` as a dep, so adding this there would re-run the whole default DAG; it
    moves there when that re-run is paid for anyway."""
    import logging

    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)  # "score.weight newly initialized": what a fresh head is
    try:
        model = AutoModelForSequenceClassification.from_pretrained(
            name, num_labels=1, dtype=torch.float32 if trainable else getattr(torch, dtype),
            attn_implementation=attn_implementation)
    except (OSError, ValueError) as e:
        raise ModelLoadError(load_hint(name, e)) from None
    finally:
        hf_logging.set_verbosity(level)
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id
    return model.to(device).eval()


def make_trainable(model: PreTrainedModel, lora: LoraCfg | None, gradient_checkpointing: bool) -> PreTrainedModel:
    """``modeling.make_trainable`` for a scalar-head model: with ``lora``, peft's ``SEQ_CLS`` task (adapters on the
    trunk, the head trained in full: ``modules_to_save``)."""
    model = modeling.make_trainable(model, None, gradient_checkpointing)
    if lora is None:
        return model
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                                                      task_type="SEQ_CLS", target_modules=lora.target_modules))


def encode(tok: PreTrainedTokenizerBase, prompt: str, completion: str) -> list[int]:
    """Token ids of (prompt, completion) as the reward model reads them (the policy's chat rendering)."""
    return encode_sft(tok, prompt, completion)[0]


def pad_id(tok: PreTrainedTokenizerBase) -> int:
    """The id the head's read-out skips: the tokenizer's pad, else its end token (a real tokenizer may lack a
    pad; right padding with the end token only moves the read-out to the text's own end token's left)."""
    pid = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if pid is None:
        raise StageError("tokenizer has neither a pad nor an end token: the reward head cannot find a text's end")
    return int(pid)


def score_ids(model: torch.nn.Module, seqs: Sequence[list[int]], pad: int) -> torch.Tensor:
    """Scores ``[N]`` of token-id sequences in one forward (right-padded; the head reads each last real token)."""
    device = next(model.parameters()).device
    batch = collate([(s, s) for s in seqs], pad)
    out = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    return out.logits[:, 0].float()


def pack(prefixes: Sequence[list[int]], end: int, pad: int) -> tuple[list[int], list[int], list[int]] | None:
    """``prefixes`` (the token ids of a text's prefixes, each with the text's ``end`` end-of-turn tokens, the
    whole text last) as one pack ``(body, tail, cuts)``: the whole text without its tail, the tail, and each
    prefix's length without it; None unless every prefix is exactly ``body[:cut] + tail`` (a tokenizer may merge
    across a step's boundary: that text is then scored prefix by prefix), and None when the tail holds ``pad``
    (the head reads a text's last token that is not pad: a template ending in the end token a tokenizer also
    pads with is read before it, which the packed read-out does not follow)."""
    whole = prefixes[-1]
    if end <= 0 or len(whole) <= end:
        return None
    body, tail = whole[:-end], whole[-end:]
    if pad in tail:
        return None
    cuts = [len(x) - end for x in prefixes]
    if any(c <= 0 or x[-end:] != tail or x[:-end] != body[:c] for x, c in zip(prefixes, cuts, strict=True)):
        return None
    return body, tail, cuts


def _width(p: tuple[list[int], list[int], list[int]]) -> int:
    """The tokens of a pack's forward: its body, and its tail once per prefix."""
    body, tail, cuts = p
    return len(body) + len(cuts) * len(tail)


def score_packed(model: torch.nn.Module, packs: Sequence[tuple[list[int], list[int], list[int]]], pad: int
                 ) -> list[torch.Tensor]:
    """Each pack's prefix scores (``[len(cuts)]``) in one forward of ``len(body) + len(cuts) x len(tail)``
    tokens, not the ``sum(cuts) + len(cuts) x len(tail)`` of a forward per prefix: the body once, then a copy of
    the tail per prefix, copy j at the positions prefix j's own text has it and seeing only ``body[:cuts[j]]`` and
    itself (a 4D mask), so the head at its last token reads what prefix j's own forward reads there."""
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    width = max(map(_width, packs))
    ids = torch.full((len(packs), width), pad, dtype=torch.long)
    pos = torch.zeros((len(packs), width), dtype=torch.long)
    seen = torch.zeros((len(packs), 1, width, width), dtype=torch.bool)
    reads = []
    for i, (body, tail, cuts) in enumerate(packs):
        n, k = len(body), len(tail)
        ids[i, :n], pos[i, :n] = torch.tensor(body), torch.arange(n)
        seen[i, 0, :n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        for j, c in enumerate(cuts):
            a = n + j * k
            ids[i, a : a + k], pos[i, a : a + k] = torch.tensor(tail), torch.arange(c, c + k)
            seen[i, 0, a : a + k, :c] = True
            seen[i, 0, a : a + k, a : a + k] = torch.ones(k, k, dtype=torch.bool).tril()
        used = n + len(cuts) * k
        seen[i, 0, range(used, width), range(used, width)] = True  # padding sees itself (no empty softmax row)
        reads.append([n + (j + 1) * k - 1 for j in range(len(cuts))])
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    hidden = model.base_model(input_ids=ids.to(device), attention_mask=mask.to(device),
                              position_ids=pos.to(device)).last_hidden_state
    scores = model.score(hidden)[..., 0].float()  # [B, width]: the head at every position
    return [scores[i, r] for i, r in enumerate(reads)]


class RewardScorer:
    """K members of one reward model; ``scorer(prompts, completions) -> np.ndarray [B, K]`` (float32)."""

    def __init__(self, members: list[PreTrainedModel], tok: PreTrainedTokenizerBase, manifest: dict[str, Any],
                 batch_size: int = 64) -> None:
        self.members, self.tok, self.manifest, self.batch_size = members, tok, manifest, batch_size
        self.pad = pad_id(tok)
        self.context = int(getattr(members[0].config, "max_position_embeddings", 0) or 0) or None
        self.truncated = 0
        self.forwarded = 0  # tokens read by the members' forwards (each member's), for benchmarks and tests
        probe = [encode(tok, "q", c) for c in ("a", "b b")]  # the end-of-turn tokens: their common tail
        self.tail = next((i for i in range(min(map(len, probe))) if probe[0][-1 - i] != probe[1][-1 - i]), 0)
        cfg = members[0].config  # packing needs the head apart from the trunk, and full attention
        self.packs = all(hasattr(m, "score") and hasattr(m, "base_model") for m in members) and \
            not getattr(cfg, "sliding_window", None)
        self.mask_budget = 2**27  # mask elements (B x width^2) a packed forward may hold: 256 MiB in bf16

    @property
    def k(self) -> int:
        return len(self.members)

    def encode(self, prompts: Sequence[str], completions: Sequence[str]) -> list[list[int]]:
        seqs = [encode(self.tok, p, c) for p, c in zip(prompts, completions, strict=True)]
        if self.context is not None:
            self.truncated += sum(len(s) > self.context for s in seqs)
            seqs = [s[-self.context:] for s in seqs]
        return seqs

    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> np.ndarray:
        return self.score_seqs(self.encode(prompts, completions))

    @torch.no_grad()
    def score_seqs(self, seqs: Sequence[list[int]]) -> np.ndarray:
        """``[N, K]`` scores of token-id sequences already encoded (and within the context), ``batch_size`` a
        forward, lengths sorted so that a forward pads little."""
        out = np.zeros((len(seqs), self.k), dtype=np.float32)
        order = np.argsort([len(s) for s in seqs], kind="stable")  # similar lengths share a forward: less padding
        for i in range(0, len(seqs), self.batch_size):
            idx = order[i : i + self.batch_size]
            chunk = [seqs[j] for j in idx]
            self.forwarded += self.k * sum(map(len, chunk))
            for k, m in enumerate(self.members):
                out[idx, k] = score_ids(m, chunk, self.pad).cpu().numpy()
        return out

    @torch.no_grad()
    def score_prefixes(self, texts: Sequence[Sequence[list[int]]], packed: bool = True) -> list[np.ndarray]:
        """``[S_i, K]`` scores of each text's prefixes (token ids, each with its end tokens, the whole text last),
        the same as ``score_seqs`` of every prefix: ``packed``, a text's prefixes share one forward
        (``score_packed``: tokens linear in the steps, where a forward per prefix reads quadratically many); a
        text the packing does not hold for (``pack``), and every text of a model with sliding-window attention (a
        custom mask bypasses the window) or without a separate head, is scored prefix by prefix."""
        packs = {i: p for i, t in enumerate(texts)
                 if packed and self.packs and len(t) > 1 and (p := pack(t, self.tail, self.pad))}
        rest = [i for i in range(len(texts)) if i not in packs]
        flat = [x for i in rest for x in texts[i]]
        scored = self.score_seqs(flat) if flat else np.zeros((0, self.k), dtype=np.float32)
        out: list[np.ndarray] = [np.zeros((0, self.k), dtype=np.float32)] * len(texts)
        at = 0
        for i in rest:
            out[i], at = scored[at : at + len(texts[i])], at + len(texts[i])
        chunks: list[list[int]] = []  # batch_size texts a forward at most, the mask within mask_budget
        for i in sorted(packs, key=lambda i: _width(packs[i])):
            if chunks and len(chunks[-1]) < self.batch_size \
                    and (len(chunks[-1]) + 1) * _width(packs[i]) ** 2 <= self.mask_budget:
                chunks[-1].append(i)
            else:
                chunks.append([i])
        for chunk in chunks:
            self.forwarded += self.k * sum(_width(packs[i]) for i in chunk)
            got = [score_packed(m, [packs[i] for i in chunk], self.pad) for m in self.members]
            for j, i in enumerate(chunk):
                out[i] = torch.stack([g[j] for g in got], dim=1).cpu().numpy()
        return out


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / MANIFEST).write_text(json.dumps({"format": FORMAT, **manifest}, indent=2) + "\n")


def load_reward_model(path: str | Path, device: str | torch.device = "cpu", dtype: str = "float32",
                      batch_size: int = 64) -> RewardScorer:
    """The reward model at ``path`` (the ``reward_model`` stage's artifact folder), every member in eval mode."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise StageError(f"{path}: not a reward model (no {MANIFEST})")
    manifest = json.loads((path / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise StageError(f"{path}: reward model format {manifest.get('format')!r}, this code reads {FORMAT}")
    tok = modeling.load_tokenizer(str(path / manifest["members"][0]))
    members = [load_scorer(str(path / m), dtype, device, pad_token_id=pad_id(tok))
               for m in manifest["members"]]
    return RewardScorer(members, tok, manifest, batch_size)
