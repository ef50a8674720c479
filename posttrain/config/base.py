"""What every params section shares: the frozen, extra-forbidding base model, the config error, the marker of
fields that change how a run computes but not what it computes, and the registry-name check.

Torch-free by contract (``lint-imports``): validating ``params.yaml`` never imports torch, transformers or
math-verify. Registry names come from :mod:`posttrain.config.names`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A params file that cannot be used. ``str()`` is one line naming the key path."""


class Section(BaseModel):
    """A params section: unknown keys are refused, values are immutable once loaded, and no float is NaN or
    infinite (a bound like ``gt=0`` lets ``inf`` through)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Bounds every section shares. Seeds: numpy and torch take them, and the derived ones (``posttrain.seeds``:
# seed x 1,000,003 + ...) stay far inside int64. Threads: more than a machine has is a typo.
MAX_SEED = 2**31 - 1
MAX_THREADS = 1024
MAX_NEW_TOKENS = 131_072  # the longest contexts of today's models; a completion cannot be longer
MAX_ROWS = 10**8  # rows of a dataset (and prompts drawn from one): 100x the largest open RL sets
MAX_COUNT = 10**9  # steps, and how often something happens in them
MAX_BATCH = 1_048_576  # sequences or prompts in one batch or call
MAX_SAMPLES = 65_536  # samples per prompt (pass@k to k = 65,536)
MAX_CHARS = 10**7  # characters of one prompt or answer
MAX_LR = 1.0  # an AdamW learning rate above 1 is a typo
MAX_TEMPERATURE = 100.0  # sampling temperature: beyond it the distribution is uniform anyway
MAX_COEF = 1000.0  # coefficients of the KL and entropy terms


# Marks a field that changes how a run computes, not what it computes (micro-batching, packing, checkpoint
# cadence, how long to run): resume fingerprints (``checkpoint.fingerprint``) leave it out, so changing it
# between a kill and a resume (the usual out-of-memory fix, or more steps) resumes instead of starting over.
NOT_RESULT: dict[str, Any] = {"fingerprint": False}


def token_budget() -> Any:
    """The ``max_tokens_per_micro_batch`` field sft, rl and distill share (``training.MicroBatch``)."""
    return Field(None, ge=1, le=100_000_000, json_schema_extra=NOT_RESULT,
                 description="also cut micro-batches at this many padded tokens (sequences x the longest): long "
                 "completions get fewer per forward; null: micro_batch_size alone. The loss is the same")


SHOWN = 80  # characters of a rejected value echoed in a one-line message


def shown(value: Any) -> str:
    """``repr(value)``, cut to ``SHOWN`` characters: a one-line message stays one short line."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


def registered(kind: str, name: str, names: Iterable[str]) -> str:
    """Refuse a name no registry knows, listing the valid ones (the registries' tests assert the names match)."""
    if name not in names:
        raise ValueError(f"unknown {kind} {shown(name)}; valid: {sorted(names)}")
    return name



class Refusal(ValueError):
    """A cross-field rule of a section (``model_validator(mode="after")``, so defaults are checked too) refusing
    ``key``; :func:`posttrain.config.params.parse_params` reports it as ``<section>.<key>: ...``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
