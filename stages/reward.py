"""reward: label rollouts with the configured rewards; per-prompt pass rates; a reward audit.

Inputs: ``paths.rollout_dir/rollouts.parquet`` (only the columns scoring reads, a record batch at a time);
``reward.rewards`` (nested specs, REWARDS registry).
Outputs: ``paths.reward_dir/rewards.parquet`` (``schema.REWARD_SCHEMA``: the reward columns only, keyed by
(prompt_id, sample) of the rollouts: ``reward``, null when unscorable, and each component as JSON; join the
rollouts for completions, tokens or, under ``rollout.keep_tokens``, log-probs: ``schema.join_rollouts``),
``paths.reward_dir/pass_rates.parquet`` (per prompt: samples, scorable, correct,
pass rate, mean reward: what ``rl`` selects its prompts from), ``paths.reward_report_dir/audit.{json,md}``
(reward distribution, unscorable share, per-component means, pass-rate histogram, example completions per
reward bucket; per learned reward (``reward_model``, ``llm_judge``, or a plug-in marked ``learned``): its agreement
with the verifier, score quantiles, the top completions it scores highest that the verifier rejects, and
``learned_scores.png``: :mod:`posttrain.rewards.audit_learned`) and ``metrics/reward.json``; ``paths.judge_cache``,
the ``llm_judge`` call cache (kept between runs: the judgements already paid for are not asked again; written
even when no judge is configured, as DVC wants its outs). With ``judge.serve`` the stage serves that folder
(``posttrain.judge.session``) while it scores; the judge's requests, cache hit rate and malformed-verdict rate go
to the audit and the metrics (``judge_*``). Fails (after writing everything) when the unscorable share exceeds
``reward.max_unscorable_frac``.

Streaming: rollouts are read in record batches (``schema.BATCH_ROWS`` rows), each batch scored by one
``score_rows`` call and its reward columns written at once (``ParquetWriter``); a prompt's pass rate is written
when its group of samples ends (the rollout stage writes each prompt's samples together: a prompt met twice is
an error). Memory: one batch of rows, the audit's counters, examples and running means, and the prompt ids
seen (an 8-byte hash a prompt: to refuse a prompt met twice).

Run: ``dvc repro reward`` or ``python -m stages.reward [--params params.yaml]``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from posttrain import plots
from posttrain.config import Params
from posttrain.errors import StageError
from posttrain.judge import session as judge
from posttrain.outputs import as_one_set
from posttrain.rewards import ERROR_KEY, WHY_KEY, RewardPool, is_learned, pass_rates, score_rows
from posttrain.rewards.audit_learned import Learned
from posttrain.rewards.audit_learned import markdown as learned_markdown
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.schema import (
    BATCH_ROWS,
    PASS_RATE_SCHEMA,
    REWARD_SCHEMA,
    iter_rows,
    parquet_file,
    parquet_sink,
    write_json,
    write_text,
)
from posttrain.tasks import get_task
from stages.layout import NEEDS
from stages.layout import reward as paths

log = logging.getLogger("reward")


class Audit:
    """The reward audit, accumulated a batch of scored rows (``add``) and a batch of pass rates (``add_rates``)
    at a time; ``result()`` is the JSON behind audit.md. Holds counters, the first examples per bucket and running
    means (:class:`Mean`): never the rows, nor a number per sample or prompt."""

    def __init__(self, n_examples: int, learned: Sequence[str] = ()) -> None:
        self.n_examples, self.samples, self.n_prompts = n_examples, 0, 0
        self.learned = {name: Learned(name, n_examples) for name in learned}  # learned rewards: their own section
        self.scorable = Mean()
        self.buckets: Counter[str] = Counter()
        self.guards: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()  # why samples could not be scored (timeout, dead worker, raised)
        self.why: Counter[str] = Counter()  # why a reward gave less than full marks, where it says (code_tests)
        self.comps: dict[str, Mean] = {}
        self.examples: dict[str, list[dict[str, str]]] = {}
        self.rates = Mean()
        self.never = self.always = 0
        self.hist: Counter[str] = Counter()

    def add(self, scored: Sequence[dict[str, Any]]) -> None:
        rewards = [r["reward"] for r in scored]
        self.samples += len(rewards)
        self.scorable.add([x for x in rewards if x is not None])
        self.buckets.update("unscorable" if x is None else f"{x:.2f}" for x in rewards)
        comps: dict[str, list[float]] = {}
        for r in scored:
            parts = json.loads(r["rewards"])
            if (e := parts.pop(ERROR_KEY, None)) is not None:
                self.errors[e] += 1
            self.why.update(f"{k}: {w}" for k, w in parts.pop(WHY_KEY, {}).items())
            for k, v in parts.items():
                if v is not None:
                    comps.setdefault(k, []).append(v)
        for k, v in comps.items():
            self.comps.setdefault(k, Mean()).add(v)
        for r in scored:
            key = "unscorable" if r["reward"] is None else f"{r['reward']:.2f}"
            if len(self.examples.setdefault(key, [])) < self.n_examples:
                self.examples[key].append({"prompt_id": r["prompt_id"], "prompt": r["prompt"], "answer": r["answer"],
                                           "completion": r["completion"], "rewards": r["rewards"]})
        for learned in self.learned.values():
            learned.add(scored)
        # the verifiers' guards: completions refused before any equivalence check (hedges, several answers, ...)
        self.guards.update(g for r in scored if (g := get_task(r["task"]).guard(r["completion"])) is not None)

    def add_group(self, group: Sequence[dict[str, Any]]) -> None:
        """Whole prompt groups (rows with ``prompt_id`` and ``rewards``): the learned rewards' within-prompt pairs."""
        for learned in self.learned.values():
            start = 0
            for i in range(1, len(group) + 1):
                if i == len(group) or group[i]["prompt_id"] != group[start]["prompt_id"]:
                    learned.add_group(group[start:i])
                    start = i

    def add_rates(self, rates: Sequence[dict[str, Any]]) -> None:
        self.n_prompts += len(rates)
        pr = [x["pass_rate"] for x in rates if x["pass_rate"] is not None]
        self.rates.add(pr)
        self.never += sum(x == 0 for x in pr)
        self.always += sum(x == 1 for x in pr)
        self.hist.update(f"{x:.3f}" for x in pr)

    def result(self) -> dict[str, Any]:
        return {
            "samples": self.samples, "unscorable": self.samples - self.scorable.n,
            "unscorable_frac": (self.samples - self.scorable.n) / max(self.samples, 1),
            "reward_mean": self.scorable.mean(),
            "reward_buckets": dict(sorted(self.buckets.items())),
            "component_means": {k: v.mean() for k, v in self.comps.items()},
            "prompts": self.n_prompts, "pass_rate_mean": self.rates.mean(),
            "pass_rate_histogram": dict(sorted(self.hist.items())),
            "never_solved": self.never, "always_solved": self.always,
            "guards": dict(sorted(self.guards.items())), "examples": self.examples,
            **({"errors": dict(sorted(self.errors.items()))} if self.errors else {}),  # (absent when none)
            **({"why": dict(self.why.most_common())} if self.why else {}),
            **({"learned": {k: v.result() for k, v in self.learned.items()}} if self.learned else {}),
        }


class Mean:
    """A running mean: the count and ``math.fsum`` of each batch with the carried total (within an ulp a batch of
    the exact sum), so the audit holds two numbers per statistic, never one per sample."""

    def __init__(self) -> None:
        self.n, self.total = 0, 0.0

    def add(self, xs: Sequence[float]) -> None:
        self.n += len(xs)
        self.total = math.fsum([self.total, *xs])

    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


def audit(scored: list[dict[str, Any]], rates: list[dict[str, Any]], n_examples: int) -> dict[str, Any]:
    """The audit of whole lists of scored rows and pass rates (one batch of each)."""
    a = Audit(n_examples)
    a.add(scored)
    a.add_rates(rates)
    return a.result()


def audit_markdown(a: dict[str, Any]) -> str:
    lines = ["# Reward audit", "",
             f"{a['samples']} samples over {a['prompts']} prompts; unscorable {a['unscorable']} "
             f"({100 * a['unscorable_frac']:.2f}%); mean reward {a['reward_mean']}; mean pass rate "
             f"{a['pass_rate_mean']}; never solved {a['never_solved']}, always solved {a['always_solved']}.", "",
             "The reward is the weighted sum of its components (weight 0: logged, not rewarded):", "",
             "| component | weight | mean | weight x mean |", "|---|---:|---:|---:|"]
    w = a.get("component_weights", {})
    lines += [f"| {k} | {w[k]:g} | {v:.4f} | {w[k] * v:.4f} |" if k in w and v is not None else f"| {k} | — | {v} | — |"
              for k, v in a["component_means"].items()]
    lines += ["", "Verifier guards (completions refused before any equivalence check; they earn nothing):", "",
              "| guard | samples |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in a["guards"].items()]
    if "errors" in a:
        lines += ["", "Unscorable because scoring failed (timeout, dead worker, a reward that raised or returned "
                  "no number):", "", "| error | samples |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in a["errors"].items()]
    if "why" in a:
        lines += ["", "Why rewards gave less than full marks (where a reward says: `code_tests` runs the tests):", "",
                  "| reward: why | samples |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in a["why"].items()]
    if "judge" in a:
        j = a["judge"]
        lines += ["", f"llm_judge: {j['judge_requests']} requests, cache hit rate {j['judge_hit_rate']}, malformed "
                  f"verdicts {j['judge_malformed']} (rate {j['judge_malformed_rate']}), failed {j['judge_failed']}, "
                  f"over the judge's context {j.get('judge_overlong', 0)}, "
                  f"{j['judge_new']} new cache entries; server start {j['judge_server_startup_s']} s."]
    lines += ["", "| reward | samples |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in a["reward_buckets"].items()]
    lines += ["", "| pass rate | prompts |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in a["pass_rate_histogram"].items()]
    lines += learned_markdown(a.get("learned", {}))
    for bucket, exs in a["examples"].items():
        lines += ["", f"## reward {bucket}", ""]
        for e in exs:
            comp = e["completion"].replace("`", "'")
            lines.append(f"- `{e['prompt_id']}` gold `{e['answer']}` {e['rewards']}: `{e['prompt']}` → `{comp}`")
    return "\n".join(lines) + "\n"


READ = ("prompt_id", "sample", "prompt", "answer", "task", "completion", "max_new_tokens", "finish_reason",
        "num_tokens")  # what scoring and the audit read of rollouts.parquet (not the token ids or log-probs)
# (and ``tool_calls``, ``model_text``, ``model_tokens`` where the rollouts have them: tools.enabled; what
# ``tool_cost`` reads and what a reward scores of a multi-turn completion)


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Score. ``inputs``: rollouts. ``out``: rewards, pass_rates, report_dir, metrics."""
    # a kill: the old set of outputs or the new one (the judge cache is merged at once: paid judgements are kept)
    with as_one_set(out, "reward", at_once=("report_dir", "judge_cache")):
        return _run(params, inputs, out)


def score_batches(rollouts: Path, specs: Sequence[Any], batch_rows: int, pool: RewardPool | None = None
                  ) -> Iterator[list[dict[str, Any]]]:
    """The rollouts' rows (``READ`` columns) with ``reward`` and ``rewards``, a record batch at a time: one
    ``score_rows`` call per batch, scored in ``pool`` (None: in this thread)."""
    names = parquet_file(rollouts).schema_arrow.names
    tools = tuple(c for c in ("tool_calls", "model_text", "model_tokens") if c in names)  # multi-turn rows
    for rows in iter_rows(rollouts, READ + tools, batch_rows):
        yield score_rows(rows, specs, pool)


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    cfg = params.reward
    a = Audit(cfg.audit_examples, [s.name for s in cfg.rewards if is_learned(s.name)])
    carry: list[dict[str, Any]] = []  # the samples of the last prompt seen: its group may go on in the next batch
    seen: list[np.ndarray] = []  # hashes of the prompt ids with a pass rate (8 bytes each): groups are whole
    pending: list[dict[str, Any]] = []  # pass rates not written yet
    with parquet_sink(out["rewards"], REWARD_SCHEMA) as write, \
            parquet_sink(out["pass_rates"], PASS_RATE_SCHEMA) as write_rates, \
            judge.for_stage(params.judge, out["judge_cache"]) as js, \
            RewardPool.of(cfg) as pool:
        for scored in score_batches(inputs["rollouts"], cfg.rewards, BATCH_ROWS, pool):
            write([{k: r[k] for k in REWARD_SCHEMA.names} for r in scored])
            a.add(scored)
            group = carry + [{k: r[k] for k in ("prompt_id", "reward", "rewards")} for r in scored]
            cut = len(group)
            while cut and group[cut - 1]["prompt_id"] == group[-1]["prompt_id"]:
                cut -= 1
            done, carry = group[:cut], group[cut:]
            pending += _rates(done, a, seen)
            while len(pending) >= BATCH_ROWS:  # row groups of BATCH_ROWS prompts (one for a small run, as before)
                write_rates(pending[:BATCH_ROWS])
                pending = pending[BATCH_ROWS:]
        pending += _rates(carry, a, seen)
        if pending:
            write_rates(pending)
    ids = np.concatenate([np.zeros(0, dtype=np.uint64), *seen])
    ids.sort()  # in place (np.unique's peak was ~8x the array: +180 MiB at 3,000,000 prompts)
    if np.any(ids[1:] == ids[:-1]):  # (a 64-bit hash: two prompts colliding is a ~1e-8 chance at 10^6)
        raise StageError(f"{inputs['rollouts']}: a prompt's samples are not contiguous (the rollout stage writes "
                         "each prompt's samples together; was the file written by another tool?)")
    res = a.result() | {"component_weights": {s.name: s.weight for s in cfg.rewards}}
    judged = any(s.name == "llm_judge" for s in cfg.rewards)
    if judged:  # (absent otherwise: the default audit and metrics are unchanged)
        res["judge"] = judge.metrics(js)
    write_json(out["report_dir"] / "audit.json", res)
    write_text(out["report_dir"] / "audit.md", audit_markdown(res))
    if a.learned:
        plots.learned_scores({k: v.by_verdict() for k, v in a.learned.items()},
                             out["report_dir"] / "learned_scores.png")
    metrics = {k: res[k] for k in ("samples", "unscorable", "unscorable_frac", "reward_mean", "prompts",
                                   "pass_rate_mean", "never_solved", "always_solved")}
    metrics |= res.get("judge", {})
    write_metrics(out["metrics"], metrics)
    log.info("mean reward %s, mean pass rate %s, unscorable %d", res["reward_mean"], res["pass_rate_mean"],
             res["unscorable"])
    if res["unscorable_frac"] > cfg.max_unscorable_frac:
        raise StageError(f"unscorable share {res['unscorable_frac']:.3f} > reward.max_unscorable_frac="
                         f"{cfg.max_unscorable_frac} (see {out['report_dir'] / 'audit.md'})")
    return metrics


def _rates(group: list[dict[str, Any]], a: Audit, seen: list[np.ndarray]) -> list[dict[str, Any]]:
    """The pass rates of whole groups of samples, added to the audit."""
    rates = pass_rates(group)
    a.add_rates(rates)
    a.add_group(group)
    seen.append(np.array([int.from_bytes(hashlib.blake2b(r["prompt_id"].encode(), digest_size=8).digest(), "little")
                          for r in rates], dtype=np.uint64))
    return rates


def main() -> None:
    stage_main("reward", lambda p: run(p, *paths(p)), needs=lambda p: NEEDS["reward"](p, None))


if __name__ == "__main__":
    main()
