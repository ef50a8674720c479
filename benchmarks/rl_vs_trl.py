"""Our RL loop against TRL's GRPOTrainer on the same work: samples/s, where a step goes, held-out pass@1.

Both arms start from the pipeline's SFT checkpoint (``paths.sft_model``), draw from the same prompts (the
``rl`` stage's pass-rate selection), and use identical settings taken from ``params.yaml``'s ``rl``
section: prompts per step B, group size G, max new tokens, temperature, top-p, learning rate (constant),
AdamW betas (0.9, 0.99), clip range (eps_low / eps_high), token-mean loss (TRL: ``loss_type="dapo"``),
group-std advantages (TRL: ``scale_rewards="group"``), one optimizer step per rollout batch, no KL, no
entropy bonus, the task's correctness reward, CPU, no vLLM. Our arm runs with ``dynamic_sampling: off``
(TRL has no DAPO skip); its micro-batching (``rl.micro_batch_size``) and sequence packing (``rl.pack``) are
exact (the same loss and gradient as one padded batch), so they are not settings of the algorithm.

Each arm runs in its own subprocess (so peak RSS is its own), alternating A B A B over ``--repeats``.
Per arm: samples/s and completion tokens/s of the training loop (median, min-max over repeats), seconds per
step split into generation / reward / log-prob recomputation / update (the rest of the step), peak RSS, and
held-out sampled pass@1 (``--eval-prompts`` x ``--eval-samples`` at T=1, 95% bootstrap interval) after the
same number of steps and, for TRL, after the same wall time as our arm's run (a weight snapshot taken
when TRL's loop passes our arm's wall time in the same repeat).

Needs the default pipeline up to ``reward`` (``dvc repro reward``) and the ``bench`` extra
(``pip install -e ".[bench]"``, which adds trl).

Arms: ``ours`` (the synchronous loop, ``runtime`` threads as in params), ``ours_k1`` (``rl.overlap`` with
``max_staleness`` 1: one generator process of 1 torch thread beside a trainer of 1 thread), ``ours_vllm`` (the
synchronous loop with ``rollout.backend: vllm``, the colocated engine), ``trl`` (``GRPOTrainer`` generating with
transformers' ``generate``) and ``trl_vllm`` (``use_vllm=True, vllm_mode="colocate"``: TRL's own colocated vLLM
engine); they run in the order given within each repeat, and each of ours is compared with each TRL arm in the
same repeat. The vLLM arms need vLLM's CPU build: run the whole benchmark with ``.venv-vllm``'s python (with trl
installed there). An engine's start is outside both loops' clocks (it is built before the first step) and inside
``process_s``.

    python benchmarks/rl_vs_trl.py [--steps 40] [--repeats 2] [--arms ours ours_k1 trl] \\
        [--json benchmarks/results/rl_vs_trl.json]
    cd <a run of profiles/smollm2-gsm8k.yaml> && <repo>/.venv-vllm/bin/python <repo>/benchmarks/rl_vs_trl.py \\
        --params <repo>/profiles/smollm2-gsm8k.yaml --steps 2 --repeats 1 --arms ours ours_vllm trl trl_vllm \\
        --eval-prompts 16 --eval-samples 4 --json <repo>/benchmarks/results/rl_vs_trl_smollm2.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GB; vLLM's CPU build (both vLLM arms)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from posttrain import metrics as M  # noqa: E402
from posttrain import modeling  # noqa: E402
from posttrain.config import Params, parse_params  # noqa: E402
from posttrain.rewards import Sample, correct  # noqa: E402
from posttrain.rl import select  # noqa: E402
from posttrain.rl.prompts import PromptPool, read_rates  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, sample_rows  # noqa: E402
from posttrain.runner import setup  # noqa: E402
from posttrain.schema import read_problems  # noqa: E402
from stages import rl  # noqa: E402

OURS = {"ours": {}, "ours_vllm": {"rollout": {"backend": "vllm"}},
        "ours_k1": {"rl": {"overlap": {"max_staleness": 1, "generators": 1, "generator_threads": 1,
                                       "trainer_threads": 1}}}}
TRL = {"trl": {}, "trl_vllm": {"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": False,
                               "vllm_importance_sampling_correction": False}}  # ours has none either: same loss


def bench_params(path: str, steps: int, arm: str = "ours") -> Params:
    """params.yaml with the benchmark's settings: ``steps``, dynamic sampling off, no resumable checkpoints,
    ``rl.overlap`` off (and the arm's own settings)."""
    from posttrain.config.params import read_yaml

    raw = read_yaml(Path(path).read_text())
    raw["rl"].update({"steps": steps, "dynamic_sampling": "off", "checkpoint_every": steps + 1, "overlap": None})
    for section, values in OURS.get(arm, {}).items():
        raw[section].update(values)
    if raw["rl"]["overlap"] and raw["rl"].get("correction") is None:  # k > 0 needs a correction (refused otherwise)
        raw["rl"]["correction"] = {"name": "icepop"}
    raw["runtime"]["progress"] = False
    return parse_params(raw)  # validated: the overlap's rules hold as in a stage


def verified(s: Sample) -> float:
    """The ``correct`` reward of one sample (a batch reward: one call, one value), 0.0 when unscorable."""
    v = correct([s])[0]
    return float(v) if isinstance(v, float | int) else 0.0


def heldout_pass1(model: torch.nn.Module, tok: Any, params: Params, n_prompts: int, n_samples: int
                  ) -> dict[str, Any]:
    """Sampled pass@1 (T=1) on the first ``n_prompts`` held-out problems, with a 95% bootstrap interval."""
    problems = read_problems(Path(params.paths.curated_dir) / "eval.parquet")[:n_prompts]
    torch.set_num_threads(params.runtime.generate_threads)
    model.eval()
    backend = BACKENDS["hf"](model, tok, 256)
    rows, _ = sample_rows(backend, tok, problems, n_samples, SamplingParams(1.0, 1.0, params.rl.sampling.max_new_tokens,
                                                                            seed=12345), policy="bench")
    per_problem: dict[str, list[float]] = {}
    for r in rows:
        ok = verified(Sample(r["completion"], r["answer"], r["task"], len(r["token_ids"]), r["max_new_tokens"]))
        per_problem.setdefault(r["prompt_id"], []).append(ok)
    vals = [float(np.mean(v)) for v in per_problem.values()]
    lo, hi = M.bootstrap_ci(vals, 1000, 0)
    return {"pass@1": round(float(np.mean(vals)), 4), "ci": [round(lo, 4), round(hi, 4)]}


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def arm_ours(params: Params, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    inputs, _ = rl.paths(params)
    import csv

    outs = {k: out / k for k in ("model", "rl_dir", "checkpoints", "report_dir")}
    outs["metrics"] = out / "rl.json"
    res = rl.run(params, inputs, outs)
    rss = peak_rss_mb()
    log = list(csv.DictReader((outs["report_dir"] / "train_log.csv").open()))
    g, b = params.rl.samples_per_prompt, params.rl.prompts_per_step
    loop_s = res["seconds"]
    tokens = sum(float(r["response_len"]) for r in log) * b * g
    n = len(log)
    gen, rew, upd = (sum(float(r[k]) for r in log) / n for k in ("gen_s", "reward_s", "update_s"))
    step = loop_s / n
    model = modeling.load_model(str(outs["model"]), params.model.dtype, torch.device("cpu"))
    tok = modeling.load_tokenizer(str(outs["model"]))
    ev = heldout_pass1(model, tok, params, args.eval_prompts, args.eval_samples)
    return {"arm": args.worker, "steps": n, "loop_s": loop_s, "samples_per_s": n * b * g / loop_s,
            "tokens_per_s": tokens / loop_s, "step_s": step, "gen_s": gen, "reward_s": rew, "logprob_s": 0.0,
            "update_s": upd, "other_s": step - gen - rew - upd, "peak_rss_mb": rss,
            "pass1_same_steps": ev, "pass1_same_time": ev, "steps_at_same_time": n,
            "final_reward": res["final_reward"]}


def arm_trl(params: Params, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    cfg = params.rl
    g, b = cfg.samples_per_prompt, cfg.prompts_per_step
    inputs, _ = rl.paths(params)
    train = PromptPool.read(inputs["train"])
    prompts = select.PROMPT_SELECTIONS[cfg.select.strategy](train, read_rates(inputs["pass_rates"], train), cfg.select)
    # TRL needs B distinct rows per step: a selection smaller than steps x B (the real profile's pass band picked 3
    # prompts) is repeated, as our loop's cursor cycles it
    prompts = list(prompts) * max(1, -(-cfg.steps * b // len(prompts)))
    ds = Dataset.from_list([{"prompt": [{"role": "user", "content": p["prompt"]}], "answer": p["answer"],
                             "task": p["task"]} for p in prompts])
    counts = {"tokens": 0, "samples": 0}

    def correctness(completions: list, answer: list, task: list, completion_ids: list, **_: Any) -> list[float]:
        counts["tokens"] += sum(len(c) for c in completion_ids)
        counts["samples"] += len(completions)
        return [verified(Sample(c[0]["content"], a, t, len(ids), cfg.sampling.max_new_tokens))
                for c, a, t, ids in zip(completions, answer, task, completion_ids, strict=True)]

    model = modeling.load_model(str(inputs["policy"]), params.model.dtype, torch.device("cpu"))
    tok = modeling.load_tokenizer(str(inputs["policy"]))
    targs = GRPOConfig(
        output_dir=str(out / "trl"), max_steps=cfg.steps, num_generations=g,
        # ours' micro-batches as TRL's gradient accumulation (its dapo loss divides by the whole batch's tokens)
        per_device_train_batch_size=min(cfg.micro_batch_size, b * g),
        gradient_accumulation_steps=max(1, b * g // cfg.micro_batch_size),
        max_completion_length=cfg.sampling.max_new_tokens, temperature=cfg.sampling.temperature,
        top_p=cfg.sampling.top_p, top_k=0, learning_rate=cfg.lr,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=cfg.weight_decay, adam_beta1=0.9,
        adam_beta2=0.99, max_grad_norm=cfg.max_grad_norm, beta=0.0, epsilon=cfg.clip_eps_low,
        epsilon_high=cfg.clip_eps_high, loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        seed=params.seed, bf16=False, disable_tqdm=True, dataloader_num_workers=0, **TRL[args.worker])
    trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=targs, train_dataset=ds, processing_class=tok)

    timers = {"gen": 0.0, "reward": 0.0, "logprob": 0.0}

    def timed(name: str, fn: Any, only_no_grad: bool = False) -> Any:
        def wrapper(*a: Any, **kw: Any) -> Any:
            if only_no_grad and torch.is_grad_enabled():
                return fn(*a, **kw)
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                timers[name] += time.perf_counter() - t
        return wrapper

    trainer._generate_single_turn = timed("gen", trainer._generate_single_turn)
    trainer._calculate_rewards = timed("reward", trainer._calculate_rewards)
    trainer._get_per_token_logps_and_entropies = timed("logprob", trainer._get_per_token_logps_and_entropies,
                                                       only_no_grad=True)
    snap: dict[str, Any] = {}

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.loop_s, self.t = 0.0, 0.0

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, _args: Any, state: Any, *a: Any, **kw: Any) -> None:
            self.loop_s += time.perf_counter() - self.t
            if "state" not in snap and self.loop_s >= args.snapshot_s:
                snap["state"], snap["step"] = copy.deepcopy(trainer.model.state_dict()), state.global_step

    clock = Clock()
    trainer.add_callback(clock)
    trainer.train()
    rss = peak_rss_mb()
    n = trainer.state.global_step
    step = clock.loop_s / n
    gen, rew, lp = (timers[k] / n for k in ("gen", "reward", "logprob"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    final = trainer.model
    ev_steps = heldout_pass1(final, tok, params, args.eval_prompts, args.eval_samples)
    if "state" in snap:
        final.load_state_dict(snap["state"])
        ev_time = heldout_pass1(final, tok, params, args.eval_prompts, args.eval_samples)
    else:  # TRL finished within our arm's wall time
        ev_time, snap["step"] = ev_steps, n
    return {"arm": args.worker, "steps": n, "loop_s": clock.loop_s, "samples_per_s": counts["samples"] / clock.loop_s,
            "tokens_per_s": counts["tokens"] / clock.loop_s, "step_s": step, "gen_s": gen, "reward_s": rew,
            "logprob_s": lp, "update_s": step - gen - rew - lp, "other_s": 0.0, "peak_rss_mb": rss,
            "pass1_same_steps": ev_steps, "pass1_same_time": ev_time, "steps_at_same_time": snap["step"],
            "final_reward": round(float(np.mean(rewards[-5:])), 4) if rewards else None}


def worker(args: argparse.Namespace) -> None:
    params = bench_params(args.params, args.steps, args.worker)
    setup(params)
    with tempfile.TemporaryDirectory() as d:
        res = (arm_trl if args.worker in TRL else arm_ours)(params, args, Path(d))
    Path(args.out).write_text(json.dumps(res))


def write(args: argparse.Namespace, p: Params, results: list[dict[str, Any]], ratios: dict[str, list[float]]) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"settings": {"steps": args.steps, "repeats": args.repeats,
                                                        "B": p.rl.prompts_per_step, "G": p.rl.samples_per_prompt,
                                                        "max_new_tokens": p.rl.sampling.max_new_tokens,
                                                        "params": args.params},
                                           "arms": args.arms, "runs": results,
                                           "ratio_samples_per_s": ratios}, indent=2))


def fmt_range(vals: list[float], digits: int = 1) -> str:
    return f"{statistics.median(vals):.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/rl_vs_trl.json")
    ap.add_argument("--arms", nargs="+", default=["ours", "ours_k1", "trl"], choices=[*OURS, *TRL])
    ap.add_argument("--worker", choices=[*OURS, *TRL], help=argparse.SUPPRESS)
    ap.add_argument("--snapshot-s", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    p = bench_params(args.params, args.steps)
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.repeats):
            ours_s = None
            for arm in args.arms:
                out = Path(d) / f"{arm}_{rep}.json"
                cmd = [sys.executable, __file__, "--worker", arm, "--out", str(out), "--params", args.params,
                       "--steps", str(args.steps), "--eval-prompts", str(args.eval_prompts),
                       "--eval-samples", str(args.eval_samples)]
                if arm in TRL and ours_s is not None:
                    cmd += ["--snapshot-s", str(ours_s)]
                t = time.time()
                subprocess.run(cmd, check=True)
                res = json.loads(out.read_text()) | {"repeat": rep, "process_s": round(time.time() - t, 1)}
                ours_s = res["loop_s"] if arm == "ours" else ours_s
                results.append(res)
                write(args, p, results, {})  # so far: a later arm's failure keeps these
                print(f"repeat {rep} {arm}: {res['samples_per_s']:.1f} samples/s, "
                      f"pass@1 {res['pass1_same_steps']['pass@1']:.3f}", file=sys.stderr, flush=True)

    by = {a: [r for r in results if r["arm"] == a] for a in args.arms}
    print(f"\nRL loop vs trl.GRPOTrainer: B={p.rl.prompts_per_step} G={p.rl.samples_per_prompt} "
          f"max_new_tokens={p.rl.sampling.max_new_tokens} steps={args.steps} repeats={args.repeats} "
          f"(torch threads {torch.get_num_threads()}, CPU)")
    print("| arm | samples/s | tokens/s | s/step | gen | reward | logprob recompute | update | peak RSS MB "
          "| pass@1 same steps | pass@1 same wall time (steps) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for a, rs in by.items():
        same_t = "; ".join(f"{r['pass1_same_time']['pass@1']:.3f} ({r['steps_at_same_time']})" for r in rs)
        same_n = "; ".join(f"{r['pass1_same_steps']['pass@1']:.3f} [{r['pass1_same_steps']['ci'][0]:.3f}, "
                           f"{r['pass1_same_steps']['ci'][1]:.3f}]" for r in rs)
        print(f"| {a} | {fmt_range([r['samples_per_s'] for r in rs])} | {fmt_range([r['tokens_per_s'] for r in rs])} "
              f"| {fmt_range([r['step_s'] for r in rs], 3)} | {statistics.median(r['gen_s'] for r in rs):.3f} "
              f"| {statistics.median(r['reward_s'] for r in rs):.3f} "
              f"| {statistics.median(r['logprob_s'] for r in rs):.3f} "
              f"| {statistics.median(r['update_s'] + r['other_s'] for r in rs):.3f} "
              f"| {max(r['peak_rss_mb'] for r in rs):.0f} | {same_n} | {same_t} |")
    ratios = {f"{a}/{t}": [o["samples_per_s"] / r["samples_per_s"] for o, r in zip(by[a], by[t], strict=True)]
              for a in by if a in OURS for t in by if t in TRL}
    for a, rs in ratios.items():
        print(f"\n{a} samples/s: median {statistics.median(rs):.2f}x (per repeat: {', '.join(f'{x:.2f}' for x in rs)})")
    write(args, p, results, ratios)


if __name__ == "__main__":
    main()
