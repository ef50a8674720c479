"""The reward_model stage: BT loss math, pairwise statistics, the pair builders (file and rollouts), config errors,
and run() on a tiny model and a separable preference set."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from posttrain import modeling
from posttrain.config import ModelCfg, parse_params
from posttrain.errors import StageError
from posttrain.metrics import wilson_ci
from posttrain.reward_model import finalize, load_reward_model, read_preference_file, rollout_pairs
from posttrain.reward_model import pairs as rm_pairs
from posttrain.reward_model import train as rm_train
from posttrain.reward_model.pairs import heldout
from posttrain.reward_model.train import bt_loss, encode_pairs, pairwise
from posttrain.runfacts import read_metrics
from posttrain.schema import PROBLEM_SCHEMA, REWARD_SCHEMA, ROLLOUT_SCHEMA, read_parquet, write_parquet
from stages import reward_model as stage


# ------------------------------------------------------------------------------------------ math
def test_bt_loss_hand_computed():
    # -log sigmoid(d) = log(1 + e^-d):  d = 2 -> log(1 + 0.135335) = 0.126928
    #                                  d = 0 -> log 2                = 0.693147
    #                                  d = -2 -> log(1 + 7.389056)   = 2.126928;  mean = 2.947003 / 3 = 0.982334
    rc, rr = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    loss = bt_loss(rc, rr)
    assert torch.allclose(loss, torch.tensor([0.126928, 0.693147, 2.126928]), atol=1e-6)
    assert loss.mean().item() == pytest.approx(0.982334, abs=1e-6)
    # stable far out: d = -100 -> 100 (log(1 + e^100) = 100 + log(1 + e^-100)), d = 100 -> e^-100 ~ 3.7e-44
    far = bt_loss(torch.tensor([-50.0, 50.0]), torch.tensor([50.0, -50.0]))
    assert far[0].item() == pytest.approx(100.0) and 0 <= far[1].item() < 1e-40


def test_bt_loss_gradient_pushes_chosen_up():
    # d/dr_c of log(1 + e^-(r_c - r_r)) = -sigmoid(r_r - r_c) = -0.5 at r_c = r_r
    rc, rr = torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)
    bt_loss(rc, rr).sum().backward()
    assert rc.grad.item() == pytest.approx(-0.5) and rr.grad.item() == pytest.approx(0.5)


def test_pairwise_accuracy_ties_margin_and_wilson():
    # wins: 3 > 1 yes, 1 > 2 no, 2 > 2 tie (wrong), 0 > -1 yes -> 2 / 4; margins 2, -1, 0, 1 -> mean 0.5
    # Wilson at 2/4, z = 1.959964 (z^2 = 3.841459): centre 0.5; half-width z * sqrt(p(1-p)/n + z^2/(4n^2)) /
    # (1 + z^2/n) = 1.959964 * sqrt(0.0625 + 0.060023) / 1.960365 = 1.959964 * 0.350033 / 1.960365 = 0.349961
    s = pairwise(np.array([3.0, 1.0, 2.0, 0.0]), np.array([1.0, 2.0, 2.0, -1.0]))
    assert s["pairs"] == 4 and s["accuracy"] == 0.5 and s["ties"] == 1 and s["margin"] == pytest.approx(0.5)
    assert s["accuracy_ci"] == [0.15, 0.85]  # 0.150039, 0.849961 to 4 places, as evaluate rounds its intervals
    assert wilson_ci(2, 4) == pytest.approx((0.150039, 0.849961), abs=1e-6)


# ------------------------------------------------------------------------------------------ pairs
def _scored(tmp: Path, groups: list[tuple[str, str, list[tuple[str, Any]]]], shuffle: bool = False
            ) -> tuple[Path, Path]:
    """rollouts.parquet + rewards.parquet of ``groups``: (prompt_id, prompt, [(completion, correct), ...])."""
    ro, rw = [], []
    for pid, prompt, samples in groups:
        for j, (text, ok) in enumerate(samples):
            ro.append({"prompt_id": pid, "sample": j, "prompt": prompt, "answer": "1", "task": "arith",
                       "completion": text})
            parts = {"correct": None if ok is None else float(ok), "format": 1.0}
            rw.append({"prompt_id": pid, "sample": j, "reward": parts["correct"], "rewards": json.dumps(parts)})
    if shuffle:
        rw = rw[::-1]
    write_parquet(tmp / "rollouts.parquet", ro, ROLLOUT_SCHEMA)
    write_parquet(tmp / "rewards.parquet", rw, REWARD_SCHEMA)
    return tmp / "rollouts.parquet", tmp / "rewards.parquet"


def test_rollout_pairs_counts_dedup_and_eval_drop(tmp_path, monkeypatch):
    monkeypatch.setattr(rm_pairs, "BATCH_ROWS", 2)  # pairs built, and read back, over several Arrow batches
    groups = [
        # 1 distinct correct (A twice) x 2 wrong (B, C) = 2 pairs; D unscorable; A again: a duplicate completion
        ("p1", "12*3=", [("A", True), ("A", True), ("B", False), ("C", False), ("D", None)]),
        ("p2", "40*2=", [("E", True), ("F", True)]),  # all correct: no pair
        ("p3", "12*3=", [("A", True), ("B", False)]),  # the same prompt text under another id: (A, B) again
        ("p4", "99*9=", [("G", True), ("H", False)]),  # an eval prompt: dropped
        ("p5", "77*7=", [("I", True), ("J", False), ("K", False), ("L", False)]),  # 3 candidates, capped at 2
    ]
    table, c = rollout_pairs(*_scored(tmp_path, groups), "correct", pairs_per_prompt=2, seed=[0])
    assert isinstance(table, pa.Table) and table.schema == rm_pairs.BUILT_SCHEMA and table.column(0).num_chunks == 3
    pairs = table.to_pylist()
    assert c == {"samples": 15, "unlabelled": 1, "prompts": 5, "prompts_with_pairs": 4, "duplicate_completions": 1,
                 "candidate_pairs": 2 + 1 + 1 + 3, "pairs_built": 2 + 1 + 1 + 2}
    assert [(p["chosen"], p["rejected"]) for p in pairs if p["prompt_id"] == "p1"] == [("A", "B"), ("A", "C")]
    assert all(p["chosen"] == "I" for p in pairs if p["prompt_id"] == "p5")
    out, f = finalize(table, [" 99*9= "], max_pairs=None, heldout_frac=0.5, seed=[0])
    assert isinstance(out, pa.Table) and out.schema == rm_pairs.PAIR_SCHEMA
    rows = out.to_pylist()
    assert [r["split"] for r in rows] == [rm_pairs.SPLITS[heldout(r["prompt"], 0.5)] for r in rows]
    assert f["pairs_in"] == 6 and f["duplicates"] == 1 and f["contaminated"] == 1 and f["over_max_pairs"] == 0
    assert f["train"] + f["heldout"] == len(rows) == 4
    assert {(r["prompt"], r["chosen"], r["rejected"]) for r in rows} == {
        ("12*3=", "A", "B"), ("12*3=", "A", "C"), *(("77*7=", "I", p["rejected"]) for p in pairs[-2:])}
    capped, f2 = finalize(table, [], max_pairs=3, heldout_frac=0.5, seed=[0])
    assert capped.num_rows == 3 and f2["over_max_pairs"] == 2 and list(f2) == [
        "pairs_in", "duplicates", "contaminated", "over_max_pairs", "train", "heldout"]
    # the rows drawn are the kept rows' (in their order), as the list-of-dicts version drew them: seed [0] over
    # the 5 kept pairs (p3's is p1's duplicate) picks np.sort(default_rng([0]).choice(5, 3, replace=False))
    keep = [p for i, p in enumerate(pairs) if i != 2]
    pick = np.sort(np.random.default_rng([0]).choice(5, size=3, replace=False))
    assert [r["id"] for r in capped.to_pylist()] == [keep[i]["id"] for i in pick]


def test_rollout_pairs_refuse_rewards_of_other_rollouts(tmp_path):
    paths = _scored(tmp_path, [("p1", "1*2=", [("A", True), ("B", False)])], shuffle=True)
    with pytest.raises(StageError, match="rows not those of"):
        rollout_pairs(*paths, "correct", 4, [0])


def test_heldout_split_is_by_prompt_and_about_the_fraction():
    prompts = [f"{i}*7=" for i in range(2000)]
    held = [heldout(p, 0.2) for p in prompts]
    assert 0.17 < np.mean(held) < 0.23  # 400 expected; sd 17.9
    assert heldout("12*3=", 0.2) == heldout(" 12*3= ", 0.2)  # normalised text: one prompt, one side


def test_preference_file_rows_and_quarantine(tmp_path):
    msgs = lambda p, a: [{"role": "user", "content": p}, {"role": "assistant", "content": a}]  # noqa: E731
    lines = [
        json.dumps({"prompt": "2*3=", "chosen": "answer: 6", "rejected": "answer: 7"}).encode(),
        json.dumps({"chosen": msgs("2*4=", "answer: 8"), "rejected": msgs("2*4=", "answer: 9")}).encode(),
        json.dumps({"prompt": "2*5=", "chosen": [{"role": "assistant", "content": "answer: 10"}],
                    "rejected": [{"role": "assistant", "content": "answer: 11"}]}).encode(),
        b'{"prompt": "broken',  # invalid JSON
        b'{"prompt": "caf\xe9", "chosen": "a", "rejected": "b"}',  # not UTF-8
        json.dumps([1, 2]).encode(),  # not an object
        json.dumps({"prompt": "2*6=", "chosen": "answer: 12"}).encode(),  # no rejected
        json.dumps({"prompt": "2*7=", "chosen": "same", "rejected": "same"}).encode(),  # no preference
        json.dumps({"chosen": msgs("a", "b") + msgs("c", "d"), "rejected": msgs("a", "b") + msgs("c", "e")}).encode(),
        json.dumps({"chosen": msgs("2*8=", "x"), "rejected": msgs("2*9=", "y")}).encode(),  # different prompts
        b"",  # empty line
    ]
    (tmp_path / "p.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    table, bad, n = read_preference_file(tmp_path / "p.jsonl")
    pairs = table.to_pylist()
    assert n == 11 and len(pairs) == 3 and len(bad) == 8
    assert [(p["prompt"], p["chosen"], p["rejected"]) for p in pairs] == [
        ("2*3=", "answer: 6", "answer: 7"), ("2*4=", "answer: 8", "answer: 9"), ("2*5=", "answer: 10", "answer: 11")]
    reasons = [b["reason"] for b in bad]
    assert reasons[0].startswith("invalid JSON") and reasons[1] == "undecodable text (not UTF-8)"
    assert reasons[2] == "row is not a JSON object" and reasons[3].startswith("rejected: missing")
    assert reasons[4].startswith("chosen == rejected") and "multi-turn" in reasons[5]
    assert reasons[6].startswith("chosen and rejected conversations differ") and reasons[7] == "empty line"
    assert [b["id"] for b in bad][:2] == ["p.jsonl:3", "p.jsonl:4"]


def test_pad_id_falls_back_to_the_end_token():
    from posttrain.reward_model.scorer import pad_id

    tok = modeling.build_char_tokenizer()
    assert pad_id(tok) == tok.pad_token_id
    tok.pad_token = None  # a real tokenizer may have none: the end token pads, the head reads the text's last
    assert pad_id(tok) == tok.eos_token_id


# ------------------------------------------------------------------------------------------ config
def _argv_exit(monkeypatch, argv: list[str]) -> int:
    monkeypatch.setattr(sys, "argv", ["stages.reward_model", *argv])
    with pytest.raises(SystemExit) as e:
        stage.main()
    return e.value.code


@pytest.mark.parametrize(("edit", "key"), [
    ({"members": 0}, "reward_model.members"),
    ({"heldout_frac": 1.0}, "reward_model.heldout_frac"),
    ({"typo": 1}, "reward_model.typo"),
    ({"verifier": "nope"}, "reward_model.verifier"),
    ({"models": {"x": "data/not_a_file.txt"}}, "reward_model.models.x"),
    ({"models": {"bad name": "p.jsonl"}}, "reward_model.models"),
])
def test_bad_config_exits_2_naming_the_key(tiny, tmp_path, monkeypatch, capsys, edit, key):
    import yaml

    tiny["reward_model"] = {**tiny.get("reward_model", {}), **edit}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(tiny))
    assert _argv_exit(monkeypatch, ["--model", "x", "--params", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and key in err[0]


def test_unknown_model_name_exits_2(tiny, tmp_path, monkeypatch, capsys):
    import yaml

    (tmp_path / "ok.yaml").write_text(yaml.safe_dump(tiny))
    assert _argv_exit(monkeypatch, ["--model", "nope", "--params", str(tmp_path / "ok.yaml")]) == 2
    assert "not a key of reward_model.models" in capsys.readouterr().err


def test_default_params_have_no_reward_model_stage():
    from conftest import repo_params

    assert repo_params()["reward_model"]["models"] == {}  # the default DAG: no reward_model@<name> stage


# ------------------------------------------------------------------------------------------ run()
def _sft_folder(tiny: dict[str, Any], path: Path) -> None:
    from conftest import tiny_model

    cfg = ModelCfg.model_validate(tiny["model"])
    model, tok = tiny_model(cfg, 0)
    modeling.save_checkpoint(model, tok, path)


def _arith_prefs(path: Path, n: int, seed: int, shuffle_labels: bool = False) -> None:
    """Correct products of even numbers (an even last digit) chosen over off-by-one ones (odd): separable from
    the last answer character. ``shuffle_labels``: chosen/rejected swapped at random (nothing to learn)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        a, b = 2 * int(rng.integers(5, 50)), int(rng.integers(2, 10))
        good, bad = f"answer: {a * b}", f"answer: {a * b + 1}"
        if shuffle_labels and rng.random() < 0.5:
            good, bad = bad, good
        rows.append({"prompt": f"{a}*{b}=", "chosen": good, "rejected": bad})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _params(tiny: dict[str, Any], tmp: Path, **rm: Any):
    tiny["reward_model"] = {**tiny.get("reward_model", {}), "models": {"prefs": str(tmp / "prefs.jsonl")},
                            "steps": 40, "batch_size": 16, "micro_batch_size": 16, "lr": 3e-3, "warmup_steps": 2,
                            "heldout_frac": 0.25, "log_every": 5, "checkpoint_every": 20, **rm}
    p = parse_params(tiny)
    write_parquet(Path(p.paths.curated_dir) / "eval.parquet",
                  [{"id": "e:0", "source": "e", "task": "arith", "prompt": "10*3=", "answer": "30", "solution": None}],
                  PROBLEM_SCHEMA)
    _sft_folder(tiny, Path(p.paths.sft_model))
    return p


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_run_learns_a_separable_preference_and_saves_one_ensemble(tiny, tmp_path):
    p = _params(tiny, tmp_path, members=2)
    _arith_prefs(tmp_path / "prefs.jsonl", 80, seed=1)
    ins, out = stage.paths(p, "prefs")
    m = stage.run(p, ins, out)
    for k in range(2):
        log = json.loads((out["model"] / f"member_{k}" / "member.json").read_text())["log"]
        assert log[-1]["loss"] < 0.7 * log[0]["loss"]  # the BT loss falls (here ~0.65 at step 5 -> 0.14-0.27)
    e = m["heldout"]["ensemble_mean"]
    assert e["pairs"] == m["pairs"]["heldout"] >= 10 and m["pairs"]["train"] + e["pairs"] <= 80
    assert e["accuracy_ci"][0] > 0.6 and e["margin"] > 0  # well above chance, with its interval
    assert all(m["heldout"][f"member_{k}"]["accuracy"] >= 0.8 for k in range(2))
    # one artifact: K members + manifest, loadable as a [B, K] scorer that prefers the correct answer
    scorer = load_reward_model(out["model"])
    s = scorer(["20*3=", "20*3="], ["answer: 60", "answer: 61"])
    assert s.shape == (2, 2) and (s[0] > s[1]).all()
    assert json.loads((out["model"] / "manifest.json").read_text())["members"] == ["member_0", "member_1"]
    long = scorer(["20*3="], ["9" * 300])  # past the 128-token context: its last 128 tokens are scored
    assert scorer.truncated == 1 and np.isfinite(long).all()
    rows = read_parquet(out["data"] / "pairs.parquet")
    assert len(rows) == m["pairs"]["train"] + m["pairs"]["heldout"] and {r["split"] for r in rows} == {"train",
                                                                                                       "heldout"}
    assert (out["report_dir"] / "member_1" / "train_log.csv").is_file() and out["metrics"].is_file()
    assert not out["checkpoints"].exists()  # finished: the artifact holds the members


def test_run_with_shuffled_labels_stays_near_chance(tiny, tmp_path):
    """The control that shows the accuracy test can fail: the same pipeline, nothing to learn."""
    p = _params(tiny, tmp_path)
    _arith_prefs(tmp_path / "prefs.jsonl", 80, seed=1, shuffle_labels=True)
    m = stage.run(p, *stage.paths(p, "prefs"))
    e = m["heldout"]["ensemble_mean"]
    assert e["accuracy_ci"][0] <= 0.6  # what the separable test asserts above fails here
    assert math.isfinite(e["margin"])


def test_run_fails_on_a_mostly_malformed_file_and_keeps_the_quarantine(tiny, tmp_path):
    p = _params(tiny, tmp_path)
    (tmp_path / "prefs.jsonl").write_text('{"prompt": "1*2=", "chosen": "a", "rejected": "b"}\nnot json\n[]\n')
    ins, out = stage.paths(p, "prefs")
    with pytest.raises(StageError, match="2 of 3 rows malformed"):
        stage.run(p, ins, out)
    assert len((out["report_dir"] / "quarantine.jsonl").read_text().splitlines()) == 2
    assert not out["model"].exists()


def test_dvc_params_cover_every_result_field():
    """Every reward_model field that changes what trains is a DVC param of the stage (a new field not listed
    would not re-run it); ``models`` is the foreach itself (each source is its instance's dep)."""
    import yaml
    from conftest import REPO

    from posttrain.config import NOT_RESULT, RewardModel

    do = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]["reward_model"]["do"]
    listed = {k.removeprefix("reward_model.") for k in do["params"] if k.startswith("reward_model.")}
    result = {n for n, f in RewardModel.model_fields.items() if (f.json_schema_extra or {}) != NOT_RESULT}
    assert listed == result - {"models"}
    assert "${item}" in do["deps"] and do["cmd"] == "python -m stages.reward_model --model ${key}"


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_run_with_lora_resumes_a_killed_member(tiny, tmp_path, monkeypatch):
    """LoRA (peft SEQ_CLS: adapters + the head) trains and saves a plain folder; a run killed in member 1 keeps
    member 0 and resumes member 1 from its checkpoint, ending with the weights of an uninterrupted run."""
    from posttrain.reward_model import train as rm_train

    tiny["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
    p = _params(tiny, tmp_path, members=2, steps=6, checkpoint_every=3, log_every=1)
    _arith_prefs(tmp_path / "prefs.jsonl", 40, seed=2)
    ins, out = stage.paths(p, "prefs")
    real = rm_train.checkpoint.save
    calls = []

    def dies_in_member_1(ckpt_dir, step, *a, **kw):  # member 1's first checkpoint is saved, then the "kill"
        path = real(ckpt_dir, step, *a, **kw)
        calls.append(ckpt_dir.name)
        if ckpt_dir.name == "ckpt_1":
            raise KeyboardInterrupt
        return path

    monkeypatch.setattr(rm_train.checkpoint, "save", dies_in_member_1)
    with pytest.raises(KeyboardInterrupt):
        stage.run(p, ins, out)
    assert calls == ["ckpt_0", "ckpt_1"] and (out["checkpoints"] / "member_0" / "member.json").is_file()
    monkeypatch.setattr(rm_train.checkpoint, "save", real)
    resumed = stage.run(p, ins, out)
    log1 = json.loads((out["model"] / "member_1" / "member.json").read_text())["log"]
    assert [r["step"] for r in log1] == [1, 2, 3, 4, 5, 6]  # steps 1-3 from the checkpoint, 4-6 after it
    assert (out["model"] / "member_0" / "adapter").is_dir()  # the LoRA adapter kept beside the merged folder
    straight = stage.run(p, ins, {**out, "model": tmp_path / "straight", "metrics": tmp_path / "m.json"})
    for who, s in straight["heldout"].items():  # the same weights as an uninterrupted run (up to float order)
        assert resumed["heldout"][who]["accuracy"] == s["accuracy"]
        assert resumed["heldout"][who]["margin"] == pytest.approx(s["margin"], rel=1e-4, abs=1e-6)


@pytest.mark.slow
@pytest.mark.extended  # CI leaves it out (time, 81 s): the stage's run() tests are in CI
def test_dvc_repro_runs_the_stage_only_when_named_and_tracks_it(tmp_path):
    """In a copy of the repo: the default DAG has no reward_model stage; named in reward_model.models,
    `dvc repro reward_model@prefs` runs it (and its upstream), dvc.lock records it, MLflow has its run with the
    members' curves, and a second repro is a no-op."""
    import os
    import subprocess

    import yaml
    from conftest import copy_repo, tiny_raw

    raw = tiny_raw(None)
    repo = tmp_path / "repo"
    copy_repo(repo, raw)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(repo),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}

    def dvc(*args: str) -> str:
        r = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return r.stdout

    assert "reward_model" not in dvc("stage", "list")
    _arith_prefs(repo / "prefs.jsonl", 60, seed=3)
    raw["reward_model"].update({"models": {"prefs": "prefs.jsonl"}, "members": 2, "steps": 10, "batch_size": 8,
                                "micro_batch_size": 8, "lr": 3e-3, "heldout_frac": 0.25})
    raw["tracking"]["enabled"] = True
    (repo / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    dvc("repro", "reward_model@prefs")
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    assert "reward_model@prefs" in lock and "rl" not in lock  # its upstream ran, nothing downstream of reward
    m = read_metrics(repo / "metrics" / "reward_model" / "prefs.json")
    assert m["members"] == 2 and m["pairs"]["heldout"] > 0
    assert "reward_model@prefs" not in dvc("status")  # up to date: a second repro is a no-op
    from posttrain.tracking import store

    client = store.mlflow_client(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name(raw["tracking"]["experiment"]).experiment_id],
                              "attributes.run_name = 'reward_model@prefs'")
    assert len(runs) == 1 and "heldout.ensemble_mean.accuracy" in runs[0].data.metrics
    assert "member_1/loss" in runs[0].data.metrics and runs[0].data.tags["dvc.stage"] == "reward_model@prefs"


def test_encode_pairs_keeps_int32_ids_of_training_pairs_that_fit_and_digest_is_the_rows_json(tiny, monkeypatch):
    from conftest import tiny_model

    from posttrain.reward_model.scorer import encode

    monkeypatch.setattr(rm_train, "BATCH_ROWS", 2)
    monkeypatch.setattr(rm_pairs, "BATCH_ROWS", 2)
    _, tok = tiny_model(ModelCfg.model_validate(tiny["model"]), 0)
    rows = pa.Table.from_pylist([
        {"id": "a", "prompt_id": "a", "prompt": "2*3=", "chosen": "answer: 6", "rejected": "no", "split": "train"},
        {"id": "b", "prompt_id": "b", "prompt": "2*4=", "chosen": "9" * 300, "rejected": "1", "split": "train"},
        {"id": "c", "prompt_id": "c", "prompt": "2*5=", "chosen": "answer: 10", "rejected": "x", "split": "heldout"},
        {"id": "d", "prompt_id": "d", "prompt": "2*6=", "chosen": "answer: 12", "rejected": "y", "split": "train"},
    ], schema=rm_pairs.PAIR_SCHEMA)
    train, fits = encode_pairs(tok, rows, limit=64)
    assert fits.tolist() == [True, False, True, True]  # b's chosen: 300 digits, over 64 tokens
    assert len(train) == 2 and all(x.dtype == np.int32 for pair in train for x in pair)  # a and d: c is held out
    assert [x.tolist() for x in train[1]] == [encode(tok, "2*6=", "answer: 12"), encode(tok, "2*6=", "y")]
    # the digest (resume fingerprint, manifest) is the one the rows' JSON list had as Python dicts
    want = hashlib.sha256(json.dumps(rows.to_pylist(), sort_keys=True).encode()).hexdigest()[:16]
    assert rm_pairs.pairs_digest(rows) == want
    assert rm_pairs.pairs_digest(rows.slice(0, 0)) == hashlib.sha256(b"[]").hexdigest()[:16]
