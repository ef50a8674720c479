"""``curate:``: where problems come from, validation, deduplication, decontamination and the splits."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config import names
from posttrain.config.base import MAX_CHARS, MAX_ROWS, Refusal, Section


class SyntheticSource(Section):
    """Problems drawn from the task generator (``task.kind`` arith or code)."""

    kind: Literal["synthetic"] = "synthetic"
    name: str = Field("arith", min_length=1, description="source name recorded in every row's `source`")
    num_rows: int = Field(4000, ge=1, le=MAX_ROWS, description="rows to generate (duplicates are then removed)")


class _Rows(Section):
    """Which of a file's or hub set's rows are read (after the fields of the source itself)."""

    format: str
    limit: int | None = Field(None, ge=1, le=MAX_ROWS, description="read at most this many rows")
    max_steps: int | None = Field(None, ge=0, le=100, description="format gsm8k: read only rows whose reference "
                                  "solution makes at most this many calculations (its <<a*b=c>> annotations); "
                                  "e.g. 2 for GSM8K's one- and two-step problems")

    @model_validator(mode="after")
    def _steps(self) -> _Rows:
        if self.max_steps is not None and self.format != "gsm8k":
            raise Refusal("max_steps", f"counts GSM8K's calculation annotations: format {self.format!r} has none")
        return self


_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
DATA_DOC = "docs/real-models.md#benchmark-files"


def expand(path: str) -> str:
    """``path`` with each ``${NAME}`` replaced by the environment's value (``${POSTTRAIN_BENCH}``: the folder of
    benchmark files on this machine). An unset or empty variable is a ``ValueError`` naming it."""
    def value(m: re.Match[str]) -> str:
        if not os.environ.get(m.group(1)):
            raise ValueError(f"${{{m.group(1)}}} is not set: export it as the folder holding "
                             f"{Path(path).name} ({DATA_DOC})")
        return os.environ[m.group(1)]

    return _VAR.sub(value, path)


def _sha256(path: str) -> str:
    with open(path, "rb") as f:  # (not posttrain.digests: config's dvc deps stay config alone)
        return hashlib.file_digest(f, "sha256").hexdigest()


class FileSource(_Rows):
    """A local JSONL or Parquet file, read line by line (JSONL) so malformed rows are quarantined. ``path`` may
    start from an environment variable (``${POSTTRAIN_BENCH}/gsm8k_train.jsonl``): the params stay the same on
    every machine, and ``sha256`` pins the bytes wherever the folder is."""

    kind: Literal["file"] = "file"
    name: str = Field(min_length=1, description="source name recorded in every row's `source`")
    path: str = Field(min_length=1, description="path to .jsonl/.json/.parquet, relative to the repo root; "
                      "${NAME} is read from the environment (e.g. ${POSTTRAIN_BENCH})")
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="the file's sha256: other bytes are "
                               "refused before any work (null: not pinned)")
    format: Literal[names.FORMATS] = Field(
        description="gsm8k: question/answer with '#### n'; math: problem/answer (or solution with \\boxed{}); "
        "generic: prompt/answer[/solution]; humaneval: prompt/test/entry_point[/canonical_solution] (task code)"
    )

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(expand(v)).is_file():
            raise ValueError(f"file not found: {expand(v)}" + (f" ({DATA_DOC})" if _VAR.search(v) else ""))
        return v

    @model_validator(mode="after")
    def _pinned(self) -> FileSource:
        if self.sha256 is not None and (got := _sha256(self.file)) != self.sha256:
            raise Refusal("sha256", f"{self.file} has sha256 {got}, not the pinned {self.sha256}")
        return self

    @property
    def file(self) -> str:
        """``path`` with its environment variables filled in: the file this machine reads."""
        return expand(self.path)


class HubSource(_Rows):
    """A dataset loaded by ``datasets.load_dataset(hub_id, config, split=split)``."""

    kind: Literal["hub"] = "hub"
    name: str = Field(min_length=1, description="source name recorded in every row's `source`")
    hub_id: str = Field(min_length=1, description="e.g. openai/gsm8k")
    config: str | None = Field(None, description="dataset config name, e.g. 'main'")
    split: str = Field("train", description="split to load")
    revision: str | None = Field(None, description="dataset revision (commit sha, tag or branch): pin a sha for a "
                                 "reproducible run; recorded in the curate report and MLflow")
    format: Literal[names.FORMATS] = Field(description="see FileSource.format")


SourceSpec = Annotated[SyntheticSource | FileSource | HubSource, Field(discriminator="kind")]
BenchmarkSpec = Annotated[FileSource | HubSource, Field(discriminator="kind")]


class Decontam(Section):
    """Word n-gram overlap of training rows with the eval split and benchmarks (in both directions)."""

    ngram: int = Field(8, ge=1, le=1000, description="word n-gram size; texts shorter than n words form one n-gram")
    threshold: float = Field(
        0.5, gt=0, le=1,
        description="flag a row when the share of its n-grams found in a benchmark item, or the share of a "
        "benchmark item's n-grams found in the row, reaches this",
    )
    boilerplate_frac: float = Field(
        0.2, gt=0, le=1,
        description="n-grams present in more than this share of a benchmark's items (shared instructions "
        "such as 'put your final answer within \\boxed{}') are not indexed",
    )
    benchmarks: list[BenchmarkSpec] = Field(
        default_factory=list,
        description="benchmark sets to decontaminate against; the held-out eval split is always included",
    )
    max_contaminated_frac: float | None = Field(
        None, ge=0, le=1, description="fail the stage when more than this share of rows is contaminated"
    )


class Dedup(Section):
    """Exact (digest of the normalised text) and near duplicates among the rows (see ``posttrain.dedup``)."""

    method: Literal[(*names.DEDUP_METHODS, "auto")] = Field(
        "auto", description="near-duplicate finder: ngram (bounded n-gram index; catches copies inside a wrapper), "
        "minhash (datasketch MinHash-LSH; less memory on large sets), auto (minhash from auto_minhash_rows rows)")
    auto_minhash_rows: int = Field(100_000, ge=1, le=MAX_ROWS, description="auto: rows from which MinHash-LSH is used")
    near_ngram: int = Field(3, ge=1, le=1000, description="word n-gram size for near-duplicate detection")
    near_threshold: float = Field(0.7, gt=0, le=1, description="ngram: share of the smaller row's informative "
                                  "n-grams found in the other at which a row is a near duplicate")
    minhash_threshold: float = Field(0.5, gt=0, le=1, description="minhash: estimated Jaccard similarity of the "
                                     "informative n-grams at which a row is a near duplicate")
    num_perm: int = Field(128, ge=16, le=1024, description="minhash: permutations (signature length)")
    boilerplate_frac: float = Field(0.05, gt=0, le=1, description="n-grams in more than this share of the rows "
                                    "(shared instructions, templates) are neither indexed nor scored")
    df_sample: int = Field(20_000, ge=100, le=MAX_ROWS, description="rows (evenly spaced) on which n-gram "
                           "document frequencies are counted for boilerplate_frac")
    max_postings: int = Field(64, ge=1, le=100_000, description="ngram: rows kept per n-gram posting list "
                              "(bounds the candidates per row: linear time)")
    numbers_must_match: bool = Field(True, description="near duplicates must hold the same numbers: problems "
                                     "that differ only in their numbers are different problems")


class Validation(Section):
    """Rows outside these bounds are quarantined with a reason, never silently dropped."""

    min_prompt_chars: int = Field(3, ge=1, le=MAX_CHARS, description="shorter prompts are quarantined")
    max_prompt_chars: int = Field(4000, ge=1, le=MAX_CHARS,
                                  description="longer prompts are quarantined (absurd length)")
    max_answer_chars: int = Field(200, ge=1, le=MAX_CHARS, description="longer gold answers are quarantined")
    max_tests_chars: int = Field(20_000, ge=1, le=MAX_CHARS, description="longer gold tests (task code: the "
                                 "answer is test source) are quarantined")


class CurateEval(Section):
    """The held-out eval split. Training rows are always decontaminated against it."""

    source: SourceSpec | None = Field(
        None, description="where eval problems come from; None = the task generator (task arith or code), "
        "seeded apart from the training draw"
    )
    rows: int = Field(200, ge=1, le=MAX_ROWS,
                      description="eval rows kept (after validation and dedup). Not named `size`: "
                      "DVC's run-cache key drops every key named size or nfiles (dvc_data's Meta fields), so a "
                      "changed `size` param would restore the old outputs")


class Curate(Section):
    """The curate stage: sources -> validated, deduplicated, decontaminated SFT / RL / eval splits."""

    sources: list[SourceSpec] = Field(min_length=1, description="where training problems come from")
    max_quarantined_frac: float = Field(0.5, ge=0, le=1, description="fail the stage when a source (training or "
                                        "eval) has more than this share of its rows quarantined: a wrong format "
                                        "or file, not a few bad rows")
    eval: CurateEval = Field(default_factory=CurateEval)
    sft_size: int = Field(2000, ge=1, le=MAX_ROWS, description="rows set aside, with solutions, as SFT demonstrations")
    dedup: Dedup = Field(default_factory=Dedup)
    decontam: Decontam = Field(default_factory=Decontam)
    validation: Validation = Field(default_factory=Validation)

    @model_validator(mode="after")
    def _rules(self) -> Curate:
        if all(isinstance(s, SyntheticSource) for s in self.sources):  # the row count is known before any work
            rows = sum(s.num_rows for s in self.sources)
            if self.sft_size >= rows:
                raise Refusal("sft_size", f"{self.sft_size} >= the {rows} rows the sources generate: no row would "
                              "be left for RL (duplicates are removed too: keep it well below)")
        return self
