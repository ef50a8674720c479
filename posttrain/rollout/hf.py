"""The default rollout backend: a KV-cached decode loop over a transformers causal LM, batched across
prompts x samples.

Prompts are left-padded and prefilled once: one prefill serves a prompt's n samples (its KV cache is
repeated n times). Then one token per step for every live row; late steps only pay for the sequences still
running (finished rows leave in groups, below). A row stops at any of the model's stop token ids (every EOS id of its
generation_config, e.g. Qwen's <|im_end|> and <|endoftext|>) or when its decoded tail contains one of
generation_config.stop_strings or of the call's ``sampling.stop`` (the tool loop's closing call tags; the text
is cut before the model's own, the token ids keep everything sampled); the rest of the batch keeps decoding.
Finished rows stay in the batch (computed, never sampled or recorded) until they are a quarter of it, then leave
together: dropping a row copies every layer's KV cache, and one copy per finished row made a 128-row batch of
~130-token GSM8K answers spend most of its time copying.
Prompts are chunked in order of length (a stable sort; the results come back in the caller's order), so a chunk
pads its prompts to like lengths: the evaluate stage's 256-prompt chunks of GSM8K-test (54-218 prompt tokens)
prefilled 237,147 positions for 121,347 real ones in the caller's order, 136,246 sorted.
Sampling applies temperature, then top-p, and records the log-prob of each sampled token under that processed
distribution (the sampler's log-prob). Each chunk is seeded from ``sampling.seed`` and its index with its own
``torch.Generator``: the same call gives the same completions. Works on CPU and GPU (the model's device).

Why not ``model.generate``: on the tiny default model generate's per-token machinery (logits processors,
stopping criteria, score bookkeeping, finished rows kept in the batch) cost more than the model itself;
on CPU this loop gives 1.1-2.0x its tokens/s (benchmarks/rollout.py, docs/performance.md). Greedy output
equals ``model.generate`` (tests/test_rollout.py).

The KV cache is transformers' ``DynamicCache`` with its full-attention layers swapped for :class:`GrowingLayer`:
keys and values sit in buffers with spare room, so a decode step writes one position in place instead of
concatenating (copying) the whole cache, as ``DynamicLayer`` does every step. On SmolLM2-135M at batch 64 and
~150 cached positions the concatenations took 50-310 ms of a 330-670 ms step (fresh allocations page-fault).

Sampling runs under ``no_grad``, not ``inference_mode``: the rl stage samples with the trainer's fp32 model inside
a ``torch.autocast`` region (``model.dtype: bfloat16``), and autocast caches a weight's low-precision cast for
the region only outside inference mode; inside it, every decoded token recast all the model's weights (on
SmolLM2-135M on 2 Xeon cores bf16 sampling took 1.4x fp32's time). The cache costs one bf16 copy of the weights
(2 bytes a parameter) while the region lasts, which ``posttrain plan`` counts in its generation phase.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from posttrain.modeling import stop_ids
from posttrain.rollout.base import Completion, SamplingParams, cut_before


def sample_next(logits: torch.Tensor, s: SamplingParams, gen: torch.Generator | None,
                u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [b, V] -> (token [b], its log-prob under the processed distribution [b]).

    Greedy (temperature 0): argmax, log-prob under the unscaled softmax. Otherwise logits / temperature,
    then nucleus filtering (the smallest set of tokens whose probability reaches ``top_p``; the top token
    always stays), renormalised, and one draw by inverse transform: a uniform u per row, the first token whose
    cumulative probability exceeds u. One random number per row: ``torch.multinomial`` draws an exponential
    per vocabulary entry (49,152 per row on SmolLM2), 476 ms a step at 256 rows on this CPU against 67 ms.
    ``u`` [b, 1]: the uniforms to use (the decode loop draws one per original row, so a row's samples do not depend
    on which other rows are still running); None: drawn from ``gen``.
    """
    logits = logits.float()
    if s.temperature == 0:
        tok = logits.argmax(-1)
        return tok, logits.gather(-1, tok[:, None]).squeeze(1) - torch.logsumexp(logits, -1)
    logits = logits / s.temperature
    if s.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= s.top_p  # mass before this token already reaches top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    lse = torch.logsumexp(logits, -1, keepdim=True)  # [b, 1]
    cdf = (logits - lse).exp_().cumsum_(-1)  # [b, V]; a filtered token adds nothing: never drawn
    if u is None:
        u = torch.rand((logits.shape[0], 1), generator=gen, device=logits.device)
    u = u * cdf[:, -1:]
    tok = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)
    return tok, (logits.gather(-1, tok[:, None]) - lse).squeeze(1)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose keys/values [B, H, T, D] are views of buffers with room to grow (doubling): an
    appended position is written in place (amortised O(1) per step, not O(T))."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.n, self._k, self._v = 0, None, None

    def _views(self) -> None:
        self.keys, self.values = self._k[..., : self.n, :], self._v[..., : self.n, :]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[-2]
        if self._k is None or self.n + t > self._k.shape[-2]:
            cap = max(self.n + t, 2 * (0 if self._k is None else self._k.shape[-2]), 64)
            k, v = (x.new_empty((*x.shape[:-2], cap, x.shape[-1])) for x in (key_states, value_states))
            if self.n:
                k[..., : self.n, :], v[..., : self.n, :] = self.keys, self.values
            self._k, self._v = k, v
        self._k[..., self.n : self.n + t, :] = key_states
        self._v[..., self.n : self.n + t, :] = value_states
        self.n += t
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length():
            self._k, self._v = self._k.repeat_interleave(repeats, 0), self._v.repeat_interleave(repeats, 0)
            self._views()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length():
            self._k, self._v = self._k[indices], self._v[indices]
            self._views()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("GrowingLayer: the decode loop never crops")

    def reset(self) -> None:
        self.n, self._k, self._v = 0, None, None
        super().reset()


def growing_cache(config: object) -> DynamicCache:
    """``DynamicCache(config)`` with every plain full-attention layer a :class:`GrowingLayer` (sliding-window and
    other special layers stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class HFBackend:
    samples_with_module = True  # generates with the trainer's model itself (under FSDP2: Dist.plain's copy)

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, batch_size: int = 256):
        self.model, self.tok, self.batch_size = model, tokenizer, batch_size
        self.pad_id = tokenizer.pad_token_id
        self.stop_ids = stop_ids(model.generation_config, tokenizer)  # its EOS ids + the tokenizer's
        self.stop_strings = list(model.generation_config.stop_strings or [])

    def load_weights(self, model: PreTrainedModel, version: str) -> None:
        """Nothing to copy: this backend samples with the trainer's model object itself."""

    def release(self) -> None:
        """Nothing to free: the KV cache lives only during ``generate``."""

    @torch.no_grad()  # not inference_mode: there autocast recasts every weight at every forward (module docstring)
    def generate(self, prompt_ids: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        per = max(1, self.batch_size // n)  # whole groups per chunk: each prompt is prefilled once for its n rows
        order = sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]))  # chunks of like lengths: less padding
        out: list[list[Completion]] = [[] for _ in prompt_ids]
        for c, start in enumerate(range(0, len(order), per)):
            idx = order[start : start + per]
            comps = self._chunk([prompt_ids[i] for i in idx], n, sampling, chunk_seed=sampling.seed + c)
            for j, i in enumerate(idx):
                out[i] = comps[j * n : (j + 1) * n]
        return out

    def _chunk(self, prompts: list[list[int]], n: int, s: SamplingParams, chunk_seed: int) -> list[Completion]:
        """Rows i*n .. i*n+n-1 sample prompt i."""
        device = self.model.device
        k, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((k, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        gen = torch.Generator(device=device).manual_seed(chunk_seed)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = growing_cache(self.model.config)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                            use_cache=True, logits_to_keep=1).logits[:, -1]  # the head at the last position only
        if n > 1:  # the n samples of a prompt share its prefill
            cache.batch_repeat_interleave(n)
            logits, mask, pos = (x.repeat_interleave(n, dim=0) for x in (logits, mask, pos))
        b = k * n
        next_pos = pos[:, -1] + 1
        rows = torch.arange(b, device=device)  # original row of each batch row
        alive = torch.ones(b, dtype=torch.bool, device=device)  # batch rows still decoding
        tokens = torch.full((b, s.max_new_tokens), self.pad_id, dtype=torch.long, device=device)
        logps = torch.zeros((b, s.max_new_tokens), device=device)
        lengths = torch.full((b,), s.max_new_tokens, dtype=torch.long, device=device)
        stopped = torch.zeros(b, dtype=torch.bool, device=device)
        stop = torch.tensor(self.stop_ids, device=device)
        strings = self.stop_strings + [x for x in s.stop if x not in self.stop_strings]  # the model's + this call's
        window = 4 * max((len(x) for x in strings), default=0) + 1  # tokens: >= 1 byte each
        tok = torch.full((b,), self.pad_id, dtype=torch.long, device=device)
        for t in range(s.max_new_tokens):
            live = rows[alive]
            u = torch.rand((b, 1), generator=gen, device=device)[live]  # a uniform per original row, every step
            tok[alive], lp = sample_next(logits[alive], s, gen, u)  # finished rows sample nothing
            tokens[live, t], logps[live, t] = tok[alive], lp
            done = torch.isin(tok[alive], stop)
            if strings:  # decode each live row's tail: a stop string just completed?
                tails = tokens[live, max(0, t + 1 - window) : t + 1].tolist()
                done |= torch.tensor([any(x in self.tok.decode(r) for x in strings) for r in tails], device=device)
            if done.any():
                lengths[live[done]], stopped[live[done]] = t + 1, True
                alive[alive.nonzero().squeeze(1)[done]] = False
                if not alive.any():
                    break
                if 4 * (~alive).sum() >= alive.numel():  # drop finished rows once they are a quarter of the batch:
                    keep = alive.nonzero().squeeze(1)  # each drop copies the whole KV cache
                    cache.batch_select_indices(keep)
                    rows, alive, tok, mask, next_pos = rows[keep], alive[keep], tok[keep], mask[keep], next_pos[keep]
            if t + 1 == s.max_new_tokens:
                break
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = self.model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos[:, None],
                                past_key_values=cache, use_cache=True).logits[:, -1]
            next_pos = next_pos + 1
        tokens, logps, lengths, stopped = tokens.cpu(), logps.cpu(), lengths.tolist(), stopped.tolist()
        res = []
        for i in range(b):
            toks = tokens[i, : lengths[i]].tolist()
            res.append(Completion(self._text(toks), toks, logps[i, : lengths[i]].tolist(),
                                  "stop" if stopped[i] else "length"))
        return res

    def _text(self, toks: list[int]) -> str:
        """The completion's text, special tokens skipped and cut before the first stop string (as vLLM does)."""
        return cut_before(self.tok.decode(toks, skip_special_tokens=True), self.stop_strings)
