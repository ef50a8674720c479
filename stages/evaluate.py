"""evaluate: one model (``evaluate@<name>``, a DVC foreach stage over ``evaluate.models``) on the held-out split
and any benchmark sets. The ``report`` stage puts every model side by side.

One stage per model, so an experiment that changes one model's inputs (say RL params) re-evaluates that model
alone; the others stay cached.

Inputs: ``paths.curated_dir/eval.parquet``; the checkpoint ``evaluate.models[<name>]``; benchmark files/hub
sets in ``evaluate.benchmarks`` (GSM8K / MATH formats, scored with math-verify; HumanEval, format ``humaneval``,
scored by running its tests in the sandbox: pass@k on code).
Outputs: ``paths.eval_report_dir/models/<name>/``: ``summary.json`` (``{split: {greedy, pass@k, maj@k, ...}}``),
``per_problem.json`` (``{split: {problem id: metrics}}``, what the report's paired differences resample) and
``generations.parquet`` (every completion with its extracted answer and verdict, for audit);
``metrics/evaluate/<name>.json`` (the summary, for ``dvc metrics show``/``diff``).
With ``tools.enabled`` completions are generated through the multi-turn tool loop (``posttrain.tools``: the
completion is the whole transcript, observations included; docs/tools.md; the verdict and the lengths read
the model's turns alone), and each split also reports
``tool_rate`` (the share of sampled completions with at least one tool call), ``tool_calls`` (calls per sampled
completion) and ``greedy_tool_calls``.

Per split: greedy accuracy (Wilson interval); ``samples_per_prompt`` samples per prompt at ``evaluate.sampling``
give sampled pass@1 (mean over samples), unbiased pass@k, maj@k (mean majority-vote correctness over the
disjoint blocks of k samples), mean completion length, the share cut at ``max_new_tokens`` and ``guarded``, the
share of completions (greedy and sampled) a verifier guard refused before any equivalence check (several
different answers, a hedge, ...: how often a model's format, not its maths, cost it reward). Intervals:
bootstrap over problems, Wilson where every problem is decided (``metrics.rate_ci``).
A problem whose gold answer cannot be parsed is unscorable: counted, and left out
of every denominator (never counted correct).

Memory: ``generations.parquet`` is written split by split (``schema.parquet_sink``), so only one split's
completions are alive at a time; a split is generated in one backend call (the backends seed by position in the
call: splitting it would change the samples, and the metrics).

Run: ``dvc repro evaluate@sft`` (or ``dvc repro report`` for all) or
``python -m stages.evaluate --model sft [--params params.yaml]``.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from posttrain import metrics as M
from posttrain import modeling
from posttrain.config import MathTask, Params, Validation
from posttrain.outputs import as_one_set
from posttrain.rollout import BACKENDS, Completion, ModelFolder, SamplingParams, chat_prompt_ids, generator
from posttrain.runfacts import write_metrics
from posttrain.runner import model_arg, stage_main
from posttrain.schema import BATCH_ROWS, GENERATION_SCHEMA, Problem, parquet_sink, read_problems, write_json
from posttrain.sources import check_usable, problems_from
from posttrain.tasks import get_task, verify_all
from posttrain.tools import with_tools
from stages.layout import NEEDS
from stages.layout import evaluate as paths

log = logging.getLogger("evaluate")


def score_problem(p: Problem, greedy: Completion, samples: list[Completion], ks: list[int],
                  oks: list[bool | None] | None = None
                  ) -> tuple[dict[str, Any] | None, list[tuple[str | None, bool | None]]]:
    """Per-problem metrics (None when unscorable) and (extracted, correct) of greedy + each sample.
    With no samples (outside ``sample_prompts``) only the greedy metrics are returned. ``oks``: the verdicts of
    greedy + each sample when already known (``verify_all`` of a whole split: code runs many at once)."""
    task, texts = get_task(p["task"]), [c.scored_text for c in [greedy, *samples]]  # observations left out
    if oks is None:
        oks = task.verify([(p["prompt"], p["answer"], t) for t in texts])
    verdicts = [(task.extract(t), ok) for t, ok in zip(texts, oks, strict=True)]
    if verdicts[0][1] is None:
        return None, verdicts
    tools = greedy.tool_calls is not None  # a multi-turn tool rollout: how often and how much it called
    guarded = float(np.mean([task.guard(t) is not None for t in texts]))  # refused before any equivalence check
    if not samples:
        row = {"greedy": float(bool(verdicts[0][1])), "greedy_len": float(greedy.model_tokens),
               "guarded": guarded}
        return row | ({"greedy_tool_calls": float(greedy.tool_calls or 0)} if tools else {}), verdicts
    s = verdicts[1:]
    c = sum(bool(v) for _, v in s)
    row = {"greedy": float(bool(verdicts[0][1])), "pass@1": c / len(s)}
    for k in ks:
        row[f"pass@{k}"] = M.pass_at_k(len(s), c, k)
        row[f"maj@{k}"] = M.maj_at_k([a for a, _ in s], [v for _, v in s], k)
    row["len"] = float(np.mean([x.model_tokens for x in samples]))
    row["greedy_len"] = float(greedy.model_tokens)
    row["truncated"] = float(np.mean([x.finish_reason == "length" for x in samples]))
    row["guarded"] = guarded
    if tools:  # tool_rate: the share of samples with >= 1 call; tool_calls: calls per sample (greedy: its own)
        row["tool_rate"] = float(np.mean([(x.tool_calls or 0) > 0 for x in samples]))
        row["tool_calls"] = float(np.mean([x.tool_calls or 0 for x in samples]))
        row["greedy_tool_calls"] = float(greedy.tool_calls or 0)
    return row, verdicts


PROPORTIONS = {"greedy"}  # one 0/1 outcome per problem: Wilson interval; means of per-problem values: bootstrap


def summarize(rows: list[dict[str, Any]], n_unscorable: int, n_boot: int, seed: int) -> dict[str, Any]:
    """Means of each per-problem metric over the problems that have it, with 95% intervals: Wilson for the
    greedy accuracy (a proportion), percentile bootstrap over problems for pass@k, maj@k (per-problem means; Wilson
    where every problem is at 0 or at 1: ``metrics.rate_ci``)."""
    out: dict[str, Any] = {"n": len(rows), "n_sampled": sum("pass@1" in r for r in rows), "unscorable": n_unscorable}
    if not rows:
        return out
    keys = list(dict.fromkeys(k for r in rows for k in r))
    for key in keys:
        vals = [r[key] for r in rows if key in r]
        out[key] = round(float(np.mean(vals)), 4)
        if key in PROPORTIONS:
            out[f"{key}_ci"] = [round(x, 4) for x in M.wilson_ci(int(sum(vals)), len(vals))]
        elif key not in M.NO_INTERVAL:
            out[f"{key}_ci"] = [round(x, 4) for x in M.rate_ci(vals, n_boot, seed)]
    return out


def run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    """Evaluate one model. ``inputs``: eval (eval.parquet), name, model (checkpoint path or hub id). ``out``:
    dir (summary.json, per_problem.json, generations.parquet), metrics. Returns ``{split: summary}``."""
    with as_one_set(out, f"evaluate@{inputs['name']}"):  # a kill leaves the old set of outputs or the new one
        return _run(params, inputs, out)


def _run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    cfg, name = params.evaluate, inputs["name"]
    torch.set_num_threads(params.runtime.generate_threads)
    device = modeling.resolve_device(params.runtime.device)
    splits: dict[str, list[Problem]] = {"eval": read_problems(inputs["eval"], cfg.limit)}
    for b in cfg.benchmarks:
        probs, bad = problems_from(b, MathTask(), params.seed, Validation())
        check_usable(b, len(probs), [x["reason"] for x in bad], cfg.max_unusable_frac, "evaluate.max_unusable_frac")
        splits[b.name] = probs[: cfg.limit]
        if bad:
            log.warning("%s: %d rows unusable (first: %s)", b.name, len(bad), bad[0]["reason"])

    greedy_sp = SamplingParams(0.0, 1.0, cfg.sampling.max_new_tokens, params.seed)
    sample_sp = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_new_tokens,
                               params.seed)
    results: dict[str, dict[str, Any]] = {}
    per_problem: dict[str, dict[str, dict[str, Any]]] = {s: {} for s in splits}  # split -> problem id -> metrics
    tok = modeling.load_tokenizer(str(inputs["model"]))
    model = ModelFolder(str(inputs["model"]), params.model.dtype, device)  # each backend loads it its own way
    backend = with_tools(BACKENDS[cfg.backend](model, tok, cfg.generate_batch_size, params.vllm_options()), tok,
                         params.tools, params.sandbox)  # multi-turn when tools.enabled
    with parquet_sink(out["dir"] / "generations.parquet", GENERATION_SCHEMA) as write:
        for split, probs in tqdm(splits.items(), desc=f"evaluate {name}", disable=not params.runtime.progress):
            t0 = time.time()
            ids = chat_prompt_ids(tok, [p["prompt"] for p in probs])
            greedy = backend.generate(ids, 1, greedy_sp)
            n_s = len(ids) if cfg.sample_prompts is None else min(cfg.sample_prompts, len(ids))
            samples = backend.generate(ids[:n_s], cfg.samples_per_prompt, sample_sp) + [[]] * (len(ids) - n_s)
            per, unscorable, gen_rows = [], 0, []
            oks = iter(verify_all([(p["task"], p["prompt"], p["answer"], c.scored_text)
                                   for p, g, ss in zip(probs, greedy, samples, strict=True) for c in [g[0], *ss]]))
            for p, g, ss in zip(probs, greedy, samples, strict=True):
                row, verdicts = score_problem(p, g[0], ss, cfg.ks, [next(oks) for _ in range(1 + len(ss))])
                if row is None:
                    unscorable += 1
                else:
                    per.append(row)
                    per_problem[split][p["id"]] = row
                for j, (c, (ext, ok)) in enumerate(zip([g[0], *ss], verdicts, strict=True)):
                    gen_rows.append({"model": name, "split": split, "id": p["id"], "mode": "greedy" if j == 0
                                     else "sample", "sample": max(j - 1, 0), "completion": c.text,
                                     "num_tokens": c.model_tokens, "finish_reason": c.finish_reason,
                                     "extracted": ext, "correct": ok})
            for i in range(0, len(gen_rows), BATCH_ROWS):  # this split's completions, then they are dropped
                write(gen_rows[i : i + BATCH_ROWS])
            results[split] = summarize(per, unscorable, cfg.bootstrap, params.seed)
            results[split]["seconds"] = round(time.time() - t0, 1)
            results[split]["generator"] = generator(cfg.backend)
            r = results[split]
            log.info("%s/%s: greedy %.3f pass@1 %.3f (n=%d, %.1fs)", name, split, r.get("greedy", float("nan")),
                     r.get("pass@1", float("nan")), r["n"], r["seconds"])
    write_json(out["dir"] / "per_problem.json", per_problem)
    write_json(out["dir"] / "summary.json", results)
    write_metrics(out["metrics"], results)
    return results


def main() -> None:
    model, argv = model_arg(sys.argv[1:])
    stage_main(f"evaluate@{model}", lambda p: run(p, *paths(p, model)), argv,
               needs=lambda p: NEEDS["evaluate"](p, model))


if __name__ == "__main__":
    main()
