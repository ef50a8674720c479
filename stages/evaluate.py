"""evaluate: every configured model, side by side, on the held-out split and any benchmark sets.

Inputs: ``paths.curated_dir/eval.parquet``; the checkpoints named in ``evaluate.models`` (name -> path);
benchmark files/hub sets in ``evaluate.benchmarks`` (GSM8K / MATH formats, scored with math-verify).
Outputs: ``metrics/evaluate.json`` (``{split: {model: {greedy, pass@k, maj@k, ...}}}`` for
``dvc metrics show``), ``paths.eval_report_dir/generations.parquet`` (every completion with its
extracted answer and verdict, for audit), ``paired.json`` (``{split: {"a vs b": {metric: diff, ci}}}`` for
the ``evaluate.compare`` pairs) and ``report.md`` (tables with 95% intervals, paired differences).

Per model and split: greedy accuracy (Wilson interval); ``num_samples`` samples per prompt at
``evaluate.sampling`` give sampled pass@1 (mean over samples), unbiased pass@k, maj@k (mean majority-vote
correctness over the disjoint blocks of k samples), mean completion length and the share cut at
``max_new_tokens`` (bootstrap intervals over problems). Each ``evaluate.compare`` pair gets paired
differences: the same problems resampled jointly. A problem whose gold answer cannot be parsed is
unscorable: counted, and left out of every denominator (never counted correct).

Run: ``dvc repro evaluate`` or ``python -m stages.evaluate [--params params.yaml]``.
"""

from __future__ import annotations

import gc
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from posttrain import metrics as M
from posttrain import modeling, plots
from posttrain.config import MathTask, Params, Validation
from posttrain.rollout import BACKENDS, Completion, SamplingParams, chat_prompt_ids, generator
from posttrain.runner import stage_main
from posttrain.schema import GENERATION_SCHEMA, Problem, read_problems, write_json, write_parquet, write_text
from posttrain.sources import problems_from
from posttrain.tasks import get_task

log = logging.getLogger("evaluate")


def score_problem(p: Problem, greedy: Completion, samples: list[Completion], ks: list[int]
                  ) -> tuple[dict[str, Any] | None, list[tuple[str | None, bool | None]]]:
    """Per-problem metrics (None when unscorable) and (extracted, correct) of greedy + each sample.
    With no samples (outside ``sample_prompts``) only the greedy metrics are returned."""
    task = get_task(p["task"])
    verdicts = [(task.extract(c.text), task.verify(p["answer"], c.text)) for c in [greedy, *samples]]
    if verdicts[0][1] is None:
        return None, verdicts
    if not samples:
        return {"greedy": float(bool(verdicts[0][1])), "greedy_len": float(len(greedy.token_ids))}, verdicts
    s = verdicts[1:]
    c = sum(bool(v) for _, v in s)
    row = {"greedy": float(bool(verdicts[0][1])), "pass@1": c / len(s)}
    for k in ks:
        row[f"pass@{k}"] = M.pass_at_k(len(s), c, k)
        row[f"maj@{k}"] = M.maj_at_k([a for a, _ in s], [v for _, v in s], k)
    row["len"] = float(np.mean([len(x.token_ids) for x in samples]))
    row["greedy_len"] = float(len(greedy.token_ids))
    row["truncated"] = float(np.mean([x.finish_reason == "length" for x in samples]))
    return row, verdicts


PROPORTIONS = {"greedy"}  # one 0/1 outcome per problem: Wilson interval; means of per-problem values: bootstrap
NO_INTERVAL = {"len", "greedy_len", "truncated"}


def summarize(rows: list[dict[str, Any]], n_unscorable: int, n_boot: int, seed: int) -> dict[str, Any]:
    """Means of each per-problem metric over the problems that have it, with 95% intervals: Wilson for the
    greedy accuracy (a proportion), percentile bootstrap over problems for pass@k, maj@k (per-problem means)."""
    out: dict[str, Any] = {"n": len(rows), "n_sampled": sum("pass@1" in r for r in rows), "unscorable": n_unscorable}
    if not rows:
        return out
    keys = list(dict.fromkeys(k for r in rows for k in r))
    for key in keys:
        vals = [r[key] for r in rows if key in r]
        out[key] = round(float(np.mean(vals)), 4)
        if key in PROPORTIONS:
            out[f"{key}_ci"] = [round(x, 4) for x in M.wilson_ci(int(sum(vals)), len(vals))]
        elif key not in NO_INTERVAL:
            out[f"{key}_ci"] = [round(x, 4) for x in M.bootstrap_ci(vals, n_boot, seed)]
    return out


def paired(per_a: dict[str, dict[str, Any]], per_b: dict[str, dict[str, Any]], n_boot: int, seed: int
           ) -> dict[str, Any]:
    """b - a on the problems both have, per metric: the mean difference and its paired-bootstrap 95% interval
    (problems resampled jointly). ``per_*``: problem id -> per-problem metrics."""
    ids = [i for i in per_a if i in per_b]
    out: dict[str, Any] = {}
    keys = [k for k in dict.fromkeys(k for i in ids for k in per_a[i]) if k not in NO_INTERVAL]
    for key in keys:
        both = [i for i in ids if key in per_a[i] and key in per_b[i]]
        if not both:
            continue
        a, b = [per_a[i][key] for i in both], [per_b[i][key] for i in both]
        out[key] = {"diff": round(float(np.mean(b) - np.mean(a)), 4), "n": len(both),
                    "ci": [round(x, 4) for x in M.paired_bootstrap_ci(a, b, n_boot, seed)]}
    return out


def crossing(a: dict[str, Any], b: dict[str, Any], ks: list[int]) -> str:
    """Where pass@k of model b stops being above (or below) model a's, in words."""
    diff = [(k, b[f"pass@{k}"] - a[f"pass@{k}"]) for k in ks if f"pass@{k}" in a and f"pass@{k}" in b]
    if not diff:
        return "no sampled metrics"
    signs = [(k, s) for k, d in diff if (s := (d > 1e-9) - (d < -1e-9))]  # ties say nothing about the order
    changes = [(k0, k1) for (k0, s0), (k1, s1) in zip(signs, signs[1:], strict=False) if s0 != s1]
    if changes:
        return "cross between " + ", ".join(f"k={k0} and k={k1}" for k0, k1 in changes)
    s = signs[0][1] if signs else 0
    return {1: "second above first at every k (no crossing)", -1: "second below first at every k (no crossing)",
            0: "equal at every k"}[s]


def report_markdown(results: dict[str, dict[str, dict[str, Any]]], ks: list[int], sampling: Any,
                    compare: list[tuple[str, str]], diffs: dict[str, dict[str, dict[str, Any]]]) -> str:
    shown = sorted({1, min(8, ks[-1]), ks[-1]} & set(ks))
    cols = ["greedy"] + [f"pass@{k}" for k in shown] + [f"maj@{ks[-1]}"]
    lines = ["# Evaluation", "",
             f"Sampled metrics at temperature {sampling.temperature}, top-p {sampling.top_p} (pass@1 is the mean "
             "over samples; maj@k the mean over disjoint blocks of k samples). 95% intervals in brackets: Wilson "
             "for greedy accuracy, bootstrap over problems for the rest. Curves: pass_at_k.png.", ""]
    for split, by_model in results.items():
        lines += [f"## {split}", "", "| model | n | " + " | ".join(cols) + " | mean len | cut at max |",
                  "|---|---:|" + "---:|" * (len(cols) + 2)]
        for name, m in by_model.items():
            if not m.get("n"):
                lines.append(f"| {name} | 0 | " + " | ".join("—" for _ in cols) + " | — | — |")
                continue
            cells = [f"{100 * m[c]:.1f} [{100 * m[c + '_ci'][0]:.1f}, {100 * m[c + '_ci'][1]:.1f}]" if c in m
                     else "—" for c in cols]
            tail = f" | {m['len']:.1f} | {100 * m['truncated']:.0f}% |" if "len" in m else " | — | — |"
            lines.append(f"| {name} | {m['n']} | " + " | ".join(cells) + tail)
        for a, b in compare:
            if a in by_model and b in by_model:
                lines.append(f"\npass@k, {a} vs {b}: {crossing(by_model[a], by_model[b], ks)}.")
        pairs = diffs.get(split, {})
        if pairs:
            lines += ["", "Paired differences (second minus first, points; 95% paired-bootstrap interval over the "
                      "same problems; an interval that excludes 0 decides the ordering):", "",
                      "| pair | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
            for pair, d in pairs.items():
                cells = [f"{100 * d[c]['diff']:+.1f} [{100 * d[c]['ci'][0]:+.1f}, {100 * d[c]['ci'][1]:+.1f}]"
                         if c in d else "—" for c in cols]
                lines.append(f"| {pair} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    """Evaluate. ``inputs``: eval (eval.parquet), models (name -> checkpoint). ``out``: report_dir, metrics."""
    cfg = params.evaluate
    torch.set_num_threads(params.runtime.generate_threads)
    device = modeling.resolve_device(params.runtime.device)
    splits: dict[str, list[Problem]] = {"eval": read_problems(inputs["eval"])[: cfg.limit]}
    for b in cfg.benchmarks:
        probs, bad = problems_from(b, MathTask(), params.seed, Validation())
        splits[b.name] = probs[: cfg.limit]
        if bad:
            log.warning("%s: %d rows unusable (first: %s)", b.name, len(bad), bad[0]["reason"])

    greedy_sp = SamplingParams(0.0, 1.0, cfg.sampling.max_new_tokens, params.seed)
    sample_sp = SamplingParams(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.max_new_tokens,
                               params.seed)
    results: dict[str, dict[str, Any]] = {s: {} for s in splits}
    per_problem: dict[str, dict[str, dict[str, dict[str, Any]]]] = {s: {} for s in splits}  # split/model/id
    gen_rows: list[dict[str, Any]] = []
    for name, path in tqdm(inputs["models"].items(), desc="evaluate", disable=not params.runtime.progress):
        model = modeling.load_model(path, params.model.dtype, device)
        tok = modeling.load_tokenizer(path)
        backend = BACKENDS[cfg.backend](model, tok, cfg.batch_size, params.rollout.vllm)
        for split, probs in splits.items():
            t0 = time.time()
            ids = chat_prompt_ids(tok, [p["prompt"] for p in probs])
            greedy = backend.generate(ids, 1, greedy_sp)
            n_s = len(ids) if cfg.sample_prompts is None else min(cfg.sample_prompts, len(ids))
            samples = backend.generate(ids[:n_s], cfg.num_samples, sample_sp) + [[]] * (len(ids) - n_s)
            per, unscorable = [], 0
            for p, g, ss in zip(probs, greedy, samples, strict=True):
                row, verdicts = score_problem(p, g[0], ss, cfg.ks)
                if row is None:
                    unscorable += 1
                else:
                    per.append(row)
                    per_problem[split].setdefault(name, {})[p["id"]] = row
                for j, (c, (ext, ok)) in enumerate(zip([g[0], *ss], verdicts, strict=True)):
                    gen_rows.append({"model": name, "split": split, "id": p["id"], "mode": "greedy" if j == 0
                                     else "sample", "sample": max(j - 1, 0), "completion": c.text,
                                     "num_tokens": len(c.token_ids), "finish_reason": c.finish_reason,
                                     "extracted": ext, "correct": ok})
            results[split][name] = summarize(per, unscorable, cfg.bootstrap, params.seed)
            results[split][name]["seconds"] = round(time.time() - t0, 1)
            results[split][name]["generator"] = generator(cfg.backend)
            r = results[split][name]
            log.info("%s/%s: greedy %.3f pass@1 %.3f (n=%d, %.1fs)", name, split, r.get("greedy", float("nan")),
                     r.get("pass@1", float("nan")), r["n"], r["seconds"])
        del backend, model  # the backend holds the model too: drop both, so one model is resident at a time
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    diffs = {split: {f"{a} vs {b}": paired(per_problem[split][a], per_problem[split][b], cfg.bootstrap, params.seed)
                     for a, b in cfg.compare if a in per_problem[split] and b in per_problem[split]}
             for split in splits}
    write_parquet(out["report_dir"] / "generations.parquet", gen_rows, GENERATION_SCHEMA)
    write_json(out["report_dir"] / "paired.json", diffs)
    write_text(out["report_dir"] / "report.md", report_markdown(results, cfg.ks, cfg.sampling, cfg.compare, diffs))
    plots.pass_at_k_curves(results, cfg.ks, out["report_dir"] / "pass_at_k.png")
    write_json(out["metrics"], results)
    return results


def paths(p: Params) -> tuple[dict[str, Any], dict[str, Path]]:
    """This stage's inputs and outputs, from ``params`` (used by ``main`` and by tests)."""
    return ({"eval": Path(p.paths.curated_dir) / "eval.parquet", "models": dict(p.evaluate.models)},
            {"report_dir": Path(p.paths.eval_report_dir), "metrics": Path(p.paths.metrics_dir) / "evaluate.json"})


def main() -> None:
    stage_main("evaluate", lambda p: run(p, *paths(p)))


if __name__ == "__main__":
    main()
