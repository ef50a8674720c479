"""Learned rewards: the ensemble combinations (mean, WCO, UWO) and the per-step Clip / Delta transforms on
hand-computed values; the ``reward_model`` reward on a tiny trained reward model (one batched forward, a model
loaded once per process, too long = unscorable); its config checks; and the reward stage's audit of a learned
reward (agreement with the verifier, quantiles, hacks, the plot)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import REPO, repo_params, tiny_raw
from test_reward_model import _arith_prefs, _params

from posttrain.config import ConfigError, parse_params
from posttrain.rewards import Sample, Spec, combine, learned
from posttrain.rewards.audit_learned import Learned, auc
from posttrain.rewards.ensemble import COMBINES, STEP_TRANSFORMS, step_ends
from posttrain.schema import ROLLOUT_SCHEMA, read_parquet, write_parquet
from stages import reward as reward_stage
from stages import reward_model as rm_stage


# ------------------------------------------------------------------------------------------ math
def test_ensemble_combines_hand_computed():
    # members [1, 2, 6]: mean 3; min 1; deviations -2, -1, 3 -> squares 4, 1, 9 -> variance 14 / 3 = 4.666667,
    # std sqrt(4.666667) = 2.160247. lam 0.5: UWO = 3 - 0.5 x 4.666667 = 0.666667; with std 3 - 1.080123 = 1.919877.
    # members [0, 0, 0]: every combination 0 (no disagreement: UWO = mean).
    r = np.array([[1.0, 2.0, 6.0], [0.0, 0.0, 0.0]])
    assert COMBINES["mean"](r, 0.5) == pytest.approx([3.0, 0.0])
    assert COMBINES["wco"](r, 0.5) == pytest.approx([1.0, 0.0])
    assert COMBINES["uwo"](r, 0.5) == pytest.approx([0.666667, 0.0], abs=1e-6)
    assert COMBINES["uwo_std"](r, 0.5) == pytest.approx([1.919877, 0.0], abs=1e-6)
    assert COMBINES["uwo"](r, 0.0) == pytest.approx(COMBINES["mean"](r, 0.0))  # lam 0: the mean
    one = np.array([[2.5]])  # one member: no spread, every combination is its score
    assert all(fn(one, 3.0)[0] == 2.5 for fn in COMBINES.values())


def test_step_transforms_hand_computed_and_bounded():
    s, eta = np.array([0.5, -1.0, 2.0]), 1.0
    # clip: min(s - 1, 0) = [min(-0.5, 0), min(-2, 0), min(1, 0)] = [-0.5, -2.0, 0.0]; sum -2.5
    assert STEP_TRANSFORMS["clip"](s, eta) == pytest.approx([-0.5, -2.0, 0.0])
    # delta: [0.5 - (-1), -1 - 2, 2] = [1.5, -3.0, 2.0]; sum 0.5 = s_1 (it telescopes)
    assert STEP_TRANSFORMS["delta"](s, eta) == pytest.approx([1.5, -3.0, 2.0])
    assert STEP_TRANSFORMS["raw"](s, eta).sum() == pytest.approx(1.5)
    # the hack the paper names: repeating a well-scored step. Raw grows with T; clip and delta do not.
    for t in (1, 4, 16):
        rep = np.full(t, 2.0)
        assert STEP_TRANSFORMS["raw"](rep, 0.0).sum() == pytest.approx(2.0 * t)
        assert STEP_TRANSFORMS["clip"](rep, 0.0).sum() == 0.0  # every step min(2 - 0, 0) = 0: at most 0
        assert STEP_TRANSFORMS["delta"](rep, 0.0).sum() == pytest.approx(2.0)  # s_1, whatever T


def test_step_ends():
    # "a\nb\n\nc\n": steps "a" (ends at 1), "b" (3), "" skipped, "c" (6) -> the last end is the whole text (7)
    assert step_ends("a\nb\n\nc\n", "\n") == [1, 3, 7]
    assert step_ends("12*3=36;36+1=37;answer: 37", ";") == [7, 15, 26]
    assert step_ends("", "\n") == [0] and step_ends("   ", "\n") == [3]


# ------------------------------------------------------------------------------------------ the reward
@pytest.fixture(scope="module")
def rm(tmp_path_factory) -> Path:
    """A 2-member reward model trained on separable arithmetic preferences (correct > off by one)."""
    tmp = tmp_path_factory.mktemp("rm")
    p = _params(tiny_raw(tmp), tmp, members=2)
    _arith_prefs(tmp / "prefs.jsonl", 80, seed=1)
    ins, out = rm_stage.paths(p, "prefs")
    rm_stage.run(p, ins, out)
    return out["model"]


def _s(prompt: str, completion: str, answer: str = "60") -> Sample:
    return Sample(completion, answer, "arith", len(completion), 80, "stop", prompt)


def test_reward_model_scores_a_batch_as_its_members_combined(rm):
    from posttrain.reward_model import load_reward_model

    samples = [_s("20*3=", "answer: 60"), _s("20*3=", "answer: 61"), _s("14*5=", "answer: 70", "70")]
    member = load_reward_model(rm)([s.prompt for s in samples], [s.completion for s in samples]).astype(float)
    got = {c: learned.reward_model(samples, str(rm), combine=c, lam=0.5) for c in ("mean", "wco", "uwo")}
    assert got["mean"] == pytest.approx(member.mean(1), abs=1e-5)
    assert got["wco"] == pytest.approx(member.min(1), abs=1e-5)
    assert got["uwo"] == pytest.approx(member.mean(1) - 0.5 * member.var(1), abs=1e-5)
    assert got["mean"][0] > got["mean"][1]  # it learned: the correct product outscores the off-by-one
    # per step (split on ';'): "12*5=60;answer: 60" has prefixes "12*5=60" and the whole text
    s = _s("12*5=", "12*5=60;answer: 60")
    pre = load_reward_model(rm)([s.prompt] * 2, ["12*5=60", s.completion]).astype(float).mean(1)
    clip = learned.reward_model([s], str(rm), steps="clip", step_sep=";", eta=0.0)[0]
    assert clip == pytest.approx(np.minimum(pre, 0.0).sum(), abs=1e-5) and clip <= 0.0
    delta = learned.reward_model([s], str(rm), steps="delta", step_sep=";")[0]
    assert delta == pytest.approx(pre[0], abs=1e-5)  # telescopes to the first prefix's score


def test_too_long_is_unscorable_never_truncated_into_a_score(rm):
    # the tiny model's context is 128 tokens; 300 characters of a character tokenizer do not fit
    got = learned.reward_model([_s("20*3=", "9" * 300), _s("20*3=", "answer: 60")], str(rm))
    assert got[0] is None and got[1] is not None
    [(total, parts)] = combine([_s("20*3=", "9" * 300)], [Spec("reward_model", 1.0, {"path": str(rm)})])
    assert total is None and parts == {"reward_model": None}


def test_the_model_is_loaded_once_per_process_and_again_when_it_changes(rm, tmp_path):
    import shutil

    copy = tmp_path / "rm"
    shutil.copytree(rm, copy)
    first = learned.scorer_for(str(copy))
    assert learned.scorer_for(str(copy)) is first  # cached: same folder, same digest
    manifest = copy / "manifest.json"
    manifest.write_text(manifest.read_text() + " ")  # its bytes changed (a retrained model at the same path)
    assert learned.scorer_for(str(copy)) is not first
    with pytest.raises(Exception, match="not a reward model"):
        learned.scorer_for(str(tmp_path / "nothing"))


def test_the_reward_model_scores_in_bf16_and_plain_cuda_is_the_ranks_own_gpu(rm, monkeypatch):
    """Issue 50 item 4: the reward model loaded in fp32 whatever the run's dtype, and ``device: cuda`` put every
    rank's scorers on GPU 0. Now ``dtype`` loads the members in it (half the bytes in bf16; scores within bf16
    rounding of fp32's) and plain ``cuda`` under torchrun is ``cuda:<LOCAL_RANK>``."""
    samples = [_s("20*3=", "answer: 60"), _s("20*3=", "answer: 61"), _s("14*5=", "answer: 70", "70")]
    f32 = learned.reward_model(samples, str(rm))
    bf16 = learned.reward_model(samples, str(rm), dtype="bfloat16")
    members = learned.scorer_for(str(rm), dtype="bfloat16").members
    assert {p.dtype for m in members for p in m.parameters()} == {torch.bfloat16}
    assert bf16 == pytest.approx(f32, abs=0.05 + 0.02 * max(abs(x) for x in f32)) and bf16 != f32
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert [learned.rank_device(d) for d in ("cuda", "cuda:1", "cpu")] == ["cuda:3", "cuda:1", "cpu"]
    monkeypatch.delenv("LOCAL_RANK")
    assert learned.rank_device("cuda") == "cuda"  # one process: the current GPU


# ------------------------------------------------------------------------------------------ config
def _with(rewards: list[dict], **top: dict) -> dict:
    raw = repo_params()
    raw["reward"]["rewards"] = rewards
    raw.update(top)
    return raw


@pytest.mark.parametrize("kwargs,key,says", [
    ({"path": "models/reward_model/nope"}, "reward.rewards[1].kwargs.path", "is not a reward model"),
    ({"path": "{rm}", "combine": "median"}, "reward.rewards[1].kwargs.combine", "unknown combine 'median'"),
    ({"path": "{rm}", "steps": "sum"}, "reward.rewards[1].kwargs.steps", "unknown steps 'sum'"),
    ({"path": "{rm}", "lam": -1.0}, "reward.rewards[1].kwargs.lam", "greater than or equal to 0"),
    ({}, "reward.rewards[1].kwargs.path", "Field required"),
    ({"path": "{rm}", "dtype": "float64"}, "reward.rewards[1].kwargs.dtype", "float32"),
])
def test_bad_reward_model_kwargs_are_refused_at_load_naming_the_key(rm, kwargs, key, says):
    kwargs = {k: v.format(rm=rm) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ConfigError) as e:
        parse_params(_with([{"name": "correct"}, {"name": "reward_model", "weight": 0.0, "kwargs": kwargs}]))
    assert f"params: {key}: " in str(e.value) and says in str(e.value), str(e.value)
    parse_params(_with([{"name": "correct"}, {"name": "reward_model", "kwargs": {"path": str(rm)}}]))  # a real one


def test_a_reward_model_the_pipeline_builds_is_accepted_unless_it_is_a_cycle():
    rw = {"name": "reward_model", "kwargs": {"path": "models/reward_model/prefs"}}
    parse_params(_with([{"name": "correct"}, rw], reward_model={**repo_params()["reward_model"],
                                                                "models": {"prefs": "data/prefs.jsonl"}}))
    with pytest.raises(ConfigError, match=r"reward.rewards\[1\].kwargs.path: .*a cycle"):
        parse_params(_with([{"name": "correct"}, rw], reward_model={**repo_params()["reward_model"],
                                                                    "models": {"prefs": "data/reward"}}))


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_a_missing_reward_model_exits_2_in_one_line(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(_with([{"name": "correct"}, {"name": "reward_model",
                                                               "kwargs": {"path": str(tmp_path / "no_rm")}}])))
    r = subprocess.run([sys.executable, "-m", "stages.reward", "--params", str(bad)], capture_output=True, text=True,
                       cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "reward.rewards[1].kwargs.path" in r.stderr and "is not a reward model" in r.stderr, r.stderr


# ------------------------------------------------------------------------------------------ the audit
def _row(pid: str, completion: str, correct: float | None, score: float | None) -> dict:
    return {"prompt_id": pid, "prompt": f"{pid}=", "answer": "1", "completion": completion,
            "rewards": json.dumps({"correct": correct, "reward_model": score})}


def test_learned_audit_hand_computed():
    rows = [_row("p1", "A", 1.0, 0.9), _row("p1", "B", 0.0, 0.4), _row("p1", "C", 0.0, 0.95),
            _row("p2", "D", 1.0, 0.2), _row("p2", "E", 0.0, 0.2), _row("p2", "F", None, 0.5),
            _row("p2", "G", 1.0, None)]
    a = Learned("reward_model", k=2)
    a.add(rows)
    a.add_group(rows[:3])
    a.add_group(rows[3:])
    res = a.result()
    assert res["scored"] == 6 and res["unscorable"] == 1  # G has no learned score
    # AUC over all: correct [0.9, 0.2] vs incorrect [0.4, 0.95, 0.2]: 0.9 beats 0.4 and 0.2 (2), 0.2 ties 0.2
    # (0.5) -> 2.5 of 6 pairs = 0.416667
    assert res["auc"] == pytest.approx(0.416667, abs=1e-6)
    # within a prompt: p1 0.9 vs 0.4 (win), 0.9 vs 0.95 (loss); p2 0.2 vs 0.2 (a half) -> 1.5 / 3 = 0.5
    assert res["pairwise_agreement"] == 0.5 and res["within_prompt_pairs"] == 3
    # scores [0.2, 0.2, 0.4, 0.5, 0.9, 0.95]: mean 3.15 / 6 = 0.525; median (0.4 + 0.5) / 2 = 0.45
    assert res["mean"] == pytest.approx(0.525) and res["quantiles"]["p50"] == pytest.approx(0.45)
    assert res["quantiles"]["p0"] == 0.2 and res["quantiles"]["p100"] == 0.95
    # correct mean (0.9 + 0.2) / 2 = 0.55; incorrect (0.4 + 0.95 + 0.2) / 3 = 0.516667
    assert res["mean_correct"] == pytest.approx(0.55) and res["mean_incorrect"] == pytest.approx(0.516667, abs=1e-6)
    # hacks: the 2 best-scored completions the verifier rejects, best first: C (0.95), B (0.4); not E (0.2)
    assert [(h["completion"], h["score"]) for h in res["hacks"]] == [("C", 0.95), ("B", 0.4)]
    assert auc(np.array([1.0]), np.array([])) is None


def test_reward_stage_audits_a_learned_reward(rm, tmp_path):
    """The reward stage with ``reward_model`` (weight 0: logged, not summed) beside ``correct``: the rewards are the
    verifier's, and the audit's learned section shows agreement, quantiles, hacks and the plot."""
    tiny = tiny_raw(tmp_path)
    tiny["reward"]["rewards"] = [{"name": "correct", "weight": 1.0},
                                 {"name": "reward_model", "weight": 0.0, "kwargs": {"path": str(rm)}}]
    p = parse_params(tiny)
    rows = []
    for i, (a, b) in enumerate([(20, 3), (14, 5), (36, 2), (48, 7), (22, 9), (30, 4)]):
        for j, off in enumerate((0, 0, 1, 11)):
            text = f"answer: {a * b + off}"
            rows.append({"prompt_id": f"p{i}", "sample": j, "prompt": f"{a}*{b}=", "answer": str(a * b),
                         "task": "arith", "completion": text, "token_ids": [5] * len(text),
                         "logprobs": [0.0] * len(text), "num_tokens": len(text), "finish_reason": "stop", "policy": "x",
                         "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 80, "seed": 0})
    ins, out = reward_stage.paths(p)
    write_parquet(ins["rollouts"], rows, ROLLOUT_SCHEMA)
    m = reward_stage.run(p, ins, out)
    assert m["reward_mean"] == 0.5  # correct alone: 12 of 24
    scored = read_parquet(out["rewards"])
    assert all(json.loads(r["rewards"])["reward_model"] is not None for r in scored)
    res = json.loads((out["report_dir"] / "audit.json").read_text())["learned"]["reward_model"]
    assert res["scored"] == 24 and res["verified"] == {"correct": 12, "incorrect": 12}
    assert res["within_prompt_pairs"] == 6 * 2 * 2 and 0.0 <= res["auc"] <= 1.0
    q = list(res["quantiles"].values())
    assert q == sorted(q) and len(q) == 7
    hacks = res["hacks"]
    assert len(hacks) == p.reward.audit_examples and [h["score"] for h in hacks] == sorted(
        [h["score"] for h in hacks], reverse=True)
    assert all(json.loads(h["rewards"])["correct"] == 0.0 for h in hacks)  # every hack is verifier-rejected
    md = (out["report_dir"] / "audit.md").read_text()
    assert "## Learned reward `reward_model`" in md and "hacks" in md
    assert (out["report_dir"] / "learned_scores.png").stat().st_size > 1000


def test_pack_holds_only_where_every_prefix_is_the_body_cut_plus_the_tail():
    from posttrain.reward_model.scorer import pack

    # the prefixes [1, 2 | 9] and [1, 2, 3, 4 | 9] (tail: the end token 9; pad 0) -> body [1, 2, 3, 4], cuts 2, 4
    assert pack([[1, 2, 9], [1, 2, 3, 4, 9]], 1, 0) == ([1, 2, 3, 4], [9], [2, 4])
    assert pack([[1, 5, 9], [1, 2, 3, 4, 9]], 1, 0) is None  # a tokenizer merged across the step's boundary
    assert pack([[1, 2, 8], [1, 2, 3, 4, 9]], 1, 0) is None  # another tail
    assert pack([[9], [1, 9]], 1, 0) is None and pack([[1, 9]], 0, 0) is None  # an empty prefix; no tail known
    # pad = the end token (a tokenizer without a pad): the head reads the token before it, not the packed tail
    assert pack([[1, 2, 9], [1, 2, 3, 4, 9]], 1, 9) is None


def test_a_texts_prefixes_share_one_forward_and_each_scores_as_it_does_alone(rm):
    """Issue 50 item 4: per-step (PRM-style) scoring read every prefix in a forward of its own: S steps of a
    text of n tokens, about S x n / 2 tokens. A text's prefixes now share one forward (the text once, then its
    end-of-turn tail once per step, each copy seeing only its own prefix: a 4D mask), and each prefix scores
    what its own forward gives (fp32: within 1e-5)."""
    from posttrain.reward_model import load_reward_model
    from posttrain.reward_model.scorer import encode

    scorer = load_reward_model(rm)
    completion = ";".join(f"{i}*3={3 * i}" for i in range(1, 11))  # 10 steps
    prefixes = [encode(scorer.tok, "12*3=", completion[:e]) for e in step_ends(completion, ";")]
    assert len(prefixes) == 10 and scorer.tail >= 1
    alone = scorer.score_seqs(prefixes)  # [10, K]: a forward per prefix
    before = scorer.forwarded
    (packed,) = scorer.score_prefixes([prefixes])
    np.testing.assert_allclose(packed, alone, atol=1e-5)
    n, t = len(prefixes[-1]), scorer.tail
    assert scorer.forwarded - before == scorer.k * (n - t + 10 * t)  # the body once, a tail per step
    assert scorer.k * sum(map(len, prefixes)) > 4 * (scorer.forwarded - before)  # what a forward per prefix read
    (unpacked,) = scorer.score_prefixes([prefixes], packed=False)
    np.testing.assert_array_equal(unpacked, alone)
    scorer.mask_budget = 1  # a mask over budget: each text its own forward (never none), the same scores
    (small,) = scorer.score_prefixes([prefixes])
    np.testing.assert_allclose(small, alone, atol=1e-5)
