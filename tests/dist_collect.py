"""One rl step's collect -> update -> shard on a stand-in sampler whose rewards are known, as one process or under
torchrun (``tests/test_distributed.py`` launches it both ways and compares). Each rank saves what it saw.

    python [-m torch.distributed.run --nproc_per_node N] tests/dist_collect.py OUT_DIR

The stand-in answers prompt i's sample j correctly iff j < i (group rewards [0000], [1000], [1100], [1110]) with
``64 + 8 i + j`` tokens, so per-token data is thousands of bytes a step while its scalars are a few hundred.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as tdist

from posttrain import distributed
from posttrain.config import Rl, TinyModel
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from posttrain.rl import collect, select, shards, update
from posttrain.rollout import Completion, chat_prompt_ids

G = 4


class StandIn:
    """A RolloutBackend whose completions depend only on the prompt (its index ``i``) and the sample ``j``."""

    def __init__(self, index: dict[tuple[int, ...], tuple[int, int]]) -> None:
        self.index = index

    def generate(self, prompt_ids: list[list[int]], n: int, sampling: object) -> list[list[Completion]]:
        out = []
        for p in prompt_ids:
            i, answer = self.index[tuple(p)]
            out.append([Completion(f"answer: {answer if j < i else answer + 1}", [5 + (j + k) % 7 for k in
                                   range(64 + 8 * i + j)], [-0.5 - 0.01 * k for k in range(64 + 8 * i + j)], "stop")
                        for j in range(n)])
        return out

    def load_weights(self, model: object, version: str) -> None: ...

    def release(self) -> None: ...


def main(out: str) -> None:
    d = distributed.init("gloo", "ddp", 60) if distributed.launched() else distributed.current()
    torch.manual_seed(0)

    def no_pickles(*a: object, **k: object) -> None:
        raise AssertionError("all_gather_object called during an rl step")

    tdist.all_gather_object = no_pickles  # nothing of a step goes through pickled gathers
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    prompts = [{"id": f"p{i}", "prompt": f"{10 + i}*3=", "answer": str((10 + i) * 3), "task": "arith"}
               for i in range(4)]
    ids = chat_prompt_ids(tok, [p["prompt"] for p in prompts])
    backend = StandIn({tuple(x): (i, (10 + i) * 3) for i, x in enumerate(ids)})
    cfg = Rl(prompts_per_step=4, samples_per_prompt=G, dynamic_sampling="off", micro_batch_size=3, lr=1e-2,
             sampling={"max_new_tokens": 128})
    specs = [SimpleNamespace(name="correct", weight=1.0, kwargs={})]
    cursor = select.PromptCursor(4, seed=0)
    cursor.take = lambda k: list(range(k))  # prompts in order: p0..p3 (p0, p1 on rank 0 of 2)
    sb = collect.collect_step(backend, tok, prompts, cursor, cfg, specs, seed=0, policy="p")
    collect_bytes = d.gathered_bytes
    wrapped = d.wrap(model)
    opt = torch.optim.SGD(wrapped.parameters(), lr=cfg.lr)
    metrics, adv = update.update_from_groups(wrapped, opt, sb, cfg, dict(zip([p["id"] for p in prompts], ids,
                                                                             strict=True)), tok.pad_token_id)
    step_bytes = d.gathered_bytes
    shards.write_shard(Path(out) / "shard.parquet", sb, adv, 1)
    r, valid = sb.reward_matrix(sb.used)
    torch.save({"rewards": r, "valid": valid, "adv": adv, "zero_var_frac": sb.zero_var_frac, "metrics": metrics,
                "local_groups": sorted(sb.rows), "local_tokens": sum(len(x["token_ids"]) for grp in sb.rows.values()
                                                                      for x in grp),
                "collect_bytes": collect_bytes, "step_bytes": step_bytes, "sent_bytes": d.sent_bytes,
                "state": {k: v.clone() for k, v in d.plain(wrapped).state_dict().items()}},
               Path(out) / f"rank{d.rank}.pt")
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
