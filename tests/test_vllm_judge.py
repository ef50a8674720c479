"""The real-engine tier for ``llm_judge``: a real ``vllm serve`` (vLLM's CPU build in ``.venv-vllm``, the
OpenAI-compatible API server) of a tiny local model, started and stopped by ``posttrain.judge.session`` as the
reward stage starts it (``judge.serve``), scoring rows through ``score_rows`` (the one scoring path).

A tiny random model writes anything but the requested verdict line: its replies are malformed and counted,
which is what this tier checks (with the cache: a re-run asks the server nothing, hit rate 1.0). It also
measures the server's start time and per-request latency on this machine (printed; ``pytest -s`` shows them).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache for the server: the default takes half the host

from posttrain.config import TinyModel  # noqa: E402
from posttrain.judge import client  # noqa: E402
from posttrain.judge.session import session  # noqa: E402
from posttrain.modeling import build_char_tokenizer, build_tiny_model, save_checkpoint  # noqa: E402
from posttrain.rewards import Spec, score_rows  # noqa: E402

SHAPE = TinyModel(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=1024)
ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--enforce-eager"]  # no inductor compile at start
SPECS = [Spec("llm_judge", 1.0, {"rubric": "Full marks for the correct product, none otherwise.",
                                 "max_tokens": 16, "timeout_s": 60.0, "retries": 1, "concurrency": 4})]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("judge") / "judge_model"
    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_model(SHAPE, tok, 0), tok, d)
    return d


def rows(n: int) -> list[dict]:
    return [{"prompt": f"{a}*{a + 1}=", "answer": str(a * (a + 1)), "task": "arith", "completion": f"answer: {a * a}",
             "num_tokens": 8, "max_new_tokens": 16, "finish_reason": "stop"} for a in range(2, 2 + n)]


def requests_served(base_url: str) -> float:
    """vLLM's own count of finished requests (its Prometheus ``/metrics``)."""
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total"))


def test_llm_judge_on_a_real_vllm_server_cache_hits_on_rerun_and_malformed_counted(folder, tmp_path):
    cache, data = tmp_path / "judge_cache.jsonl", rows(6)
    with session(cache, serve_folder=str(folder), python=sys.executable, args=ARGS,
                 log=tmp_path / "server1.log") as s1:
        t0 = time.monotonic()
        first = score_rows(data, SPECS)
        batch_s = time.monotonic() - t0
        served1 = requests_served(s1.base_url)
        # latency: one request at a time (fresh prompts, no cache), then 8 at once
        reqs = [{"api": "chat", "prompt": f"Rate {i}. End with `SCORE: <n>`.", "max_tokens": 16,
                 "temperature": 0.0, "seed": 0} for i in range(8)]
        lat = []
        for r in reqs:
            t = time.monotonic()
            assert client.ask(s1.base_url, "judge", [r], timeout_s=60, retries=0, concurrency=1)[0].why is None
            lat.append(time.monotonic() - t)
        t = time.monotonic()
        got = client.ask(s1.base_url, "judge", [{**r, "seed": 1} for r in reqs], timeout_s=60, retries=0,
                         concurrency=8)
        par_s = time.monotonic() - t
        assert all(g.why is None for g in got)
    assert not psutil.pid_exists(s1.pid)  # the server's tree is stopped with the session
    st1 = s1.stats
    assert served1 == 6 and st1["requests"] == 6 and st1["misses"] == 6 and st1["hits"] == 0 and st1["failed"] == 0
    parts = [json.loads(r["rewards"]) for r in first]
    malformed = sum(p["llm_judge"] is None for p in parts)
    assert st1["malformed"] == malformed and st1["malformed_rate"] == malformed / 6
    assert all(p["llm_judge"] is not None or p["why"]["llm_judge"].startswith("malformed verdict: ")
               for p in parts)
    assert len(cache.read_text().splitlines()) == 1 + 6  # the header line, the 6 judgements

    # the re-run (a new server, as a re-run of the stage starts one): every judgement from the cache
    with session(cache, serve_folder=str(folder), python=sys.executable, args=ARGS,
                 log=tmp_path / "server2.log") as s2:
        again = score_rows(data, SPECS)
        served2 = requests_served(s2.base_url)
    assert served2 == 0 and s2.stats["hit_rate"] == 1.0 and s2.stats["new"] == 0
    assert [(r["reward"], r["rewards"]) for r in again] == [(r["reward"], r["rewards"]) for r in first]
    print(f"\njudge server start {s1.startup_s:.1f} s and {s2.startup_s:.1f} s; batch of 6 through score_rows "
          f"(concurrency 4) {batch_s:.2f} s; one request at a time: median {statistics.median(lat) * 1000:.0f} ms, "
          f"min {min(lat) * 1000:.0f}, max {max(lat) * 1000:.0f} (n=8); 8 at once {par_s * 1000:.0f} ms; "
          f"malformed rate {st1['malformed_rate']:.3f} ({st1['malformed']} of 6); re-run hit rate "
          f"{s2.stats['hit_rate']}")
    print("why:", sorted({p.get("why", {}).get("llm_judge", "") for p in parts}))
