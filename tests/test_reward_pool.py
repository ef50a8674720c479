"""Rewards in a process pool (``RewardPool``) and reward plug-ins (``package.module:function``).

The pool scores exactly as serial scoring does; a sample that hangs (also in C code, deaf to SIGTERM) or kills
its worker is unscorable with a reason, never a crash or a hang; a plug-in is checked at load (exit 2, one line
naming the key) and is held to the unscorable-is-never-a-reward rule like the built-ins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, repo_params
from test_rewards import ARITH_ATTACKS, COT, MATH_ATTACKS

from posttrain.config import ConfigError, parse_params
from posttrain.rewards import ERROR_KEY, RewardPool, Sample, Spec, combine, score_rows

PLUGIN = '''
import math, os, signal, time

from posttrain.rewards import Sample, per_sample

@per_sample
def length_bonus(sample, scale: float = 0.01):
    """A plug-in: a small bonus per token, None when the gold is empty (nothing to score against)."""
    return None if not sample.answer else scale * sample.num_tokens

@per_sample
def hang(sample):
    """Hangs as a worker stuck in C code does: deaf to SIGTERM, only SIGKILL ends it."""
    if "hang" in sample.completion:
        with open(os.environ["PIDFILE"], "a") as f:
            f.write(f"{os.getpid()}\\n")
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(3600)
    return 0.0

@per_sample
def slow_pid(sample):
    """0.15 s a sample; the reward is the worker's pid (which workers scored it)."""
    time.sleep(0.15)
    return float(os.getpid())

@per_sample
def die(sample):
    """Kills its own worker."""
    if "die" in sample.completion:
        os._exit(7)
    return 0.0

@per_sample
def bad_values(sample):
    """Returns what is not a reward: NaN, a string, or raises."""
    if sample.completion == "nan":
        return math.nan
    if sample.completion == "str":
        return "1.0"
    if sample.completion == "raise":
        raise ZeroDivisionError("boom")
    return 1.0

def batch_size(samples):
    """A batch reward: each sample scores the size of the batch it was called with (one call per batch)."""
    return [float(len(samples))] * len(samples)

def wrong_length(samples):
    return [1.0] * (len(samples) + 1)

def not_a_list(samples):
    return 1.0

def batch_raise(samples):
    raise KeyError("boom")

def batch_stage_error(samples):
    from posttrain.errors import StageError
    raise StageError("refused")

def one_sample(sample: Sample) -> float:
    return 1.0

class NotAFunction:
    pass

def _make():
    def inner(sample):
        return 1.0
    return inner

closure = _make()

_MODEL = []

def _load_model(seconds=1.5, **_):
    """What a learned reward does on first use in a process: load its model (here: sleep)."""
    if not _MODEL:
        time.sleep(seconds)
        _MODEL.append(os.getpid())

def slow_loading(samples, seconds=1.5):
    """A batch reward whose model loads lazily; ``warm`` loads it ahead (as the reward_model reward does)."""
    _load_model(seconds)
    return [1.0] * len(samples)

slow_loading.warm = _load_model

def pid(samples):
    """A batch verifier: the process that scored each sample."""
    return [float(os.getpid())] * len(samples)

def learned_pid(samples):
    """A learned reward (its model would be loaded where it runs): the process that scored each sample."""
    return [float(os.getpid())] * len(samples)

learned_pid.learned = True
'''


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    """A plug-in module ``rwplug_<test>`` in a temp dir on sys.path; returns its name."""
    name = f"rwplug_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PIDFILE", str(tmp_path / "pids"))
    return name


def _samples() -> list[Sample]:
    math_golds = ["5", "\\frac{1}{2}", "3\\sqrt{2}", "(1, 2)", "\\frac{"]
    out = [Sample(COT, "33166", "arith", 40, 80), Sample("answer: 1", "n/a", "arith", 5, 80)]
    out += [Sample(c, "33166", "arith", 20, 80) for c, _ in ARITH_ATTACKS]
    for gold in math_golds:
        out += [Sample(f"so the answer is \\boxed{{{gold}}}", gold, "math", 70, 80, "length")]
        out += [Sample(c, gold, "math", 20, 80) for c, _ in MATH_ATTACKS[:12]]
    return out


SPECS = [Spec("correct", 1.0, {}), Spec("math_verify", 0.0, {}), Spec("format", 0.1, {}),
         Spec("overlong", 1.0, {"buffer": 16})]


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_pool_scores_exactly_as_serial():
    samples = _samples()
    with RewardPool(0) as serial:
        want = serial.score(samples, SPECS)
    with RewardPool(2, timeout_s=30) as pool:
        got = pool.score(samples, SPECS)
    assert got == want  # floats equal bit for bit: the same function, the same inputs
    assert any(t is None for t, _ in want) and any(t == 1.1 for t, _ in want)  # unscorable and correct both present
    rows = [{"completion": s.completion, "answer": s.answer, "task": s.task, "token_ids": [0] * s.num_tokens,
             "max_new_tokens": s.max_new_tokens, "finish_reason": s.finish_reason, "prompt_id": str(i)}
            for i, s in enumerate(samples)]
    with RewardPool(3, timeout_s=30) as pool:
        assert score_rows(rows, SPECS, pool) == score_rows(rows, SPECS)  # the rows the reward stage writes


@pytest.mark.slow
def test_a_chunk_gets_the_time_of_its_samples_so_no_worker_is_killed_for_slow_but_timely_samples(plugin):
    """64 samples of 0.15 s on 2 workers go in chunks of 8 (1.2 s a chunk); each sample is within the 0.5 s
    limit. Every sample is scored by one of the 2 original workers: no chunk was killed and redone one by one
    (with a chunk limited to one sample's 0.5 s, every chunk timed out and its worker was replaced)."""
    specs = [Spec(f"{plugin}:slow_pid", 1.0, {})]
    with RewardPool(2, timeout_s=0.5) as pool:
        first = pool.score([Sample("x", "5", "arith", 5, 80)] * 2, specs)  # the workers as started
        got = pool.score([Sample("x", "5", "arith", 5, 80)] * 64, specs)
    assert all(r is not None for r, _ in first + got)
    assert len({r for r, _ in first + got}) <= 2  # a killed chunk's samples would come back from new workers


@pytest.mark.slow
def test_a_learned_rewards_model_loads_as_each_worker_starts_not_within_a_samples_timeout(plugin):
    """Found by the review: a learned reward loaded its model inside the first chunk's timeout, so a load longer
    than a chunk's time made every sample unscorable (each redone alone, each loading again, each timed out).
    The pool's workers now run the reward's ``warm`` as they start (pebble times a task from its start)."""
    specs = [Spec(f"{plugin}:slow_loading", 1.0, {"seconds": 1.5})]
    samples = [Sample("x", "5", "arith", 5, 80)] * 4  # chunks of 1 on 2 workers: 0.5 s each, the load 1.5 s
    with RewardPool(2, timeout_s=0.5, warm=specs) as pool:
        got = pool.score(samples, specs)
    assert [r for r, _ in got] == [1.0] * 4, got
    with RewardPool(2, timeout_s=0.5) as pool:  # nothing warmed: what every pool did before
        cold = pool.score(samples, specs)
    assert [r for r, _ in cold] == [None] * 4 and cold[0][1][ERROR_KEY] == "timeout after 0.5s"


def test_a_reward_that_cannot_be_loaded_in_a_worker_fails_its_samples_not_the_pool():
    """Found by the review: ``warm`` resolved each reward outside its try, so a plug-in that failed to import in a
    worker failed pebble's initializer, every worker exited and the pool broke (BrokenProcessPool): a crash, not
    an unscorable sample."""
    specs = [Spec("correct", 1.0, {}), Spec("no_such_module_xyz:fn", 1.0, {})]
    with RewardPool(2, timeout_s=5, warm=specs) as pool:
        got = pool.score([Sample("answer: 5", "5", "arith", 5, 80)] * 2, specs)
    assert [r for r, _ in got] == [None, None]
    assert all("no_such_module_xyz:fn" in parts[ERROR_KEY] for _, parts in got), got


@pytest.mark.slow  # 12.6 s of the fast suite's 111 s alone (pebble's SIGTERM grace before its SIGKILL)
def test_a_hung_worker_is_killed_and_its_sample_unscorable(plugin, tmp_path):
    """A reward stuck where SIGTERM cannot reach it (C code): the sample times out, its worker is SIGKILLed and
    replaced, and the samples after it are scored. (40 samples on 2 workers go in chunks of 5: the chunk with
    the hung sample times out and is redone a sample at a time.)"""
    specs = [Spec("correct", 1.0, {}), Spec(f"{plugin}:hang", 1.0, {})]
    samples = [Sample("answer: 5", "5", "arith", 5, 80)] * 40
    samples[1] = Sample("hang", "5", "arith", 5, 80)
    t = time.time()
    with RewardPool(2, timeout_s=1.0) as pool:
        got = pool.score(samples, specs)
        again = pool.score(samples[:1], specs)  # the pool still works after the kill
    assert time.time() - t < 20
    assert got[1] == (None, {"correct": None, f"{plugin}:hang": None, ERROR_KEY: "timeout after 1s"})
    assert [x[0] for x in got[:1] + got[2:]] == [1.0] * 39 and again[0][0] == 1.0
    pids = [int(x) for x in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 2  # the chunk, then the sample alone
    time.sleep(0.5)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_worker_that_dies_fails_its_sample_alone(plugin):
    specs = [Spec(f"{plugin}:die", 1.0, {})]
    samples = [Sample(c, "5", "arith", 5, 80) for c in ("a", "die", "b", "c")]
    with RewardPool(2, timeout_s=10) as pool:
        got = pool.score(samples, specs)
    assert got[1] == (None, {f"{plugin}:die": None, ERROR_KEY: "worker died (exit code 7)"})
    assert [x[0] for x in got[:1] + got[2:]] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_plugin_that_raises_or_returns_no_number_is_unscorable_never_paid(plugin, workers):
    specs = [Spec(f"{plugin}:bad_values", 1.0, {}), Spec("format", 0.0, {})]
    samples = [Sample(c, "5", "arith", 5, 80) for c in ("nan", "str", "raise", "fine")]
    with RewardPool(workers) as pool:
        got = pool.score(samples, specs)
    name = f"{plugin}:bad_values"
    assert [(t, p[name], p.get(ERROR_KEY)) for t, p in got] == [
        (None, None, f"{name} returned nan"), (None, None, f"{name} returned str"),
        (None, None, f"{name} raised ZeroDivisionError"), (1.0, 1.0, None)]


def _params_with(rewards: list[dict]) -> dict:
    raw = repo_params()
    raw["reward"]["rewards"] = rewards
    return raw


def test_a_plugin_named_in_params_is_loaded_and_scored(plugin):
    p = parse_params(_params_with([{"name": "correct"}, {"name": f"{plugin}:length_bonus", "weight": 2.0,
                                                          "kwargs": {"scale": 0.5}}]))
    rows = [{"completion": "answer: 5", "answer": "5", "task": "arith", "token_ids": [1, 2, 3], "max_new_tokens": 8,
             "finish_reason": "stop"}]
    (row,) = score_rows(rows, p.reward.rewards)
    # correct 1.0 + 2.0 x (0.5 x 3 tokens) = 4.0
    assert row["reward"] == 4.0 and json.loads(row["rewards"]) == {"correct": 1.0, f"{plugin}:length_bonus": 1.5}
    (row,) = score_rows([{**rows[0], "answer": ""}], p.reward.rewards)
    assert row["reward"] is None  # the plug-in's None makes the sample unscorable: never a free reward


@pytest.mark.parametrize("name,kwargs,key,says", [
    ("no_such_module_xyz:fn", {}, "reward.rewards[0].name", "cannot import 'no_such_module_xyz'"),
    ("{plugin}:missing", {}, "reward.rewards[0].name", "has no attribute 'missing'"),
    ("{plugin}:NotAFunction", {}, "reward.rewards[0].name", "not a function"),
    ("{plugin}:closure", {}, "reward.rewards[0].name", "_make.<locals>.inner"),
    ("{plugin}:length_bonus", {"scael": 1}, "reward.rewards[0].kwargs", "unexpected keyword argument 'scael'"),
    ("{plugin}:hang", {"x": 1}, "reward.rewards[0].kwargs", "cannot be called"),
    ("not a ref:", {}, "reward.rewards[0].name", "is not 'package.module:function'"),
])
def test_a_bad_plugin_is_refused_at_load_naming_the_key(plugin, name, kwargs, key, says):
    with pytest.raises(ConfigError) as e:
        parse_params(_params_with([{"name": name.format(plugin=plugin), "kwargs": kwargs}]))
    assert f"params: {key}: " in str(e.value) and says in str(e.value) and "\n" not in str(e.value), str(e.value)


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_a_bad_plugin_exits_2_in_one_line(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(_params_with([{"name": "correct"}, {"name": "no_such_module_xyz:score"}])))
    r = subprocess.run([sys.executable, "-m", "stages.reward", "--params", str(bad)], capture_output=True,
                       text=True, cwd=REPO)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0, r.stderr
    assert "reward.rewards[1].name: Value error, cannot import 'no_such_module_xyz'" in r.stderr, r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 128 + signal.SIGTERM), (signal.SIGKILL, -signal.SIGKILL)])
def test_a_killed_stage_leaves_no_worker_behind(plugin, tmp_path, sig, code):
    """A stage killed while its workers hang in C code (deaf to SIGTERM): SIGTERM stops the pool and exits 143;
    after SIGKILL (no clean-up possible) the workers die with their forkserver. No worker outlives the stage."""
    script = tmp_path / "stage.py"
    script.write_text(textwrap.dedent(f"""
        from posttrain.rewards import RewardPool, Sample, Spec
        if __name__ == "__main__":
            with RewardPool(2, timeout_s=600) as pool:
                pool.score([Sample("hang", "5", "arith", 5, 80)] * 2, [Spec("{plugin}:hang", 1.0, {{}})])
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    proc = subprocess.Popen([sys.executable, str(script)], env=env, cwd=tmp_path)
    pids: list[int] = []
    for _ in range(300):  # both workers are hanging
        time.sleep(0.1)
        if (tmp_path / "pids").exists() and len(pids := [int(x) for x in (tmp_path / "pids").read_text().split()]) == 2:
            break
    assert len(pids) == 2
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == code
    for _ in range(100):  # (gone within seconds: SIGTERM's clean-up kills them after pebble's 3 s grace)
        alive = [pid for pid in pids if _alive(pid)]
        if not alive:
            break
        time.sleep(0.1)
    assert not alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z" if Path(f"/proc/{pid}").exists() else True


def test_reward_workers_are_the_machines_shared_by_its_torchrun_ranks(monkeypatch):
    """reward.workers split over a machine's torchrun ranks, never below 2 a rank when a pool was asked for (its
    per-sample timeout and isolation): 8 ranks with 16 -> 2 each; with 8 -> still 2 each; 0 or 1 -> in-process."""
    from posttrain.config import Reward

    for workers, ranks, each in ((8, None, 8), (16, "8", 2), (8, "8", 2), (9, "2", 4), (1, "4", 1), (0, "4", 0)):
        if ranks is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
        assert RewardPool.of(Reward(rewards=[{"name": "correct"}], workers=workers)).workers == each


def test_workers_param_is_bounded_and_not_part_of_the_result():
    from posttrain.config.base import NOT_RESULT
    from posttrain.config.reward import Reward

    assert Reward.model_fields["workers"].json_schema_extra == NOT_RESULT
    raw = repo_params()
    raw["reward"]["workers"] = -1
    with pytest.raises(ConfigError, match="reward.workers"):
        parse_params(raw)


def test_the_reward_stage_writes_the_same_bytes_with_the_pool(tiny, tmp_path):
    """reward.workers changes how the stage scores, not what it writes: scored rows, pass rates and the audit are
    byte-identical with 0 (in-process, the default) and 2 workers."""
    from posttrain.schema import ROLLOUT_SCHEMA, write_parquet
    from stages import reward

    rows = []
    for i, s in enumerate(_samples()):
        rows.append({"prompt_id": f"p:{i // 4}", "sample": i % 4, "prompt": "q", "answer": s.answer, "task": s.task,
                     "completion": s.completion, "token_ids": [1] * s.num_tokens, "logprobs": [-0.5] * s.num_tokens,
                     "num_tokens": s.num_tokens, "finish_reason": s.finish_reason, "policy": "p", "temperature": 1.0,
                     "top_p": 1.0, "max_new_tokens": s.max_new_tokens, "seed": 0})
    write_parquet(tmp_path / "r.parquet", rows, ROLLOUT_SCHEMA)
    got = {}
    for workers in (0, 2):
        tiny["reward"].update(workers=workers, max_unscorable_frac=1.0)
        tiny["reward"]["rewards"] = [{"name": n.name, "weight": n.weight, "kwargs": n.kwargs} for n in SPECS]
        for k in ("reward_dir", "reward_report_dir", "metrics_dir"):
            tiny["paths"][k] = str(tmp_path / f"w{workers}" / k)
        p = parse_params(tiny)
        _, out = reward.paths(p)
        reward.run(p, {"rollouts": tmp_path / "r.parquet"}, out)
        got[workers] = [Path(out[k]).read_bytes() for k in ("rewards", "pass_rates", "metrics")]
        got[workers].append((Path(out["report_dir"]) / "audit.json").read_bytes())
    assert got[0] == got[2]
    assert b'"errors"' not in got[0][3]  # nothing failed: the audit has no errors table (as before the pool)


def test_the_audit_counts_why_samples_could_not_be_scored(plugin):
    from posttrain.rewards import pass_rates
    from stages import reward

    name = f"{plugin}:bad_values"
    rows = [{"prompt_id": "p", "prompt": "q", "answer": "5", "task": "arith", "completion": c, "token_ids": [1],
             "max_new_tokens": 8, "finish_reason": "stop"} for c in ("nan", "raise", "raise", "fine")]
    scored = score_rows(rows, [Spec(name, 1.0, {}), Spec("correct", 1.0, {})])
    a = reward.audit(scored, pass_rates(scored), 1)
    assert a["errors"] == {f"{name} raised ZeroDivisionError": 2, f"{name} returned nan": 1}
    assert a["unscorable"] == 3 and a["component_means"] == {name: 1.0, "correct": 0.0}
    assert "| error | samples |" in reward.audit_markdown(a)


def test_an_rl_step_collects_the_same_rows_with_the_pool():
    """collect_step (the rl and distill stages' rollout -> reward) with a pool: the same rows, rewards and groups."""
    from posttrain.config import Rl, TinyModel
    from posttrain.modeling import build_char_tokenizer, build_tiny_model
    from posttrain.rl import collect, select
    from posttrain.rollout import BACKENDS

    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    backend = BACKENDS["hf"](model.eval(), tok, 64)
    prompts = [{"id": f"p{i}", "prompt": f"{10 + i}*3=", "answer": str((10 + i) * 3), "task": "arith"}
               for i in range(6)]
    specs = [Spec("correct", 1.0, {}), Spec("overlong", 1.0, {"buffer": 6})]  # length gives reward variance
    cfg = Rl(prompts_per_step=3, samples_per_prompt=4, dynamic_sampling="skip", sampling={"max_new_tokens": 8})
    got = []
    for workers in (0, 2):
        with RewardPool(workers) as pool:
            got.append(collect.collect_step(backend, tok, prompts, select.PromptCursor(len(prompts), seed=0), cfg,
                                            specs, seed=0, policy="p", pool=pool))
    serial, pooled = got
    assert torch.equal(pooled.stats.nan_to_num(-9.0), serial.stats.nan_to_num(-9.0)) and pooled.used == serial.used
    assert {k: [(r["completion"], r["rewards"]) for r in v] for k, v in pooled.rows.items()} == \
        {k: [(r["completion"], r["rewards"]) for r in v] for k, v in serial.rows.items()}
    assert len(set(serial.stats[..., 0].flatten().tolist())) > 1  # the rewards are not all one value


def test_per_sample_and_batch_rewards_score_together_one_call_per_batch(plugin):
    """One ``combine`` calls each reward once on the whole batch: ``batch_size`` sees all 3 samples (3.0 each)
    while the per-sample ``correct`` scores each alone. Totals: 1.0 x correct + 0.5 x 3.0 = 2.5 for the right
    answer, 0.0 + 1.5 = 1.5 for the wrong one, None for the unparseable gold."""
    specs = [Spec("correct", 1.0, {}), Spec(f"{plugin}:batch_size", 0.5, {})]
    samples = [Sample("answer: 5", "5", "arith", 5, 80), Sample("answer: 4", "5", "arith", 5, 80),
               Sample("answer: 5", "n/a", "arith", 5, 80)]
    got = combine(samples, specs)
    name = f"{plugin}:batch_size"
    assert got == [(2.5, {"correct": 1.0, name: 3.0}), (1.5, {"correct": 0.0, name: 3.0}),
                   (None, {"correct": None, name: 3.0})]
    with RewardPool(2, timeout_s=30) as pool:  # 3 samples, 2 workers: chunks of 1 (every worker gets work)
        assert [p[name] for _, p in pool.score(samples, specs)] == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("fn,error", [
    ("wrong_length", "{name} returned 4 values for 3 samples"),
    ("not_a_list", "{name} returned float, not one value per sample"),
    ("batch_raise", "{name} raised KeyError"),
])
def test_a_batch_reward_that_fails_fails_its_component_for_the_batch(plugin, fn, error):
    """A wrong length, a non-sequence or an exception: that component is None for every sample of the batch, the
    error kept; the other components are still scored (``format`` at weight 0 is logged, never summed)."""
    name = f"{plugin}:{fn}"
    samples = [Sample("answer: 5", "5", "arith", 5, 80)] * 3
    got = combine(samples, [Spec(name, 1.0, {}), Spec("format", 0.0, {})])
    assert got == [(None, {name: None, "format": 1.0, ERROR_KEY: error.format(name=name)})] * 3


def test_a_batch_reward_that_refuses_stops_the_stage(plugin):
    from posttrain.errors import StageError

    with pytest.raises(StageError, match="refused"):
        combine([Sample("x", "5", "arith", 5, 80)], [Spec(f"{plugin}:batch_stage_error", 1.0, {})])


def test_a_per_sample_reward_that_raises_fails_that_sample_alone(plugin):
    name = f"{plugin}:bad_values"
    got = combine([Sample(c, "5", "arith", 5, 80) for c in ("fine", "raise", "fine")], [Spec(name, 1.0, {})])
    assert [p.get(ERROR_KEY) for _, p in got] == [None, f"{name} raised ZeroDivisionError", None]
    assert [t for t, _ in got] == [1.0, None, 1.0]


def test_a_one_sample_plugin_is_refused_at_load_with_the_hint(plugin):
    with pytest.raises(ConfigError, match=r"reward.rewards\[0\].kwargs: .*takes one Sample.*per_sample"):
        parse_params(_params_with([{"name": f"{plugin}:one_sample"}]))


@pytest.mark.slow
def test_a_learned_reward_is_scored_once_in_the_calling_process_not_in_each_worker(plugin):
    """Issue 50 item 4: each pool worker loaded its own copy of a reward model (``reward.workers`` copies per
    rank). Learned rewards are now scored in the calling process (the rank, on its own device), the verifiers in
    the workers; the totals and the components in the specs' order are what one ``combine`` gives."""
    specs = [Spec(f"{plugin}:pid", 1.0, {}), Spec(f"{plugin}:learned_pid", 2.0, {})]
    samples = [Sample("x", "5", "arith", 5, 80)] * 6
    with RewardPool(2, timeout_s=30, warm=specs) as pool:
        assert [s.name for s in pool.warm] == [f"{plugin}:pid"]  # the workers never load the learned one
        got = pool.score(samples, specs)
    me = float(os.getpid())
    for total, parts in got:
        assert list(parts) == [f"{plugin}:pid", f"{plugin}:learned_pid"]
        assert parts[f"{plugin}:learned_pid"] == me and parts[f"{plugin}:pid"] != me  # here / in a worker
        assert total == parts[f"{plugin}:pid"] + 2 * me
    with RewardPool(2, timeout_s=30) as pool:  # learned alone: no worker is asked anything
        assert pool.score(samples, specs[1:]) == [(2 * me, {f"{plugin}:learned_pid": me})] * 6
