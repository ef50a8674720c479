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

The batch a forward takes is built here too: ``Seq`` (prompt ids + a sampled completion + per-token
log-probs, all tensors), ``batch_tensors`` (padded, or packed with ``pack_rows`` into block-diagonal rows) and
``fill`` (a model's log-probs of the sequences a rank holds, without grad).

Why by hand: Liger's fused linear + cross-entropy is the field's kernel for this, but it needs Triton and a
GPU (this pipeline must train on CPU too), returns a loss rather than per-token log-probs and entropies
at a sampling temperature, and has no divergence between two models' distributions, which distill needs.
Chunked PyTorch is exact, runs everywhere, and is ~30 lines.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from posttrain import distributed
from posttrain.distributed import placement

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


def scored_positions(mask: torch.Tensor) -> torch.Tensor:
    """The flat index [N] in [B * (T-1)] of each scored position of ``mask`` [B, T-1]. (The memory plan,
    ``posttrain.plan``, runs on fake tensors that have no values: it swaps this for every position.)"""
    return mask.flatten().nonzero().squeeze(1)


def hidden_at_targets(model: torch.nn.Module, t: dict[str, torch.Tensor]
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decoder hidden states at the positions whose next token is scored.

    ``t`` is a ``batch_tensors`` batch: ``mask`` [B, T-1] (1 where target t+1 is scored) and either a
    padded input (``ids``, ``attn`` [B, T]) or a packed one (``ids``, ``pos`` [R, W], ``gather`` [B, T-1]).
    Returns hidden [N, H], target ids [N] and the flat index [N] of each position in [B * (T-1)]
    (N = mask.sum())."""
    decoder, _ = decoder_and_head(model)
    if "gather" in t:
        out = decoder(input_ids=t["ids"], position_ids=t["pos"], use_cache=False)
    else:
        out = decoder(input_ids=t["ids"], attention_mask=t["attn"], use_cache=False)
    h = out.last_hidden_state[:, :-1]  # [rows, width-1, H]: position t predicts token t+1
    where = scored_positions(t["mask"])  # [N] in [B * (T-1)]
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


# ---------------------------------------------------------------------------------- batches of sequences
@dataclass
class Seq:
    """One training sequence: chat-formatted prompt ids, the sampled completion, the sampler's per-token
    log-probs (``logprobs``, as in the rollout rows), and (filled in by the RL update, ``fill``) the trainer's
    old-policy and reference log-probs. Distillation uses the ids alone (``adv`` unused).

    Per-token fields are 1-D tensors (ids int64, the rest float32: the dtype every forward uses), whatever
    sequence type is passed in: a step's per-token data lives in tensors, never in Python lists."""

    prompt_ids: torch.Tensor
    completion_ids: torch.Tensor
    logprobs: torch.Tensor
    adv: float
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    entropy: torch.Tensor | None = None  # per token, under the policy that sampled (token selection)
    pg_mask: torch.Tensor | None = None  # 1 where the token carries the policy gradient (None: every token)
    # multi-turn tool rollouts: 1 on a model token, 0 on an observation token, which no loss, KL, entropy or
    # count sees (batch_tensors' mask is 0 there); None: every token is the model's
    loss_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = torch.as_tensor(self.prompt_ids, dtype=torch.long)
        self.completion_ids = torch.as_tensor(self.completion_ids, dtype=torch.long)
        for k in ("logprobs", "old_logp", "ref_logp", "entropy", "pg_mask", "loss_mask"):
            v = getattr(self, k)
            if v is not None:
                setattr(self, k, torch.as_tensor(v, dtype=torch.float32))

    def model_tokens(self) -> torch.Tensor:
        """Indices of the model's tokens in ``completion_ids`` (every index without a ``loss_mask``)."""
        n = len(self.completion_ids)
        return torch.arange(n) if self.loss_mask is None else self.loss_mask.nonzero().squeeze(1)

    def n_model_tokens(self) -> int:
        """The tokens the loss sees: ``loss_mask.sum()``, or every completion token."""
        return len(self.completion_ids) if self.loss_mask is None else int(self.loss_mask.sum())


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit decreasing bin packing: the indices of ``lengths`` in each row, each row's total <= ``width``
    (a sequence longer than ``width`` gets a row of its own)."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        r = next((k for k, f in enumerate(free) if f >= lengths[i]), len(rows))
        if r == len(rows):
            rows.append([])
            free.append(max(width, lengths[i]))
        rows[r].append(i)
        free[r] -= lengths[i]
    return rows


def batch_tensors(seqs: Sequence[Seq], pad_id: int, device: torch.device, pack: bool = False
                  ) -> dict[str, torch.Tensor]:
    """Per-sequence tensors aligned with next-token targets [B, T-1]: completion mask and every per-token
    log-prob; advantages [B]; and the model input.

    ``pack`` False: the input is the right-padded ids and attention mask [B, T]. ``pack`` True: the sequences
    are packed (``pack_rows``) into rows of W = twice the longest, with position ids restarting at 0 per
    sequence and no attention mask, which transformers turns into a block-diagonal causal mask (each
    sequence attends only to itself); ``gather`` [B, T-1] maps each (sequence, position) to its flat index
    in the packed [R, W-1] predictions. On SFT-policy samples of the default task (lengths 19-74) the
    packed input is 94% real tokens against 74% for length-sorted padded micro-batches of 64
    (``benchmarks/update.py``).
    """
    lens = [len(s.prompt_ids) + len(s.completion_ids) for s in seqs]
    width, b = max(lens), len(seqs)
    aligned = {k: torch.zeros((b, width - 1)) for k in ("mask", "logprobs", "old_logp", "ref_logp", "pg_mask")}
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        span = slice(p - 1, p - 1 + c)  # target t+1 is a completion token
        aligned["mask"][i, span] = 1 if s.loss_mask is None else s.loss_mask
        aligned["pg_mask"][i, span] = 1 if s.pg_mask is None else s.pg_mask
        for k in ("logprobs", "old_logp", "ref_logp"):
            v = getattr(s, k)
            if v is not None:
                aligned[k][i, span] = v
    out = {"adv": torch.tensor([s.adv for s in seqs]), **aligned}
    if pack:
        w = 2 * width
        rows = pack_rows(lens, w)
        ids = torch.full((len(rows), w), pad_id, dtype=torch.long)
        pos = torch.zeros((len(rows), w), dtype=torch.long)
        gather = torch.zeros((b, width - 1), dtype=torch.long)
        for r, members in enumerate(rows):
            off = 0
            for i in members:
                s, n = seqs[i], lens[i]
                ids[r, off : off + n] = torch.cat((s.prompt_ids, s.completion_ids))
                pos[r, off : off + n] = torch.arange(n)
                gather[i, : n - 1] = r * (w - 1) + off + torch.arange(n - 1)
                off += n
            # the tail after the last sequence restarts at 0 too: its own block, never gathered
            pos[r, off:] = torch.arange(w - off)
        out |= {"ids": ids, "pos": pos, "gather": gather}
    else:
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        attn = torch.zeros((b, width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : lens[i]] = torch.cat((s.prompt_ids, s.completion_ids))
            attn[i, : lens[i]] = 1
        out |= {"ids": ids, "attn": attn}
    return {k: v.to(device) for k, v in out.items()}


def filler(pad_id: int) -> list[Seq]:
    """A micro-batch of one one-token sequence: the forward a rank without sequences runs (with zero weight) so
    that its collectives line up with the other ranks'."""
    return [Seq([pad_id], [pad_id], [0.0], 0.0)]


@torch.no_grad()
def fill(model: torch.nn.Module, seqs: Sequence[Seq], attr: str, pad_id: int, micro: int, pack: bool,
          temperature: float, with_entropy: bool = False) -> None:
    """Set ``seq.<attr>`` to ``model``'s log-probs of each completion token (no grad), and with
    ``with_entropy`` ``seq.entropy`` to its per-token entropies, each a tensor. Under torchrun each rank fills
    exactly the sequences it holds, the ones it will update (``rl.update``), so nothing per-token crosses ranks.
    ``model``: a plain model (no collective), or an FSDP2 handle (``Dist.scoring``, ``Dist.load_frozen``), whose
    every forward all-gathers: then every rank runs the job's largest number of micro-batches, a rank with fewer
    scoring a one-token filler (the ranks' forwards line up; a rank's extra forward would wait forever)."""
    d = distributed.current()
    device = next(model.parameters()).device
    chunks = [seqs[i : i + micro] for i in range(0, len(seqs), micro)]
    if placement.sharded(model):
        chunks += [[]] * (int(d.max(len(chunks))) - len(chunks))
    for chunk in chunks:
        t = batch_tensors(chunk or filler(pad_id), pad_id, device, pack)
        lp, ent = distributed.forward(model, token_logp_entropy, t, temperature,
                                      entropy="detached" if with_entropy else "off")
        for j, s in enumerate(chunk):
            span = slice(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + len(s.completion_ids))
            setattr(s, attr, lp[j, span].float().cpu().clone())
            if with_entropy:
                s.entropy = ent[j, span].float().cpu().clone()
