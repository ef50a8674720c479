"""``evaluate:`` (one evaluate@<name> stage per model) and ``report:`` (every model side by side)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from posttrain.config import names
from posttrain.config.base import MAX_BATCH, MAX_ROWS, MAX_SAMPLES, Refusal, Section
from posttrain.config.curate import BenchmarkSpec
from posttrain.config.rollout import Sampling


class Evaluate(Section):
    """One evaluate@<name> stage per model: greedy accuracy, sampled pass@k and maj@k, with intervals."""

    models: dict[str, Annotated[str, Field(min_length=1)]] = Field(
        min_length=1,
        description="name -> checkpoint path, each evaluated by its own DVC stage evaluate@<name> (a dep: so an "
        "experiment re-evaluates only the models whose inputs changed) and shown side by side in this order by "
        "the report stage. `python -m stages.evaluate --model NAME` also takes a hub id; dvc repro needs paths",
    )
    backend: Literal[names.BACKENDS] = Field("hf", description="rollout backend used for generation")
    samples_per_prompt: int = Field(8, ge=1, le=MAX_SAMPLES, description="samples per prompt for pass@k / maj@k")
    ks: list[int] = Field(default_factory=lambda: [1, 4, 8], min_length=1,
                          description="k values for pass@k and maj@k")
    sampling: Sampling = Field(default_factory=Sampling, description="sampled decoding (greedy is always run)")
    generate_batch_size: int = Field(256, ge=1, le=MAX_BATCH, description="sequences per generate() call")
    limit: int | None = Field(None, ge=1, le=MAX_ROWS, description="evaluate at most this many prompts per split")
    sample_prompts: int | None = Field(None, ge=1, le=MAX_ROWS,
                                       description="sampled metrics (pass@k, maj@k) on the first N "
                                       "prompts of each split only (greedy runs on all); None = all")
    benchmarks: list[BenchmarkSpec] = Field(default_factory=list, description="extra benchmark files/hub sets")
    max_unusable_frac: float = Field(0.5, ge=0, le=1, description="fail the stage when a benchmark has no usable "
                                     "row or drops more than this share of its rows (a wrong format or file)")
    bootstrap: int = Field(1000, ge=10, le=1_000_000, description="bootstrap resamples for 95% intervals")

    def metric_names(self) -> set[str]:
        """The numbers each split of an evaluate@<name> summary holds (``stages/evaluate.py``; a test holds the two
        equal): what ``tracking.champion`` may name."""
        return {"n", "n_sampled", "unscorable", "greedy", "greedy_len", "len", "truncated", "guarded", "seconds",
                "pass@1",
                *(f"{m}@{k}" for m in ("pass", "maj") for k in self.ks)}

    def split_names(self) -> list[str]:
        """The summary's splits: the held-out ``eval`` split and each benchmark by name."""
        return ["eval", *(b.name for b in self.benchmarks)]

    @model_validator(mode="after")
    def _rules(self) -> Evaluate:
        bad = [k for k in self.ks if k < 1 or k > self.samples_per_prompt]
        if bad:
            raise Refusal("ks", f"every k must be in [1, samples_per_prompt={self.samples_per_prompt}], got {bad}")
        return self


class Report(Section):
    """The side-by-side report over every evaluate@<name> stage's results (stages/report.py)."""

    compare: list[tuple[str, str]] = Field(default_factory=list, description="model pairs (names of "
                                           "evaluate.models) given paired differences and checked for a pass@k "
                                           "crossing (e.g. [sft, rl])")
