import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import yaml
from conftest import REPO

from posttrain.config import ConfigError, parse_overrides, render_overrides
from posttrain.dvcrepo import (
    clear_stale_locks,
    handoff_of,
    handoff_text,
    lock_entries,
    parse_handoff,
    plan,
    receive,
    use_params,
    workspace_lock,
)


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid  # reaped: no such process any more


def test_clear_stale_locks_keeps_live_holders(tmp_path):
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits, but is not reaped: a zombie
    for _ in range(100):
        if psutil.Process(zombie.pid).status() == psutil.STATUS_ZOMBIE:
            break
        time.sleep(0.05)
    dead, live = _dead_pid(), os.getpid()
    lock = tmp_path / ".dvc" / "tmp" / "rwlock"
    lock.parent.mkdir(parents=True)
    lock.write_text(json.dumps({
        "write": {"/r/models/sft": {"pid": dead, "cmd": "dvc repro"}, "/r/models/x": {"pid": live, "cmd": "dvc"}},
        "read": {"/r/a.py": [{"pid": dead, "cmd": "dvc"}, {"pid": live, "cmd": "dvc"}],
                 "/r/b.py": [{"pid": zombie.pid, "cmd": "dvc"}]},
    }))
    assert clear_stale_locks(tmp_path) == ["/r/a.py", "/r/b.py", "/r/models/sft"]
    zombie.wait()
    left = json.loads(lock.read_text())
    assert left == {"write": {"/r/models/x": {"pid": live, "cmd": "dvc"}},
                    "read": {"/r/a.py": [{"pid": live, "cmd": "dvc"}]}}
    assert clear_stale_locks(tmp_path) == []  # nothing stale left
    assert clear_stale_locks(tmp_path / "nope") == []


# ------------------------------------------------------------------ a real tiny DVC repo
def _sh(cmd: list[str], cwd) -> str:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def _dvc(repo, *args: str) -> str:
    return _sh([sys.executable, "-m", "dvc", *args], repo)


@pytest.fixture
def tiny_dvc(tmp_path):
    """A git + DVC repo with one stage: ``cat in.txt > out.txt`` (a file dep, a param, a cached output) that
    also writes an uncached metrics file."""
    repo = tmp_path / "tiny"
    repo.mkdir()
    (repo / "in.txt").write_text("a\n")
    (repo / "params.yaml").write_text("# the tiny stage's params\nmsg: hello  # any value\n")
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"echo": {
        "cmd": """cat in.txt > out.txt && echo '{"n": 1}' > m.json""", "deps": ["in.txt"], "params": ["msg"],
        "outs": ["out.txt"], "metrics": [{"m.json": {"cache": False}}]}}}))
    _sh(["git", "init", "-q"], repo)
    _dvc(repo, "init", "-q")
    return repo


@pytest.mark.slow
def test_plan_says_what_dvc_repro_then_does(tiny_dvc):
    """``plan`` before each ``dvc repro``, checked against what repro printed: ran (a value never run), skipped
    (up to date: nothing printed about running), restored (a value run before, from the run-cache; or the
    locked outputs, deleted, from the cache)."""
    repo = tiny_dvc
    params = repo / "params.yaml"

    def step(expected: str) -> None:
        assert plan(repo, "echo") == expected
        out = _dvc(repo, "repro", "--single-item", "echo")
        assert ("Running stage 'echo'" in out) == (expected == "ran"), out
        assert ("is cached - skipping run" in out) == (expected == "restored"), out

    step("ran")  # fresh
    step("skipped")
    (repo / "in.txt").write_text("b\n")
    step("ran")  # a new dep value: not in the run-cache (the locked outputs are, but they are a's)
    (repo / "in.txt").write_text("a\n")
    step("restored")  # back to a value that ran: DVC's run-cache
    assert (repo / "out.txt").read_text() == "a\n"
    params.write_text(params.read_text().replace("hello", "world"))
    step("ran")  # a new param value
    params.write_text(params.read_text().replace("world", "hello"))
    step("restored")
    step("skipped")
    (repo / "out.txt").unlink()
    step("restored")  # deps as locked, output gone: checked out of the cache
    assert (repo / "out.txt").read_text() == "a\n"


def test_handoff_carries_lock_entries_and_uncached_outputs(tiny_dvc, tmp_path):
    _dvc(tiny_dvc, "repro")
    handoff = handoff_of(tiny_dvc, ["echo"])
    assert set(handoff["stages"]) == {"echo"} and handoff["files"] == {"m.json": '{"n": 1}\n'}
    assert parse_handoff(handoff_text(handoff)) == handoff  # what goes through the Prefect artifact
    other = tmp_path / "other"
    (other / "sub").mkdir(parents=True)
    receive(other, handoff)
    assert lock_entries(other, None) == lock_entries(tiny_dvc, ["echo"]) == handoff["stages"]
    assert (other / "m.json").read_text() == '{"n": 1}\n'
    assert lock_entries(other, ["nope"]) == {} and lock_entries(tmp_path / "nothing", None) == {}


# ------------------------------------------------------------------ params.yaml for one run
@pytest.fixture
def checkout(tmp_path):
    """A folder with the real params.yaml (comments and all)."""
    from conftest import REPO

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    return tmp_path


def _overridden(checkout, *overrides: str) -> str:
    _, edits = parse_overrides(checkout / "params.yaml", list(overrides))
    return render_overrides((checkout / "params.yaml").read_text(), edits)


def test_use_params_holds_for_the_body_only_even_when_it_fails(checkout):
    path = checkout / "params.yaml"
    own, text = path.read_text(), _overridden(checkout, "rl.lr=1e-6")
    with use_params(checkout, text):
        assert path.read_text() == text
    assert path.read_text() == own
    with pytest.raises(RuntimeError), use_params(checkout, text):
        assert path.read_text() == text
        raise RuntimeError("a stage failed")
    assert path.read_text() == own
    assert not list((checkout / ".dvc" / "tmp").glob("posttrain-params*"))  # no backup left behind
    for same in (None, own):  # nothing to do: nothing written
        with use_params(checkout, same):
            assert path.read_text() == own
    bad = render_overrides(own, [(("rl", "lr"), "fast")])
    with pytest.raises(ConfigError, match="rl.lr"), use_params(checkout, bad):
        pytest.fail("ran with params that do not validate")
    assert path.read_text() == own


def test_the_next_holder_puts_back_params_a_killed_run_left(checkout):
    path = checkout / "params.yaml"
    own, text = path.read_text(), _overridden(checkout, "rl.lr=1e-6")
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys; from posttrain.dvcrepo import use_params\n"
        f"with use_params({str(checkout)!r}, sys.stdin.read()):\n    os._exit(9)  # killed mid-run: no finally")],
        input=text, text=True)
    assert killed.returncode == 9 and path.read_text() == text  # the killed run's params are still there
    with workspace_lock(checkout, "next run", 1):
        assert path.read_text() == own  # put back before the next run reads it
    assert not (checkout / ".dvc" / "tmp" / "posttrain-params.json").exists()
    # edited by hand after the kill: the edit is kept
    killed = subprocess.run([sys.executable, "-c", (
        "import os, sys; from posttrain.dvcrepo import use_params\n"
        f"with use_params({str(checkout)!r}, sys.stdin.read()):\n    os._exit(9)")], input=text, text=True)
    path.write_text(own.replace("seed: 0", "seed: 1"))
    with workspace_lock(checkout, "next run", 1):
        assert "seed: 1" in path.read_text()


@pytest.mark.slow
def test_a_stage_refusing_under_plain_dvc_repro_leaves_its_locked_outputs_in_place(tiny_dvc):
    """Issue 49, finding 8: plain ``dvc repro`` with a misspelled key deleted ``models/rl`` and the git-tracked
    ``metrics/rl.json`` (DVC removes a stage's outputs before its command runs), then the stage exited 2. Now a
    refusal before any work puts them back (``runner.refuse`` -> ``dvcrestore``): the cached file and folder from
    DVC's cache, the uncached metrics file from git's HEAD; ``dvc status`` then lists no deleted output."""
    repo = tiny_dvc
    stage = yaml.safe_load((repo / "dvc.yaml").read_text())
    stage["stages"]["echo"]["cmd"] += " && mkdir -p d/sub && echo 1 > d/a && echo 2 > d/sub/b"
    stage["stages"]["echo"]["outs"].append("d")
    (repo / "dvc.yaml").write_text(yaml.safe_dump(stage))
    _dvc(repo, "repro")
    _sh(["git", "add", "-A"], repo)
    _sh(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "ran"], repo)
    outs = ["out.txt", "m.json", "d/a", "d/sub/b"]
    before = {p: (repo / p).read_bytes() for p in outs}
    # the stage becomes a posttrain stage; its params file is not posttrain's (an unknown key: ``msg``)
    stage["stages"]["echo"]["cmd"] = f"{sys.executable} -m stages.rl --params params.yaml"
    (repo / "dvc.yaml").write_text(yaml.safe_dump(stage))
    r = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode != 0 and "exited with 2" in r.stdout + r.stderr, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    assert {p: (repo / p).read_bytes() for p in outs if (repo / p).exists()} == before
    assert "deleted" not in _dvc(repo, "status")
