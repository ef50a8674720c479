"""The sample ledger (posttrain/lineage/ledger.py): which curated rows each rl step consumed, read from the shards,
and which demos each sft step trained on.
Its end-to-end check, a SIGKILLed and resumed rl run against an uninterrupted one, is in tests/test_slow.py."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from conftest import tiny_raw

from posttrain.config import parse_params
from posttrain.lineage.ledger import SFT_LEDGER, ledger, sft_ledger, write_sft


def test_the_ledger_lists_each_steps_prompts_in_sampling_order_with_the_splits_hash(tmp_path):
    p = parse_params(tiny_raw(tmp_path))  # every path under tmp_path
    shards = Path(p.paths.rl_dir) / "shards"
    shards.mkdir(parents=True)
    split = Path(p.paths.curated_dir) / "train.parquet"
    split.parent.mkdir(parents=True)
    split.write_bytes(b"PAR1 not really")  # hashed, not read
    steps = ((1, ["b", "b", "a", "a"], [True, True, False, False]), (2, ["c", "c", "b", "b"], [True] * 4))
    for step, ids, used in steps:
        pq.write_table(pa.table({"prompt_id": ids, "step": [step] * 4, "used": used}),
                       shards / f"step_{step:05d}.parquet")
    led = ledger(tmp_path, p)
    assert led["split"]["sha256"] == hashlib.sha256(b"PAR1 not really").hexdigest()
    assert led["steps"] == [{"step": 1, "prompts": ["b", "a"], "samples": 4, "used": 2},
                            {"step": 2, "prompts": ["c", "b"], "samples": 4, "used": 4}]


def test_the_sft_ledger_round_trips_the_steps_the_training_loop_recorded(tmp_path):
    """Issue 49 #8, sft: the loop's per-step demo ids and renderings (training.sft_train's ``ledger``, checkpointed
    with the model: tests/test_training.py resumes a run and gets the straight run's) are written by the stage and
    read back per step, in order."""
    p = parse_params(tiny_raw(tmp_path))
    steps = [{"step": 1, "ids": ["d3", "d1"], "styles": ["cot", "direct"]},
             {"step": 2, "ids": ["d1", "d0"], "styles": ["direct", "direct"]}]
    report = Path(p.paths.sft_report_dir)
    report.mkdir(parents=True)
    write_sft(steps, report / SFT_LEDGER)
    led = sft_ledger(tmp_path, p)
    assert led["steps"] == steps and led["split"]["path"].endswith("sft.parquet")


def test_the_distill_ledger_round_trips_and_the_cursor_replays_what_it_handed_out(tmp_path):
    """Issue 49 #8, distill: per step its phase, the prompts it drew (``PromptCursor.between`` replays the
    positions a step consumed: exactly what ``take`` returned then, across an epoch's end) and who sampled each."""
    from posttrain.lineage.ledger import DISTILL_LEDGER, distill_ledger, write_distill
    from posttrain.rl.select import PromptCursor

    c = PromptCursor(5, seed=3)
    first, second = c.take(3), c.take(4)  # the second crosses into epoch 1 (positions 3..6 of 5 per epoch)
    assert c.between(0, 3) == first and c.between(3, 7) == second and c.pos == 7
    assert sorted(first + second[:2]) == [0, 1, 2, 3, 4]  # epoch 0: each prompt once
    p = parse_params(tiny_raw(tmp_path))
    steps = [{"step": 1, "phase": "warmup", "ids": ["p2", "p0"], "samplers": ["teacher", "teacher"]},
             {"step": 2, "phase": "on_policy", "ids": ["p1", "p4"], "samplers": ["student", "teacher"]}]
    report = Path(p.paths.distill_report_dir)
    report.mkdir(parents=True)
    write_distill(steps, report / DISTILL_LEDGER)
    assert distill_ledger(tmp_path, p)["steps"] == steps


def test_samples_of_a_model_no_training_stage_made_is_refused_in_one_line():
    import subprocess
    import sys

    from conftest import REPO

    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "lineage", "models/base", "--samples"], cwd=REPO,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "only their stages record" in r.stderr, r.stderr
