"""Colocated vLLM engines under torchrun (``external_launcher``): every rank builds the backend as the rl stage
does (``BACKENDS["vllm"]`` inside the trainer's process group), samples its own prompt, takes a weight change
and checks its engine's log-probs against its own trainer's; then the trainer's group still works and the job
ends through ``distributed.shutdown``. Run by ``tests/test_vllm_engine.py``.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm_ranks.py FOLDER OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from posttrain import distributed
from posttrain.config import VLLMOptions
from posttrain.modeling import load_model, load_tokenizer
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids


def main(folder: str, out: str) -> None:
    d = distributed.init("auto", "ddp", 300)  # gloo on CPU, nccl on CUDA
    tok, model = load_tokenizer(folder), load_model(folder, "float32")
    backend = BACKENDS["vllm"](model, tok, 8, VLLMOptions(dtype="float32", max_model_len=128, enforce_eager=True))
    ids = chat_prompt_ids(tok, ["3*7="])  # the same request on every rank: only the weights differ
    sp = SamplingParams(1.0, 1.0, 8, 0)
    g = torch.Generator().manual_seed(d.rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))  # each rank's trainer moves differently
    backend.load_weights(model, "v1")
    (group,) = backend.generate(ids, 2, sp)
    gaps = []
    for c in group:
        x = torch.tensor([ids[0] + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0, len(ids[0]) - 1 : -1].float(), -1)
        trainer = logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
        gaps.append(float((trainer - torch.tensor(c.logprobs)).abs().max()))
    t = torch.tensor([d.rank + 1.0])
    torch.distributed.all_reduce(t)  # the trainer's group, after the engine joined it
    Path(out, f"rank{d.rank}.json").write_text(json.dumps(
        {"world": d.world, "tokens": [c.token_ids for c in group], "logprobs": [c.logprobs for c in group],
         "max_gap": max(gaps), "all_reduce": float(t)}))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
