"""FSDP2's weights streamed into colocated vLLM engines (issue 50, item 1): under torchrun (gloo) every rank
holds half of the policy (``Dist.wrap``, FSDP2), builds its engine as the rl stage does (``policy_source``: the
policy's folder, not ``Dist.plain``'s copy), takes one AdamW step, and syncs its engine from
``Dist.for_generation``'s stream (one all-gathered parameter at a time) without ``Dist.plain``'s full copy ever
being allocated; each engine's sampler log-probs are then checked against the trainer's new weights (and shown
to differ from the old ones). Run by ``tests/test_vllm_engine.py``.

    python -m torch.distributed.run --nproc_per_node 2 tests/vllm_fsdp2.py FOLDER OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from posttrain import distributed
from posttrain.config import VLLMOptions
from posttrain.distributed import forward
from posttrain.modeling import load_model, load_tokenizer
from posttrain.rollout import BACKENDS, ModelFolder, SamplingParams, chat_prompt_ids, policy_source


def _gap(model: torch.nn.Module, prompt: list[int], group: list) -> float:
    """The largest |trainer log-prob - sampler log-prob| over ``group``'s tokens, ``model`` scored alone."""
    gaps = []
    for c in group:
        x = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x).logits[0, len(prompt) - 1 : -1].float(), -1)
        gaps.append(float((logp.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(1)
                           - torch.tensor(c.logprobs)).abs().max()))
    return max(gaps)


def main(folder: str, out: str) -> None:
    d = distributed.init("auto", "fsdp2", 300)
    tok, model = load_tokenizer(folder), load_model(folder, "float32")
    old = load_model(folder, "float32")  # the weights before the step, for the control
    wrapped = d.wrap(model.train(), "float32")
    src = policy_source("vllm", lambda: d.plain(wrapped), ModelFolder(folder, "float32"))  # as the rl stage builds it
    backend = BACKENDS["vllm"](src, tok, 8, VLLMOptions(dtype="float32", max_model_len=128, enforce_eager=True))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    ids = torch.tensor([chat_prompt_ids(tok, ["12*3="])[0] + [5, 6, 7]])
    loss = forward(wrapped, lambda m, x: m(input_ids=x).logits.float().logsumexp(-1).mean(), ids)
    loss.backward()
    opt.step()
    backend.load_weights(d.for_generation(wrapped, backend), "v1")
    copy_ = d._copies[id(wrapped)]
    copy_bytes = sum(p.numel() * p.element_size() for p in copy_.parameters() if not p.is_meta)
    prompt = chat_prompt_ids(tok, ["3*7="])[0]
    (group,) = backend.generate([prompt], 2, SamplingParams(1.0, 1.0, 8, 0))
    new = d.plain(wrapped)  # the trainer's full weights after the step, to score against (allocated only now)
    Path(out, f"rank{d.rank}.json").write_text(json.dumps(
        {"world": d.world, "copy_bytes_after_sync": copy_bytes, "gap_new": _gap(new, prompt, group),
         "gap_old": _gap(old, prompt, group), "local_params": sum(p.to_local().numel() for p in wrapped.parameters()),
         "params": sum(p.numel() for p in old.parameters())}))
    distributed.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
