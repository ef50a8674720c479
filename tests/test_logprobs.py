"""The memory-lean log-prob path equals the full-logits one (values and gradients) and never keeps [B, T, V]."""

import pytest
import torch

from posttrain import distillation, logprobs, sft_data, training
from tests.realmodel import bpe_tokenizer, full_logp_entropy, qwen2

V = 500  # a vocabulary larger than the tokenizer's (as real checkpoints pad theirs)


@pytest.fixture(scope="module")
def tok():
    return bpe_tokenizer(300)


def _seqs(tok, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = tok(f"Natalia sold clips to {i * 7} friends")["input_ids"]
        c = torch.randint(0, len(tok), (3 + 2 * i,), generator=g).tolist()
        out.append(logprobs.Seq(p, c, [0.0] * len(c), 1.0 - 0.4 * i))
    return out


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("tie", [False, True])
def test_chunked_logp_entropy_and_grads_equal_full_logits(tok, pack, tie):
    seqs = _seqs(tok)
    t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"), pack=pack)
    grads = []
    for fn in (lambda m: full_logp_entropy(m, t, 0.7),
               lambda m: logprobs.token_logp_entropy(m, t, 0.7, chunk=7)):  # 7: chunks end mid-sequence
        model = qwen2(tok, hidden=32, layers=2, vocab_size=V, tie=tie)
        lp, ent = fn(model)
        (lp * t["adv"][:, None]).sum().backward(retain_graph=True)
        (0.3 * ent).sum().backward()
        grads.append(({n: p.grad.clone() for n, p in model.named_parameters()}, lp.detach(), ent.detach()))
    (g_full, lp_full, ent_full), (g_lean, lp_lean, ent_lean) = grads
    assert torch.allclose(lp_lean, lp_full, atol=1e-5) and torch.allclose(ent_lean, ent_full, atol=1e-5)
    assert lp_full.abs().sum() > 1  # a real comparison: the scored positions hold log-probs
    for n in g_full:
        assert torch.allclose(g_lean[n], g_full[n], atol=1e-5, rtol=1e-4), n


def test_no_tensor_of_full_vocabulary_per_position_is_kept_for_backward(tok):
    """Autograd keeps no [*, V] tensor of more than one chunk's rows: the logits are recomputed per chunk in
    backward. The full path keeps [B, T-1, V] ones (checked as a control)."""
    t = logprobs.batch_tensors(_seqs(tok), tok.pad_token_id, torch.device("cpu"))
    model = qwen2(tok, hidden=32, layers=2, vocab_size=V)

    def biggest_vocab_tensor(fn):
        rows = [0]
        with torch.autograd.graph.saved_tensors_hooks(
                lambda x: rows.append(x.numel() // V if x.dim() and x.shape[-1] == V else 0) or x, lambda x: x):
            lp, _ = fn()
        lp.sum().backward()
        return max(rows)

    b, width = t["ids"].shape
    assert biggest_vocab_tensor(lambda: full_logp_entropy(model, t, 1.0)) >= b * (width - 1)
    assert biggest_vocab_tensor(lambda: logprobs.token_logp_entropy(model, t, 1.0, chunk=8)) <= 8


def test_entropy_modes(tok):
    t = logprobs.batch_tensors(_seqs(tok, 2), tok.pad_token_id, torch.device("cpu"))
    model = qwen2(tok, hidden=32, layers=1, vocab_size=V)
    _, ent = logprobs.token_logp_entropy(model, t, entropy="detached")
    assert not ent.requires_grad and ent.sum() > 0
    _, ent = logprobs.token_logp_entropy(model, t, entropy="off")
    assert ent.abs().sum() == 0


def test_sft_nll_equals_cross_entropy_of_full_logits(tok):
    ex = [sft_data.encode_sft(tok, "What is 2+3?", "2+3 = 5. The answer is 5."),
          sft_data.encode_sft(tok, "Natalia sold 48 clips.", "She sold 48.")]
    batch = training.collate(ex, tok.pad_token_id)
    model = qwen2(tok, hidden=32, layers=1, vocab_size=V)
    s, n = training.sum_token_nll(model, batch)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, V), batch["labels"][:, 1:].reshape(-1),
                                            ignore_index=sft_data.IGNORE, reduction="sum")
    assert n == sum(sum(1 for y in labels[1:] if y != sft_data.IGNORE) for _, labels in ex)
    assert abs(float(s) - float(ref)) < 1e-3 * n


class _GradsAtStep(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it stepped with."""

    def step(self, closure=None):
        self.grads = {id(p): p.grad.clone() for g in self.param_groups for p in g["params"]}
        return super().step(closure)


def test_chunked_divergence_equals_full_logits(tok):
    """distill's divergence update (student and teacher of different widths, one vocabulary) gives the forward
    KL of the full distributions, and the same student gradient."""
    seqs = _seqs(tok)
    t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
    teacher = qwen2(tok, hidden=48, layers=2, vocab_size=V, seed=1).eval()
    grads = []
    for lean in (False, True):
        student = qwen2(tok, hidden=32, layers=1, vocab_size=V, seed=2)
        opt = _GradsAtStep(student.parameters(), lr=0.0)
        if lean:
            m = distillation.divergence_update(student, teacher, opt, seqs, "forward_kl", 0.5, tok.pad_token_id, 2,
                                               max_grad_norm=1e9, temperature=0.8)
            fkl = m["forward_kl"]
            for p in student.parameters():  # the update frees its gradients after the step: the ones it stepped with
                p.grad = opt.grads[id(p)]
        else:
            with torch.no_grad():
                t_lp = torch.log_softmax(teacher(input_ids=t["ids"], attention_mask=t["attn"]).logits[:, :-1] / 0.8, -1)
            s_lp = torch.log_softmax(student(input_ids=t["ids"], attention_mask=t["attn"]).logits[:, :-1] / 0.8, -1)
            kl = (t_lp.exp() * (t_lp - s_lp)).sum(-1) * t["mask"]
            (kl.sum() / t["mask"].sum()).backward()
            fkl = float(kl.detach().sum() / t["mask"].sum())
        grads.append((fkl, {n: p.grad.clone() for n, p in student.named_parameters()}))
    assert abs(grads[0][0] - grads[1][0]) < 1e-6 and grads[0][0] > 0.01  # two random models: KL 0.025
    for n in grads[0][1]:
        assert torch.allclose(grads[0][1][n], grads[1][1][n], atol=1e-6, rtol=1e-4), n
