"""Our RL loop against TRL's GRPOTrainer on the same work: samples/s, where a step goes, held-out pass@1.

Both arms start from the pipeline's SFT checkpoint (``paths.sft_model``), draw from the same prompts (the
``rl`` stage's pass-rate selection), and use identical settings taken from ``params.yaml``'s ``rl``
section: prompts per step B, group size G, max new tokens, temperature, top-p, learning rate (constant),
AdamW betas (0.9, 0.99), clip range (eps_low / eps_high), token-mean loss (TRL: ``loss_type="dapo"``),
group-std advantages (TRL: ``scale_rewards="group"``), one optimizer step per rollout batch, no KL, no
entropy bonus, the task's correctness reward, CPU (vLLM only in the vLLM arms). Our arm runs with
``dynamic_sampling: off`` (TRL has no DAPO skip); its micro-batching (``rl.micro_batch_size``), sequence
packing (``rl.pack``) and, since a15d6bb, its skipping of sequences of advantage 0 in the update (they add
exactly 0 to the loss and gradient; their tokens stay in the token-mean normaliser; TRL runs them) are exact (the
same loss and gradient as one padded batch), so they are not settings of the algorithm.

Each arm runs in its own subprocess (so peak RSS is its own), in the order given within each repeat; repeat r
seeds every arm with r (our ``rl.seed``, TRL's ``seed``), so the repeats are seeds as well as timing repeats.
Per arm: samples/s and completion tokens/s of the training loop, seconds per step split into generation /
reward / log-prob recomputation / update (the rest of the step), peak RSS, the per-step train reward, and
held-out sampled pass@1 (``--eval-prompts`` x ``--eval-samples`` at T=1, the same seeded draw for every arm,
95% interval over problems) after the same number of steps and, for TRL, after the same wall time as our
arm's run (a weight snapshot taken when TRL's loop passes our arm's wall time in the same repeat). The start
checkpoint is scored once the same way (``start``), and each of ours is paired with each TRL arm of its repeat
on the same problems: the difference ours - TRL in pass@1 with its paired 95% interval
(``posttrain.metrics.paired_rate_ci``), which is what "at equal held-out pass@1" is read from.

Needs the pipeline up to ``reward`` (``dvc repro reward``, or ``posttrain repro -p <profile> reward``) and the
``bench`` extra (``pip install -e ".[bench]"``, which adds trl). TRL's arm is ``benchmarks/trl_arm.py``.

Arms: ``ours`` (the synchronous loop, ``runtime`` threads as in params), ``ours_pack`` (the same with
``rl.pack``: the update's sequences packed into rows without padding, exact), ``ours_k1`` (``rl.overlap`` with
``max_staleness`` 1: one generator process of 1 torch thread beside a trainer of 1 thread), ``ours_vllm`` (the
synchronous loop with ``rollout.backend: vllm``, the colocated engine), ``trl`` (``GRPOTrainer`` generating with
transformers' ``generate``) and ``trl_vllm`` (``use_vllm=True, vllm_mode="colocate"``: TRL's own colocated vLLM
engine); they run in the order given within each repeat, and each of ours is compared with each TRL arm in the
same repeat. The vLLM arms need vLLM's CPU build: run the whole benchmark with ``.venv-vllm``'s python (with trl
installed there). An engine's start is outside both loops' clocks (it is built before the first step) and inside
``process_s``.

    python benchmarks/rl_vs_trl.py [--steps 40] [--repeats 2] [--arms ours ours_k1 trl] \\
        [--json benchmarks/results/rl_vs_trl.json]
    cd <a run of profiles/smollm2-arith.yaml to reward> && <repo>/.venv-vllm/bin/python \\
        <repo>/benchmarks/rl_vs_trl.py --params <repo>/profiles/smollm2-arith.yaml --steps 10 --repeats 2 \\
        --arms ours ours_vllm ours_k1 trl trl_vllm --eval-prompts 200 --eval-samples 4 \\
        --json <repo>/benchmarks/results/rl_vs_trl_smollm2_arith.json
"""

from __future__ import annotations

import argparse
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
from posttrain.rollout import BACKENDS, SamplingParams, sample_rows  # noqa: E402
from posttrain.runner import setup  # noqa: E402
from posttrain.schema import read_problems  # noqa: E402
from stages import rl  # noqa: E402

OURS = {"ours": {}, "ours_pack": {"rl": {"pack": True}}, "ours_vllm": {"rollout": {"backend": "vllm"}},
        "ours_k1": {"rl": {"overlap": {"max_staleness": 1, "generators": 1, "generator_threads": 1,
                                       "trainer_threads": 1}}}}
TRL = ("trl", "trl_vllm")  # benchmarks/trl_arm.py: ARMS
START = "start"  # the SFT checkpoint itself, scored once: where every arm begins


def bench_params(path: str, steps: int, arm: str = "ours", seed: int = 0) -> Params:
    """params.yaml with the benchmark's settings: ``steps``, ``rl.seed``, dynamic sampling off, no resumable
    checkpoints, ``rl.overlap`` off (and the arm's own settings)."""
    from posttrain.config.params import read_yaml

    raw = read_yaml(Path(path).read_text())
    raw["rl"].update({"steps": steps, "seed": seed, "dynamic_sampling": "off", "checkpoint_every": steps + 1,
                      "overlap": None})
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
    """Sampled pass@1 (T=1, one seeded draw for every arm) on the first ``n_prompts`` held-out problems: the
    mean, its 95% interval over problems (``metrics.rate_ci``) and each problem's rate (for paired intervals)."""
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
    rates = {k: float(np.mean(v)) for k, v in per_problem.items()}
    lo, hi = M.rate_ci(list(rates.values()))
    return {"pass@1": round(float(np.mean(list(rates.values()))), 4), "ci": [round(lo, 4), round(hi, 4)],
            "per_problem": rates}


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
    rewards = [round(float(r["reward_mean"]), 4) for r in log]
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
            "pass1_same_steps": ev, "pass1_same_time": ev, "steps_at_same_time": n, "rewards": rewards,
            "final_reward": res["final_reward"]}


def arm_start(params: Params, args: argparse.Namespace) -> dict[str, Any]:
    """The start checkpoint (``paths.sft_model``) scored by the same held-out draw as every arm."""
    inputs, _ = rl.paths(params)
    model = modeling.load_model(str(inputs["policy"]), params.model.dtype, torch.device("cpu"))
    tok = modeling.load_tokenizer(str(inputs["policy"]))
    return {"arm": START, "pass1_same_steps": heldout_pass1(model, tok, params, args.eval_prompts, args.eval_samples)}


def worker(args: argparse.Namespace) -> None:
    params = bench_params(args.params, args.steps, args.worker, args.seed)
    setup(params)
    if args.worker == START:
        res = arm_start(params, args)
    elif args.worker in TRL:
        from trl_arm import arm_trl

        def evaluate(model: torch.nn.Module, tok: Any) -> dict[str, Any]:
            return heldout_pass1(model, tok, params, args.eval_prompts, args.eval_samples)

        with tempfile.TemporaryDirectory() as d:
            res = arm_trl(params, args, Path(d), params.seed + args.seed, verified, evaluate, peak_rss_mb)
    else:
        with tempfile.TemporaryDirectory() as d:
            res = arm_ours(params, args, Path(d))
    Path(args.out).write_text(json.dumps(res))


def write(args: argparse.Namespace, p: Params, results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"settings": {"steps": args.steps, "repeats": args.repeats,
                                                        "B": p.rl.prompts_per_step, "G": p.rl.samples_per_prompt,
                                                        "max_new_tokens": p.rl.sampling.max_new_tokens,
                                                        "lr": p.rl.lr, "eval_prompts": args.eval_prompts,
                                                        "eval_samples": args.eval_samples, "params": args.params},
                                           "arms": args.arms, "runs": results} | summary, indent=2))


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """pass@1 of ``b`` minus ``a`` on the problems both scored, with its paired 95% interval."""
    ids = sorted(set(a["per_problem"]) & set(b["per_problem"]))
    x, y = [a["per_problem"][i] for i in ids], [b["per_problem"][i] for i in ids]
    lo, hi = M.paired_rate_ci(x, y)
    return {"diff": round(float(np.mean(y) - np.mean(x)), 4), "ci": [round(lo, 4), round(hi, 4)], "n": len(ids)}


def summarize(results: list[dict[str, Any]], arms: list[str]) -> dict[str, Any]:
    """Per repeat: ours / TRL samples/s, and pass@1 differences (ours - TRL, every arm - start), paired."""
    start = next(r for r in results if r["arm"] == START)["pass1_same_steps"]
    reps = sorted({r["repeat"] for r in results if r["arm"] != START})
    at = {(r["arm"], r["repeat"]): r for r in results if r["arm"] != START}
    ratios: dict[str, list[float]] = {}
    diffs: dict[str, list[dict[str, Any]]] = {}
    for rep in reps:
        for a in arms:
            if (a, rep) in at:
                diffs.setdefault(f"{a}-start", []).append(paired(start, at[a, rep]["pass1_same_steps"]))
        for a in (x for x in arms if x in OURS and (x, rep) in at):
            for t in (x for x in arms if x in TRL and (x, rep) in at):
                ratios.setdefault(f"{a}/{t}", []).append(at[a, rep]["samples_per_s"] / at[t, rep]["samples_per_s"])
                diffs.setdefault(f"{a}-{t}", []).append(paired(at[t, rep]["pass1_same_steps"],
                                                               at[a, rep]["pass1_same_steps"]))
    return {"ratio_samples_per_s": ratios, "pass1_diff": diffs}


def report(p: Params, args: argparse.Namespace, results: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    """The table, one row per arm and repeat, then each ratio and paired difference per repeat."""
    start = next(r for r in results if r["arm"] == START)["pass1_same_steps"]
    print(f"\nRL loop vs trl.GRPOTrainer: B={p.rl.prompts_per_step} G={p.rl.samples_per_prompt} "
          f"max_new_tokens={p.rl.sampling.max_new_tokens} lr={p.rl.lr} steps={args.steps} repeats={args.repeats} "
          f"(CPU); start pass@1 {start['pass@1']:.3f} [{start['ci'][0]:.3f}, {start['ci'][1]:.3f}]")
    print("| arm | repeat | samples/s | tokens/s | s/step | gen | reward | logprob recompute | update | peak RSS MB "
          "| pass@1 same steps | pass@1 same wall time (steps) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|")
    for r in sorted((r for r in results if r["arm"] != START), key=lambda r: (args.arms.index(r["arm"]), r["repeat"])):
        e, t = r["pass1_same_steps"], r["pass1_same_time"]
        print(f"| {r['arm']} | {r['repeat']} | {r['samples_per_s']:.3f} | {r['tokens_per_s']:.1f} | {r['step_s']:.1f} "
              f"| {r['gen_s']:.1f} | {r['reward_s']:.2f} | {r['logprob_s']:.1f} | {r['update_s'] + r['other_s']:.1f} "
              f"| {r['peak_rss_mb']:.0f} | {e['pass@1']:.3f} [{e['ci'][0]:.3f}, {e['ci'][1]:.3f}] "
              f"| {t['pass@1']:.3f} ({r['steps_at_same_time']}) |")
    for k, rs in summary["ratio_samples_per_s"].items():
        print(f"{k} samples/s: median {statistics.median(rs):.2f}x (per repeat: {', '.join(f'{x:.2f}' for x in rs)})")
    for k, ds in summary["pass1_diff"].items():
        print(f"pass@1 {k}: " + "; ".join(f"{d['diff']:+.3f} [{d['ci'][0]:+.3f}, {d['ci'][1]:+.3f}]" for d in ds))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--eval-prompts", type=int, default=200)
    ap.add_argument("--eval-samples", type=int, default=8)
    ap.add_argument("--json", default="benchmarks/results/rl_vs_trl.json")
    ap.add_argument("--arms", nargs="+", default=["ours", "ours_k1", "trl"], choices=[*OURS, *TRL])
    ap.add_argument("--resume", action="store_true",
                    help="keep the runs already in --json (a failed arm stays failed), run the rest")
    ap.add_argument("--worker", choices=[START, *OURS, *TRL], help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--snapshot-s", type=float, default=float("inf"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    p = bench_params(args.params, args.steps)
    results: list[dict[str, Any]] = json.loads(Path(args.json).read_text())["runs"] if args.resume else []
    done = {(r["arm"], r.get("repeat")) for r in results}
    plan = [(START, None)] + [(arm, rep) for rep in range(args.repeats) for arm in args.arms]
    with tempfile.TemporaryDirectory() as d:
        for arm, rep in plan:
            if (arm, rep) in done:
                continue
            out = Path(d) / f"{arm}_{rep}.json"
            cmd = [sys.executable, __file__, "--worker", arm, "--out", str(out), "--params", args.params,
                   "--steps", str(args.steps), "--eval-prompts", str(args.eval_prompts),
                   "--eval-samples", str(args.eval_samples), "--seed", str(rep or 0)]
            ours = next((r for r in results if r["arm"] == "ours" and r.get("repeat") == rep), None)
            if arm in TRL and ours is not None:
                cmd += ["--snapshot-s", str(ours["loop_s"])]
            t = time.time()
            rc = subprocess.run(cmd).returncode
            if rc:  # recorded, and the other arms go on (trl_vllm: TRL's weight sync fails on vLLM's CPU build)
                results.append({"arm": arm, "repeat": rep, "failed": rc, "process_s": round(time.time() - t, 1)})
                write(args, p, results, {})
                print(f"repeat {rep} {arm}: failed (exit {rc})", file=sys.stderr, flush=True)
                continue
            res = json.loads(out.read_text()) | {"repeat": rep, "process_s": round(time.time() - t, 1)}
            results.append(res)
            write(args, p, results, {})  # so far: a later arm's failure keeps these (--resume goes on from them)
            print(f"repeat {rep} {arm}: {res.get('samples_per_s', 0):.3f} samples/s, "
                  f"pass@1 {res['pass1_same_steps']['pass@1']:.3f}", file=sys.stderr, flush=True)
    ok = [r for r in results if "failed" not in r]
    for r in results:
        if "failed" in r:
            print(f"{r['arm']} repeat {r['repeat']}: failed (exit {r['failed']}); left out of the table")
    summary = summarize(ok, args.arms)
    report(p, args, ok, summary)
    write(args, p, results, summary)


if __name__ == "__main__":
    main()
