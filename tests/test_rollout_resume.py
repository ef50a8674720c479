"""Slow: a rollout stage SIGKILLed after its first chunks are on disk, re-run, resumes where it stopped: no
(prompt, sample) duplicated or missing, and a rollouts.parquet byte-identical to an uninterrupted run's."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, tiny_raw

pytestmark = pytest.mark.slow
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def _stage(name: str, params: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"stages.{name}", "--params", str(params)], cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _params(root: Path) -> Path:
    raw = tiny_raw(root)
    # 120 prompts x 2 samples, 2 prompts per chunk: 60 chunks, so a kill lands mid-way
    raw["rollout"].update({"num_prompts": 120, "samples_per_prompt": 2, "generate_batch_size": 4,
                           "checkpoint_every_s": 0})  # a part per chunk
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root / "params.yaml"


def test_rollout_sigkill_then_rerun_resumes_without_duplicates_or_gaps(tmp_path):
    straight = _params(tmp_path / "straight")
    for up in ("model", "curate", "sft"):
        assert _stage(up, straight).wait() == 0
    shutil.copytree(tmp_path / "straight", tmp_path / "killed")
    killed = _params(tmp_path / "killed")
    assert _stage("rollout", straight).wait() == 0

    parts = tmp_path / "killed" / "checkpoints" / "rollout"
    proc = _stage("rollout", killed)
    deadline = time.time() + 300
    while len(list(parts.glob("part-*.parquet"))) < 2 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)  # until two chunks are on disk
    assert proc.poll() is None, "the rollout stage finished (or failed) before a chunk was on disk: nothing to resume"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = tmp_path / "killed" / "data" / "rollout" / "rollouts.parquet"
    on_disk = len(list(parts.glob("part-*.parquet")))
    assert not out.exists() and 2 <= on_disk < 60, on_disk

    rerun = _stage("rollout", killed)
    _, err = rerun.communicate(timeout=600)
    assert rerun.returncode == 0, err[-2000:]
    m = re.search(r"resuming at prompt (\d+) of 120", err)
    assert m and int(m.group(1)) >= 4, err[-2000:]  # at least the two chunks seen before the kill were kept
    assert not parts.exists()  # the partial run is removed once the output is in place

    keys = Counter(zip(*pq.read_table(out, columns=["prompt_id", "sample"]).to_pydict().values(), strict=True))
    assert len(keys) == 240 and set(keys.values()) == {1}  # every (prompt, sample) once
    ref = tmp_path / "straight" / "data" / "rollout" / "rollouts.parquet"
    assert pq.read_table(out).equals(pq.read_table(ref))
    assert out.read_bytes() == ref.read_bytes()
