"""The online loop's pieces: prompt cursor, dynamic-sampling test, and the policy update itself."""

import copy
import math

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import GradCapture

from posttrain import checkpoint, logprobs
from posttrain.config import Rl, TinyModel
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from posttrain.rl import collect, select, update
from posttrain.rl.prompts import PromptPool, PromptTokens, read_rates
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids


def test_prompt_cursor_is_a_resumable_permutation_walk():
    c = select.PromptCursor(5, seed=3)
    first = c.take(5)
    assert sorted(first) == [0, 1, 2, 3, 4]  # one epoch visits every prompt once
    nxt = c.take(3)
    resumed = select.PromptCursor(5, seed=3, pos=5)
    assert resumed.take(3) == nxt  # restoring pos continues exactly


def test_zero_variance_groups():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 5.0]])
    valid = torch.tensor([[True, True, True], [True, True, True], [True, True, False]])
    assert collect.zero_variance(r, valid).tolist() == [True, False, True]  # the 5.0 is unscorable


def _setup(**rl_overrides):
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    ids = chat_prompt_ids(tok, ["12*3="])[0]
    comp = BACKENDS["hf"](model.eval(), tok, 8).generate([ids], 2, SamplingParams(1.0, 1.0, 8, 0))[0]
    seqs = [logprobs.Seq(ids, c.token_ids, c.logprobs, a) for c, a in zip(comp, [1.0, -1.0], strict=True)]
    cfg = Rl(**{"lr": 1e-2, "micro_batch_size": 1, **rl_overrides})
    return tok, model, seqs, cfg


@torch.no_grad()
def _seq_logp(model, s):
    t = logprobs.batch_tensors([s], 0, torch.device("cpu"))
    lp, _ = logprobs.token_logp_entropy(model, t)
    return float((lp * t["mask"]).sum())


def test_update_raises_positive_and_lowers_negative_advantage_sequences():
    tok, model, seqs, cfg = _setup()
    before = [_seq_logp(model, s) for s in seqs]
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    m = update.policy_update(model.train(), opt, seqs, cfg, tok.pad_token_id)
    after = [_seq_logp(model, s) for s in seqs]
    assert after[0] > before[0] and after[1] < before[1]
    assert m["optimizer_steps"] == 1 and m["clipfrac"] == 0.0  # exactly on-policy: ratio 1
    assert m["logprob_gap"] < 1e-4  # sampler and trainer agree on the same tokens


def test_off_policy_epochs_recompute_old_logprobs_and_clip():
    tok, model, seqs, cfg = _setup(epochs=3, minibatches=2, clip_eps_low=0.01, clip_eps_high=0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    m = update.policy_update(model.train(), opt, seqs, cfg, tok.pad_token_id)
    assert m["optimizer_steps"] == 6
    assert all(s.old_logp is not None and len(s.old_logp) == len(s.completion_ids) for s in seqs)
    assert m["clipfrac"] > 0 and m["ratio_max"] > 1.0  # later minibatches move away from the old policy


def test_kl_term_pulls_the_policy_toward_the_reference():
    """With zero advantages the only gradient is the KL term's: one step must lower the KL to a reference
    that differs from the policy, and the logged KL must be the k3 mean computed by hand from log-probs.
    (Fails if the KL term is dropped from the loss: the weights would not move.)"""
    tok, model, seqs, _ = _setup()
    ref = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 1).eval()
    for s in seqs:
        s.adv = 0.0

    def mean_k3():
        with torch.no_grad():
            t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
            lp, _ = logprobs.token_logp_entropy(model, t)
            rlp, _ = logprobs.token_logp_entropy(ref, t)
            d = rlp - lp
            return float(((d.exp() - d - 1) * t["mask"]).sum() / t["mask"].sum())

    before = mean_k3()
    cfg = Rl(lr=1e-3, micro_batch_size=1, kl_coef=1.0, kl_estimator="k3")
    m = update.policy_update(model.train(), torch.optim.AdamW(model.parameters(), lr=cfg.lr), seqs, cfg,
                           tok.pad_token_id, ref_model=ref)
    assert abs(m["kl"] - before) < 1e-5  # logged: the pre-step k3 mean
    assert before > 1e-3 and mean_k3() < before  # the step moved the policy toward the reference


def test_bf16_mixed_precision_update_moves_the_weights_like_fp32(tmp_path):
    """model.dtype bfloat16: fp32 master weights and optimizer state, forward/backward under autocast. At
    lr 1e-6 an AdamW step (~1e-6 per weight) is far below bf16's spacing near these weights (~1e-4), so
    with bf16 storage it rounds away; with fp32 masters it lands, in the fp32 update's direction."""
    from posttrain import modeling

    tok, model, seqs, _ = _setup()
    modeling.save_checkpoint(model, tok, tmp_path / "m")
    cfg = Rl(lr=1e-6, micro_batch_size=1)
    deltas = []
    # fp32; bf16 with fp32 masters (the fix); bf16 storage and optimizer state (what bfloat16 used to mean)
    for dtype, trainable in (("float32", True), ("bfloat16", True), ("bfloat16", False)):
        m = modeling.load_model(str(tmp_path / "m"), dtype, trainable=trainable).train()
        w0 = torch.cat([p.detach().float().flatten().clone() for p in m.parameters()])
        with modeling.autocast(dtype, torch.device("cpu")):
            update.policy_update(m, torch.optim.AdamW(m.parameters(), lr=cfg.lr), seqs, cfg, tok.pad_token_id)
        deltas.append(torch.cat([p.detach().float().flatten() for p in m.parameters()]) - w0)
    fp32, bf16, bf16_storage = deltas

    def moved(d):
        return (d != 0).float().mean().item()

    def cos(d):
        return torch.nn.functional.cosine_similarity(fp32, d, dim=0).item()

    assert moved(bf16) > 0.95 and cos(bf16) > 0.95, (moved(bf16), cos(bf16))  # measured: 99.9%, 0.998
    assert moved(bf16_storage) < 0.1 and cos(bf16_storage) < 0.5  # the control: 2.2% moved, cosine 0.14


def test_trainer_scores_the_sampling_temperature():
    """At T = 0.7 the trainer's log-probs of a sampled batch equal the sampler's (logits / T), so the on-policy
    ratio is exactly 1 and nothing is clipped."""
    tok, model, _, _ = _setup()
    ids = chat_prompt_ids(tok, ["12*3=", "7*8="])
    comps = BACKENDS["hf"](model.eval(), tok, 8).generate(ids, 3, SamplingParams(0.7, 1.0, 10, 0))
    seqs = [logprobs.Seq(p, c.token_ids, c.logprobs, 1.0 - j) for p, g in zip(ids, comps, strict=True)
            for j, c in enumerate(g)]
    cfg = Rl(lr=1e-2, micro_batch_size=2, sampling={"temperature": 0.7})
    m = update.policy_update(model.train(), torch.optim.AdamW(model.parameters(), lr=cfg.lr), seqs, cfg,
                           tok.pad_token_id)
    assert m["logprob_gap"] < 1e-5, m["logprob_gap"]
    assert m["ratio_max"] == 1.0 and m["clipfrac"] == 0.0


def test_dynamic_sampling_modes():
    """An untrained policy never solves the task: every group has zero reward variance."""
    from types import SimpleNamespace

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    backend = BACKENDS["hf"](model.eval(), tok, 64)
    prompts = [{"id": f"p{i}", "prompt": f"{10 + i}*3=", "answer": str((10 + i) * 3), "task": "arith"}
               for i in range(20)]
    specs = [SimpleNamespace(name="correct", weight=1.0, kwargs={})]
    out = {}
    for mode in ("off", "skip", "refill"):
        cfg = Rl(prompts_per_step=3, samples_per_prompt=2, dynamic_sampling=mode, max_refill_rounds=2,
                 sampling={"max_new_tokens": 4})
        cursor = select.PromptCursor(len(prompts), seed=0)
        out[mode] = (collect.collect_step(backend, tok, prompts, cursor, cfg, specs, seed=0, policy="p"), cursor.pos)
    assert [len(out[m][0].used) for m in ("off", "skip", "refill")] == [3, 0, 0]
    assert out["skip"][0].zero_var_frac == 1.0 and out["skip"][0].rounds == 0
    refill, pos = out["refill"]
    assert refill.rounds == 2 and len(refill.prompt_ids) == 9 and pos == 9  # 3 rounds of 3 prompts, all on disk
    assert sorted(refill.rows) == list(range(9)) and refill.segments == [(0, 3), (3, 6), (6, 9)]
    assert all(isinstance(x["token_ids"], np.ndarray) and x["logprobs"].dtype == np.float32
               for grp in refill.rows.values() for x in grp)  # per-token fields are arrays


def test_pack_rows_first_fit_decreasing():
    # lengths 5,4,3,3,2 into width 8: 5 -> row0 (3 left), 4 -> row1 (4 left), 3 -> row0 (0 left),
    # 3 -> row1 (1 left), 2 -> row2; a sequence wider than the rows gets its own row
    assert logprobs.pack_rows([3, 5, 2, 4, 3], 8) == [[1, 0], [3, 4], [2]]
    assert logprobs.pack_rows([9, 1], 4) == [[0], [1]]


def test_packed_update_equals_padded_update():
    """Packing changes the layout only: per-token log-probs, entropies and the gradient of the loss equal
    those of the right-padded batch (sequences of different lengths, one row holding several)."""
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64), tok, 0)
    prompts = chat_prompt_ids(tok, ["12*3=", "4*5=", "123*7="])
    comps = BACKENDS["hf"](model.eval(), tok, 8).generate(prompts, 3, SamplingParams(1.0, 1.0, 12, 1))
    seqs = [logprobs.Seq(p, c.token_ids, c.logprobs, 1.0 - j) for p, g in zip(prompts, comps, strict=True)
            for j, c in enumerate(g)]
    assert len({len(s.completion_ids) for s in seqs}) > 1
    packed = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"), pack=True)
    assert packed["ids"].shape[0] < len(seqs)  # several sequences share a row
    padded = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
    grads = []
    for t in (padded, packed):
        model.zero_grad()
        logp, ent = logprobs.token_logp_entropy(model.train(), t)
        m = t["mask"]
        (-(logp * t["adv"][:, None] * m).sum() / m.sum()).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        if t is padded:
            ref_logp, ref_ent = logp.detach() * m, ent.detach() * m
    torch.testing.assert_close(logp.detach() * m, ref_logp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.detach() * m, ref_ent, atol=1e-5, rtol=0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_policy_update_is_the_same_packed_or_padded():
    """rl.pack changes the layout, not the update: the same weights after two off-policy optimizer steps
    (old log-probs recomputed packed too) and the same metrics."""
    tok, model, seqs, _ = _setup()
    half = [len(s.completion_ids) // 2 + 1 for s in seqs]
    seqs += [logprobs.Seq(s.prompt_ids, s.completion_ids[:h], s.logprobs[:h], -s.adv)
             for s, h in zip(seqs, half, strict=True)]  # unequal lengths, so packing has something to do
    results = []
    for pack in (False, True):
        m = copy.deepcopy(model).train()
        cfg = Rl(lr=1e-2, micro_batch_size=3, minibatches=2, pack=pack)
        out = update.policy_update(m, torch.optim.AdamW(m.parameters(), lr=cfg.lr), copy.deepcopy(seqs), cfg,
                                 tok.pad_token_id)
        results.append((out, [p.detach() for p in m.parameters()]))
    (m0, w0), (m1, w1) = results
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == 2
    for k in ("loss", "clipfrac", "entropy", "logprob_gap"):
        assert abs(m0[k] - m1[k]) < 1e-5, k
    for a, b in zip(w0, w1, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def _zero_adv_batch():
    """Four sequences of unequal lengths, advantages [1, 0, -1, 0], and a forward counter on the model."""
    tok, model, seqs, _ = _setup()
    seqs += [logprobs.Seq(s.prompt_ids, s.completion_ids[: len(s.completion_ids) // 2 + 1],
                          s.logprobs[: len(s.completion_ids) // 2 + 1], 0.0) for s in seqs]
    seqs = [seqs[0], seqs[2], seqs[1], seqs[3]]
    rows = []
    model.get_decoder().register_forward_pre_hook(lambda _m, _a, kw: rows.append(int(kw["input_ids"].shape[0])),
                                                  with_kwargs=True)  # every scoring forward (copies share it)
    return tok, model, seqs, rows


def test_zero_advantage_sequences_are_not_run_and_the_gradient_is_the_full_batchs():
    """A sequence of advantage 0 adds 0 to the policy-gradient loss: the update skips its forward and backward
    but keeps its tokens in the token-mean normaliser, so the gradient is the whole batch's, computed by hand:
    on-policy ppo_clip (ratio 1) is -sum_i adv_i * grad(sum_t logp_it) / (all tokens, zero-advantage ones too)."""
    tok, model, seqs, rows = _zero_adv_batch()
    t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
    ref = copy.deepcopy(model).train()
    logp, _ = logprobs.token_logp_entropy(ref, t)
    (-(logp * t["adv"][:, None] * t["mask"]).sum() / t["mask"].sum()).backward()
    rows.clear()
    grads, m = _grads(model, seqs, Rl(lr=1e-2, micro_batch_size=1, max_grad_norm=1e6), tok)
    assert rows == [1, 1]  # the two sequences of advantage +-1, one micro-batch each; the zeros never ran
    for g, p in zip(grads, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    assert m["optimizer_steps"] == 1


def test_zero_advantage_sequences_run_when_they_feed_a_term_or_are_all_there_is():
    """With a KL to the reference or an entropy bonus a zero-advantage sequence has a gradient: it runs. A
    minibatch of zeros only still runs, so AdamW takes its step on a zero gradient as before."""
    tok, model, seqs, rows = _zero_adv_batch()
    for over, forwards in (({"entropy_coef": 0.01}, 4), ({"kl_coef": 0.1}, 8)):  # kl: + the reference's 4
        rows.clear()
        update.policy_update(copy.deepcopy(model).train(), GradCapture(model.parameters()), copy.deepcopy(seqs),
                             Rl(lr=1e-2, micro_batch_size=1, **over), tok.pad_token_id, ref_model=model)
        assert rows == [1] * forwards, over
    for s in seqs:
        s.adv = 0.0
    rows.clear()
    m = copy.deepcopy(model).train()
    w0 = [p.detach().clone() for p in m.parameters()]
    update.policy_update(m, torch.optim.AdamW(m.parameters(), lr=1e-2), seqs, Rl(lr=1e-2, micro_batch_size=1),
                         tok.pad_token_id)
    assert rows == [1, 1, 1, 1]
    # AdamW stepped on a zero gradient (not on None, which it skips): only its weight decay moved the weights
    assert all(not torch.equal(p.detach(), w) for p, w in zip(m.parameters(), w0, strict=True) if w.abs().sum() > 0)


def test_kl_in_the_reward_hand_values():
    # r - coef * sum_t (sampler logp_t - ref logp_t): 1 - 0.1 * ((-0.5 + 0.7) + (-1.0 + 0.6)) = 1 - 0.1 * (-0.2) = 1.02
    k1 = [update.seq_k1(torch.tensor(s), torch.tensor(q)) for s, q in (([-0.5, -1.0], [-0.7, -0.6]), ([-2.0], [-1.0]))]
    assert k1 == pytest.approx([-0.2, -1.0])
    shaped = update.kl_shaped_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor(k1), 0.1)
    assert shaped.tolist() == pytest.approx([1.02, 0.1])  # second: 0 - 0.1 * (-2.0 + 1.0) = 0.1


def test_kl_in_the_reward_separates_a_group_of_equal_rewards():
    """Two samples with the same task reward: without KL the group has no signal (advantages 0); with
    kl_reward_coef the sample that strayed further from the reference (larger k1 sum) gets the negative
    advantage. GRPO on two values is +-1/sqrt(2) = +-0.707107 whatever their gap (unbiased std = gap/sqrt 2)."""
    tok, model, seqs, _ = _setup()
    ref = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 1).eval()
    rows = [{"prompt_id": "p", "sample": j, "reward": 1.0, "token_ids": s.completion_ids, "logprobs": s.logprobs}
            for j, s in enumerate(seqs)]
    prompt_ids = {"p": seqs[0].prompt_ids}
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sb = collect.StepBatch.from_rows(rows, 2)
    _, plain = update.update_from_groups(model, opt, sb, Rl(samples_per_prompt=2), prompt_ids, tok.pad_token_id)
    assert plain.tolist() == [[0.0, 0.0]]
    m, adv = update.update_from_groups(model, opt, sb, Rl(samples_per_prompt=2, kl_reward_coef=0.1), prompt_ids,
                                       tok.pad_token_id, ref_model=ref)
    shaped = {("p", j): float(adv[0, j]) for j in range(2)}
    k1 = []
    for s in seqs:
        t = logprobs.batch_tensors([s], tok.pad_token_id, torch.device("cpu"))
        with torch.no_grad():
            rlp, _ = logprobs.token_logp_entropy(ref, t)
        k1.append(float(s.logprobs.sum()) - float((rlp * t["mask"]).sum()))
    assert k1[0] != pytest.approx(k1[1])
    expect = [0.707107, -0.707107] if k1[0] < k1[1] else [-0.707107, 0.707107]
    assert [shaped[("p", 0)], shaped[("p", 1)]] == pytest.approx(expect, abs=1e-4)
    assert m["kl_seq"] == pytest.approx(sum(k1) / 2, abs=1e-4)


def _grads(model, seqs, cfg, tok, ref_model=None):
    """The update's gradient (one optimizer step: epochs = minibatches = 1) and its metrics."""
    m = copy.deepcopy(model).train()
    opt = GradCapture(m.parameters())
    metrics = update.policy_update(m, opt, seqs, cfg, tok.pad_token_id, ref_model=ref_model)
    assert opt.grads and any(float(g.abs().max()) > 0 for g in opt.grads)
    return opt.grads, metrics


def _tis(cap):
    from posttrain.config import CorrectionSpec

    return {"correction": CorrectionSpec(name="tis_token", kwargs={"cap": cap})}


def _sampler_agrees(model, seqs):
    """Give each sequence the trainer's own log-probs as its sampler's (every ratio exactly 1)."""
    with torch.no_grad():
        for s in seqs:
            t = logprobs.batch_tensors([s], 0, torch.device("cpu"))
            lp, _ = logprobs.token_logp_entropy(model, t)
            p = len(s.prompt_ids)
            s.logprobs = lp[0, p - 1 : p - 1 + len(s.completion_ids)].clone()


def test_truncated_importance_sampling_reweights_the_policy_gradient():
    tok, model, seqs, cfg = _setup(max_grad_norm=1e6)  # no clipping at these gradient norms
    plain, _ = _grads(model, seqs, cfg, tok)
    # a sampler that agrees with the trainer: every weight is exp(0) = 1, the same gradient
    _sampler_agrees(model, seqs)
    same, m = _grads(model, seqs, cfg.model_copy(update=_tis(3.0)), tok)
    for a, b in zip(plain, same, strict=True):
        torch.testing.assert_close(a, b)
    assert m["tis_capped"] == 0.0 and m["is_masked"] == 0.0
    # a sampler that gave every token half the trainer's probability: weight 2 per token (under the cap of 3), so
    # the policy-gradient loss and its gradient double; with a cap of 1.5 they are x1.5 and every token is capped
    for s in seqs:
        s.logprobs = s.logprobs - math.log(2)
    for cap, factor in ((3.0, 2.0), (1.5, 1.5)):
        got, m = _grads(model, seqs, cfg.model_copy(update=_tis(cap)), tok)
        for a, b in zip(plain, got, strict=True):
            torch.testing.assert_close(b, factor * a, rtol=1e-4, atol=1e-7)
        assert m["tis_capped"] == (1.0 if cap < 2 else 0.0)
        assert m["logprob_gap"] == pytest.approx(math.log(2), abs=1e-5)


@pytest.mark.parametrize("name,kwargs,factor,masked", [
    ("mis_token", {"low": 0.5, "high": 1.5}, 0.0, 1.0),  # ratio 2 > 1.5: every token masked, no policy gradient
    ("mis_sequence", {"low": 0.5, "high": 1.5}, 0.0, 1.0),  # geometric mean 2 > 1.5: every sequence masked
    ("icepop", {"low": 0.5, "high": 1.5}, 0.0, 1.0),
    ("mis_token", {"low": 0.5, "high": 2.5}, 1.0, 0.0),  # ratio 2 inside: kept, unweighted
    ("mis_sequence", {"low": 0.5, "high": 2.5}, 1.0, 0.0),
    ("icepop", {"low": 0.5, "high": 2.5}, 2.0, 0.0),  # ratio 2 inside: kept, weighted by the ratio
])
def test_a_configured_correction_reaches_the_policy_gradient_and_not_the_kl(name, kwargs, factor, masked):
    """Every sampled token had half the trainer's probability (ratio pi_trainer / pi_sampler = 2). The update's
    gradient is g_pg * factor + g_kl: a band that masks every token leaves exactly the KL term's gradient (the KL
    to the reference still acts), a band that keeps them the policy gradient x1 (masked IS) or x2 (IcePop).
    (Fails if the update ignores rl.correction, or applies the weights to the KL term too.)"""
    from posttrain.config import CorrectionSpec

    tok, model, seqs, cfg = _setup(max_grad_norm=1e6, kl_coef=0.5)
    ref = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 1)
    _sampler_agrees(model, seqs)
    for s in seqs:
        s.logprobs = s.logprobs - math.log(2)

    def grads(cfg, advs):
        for s, a in zip(seqs, advs, strict=True):
            s.adv = a
        return _grads(model, seqs, cfg, tok, ref_model=ref)

    g_all, _ = grads(cfg, [1.0, -1.0])  # no correction: policy gradient + KL
    g_kl, _ = grads(cfg, [0.0, 0.0])  # advantages 0: the KL term's gradient alone
    assert max(float(g.abs().max()) for g in g_kl) > 1e-4  # the KL acts
    assert max(float((a - b).abs().max()) for a, b in zip(g_all, g_kl, strict=True)) > 1e-4  # and so does the PG
    got, m = grads(cfg.model_copy(update={"correction": CorrectionSpec(name=name, kwargs=kwargs)}), [1.0, -1.0])
    for a, k, b in zip(g_all, g_kl, got, strict=True):
        torch.testing.assert_close(b, k + factor * (a - k), rtol=1e-4, atol=1e-7)
    assert m["is_masked"] == masked and m["tis_capped"] == 0.0
    assert m["logprob_gap"] == pytest.approx(math.log(2), abs=1e-5)


def test_entropy_token_selection_restricts_the_policy_gradient_to_the_chosen_tokens():
    """top_entropy at rho 1 keeps every token (the same update as all); bottom_entropy at rho 1 keeps none (no
    policy gradient: the weights do not move); rho 0.3 keeps the highest-entropy 30% of the batch's tokens
    under the sampling policy and gives another update. (Fails if the mask is not applied to the loss.)"""
    def step(**kw):
        tok, model, seqs, cfg = _setup(**kw)
        w0 = [p.detach().clone() for p in model.parameters()]
        m = update.policy_update(model.train(), torch.optim.SGD(model.parameters(), lr=0.1), seqs, cfg,
                               tok.pad_token_id)
        moved = max(float((p.detach() - q).abs().max()) for p, q in zip(model.parameters(), w0, strict=True))
        return moved, seqs, m, model

    moved_all, _, m_all, model_all = step()
    moved_top1, _, m_top1, model_top1 = step(token_select="top_entropy", token_rho=1.0)
    assert moved_all > 0 and m_all["pg_tokens"] == 1.0 and m_top1["pg_tokens"] == 1.0
    for p, q in zip(model_all.parameters(), model_top1.parameters(), strict=True):
        assert torch.allclose(p, q, atol=1e-7)
    moved_none, _, m_none, _ = step(token_select="bottom_entropy", token_rho=1.0)
    assert moved_none == 0.0 and m_none["pg_tokens"] == 0.0
    moved_top, seqs, m_top, model_top = step(token_select="top_entropy", token_rho=0.3)
    flat = [(e, k) for s in seqs for e, k in zip(s.entropy, s.pg_mask, strict=True)]
    kept = sorted(e for e, k in flat if k)
    assert len(kept) == math.ceil(0.3 * len(flat)) and abs(m_top["pg_tokens"] - len(kept) / len(flat)) < 1e-9
    assert min(kept) >= max(e for e, k in flat if not k)  # the kept tokens are the highest-entropy ones
    assert moved_top > 0 and any(not torch.allclose(p, q) for p, q in zip(model_all.parameters(),
                                                                          model_top.parameters(), strict=True))


def test_the_prompt_pool_is_a_table_read_by_row_searched_by_id_and_tokenized_on_demand(tmp_path):
    """PromptPool: the loop's columns by position (as dicts, the file's order), a selection a view on them, ids
    found by binary search, a digest of the id set that ignores order, the selection written back with every
    column of the file; PromptTokens: the same ids as tokenizing the whole pool up front, one prompt at a time;
    read_rates: the pass-rate columns, of the pool's prompts only."""
    import pyarrow.parquet as pq

    from posttrain.rl.prompts import COLUMNS
    from posttrain.schema import PROBLEM_SCHEMA, read_problems

    rows = [{"id": f"q{i}", "source": "t", "task": "arith", "prompt": f"{i}+{7 - i}=", "answer": "7",
             "solution": f"{i} and {7 - i}"} for i in (3, 0, 2, 1)]
    loop = [{c: r[c] for c in COLUMNS} for r in rows]
    pq.write_table(pa.Table.from_pylist(rows, schema=PROBLEM_SCHEMA), tmp_path / "train.parquet")
    pool = PromptPool.read(tmp_path / "train.parquet")
    assert len(pool) == 4 and pool[0] == loop[0] and pool[-1] == loop[3] and list(pool) == loop
    assert [pool.index.find(f"q{i}") for i in range(5)] == [1, 3, 2, 0, -1]
    assert pool.digest() == PromptPool.of(rows[::-1]).digest() != PromptPool.of(rows[:3]).digest()
    sub = pool.subset(np.array([0, 2, 3]))  # q3, q2, q1
    assert list(sub) == [loop[0], loop[2], loop[3]] and sub[1] == loop[2] and sub.index.find("q1") == 2
    assert list(sub.subset(np.array([2]))) == [loop[3]]
    sub.write_selected(tmp_path / "selected.parquet")
    assert read_problems(tmp_path / "selected.parquet") == [rows[0], rows[2], rows[3]]  # every column, file order
    tok = build_char_tokenizer()
    want = dict(zip([r["id"] for r in rows], chat_prompt_ids(tok, [r["prompt"] for r in rows]), strict=True))
    got = PromptTokens(pool, tok)
    assert {k: got[k] for k in want} == want and sorted(got) == sorted(want)
    with pytest.raises(KeyError):
        got["q9"]
    pq.write_table(pa.Table.from_pylist([{"prompt_id": "q2", "n": 4, "scorable": 4, "n_correct": 1,
                                          "pass_rate": 0.25, "mean_reward": 0.25},
                                         {"prompt_id": "other", "n": 4, "scorable": 4, "n_correct": 4,
                                          "pass_rate": 1.0, "mean_reward": 1.0}]), tmp_path / "rates.parquet")
    assert read_rates(tmp_path / "rates.parquet", pool).column("prompt_id").to_pylist() == ["q2"]
    prior = select.PriorState.from_rates(read_rates(tmp_path / "rates.parquet"))
    assert (prior.get("q2"), prior.get("other"), prior.get("q0")) == ((0.25, 4.0), (1.0, 4.0), (0.0, 0.0))
    assert prior.p == {} and prior.n == {}  # read from the columns: nothing copied (or checkpointed) until updated
    with pytest.raises(ValueError, match="missing columns"):
        PromptPool.read(tmp_path / "rates.parquet")
    with pytest.raises(ValueError, match="built in memory"):
        PromptPool.of(rows).write_selected(tmp_path / "x.parquet")
    pq.write_table(pa.Table.from_pylist([{"prompt_id": "q2", "pass_rate": 0.25}] * 2), tmp_path / "dup.parquet")
    with pytest.raises(ValueError, match="more than one row"):
        read_rates(tmp_path / "dup.parquet")


def test_1_shot_prompt_selection_by_reward_variance_by_hand():
    from posttrain.config import RlSelect

    problems = PromptPool.of([{"id": f"p{i}"} for i in range(5)])
    rates = pa.Table.from_pylist([{"prompt_id": "p0", "pass_rate": 0.5}, {"prompt_id": "p1", "pass_rate": 0.9},
                                  {"prompt_id": "p2", "pass_rate": 0.3}, {"prompt_id": "p3", "pass_rate": None},
                                  {"prompt_id": "p4", "pass_rate": 0.0}])
    band = RlSelect(min_pass_rate=0.01, max_pass_rate=0.99)
    assert [p["id"] for p in select.PROMPT_SELECTIONS["pass_band"](problems, rates, band)] == ["p0", "p1", "p2"]
    # variances p(1 - p): p0 0.25, p1 0.09, p2 0.21 (p3 unmeasured, p4 outside the band)
    top2 = RlSelect(strategy="top_variance", top_k=2)
    assert [p["id"] for p in select.PROMPT_SELECTIONS["top_variance"](problems, rates, top2)] == ["p0", "p2"]
    top1 = RlSelect(strategy="top_variance", top_k=1)
    assert [p["id"] for p in select.PROMPT_SELECTIONS["top_variance"](problems, rates, top1)] == ["p0"]


def test_the_all_selection_keeps_the_whole_split_measured_or_not():
    """rl.select.strategy all: every prompt of the split, in its order: p1 measured in the band, p2 never solved
    (outside it), p3 with a null rate, p0 and p4 missing from the reward stage's table (rollout.num_prompts
    scored only some); the band a pass_band selection would use is ignored."""
    from posttrain.config import RlSelect

    problems = PromptPool.of([{"id": f"p{i}"} for i in range(5)])
    rates = pa.Table.from_pylist([{"prompt_id": "p1", "pass_rate": 0.5}, {"prompt_id": "p2", "pass_rate": 0.0},
                                  {"prompt_id": "p3", "pass_rate": None}])
    every = RlSelect(strategy="all", min_pass_rate=0.4, max_pass_rate=0.6)
    assert [p["id"] for p in select.PROMPT_SELECTIONS["all"](problems, rates, every)] == ["p0", "p1", "p2", "p3", "p4"]
    assert [p["id"] for p in select.PROMPT_SELECTIONS["pass_band"](problems, rates, every)] == ["p1"]


def test_reference_reset_moves_the_kl_anchor_to_the_policy_and_clears_the_optimizer(tmp_path):
    """ProRL: after a reset the reference equals the policy (the KL is 0 again), Adam's state is gone, and a
    checkpoint carries the moved reference so a resumed run continues from it."""

    tok, model, seqs, _ = _setup()
    ref = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 1).eval()
    cfg = Rl(lr=1e-3, micro_batch_size=1, kl_coef=1.0, ref_reset={"every": 1, "optimizer": True})
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    m = update.policy_update(model.train(), opt, seqs, cfg, tok.pad_token_id, ref_model=ref)
    assert m["kl"] > 1e-3 and opt.state  # a different reference: a KL; Adam has moments
    update.reset_reference(ref, model, opt)
    assert not opt.state
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q) and p.data_ptr() != q.data_ptr()  # a copy, not the same tensors
    for s in seqs:
        s.ref_logp = None
    m = update.policy_update(model.train(), opt, seqs, cfg, tok.pad_token_id, ref_model=ref)
    assert m["kl"] < 1e-9  # k3 of identical distributions

    checkpoint.save_loop_state(tmp_path, 1, "fp", 0, model, opt, [], ref)
    fresh = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 2)
    checkpoint.restore_loop_state(tmp_path, "fp", model, opt, fresh)
    assert all(torch.equal(p, q) for p, q in zip(ref.parameters(), fresh.parameters(), strict=True))


def test_reference_reset_needs_a_reference_and_no_lora():
    from conftest import tiny_raw

    from posttrain.config import ConfigError, parse_params

    with pytest.raises(ValueError, match="needs a reference"):
        Rl(ref_reset={"every": 5})
    raw = tiny_raw(None)
    raw["rl"].update({"kl_coef": 0.1, "ref_reset": {"every": 5}})
    raw["distill"]["grpo_steps"] = 0  # phase C has no KL reference (refused)
    parse_params(raw)
    raw["model"]["lora"] = {"r": 4, "alpha": 8}
    with pytest.raises(ConfigError, match="rl.ref_reset: with model.lora"):
        parse_params(raw)


def test_prior_state_starts_from_the_reward_stage_and_is_updated_each_step(tmp_path):

    prior = select.PriorState.from_rates(pa.Table.from_pylist([
        {"prompt_id": "a", "mean_reward": 0.5, "scorable": 8}, {"prompt_id": "b", "mean_reward": 0.1, "scorable": 20},
        {"prompt_id": "c", "mean_reward": None, "scorable": 0},
        {"prompt_id": "d", "mean_reward": 0.75, "scorable": 4}]))
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 1], [1, 0, 1, 0]])
    adv = update.group_advantages(r, torch.ones(3, 4, dtype=torch.bool), ["a", "b", "c"], None, "prior_fused", prior)
    assert adv[0].tolist() == pytest.approx([7 / 12, -5 / 12, -5 / 12, -5 / 12], abs=1e-6)  # test_algos: by hand
    assert adv[2].tolist() == pytest.approx([0.5, -0.5, 0.5, -0.5])  # c has no prior: its group mean
    # a accepted: (5/12, (8 + 4) * 0.5 = 6); b rejected: (1.0, 4 * 0.5 = 2); c: (0.5, 2)
    assert prior.p == pytest.approx({"a": 5 / 12, "b": 1.0, "c": 0.5}) and prior.n == {"a": 6.0, "b": 2.0, "c": 2.0}

    tok, model, _, _ = _setup()
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save_loop_state(tmp_path, 1, "fp", 0, model, opt, [], extra={"prior": {"p": prior.p, "n": prior.n}})
    saved: dict = {}
    checkpoint.restore_loop_state(tmp_path, "fp", model, opt, extra=saved)
    restored = select.PriorState(**saved["prior"], base=prior.base)  # a resumed run continues from them: the
    ids = ["a", "b", "c", "d"]  # updated priors from the checkpoint, d's (never trained on) from the reward stage's
    assert restored == prior and torch.equal(restored.tensor(ids), prior.tensor(ids)) and prior.get("d") == (0.75, 4.0)


def test_adaptive_budget_refreshes_rejected_priors_with_fresh_samples():
    """refresh_priors: prompt a's prior (0.1 over 20) is rejected by its group [1, 1, 1, 1] (z = 3.79, see
    test_algos), b's (0.5 over 8) accepted by [1, 0, 0, 0]: only a gets G fresh samples, whose mean 0.75 (over
    4) becomes its prior; the extra group's samples are numbered G..2G-1. Through collect_step on an untrained
    policy (every reward 0; a prior of 0.9 over 8 against a group [0, 0]: pooled 7.2/10 = 0.72, z = 0.9 /
    sqrt(0.72 * 0.28 * (1/2 + 1/8)) = 2.54 > 1.96, rejected) the budget caps the extra groups, which are
    recorded after the first round's groups and not trained on."""
    from types import SimpleNamespace

    prior = select.PriorState({"a": 0.1, "b": 0.5}, {"a": 20.0, "b": 8.0})
    r, valid = torch.tensor([[1.0, 1, 1, 1], [1, 0, 0, 0]]), torch.ones(2, 4, dtype=torch.bool)
    asked = []

    def sample(ids):
        asked.extend(ids)
        return torch.tensor([[1.0, 1, 0, 1]] * len(ids)), torch.ones(len(ids), 4, dtype=torch.bool)

    assert collect.refresh_priors(prior, ["a", "b"], r, valid, 5, sample) == ["a"] and asked == ["a"]
    assert (prior.p["a"], prior.n["a"]) == (0.75, 4.0) and (prior.p["b"], prior.n["b"]) == (0.5, 8.0)
    assert collect.refresh_priors(prior, ["a", "b"], r, valid, 0, sample) == []  # no budget: nothing sampled

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    prompts = [{"id": f"p{i}", "prompt": f"{10 + i}*3=", "answer": str((10 + i) * 3), "task": "arith"}
               for i in range(6)]
    specs = [SimpleNamespace(name="correct", weight=1.0, kwargs={})]
    prior = select.PriorState({p["id"]: 0.9 for p in prompts}, {p["id"]: 8.0 for p in prompts})
    cfg = Rl(prompts_per_step=3, samples_per_prompt=2, dynamic_sampling="off", advantage="prior_fused", prior_budget=4,
             sampling={"max_new_tokens": 4})
    sb = collect.collect_step(BACKENDS["hf"](model.eval(), tok, 64), tok, prompts, select.PromptCursor(6, 0), cfg,
                           specs, seed=0, policy="p", prior=prior)
    assert len(sb.used) == 3 and len(sb.prompt_ids) == 3 + 2  # budget 4 = two extra groups of G = 2
    assert sb.used == [0, 1, 2] and all(x["sample"] in (2, 3) for i in (3, 4) for x in sb.rows[i])
    refreshed = set(sb.prompt_ids[3:])
    assert all(prior.p[i] == 0.0 and prior.n[i] == 2.0 for i in refreshed)  # every fresh sample was wrong
    with pytest.raises(ValueError, match="prior_fused"):
        Rl(prior_budget=4)


def test_a_prompt_sampled_twice_in_one_step_keeps_each_groups_own_advantages():
    """A prompt appears twice in a step when the selected prompts are fewer than ``prompts_per_step`` (1-shot
    RLVR: ``top_k`` 2, 4 prompts a step) or refill rounds cross an epoch of the cursor. Its groups [1, 0] and
    [0, 0]: GRPO gives [0.707107, -0.707107] (unbiased std of [1, 0]: sqrt(1/2)) and [0, 0]. Found here: keyed by
    (prompt_id, sample), the later group's [0, 0] overwrote the first's, which then carried no gradient."""
    tok, model, seqs, _ = _setup()
    rows = [{"prompt_id": "p", "sample": j, "reward": r, "token_ids": seqs[j].completion_ids,
             "logprobs": seqs[j].logprobs} for grp in ([1.0, 0.0], [0.0, 0.0]) for j, r in enumerate(grp)]
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    m, adv = update.update_from_groups(model.train(), opt, collect.StepBatch.from_rows(rows, 2),
                                       Rl(samples_per_prompt=2), {"p": seqs[0].prompt_ids}, tok.pad_token_id)
    assert adv.tolist() == [pytest.approx([0.707107, -0.707107], abs=1e-5), [0.0, 0.0]]
    assert m["grad_norm"] > 0  # the first group's samples carry the policy gradient
