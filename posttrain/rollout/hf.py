"""The default rollout backend: transformers ``generate``, batched across prompts x samples.

Prompts are left-padded, the KV cache is on, generation stops per sequence at EOS (a finished sequence
only emits padding) and each chunk is seeded from ``sampling.seed`` and its index, so the same call gives
the same completions. Works on CPU and GPU (the model's device).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.rollout import Completion, SamplingParams


class HFBackend:
    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 256):
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.pad_id = tokenizer.pad_token_id
        self.eos_id = tokenizer.eos_token_id

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        flat = [p for p in prompt_ids for _ in range(n)]  # prompt i's samples are rows i*n .. i*n+n-1
        out: list[Completion] = []
        for c, start in enumerate(range(0, len(flat), self.batch_size)):
            out += self._chunk(flat[start : start + self.batch_size], sampling, chunk_seed=sampling.seed + c)
        return [out[i * n : (i + 1) * n] for i in range(len(prompt_ids))]

    def _chunk(self, prompts: list[list[int]], s: SamplingParams, chunk_seed: int) -> list[Completion]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        device = self.model.device
        greedy = s.temperature == 0
        torch.manual_seed(chunk_seed)
        gen = self.model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            do_sample=not greedy,
            temperature=None if greedy else s.temperature,
            top_p=None if greedy else s.top_p,
            top_k=None,
            max_new_tokens=s.max_new_tokens,
            pad_token_id=self.pad_id,
            eos_token_id=self.eos_id,
            output_scores=True,
            return_dict_in_generate=True,
        )
        new = gen.sequences[:, width:].cpu()  # [B, T_new]
        # scores: T_new x [B, V], the processed (temperature / top-p) logits actually sampled from
        logp = torch.stack([torch.log_softmax(x.float(), dim=-1) for x in gen.scores], dim=1).cpu()
        tok_logp = logp.gather(-1, new.unsqueeze(-1)).squeeze(-1)  # [B, T_new]
        res = []
        for i in range(new.shape[0]):
            row = new[i].tolist()
            if self.eos_id in row:
                end, reason = row.index(self.eos_id) + 1, "stop"
            else:
                end, reason = len(row), "length"
            toks = row[:end]
            text = self.tok.decode(toks, skip_special_tokens=True)
            res.append(Completion(text, toks, tok_logp[i, :end].tolist(), reason))
        return res
