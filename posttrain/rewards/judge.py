"""``llm_judge``: a reward asked of a judge model over an OpenAI-compatible API, a batch of samples at a time.

Each sample becomes one request: the template (``posttrain.judge.verdict``) filled with the prompt, the gold
answer, the completion, the task's rubric and the verdict format's instruction. Requests already judged are
taken from the judge-call cache (``posttrain.judge.cache``: keyed by the judge's digest and the request); the
rest are sent together, ``concurrency`` at a time, each with ``timeout_s`` and ``retries``
(``posttrain.judge.client``). A reply is worth its verdict in [0, 1] when it is exactly in the requested format;
a malformed reply is None with why (``malformed verdict: ...``) and a failed request None with why
(``judge timed out after 2 retries``): counted, never a free reward. A completion the server refuses as longer
than its context scores ``overlong_score`` (default 0, the minimum; counted as ``overlong``): excluding it as
unscorable would let a policy escape grading by writing past the judge's context.

Where the judge is: ``base_url`` and ``model`` in the kwargs, or, when they are left out, the server the stage
started (``judge.serve``; ``posttrain.judge.session``). Which model answered (the cache key's judge):
``revision`` when given, else the served folder's hash when the stage serves it, else what the server reports
(``/v1/models``: id and root).

Rubrics: ``rubrics`` by task (``{arith: ..., math: ...}``), else ``rubric``. A rubric per row would need a column
the rollouts do not carry today (``Sample`` has no such field): not done here.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Sequence
from typing import Any

from posttrain.errors import StageError
from posttrain.judge import cache as jcache
from posttrain.judge.client import CONTEXT_EXCEEDED, ask, served_digest
from posttrain.judge.session import ENV_BASE_URL, ENV_DIGEST, ENV_MODEL
from posttrain.judge.verdict import DEFAULT_TEMPLATE, VERDICTS, render
from posttrain.rewards.sample import Sample, Scored

log = logging.getLogger(__name__)

MALFORMED = "malformed verdict: "  # the prefix of why a reply was refused (the audit counts them by text)


def _judge(base_url: str | None, model: str | None, revision: str | None, timeout_s: float, retries: int
           ) -> tuple[str, str, str]:
    """(base_url, model, digest) of the judge these kwargs name, or of the server the stage started."""
    ours = base_url is None
    base_url = base_url or os.environ.get(ENV_BASE_URL)
    model = model or (os.environ.get(ENV_MODEL) if ours else None)
    if not base_url or not model:
        raise StageError("llm_judge: no judge server in this stage: give kwargs base_url and model (judge.serve is "
                         "started by the reward stage only; rl and distill score with a server you point at)")
    if revision is not None:
        return base_url, model, f"revision:{model}@{revision}"
    if ours and os.environ.get(ENV_DIGEST):
        return base_url, model, os.environ[ENV_DIGEST]
    return base_url, model, served_digest(base_url, model, timeout_s, retries)


def llm_judge(samples: Sequence[Sample], *, base_url: str | None = None, model: str | None = None,
              rubric: str = "", rubrics: dict[str, str] | None = None, template: str = DEFAULT_TEMPLATE,
              verdict: str = "score", max_score: int = 10, api: str = "chat", max_tokens: int = 512,
              temperature: float = 0.0, seed: int = 0, timeout_s: float = 60.0, retries: int = 2,
              concurrency: int = 8, overlong_score: float = 0.0, revision: str | None = None) -> list[Scored]:
    """The judge's verdict on each sample, in [0, 1] (``score``: n / max_score; ``binary``: PASS 1, FAIL 0), or
    None with why (malformed reply, failed request, no rubric for the task). Greedy by default (temperature 0),
    so a cached judgement is the one the judge would give again."""
    store = jcache.store()
    counts: Counter[str] = Counter({c: 0 for c in jcache.COUNTERS})
    counts["requests"] = len(samples)
    out: list[Scored | None] = [None] * len(samples)
    todo: list[tuple[int, str, dict[str, Any]]] = []  # (sample index, cache key, request)
    try:
        url, name, digest = _judge(base_url, model, revision, timeout_s, retries)
    except (ConnectionError, LookupError) as e:  # the judge cannot be asked: every sample unscorable, counted
        counts["failed"] = len(samples)
        store.count(counts)
        return [Scored(None, str(e))] * len(samples)
    for i, s in enumerate(samples):
        text = (rubrics or {}).get(s.task, rubric)
        if not text:
            out[i] = Scored(None, f"no rubric for task {s.task}")
            counts["failed"] += 1
            continue
        prompt = render(template, prompt=s.prompt, completion=s.completion, answer=s.answer, rubric=text,
                        verdict=verdict, max_score=max_score)
        req = {"api": api, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed}
        k = jcache.key(digest, req)
        hit = store.get(k)
        if hit is None:
            todo.append((i, k, req))
            continue
        counts["hits"] += 1
        out[i] = _scored(hit)
    counts["misses"] = len(todo)
    replies = ask(url, name, [r for _, _, r in todo], timeout_s=timeout_s, retries=retries, concurrency=concurrency)
    for (i, k, _), reply in zip(todo, replies, strict=True):
        if reply.why == CONTEXT_EXCEEDED:  # too long to judge: the configured score (the minimum), counted
            out[i] = Scored(overlong_score, f"{CONTEXT_EXCEEDED}: scored {overlong_score}")
            counts["overlong"] += 1
            continue
        if reply.text is None:
            out[i] = Scored(None, reply.why)
            counts["failed"] += 1
            continue
        v, why = VERDICTS[verdict].parse(reply.text, max_score)
        entry = jcache.Entry(reply.text, v, why)
        store.put(k, digest, entry)
        out[i] = _scored(entry)
    counts["malformed"] = sum(o is not None and o.why is not None and o.why.startswith(MALFORMED) for o in out)
    if len(todo) >= 8 and counts["overlong"] > len(todo) / 2:  # not long completions: a judge with no room
        log.warning("llm_judge: %d of %d requests exceeded the judge's context and scored %s: check that "
                    "judge.max_tokens (%d) and the prompt template fit the server's max_model_len",
                    counts["overlong"], len(todo), overlong_score, max_tokens)
    store.count(counts)
    return [o if o is not None else Scored(None, "not judged") for o in out]


def _scored(e: jcache.Entry) -> Scored:
    return Scored(e.value, None) if e.value is not None else Scored(None, MALFORMED + (e.why or "refused"))
