"""distill: teacher -> smaller student through the sparse-to-dense bridge.

Inputs: ``paths.curated_dir/{sft,train}.parquet``; the teacher ``distill.teacher`` (default: the RL model).
Outputs: ``paths.student_sft_model`` (the student after its cold start: the SFT-only arm),
``paths.student_model`` (the distilled student), ``paths.distill_report_dir/{train_log.csv,curves.png}``,
``metrics/distill.json``.

Steps (all resumable from ``paths.distill_checkpoints``):
0. Build the student from ``distill.student`` (same tokenizer as the teacher) and cold-start it with the
   same mixed-format SFT recipe as the teacher (``sft`` section, ``training.sft_train``).
A. Warmup (``distill.warmup``): the teacher samples, the student learns from those samples: ``soft``
   token-level forward KL to the teacher's distributions, or ``hard`` SFT; optionally only samples the
   verifier accepts (rejection sampling).
B. On-policy distillation (``distill.on_policy``): the student samples (``student_frac`` of the prompts;
   the teacher the rest), the teacher scores the same tokens, loss = per-token reverse KL (or forward KL,
   or generalized JSD with ``beta``).
C. Optional student GRPO (``distill.grpo_steps``) with the ``rl`` section's algorithm, through the same
   ``rl.collect.collect_step`` / ``rl.update.update_from_groups`` as the rl stage.
With warmup and on-policy steps at 0 and ``grpo_steps`` > 0 this stage is "direct GRPO on the student".

Several processes (``runtime.distributed``): the same command relaunches under torchrun; the student is the
wrapped model (DDP or FSDP2), the teacher a full frozen copy per rank; each rank samples its share of every
step's prompts and trains on its share of the sequences; rank 0 writes the outputs.

Run: ``dvc repro distill`` or ``python -m stages.distill [--params params.yaml]``.
"""

from __future__ import annotations

import functools
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch
from tqdm import tqdm

from posttrain import checkpoint, distillation, distributed, modeling, plots, seeds, training
from posttrain.config import Params, TeacherLayers
from posttrain.demos import read_demos
from posttrain.errors import StageError
from posttrain.lineage.ledger import DISTILL_LEDGER, STUDENT_SFT_LEDGER, write_distill, write_sft
from posttrain.logprobs import Seq
from posttrain.outputs import as_one_set, atomic_path
from posttrain.rewards import RewardPool, is_correct, score_rows
from posttrain.rl import collect, select, update
from posttrain.rl.prompts import PromptPool, PromptTokens
from posttrain.rollout import BACKENDS, SamplingParams, generator, sample_rows
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.tools import with_tools
from posttrain.trainlog import TrainLog
from stages.layout import NEEDS
from stages.layout import distill as paths

log = logging.getLogger("distill")
LOG_FIELDS = ["step", "phase", "loss", "forward_kl", "reverse_kl", "entropy", "response_len", "sample_pass_rate",
              "reward_mean", "grad_norm", "seconds"]


def _seqs(rows: list[dict[str, Any]], prompt_ids: dict[str, list[int]]) -> list[Seq]:
    """Sampled rows as sequences; a multi-turn tool rollout keeps its ``loss_mask`` (observations out of the loss)."""
    return [Seq(prompt_ids[r["prompt_id"]], list(r["token_ids"]), list(r["logprobs"]), 0.0,
                loss_mask=r.get("loss_mask")) for r in rows]


def _step_stats(rows: list[dict[str, Any]], d: Any) -> tuple[int, float | None, float | None]:
    """Over every rank's rows (each rank holds the rows it sampled): how many, the share correct among the
    scorable, the mean tool calls."""
    v = [is_correct(r["rewards"]) for r in rows]
    n, scorable, correct, calls = d.sum(len(rows), sum(x is not None for x in v), sum(x is True for x in v),
                                        sum(r.get("tool_calls") or 0 for r in rows))
    return round(n), (correct / scorable if scorable else None), (calls / n if n else None)


def _student(params: Params, tok: Any, teacher: Any, device: torch.device, meta: bool = False) -> Any:
    """The student, trainable (``model.lora``, gradient checkpointing), stopping like the teacher. A size builds
    a fresh Llama with the teacher's tokenizer and vocabulary size; a pretrained folder or hub id must share
    the teacher's tokenizer (the divergences compare distributions token id by token id). ``meta``
    (``Dist.loads_on_meta``): a pretrained student is built on the meta device, no weight read; ``Dist.wrap``
    gives it rank 0's weights."""
    cfg = params.distill
    if isinstance(cfg.student, str):
        s_tok = modeling.load_tokenizer(cfg.student, cfg.student_revision)
        if s_tok.get_vocab() != tok.get_vocab():
            diff = len(set(s_tok.get_vocab().items()) ^ set(tok.get_vocab().items()))
            raise StageError(f"distill.student {cfg.student!r}: its tokenizer differs from the teacher's ({len(s_tok)} "
                             f"vs {len(tok)} tokens, {diff} (token, id) pairs differ). Token-level distillation needs "
                             "one vocabulary: use a student of the teacher's family, or a size (a fresh student "
                             "built on the teacher's tokenizer); cross-tokenizer distillation (e.g. ULD) is not "
                             "implemented")
        if meta:  # in the dtype load_model gives: fp32 masters, or the frozen LoRA base in model.dtype
            student = modeling.empty_model(cfg.student, params.model.attn_implementation, cfg.student_revision,
                                           "float32" if params.model.lora is None else params.model.dtype)
        else:
            student = modeling.load_model(cfg.student, params.model.dtype, trainable=params.model.lora is None,
                                          revision=cfg.student_revision,
                                          attn_implementation=params.model.attn_implementation)
    elif isinstance(cfg.student, TeacherLayers):  # cut from the teacher: its layers, embeddings and head
        try:
            student = modeling.keep_layers(teacher, cfg.student.layers,
                                           "float32" if params.model.lora is None else params.model.dtype, meta)
        except ValueError as e:
            raise StageError(f"distill.student.layers: {e}") from None
    else:
        student = modeling.build_tiny_model(cfg.student, tok, seeds.student_init(params.seed),
                                           vocab_size=teacher.config.vocab_size)
    common = min(student.config.vocab_size, teacher.config.vocab_size)
    if len(tok) > common:
        raise StageError(f"distill: the tokenizer has {len(tok)} tokens but the student's or teacher's LM head "
                         f"only {common} rows")
    for k in ("eos_token_id", "stop_strings", "pad_token_id"):  # the teacher's prompt format ends turns
        setattr(student.generation_config, k, getattr(teacher.generation_config, k))
    student = modeling.make_trainable(student, params.model.lora, params.model.gradient_checkpointing)
    return student if meta else student.to(device)


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Distill. ``inputs``: demos, train, teacher. ``out``: student_sft, student, checkpoints, report_dir, metrics."""
    with as_one_set(out, "distill"), RewardPool.of(params.reward) as pool:
        return _run(params, inputs, out, pool)  # (a kill leaves the old outputs or the new ones, never a mix)


def _run(params: Params, inputs: dict[str, Path], out: dict[str, Path], pool: RewardPool) -> dict[str, Any]:
    cfg, rt, d = params.distill, params.runtime, distributed.current()
    device = modeling.resolve_device(rt.device)
    tok = modeling.load_tokenizer(str(inputs["teacher"]))
    teacher = d.load_on_rank0(lambda: modeling.load_model(str(inputs["teacher"]), params.model.dtype, device),
                              lambda: modeling.empty_model(str(inputs["teacher"]), dtype=params.model.dtype),
                              device)  # ranks > 0 read no weights: rank 0 broadcasts them
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = _student(params, tok, teacher, device, d.loads_on_meta)
    log.info("teacher %d params, student %d params", modeling.num_params(teacher), modeling.num_params(student))
    student_params = modeling.num_params(student)
    student = d.wrap(student, params.model.dtype)  # the training handle (the model itself in one process)

    # 0. the student's cold start: the teacher's own SFT recipe
    demos = read_demos(inputs["demos"])  # Arrow, as the sft stage reads it
    torch.set_num_threads(rt.train_threads)
    fp0 = checkpoint.fingerprint("student-sft", params.sft, cfg.student, cfg.student_revision, params.model.lora,
                               params.seed, checkpoint.file_digest(inputs["demos"]),
                               *([params.tools] if params.sft.tool_demos else []))
    amp = functools.partial(modeling.autocast, params.model.dtype, device)  # mixed precision (no-op in fp32)
    with amp():
        res = training.sft_train(student, tok, demos, params.sft, params.seed, out["checkpoints"] / "sft", fp0,
                                 progress=rt.progress, desc="student sft", tools=params.tools,
                                 log_to=TrainLog(None, training.SFT_LOG_FIELDS, name="student_sft"))  # MLflow only
    cold = d.plain(student)
    if d.main:
        with atomic_path(out["student_sft"]) as tmp:
            modeling.save_checkpoint(cold, tok, tmp, params.model.dtype)
    sft_seconds = res["seconds"]

    # A, B, C: one global step counter, one optimizer (lr set per phase), resumable
    prompts = PromptPool.read(inputs["train"])  # an Arrow table: rows become dicts only when a step draws them
    prompt_ids = PromptTokens(prompts, tok)  # tokenized when first asked for, not all up front
    phases = ["warmup"] * cfg.warmup.steps + ["on_policy"] * cfg.on_policy.steps + ["grpo"] * cfg.grpo_steps
    opt = training.adamw(student, cfg.warmup.lr, training.DISTILL_WEIGHT_DECAY, training.ONLINE_BETAS)
    tools = params.tools.enabled  # multi-turn tool rollouts: both samplers through the tool loop
    fp = checkpoint.fingerprint(cfg, params.rl, params.reward, params.seed, fp0,
                              modeling.checkpoint_digest(inputs["teacher"]), prompts.digest(),
                              *([] if params.rollout.backend == "hf" else [params.sampler_id()]),
                              *([params.tools] if tools else []))
    d_seed = params.seed + cfg.seed  # distill.seed: seeds of a distillation arm (the cold start stays fixed)
    cursor = select.PromptCursor(len(prompts), seeds.distill_cursor(d_seed))
    state: dict[str, Any] = {"ledger": []}  # per step: the prompts drawn and who sampled each (lineage --samples)
    start, restored, cursor.pos = checkpoint.restore_loop_state(out["checkpoints"], fp, student, opt, extra=state)
    ledger = state["ledger"]
    if start and not ledger:  # a checkpoint from before the ledger: what it consumed is not known
        log.warning("resumed at step %d from a checkpoint without a sample ledger: the ledger lists steps %d on",
                    start, start + 1)
    train_log = TrainLog(out["report_dir"] / "train_log.csv" if d.main else None,
                         LOG_FIELDS + ["tool_calls"] * tools)  # live: CSV + MLflow
    train_log.resume(restored)
    log_rows = train_log.rows
    # one engine per process at most (vLLM refuses a second sleep-mode engine in a process, and two engines
    # would not fit beside the trainer): the teacher -- a checkpoint folder, frozen -- samples through
    # rollout.backend; the student, built in memory and trained here, samples with the hf backend
    s_backend = with_tools(BACKENDS["hf"](d.plain(student), tok, params.rl.generate_batch_size), tok, params.tools,
                           params.sandbox)
    t_backend = with_tools(BACKENDS[params.rollout.backend](teacher, tok, params.rl.generate_batch_size,
                                                            params.vllm_options()), tok, params.tools, params.sandbox)
    t_backend.release()  # asleep until the teacher samples: its memory is the update's in every other step
    specs = params.reward.rewards
    t_run = time.time()
    for step in tqdm(range(start, len(phases)), initial=start, total=len(phases), desc="distill",
                     disable=not rt.progress):
        phase, t0, pos0 = phases[step], time.time(), cursor.pos
        samplers: list[str] = []  # per prompt drawn (grpo: every one the student's, refills included)
        seed = seeds.distill_step(d_seed, step)
        torch.set_num_threads(rt.generate_threads)
        student.eval()
        # FSDP2: the hf backend's copy refreshed, or the weights streamed into vLLM's engine
        s_backend.load_weights(d.for_generation(student, s_backend), f"student@{step}")
        row: dict[str, Any] = {"step": step + 1, "phase": phase}
        if phase == "grpo":
            for g in opt.param_groups:
                g["lr"] = params.rl.lr
            with amp():
                sb = collect.collect_step(s_backend, tok, prompts, cursor, params.rl, specs, seed,
                                       policy=f"student@{step}", pool=pool)
            first = sb.first_round().numpy()  # [B * G, 3]: reward, correct, length (NaN: unknown)
            reward, correct = first[:, collect.REWARD], first[:, collect.CORRECT]
            torch.set_num_threads(rt.train_threads)
            s_backend.release()
            student.train()
            with amp():
                m, _ = update.update_from_groups(student, opt, sb, params.rl, prompt_ids, tok.pad_token_id,
                                               seed=seed)
            known, scorable = ~np.isnan(correct), ~np.isnan(reward)
            row.update({"loss": m.get("loss"), "entropy": m.get("entropy"), "grad_norm": m.get("grad_norm"),
                        "response_len": float(np.mean(first[:, collect.LENGTH])),
                        "sample_pass_rate": float(np.mean(correct[known] == 1)) if known.any() else None,
                        "reward_mean": float(np.mean(reward[scorable])) if scorable.any() else None,
                        "tool_calls": float(np.mean(first[:, collect.TOOL_CALLS]))})
        else:
            pc = cfg.warmup if phase == "warmup" else cfg.on_policy
            for g in opt.param_groups:
                g["lr"] = pc.lr
            batch = [prompts[i] for i in cursor.take(pc.prompts_per_step)]
            sp = SamplingParams(cfg.temperature, 1.0, cfg.max_new_tokens, seeds.rank(seed, d.rank))
            n_student = 0 if phase == "warmup" else round(cfg.on_policy.student_frac * len(batch))
            samplers = ["student"] * n_student + ["teacher"] * (len(batch) - n_student)
            rows = []
            t_backend.load_weights(teacher, "teacher")  # an engine that slept at level 2 lost them
            with amp():  # each rank samples and trains on its share of each part: rows are never gathered
                for backend, part, who in ((s_backend, batch[:n_student], "student"),
                                           (t_backend, batch[n_student:], "teacher")):
                    if part:
                        mine = sample_rows(backend, tok, d.shard(part), pc.samples_per_prompt, sp, who)[0]
                        rows += score_rows(mine, specs, pool)
            if phase == "warmup" and cfg.warmup.filter_correct:
                rows = [r for r in rows if is_correct(r["rewards"])]
            n_rows, row["sample_pass_rate"], row["tool_calls"] = _step_stats(rows, d)
            torch.set_num_threads(rt.train_threads)
            for b in (s_backend, t_backend):
                b.release()
            student.train()
            if n_rows:  # (every rank decides alike: a rank that kept no row runs zero-weight passes)
                seqs = _seqs(rows, prompt_ids)
                micro = training.MicroBatch(cfg.micro_batch_size, cfg.max_tokens_per_micro_batch, training.seq_tokens)
                with amp():
                    if phase == "warmup" and cfg.warmup.targets == "hard":
                        m = distillation.nll_update(student, opt, seqs, tok.pad_token_id, micro,
                                                    temperature=cfg.temperature, local=True)
                    else:
                        div = "forward_kl" if phase == "warmup" else cfg.on_policy.divergence
                        m = distillation.divergence_update(student, teacher, opt, seqs, div, cfg.on_policy.beta,
                                                           tok.pad_token_id, micro,
                                                           temperature=cfg.temperature, local=True)
                row.update(m)
        drawn = prompts.ids.take(pa.array(cursor.between(pos0, cursor.pos), pa.int64())).to_pylist()
        ledger.append({"step": step + 1, "phase": phase, "ids": drawn,
                       "samplers": samplers or ["student"] * len(drawn)})
        row["seconds"] = round(time.time() - t0, 3)
        train_log.append({k: (float(f"{row[k]:.5g}") if isinstance(row.get(k), float) else row.get(k))
                          for k in train_log.fields})
        done = step + 1
        if done % cfg.checkpoint_every == 0 and done < len(phases):
            checkpoint.save_loop_state(out["checkpoints"], done, fp, cursor.pos, student, opt, log_rows,
                                       extra={"ledger": ledger})
    elapsed = time.time() - t_run

    student.eval()
    final = d.plain(student)
    if not d.main:
        return {"steps": len(phases), "rank": d.rank}
    with atomic_path(out["student"]) as tmp:
        modeling.save_checkpoint(final, tok, tmp, params.model.dtype)
    train_log.close()
    write_distill(ledger, out["report_dir"] / DISTILL_LEDGER)
    write_sft(res["ledger"], out["report_dir"] / STUDENT_SFT_LEDGER)
    if log_rows:
        plots.training_curves(log_rows, "step", ["reverse_kl", "forward_kl", "entropy", "sample_pass_rate"],
                              "distill (A: warmup, B: on-policy" + (", C: grpo)" if cfg.grpo_steps else ")"),
                              out["report_dir"] / "curves.png", phase="phase")
    else:
        out["report_dir"].mkdir(parents=True, exist_ok=True)
        plots.training_curves([{"step": 0, "loss": 0.0}], "step", ["loss"], "distill (no steps)",
                              out["report_dir"] / "curves.png")
    metrics = {"teacher_params": modeling.num_params(teacher), "student_params": student_params,
               "student_sft_seconds": round(sft_seconds, 1), "steps": len(phases), "resumed_from_step": start,
               "phase_steps": {"warmup": cfg.warmup.steps, "on_policy": cfg.on_policy.steps, "grpo": cfg.grpo_steps},
               "seconds": round(elapsed, 1),
               "student_side_seconds": round(sum(r["seconds"] for r in log_rows), 1),
               "generator": generator(params.rollout.backend) if params.rollout.backend == "hf" else
               f"teacher: {generator(params.rollout.backend)}; student: {generator('hf')}"}
    if tools:  # mean tool calls per sampled completion over the steps
        metrics["tool_calls"] = round(float(np.mean([r["tool_calls"] or 0 for r in log_rows])), 4)
    write_metrics(out["metrics"], metrics)
    shutil.rmtree(out["checkpoints"], ignore_errors=True)
    log.info("student %d params; %d distill steps in %.1fs", metrics["student_params"], len(phases), elapsed)
    return metrics


def main() -> None:
    stage_main("distill", lambda p: run(p, *paths(p)), distributed=True,
               needs=lambda p: NEEDS["distill"](p, None))


if __name__ == "__main__":
    main()
