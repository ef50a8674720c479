"""Teacher -> student distillation updates (the ``distill`` stage's algorithms).

Both take ``logprobs.Seq`` sequences (prompt ids + a sampled completion; the advantage field is unused) and
make one optimizer step over them (``training.accumulate``) with full-batch token-mean normalisation:

- ``divergence_update``: per-token divergence between the student's and the teacher's next-token
  distributions at every completion position (``divergences.DIVERGENCES``: forward KL for the warmup on teacher
  samples, reverse KL / generalized JSD for on-policy distillation on student samples). The teacher is
  frozen (no grad).
- ``nll_update``: plain SFT on the sequences (hard targets: the warmup's "SFT on teacher samples").

Under torchrun ``student`` is the training handle (``distributed.Dist.wrap``): each rank runs its share of
the sequences, normalised by the global token count (``training.accumulate``). With ``local`` the sequences
passed are this rank's own (the distill stage keeps sampled rows on the rank that sampled them: nothing is
gathered), possibly none; the token and sequence totals are summed over ranks.

Papers: Hinton et al. 2015 (KD, forward KL); Agarwal et al. 2024 (GKD: on-policy, generalized JSD);
"Beyond GRPO and On-Policy Distillation: a sparse-to-dense reward principle" (forward-KL warmup, then
on-policy distillation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from posttrain import algos, distributed, divergences, logprobs, training
from posttrain.logprobs import Seq, batch_tensors


def divergence_update(student: torch.nn.Module, teacher: torch.nn.Module, opt: torch.optim.Optimizer,
                      seqs: Sequence[Seq], divergence: str, beta: float, pad_id: int,
                      micro: int | training.MicroBatch, max_grad_norm: float = 1.0, temperature: float = 1.0,
                      local: bool = False) -> dict[str, float]:
    """One step on sum_t D(student_t, teacher_t) / tokens over completion positions, both distributions of
    logits / ``temperature`` (the sampling temperature, as in GKD/TRL). Returns the step's mean divergence,
    forward and reverse KL (diagnostics), student entropy and completion length.

    Memory-lean (``posttrain.logprobs``): both heads run only at completion positions, ``chunk`` positions at
    a time, so neither model's [B, T, V] logits exist; a chunk's [chunk, V] distributions are recomputed in
    backward. Where the two heads have a different number of rows (checkpoints pad the vocabulary to
    different multiples) the distributions are over the rows both have; the stage checks every token is among them.
    """
    d = distributed.current()
    device = next(student.parameters()).device
    fn = divergences.DIVERGENCES[divergence]
    _, t_head = logprobs.decoder_and_head(teacher)

    def student_side(model: torch.nn.Module, t: dict[str, torch.Tensor], th: torch.Tensor
                     ) -> tuple[torch.Tensor, ...]:
        """The student's forward (through the DDP/FSDP2 wrapper when distributed) and the per-chunk stats."""
        _, s_head = logprobs.decoder_and_head(model)
        n_vocab = min(s_head.out_features, t_head.out_features)  # same tokenizer; heads padded differently

        def stats(sh: torch.Tensor, th: torch.Tensor) -> tuple[torch.Tensor, ...]:
            s_logp = torch.log_softmax(s_head(sh)[:, :n_vocab].float() / temperature, -1)  # [c, V]
            with torch.no_grad():
                t_logp = torch.log_softmax(t_head(th)[:, :n_vocab].float() / temperature, -1)
            div = fn(s_logp, t_logp, beta)  # [c]
            with torch.no_grad():
                return (div, divergences.forward_kl(s_logp, t_logp), divergences.reverse_kl(s_logp, t_logp),
                        -(s_logp.exp() * s_logp).sum(-1))

        sh, _, _ = logprobs.hidden_at_targets(model, t)  # [N, H_student]
        return logprobs.per_chunk(stats, sh, th)

    n_tok, n_seq, n_len = _totals(seqs, local)
    sums = {"loss": 0.0, "forward_kl": 0.0, "reverse_kl": 0.0, "entropy": 0.0}

    def loss_of(chunk: list[Seq], real: bool) -> torch.Tensor:
        t = batch_tensors(chunk or _filler(pad_id), pad_id, device)
        with torch.no_grad():
            th, _, _ = logprobs.hidden_at_targets(teacher, t)  # [N, H_teacher]
        div, fkl, rkl, ent = distributed.forward(student, student_side, t, th)
        loss = div.sum() / max(n_tok, 1)  # token-mean over the whole batch
        if real:
            sums["loss"] += float(loss.detach())
            for key, v in (("forward_kl", fkl), ("reverse_kl", rkl), ("entropy", ent)):
                sums[key] += float(v.sum())
        return loss

    grad_norm = training.accumulate(student, opt, seqs, micro, loss_of, max_grad_norm, local)
    sums = dict(zip(sums, d.sum(*sums.values()), strict=True))
    tok = max(n_tok, 1)
    return {"loss": sums["loss"], "forward_kl": sums["forward_kl"] / tok, "reverse_kl": sums["reverse_kl"] / tok,
            "entropy": sums["entropy"] / tok, "grad_norm": grad_norm, "response_len": n_len / max(n_seq, 1)}


def nll_update(student: torch.nn.Module, opt: torch.optim.Optimizer, seqs: Sequence[Seq], pad_id: int,
               micro: int | training.MicroBatch, max_grad_norm: float = 1.0, temperature: float = 1.0,
               local: bool = False) -> dict[str, float]:
    """One SFT step on the sequences' completions (token-mean NLL of softmax(logits / ``temperature``), the
    distribution the student will sample from). Returns loss, entropy, length."""
    d = distributed.current()
    device = next(student.parameters()).device
    n_tok, n_seq, n_len = _totals(seqs, local)
    loss_sum, ent_sum = 0.0, 0.0

    def loss_of(chunk: list[Seq], real: bool) -> torch.Tensor:
        nonlocal loss_sum, ent_sum
        t = batch_tensors(chunk or _filler(pad_id), pad_id, device)
        m = t["mask"]
        logp, ent = distributed.forward(student, logprobs.token_logp_entropy, t, temperature, "detached")
        loss = algos.aggregate(-logp, m, "token-mean", n_seq, n_tok, 1)
        if real:
            loss_sum += float(loss.detach())
            ent_sum += float((ent.detach() * m).sum())
        return loss

    grad_norm = training.accumulate(student, opt, seqs, micro, loss_of, max_grad_norm, local)
    loss_sum, ent_sum = d.sum(loss_sum, ent_sum)
    return {"loss": loss_sum, "entropy": ent_sum / max(n_tok, 1), "grad_norm": grad_norm,
            "response_len": n_len / max(n_seq, 1)}


def _totals(seqs: Sequence[Seq], local: bool) -> tuple[int, int, int]:
    """The global batch's model tokens (a tool rollout's observations are not the model's), sequences and
    completion tokens (observations included: the response length): summed over ranks when ``seqs`` are
    ``local``, else every rank holds them all."""
    t = (sum(s.n_model_tokens() for s in seqs), len(seqs), sum(len(s.completion_ids) for s in seqs))
    return tuple(round(x) for x in distributed.current().sum(*t)) if local else t  # type: ignore[return-value]


def _filler(pad_id: int) -> list[Seq]:
    """One one-token sequence: the zero-weight forward of a rank that holds no sequence (``local``)."""
    return [Seq([pad_id], [pad_id], [0.0], 0.0)]
