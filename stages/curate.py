"""curate: read, validate, deduplicate and decontaminate problems; split train / SFT demos / eval.

Inputs (params ``curate``): sources (the task generator, local JSONL/Parquet files, hub datasets), the
eval source, benchmark sets to decontaminate against (by path or hub id).
Outputs (``paths.curated_dir``): ``train.parquet`` (RL prompts), ``sft.parquet`` (demonstrations with
solutions), ``eval.parquet`` (held-out), ``quarantine.jsonl`` (every rejected row with its reason);
``paths.curate_report_dir``: ``decontamination.json`` + ``.md``; ``metrics/curate.json`` (counts).

Counts reconcile exactly: ``in = kept + quarantined + duplicates + contaminated`` (training rows; the
eval split is counted on its own).

Run: ``dvc repro curate`` or ``python -m stages.curate [--params params.yaml]``.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from tqdm import tqdm

from posttrain import decontam, seeds
from posttrain import dedup as dedup_mod
from posttrain.config import Curate, Dedup, Params, SyntheticSource, Validation
from posttrain.errors import StageError
from posttrain.outputs import atomic_path
from posttrain.runner import stage_main
from posttrain.schema import PROBLEM_SCHEMA, Problem, write_json, write_jsonl, write_parquet, write_text
from posttrain.sources import check_usable, read_source, validate

log = logging.getLogger("curate")

# --------------------------------------------------------------------------------------------- run
def _collect(sources: list[Any], task: Any, task_kind: str, v: Validation, seed: int, progress: bool,
             desc: str, max_quarantined_frac: float) -> tuple[list[Problem], list[dict[str, Any]], int, list[str]]:
    """Valid rows, quarantined rows, rows read, and one complaint per source whose quarantined share exceeds
    ``max_quarantined_frac`` (naming the file and its top reasons)."""
    rows, quarantined, n_in, complaints = [], [], 0, []
    for k, src in enumerate(sources):
        n_src, bad = 0, Counter()
        for rid, obj, err in tqdm(read_source(src, task, seed + 1000 * k), desc=f"{desc}:{src.name}",
                                  disable=not progress, unit="row", leave=False):
            n_in += 1
            n_src += 1
            err = err or validate(obj, task_kind, v)
            if err:
                quarantined.append({"id": rid, "split": desc, "reason": err,
                                    "row": obj if obj is not None else None})
                bad[err.split(":")[0]] += 1
                continue
            rows.append(Problem(id=rid, source=src.name, task=task_kind, prompt=obj["prompt"],
                                answer=obj["answer"].strip(), solution=obj.get("solution")))
        share = sum(bad.values()) / max(n_src, 1)
        if n_src == 0 or share > max_quarantined_frac:
            where = getattr(src, "path", None) or getattr(src, "hub_id", None) or src.name
            top = ", ".join(f"{reason} ({n})" for reason, n in bad.most_common(3)) or "no rows at all"
            complaints.append(f"{desc} source {src.name!r} ({where}): {sum(bad.values())} of {n_src} rows "
                              f"quarantined ({share:.0%} > curate.max_quarantined_frac={max_quarantined_frac}); "
                              f"top reasons: {top}")
    return rows, quarantined, n_in, complaints


def dedup(rows: list[Problem], cfg: Dedup) -> tuple[list[Problem], list[dict[str, Any]]]:
    """Exact and near duplicates removed (``posttrain.dedup``), first occurrence kept."""
    _, found = dedup_mod.find_duplicates([r["prompt"] for r in rows], cfg)
    gone = {d.row for d in found}
    dups = [{"id": rows[d.row]["id"], "duplicate_of": rows[d.of]["id"], "method": d.method, "score": d.score}
            for d in found]
    return [r for i, r in enumerate(rows) if i not in gone], dups


def decontaminate(rows: list[Problem], benchmarks: dict[str, list[tuple[str, str]]], cfg: Any
                  ) -> tuple[list[Problem], set[str], dict[str, Any]]:
    """Drop rows matching any benchmark item; return kept rows, contaminated ids, and the report."""
    report: dict[str, Any] = {"ngram": cfg.ngram, "threshold": cfg.threshold, "rows_checked": len(rows),
                              "benchmarks": {}}
    bad: set[str] = set()
    for name, items in benchmarks.items():
        index = decontam.build_index(items, cfg.ngram, cfg.boilerplate_frac)
        matches = []
        for r in rows:
            m = index.query(r["prompt"])
            if m is not None and m.score >= cfg.threshold:
                matches.append({"row_id": r["id"], "item_id": m.item_id, "method": m.method,
                                "score": round(m.score, 3), "ngrams": m.shared[:5]})
                bad.add(r["id"])
        report["benchmarks"][name] = {"items": len(items), "boilerplate_ngrams": len(index.boilerplate),
                                      "matched_rows": len(matches),
                                      "matched_ids": sorted({m["item_id"] for m in matches}),
                                      "matches": matches}
    report["contaminated_rows"] = len(bad)
    return [r for r in rows if r["id"] not in bad], bad, report


def run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    """Curate. ``inputs``: nothing beyond params (sources are named there). ``out``: curated_dir, report_dir,
    metrics. Returns the counts written to ``out['metrics']``."""
    cfg: Curate = params.curate
    task, kind, v, prog = params.task, params.task.kind, cfg.validation, params.runtime.progress

    # 1. eval split: its own source (or the generator, seeded apart from training), validated, deduped
    eval_src = cfg.eval.source or SyntheticSource(name="arith_eval", num_rows=cfg.eval.rows * 2)
    ev, ev_quarantine, ev_in, complaints = _collect([eval_src], task, kind, v, seeds.eval_draw(params.seed), prog,
                                                    "eval", cfg.max_quarantined_frac)
    ev, _ = dedup(ev, cfg.dedup)
    ev = ev[: cfg.eval.rows]

    # 2. training pool: read + validate -> dedup -> decontaminate (eval split always, then benchmarks)
    rows, quarantine, n_in, train_complaints = _collect(cfg.sources, task, kind, v, params.seed, prog, "train",
                                                        cfg.max_quarantined_frac)
    complaints += train_complaints
    rows, dups = dedup(rows, cfg.dedup)
    bench: dict[str, list[tuple[str, str]]] = {"eval_split": [(r["id"], r["prompt"]) for r in ev]}
    for b in cfg.decontam.benchmarks:
        read = list(read_source(b, task, params.seed))
        items = [(rid, obj["prompt"]) for rid, obj, err in read if err is None]
        check_usable(b, len(items), [err for _, _, err in read if err], cfg.max_quarantined_frac,
                     "curate.max_quarantined_frac")
        bench[b.name] = items
    rows, bad, report = decontaminate(rows, bench, cfg.decontam)

    # 3. split: SFT demonstrations (need a solution the task can render) and RL train prompts
    can_demo = [r for r in rows if r["solution"] or kind == "arith"]
    sft = can_demo[: cfg.sft_size]
    sft_ids = {r["id"] for r in sft}
    train = [r for r in rows if r["id"] not in sft_ids]
    if not complaints and (not sft or not train):  # (complaints say why rows are missing: reported below)
        raise StageError(f"{len(rows)} usable training rows, {len(can_demo)} with a solution: curate.sft_size "
                         f"({cfg.sft_size}) leaves {len(sft)} SFT demonstrations and {len(train)} RL prompts; "
                         "both must be > 0 (lower sft_size or add rows)")

    counts = {"in": n_in, "kept": len(rows), "quarantined": len(quarantine), "duplicates": len(dups),
              "contaminated": len(bad), "train": len(train), "sft": len(sft),
              "eval": len(ev), "eval_in": ev_in, "eval_quarantined": len(ev_quarantine)}
    assert counts["in"] == counts["kept"] + counts["quarantined"] + counts["duplicates"] + counts["contaminated"]
    quarantine_reasons: dict[str, int] = {}
    for q in quarantine + ev_quarantine:
        key = q["reason"].split(":")[0]
        quarantine_reasons[key] = quarantine_reasons.get(key, 0) + 1
    counts["quarantine_reasons"] = quarantine_reasons
    counts["contaminated_by_benchmark"] = {k: b["matched_rows"] for k, b in report["benchmarks"].items()}

    d = out["curated_dir"]
    with atomic_path(d) as tmp:  # the splits are one set: a kill leaves the old set or the new one, never a mix
        write_parquet(tmp / "train.parquet", train, PROBLEM_SCHEMA)
        write_parquet(tmp / "sft.parquet", sft, PROBLEM_SCHEMA)
        write_parquet(tmp / "eval.parquet", ev, PROBLEM_SCHEMA)
        write_jsonl(tmp / "quarantine.jsonl", quarantine + ev_quarantine)
        write_jsonl(tmp / "duplicates.jsonl", dups)
    write_json(out["report_dir"] / "decontamination.json", report)
    write_text(out["report_dir"] / "decontamination.md", decontam.report_markdown(report))
    write_json(out["metrics"], counts)
    log.info("in=%d kept=%d (train %d, sft %d) quarantined=%d duplicates=%d contaminated=%d eval=%d",
             n_in, len(rows), len(train), len(sft), len(quarantine), len(dups), len(bad), len(ev))

    if complaints:  # after the writes: quarantine.jsonl shows every rejected row and its reason
        raise StageError("; ".join(complaints) + f" (every row and reason: {d / 'quarantine.jsonl'})")
    limit = cfg.decontam.max_contaminated_frac
    if limit is not None and n_in and len(bad) / n_in > limit:
        raise StageError(f"contaminated share {len(bad) / n_in:.3f} > curate.decontam.max_contaminated_frac="
                         f"{limit} (see {out['report_dir'] / 'decontamination.md'})")
    return counts


def paths(p: Params) -> tuple[dict[str, Any], dict[str, Path]]:
    """This stage's inputs and outputs, from ``params.paths`` (used by ``main`` and by tests)."""
    return {}, {"curated_dir": Path(p.paths.curated_dir), "report_dir": Path(p.paths.curate_report_dir),
                "metrics": Path(p.paths.metrics_dir) / "curate.json"}


def main() -> None:
    stage_main("curate", lambda p: run(p, *paths(p)))


if __name__ == "__main__":
    main()
