"""Rewards: the ``REWARDS`` registry and plug-ins, scoring (in-process or in a pool with a timeout), pass rates.

- ``builtin``: the built-in reward functions (``REWARDS``: ``correct``, ``math_verify``, ``format``,
  ``overlong``, ``code_tests``, ``reward_model``) and ``per_sample``; ``sample``: ``Sample`` and ``Scored``.
- ``learned``: the ``reward_model`` reward (a trained reward model, loaded once per process); ``ensemble``: its
  math (mean / WCO / UWO over members, Clip / Delta over steps); ``audit_learned``: the reward audit's section on
  learned rewards (agreement with the verifier, quantiles, hacks).
- ``scoring``: ``combine`` (the one call site of a reward function), ``score_rows`` (the one scoring path of
  the reward stage and every RL step), ``is_correct``, ``pass_rates``.
- ``pool``: ``RewardPool``, worker processes scoring chunks of samples with a per-sample timeout
  (``reward.workers``, ``reward.timeout_s``).

A reward is ``fn(samples: Sequence[Sample], **kwargs) -> Sequence[float | Scored | None]`` (one value per sample;
``per_sample`` makes one of a one-sample function), a module-level function (picklable): a key of
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
    per_sample,
)
from posttrain.rewards.pool import RewardPool
from posttrain.rewards.scoring import (
    ERROR_KEY,
    WHY_KEY,
    Spec,
    combine,
    is_correct,
    is_learned,
    pass_rates,
    resolve,
    sample_of,
    score_rows,
    specs_of,
)

__all__ = ["ERROR_KEY", "REWARDS", "WHY_KEY", "RewardPool", "Sample", "Scored", "Spec", "code_tests", "combine",
           "correct", "format_reward", "is_correct", "is_learned", "math_verify", "overlong", "pass_rates",
           "per_sample", "resolve", "sample_of", "score_rows", "specs_of"]
