"""What every params section shares: the frozen, extra-forbidding base model, the config error, the marker of
fields that change how a run computes but not what it computes, and the registry-name check.

Torch-free by contract (``lint-imports``): validating ``params.yaml`` never imports torch, transformers or
math-verify. Registry names come from :mod:`posttrain.config.names`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A params file that cannot be used. ``str()`` is one line naming the key path."""


class Section(BaseModel):
    """A params section: unknown keys are refused, values are immutable once loaded."""

    model_config = ConfigDict(extra="forbid", frozen=True)


# Marks a field that changes how a run computes, not what it computes (micro-batching, packing, checkpoint
# cadence, how long to run): resume fingerprints (``checkpoint.fingerprint``) leave it out, so changing it
# between a kill and a resume (the usual out-of-memory fix, or more steps) resumes instead of starting over.
NOT_RESULT: dict[str, Any] = {"fingerprint": False}


def registered(kind: str, name: str, names: Iterable[str]) -> str:
    """Refuse a name no registry knows, listing the valid ones (the registries' tests assert the names match)."""
    if name not in names:
        raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(names)}")
    return name



class Refusal(ValueError):
    """A cross-field rule of a section (``model_validator(mode="after")``, so defaults are checked too) refusing
    ``key``; :func:`posttrain.config.params.parse_params` reports it as ``<section>.<key>: ...``."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
