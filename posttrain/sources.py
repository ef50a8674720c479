"""Reading problem sources into one schema: the task generator, local JSONL/Parquet files, hub datasets.

Local JSONL is read line by line (not through ``datasets``) so that one undecodable or malformed line is
reported (and quarantined by the caller) instead of failing the whole file; Parquet files and hub ids go
through ``datasets.load_dataset``. Every yielded row is ``(id, {prompt, answer, solution} | None, error)``
with ``id = <source name>:<row index>``, traceable to the raw line.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any

from posttrain.config import (
    BenchmarkSpec,
    FileSource,
    HubSource,
    SourceSpec,
    SyntheticSource,
    Validation,
)
from posttrain.config.model import hub_offline
from posttrain.errors import StageError
from posttrain.schema import Problem
from posttrain.tasks import ADAPTERS, FORMAT_TASK, get_task
from posttrain.tasks.mathfmt import gsm8k_steps

# A raw row: (row id, parsed dict) or (row id, error reason) when it could not even be read.
Raw = tuple[str, dict[str, Any] | None, str | None]


# ------------------------------------------------------------------------------------------ reading
def _synthetic(name: str, n: int, task: Any, rng: random.Random) -> Iterator[Raw]:
    generate = get_task(task.kind).generate
    if generate is None:
        raise StageError(f"source {name!r}: task {task.kind!r} has no generator")
    for i in range(n):
        prompt, answer, solution = generate(rng, task)
        yield f"{name}:{i}", {"prompt": prompt, "answer": answer, "solution": solution}, None


def _jsonl(src: FileSource) -> Iterator[Raw]:
    """Line by line, so one undecodable or malformed line is quarantined instead of failing the file."""
    with open(src.file, "rb") as f:
        for i, line in enumerate(f):
            if src.limit is not None and i >= src.limit:
                return
            rid = f"{src.name}:{i}"
            if not line.strip():
                yield rid, None, "empty line"
                continue
            try:
                obj = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError:
                yield rid, None, "undecodable text (not UTF-8)"
                continue
            except json.JSONDecodeError as e:
                yield rid, None, f"invalid JSON: {e.msg}"
                continue
            yield (rid, obj, None) if isinstance(obj, dict) else (rid, None, "row is not a JSON object")


def _datasets_rows(src: FileSource | HubSource) -> Iterator[Raw]:
    """Parquet files and hub datasets go through ``datasets.load_dataset``."""
    import datasets

    what = src.file if isinstance(src, FileSource) else f"hub dataset {src.hub_id!r}"
    try:
        if isinstance(src, FileSource):
            ds = datasets.load_dataset("parquet", data_files=src.file, split="train")
        else:
            ds = datasets.load_dataset(src.hub_id, src.config, split=src.split, revision=src.revision)
    except Exception as e:  # datasets raises many types (offline, not found, corrupt): one line naming the source
        hint = (" (HF_HUB_OFFLINE=1 and it is not in the local cache: run once with the hub reachable, or point "
                "a `kind: file` source at a local copy)" if isinstance(src, HubSource)
                and hub_offline() else "")
        raise StageError(f"source {src.name!r}: {what} cannot be read: {type(e).__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''}{hint}") from None
    for i, row in enumerate(ds):
        if src.limit is not None and i >= src.limit:
            return
        yield f"{src.name}:{i}", dict(row), None


def read_source(src: SourceSpec | BenchmarkSpec, task: Any, seed: int) -> Iterator[Raw]:
    """Raw rows of one source, each normalised to ``{prompt, answer, solution}`` or with an error."""
    if isinstance(src, SyntheticSource):
        yield from _synthetic(src.name, src.num_rows, task, random.Random(seed))
        return
    raw = _jsonl(src) if isinstance(src, FileSource) and src.path.endswith((".jsonl", ".json")) \
        else _datasets_rows(src)
    adapter = ADAPTERS[src.format]
    max_steps = getattr(src, "max_steps", None)
    for rid, obj, err in raw:
        if err is not None:
            yield rid, None, err
            continue
        if max_steps is not None and gsm8k_steps(obj) > max_steps:  # selected out, like rows past `limit`
            continue
        try:
            yield rid, adapter(obj), None
        except ValueError as e:
            yield rid, None, f"malformed row: {e}"


def validate(row: dict[str, Any], task_kind: str, v: Validation) -> str | None:
    """The reason a normalised row is unusable, or None."""
    p, a = row["prompt"], row["answer"]
    if not p.strip():
        return "empty prompt"
    if not a.strip():
        return "empty answer"
    if "\ufffd" in p or "\ufffd" in a:
        return "undecodable text (replacement character)"
    if len(p) < v.min_prompt_chars or len(p) > v.max_prompt_chars:
        return f"prompt length {len(p)} outside [{v.min_prompt_chars}, {v.max_prompt_chars}]"
    task = get_task(task_kind)
    limit = v.max_tests_chars if task.answer_is_tests else v.max_answer_chars
    if len(a) > limit:
        return f"{'tests' if task.answer_is_tests else 'answer'} length {len(a)} > {limit}"
    if not task.gold_ok(a):
        return "unparseable gold answer"
    return None


def check_usable(src: SourceSpec | BenchmarkSpec, n_ok: int, reasons: list[str], limit: float, knob: str) -> None:
    """Refuse a source (a benchmark, an eval set) that yields no usable row, or drops more than ``limit`` of its
    rows (a wrong ``format`` or file), naming it, the count and the top reasons: a benchmark silently shrunk to
    nothing would decontaminate nothing or evaluate nothing."""
    n = n_ok + len(reasons)
    if n_ok and len(reasons) <= limit * n:
        return
    from collections import Counter

    where = getattr(src, "file", None) or getattr(src, "hub_id", None) or src.name
    top = ", ".join(f"{r} ({k})" for r, k in Counter(x.split(":")[0] for x in reasons).most_common(3)) or "no rows"
    raise StageError(f"benchmark {src.name!r} ({where}): {n_ok} usable of {n} rows ({len(reasons)} dropped > "
                     f"{knob}={limit}); top reasons: {top}")


def problems_from(src: SourceSpec | BenchmarkSpec, task: Any, seed: int, v: Validation
                  ) -> tuple[list[Problem], list[dict[str, Any]]]:
    """Valid problems of one source and the rejected rows (with reasons), for evaluation sets. A format that
    implies a task (``FORMAT_TASK``: humaneval -> code) scores its rows with it, whatever ``task`` is."""
    ok, bad = [], []
    kind = task_of(src, task.kind)
    for rid, obj, err in read_source(src, task, seed):
        err = err or validate(obj, kind, v)
        if err:
            bad.append({"id": rid, "reason": err})
        else:
            ok.append(Problem(id=rid, source=src.name, task=kind, prompt=obj["prompt"],
                              answer=obj["answer"].strip(), solution=obj.get("solution")))
    return ok, bad


def task_of(src: SourceSpec | BenchmarkSpec, default: str) -> str:
    """The task a source's rows belong to: the one its format implies, else ``default``."""
    return FORMAT_TASK.get(getattr(src, "format", ""), default)
