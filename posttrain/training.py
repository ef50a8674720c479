"""Plain training functions: SFT example encoding, batching, optimizer/schedule, resumable checkpoints.

A resumable checkpoint holds model, optimizer, scheduler, RNG states, the step and the training log,
plus a fingerprint of everything that determines the run (params section, model config, input data
hash). A checkpoint whose fingerprint differs from the current run's is stale and never resumed from.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase, get_cosine_schedule_with_warmup

from posttrain.schema import atomic_path

IGNORE = -100
log = logging.getLogger("posttrain.training")


def file_digest(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(*parts: Any) -> str:
    """A stable hash of JSON-able parts (pydantic models are dumped first)."""
    norm = [p.model_dump(mode="json") if hasattr(p, "model_dump") else p for p in parts]
    return hashlib.sha256(json.dumps(norm, sort_keys=True, default=str).encode()).hexdigest()[:16]


def encode_sft(tokenizer: PreTrainedTokenizerBase, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Chat-template ``prompt`` + ``completion``; labels are IGNORE on the prompt (loss on completion only).

    Works for any chat template whose rendering of [user] + generation prompt is a prefix of the
    rendering of [user, assistant].
    """
    msgs = [{"role": "user", "content": prompt}]
    p = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    full = tokenizer.apply_chat_template(msgs + [{"role": "assistant", "content": completion}], tokenize=True)
    p, full = _ids(p), _ids(full)
    if full[: len(p)] != p:
        raise ValueError("chat template: the generation prompt is not a prefix of the full conversation")
    return full, [IGNORE] * len(p) + full[len(p) :]


def _ids(enc: Any) -> list[int]:
    return list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc)


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad (ids, labels) pairs into input_ids / attention_mask / labels, all [B, T]."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE)
    mask = torch.zeros_like(ids)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def sum_token_nll(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed next-token NLL over completion tokens, and their count (divide by the *whole* batch's count
    so gradient accumulation gives exactly the full-batch token-mean loss)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    target = batch["labels"][:, 1:]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return loss, int((target != IGNORE).sum())


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float, warmup: int, total: int
                   ) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    return opt, get_cosine_schedule_with_warmup(opt, warmup, total)


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(s: dict[str, Any]) -> None:
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    random.setstate(s["python"])


def save_resumable(ckpt_dir: Path, step: int, state: dict[str, Any], keep: int = 2) -> Path:
    """Write ``step_<N>.pt`` atomically, then prune all but the newest ``keep``."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step_{step:07d}.pt"
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(ckpt_dir.glob("step_*.pt"))[:-keep]:
        old.unlink()
    return path


def load_resumable(ckpt_dir: Path, fp: str) -> dict[str, Any] | None:
    """The newest checkpoint whose fingerprint is ``fp``; stale ones (other fingerprint) are removed."""
    if not ckpt_dir.is_dir():
        return None
    for path in sorted(ckpt_dir.glob("step_*.pt"), reverse=True):
        state = torch.load(path, weights_only=False)
        if state.get("fingerprint") == fp:
            return state
        log.warning("discarding checkpoints in %s: they belong to another configuration (fingerprint %s, this "
                    "run %s)", ckpt_dir, state.get("fingerprint"), fp)
        shutil.rmtree(ckpt_dir)  # a different run's checkpoints: never resume from them
        return None
    return None
