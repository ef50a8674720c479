"""Memory-lean per-token log-probs: the LM head runs only at the positions that are scored, in chunks.

A training forward used to take ``model(...).logits``: a [B, T, V] tensor, plus its fp32 copy, log-softmax
and the autograd buffers of each. With a real vocabulary (Qwen2.5: V = 151,936) one 64 x 600-token
micro-batch is 23 GB per fp32 copy. Here the decoder runs once ([B, T, H] hidden states, H << V), the
completion positions are picked out ([N, H]), and the head + log-softmax + gather + entropy run on chunks of
``chunk`` positions under ``torch.utils.checkpoint``: a chunk's [chunk, V] logits exist only while that chunk
is computed, forward and again in backward. Peak logit memory is O(chunk x V) whatever B and T are, and
the values are those of the full-logits path (the same ops on the same rows; ``tests/test_logprobs.py``).

Used by every training forward: rl (policy, old log-probs, reference), distill (student and teacher), SFT.
Generation keeps only the last position's logits (``logits_to_keep=1`` in ``rollout/hf.py``).

Why by hand: Liger's fused linear + cross-entropy is the field's kernel for this, but it needs Triton and a
GPU (this pipeline must train on CPU too), returns a loss rather than per-token log-probs and entropies
at a sampling temperature, and has no divergence between two models' distributions, which distill needs.
Chunked PyTorch is exact, runs everywhere, and is ~30 lines.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

DEFAULT_CHUNK = 256  # positions per head chunk: 256 x 151,936 fp32 logits = 156 MB per copy


def decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The model's decoder stack (hidden states after the final norm) and its LM head. A peft model's
    LoRA layers live inside the base model's modules, so both stay adapted (or disabled) as the peft model is."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(base.config, attr, None) not in (None, 1.0):
            raise NotImplementedError(f"{type(base).__name__} transforms its logits ({attr}); the memory-lean "
                                      "log-prob path applies the plain LM head only")
    return base.get_decoder(), base.get_output_embeddings()


def hidden_at_targets(model: torch.nn.Module, t: dict[str, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder hidden states at the positions whose next token is scored.

    ``t`` is a ``grpo.batch_tensors`` batch: ``mask`` [B, T-1] (1 where target t+1 is scored) and either a
    padded input (``ids``, ``attn`` [B, T]) or a packed one (``ids``, ``pos`` [R, W], ``gather`` [B, T-1]).
    Returns hidden [N, H], target ids [N] and the flat index [N] of each position in [B * (T-1)]
    (N = mask.sum())."""
    decoder, _ = decoder_and_head(model)
    if "gather" in t:
        out = decoder(input_ids=t["ids"], position_ids=t["pos"], use_cache=False)
    else:
        out = decoder(input_ids=t["ids"], attention_mask=t["attn"], use_cache=False)
    h = out.last_hidden_state[:, :-1]  # [rows, width-1, H]: position t predicts token t+1
    where = t["mask"].flatten().nonzero().squeeze(1)  # [N] in [B * (T-1)]
    src = t["gather"].flatten()[where] if "gather" in t else where
    return h.reshape(-1, h.shape[-1])[src], t["ids"][:, 1:].flatten()[src], where


def per_chunk(fn: Callable[..., tuple[torch.Tensor, ...]], *xs: torch.Tensor, chunk: int = DEFAULT_CHUNK
              ) -> tuple[torch.Tensor, ...]:
    """``fn`` on row chunks of ``xs`` (all [N, ...]), outputs concatenated. With grad enabled each chunk is
    checkpointed: its intermediates ([chunk, V] logits) are recomputed in backward instead of kept."""
    grad = torch.is_grad_enabled() and any(x.requires_grad for x in xs)
    outs = []
    for s in range(0, xs[0].shape[0], chunk):
        part = [x[s : s + chunk] for x in xs]
        outs.append(checkpoint(fn, *part, use_reentrant=False) if grad else fn(*part))
    if not outs:  # nothing to score: the ops run on empty tensors
        return fn(*xs)
    return tuple(torch.cat(o) for o in zip(*outs, strict=True))


def scatter(values: torch.Tensor, where: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[N] values back to a zero-filled ``shape`` tensor at the flat positions ``where`` (differentiable)."""
    return values.new_zeros(shape.numel()).index_put((where,), values).view(shape)


def token_logp_entropy(model: torch.nn.Module, t: dict[str, torch.Tensor], temperature: float = 1.0,
                       entropy: Literal["grad", "detached", "off"] = "grad", chunk: int = DEFAULT_CHUNK
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each scored target and the entropy of its next-token distribution, both under
    softmax(logits / ``temperature``), as [B, T-1] (0 where ``t['mask']`` is 0).

    ``entropy``: ``grad`` (it enters the loss), ``detached`` (a metric: computed without autograd), ``off``
    (zeros). The temperature is the sampler's: the trainer scores the distribution the samples came from."""
    h, targets, where = hidden_at_targets(model, t)
    _, head = decoder_and_head(model)

    def stats(hc: torch.Tensor, yc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(hc).float()  # [c, V]
        logp_all = torch.log_softmax(logits / temperature if temperature != 1 else logits, dim=-1)
        lp = logp_all.gather(-1, yc[:, None]).squeeze(-1)
        if entropy == "off":
            return lp, torch.zeros_like(lp)
        with torch.set_grad_enabled(entropy == "grad" and torch.is_grad_enabled()):
            ent = -(logp_all.exp() * logp_all).sum(-1)
        return lp, ent

    lp, ent = per_chunk(stats, h, targets, chunk=chunk)
    shape = t["mask"].shape
    return scatter(lp, where, shape), scatter(ent, where, shape)
