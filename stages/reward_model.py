"""reward_model: a Bradley-Terry reward model (an ensemble of K members) trained on preference pairs. Optional:
one DVC stage ``reward_model@<name>`` per entry of ``reward_model.models`` (none by default).

Inputs: the pairs source (``reward_model.models[<name>]``): the reward stage's folder (``paths.reward_dir``:
``rewards.parquet`` joined in order with ``paths.rollout_dir/rollouts.parquet``; a correct and an incorrect
completion of one prompt make a pair) or a preference JSONL file; ``paths.curated_dir/eval.parquet`` (pairs whose
prompt is an eval prompt are dropped); the SFT policy ``paths.sft_model`` (each member starts from it, with a
fresh scalar head: ``posttrain.reward_model.train``).
Outputs: ``paths.reward_model_dir/<name>/`` (``member_0 .. member_{K-1}``: HF folders; ``manifest.json``; load it
with ``posttrain.reward_model.load_reward_model``), ``paths.reward_model_data_dir/<name>/pairs.parquet`` (every
pair that trained or was held out, with its split), ``paths.reward_model_report_dir/<name>/``
(``member_<k>/train_log.csv``, ``report.md``, ``quarantine.jsonl``: malformed preference rows with their
reasons) and ``metrics/reward_model/<name>.json`` (pair counts; held-out pairwise accuracy with a Wilson 95%
interval and mean margin, per member and for the members' mean score).

Members: member k has its own seed (``member_seed``: head init, batch order) and, with ``bootstrap`` and
K > 1, its own resample with replacement of the training pairs. Resumable: a killed run resumes the member it was
training from its last checkpoint and keeps the members it finished (``paths.reward_model_checkpoints/<name>``,
not a DVC out). The held-out scores come from the saved artifact through ``load_reward_model``: the metrics
describe exactly what a later stage loads.

Run: ``dvc repro reward_model@<name>`` (or ``dvc repro`` once ``reward_model.models`` names it), or
``python -m stages.reward_model --model <name> [--params params.yaml]``.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from posttrain import checkpoint, modeling
from posttrain.config import Params
from posttrain.errors import StageError
from posttrain.outputs import as_one_set, atomic_path
from posttrain.reward_model import pairs as rm_pairs
from posttrain.reward_model.scorer import load_reward_model, load_scorer, make_trainable, pad_id, write_manifest
from posttrain.reward_model.train import (
    LOG_FIELDS,
    EncodedPair,
    bootstrap_indices,
    encode_pairs,
    ensemble_stats,
    member_seed,
    pairs_seed,
    train_member,
)
from posttrain.runfacts import write_metrics
from posttrain.runner import model_arg, stage_main
from posttrain.schema import read_columns, write_jsonl, write_text
from posttrain.trainlog import TrainLog
from stages.layout import reward_model as paths

log = logging.getLogger("reward_model")


def run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    """Train. ``inputs``: name, source, rollouts, eval, sft_model. ``out``: model, data, checkpoints, report_dir,
    metrics."""
    with as_one_set(out, f"reward_model@{inputs['name']}", at_once=("checkpoints", "report_dir")):
        return _run(params, inputs, out)


def build_pairs(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> tuple[pa.Table, dict[str, Any]]:
    """The pairs with their split (Arrow, ``rm_pairs.PAIR_SCHEMA``), and the counts of every step; malformed file
    rows go to quarantine.jsonl."""
    cfg, arm = params.reward_model, params.seed + params.reward_model.seed
    source = Path(inputs["source"])
    if source.is_dir():
        built, counts = rm_pairs.rollout_pairs(inputs["rollouts"], source / "rewards.parquet", cfg.verifier,
                                               cfg.pairs_per_prompt, pairs_seed(arm))
        bad: list[dict[str, Any]] = []
    else:
        built, bad, n = rm_pairs.read_preference_file(source)
        counts = {"rows": n, "quarantined": len(bad), "pairs_read": built.num_rows}
    write_jsonl(out["report_dir"] / "quarantine.jsonl", bad)
    if bad and len(bad) > cfg.max_quarantined_frac * counts["rows"]:
        raise StageError(f"{source}: {len(bad)} of {counts['rows']} rows malformed (> reward_model."
                         f"max_quarantined_frac={cfg.max_quarantined_frac}); reasons in "
                         f"{out['report_dir'] / 'quarantine.jsonl'}")
    eval_prompts = read_columns(inputs["eval"], ["prompt"]).column("prompt").to_pylist()
    rows, final = rm_pairs.finalize(built, eval_prompts, cfg.max_pairs, cfg.heldout_frac, pairs_seed(arm))
    return rows, {"source": counts, **final}


def _run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    cfg, name, t0 = params.reward_model, inputs["name"], time.time()
    sft = str(inputs["sft_model"])
    rows, counts = build_pairs(params, inputs, out)
    tok = modeling.load_tokenizer(sft)
    pad = pad_id(tok)
    context = json.loads((Path(sft) / "config.json").read_text()).get("max_position_embeddings")
    limit = min(x for x in (cfg.max_len, context, 2**62) if isinstance(x, int))  # the tighter of the two
    train, fits = encode_pairs(tok, rows, limit)
    counts["over_max_len"] = int((~fits).sum())
    rows = rows if fits.all() else rows.filter(pa.array(fits))
    held = rows.filter(pc.equal(rows.column("split"), "heldout"))
    counts["train"], counts["heldout"] = len(train), held.num_rows
    if not train or not held.num_rows:
        raise StageError(f"reward_model@{name}: {len(train)} training and {held.num_rows} held-out pairs (need "
                         f"both; counts {counts}): more pairs, or another reward_model.heldout_frac")
    with atomic_path(out["data"]) as tmp:
        tmp.mkdir()
        pq.write_table(rows.combine_chunks(), tmp / "pairs.parquet")
    digest = rm_pairs.pairs_digest(rows)

    device = modeling.resolve_device(params.runtime.device)
    member_info = [_member(params, inputs, out, k, train, tok, pad, device, digest) for k in range(cfg.members)]
    with atomic_path(out["model"]) as tmp:
        tmp.mkdir()
        for k in range(cfg.members):
            shutil.copytree(out["checkpoints"] / f"member_{k}", tmp / f"member_{k}")
        write_manifest(tmp, {"kind": "bradley_terry", "name": name, "members": [f"member_{k}" for k in
                                                                                range(cfg.members)],
                             "seeds": [m["seed"] for m in member_info], "base": sft,
                             "base_digest": modeling.checkpoint_digest(sft), "pairs_digest": digest,
                             "train_pairs": len(train), "source": str(inputs["source"])})
        scorer = load_reward_model(tmp, device, batch_size=cfg.eval_batch_size)
        prompts = held.column("prompt").to_pylist()  # held out: a small share of the pairs
        chosen = scorer(prompts, held.column("chosen").to_pylist())  # [N, K]
        rejected = scorer(prompts, held.column("rejected").to_pylist())
    stats = ensemble_stats(chosen, rejected)
    metrics = {"pairs": counts, "members": cfg.members, "heldout": stats,
               "final_loss": {f"member_{k}": m["final_loss"] for k, m in enumerate(member_info)},
               "seconds": round(time.time() - t0, 1)}
    write_text(out["report_dir"] / "report.md", report_markdown(name, counts, stats))
    write_metrics(out["metrics"], metrics)
    shutil.rmtree(out["checkpoints"], ignore_errors=True)  # finished: the artifact holds every member now
    e = stats["ensemble_mean"]
    log.info("held-out pairwise accuracy %.3f [%.3f, %.3f] on %d pairs (%d members)", e["accuracy"],
             *e["accuracy_ci"], e["pairs"], cfg.members)
    return metrics


def _member(params: Params, inputs: dict[str, Any], out: dict[str, Path], k: int, train: list[EncodedPair], tok: Any,
            pad: int, device: Any, digest: str) -> dict[str, Any]:
    """Member ``k`` trained (or found finished in the checkpoints folder) and saved to
    ``checkpoints/member_<k>`` as an HF folder with ``member.json`` (fingerprint, seed, log)."""
    cfg, sft = params.reward_model, str(inputs["sft_model"])
    seed = member_seed(params.seed + cfg.seed, k)
    fp = checkpoint.fingerprint(cfg.model_copy(update={"models": {}}), params.model, params.seed, k, digest,
                                modeling.checkpoint_digest(sft))
    done = out["checkpoints"] / f"member_{k}"
    tlog = TrainLog(out["report_dir"] / f"member_{k}" / "train_log.csv", LOG_FIELDS, name=f"member_{k}")
    info = json.loads((done / "member.json").read_text()) if (done / "member.json").is_file() else {}
    if info.get("fingerprint") == fp:
        log.info("member %d: finished by an earlier run (%s)", k, done)
        tlog.resume(info["log"])
        tlog.close()
        return info
    idx = bootstrap_indices(len(train), seed, cfg.bootstrap and cfg.members > 1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the fresh head's init (and LoRA's A matrices)
        model = load_scorer(sft, params.model.dtype, device, trainable=params.model.lora is None,
                            attn_implementation=params.model.attn_implementation, pad_token_id=pad)
        model = make_trainable(model, params.model.lora, params.model.gradient_checkpointing)
    with modeling.autocast(params.model.dtype, device):
        res = train_member(model, [train[i] for i in idx], cfg, pad, seed, out["checkpoints"] / f"ckpt_{k}", fp,
                           params.runtime.progress, f"reward_model@{inputs['name']} member {k}", tlog)
    tlog.close()
    info = {"fingerprint": fp, "seed": seed, "train_pairs": len(idx), "distinct_train_pairs": len(set(idx.tolist())),
            "final_loss": res["log"][-1]["loss"], "seconds": round(res["seconds"], 1), "log": res["log"]}
    with atomic_path(done, now=True) as tmp:
        modeling.save_checkpoint(model, tok, tmp, params.model.dtype)
        (tmp / "member.json").write_text(json.dumps(info) + "\n")
    shutil.rmtree(out["checkpoints"] / f"ckpt_{k}", ignore_errors=True)
    return info


def report_markdown(name: str, counts: dict[str, Any], stats: dict[str, Any]) -> str:
    lines = [f"# Reward model {name}", "", f"Pairs: {json.dumps(counts)}", "",
             "Held-out pairwise accuracy (r(chosen) > r(rejected); a tie counts as wrong), Wilson 95% interval:", "",
             "| scorer | pairs | accuracy | 95% interval | ties | mean margin |", "|---|---:|---:|---|---:|---:|"]
    for who, s in stats.items():
        lo, hi = s["accuracy_ci"]
        lines.append(f"| {who} | {s['pairs']} | {s['accuracy']:.4f} | [{lo:.4f}, {hi:.4f}] | {s['ties']} | "
                     f"{s['margin']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    name, argv = model_arg(sys.argv[1:])
    stage_main(f"reward_model@{name}", lambda p: run(p, *paths(p, name)), argv)


if __name__ == "__main__":
    main()
