"""``reward_model``: a learned reward, the ``reward_model`` stage's artifact (one member or an ensemble) scoring a
batch of completions in one go; registered in ``REWARDS`` (``posttrain.rewards.builtin``).

The batch's texts (each completion, or each of its step prefixes) are scored by one ``RewardScorer`` call, which
runs ``batch_size`` texts a forward per member; the members' scores are combined per text (``mean``, ``wco``,
``uwo``: :mod:`posttrain.rewards.ensemble`), then per completion over its steps (``steps``: off, or raw / clip /
delta). A completion longer than the reward model's context is unscorable (None), never truncated into a score
of a text the model did not see, nor a free reward.

The model is loaded once per process and kept, keyed by its folder and a digest of its files' bytes
(``posttrain.digests``: recomputed only when a file changed, so a retrained model at the same path is
reloaded); torch and transformers are imported on first use, so the reward pool's forkserver and the config never
import them (and ``posttrain.reward_model`` is no import of this module's: see docs/reward_model.md on DVC deps).

Statistics: each call logs, on the ``reward`` logger, the batch's raw member-score mean and std, the mean
spread between members (their std) and the unscorable count; the reward stage's audit reports the learned
component's distribution (quantiles, a histogram plot) over the run.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.digests import folder_digest
from posttrain.errors import StageError
from posttrain.rewards.ensemble import COMBINES, STEP_TRANSFORMS, step_ends
from posttrain.rewards.sample import Sample

log = logging.getLogger("reward")
MANIFEST = "manifest.json"  # (posttrain.reward_model.scorer.MANIFEST: named here to stay torch-free)
_LOADED: dict[tuple[str, str, str, str], Any] = {}  # (folder, digest, device, dtype) -> its RewardScorer


def rank_device(device: str) -> str:
    """``cuda`` under torchrun is the rank's own GPU (``cuda:<LOCAL_RANK>``: every rank's scorers on GPU 0
    would crowd one card); any other name as given."""
    local = os.environ.get("LOCAL_RANK")
    return f"cuda:{local}" if device == "cuda" and local is not None else device


def scorer_for(path: str, device: str = "cpu", dtype: str = "float32") -> Any:
    """The reward model at ``path`` in ``dtype`` on ``device`` (``rank_device``), loaded once per process (and
    again when its files change)."""
    folder = Path(path).resolve()
    if not (folder / MANIFEST).is_file():
        raise StageError(f"{path}: not a reward model (no {MANIFEST}); train it with the reward_model stage")
    device = rank_device(device)
    key = (str(folder), folder_digest(folder), device, dtype)
    if key not in _LOADED:
        from posttrain.reward_model.scorer import load_reward_model

        for old in [k for k in _LOADED if k[0] == key[0]]:  # an older version of the same folder
            del _LOADED[old]
        _LOADED[key] = load_reward_model(folder, device, dtype)
        log.info("reward_model: loaded %s (%d members, digest %s)", path, _LOADED[key].k, key[1][7:19])
    return _LOADED[key]


def reward_model(samples: Sequence[Sample], path: str, combine: str = "mean", lam: float = 0.5, steps: str = "off",
                 step_sep: str = "\n", eta: float = 0.0, batch_size: int = 64, device: str = "cpu",
                 dtype: str = "float32") -> list[float | None]:
    """A Bradley-Terry reward model's score of each (prompt, completion): its members combined by ``combine``
    (``mean``; ``wco``: the minimum; ``uwo``: mean - ``lam`` x variance; ``uwo_std``: mean - ``lam`` x std), of
    the whole completion (``steps: off``) or, per step (``step_sep``-separated; the summed step rewards of
    ``raw``, ``clip`` (``min(s - eta, 0)``) or ``delta``), of each prefix: a text's prefixes in one forward (the
    text once, an end-of-turn tail per step: tokens linear in the steps). None when the text is longer than the
    model's context. ``dtype``: the members' weights (float32, bfloat16, float16); ``device``: ``rank_device``."""
    from posttrain.reward_model.scorer import encode

    scorer = scorer_for(path, device, dtype)
    scorer.batch_size = batch_size
    texts: list[list[list[int]]] = []  # each scorable sample's prefixes (one: the whole text, steps off)
    spans: list[tuple[int, int] | None] = []  # each sample's rows of the scores; None: unscorable
    at = 0
    for s in samples:
        ends = [len(s.completion)] if steps == "off" else step_ends(s.completion, step_sep)
        ids = [encode(scorer.tok, s.prompt, s.completion[:e]) for e in ends]
        if scorer.context is not None and max(len(x) for x in ids) > scorer.context:
            spans.append(None)
            continue
        spans.append((at, at + len(ids)))
        texts.append(ids)
        at += len(ids)
    # [N, K]: a text's prefixes share one forward (scorer.score_prefixes: linear in its steps)
    member = np.concatenate(scorer.score_prefixes(texts)).astype(np.float64) if texts else np.zeros((0, scorer.k))
    combined = COMBINES[combine](member, lam)  # [N]
    out: list[float | None] = []
    for span in spans:
        if span is None:
            out.append(None)
        elif steps == "off":
            out.append(float(combined[span[0]]))
        else:
            out.append(float(STEP_TRANSFORMS[steps](combined[span[0]:span[1]], eta).sum()))
    if len(member):
        log.info("reward_model %s: %d texts of %d samples, raw score mean %.4f std %.4f, member spread %.4f, "
                 "unscorable %d", path, len(member), len(samples), member.mean(), member.std(),
                 member.std(axis=1).mean(), spans.count(None))
    return out


def _warm(path: str, device: str = "cpu", dtype: str = "float32", **_: Any) -> None:
    scorer_for(path, device, dtype)


reward_model.warm = _warm  # type: ignore[attr-defined]  # (scoring.warm: a pool worker loads it as it starts)
