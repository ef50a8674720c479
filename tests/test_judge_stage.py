"""llm_judge in the reward stage and in params: the stage keeps the judge-call cache between runs (also with a
pool of scoring processes), reports the hit and malformed rates, and bad judge params are refused at load.
The judge is a test double (tests/judge_stub.py); the real server is in tests/test_vllm_judge.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import repo_params

from posttrain.config import ConfigError, names, parse_params
from posttrain.judge import cache as jcache
from posttrain.judge.verdict import VERDICTS
from tests.judge_stub import Stub, running


def _rollouts(path: Path, n: int) -> None:
    from posttrain.schema import ROLLOUT_SCHEMA, write_parquet

    rows = [{"prompt_id": f"p:{i // 2}", "sample": i % 2, "prompt": f"{i}*2=", "answer": str(2 * i), "task": "arith",
             "completion": f"answer: {2 * i if i % 3 else 0}", "token_ids": [1] * 4, "logprobs": [-0.5] * 4,
             "num_tokens": 4, "finish_reason": "stop", "policy": "p", "temperature": 1.0, "top_p": 1.0,
             "max_new_tokens": 16, "seed": 0} for i in range(n)]
    write_parquet(path, rows, ROLLOUT_SCHEMA)


@pytest.mark.slow  # the reward stage twice, with a pool of worker processes
def test_reward_stage_keeps_the_judge_cache_between_runs_with_a_pool(tiny, tmp_path):
    from stages import reward

    _rollouts(tmp_path / "r.parquet", 8)
    stub = Stub(reply=lambda p: "SCORE: 9" if "answer: 0" not in p else "I cannot say.")
    with running(stub):
        tiny["reward"].update(max_unscorable_frac=1.0)
        tiny["reward"]["rewards"] = [
            {"name": "correct", "weight": 1.0},
            {"name": "llm_judge", "weight": 0.0, "kwargs": {"base_url": stub.base_url, "model": "stub-judge",
                                                            "rubric": "Is the product right?", "concurrency": 2,
                                                            "timeout_s": 5, "retries": 1}}]  # 11.5 s at most
        tiny["reward"]["timeout_s"] = 12
        got = []
        for workers in (2, 0):  # a pool of 2 scoring processes, then a re-run in this process
            tiny["reward"]["workers"] = workers
            p = parse_params(tiny)
            _, out = reward.paths(p)
            got.append(reward.run(p, {"rollouts": tmp_path / "r.parquet"}, out))
    first, second = got
    # i = 0, 3, 6 write "answer: 0": the stub's reply has no SCORE line (malformed); the rest score 9/10
    assert first["judge_requests"] == 8 and first["judge_hit_rate"] == 0.0 and first["judge_new"] == 8
    assert first["judge_malformed"] == 3 and first["judge_malformed_rate"] == 3 / 8
    assert stub.requests == 8  # the re-run asked nothing
    assert second["judge_hit_rate"] == 1.0 and second["judge_new"] == 0 and second["judge_malformed_rate"] == 3 / 8
    assert second["reward_mean"] == first["reward_mean"]  # (llm_judge weight 0: logged only)
    cache = Path(p.paths.judge_cache)
    assert len(cache.read_text().splitlines()) == 1 + 8  # the header line, the 8 judgements
    audit = json.loads((Path(p.paths.reward_report_dir) / "audit.json").read_text())
    assert audit["component_means"]["llm_judge"] == pytest.approx(0.9)  # the 5 scored replies, each 9/10
    assert audit["why"] == {"llm_judge: malformed verdict: no SCORE: line": 3}
    assert "cache hit rate 1.0" in (Path(p.paths.reward_report_dir) / "audit.md").read_text()
    assert "llm_judge" in audit["learned"]  # a learned reward: agreement with the verifier, its "hacks"


def test_without_a_judge_the_stage_writes_an_empty_cache_and_the_same_metrics(tiny, tmp_path):
    """The empty cache is its header line alone (a 0-byte file made DVC warn on every run)."""
    from stages import reward

    _rollouts(tmp_path / "r.parquet", 4)
    p = parse_params(tiny)
    _, out = reward.paths(p)
    m = reward.run(p, {"rollouts": tmp_path / "r.parquet"}, out)
    assert not any(k.startswith("judge") for k in m)  # the default metrics are unchanged
    assert Path(p.paths.judge_cache).read_text() == json.dumps(jcache.HEADER) + "\n"


def _with_judge(kwargs: dict, serve: str | None = None) -> dict:
    raw = repo_params()
    raw["reward"]["rewards"].append({"name": "llm_judge", "weight": 0.0, "kwargs": kwargs})
    if serve is not None:
        raw["judge"]["serve"] = serve
    return raw


@pytest.mark.parametrize(("kwargs", "serve", "expected"), [
    ({"rubric": "r"}, None, r"reward.rewards\[\d\].kwargs.base_url: .*judge.serve is null"),
    ({"base_url": "http://h/v1", "rubric": "r"}, None, "kwargs.model: .*name the model"),
    ({"base_url": "http://h/v1", "model": "m", "rubric": "r"}, "models/judge", "judge.serve: set, but no llm_judge"),
    ({"base_url": "http://h/v1", "model": "m"}, None, "kwargs.rubric: .*empty and no rubrics"),
    ({"base_url": "http://h/v1", "model": "m", "rubric": "r", "verdict": "stars"}, None, "kwargs.verdict"),
    ({"base_url": "http://h/v1", "model": "m", "rubric": "r", "template": "{completion} {score} {format}"}, None,
     r"kwargs.template: .*unknown fields \['score'\]"),
    ({"base_url": "http://h/v1", "model": "m", "rubric": "r", "template": "{prompt} {format}"}, None,
     r"kwargs.template: .*must show the judge \['completion'\]"),
    ({"base_url": "http://h/v1", "model": "m", "rubrics": {"arithmetic": "r"}}, None, "kwargs.rubrics"),
    ({"base_url": "http://h/v1", "model": "m", "rubric": "r", "concurrency": 0}, None, "kwargs.concurrency"),
])
def test_bad_judge_params_are_refused_at_load(kwargs, serve, expected):
    with pytest.raises(ConfigError, match=expected):
        parse_params(_with_judge(kwargs, serve))


def test_judge_params_that_work_and_the_verdict_names():
    assert names.JUDGE_VERDICTS == tuple(VERDICTS)
    p = parse_params(_with_judge({"rubric": "r"}, serve="models/judge"))
    assert p.judge.serve == "models/judge"
    parse_params(_with_judge({"base_url": "http://h/v1", "model": "m", "rubrics": {"arith": "r"}, "verdict": "binary"}))


def test_a_judge_beside_a_reward_pool_is_accepted_it_is_scored_in_the_rank_not_in_a_worker():
    """A pool's per-sample timeout (reward.timeout_s, 30 s by default) once cut an llm_judge request off mid-retry
    ((retries + 1) x timeout_s + backoff: 181.5 s by default), so such params were refused at load. Learned
    rewards are now scored in the rank's process (tests/test_reward_pool.py), outside any pool timeout: the
    params that were refused load."""
    raw = _with_judge({"base_url": "http://h/v1", "model": "m", "rubric": "r"})  # timeout_s 60, retries 2
    raw["reward"]["workers"] = 4
    parse_params(raw)
