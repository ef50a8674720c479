"""The reward audit's section on learned rewards (a ``reward_model`` component, or a plug-in whose function sets
``learned = True``): does the learned score agree with the verifier, how are its scores spread, and which
completions does it rank highest that the verifier rejects (the "hacks", where over-optimisation starts).

Per learned component, accumulated a batch of scored rows (``add``) and a whole prompt group (``add_group``) at a
time, in bounded memory:

- ``auc``: the probability that a verified-correct completion outscores a verified-incorrect one, over all of
  them (ties count half; the ROC AUC, the Mann-Whitney U over C x W, counted by binary search in O(n log n));
- ``pairwise_agreement``: the same within each prompt's group only (a correct and an incorrect completion of
  one prompt: what a Bradley-Terry RM was trained to order), and the number of such pairs;
- the score distribution: mean, std, quantiles (0, 5, 25, 50, 75, 95, 100 %) overall, mean by verdict, and a
  histogram per verdict (``posttrain.plots.learned_scores``);
- ``hacks``: the ``k`` highest-scored completions the verifier rejects (``is_correct`` is False).

Scores kept for the quantiles and the AUC: every one up to ``RESERVOIR`` samples, beyond that a uniform
reservoir sample of that many (Vitter's algorithm R, seeded: the same rows give the same audit); the pairwise
agreement and the hacks are exact at any size. Written by hand: a few counters over numpy, no library keeps this
particular mix of running statistics.
"""

from __future__ import annotations

import heapq
import json
import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from posttrain.rewards.scoring import is_correct

RESERVOIR = 100_000
QUANTILES = (0, 5, 25, 50, 75, 95, 100)


class Learned:
    """One learned component's running audit."""

    def __init__(self, name: str, k: int) -> None:
        self.name, self.k = name, k
        self.n = self.unscorable = 0
        self.kept: list[tuple[float, bool | None]] = []  # (score, verdict), the reservoir
        self.rng = random.Random(0)
        self.pairs = 0
        self.wins = 0.0  # within-prompt pairs ordered as the verifier orders them (ties: a half)
        self.hacks: list[tuple[float, int, dict[str, str]]] = []  # a min-heap of the k best-scored rejected ones
        self.seen = 0

    def add(self, rows: Sequence[dict[str, Any]]) -> None:
        for r in rows:
            v = json.loads(r["rewards"]).get(self.name)
            if v is None:
                self.unscorable += 1
                continue
            ok = is_correct(r["rewards"])
            self.n += 1
            if len(self.kept) < RESERVOIR:
                self.kept.append((v, ok))
            elif (j := self.rng.randrange(self.n)) < RESERVOIR:
                self.kept[j] = (v, ok)
            if ok is False and self.k:
                self.seen += 1
                item = (v, -self.seen, {"prompt_id": r["prompt_id"], "prompt": r["prompt"], "answer": r["answer"],
                                        "completion": r["completion"], "rewards": r["rewards"]})
                (heapq.heappush if len(self.hacks) < self.k else heapq.heappushpop)(self.hacks, item)

    def add_group(self, group: Sequence[dict[str, Any]]) -> None:
        """A whole prompt's samples: count its (correct, incorrect) pairs and how many the score orders right."""
        good, bad = [], []
        for r in group:
            v = json.loads(r["rewards"]).get(self.name)
            ok = is_correct(r["rewards"])
            if v is not None and ok is not None:
                (good if ok else bad).append(v)
        if good and bad:
            g, b = np.array(good)[:, None], np.array(bad)[None, :]  # [C, 1], [1, W]
            self.pairs += g.size * b.size
            self.wins += float((g > b).sum() + 0.5 * (g == b).sum())

    def result(self) -> dict[str, Any]:
        by = self.by_verdict()
        scores, good, bad = np.concatenate(list(by.values())), by["correct"], by["incorrect"]
        out: dict[str, Any] = {"scored": self.n, "unscorable": self.unscorable,
                               "mean": _r(scores.mean()) if len(scores) else None,
                               "std": _r(scores.std()) if len(scores) else None,
                               "quantiles": {f"p{q}": _r(np.percentile(scores, q)) for q in QUANTILES}
                               if len(scores) else {},
                               "mean_correct": _r(good.mean()) if len(good) else None,
                               "mean_incorrect": _r(bad.mean()) if len(bad) else None,
                               "verified": {"correct": len(good), "incorrect": len(bad)},
                               "auc": auc(good, bad),
                               "pairwise_agreement": _r(self.wins / self.pairs) if self.pairs else None,
                               "within_prompt_pairs": self.pairs,
                               "sampled": self.n > RESERVOIR}
        out["hacks"] = [{"score": _r(v), **row} for v, _, row in sorted(self.hacks, reverse=True)]
        return out

    def by_verdict(self) -> dict[str, np.ndarray]:
        """The kept scores by the verifier's verdict (correct / incorrect / unverified): the plot's data."""
        by: dict[str, list[float]] = {"correct": [], "incorrect": [], "unverified": []}
        for v, ok in self.kept:
            by["unverified" if ok is None else "correct" if ok else "incorrect"].append(v)
        return {k: np.array(v, dtype=np.float64) for k, v in by.items()}


def auc(good: np.ndarray, bad: np.ndarray) -> float | None:
    """P(a correct one outscores an incorrect one), ties a half: the Mann-Whitney U over C x W, divided by C x W."""
    if not len(good) or not len(bad):
        return None
    b = np.sort(bad)
    below, upto = np.searchsorted(b, good, "left"), np.searchsorted(b, good, "right")  # [C]: W below, W at or below
    return _r((below.sum() + 0.5 * (upto - below).sum()) / (len(good) * len(bad)))


def _r(x: float) -> float:
    return round(float(x), 6)


def markdown(learned: dict[str, dict[str, Any]]) -> list[str]:
    """audit.md's lines on the learned rewards (none when there are none)."""
    lines: list[str] = []
    for name, a in learned.items():
        q = a["quantiles"]
        lines += ["", f"## Learned reward `{name}`", "",
                  f"{a['scored']} scored, {a['unscorable']} unscorable; mean {a['mean']}, std {a['std']}; mean on "
                  f"verified-correct {a['mean_correct']} ({a['verified']['correct']}), on verified-incorrect "
                  f"{a['mean_incorrect']} ({a['verified']['incorrect']}).", "",
                  f"Agreement with the verifier: AUC {a['auc']} (a correct completion outscores an incorrect one); "
                  f"within a prompt {a['pairwise_agreement']} over {a['within_prompt_pairs']} pairs."
                  + (" (Distribution and AUC from a uniform sample of the scores.)" if a["sampled"] else ""), "",
                  "| " + " | ".join(q) + " |", "|" + "---:|" * len(q), "| " + " | ".join(str(v) for v in q.values())
                  + " |", "", f"Highest-scored completions the verifier rejects (hacks, top {len(a['hacks'])}):", ""]
        for h in a["hacks"]:
            comp = h["completion"].replace("`", "'")
            lines.append(f"- {h['score']} `{h['prompt_id']}` gold `{h['answer']}`: `{h['prompt']}` → `{comp}`")
    return lines
