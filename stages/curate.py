"""curate: read, validate, deduplicate and decontaminate problems; split train / SFT demos / eval.

Inputs (params ``curate``): sources (the task generator, local JSONL/Parquet files, hub datasets), the
eval source, benchmark sets to decontaminate against (by path or hub id).
Outputs (``paths.curated_dir``): ``train.parquet`` (RL prompts), ``sft.parquet`` (demonstrations with
solutions), ``eval.parquet`` (held-out), ``quarantine.jsonl`` (every rejected row with its reason);
``paths.curate_report_dir``: ``decontamination.json`` + ``.md``; ``metrics/curate.json`` (counts).

Streaming: rows are read and validated into a scratch Parquet pool (a record batch in memory at a time),
deduplicated over the pool's prompt column (``posttrain.dedup``; read twice, never whole), then decontaminated
and split a row at a time into the outputs. Memory at 10^6 rows: ``benchmarks/results/scale.json``.

Counts reconcile exactly: ``in = kept + quarantined + duplicates + contaminated`` (training rows; the
eval split is counted on its own).

Run: ``dvc repro curate`` or ``python -m stages.curate [--params params.yaml]``.
"""

from __future__ import annotations

import logging
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from posttrain import decontam, seeds
from posttrain import dedup as dedup_mod
from posttrain.config import Curate, Dedup, Params, SyntheticSource, Validation
from posttrain.dedup import Texts
from posttrain.errors import StageError
from posttrain.outputs import atomic_path
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main
from posttrain.schema import (
    BATCH_ROWS,
    PROBLEM_SCHEMA,
    Column,
    Problem,
    batches,
    iter_rows,
    json_line,
    parquet_file,
    parquet_sink,
    write_json,
    write_jsonl,
    write_parquet,
    write_text,
)
from posttrain.sources import check_usable, read_source, task_of, validate
from stages.layout import curate as paths

log = logging.getLogger("curate")
ID_CHUNK = 1 << 18  # duplicates whose ids are looked up in one pass over the id column

# --------------------------------------------------------------------------------------------- run
@dataclass
class Pool:
    """The rows of some sources: the valid ones in a scratch Parquet file (``rows``, ``PROBLEM_SCHEMA``), the
    rejected ones with their reasons in a scratch JSONL (``quarantine``), and the counts."""

    rows: Path
    quarantine: Path
    n_in: int = 0
    n_bad: int = 0
    reasons: Counter[str] = field(default_factory=Counter)


def _collect(sources: list[Any], task: Any, task_kind: str, v: Validation, seed: int, progress: bool,
             desc: str, max_quarantined_frac: float, scratch: Path) -> tuple[Pool, list[str]]:
    """Read and validate ``sources`` into a :class:`Pool` under ``scratch`` (a batch of rows in memory at a
    time), and one complaint per source whose quarantined share exceeds ``max_quarantined_frac`` (naming the
    file and its top reasons)."""
    pool, complaints, batch = Pool(scratch / f"{desc}.parquet", scratch / f"{desc}.quarantine.jsonl"), [], []
    with pq.ParquetWriter(pool.rows, PROBLEM_SCHEMA) as w, pool.quarantine.open("w") as q:
        def flush() -> None:
            w.write_batch(pa.RecordBatch.from_pylist(batch, schema=PROBLEM_SCHEMA))
            batch.clear()

        for k, src in enumerate(sources):
            n_src, bad, kind = 0, Counter(), task_of(src, task_kind)
            for rid, obj, err in tqdm(read_source(src, task, seed + 1000 * k), desc=f"{desc}:{src.name}",
                                      disable=not progress, unit="row", leave=False):
                n_src += 1
                err = err or validate(obj, kind, v)
                if err:
                    q.write(json_line({"id": rid, "split": desc, "reason": err, "row": obj}))
                    bad[err.split(":")[0]] += 1
                    continue
                batch.append(Problem(id=rid, source=src.name, task=kind, prompt=obj["prompt"],
                                     answer=obj["answer"].strip(), solution=obj.get("solution")))
                if len(batch) == BATCH_ROWS:
                    flush()
            pool.n_in, pool.n_bad = pool.n_in + n_src, pool.n_bad + sum(bad.values())
            pool.reasons += bad
            share = sum(bad.values()) / max(n_src, 1)
            if n_src == 0 or share > max_quarantined_frac:
                where = getattr(src, "path", None) or getattr(src, "hub_id", None) or src.name
                top = ", ".join(f"{reason} ({n})" for reason, n in bad.most_common(3)) or "no rows at all"
                complaints.append(f"{desc} source {src.name!r} ({where}): {sum(bad.values())} of {n_src} rows "
                                  f"quarantined ({share:.0%} > curate.max_quarantined_frac={max_quarantined_frac})"
                                  f"; top reasons: {top}")
        if batch:
            flush()
    return pool, complaints


def duplicates(prompts: Texts, cfg: Dedup, scratch: Path | None = None) -> tuple[np.ndarray, dedup_mod.Found]:
    """A mask of the rows that are exact or near duplicates (``posttrain.dedup``, first occurrence kept) and
    the duplicates found (each naming the row it repeats); the MinHash index spills under ``scratch``."""
    _, found = dedup_mod.find_duplicates(prompts, cfg, scratch)
    gone = np.zeros(len(prompts), dtype=bool)
    gone[found.row] = True
    return gone, found


def records(found: dedup_mod.Found, name: Callable[[int], str]) -> Iterator[dict[str, Any]]:
    """duplicates.jsonl's rows: each duplicate's id, the id of the row it repeats, the method and score
    (``name``: row index -> id)."""
    for d in found:
        yield {"id": name(d.row), "duplicate_of": name(d.of), "method": d.method, "score": d.score}


def dedup(rows: list[Problem], cfg: Dedup) -> tuple[list[Problem], list[dict[str, Any]]]:
    """Exact and near duplicates removed from a list of rows, first occurrence kept."""
    gone, found = duplicates([r["prompt"] for r in rows], cfg)
    return ([r for i, r in enumerate(rows) if not gone[i]],
            list(records(found, lambda i: rows[i]["id"])))


def decontaminate(rows: list[Problem], benchmarks: dict[str, list[tuple[str, str]]], cfg: Any
                  ) -> tuple[list[Problem], set[str], dict[str, Any]]:
    """Drop rows matching any benchmark item; return kept rows, contaminated ids, and the report."""
    d = decontam.Checker(benchmarks, cfg)
    kept = [r for r in rows if d.clean(r)]
    return kept, d.bad, d.report()


def _kept_rows(pool: Pool, gone: np.ndarray) -> Iterator[Problem]:
    """The pool's rows in order, but the duplicates, a record batch at a time."""
    i = 0
    for batch in iter_rows(pool.rows):
        for r in batch:
            if not gone[i]:
                yield r  # type: ignore[misc]
            i += 1


def run(params: Params, inputs: dict[str, Any], out: dict[str, Path]) -> dict[str, Any]:
    """Curate. ``inputs``: nothing beyond params (sources are named there). ``out``: curated_dir, report_dir,
    metrics. Returns the counts written to ``out['metrics']``.

    Memory: a batch of rows, the dedup index (``posttrain.dedup``: with MinHash on disk in the scratch
    folder, one boolean a row in memory), 21 bytes a duplicate (``dedup.Found``'s columns; their ids are
    looked up ``ID_CHUNK`` at a time), the kept eval split, the contaminated rows' ids and the rejected rows'
    reason counts; the rows themselves stream through scratch Parquet files beside the output."""
    cfg: Curate = params.curate
    task, kind, v, prog = params.task, params.task.kind, cfg.validation, params.runtime.progress
    d = out["curated_dir"]
    with atomic_path(d) as tmp:  # the splits are one set: a kill leaves the old set or the new one, never a mix
        scratch = tmp.parent / "scratch"  # (atomic_path's own folder: removed with it, or by the next run)
        scratch.mkdir()
        tmp.mkdir()
        # 1. eval split: its own source (or the generator, seeded apart from training), validated, deduped
        eval_src = cfg.eval.source or SyntheticSource(name=f"{kind}_eval", num_rows=cfg.eval.rows * 2)
        ev_pool, complaints = _collect([eval_src], task, kind, v, seeds.eval_draw(params.seed), prog, "eval",
                                       cfg.max_quarantined_frac, scratch)
        gone, _ = duplicates(Column(ev_pool.rows, "prompt"), cfg.dedup, scratch)
        ev = list(islice(_kept_rows(ev_pool, gone), cfg.eval.rows))

        # 2. training pool: read + validate -> dedup -> decontaminate (eval split always, then benchmarks)
        pool, train_complaints = _collect(cfg.sources, task, kind, v, params.seed, prog, "train",
                                          cfg.max_quarantined_frac, scratch)
        complaints += train_complaints
        gone, dups = duplicates(Column(pool.rows, "prompt"), cfg.dedup, scratch)
        bench: dict[str, list[tuple[str, str]]] = {"eval_split": [(r["id"], r["prompt"]) for r in ev]}
        for b in cfg.decontam.benchmarks:
            read = list(read_source(b, task, params.seed))
            items = [(rid, obj["prompt"]) for rid, obj, err in read if err is None]
            check_usable(b, len(items), [err for _, _, err in read if err], cfg.max_quarantined_frac,
                         "curate.max_quarantined_frac")
            bench[b.name] = items
        dc = decontam.Checker(bench, cfg.decontam)

        # 3. split, streaming: the first sft_size rows with a solution the task can render are SFT
        # demonstrations, the others RL train prompts
        n = {"kept": 0, "can_demo": 0, "sft": 0, "train": 0}
        with _sink(tmp / "train.parquet") as train, _sink(tmp / "sft.parquet") as sft:
            for r in _kept_rows(pool, gone):
                if not dc.clean(r):
                    continue
                n["kept"] += 1
                demo = bool(r["solution"]) or kind == "arith"
                n["can_demo"] += demo
                to = "sft" if demo and n["sft"] < cfg.sft_size else "train"
                n[to] += 1
                (sft if to == "sft" else train)(r)
            if not complaints and (not n["sft"] or not n["train"]):  # (complaints say why rows are missing)
                raise StageError(f"{n['kept']} usable training rows, {n['can_demo']} with a solution: "
                                 f"curate.sft_size ({cfg.sft_size}) leaves {n['sft']} SFT demonstrations and "
                                 f"{n['train']} RL prompts; both must be > 0 (lower sft_size or add rows)")
        write_parquet(tmp / "eval.parquet", ev, PROBLEM_SCHEMA)
        with (tmp / "quarantine.jsonl").open("wb") as f:  # training rows' reasons, then the eval split's
            for part in (pool.quarantine, ev_pool.quarantine):
                with part.open("rb") as src:
                    shutil.copyfileobj(src, f)
        write_jsonl(tmp / "duplicates.jsonl", _duplicate_records(pool, dups))
    report = dc.report()

    counts = {"in": pool.n_in, "kept": n["kept"], "quarantined": pool.n_bad, "duplicates": len(dups),
              "contaminated": len(dc.bad), "train": n["train"], "sft": n["sft"],
              "eval": len(ev), "eval_in": ev_pool.n_in, "eval_quarantined": ev_pool.n_bad}
    assert counts["in"] == counts["kept"] + counts["quarantined"] + counts["duplicates"] + counts["contaminated"]
    counts["quarantine_reasons"] = dict(pool.reasons + ev_pool.reasons)
    counts["contaminated_by_benchmark"] = {k: b["matched_rows"] for k, b in report["benchmarks"].items()}

    write_json(out["report_dir"] / "decontamination.json", report)
    write_text(out["report_dir"] / "decontamination.md", decontam.report_markdown(report))
    write_metrics(out["metrics"], counts)
    log.info("in=%d kept=%d (train %d, sft %d) quarantined=%d duplicates=%d contaminated=%d eval=%d",
             pool.n_in, n["kept"], n["train"], n["sft"], pool.n_bad, len(dups), len(dc.bad), len(ev))

    if complaints:  # after the writes: quarantine.jsonl shows every rejected row and its reason
        raise StageError("; ".join(complaints) + f" (every row and reason: {d / 'quarantine.jsonl'})")
    limit = cfg.decontam.max_contaminated_frac
    if limit is not None and pool.n_in and len(dc.bad) / pool.n_in > limit:
        raise StageError(f"contaminated share {len(dc.bad) / pool.n_in:.3f} > curate.decontam."
                         f"max_contaminated_frac={limit} (see {out['report_dir'] / 'decontamination.md'})")
    return counts


def _duplicate_records(pool: Pool, dups: dedup_mod.Found) -> Iterator[dict[str, Any]]:
    """duplicates.jsonl's rows, ``ID_CHUNK`` duplicates at a time: a chunk's ids (the duplicates' and the rows
    they repeat) taken in one pass over the id column, so memory holds one chunk's ids whatever the duplicate
    count (passes: duplicates / ``ID_CHUNK``; 10^8 rows with a quarter copies: ~100 passes over 10^8 ids)."""
    for k in range(0, len(dups), ID_CHUNK):
        part = dups[k:k + ID_CHUNK]
        yield from records(part, _ids(pool, np.union1d(part.row, part.of)))


def _ids(pool: Pool, want: np.ndarray) -> Callable[[int], str]:
    """Row index -> id for the rows ``want`` (sorted; the duplicates and the rows they repeat) of a pool: their
    ids taken from the id column a record batch at a time, kept as one Arrow array (no Python string a row)."""
    taken, start = [], 0
    for batch in batches(parquet_file(pool.rows), BATCH_ROWS, ["id"]):
        end = start + batch.num_rows
        taken.append(batch.column(0).take(pa.array(want[np.searchsorted(want, start):np.searchsorted(want, end)]
                                                   - start)))
        start = end
    ids = pa.concat_arrays(taken) if taken else pa.array([], pa.string())
    return lambda i: ids[int(np.searchsorted(want, i))].as_py()


@contextmanager
def _sink(path: Path) -> Iterator[Callable[[Problem], None]]:
    """A Parquet file of problems written ``BATCH_ROWS`` rows (a row group) at a time: yields ``add(row)``."""
    batch: list[Problem] = []
    with parquet_sink(path, PROBLEM_SCHEMA) as write:
        def add(r: Problem) -> None:
            batch.append(r)
            if len(batch) == BATCH_ROWS:
                write(batch)
                batch.clear()

        yield add
        write(batch)


def main() -> None:
    stage_main("curate", lambda p: run(p, *paths(p)))


if __name__ == "__main__":
    main()
