"""What a reward sees of one completion (``Sample``) and what it may return with a reason (``Scored``): torch-free,
imported by the built-in rewards (``builtin``) and the learned ones (``learned``) alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class Sample:
    """What a reward sees of one completion."""

    completion: str
    answer: str  # gold
    task: str  # key of posttrain.tasks.TASKS
    num_tokens: int
    max_new_tokens: int
    finish_reason: str = "stop"
    prompt: str = ""  # (the code task runs prompt + completion)


class Scored(NamedTuple):
    """A reward's value with why it is not full marks (``combine`` keeps it under ``"why"``; the audit counts
    it): a reward may return this instead of a bare number."""

    value: float | None
    why: str | None
