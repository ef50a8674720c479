"""A stage's metrics file and its run facts: results in ``metrics/<stage>.json``, timings beside it.

``dvc exp show --only-changed`` lists every metric that differs between experiments, and two runs of one config
differ in their timings: 15 of 17 columns before rl's pass@1 were times (issue 49, finding 6). So a stage's
metrics are written as two files (``write_metrics``): the results, DVC's metrics file, and the run facts (how
the run went: seconds, throughputs, world size, where it resumed) in ``metrics/<stage>.run.json``, a DVC output
that is not a metric, replaced with the stage's other outputs. It is cached by DVC, not git-tracked: DVC keeps a
stage whose output is ``cache: false`` (and neither a metric nor a plot) out of its run-cache (``Stage.run``'s
``no_cache_outs``), which would end restoring a value tried before. ``read_metrics`` joins the two files, as the
stage's ``run`` returned them; MLflow gets both (``tracking.records``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from posttrain.outputs import run_facts_path
from posttrain.schema import write_json

RUN_FACTS = frozenset({"seconds", "world_size", "resumed_from_step", "resumed_at_prompt", "peak_rss_mb",
                       "peak_rss_children_mb"})


def is_run_fact(key: str) -> bool:
    """A metric that says how a run went, not what it produced: a time (``seconds``, ``*_s``, ``*_seconds``,
    ``seconds_per_*``, throughputs ``*_per_s``), the world size, where it resumed. Two runs of one config differ
    in these alone, so they stay out of the result metrics (``write_metrics``)."""
    return key in RUN_FACTS or key.endswith(("_s", "_seconds")) or key.startswith("seconds_")


def split_run_facts(metrics: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``metrics`` as (results, run facts), nested sections split alike (``{"eval": {"seconds": ...}}``)."""
    results: dict[str, Any] = {}
    facts: dict[str, Any] = {}
    for k, v in metrics.items():
        if is_run_fact(str(k)):  # (a section named like one, say a timing breakdown, moves whole)
            facts[k] = v
        elif isinstance(v, dict):
            r, f = split_run_facts(v)
            if r or not f:
                results[k] = r
            if f:
                facts[k] = f
        else:
            results[k] = v
    return results, facts


def write_metrics(path: str | Path, metrics: dict[str, Any]) -> None:
    """A stage's metrics: its results to ``path`` (what ``dvc metrics show`` and ``dvc exp show --only-changed``
    list), its run facts to ``run_facts_path(path)`` (``metrics/rl.run.json``: a DVC output but not a metric, so
    timings no longer fill every experiment table). ``read_metrics`` joins them again."""
    results, facts = split_run_facts(metrics)
    write_json(path, results)
    write_json(run_facts_path(path), facts)


def read_metrics(path: str | Path) -> dict[str, Any]:
    """A stage's metrics file with its run facts (when there are) merged back in: what the stage's ``run``
    returned."""
    def merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        return {**a, **{k: merge(a[k], v) if isinstance(v, dict) and isinstance(a.get(k), dict) else v
                        for k, v in b.items()}}

    facts = run_facts_path(path)
    out = json.loads(Path(path).read_text())
    return merge(out, json.loads(facts.read_text())) if facts.is_file() else out


def add_peak_rss(path: str | Path) -> dict[str, float]:
    """Add this process's peak RSS (``ru_maxrss``) and its largest finished child's (a reward worker, an engine
    process that exited) to the run facts of the metrics file ``path``, if the stage wrote them; the values."""
    import resource

    facts = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),  # Linux: KiB
             "peak_rss_children_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}
    at = run_facts_path(path)
    if at.is_file():
        write_json(at, {**json.loads(at.read_text()), **facts})
    return facts
