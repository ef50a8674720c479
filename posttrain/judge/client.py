"""Asking the judge: a batch of requests to an OpenAI-compatible server, in parallel up to a limit, each with a
timeout and retries with backoff; and which model answers (its digest, for the cache key).

Why the ``openai`` client (not requests by hand): it is the reference client of the API vLLM serves, and it
already retries what should be retried (connection errors, timeouts, 408, 409, 429, 5xx) with exponential
backoff and jitter (0.5 s doubling to 8 s, or the server's ``Retry-After``), and not what should not (other
4xx). A request that still fails after ``retries`` retries is *failed* (None, why kept): never a reward.
Parallelism: a thread pool of ``concurrency`` threads over one client (its connection pool is shared and
thread-safe); the server batches concurrent requests, so this is what makes a batch of judgements cheap.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

API_KEY_ENV = "POSTTRAIN_JUDGE_API_KEY"  # sent as the bearer token ("EMPTY" when unset: vLLM's default)


class Reply(NamedTuple):
    """The judge's text, or None and why the request failed."""

    text: str | None
    why: str | None


@functools.cache
def client(base_url: str, timeout_s: float, retries: int) -> Any:
    """One ``openai.OpenAI`` per (server, timeout, retries) and process (imported here: scoring processes that
    never judge do not pay for the import)."""
    import openai

    return openai.OpenAI(base_url=base_url, api_key=os.environ.get(API_KEY_ENV) or "EMPTY", timeout=timeout_s,
                         max_retries=retries)


CONTEXT_EXCEEDED = "longer than the judge's context"  # a 400 whose message says so (vLLM's and OpenAI's wording)
_CONTEXT_RE = re.compile(r"longer than the maximum model length|maximum context length|context_length_exceeded",
                         re.IGNORECASE)


def _why(e: Exception, retries: int) -> str:
    """One line for a failed request (no URL or body: the audit counts these by text)."""
    import openai

    after = f" after {retries} retries" if retries else ""
    if isinstance(e, openai.APITimeoutError):
        return f"judge timed out{after}"
    if isinstance(e, openai.APIConnectionError):
        return f"judge unreachable{after}"
    if isinstance(e, openai.BadRequestError) and _CONTEXT_RE.search(str(e)):
        return CONTEXT_EXCEEDED
    if isinstance(e, openai.APIStatusError):
        return f"judge answered HTTP {e.status_code}"
    return f"judge request raised {type(e).__name__}"


def ask_one(c: Any, model: str, request: dict[str, Any], retries: int) -> Reply:
    """One request: ``request["api"]`` ``chat`` (``/v1/chat/completions``, one user message) or ``completions``
    (``/v1/completions``, the text as is); greedy unless ``temperature`` says otherwise."""
    import openai

    sampling = {"max_tokens": request["max_tokens"], "temperature": request["temperature"], "seed": request["seed"]}
    try:
        if request["api"] == "chat":
            r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": request["prompt"]}],
                                          **sampling)
            text = r.choices[0].message.content if r.choices else None
        else:
            r = c.completions.create(model=model, prompt=request["prompt"], **sampling)
            text = r.choices[0].text if r.choices else None
    except openai.OpenAIError as e:
        return Reply(None, _why(e, retries))
    return Reply(text, None) if text is not None else Reply(None, "judge returned no choice")


def ask(base_url: str, model: str, requests: Sequence[dict[str, Any]], *, timeout_s: float, retries: int,
        concurrency: int) -> list[Reply]:
    """Every request's reply, in order, at most ``concurrency`` in flight."""
    if not requests:
        return []
    c = client(base_url, timeout_s, retries)
    if concurrency <= 1 or len(requests) == 1:
        return [ask_one(c, model, r, retries) for r in requests]
    with ThreadPoolExecutor(max_workers=min(concurrency, len(requests)), thread_name_prefix="judge") as ex:
        return list(ex.map(lambda r: ask_one(c, model, r, retries), requests))


@functools.cache
def served_digest(base_url: str, model: str, timeout_s: float, retries: int) -> str:
    """What identifies the served model when nobody gave its digest: the server's model id and ``root`` (vLLM:
    the folder or hub id it loaded) from ``/v1/models``. Weaker than a weights hash: a server that swaps the
    weights under the same name and path keeps the key (give ``revision``, or let the stage serve the folder)."""
    try:
        models = {m.id: m for m in client(base_url, timeout_s, retries).models.list().data}
    except Exception as e:  # noqa: BLE001 (any failure here is the same one line to the caller)
        raise ConnectionError(f"{base_url}: cannot list models ({_why(e, retries)})") from None
    if model not in models:
        raise LookupError(f"{base_url} serves {sorted(models)}, not {model!r}")
    return f"served:{model}@{getattr(models[model], 'root', None) or model}"
