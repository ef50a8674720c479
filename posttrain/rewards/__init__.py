"""Rewards: the ``REWARDS`` registry and plug-ins, scoring (in-process or in a pool with a timeout), pass rates.

- ``builtin``: ``Sample`` and the built-in reward functions (``REWARDS``: ``correct``, ``math_verify``,
  ``format``, ``overlong``, ``code_tests``, ``tool_cost``).
- ``scoring``: ``combine`` (the one call site of a reward function), ``score_rows`` (the one scoring path of
  the reward stage and every RL step), ``is_correct``, ``pass_rates``.
- ``pool``: ``RewardPool``, worker processes with a per-sample timeout (``reward.workers``, ``reward.timeout_s``).

A reward is ``fn(sample: Sample, **kwargs) -> float | None``, a module-level function (picklable): a key of
``REWARDS``, or any importable ``package.module:function`` named in ``reward.rewards[].name`` (checked at load,
``posttrain.config.plugins``). ``None`` means unscorable: counted, kept out of the update, never a free reward.
"""

from posttrain.rewards.builtin import (
    REWARDS,
    Sample,
    Scored,
    code_tests,
    correct,
    format_reward,
    math_verify,
    overlong,
    tool_cost,
)
from posttrain.rewards.pool import RewardPool
from posttrain.rewards.scoring import (
    ERROR_KEY,
    WHY_KEY,
    Spec,
    combine,
    is_correct,
    pass_rates,
    resolve,
    sample_of,
    score_rows,
    specs_of,
)

__all__ = ["ERROR_KEY", "REWARDS", "WHY_KEY", "RewardPool", "Sample", "Scored", "Spec", "code_tests", "combine",
           "correct", "format_reward", "is_correct", "math_verify", "overlong", "pass_rates", "resolve", "sample_of",
           "score_rows", "specs_of", "tool_cost"]
