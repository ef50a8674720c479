"""training.py: the SFT loss normalisation and resumable checkpoints (what resumes, what is set aside)."""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import torch

from posttrain import checkpoint, sft_data, training
from posttrain.config import Rl, Sft, TinyModel
from posttrain.modeling import build_char_tokenizer, build_tiny_model

DEMOS = [{"prompt": "12*3=", "answer": "36", "solution": None, "task": "arith"},
         {"prompt": "4738*7=", "answer": "33166", "solution": None, "task": "arith"}]


def _model(seed: int = 0):
    tok = build_char_tokenizer()
    return build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, seed), tok


def _sft(**kw) -> Sft:
    return Sft(**{"phases": [{"steps": 1, "cot_frac": 0.0}], "batch_size": 2, "micro_batch_size": 1,
                  "warmup_steps": 0, "log_every": 1, "checkpoint_every": 100, **kw})


def test_sft_loss_is_the_token_mean_over_completion_tokens(tmp_path):
    """Step 1's logged loss is the mean NLL over every completion token of the batch (both examples),
    computed here by hand from the untouched model: sum of -log p(target) / number of targets. The bare-answer
    completions 'answer: 36' and 'answer: 33166' + EOS are 11 and 14 tokens: 25 targets, not 25 - 2."""
    model, tok = _model()
    ref = copy.deepcopy(model).eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for d in DEMOS:
            ids, labels = sft_data.encode_sft(tok, d["prompt"], "answer: " + d["answer"])
            logp = torch.log_softmax(ref(input_ids=torch.tensor([ids])).logits[0, :-1].float(), -1)
            for t, y in enumerate(labels[1:]):
                if y != sft_data.IGNORE:
                    nll -= float(logp[t, y])
                    count += 1
    assert count == 25  # 11 + 14 completion tokens (character tokenizer, EOS included)
    res = training.sft_train(model, tok, DEMOS, _sft(), 0, tmp_path / "ck", "fp", progress=False)
    assert math.isclose(res["log"][0]["loss"], nll / count, rel_tol=1e-5), (res["log"][0]["loss"], nll / count)


def test_any_micro_batch_size_gives_the_full_batch_gradient(tmp_path):
    """training.accumulate takes any split of the batch (the config used to refuse a batch that micro-batches
    do not divide): 3 demos in micro-batches of 2 (2 + 1) end where one micro-batch of 3 ends."""
    demos = DEMOS + [{"prompt": "57*8=", "answer": "456", "solution": None, "task": "arith"}]
    ends = []
    for micro in (3, 2):
        model, tok = _model()
        training.sft_train(model, tok, demos, _sft(batch_size=3, micro_batch_size=micro, lr=1e-2), 0,
                           tmp_path / f"ck{micro}", "fp", progress=False)
        ends.append(model.state_dict())
    assert all(torch.allclose(ends[0][k], ends[1][k], atol=1e-6) for k in ends[0])


def test_no_gradient_memory_is_held_after_a_step():
    """M3 of the vLLM issue (read): gradients stayed allocated from one update through the next generation, where
    a colocated engine wants the memory. ``accumulate`` frees them once the optimizer has stepped."""
    model, tok = _model()
    opt = training.adamw(model, 1e-2, 0.0, training.ONLINE_BETAS)
    ids = torch.tensor([sft_data.encode_sft(tok, "1+1=", "2")[0]])
    before = [p.detach().clone() for p in model.parameters()]
    training.accumulate(model, opt, [ids], 1, lambda chunk, real: model(input_ids=chunk[0], labels=chunk[0]).loss, 1.0)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))  # it stepped
    assert all(p.grad is None for p in model.parameters())


def test_fingerprint_ignores_knobs_that_do_not_change_the_result():
    base = checkpoint.fingerprint(Rl())
    assert checkpoint.fingerprint(Rl(micro_batch_size=8, pack=True, checkpoint_every=3)) == base
    assert checkpoint.fingerprint(Rl(lr=1e-5)) != base
    assert checkpoint.fingerprint(Rl(generate_batch_size=64)) != base  # chunking seeds the samples
    assert checkpoint.fingerprint(_sft(micro_batch_size=2, checkpoint_every=7)) == checkpoint.fingerprint(_sft())


def test_resume_after_changing_micro_batch_size_gives_the_same_weights(tmp_path):
    """The usual out-of-memory fix between a kill and a resume (a smaller micro-batch) resumes from the
    checkpoint and ends where an uninterrupted run ends; a change that alters the result (lr) moves the old
    checkpoints aside, never deletes them."""
    demos = DEMOS * 4
    cfg = _sft(phases=[{"steps": 4, "cot_frac": 0.0}], batch_size=4, micro_batch_size=4, checkpoint_every=2)
    whole, tok = _model()
    straight = training.sft_train(whole, tok, demos, cfg, 0, tmp_path / "whole", checkpoint.fingerprint(cfg),
                                  progress=False)

    # "killed" after step 2: a run of the first two steps leaves the step-2 checkpoint behind
    ck = tmp_path / "ck"
    killed, _ = _model()
    training.sft_train(killed, tok, demos, cfg, 0, ck, checkpoint.fingerprint(cfg), progress=False)
    for p in sorted(ck.glob("step_*"))[1:]:
        shutil.rmtree(p)
    assert [p.name for p in ck.glob("step_*")] == ["step_0000002"]

    smaller = cfg.model_copy(update={"micro_batch_size": 1})
    resumed, _ = _model()
    res = training.sft_train(resumed, tok, demos, smaller, 0, ck, checkpoint.fingerprint(smaller), progress=False)
    assert res["start"] == 2
    for a, b in zip(whole.parameters(), resumed.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # the sample ledger (issue 49 #8): the resumed run's, steps 1-2 from the checkpoint, is the straight run's
    assert res["ledger"] == straight["ledger"] and [s["step"] for s in res["ledger"]] == [1, 2, 3, 4]
    assert all(len(s["ids"]) == len(s["styles"]) == 4 for s in res["ledger"])
    assert {i for s in res["ledger"] for i in s["ids"]} <= {str(k) for k in range(len(demos))}  # no ids: row numbers

    other = cfg.model_copy(update={"lr": 1e-3})
    fresh, _ = _model()
    res = training.sft_train(fresh, tok, demos, other, 0, ck, checkpoint.fingerprint(other), progress=False)
    assert res["start"] == 0
    aside = list(tmp_path.glob("ck.stale-*"))
    assert len(aside) == 1 and (aside[0] / "step_0000002" / "meta.json").is_file()


def test_stale_checkpoint_folder_name_says_what_it_was(tmp_path: Path):
    ck = tmp_path / "rl"
    model, _ = _model()
    opt = torch.optim.AdamW(model.parameters())
    checkpoint.save(ck, 5, "aaaa", model, opt, {})
    assert checkpoint.restore(ck, "bbbb", model, opt) is None
    (aside,) = tmp_path.glob("rl.stale-*")
    assert "aaaa" in aside.name and (aside / "step_0000005" / "meta.json").is_file()


def test_a_token_budget_cuts_micro_batches_by_padded_tokens():
    """Issue 50, finding 4: micro-batches were sized by sequence count only. ``MicroBatch(size, max_tokens)``:
    lengths 10, 10, 50, 5, 5, 5, 100 at size 4, budget 60 (padded tokens = sequences x the longest):
    [10, 10] (2 x 10 = 20; adding 50 would be 3 x 50 = 150), [50] (2 x 50 = 100 > 60), [5, 5, 5] (3 x 5; then
    4 x 100), [100] alone (over the budget by itself). Nine 1-token items at size 4: 4, 4, 1."""
    mb = training.MicroBatch(4, 60, lambda n: n)
    assert mb.chunks([10, 10, 50, 5, 5, 5, 100]) == [[10, 10], [50], [5, 5, 5], [100]]
    assert [len(c) for c in training.MicroBatch(4, 1000, lambda n: n).chunks([1] * 9)] == [4, 4, 1]
    assert training.MicroBatch(4).chunks(list(range(9))) == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


def test_a_token_budget_gives_the_full_batch_gradient(tmp_path, monkeypatch):
    """The exact loss aggregation holds whatever the cut: SFT of 3 demos (18, 23 and 19 tokens) under a 40-token
    budget ends where one micro-batch of all 3 ends. The budget is used, counted: 2 forward passes against 1
    (``batching: grouped`` orders them by length: [18, 19] is 2 x 19 = 38 tokens, [23] alone)."""
    demos = DEMOS + [{"prompt": "57*8=", "answer": "456", "solution": None, "task": "arith"}]
    ends, passes, accumulate = [], [], training.accumulate

    def counted(model, opt, items, micro, loss_of_batch, *a, **k):  # the chunks sft_train's budget made
        def loss(chunk, real):
            passes[-1] += 1
            return loss_of_batch(chunk, real)
        return accumulate(model, opt, items, micro, loss, *a, **k)

    monkeypatch.setattr(training, "accumulate", counted)
    for kw in ({"micro_batch_size": 3}, {"micro_batch_size": 3, "max_tokens_per_micro_batch": 40}):
        model, tok = _model()
        passes.append(0)
        training.sft_train(model, tok, demos, _sft(batch_size=3, lr=1e-2, **kw), 0, tmp_path / f"ck{len(kw)}", "fp",
                           progress=False)
        ends.append(model.state_dict())
    assert passes == [1, 2]  # one step each: all 3 demos at once; then [18, 19] and [23]
    assert all(torch.allclose(ends[0][k], ends[1][k], atol=1e-6) for k in ends[0])
    lengths = [len(sft_data.encode_sft(tok, d["prompt"], "answer: " + d["answer"])[0]) for d in demos]
    assert lengths == [18, 23, 19]
    assert len(training.MicroBatch(3, 40, len).chunks([[0] * n for n in lengths])) == 3  # in this order: 3 cuts
    assert Rl(max_tokens_per_micro_batch=8192).max_tokens_per_micro_batch == 8192  # rl and distill take it too


def test_a_resumed_run_reports_the_whole_runs_padding_fraction(tmp_path):
    """``data.padding_frac`` (metrics/sft.json) counts the padded positions of every step, so a run resumed from
    its step-2 checkpoint reports the straight run's, not that of the steps it trained itself."""
    demos = [{"prompt": f"{'9' * k}*7=", "answer": str(int("9" * k) * 7), "solution": None, "task": "arith"}
             for k in range(1, 9)]  # 8 lengths: each step's batch pads differently
    cfg = _sft(phases=[{"steps": 4, "cot_frac": 0.0}], batch_size=4, micro_batch_size=4, checkpoint_every=2)
    straight = training.sft_train(_model()[0], _model()[1], demos, cfg, 0, tmp_path / "whole",
                                  checkpoint.fingerprint(cfg), progress=False)
    ck = tmp_path / "ck"
    shutil.copytree(tmp_path / "whole", ck)
    for p in sorted(ck.glob("step_*"))[1:]:  # "killed" after step 2
        shutil.rmtree(p)
    res = training.sft_train(_model()[0], _model()[1], demos, cfg, 0, ck, checkpoint.fingerprint(cfg), progress=False)
    assert res["start"] == 2 and 0 < straight["data"]["padding_frac"] < 1
    assert res["data"] == straight["data"]


def test_steps_inside_one_autocast_region_see_the_weights_each_step_wrote():
    """model.dtype bfloat16 keeps fp32 masters and casts them under autocast, which caches each weight's cast until
    its region ends and never sees an in-place optimizer step. The sft stage holds one region over the whole run:
    without clearing that cache after each step, every forward after the first used the first step's weights
    (the stale cast) and the masters moved on gradients taken there. Two steps in one region must equal two
    steps in regions of their own."""
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    ref = torch.nn.Linear(8, 8)
    losses = {}
    for arm in ("one region", "a region each"):
        lin = copy.deepcopy(ref)
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        seen = []

        def loss_of(chunk, real, lin=lin, seen=seen):
            loss = lin(x).float().pow(2).mean()
            seen.append(float(loss))
            return loss

        if arm == "one region":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                for _ in range(2):
                    training.accumulate(lin, opt, [0], 1, loss_of, 1e9)
        else:
            for _ in range(2):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    training.accumulate(lin, opt, [0], 1, loss_of, 1e9)
        losses[arm] = seen
    assert losses["a region each"][1] != losses["a region each"][0]  # the step changed the loss
    assert losses["one region"] == losses["a region each"]
