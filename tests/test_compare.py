"""``posttrain compare A B`` (posttrain/compare.py) on a real git + DVC repository made here: two commits whose
evaluation outputs are DVC-tracked, a DVC experiment ref, and a dvc.lock whose student was built from an older rl."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO

from posttrain import compare as C
from posttrain.errors import StageError

ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
       "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}


def _sh(root: Path, *cmd: str) -> str:
    r = subprocess.run(cmd, cwd=root, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _revision(root: Path, lr: float, rl_right: list[int], rl_md5: str, distill_dep: str) -> None:
    """One revision: params, a dvc.lock, and evaluate@rl's per_problem.json (10 problems, greedy right on
    ``rl_right``), DVC-tracked."""
    (root / "params.yaml").write_text(yaml.safe_dump({"rl": {"lr": lr}, "evaluate": {"models": {"rl": "models/rl"}},
                                                      "paths": {"eval_report_dir": "reports/evaluate"}}))
    lock = {"schema": "2.0", "stages": {
        "rl": {"cmd": "x", "deps": [], "outs": [{"path": "models/rl", "md5": rl_md5}]},
        "distill": {"cmd": "x", "deps": [{"path": "models/rl", "md5": distill_dep}],
                    "outs": [{"path": "models/student", "md5": "s1"}]}}}
    (root / "dvc.lock").write_text(yaml.safe_dump(lock))
    per = {"eval": {f"p{i}": {"greedy": float(i in rl_right), "pass@1": 0.5 * (i in rl_right), "len": 10.0 + i,
                              "seconds": 3.0} for i in range(10)}}
    d = root / "reports" / "evaluate" / "models" / "rl"
    d.mkdir(parents=True, exist_ok=True)
    (d / "per_problem.json").write_text(json.dumps(per))
    _sh(root, sys.executable, "-m", "dvc", "add", "-q", "reports/evaluate/models")
    _sh(root, "git", "add", "-A")
    _sh(root, "git", "commit", "-qm", f"lr {lr}")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    _sh(root, "git", "init", "-q")
    _sh(root, sys.executable, "-m", "dvc", "init", "-q")
    _revision(root, 3e-5, [0, 1, 2, 3], "rl-a", "rl-a")
    _revision(root, 1e-5, [0, 1, 2, 3, 4, 5, 6, 7], "rl-b", "rl-a")  # rl trained again; distill not re-run
    _sh(root, "git", "update-ref", "refs/exps/ab/cdef/lr1e5", _sh(root, "git", "rev-parse", "HEAD").strip())
    return root


@pytest.mark.slow  # dvc add and git in a fresh repository: over 2 s
def test_compare_pairs_two_revisions_and_says_what_differs(repo):
    """B (lr 1e-5) is right on 4 more of the same 10 problems: greedy +40.0 points, Newcombe's paired interval
    excluding 0 (4 discordant pairs, all one way); timing fields (``seconds``) stay out of the table; the params and
    the changed stage output are named; in B the student was built from the older rl: a warning."""
    c = C.compare(repo, "HEAD~1", "lr1e5")
    g = c.paired["rl"]["eval"]["greedy"]
    assert (g["a"], g["b"], g["diff"], g["n"]) == (0.4, 0.8, 0.4, 10) and g["ci"][0] > 0
    assert "seconds" not in c.paired["rl"]["eval"] and "len" in c.paired["rl"]["eval"]
    assert c.params == {"rl.lr": [3e-5, 1e-5]}
    assert c.stages == {"rl": ["models/rl"]}
    assert c.warnings == ["lr1e5: distill was built from a models/rl other than the one rl now outputs (run dvc "
                          "repro to rebuild it)"]
    md = C.markdown(c, "HEAD~1", "lr1e5")
    assert "| greedy | 40.0 | 80.0 | +40.0 [" in md and "- params `rl.lr`: 3e-05 -> 1e-05" in md


@pytest.mark.slow
def test_compare_cli_names_an_unknown_revision_in_one_line(repo):
    with pytest.raises(StageError, match="'nope' is neither a git revision nor a DVC experiment"):
        C.compare(repo, "HEAD", "nope")
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "compare", "HEAD~1", "nope", "--repo", str(repo)],
                       cwd=REPO, env=ENV, capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "nope" in r.stderr
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "compare", "HEAD~1", "HEAD", "--repo", str(repo)],
                       cwd=REPO, env=ENV, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("# HEAD vs HEAD~1"), r.stderr
