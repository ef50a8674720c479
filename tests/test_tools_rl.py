"""Multi-turn tool rollouts in RL: observation tokens are out of the policy loss, the KL, the entropy, the token
counts and token selection (``loss_mask``), and a multi-turn step replays from its persisted shard."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import GradCapture

from posttrain import logprobs
from posttrain.config import Rl, TinyModel, ToolsCfg, parse_params
from posttrain.logprobs import Seq
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from posttrain.rl import collect, select, shards, update
from posttrain.rollout import BACKENDS, chat_prompt_ids
from posttrain.schema import SHARD_SCHEMA, read_parquet, with_tool_fields
from posttrain.tools import FORMATS, Call, Format, ToolBackend, ToolContext
from posttrain.tools import formats as formats_mod
from tests.conftest import import_base


def _tiny():
    tok = build_char_tokenizer()
    return tok, build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)


def _grads(model, seqs, cfg, pad):
    m = copy.deepcopy(model).train()
    opt = GradCapture(m.parameters())
    metrics = update.policy_update(m, opt, [copy.deepcopy(s) for s in seqs], cfg, pad)
    return opt.grads, metrics


def test_the_batch_mask_excludes_every_observation_token():
    # prompt [1, 5, 6] (p = 3), completion of 5 tokens, the 2nd and 3rd an observation. Targets t+1: the completion
    # sits at positions p-1 .. p+3 = 2..6 of the [1, 7] aligned tensors: mask 0 0 | 1 0 0 1 1
    s = Seq([1, 5, 6], [10, 11, 12, 13, 2], [-1.0, 0.0, 0.0, -2.0, -0.5], 1.0, loss_mask=[1, 0, 0, 1, 1])
    plain = Seq([1, 5, 6], [10, 11, 12, 13, 2], [-1.0, 0.0, 0.0, -2.0, -0.5], 1.0)
    t = logprobs.batch_tensors([s, plain], 0, torch.device("cpu"))
    assert t["mask"].tolist() == [[0, 0, 1, 0, 0, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
    assert s.n_model_tokens() == 3 and s.model_tokens().tolist() == [0, 3, 4] and plain.n_model_tokens() == 5


def _masked_pair():
    tok, model = _tiny()
    ids = chat_prompt_ids(tok, ["12*3="])[0]
    a = Seq(ids, tok("ab<o>c", add_special_tokens=False)["input_ids"], [-1.0] * 6, 1.0,
            loss_mask=[1, 1, 0, 0, 0, 1])  # 3 model tokens, an observation of 3
    b = Seq(ids, tok("x<oo>y", add_special_tokens=False)["input_ids"], [-1.0] * 6, -1.0,
            loss_mask=[1, 0, 0, 0, 0, 1])  # 2 model tokens, an observation of 4
    return tok, model, [a, b]


def test_the_loss_counts_model_tokens_only():
    """Exactly on-policy, ratio 1: the ppo_clip token loss is -adv on each token it sees. token-mean over the model
    tokens: -(3 * 1 + 2 * (-1)) / (3 + 2) = -0.2 (counting the observations too: -(6 - 6) / 12 = 0, or with their
    tokens in the sum and not the count, -(6 - 6) / 5 = 0)."""
    tok, model, seqs = _masked_pair()
    _, m = _grads(model, seqs, Rl(loss_agg="token-mean", micro_batch_size=4), tok.pad_token_id)
    assert m["loss"] == pytest.approx(-0.2, abs=1e-6)
    # seq-mean-token-mean: mean over the two sequences of their token means: (-1 + 1) / 2 = 0
    _, m = _grads(model, seqs, Rl(loss_agg="seq-mean-token-mean", micro_batch_size=4), tok.pad_token_id)
    assert m["loss"] == pytest.approx(0.0, abs=1e-6)


def test_the_policy_gradient_ignores_observation_log_probs():
    """The sampler's, the old policy's and the reference's log-probs at observation tokens are changed wildly: the
    gradient (policy loss + a TIS correction + the KL) is the same. Without the mask the same change moves it."""
    from posttrain.config import CorrectionSpec

    tok, model, seqs = _masked_pair()
    cfg = Rl(kl_coef=0.5, micro_batch_size=4, epochs=2, correction=CorrectionSpec(name="tis_token",
                                                                                 kwargs={"cap": 2.0}))
    for s in seqs:
        s.ref_logp = torch.full((len(s.completion_ids),), -1.5)
    base, _ = _grads(model, seqs, cfg, tok.pad_token_id)
    moved = copy.deepcopy(seqs)
    for s in moved:
        obs = s.loss_mask == 0
        s.logprobs[obs], s.ref_logp[obs] = -9.0, 3.0
    after, _ = _grads(model, moved, cfg, tok.pad_token_id)
    assert all(torch.equal(x, y) for x, y in zip(base, after, strict=True))
    for s in (*seqs, *moved):  # the control: the same change, no mask
        s.loss_mask = None
    base, _ = _grads(model, seqs, cfg, tok.pad_token_id)
    after, _ = _grads(model, moved, cfg, tok.pad_token_id)
    assert not all(torch.equal(x, y) for x, y in zip(base, after, strict=True))


def test_token_selection_never_ranks_observation_tokens():
    # model-token entropies of the batch: a: 0.1, 0.5, 0.3 (its 9s are an observation's), b: 0.2, 0.9.
    # top_entropy rho 0.5 keeps ceil(0.5 * 5) = 3 of the 5 model tokens: 0.9, 0.5, 0.3 -> a: 0 . . 1 1, b: 0 1
    a = Seq([1], [10, 11, 12, 13, 14], [0.0] * 5, 1.0, entropy=[0.1, 9.0, 9.0, 0.5, 0.3], loss_mask=[1, 0, 0, 1, 1])
    b = Seq([1], [10, 11], [0.0] * 2, 1.0, entropy=[0.2, 0.9])
    share = update.select_tokens([a, b], "top_entropy", 0.5)
    assert a.pg_mask.tolist() == [0, 0, 0, 1, 1] and b.pg_mask.tolist() == [0, 1]
    assert share == pytest.approx(3 / 5)


@pytest.fixture
def char_format(monkeypatch):
    """A closing tag of one character (the untrained tiny model calls often): each call is calc on 2+3."""
    fmt = Format("a", lambda text: Call("calc", "2+3") if "a" in text else None, FORMATS["tag"].render)
    monkeypatch.setitem(formats_mod.FORMATS, "tag", fmt)


def test_a_multi_turn_step_replays_from_its_shard(tmp_path, char_format):
    """collect_step through the tool loop -> the update's gradient; the step's shard, read back, holds every turn
    (token ids, loss masks, tool calls) and gives the same advantages and the same gradient."""
    tok, model = _tiny()
    prompts = [{"id": f"p{i}", "prompt": f"{10 + i}*3=", "answer": str((10 + i) * 3), "task": "arith"}
               for i in range(4)]
    specs = [SimpleNamespace(name="overlong", weight=1.0, kwargs={"buffer": 30})]  # length varies: reward varies
    cfg = Rl(prompts_per_step=2, samples_per_prompt=4, dynamic_sampling="off", micro_batch_size=4,
             sampling={"max_new_tokens": 32})
    loop = ToolBackend(BACKENDS["hf"](model.eval(), tok, 64), tok, ToolsCfg(enabled=True, names=["calc"]),
                       ToolContext(sandbox=lambda: None))
    sb = collect.collect_step(loop, tok, prompts, select.PromptCursor(4, 0), cfg, specs, seed=3, policy="p")
    prompt_ids = dict(zip([p["id"] for p in prompts], chat_prompt_ids(tok, [p["prompt"] for p in prompts]),
                          strict=True))
    live = [r for i in sb.used for r in sb.rows[i]]
    assert sum(r["tool_calls"] for r in live) > 0 and any((r["loss_mask"] == 0).any() for r in live)
    assert sb.stats[:, :, collect.TOOL_CALLS].sum() == sum(r["tool_calls"] for r in live)

    def grads(batch):
        m = copy.deepcopy(model).train()
        opt = GradCapture(m.parameters())
        metrics, adv = update.update_from_groups(m, opt, batch, cfg, prompt_ids, tok.pad_token_id, seed=5)
        return opt.grads, metrics, adv

    g_live, m_live, adv = grads(sb)
    path = tmp_path / "step_00001.parquet"
    shards.write_shard(path, sb, adv, 1, with_tool_fields(SHARD_SCHEMA, True))
    rows = read_parquet(path)
    assert [r["token_ids"] for r in rows] == [r["token_ids"].tolist() for r in live]
    assert [r["loss_mask"] for r in rows] == [r["loss_mask"].tolist() for r in live]
    for r in rows:  # observation tokens: log-prob 0, never the sampler's
        assert all(lp == 0.0 for lp, k in zip(r["logprobs"], r["loss_mask"], strict=True) if not k)
    g_replay, m_replay, adv_replay = grads(collect.StepBatch.from_rows(rows, cfg.samples_per_prompt))
    assert torch.equal(adv, adv_replay)
    assert all(torch.allclose(x, y, atol=1e-7) for x, y in zip(g_live, g_replay, strict=True))
    assert m_replay["loss"] == pytest.approx(m_live["loss"], abs=1e-7)

    # rl.shard_tokens: false (issue 50, storage): the per-token columns null, every other column as written above
    shards.write_shard(tmp_path / "lean.parquet", sb, adv, 1, with_tool_fields(SHARD_SCHEMA, True), tokens=False)
    lean = read_parquet(tmp_path / "lean.parquet")
    assert all(r[k] is None for r in lean for k in ("token_ids", "logprobs", "loss_mask"))
    assert [r["num_tokens"] for r in lean] == [len(r["token_ids"]) for r in rows]
    per_token = {"token_ids", "logprobs", "loss_mask"}
    assert [{k: v for k, v in r.items() if k not in per_token} for r in lean] == [
        {k: v for k, v in r.items() if k not in per_token} for r in rows]


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_rollout_rl_and_evaluate_stages_run_tool_rollouts(tiny, char_format):
    """tools.enabled through the stages: rollouts.parquet and every rl shard carry each completion's loss mask and
    tool calls, the rl log has a tool_calls column, evaluate generates through the same loop."""
    from stages import curate, evaluate, reward, rl, rollout, sft

    tiny["tools"].update(enabled=True, names=["calc"])
    tiny["rollout"]["keep_tokens"] = True  # the per-token columns (loss masks among them) kept for the audit below
    for phase in ("warmup", "on_policy"):
        tiny["distill"][phase]["steps"] = 0
    tiny["distill"]["grpo_steps"] = 0
    tiny["rl"]["steps"] = 2
    p = parse_params(tiny)
    curate.run(p, *curate.paths(p))
    import_base(p)
    sft.run(p, *sft.paths(p))
    rollout.run(p, *rollout.paths(p))
    rows = read_parquet(rollout.paths(p)[1]["rollouts"])
    assert all(len(r["loss_mask"]) == len(r["token_ids"]) == r["num_tokens"] for r in rows)
    assert sum(r["tool_calls"] for r in rows) > 0 and any(0 in r["loss_mask"] for r in rows)
    reward.run(p, *reward.paths(p))
    m = rl.run(p, *rl.paths(p))
    shard = read_parquet(sorted((Path(p.paths.rl_dir) / "shards").glob("step_*.parquet"))[0])
    assert all(len(r["loss_mask"]) == len(r["token_ids"]) and r["tool_calls"] is not None for r in shard)
    log = (Path(p.paths.rl_report_dir) / "train_log.csv").read_text().splitlines()
    assert log[0].endswith(",tool_calls") and float(log[1].split(",")[-1]) > 0
    assert m["steps"] == 2 and m["tool_calls"] > 0
    res = evaluate.run(p, *evaluate.paths(p, "sft"))
    assert res["eval"]["n"] > 0


def test_distillation_losses_average_over_model_tokens_only():
    """A sequence whose last two completion tokens are an observation: the SFT loss is the mean NLL of its two
    model tokens (not the sum over them / 4, as when observation tokens were counted: watched fail, half the
    loss), and the divergence loss equals that of the sequence without the observation tokens' targets."""
    from posttrain import distillation

    tok, model = _tiny()
    prompt = chat_prompt_ids(tok, ["2+3="])[0]
    ids = tok("ab<o", add_special_tokens=False).input_ids  # 2 model tokens, then 2 observation tokens
    masked = Seq(prompt, ids, [0.0] * 4, 0.0, loss_mask=[1, 1, 0, 0])
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=seq).logits[0, len(prompt) - 1 : -1].float(), -1)
    nll = -lp.gather(-1, torch.tensor(ids)[:, None]).squeeze(1)  # [4]
    m = distillation.nll_update(copy.deepcopy(model).train(), GradCapture(model.parameters()), [masked],
                                tok.pad_token_id, 4)
    assert m["loss"] == pytest.approx(float(nll[:2].mean()), rel=1e-5)  # (nll_a + nll_b) / 2
    teacher = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 1)
    two = Seq(prompt, ids[:2], [0.0] * 2, 0.0)  # the same two model tokens, nothing after
    got = [distillation.divergence_update(copy.deepcopy(model).train(), teacher, GradCapture(model.parameters()), [s],
                                          "reverse_kl", 0.5, tok.pad_token_id, 4)["loss"] for s in (masked, two)]
    assert got[0] == pytest.approx(got[1], rel=1e-5)


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_the_distill_stage_samples_through_the_tool_loop_and_masks_observations(tiny, char_format, monkeypatch):
    """tools.enabled in distill: teacher (warmup) and student (on-policy, grpo) samples come from the tool loop,
    every sequence the divergence sees carries its loss mask, and the distill log has a tool_calls column."""
    from posttrain import distillation
    from stages import curate, distill, sft

    tiny["tools"].update(enabled=True, names=["calc"])
    tiny["distill"]["warmup"].update(steps=1, targets="soft")
    tiny["distill"]["on_policy"]["steps"] = 1
    tiny["distill"]["grpo_steps"] = 1
    p = parse_params(tiny)
    seen = []
    real = distillation.divergence_update
    monkeypatch.setattr(distillation, "divergence_update", lambda st, te, opt, seqs, *a, **k: (
        seen.extend(seqs), real(st, te, opt, seqs, *a, **k))[1])
    curate.run(p, *curate.paths(p))
    import_base(p)
    sft.run(p, *sft.paths(p))
    shutil.copytree(p.paths.sft_model, p.paths.rl_model)  # the teacher: here the SFT model (rl is not the subject)
    m = distill.run(p, *distill.paths(p))
    assert seen and all(s.loss_mask is not None and len(s.loss_mask) == len(s.completion_ids) for s in seen)
    assert any(0 in s.loss_mask.tolist() for s in seen)  # an observation, kept out of the divergence
    log = (Path(p.paths.distill_report_dir) / "train_log.csv").read_text().splitlines()
    assert log[0].endswith(",tool_calls") and len(log) == 4 and m["tool_calls"] > 0
