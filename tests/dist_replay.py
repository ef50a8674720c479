"""One rl update replayed from a persisted rollout shard, then one distill step (reverse KL of the starting
policy to the updated one, on the same sequences), as one process or under torchrun (the distributed tests
launch it both ways and compare the weights rank 0 saves).

    python [-m torch.distributed.run --nproc_per_node N] tests/dist_replay.py OUT POLICY SHARD PARAMS [PARAMS ...]

Each params file is one variant (e.g. full fine-tuning and LoRA), run in turn in the same job (the first file's
``runtime.distributed`` sets up the job); OUT gets {params file stem: weights and metrics}.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from posttrain import distillation, distributed, logprobs, modeling, training
from posttrain.config import Params, load_params
from posttrain.rl import collect, update
from posttrain.rollout import chat_prompt_ids
from posttrain.schema import read_parquet


def main(out: str, policy: str, shard: str, *params_files: str) -> None:
    d = load_params(params_files[0]).runtime.distributed
    dist = distributed.init(d.backend, d.strategy, d.timeout_s) if distributed.launched() else distributed.current()
    results = {Path(f).stem: variant(dist, load_params(f), policy, shard) for f in params_files}
    if dist.main:
        torch.save(results, out)
    distributed.shutdown()


def variant(dist: distributed.Dist, params: Params, policy: str, shard: str) -> dict:
    torch.set_num_threads(params.runtime.train_threads)
    torch.manual_seed(params.seed)  # as stage_main seeds a stage (LoRA adapters start from the same draw)
    cfg, g = params.rl, params.rl.samples_per_prompt
    rows = read_parquet(Path(shard))
    sb = collect.StepBatch.from_rows(rows, g)  # each rank keeps its share of the groups, as collect_step does
    tok = modeling.load_tokenizer(policy)
    model = modeling.load_policy(policy, params.model, torch.device("cpu"), meta=dist.loads_on_meta)
    assert all(p.is_meta for p in model.parameters()) == dist.loads_on_meta  # FSDP2: only rank 0 reads weights
    ref = dist.load_frozen(lambda: modeling.load_model(policy), lambda: modeling.empty_model(policy),  # as rl
                           torch.device("cpu")) if cfg.kl_coef > 0 and params.model.lora is None else None
    prompts = {r["prompt_id"]: r["prompt"] for r in rows}
    prompt_ids = dict(zip(prompts, chat_prompt_ids(tok, list(prompts.values())), strict=True))
    lora_ref = model if params.model.lora is not None and cfg.kl_coef > 0 else None  # its adapter off, as rl
    model = dist.wrap(model)
    opt = training.adamw(model, cfg.lr, cfg.weight_decay, training.ONLINE_BETAS)  # as stages/rl.py
    metrics, _ = update.update_from_groups(model, opt, sb, cfg, prompt_ids, tok.pad_token_id,
                                           ref if ref is not None else lora_ref, seed=7)
    # after the update scored it: a frozen root FSDP2 never reshards in backward must reshard after forward
    ref_bytes = sum(_local(p).numel() * p.element_size() for p in ref.parameters()) if ref is not None else 0
    mine = [logprobs.Seq(prompt_ids[r["prompt_id"]], list(r["token_ids"]), list(r["logprobs"]), 0.0)
            for i in sb.rows for r in sb.rows[i]]  # this rank's rows
    zero_rank = None
    if ref is not None:  # a KL update where rank 1 holds no sequence (its groups dropped): its share of the
        # reference's scoring is fillers, in step with rank 0 (lr 0: the weights stay those recorded below)
        fresh = [logprobs.Seq(s.prompt_ids, s.completion_ids, s.logprobs, 0.0) for s in mine]
        zero_rank = update.policy_update(model, torch.optim.SGD(model.parameters(), lr=0.0),
                                         fresh if dist.rank == 0 else [], cfg, tok.pad_token_id, ref)
    reset_gap = None
    if ref is not None:  # ProRL's reset: the reference becomes the updated policy, as the rl stage calls it
        update.reset_reference(ref, dist.scoring(model))
        mine = mine if dist.rank == 0 else []  # unequal micro-batch counts: FSDP2's forwards in lockstep
        logprobs.fill(ref, mine, "ref_logp", tok.pad_token_id, cfg.micro_batch_size, cfg.pack, 1.0)
        logprobs.fill(dist.scoring(model), mine, "old_logp", tok.pad_token_id, cfg.micro_batch_size, cfg.pack, 1.0)
        reset_gap = dist.max(max((float((s.ref_logp - s.old_logp).abs().max()) for s in mine), default=0.0))
    teacher = dist.plain(model)
    updated = {k: v.clone() for k, v in teacher.state_dict().items()}
    with torch.no_grad():  # a teacher measurably unlike the student: the updated policy, its head scaled
        teacher.get_output_embeddings().weight.mul_(3.0)
    student = dist.wrap(modeling.load_policy(policy, params.model, torch.device("cpu"), meta=dist.loads_on_meta))
    s_opt = torch.optim.SGD(modeling.trainable_params(student), lr=1.0)  # weights move by the gradient itself
    seqs = [logprobs.Seq(prompt_ids[r["prompt_id"]], list(r["token_ids"]), list(r["logprobs"]), 0.0) for r in rows]
    # as the distill stage: each rank passes the rows it sampled (local); here rank 0 holds them all and rank 1
    # none (a rank whose samples a warmup filter dropped): it runs zero-weight passes, the step is world 1's
    mine = seqs if dist.rank == 0 else []
    d_metrics = distillation.divergence_update(student, teacher, s_opt, mine, "reverse_kl", 0.5, tok.pad_token_id,
                                               cfg.micro_batch_size, local=True)
    distilled = dist.plain(student)
    return {"state": updated, "metrics": metrics, "student": distilled.state_dict(), "distill_metrics": d_metrics,
            "ref_bytes": ref_bytes, "reset_gap": reset_gap,
            "zero_rank": zero_rank}


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


if __name__ == "__main__":
    main(*sys.argv[1:])
