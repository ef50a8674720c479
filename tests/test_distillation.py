"""The distillation updates move the student toward the teacher."""

import torch

from posttrain import distillation, logprobs
from posttrain.config import TinyModel
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids

CFG = TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def _seqs(tok, model):
    ids = chat_prompt_ids(tok, ["12*3=", "47*7="])
    groups = BACKENDS["hf"](model.eval(), tok, 8).generate(ids, 2, SamplingParams(1.0, 1.0, 10, 0))
    return [logprobs.Seq(p, c.token_ids, c.logprobs, 0.0) for p, g in zip(ids, groups, strict=True) for c in g]


def test_divergence_update_reduces_the_divergence():
    tok = build_char_tokenizer()
    teacher, student = build_tiny_model(CFG, tok, 0).eval(), build_tiny_model(CFG, tok, 1)
    seqs = _seqs(tok, student)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    first = distillation.divergence_update(student.train(), teacher, opt, seqs, "reverse_kl", 0.5, 0, 4)
    for _ in range(20):
        last = distillation.divergence_update(student, teacher, opt, seqs, "reverse_kl", 0.5, 0, 4)
    assert last["reverse_kl"] < 0.5 * first["reverse_kl"]
    assert first["loss"] == first["reverse_kl"] or abs(first["loss"] - first["reverse_kl"]) < 1e-5


def test_identical_teacher_gives_zero_divergence():
    tok = build_char_tokenizer()
    teacher, student = build_tiny_model(CFG, tok, 0).eval(), build_tiny_model(CFG, tok, 0)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    m = distillation.divergence_update(student.train(), teacher, opt, _seqs(tok, teacher), "jsd", 0.5, 0, 4)
    assert abs(m["loss"]) < 1e-6 and m["grad_norm"] < 1e-5


def test_nll_update_raises_the_likelihood_of_the_samples():
    tok = build_char_tokenizer()
    student = build_tiny_model(CFG, tok, 1)
    seqs = _seqs(tok, student)
    opt = torch.optim.AdamW(student.parameters(), lr=1e-2)
    first = distillation.nll_update(student.train(), opt, seqs, 0, 3)
    for _ in range(10):
        last = distillation.nll_update(student, opt, seqs, 0, 3)
    assert last["loss"] < first["loss"]


def test_distill_losses_score_the_sampling_temperature():
    """Student samples drawn at T = 0.7: the hard-target loss is the NLL of softmax(logits / 0.7) (equal to the
    sampler's own log-probs, summed by hand), and the forward-KL divergence compares both models at T = 0.7."""
    tok = build_char_tokenizer()
    student = build_tiny_model(CFG, tok, 0)
    ids = chat_prompt_ids(tok, ["12*3=", "47*7="])
    groups = BACKENDS["hf"](student.eval(), tok, 8).generate(ids, 2, SamplingParams(0.7, 1.0, 10, 0))
    seqs = [logprobs.Seq(p, c.token_ids, c.logprobs, 0.0) for p, g in zip(ids, groups, strict=True) for c in g]
    hand = -sum(sum(s.logprobs) for s in seqs) / sum(len(s.completion_ids) for s in seqs)
    m = distillation.nll_update(student.train(), torch.optim.SGD(student.parameters(), lr=0.0), seqs,
                                tok.pad_token_id, 8, temperature=0.7)
    assert abs(m["loss"] - hand) < 1e-4, (m["loss"], hand)
    m1 = distillation.nll_update(student, torch.optim.SGD(student.parameters(), lr=0.0), seqs, tok.pad_token_id, 8)
    assert abs(m1["loss"] - hand) > 1e-3  # at T = 1 another distribution (measured gap 0.0077 here)
    teacher = build_tiny_model(CFG, tok, 1).eval()
    t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        s_lp, t_lp = (torch.log_softmax(m(input_ids=t["ids"], attention_mask=t["attn"]).logits[:, :-1] / 0.7, -1)
                      for m in (student, teacher))  # the full-logits reference
    fkl = float((torch.sum(t_lp.exp() * (t_lp - s_lp), -1) * t["mask"]).sum() / t["mask"].sum())
    m = distillation.divergence_update(student, teacher, torch.optim.SGD(student.parameters(), lr=0.0), seqs,
                                       "forward_kl", 0.5, tok.pad_token_id, 8, temperature=0.7)
    assert abs(m["forward_kl"] - fkl) < 1e-5
