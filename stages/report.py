"""report: every evaluated model side by side, with paired differences (the merge step after evaluate@<name>).

Inputs: ``paths.eval_report_dir/models/<name>/`` of every model in ``evaluate.models`` (summary.json,
per_problem.json: the outputs of the ``evaluate@<name>`` stages). Outputs: ``paths.eval_report_dir/summary/``:
``report.md`` (a table per split with 95% intervals, paired differences, pass@k crossings), ``paired.json``
and ``pass_at_k.png``; ``metrics/report.json``: ``{split: {"a vs b": {metric: {diff, n, ci}}}}`` for the
``report.compare`` pairs (the same problems resampled jointly: paired bootstrap).

Cheap (no model is loaded): it re-runs whenever any model's evaluation does. Run inside a DVC repository,
it reads ``dvc.lock`` (never a dependency: DVC rewrites it as stages finish) and heads report.md with a
warning for every stage built from an output its upstream no longer holds (``compare.stale_inputs``: a
student distilled from an rl model that a later ``dvc repro evaluate@rl`` replaced, say).

Run: ``dvc repro report`` (re-evaluates what changed first) or ``python -m stages.report [--params params.yaml]``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import yaml

from posttrain import metrics as M
from posttrain import plots
from posttrain.compare import stale_inputs
from posttrain.config import Params
from posttrain.errors import StageError
from posttrain.outputs import as_one_set
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.schema import write_json, write_text
from stages.layout import NEEDS
from stages.layout import report as paths

log = logging.getLogger("report")


def crossing(a: dict[str, Any], b: dict[str, Any], ks: list[int]) -> str:
    """Where pass@k of model b stops being above (or below) model a's, in words."""
    diff = [(k, b[f"pass@{k}"] - a[f"pass@{k}"]) for k in ks if f"pass@{k}" in a and f"pass@{k}" in b]
    if not diff:
        return "no sampled metrics"
    signs = [(k, s) for k, d in diff if (s := (d > 1e-9) - (d < -1e-9))]  # ties say nothing about the order
    changes = [(k0, k1) for (k0, s0), (k1, s1) in zip(signs, signs[1:], strict=False) if s0 != s1]
    if changes:
        return "cross between " + ", ".join(f"k={k0} and k={k1}" for k0, k1 in changes)
    s = signs[0][1] if signs else 0
    return {1: "second above first at every k (no crossing)", -1: "second below first at every k (no crossing)",
            0: "equal at every k"}[s]


def report_markdown(results: dict[str, dict[str, dict[str, Any]]], ks: list[int], sampling: Any,
                    compare: list[tuple[str, str]], diffs: dict[str, dict[str, dict[str, Any]]],
                    stale: list[str] = ()) -> str:
    shown = sorted({1, min(8, ks[-1]), ks[-1]} & set(ks))
    cols = ["greedy"] + [f"pass@{k}" for k in shown] + [f"maj@{ks[-1]}"]
    lines = ["# Evaluation", "",
             f"Sampled metrics at temperature {sampling.temperature}, top-p {sampling.top_p} (pass@1 is the mean "
             "over samples; maj@k the mean over disjoint blocks of k samples). 95% intervals in brackets: Wilson "
             "for greedy accuracy, bootstrap over problems for the rest (Wilson where every problem is within one "
             "point of 0% or 100%, where a bootstrap cannot move). Guarded: the share of completions a verifier "
             "guard refused before any equivalence check: no answer at all, several different answers, a hedge "
             "(the task's guard: reports/reward/audit.md counts each reason). n sampled: the problems the "
             "sampled metrics use. Curves: pass_at_k.png.", ""]
    if stale:
        lines += ["**Stale inputs** (dvc.lock): these rows do not all come from one pipeline state.", ""]
        lines += [f"- {w}" for w in stale] + [""]
    for split, by_model in results.items():
        lines += [f"## {split}", "", "| model | n greedy | n sampled | " + " | ".join(cols)
                  + " | mean len | cut at max | guarded |", "|---|---:|---:|" + "---:|" * (len(cols) + 3)]
        for name, m in by_model.items():
            if not m.get("n"):
                lines.append(f"| {name} | 0 | 0 | " + " | ".join("—" for _ in cols) + " | — | — | — |")
                continue
            cells = [f"{100 * m[c]:.1f} [{100 * m[c + '_ci'][0]:.1f}, {100 * m[c + '_ci'][1]:.1f}]" if c in m
                     else "—" for c in cols]
            tail = f" | {m['len']:.1f} | {100 * m['truncated']:.0f}%" if "len" in m else " | — | —"
            tail += f" | {100 * m['guarded']:.0f}% |" if "guarded" in m else " | — |"
            lines.append(f"| {name} | {m['n']} | {m.get('n_sampled', '—')} | " + " | ".join(cells) + tail)
        for a, b in compare:
            if a in by_model and b in by_model:
                lines.append(f"\npass@k, {a} vs {b}: {crossing(by_model[a], by_model[b], ks)}.")
        pairs = diffs.get(split, {})
        if pairs:
            lines += ["", "Paired differences (second minus first, points, on the same problems; 95% interval: "
                      "Newcombe's paired interval for 0/1 outcomes, else the paired bootstrap; an interval that "
                      "excludes 0 decides the ordering):", "",
                      "| pair | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
            for pair, d in pairs.items():
                cells = [f"{100 * d[c]['diff']:+.1f} [{100 * d[c]['ci'][0]:+.1f}, {100 * d[c]['ci'][1]:+.1f}]"
                         if c in d else "—" for c in cols]
                lines.append(f"| {pair} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    """Merge. ``inputs``: models_dir (one folder per model), lock (``dvc.lock``; optional, read if there). ``out``: dir,
    metrics. Returns the paired diffs."""
    with as_one_set(out, "report"):  # a kill leaves the old outputs or the new ones, never a mix
        return _run(params, inputs, out)


def _run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    names = list(params.evaluate.models)
    missing = [n for n in names if not (inputs["models_dir"] / n / "summary.json").is_file()]
    if missing:
        raise StageError(f"no evaluation of {missing} under {inputs['models_dir']}: run dvc repro "
                         + " ".join(f"evaluate@{n}" for n in missing))
    summaries = {n: json.loads((inputs["models_dir"] / n / "summary.json").read_text()) for n in names}
    per = {n: json.loads((inputs["models_dir"] / n / "per_problem.json").read_text()) for n in names}
    splits = list(dict.fromkeys(s for n in names for s in summaries[n]))
    results = {s: {n: summaries[n][s] for n in names if s in summaries[n]} for s in splits}
    cfg = params.evaluate
    diffs = {s: {f"{a} vs {b}": M.paired_table(per[a].get(s, {}), per[b].get(s, {}), cfg.bootstrap, params.seed,
                                                    lambda k: k in M.NO_INTERVAL)
                 for a, b in params.report.compare} for s in splits}
    write_json(out["dir"] / "paired.json", diffs)
    stale = _stale(inputs.get("lock"))
    for w in stale:
        log.warning("stale input: %s", w)
    write_text(out["dir"] / "report.md", report_markdown(results, cfg.ks, cfg.sampling, params.report.compare, diffs,
                                                         stale))
    plots.pass_at_k_curves(results, cfg.ks, out["dir"] / "pass_at_k.png")
    write_metrics(out["metrics"], diffs)
    for s in splits:
        for a, b in params.report.compare:
            log.info("%s, %s vs %s: %s", s, a, b, crossing(results[s].get(a, {}), results[s].get(b, {}), cfg.ks))
    return diffs


def _stale(lock: Path | None) -> list[str]:
    """``compare.stale_inputs`` of ``dvc.lock`` (none when there is no lock); an unreadable lock (a merge
    conflict, say) is a warning, never the report's failure."""
    if lock is None or not lock.is_file():
        return []
    try:
        return stale_inputs(yaml.safe_load(lock.read_text()) or {})
    except (OSError, yaml.YAMLError, AttributeError, KeyError, TypeError) as e:
        log.warning("%s could not be read for stale inputs: %s", lock, str(e).splitlines()[0])
        return []


def main() -> None:
    def body(p: Params) -> dict[str, Any]:  # dvc (and a user by hand) runs stages at the repository's root
        inputs, out = paths(p)
        return run(p, {**inputs, "lock": Path("dvc.lock")}, out)

    stage_main("report", body, needs=lambda p: NEEDS["report"](p, None))


if __name__ == "__main__":
    main()
