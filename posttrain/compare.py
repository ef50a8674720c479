"""``posttrain compare A B``: two revisions of the pipeline side by side, paired on the same problems.

``A`` and ``B`` are git revisions (a commit, a branch, ``HEAD~1``) or DVC experiment names (``dvc exp run -n
lr1e5`` stores one under ``refs/exps``). For each model both evaluated (``evaluate.models``), on each split, every
per-problem metric of ``per_problem.json`` as B - A over the problems both have, with its 95% paired interval
(``metrics.paired_rate_ci``: Newcombe's for 0/1 outcomes, else the paired bootstrap; the report stage's method,
across revisions instead of across models); then what differs between the two: the params (``params.yaml``,
flattened) and the stages whose outputs differ (``dvc.lock``); and, in each revision, any stage whose input is not
the output that revision holds (a student distilled from an rl model that was trained again since: its numbers
sit beside a teacher it never saw).

Files are read at each revision without a checkout: git-tracked ones with ``git show``, DVC outputs with
``dvc.api.read`` (from the local cache: the revision must have run here, or been pulled). Timing fields (``*_s``,
``seconds``) are metrics of how fast, not of what was learned: they are left out of the paired table.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from posttrain import metrics as M
from posttrain.errors import StageError
from posttrain.revisions import commit_of, dvc_file, git_file
from posttrain.runfacts import is_run_fact


@dataclass
class Comparison:
    """What ``compare`` found: ``revs`` (name -> commit), ``paired`` (model -> split -> metric -> {a, b, diff, ci,
    n}), ``params`` (key -> [a, b]), ``stages`` (stage -> changed outputs), ``warnings`` (per revision)."""

    revs: dict[str, str]
    paired: dict[str, dict[str, dict[str, dict[str, Any]]]] = field(default_factory=dict)
    params: dict[str, list[Any]] = field(default_factory=dict)
    stages: dict[str, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def stale_inputs(lock: dict[str, Any]) -> list[str]:
    """Stages of one ``dvc.lock`` whose input is a path another stage outputs, with another md5: built from an
    output this revision no longer holds."""
    stages = lock.get("stages", {})
    made = {o["path"]: (name, o.get("md5")) for name, s in stages.items() for o in s.get("outs", [])}
    found = []
    for name, s in stages.items():
        for d in s.get("deps", []):
            if d["path"] in made and made[d["path"]][1] != d.get("md5") and made[d["path"]][0] != name:
                found.append(f"{name} was built from a {d['path']} other than the one {made[d['path']][0]} now "
                             "outputs (run dvc repro to rebuild it)")
    return found


def compare(root: Path, a: str, b: str, n_boot: int = 1000, seed: int = 0) -> Comparison:
    """Compare revisions ``a`` and ``b`` of the repository at ``root`` (see the module docstring)."""
    revs = {a: commit_of(root, a), b: commit_of(root, b)}
    ra, rb = revs[a], revs[b]
    texts = {r: git_file(root, r, "params.yaml") for r in (ra, rb)}
    if any(t is None for t in texts.values()):
        raise StageError(f"no params.yaml at {a if texts[ra] is None else b}")
    pa, pb = (yaml.safe_load(texts[r]) or {} for r in (ra, rb))
    out = Comparison(revs)
    fa, fb = _flat(pa), _flat(pb)
    out.params = {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}
    locks = {r: yaml.safe_load(git_file(root, r, "dvc.lock") or "{}") or {} for r in (ra, rb)}
    sa, sb = locks[ra].get("stages", {}), locks[rb].get("stages", {})
    for name in sorted(set(sa) | set(sb)):
        oa = {o["path"]: o.get("md5") for o in sa.get(name, {}).get("outs", [])}
        ob = {o["path"]: o.get("md5") for o in sb.get(name, {}).get("outs", [])}
        changed = sorted(p for p in set(oa) | set(ob) if oa.get(p) != ob.get(p))
        if changed:
            out.stages[name] = changed
    for label, r in ((a, ra), (b, rb)):
        out.warnings += [f"{label}: {w}" for w in stale_inputs(locks[r])]
    models_a = (pa.get("evaluate") or {}).get("models") or {}
    models_b = (pb.get("evaluate") or {}).get("models") or {}
    dir_a = (pa.get("paths") or {}).get("eval_report_dir", "reports/evaluate")
    dir_b = (pb.get("paths") or {}).get("eval_report_dir", "reports/evaluate")
    for name in [m for m in models_a if m in models_b]:
        ta = dvc_file(root, ra, f"{dir_a}/models/{name}/per_problem.json")
        tb = dvc_file(root, rb, f"{dir_b}/models/{name}/per_problem.json")
        if ta is None or tb is None:
            out.warnings.append(f"{name}: no evaluation at {a if ta is None else b} in the local cache "
                                "(dvc pull, or run it there)")
            continue
        per_a, per_b = json.loads(ta), json.loads(tb)
        out.paired[name] = {s: M.paired_table(per_a[s], per_b[s], n_boot, seed, is_run_fact)
                            for s in per_a if s in per_b}
    return out


def _plain(key: str) -> bool:
    """A count or a length (shown as is), not a rate (shown in points)."""
    return key.endswith(("len", "tool_calls"))


def markdown(c: Comparison, a: str, b: str) -> str:
    """The comparison as Markdown: one table per model and split (rates in points), then what differs."""
    lines = [f"# {b} vs {a}", "", f"{a} = {c.revs[a][:10]}, {b} = {c.revs[b][:10]}. Paired over the problems both "
             "evaluated: B - A, 95% interval (Newcombe for 0/1 outcomes, else the paired bootstrap); an interval "
             "that excludes 0 decides the ordering. Rates in points; lengths in tokens.", ""]
    for name, splits in c.paired.items():
        for split, rows in splits.items():
            lines += [f"## {name} / {split}", "", f"| metric | {a} | {b} | {b} - {a} [95%] | n |",
                      "|---|---:|---:|---:|---:|"]
            for key, r in rows.items():
                k = 1.0 if _plain(key) else 100.0
                ci = "" if np.isnan(r["ci"][0]) else f" [{k * r['ci'][0]:+.1f}, {k * r['ci'][1]:+.1f}]"
                lines.append(f"| {key} | {k * r['a']:.1f} | {k * r['b']:.1f} | {k * r['diff']:+.1f}{ci} | {r['n']} |")
            lines.append("")
    lines += ["## What differs", ""]
    lines += [f"- params `{k}`: {v[0]!r} -> {v[1]!r}" for k, v in c.params.items()] or ["- params: none"]
    lines += [f"- stage `{s}`: {', '.join(o)} changed" for s, o in c.stages.items()] or ["- stage outputs: none"]
    if c.warnings:
        lines += ["", "## Warnings", ""] + [f"- {w}" for w in c.warnings]
    return "\n".join(lines) + "\n"
