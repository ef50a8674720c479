"""reward: label rollouts with the configured rewards; per-prompt pass rates; a reward audit.

Inputs: ``paths.rollout_dir/rollouts.parquet``; ``reward.rewards`` (nested specs, REWARDS registry).
Outputs: ``paths.reward_dir/scored.parquet`` (rollouts + ``reward``, null when unscorable, and each
component as JSON), ``paths.reward_dir/pass_rates.parquet`` (per prompt: samples, scorable, correct,
pass rate, mean reward: what ``rl`` selects its prompts from), ``paths.reward_report_dir/audit.{json,md}``
(reward distribution, unscorable share, per-component means, pass-rate histogram, example completions per
reward bucket) and ``metrics/reward.json``. Fails (after writing everything) when the unscorable share
exceeds ``reward.max_unscorable_frac``.

Run: ``dvc repro reward`` or ``python -m stages.reward [--params params.yaml]``.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.config import Params
from posttrain.errors import StageError
from posttrain.outputs import as_one_set
from posttrain.rewards import ERROR_KEY, RewardPool, pass_rates, score_rows
from posttrain.runner import stage_main
from posttrain.schema import PASS_RATE_SCHEMA, SCORED_SCHEMA, read_parquet, write_json, write_parquet, write_text
from posttrain.tasks import get_task

log = logging.getLogger("reward")


def audit(scored: list[dict[str, Any]], rates: list[dict[str, Any]], n_examples: int) -> dict[str, Any]:
    """Distribution and examples of the rewards (the JSON behind audit.md)."""
    rewards = [r["reward"] for r in scored]
    scorable = [x for x in rewards if x is not None]
    buckets = Counter("unscorable" if x is None else f"{x:.2f}" for x in rewards)
    comps: dict[str, list[float]] = {}
    for r in scored:
        for k, v in json.loads(r["rewards"]).items():
            if v is not None and k != ERROR_KEY:
                comps.setdefault(k, []).append(v)
    examples: dict[str, list[dict[str, str]]] = {}
    for r in scored:
        key = "unscorable" if r["reward"] is None else f"{r['reward']:.2f}"
        if len(examples.setdefault(key, [])) < n_examples:
            examples[key].append({"prompt_id": r["prompt_id"], "prompt": r["prompt"], "answer": r["answer"],
                                  "completion": r["completion"], "rewards": r["rewards"]})
    pr = [x["pass_rate"] for x in rates if x["pass_rate"] is not None]
    hist = Counter(f"{x:.3f}" for x in pr)
    # the verifiers' guards: completions refused before any equivalence check (hedges, several answers, ...)
    # samples a reward function, a timeout or a dead worker could not score (the error's reason: never a reward)
    errors = Counter(e for r in scored if (e := json.loads(r["rewards"]).get(ERROR_KEY)) is not None)
    guards = Counter(g for r in scored if (g := get_task(r["task"]).guard(r["completion"])) is not None)
    return {
        "samples": len(rewards), "unscorable": len(rewards) - len(scorable),
        "unscorable_frac": (len(rewards) - len(scorable)) / max(len(rewards), 1),
        "reward_mean": float(np.mean(scorable)) if scorable else None,
        "reward_buckets": dict(sorted(buckets.items())),
        "component_means": {k: float(np.mean(v)) for k, v in comps.items()},
        "prompts": len(rates), "pass_rate_mean": float(np.mean(pr)) if pr else None,
        "pass_rate_histogram": dict(sorted(hist.items())),
        "never_solved": sum(x == 0 for x in pr), "always_solved": sum(x == 1 for x in pr),
        "guards": dict(sorted(guards.items())), "examples": examples,
        **({"errors": dict(sorted(errors.items()))} if errors else {}),  # (absent when none: outputs unchanged)
    }


def audit_markdown(a: dict[str, Any]) -> str:
    lines = ["# Reward audit", "",
             f"{a['samples']} samples over {a['prompts']} prompts; unscorable {a['unscorable']} "
             f"({100 * a['unscorable_frac']:.2f}%); mean reward {a['reward_mean']}; mean pass rate "
             f"{a['pass_rate_mean']}; never solved {a['never_solved']}, always solved {a['always_solved']}.", "",
             "| component | mean |", "|---|---:|"]
    lines += [f"| {k} | {v:.4f} |" for k, v in a["component_means"].items()]
    lines += ["", "Verifier guards (completions refused before any equivalence check; they earn nothing):", "",
              "| guard | samples |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in a["guards"].items()]
    if "errors" in a:
        lines += ["", "Unscorable because scoring failed (timeout, dead worker, a reward that raised or returned "
                  "no number):", "", "| error | samples |", "|---|---:|"]
        lines += [f"| {k} | {v} |" for k, v in a["errors"].items()]
    lines += ["", "| reward | samples |", "|---|---:|"] + [f"| {k} | {v} |" for k, v in a["reward_buckets"].items()]
    lines += ["", "| pass rate | prompts |", "|---|---:|"]
    lines += [f"| {k} | {v} |" for k, v in a["pass_rate_histogram"].items()]
    for bucket, exs in a["examples"].items():
        lines += ["", f"## reward {bucket}", ""]
        for e in exs:
            comp = e["completion"].replace("`", "'")
            lines.append(f"- `{e['prompt_id']}` gold `{e['answer']}` {e['rewards']}: `{e['prompt']}` → `{comp}`")
    return "\n".join(lines) + "\n"


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Score. ``inputs``: rollouts. ``out``: scored, pass_rates, report_dir, metrics."""
    with as_one_set(out, "reward", at_once=("report_dir",)):  # a kill: the old set of outputs or the new one
        return _run(params, inputs, out)


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    cfg = params.reward
    with RewardPool(cfg.workers, cfg.timeout_s) as pool:
        scored = score_rows(read_parquet(inputs["rollouts"]), cfg.rewards, pool)
    rates = pass_rates(scored)
    a = audit(scored, rates, cfg.audit_examples)
    write_parquet(out["scored"], scored, SCORED_SCHEMA)
    write_parquet(out["pass_rates"], rates, PASS_RATE_SCHEMA)
    write_json(out["report_dir"] / "audit.json", a)
    write_text(out["report_dir"] / "audit.md", audit_markdown(a))
    metrics = {k: a[k] for k in ("samples", "unscorable", "unscorable_frac", "reward_mean", "prompts",
                                 "pass_rate_mean", "never_solved", "always_solved")}
    write_json(out["metrics"], metrics)
    log.info("mean reward %s, mean pass rate %s, unscorable %d", a["reward_mean"], a["pass_rate_mean"],
             a["unscorable"])
    if a["unscorable_frac"] > cfg.max_unscorable_frac:
        raise StageError(f"unscorable share {a['unscorable_frac']:.3f} > reward.max_unscorable_frac="
                         f"{cfg.max_unscorable_frac} (see {out['report_dir'] / 'audit.md'})")
    return metrics


def paths(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    """This stage's inputs and outputs, from ``params.paths`` (used by ``main`` and by tests)."""
    P = p.paths
    return {"rollouts": Path(P.rollout_dir) / "rollouts.parquet"}, {
        "scored": Path(P.reward_dir) / "scored.parquet", "pass_rates": Path(P.reward_dir) / "pass_rates.parquet",
        "report_dir": Path(P.reward_report_dir), "metrics": Path(P.metrics_dir) / "reward.json"}


def main() -> None:
    stage_main("reward", lambda p: run(p, *paths(p)))


if __name__ == "__main__":
    main()
