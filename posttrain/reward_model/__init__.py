"""Learned rewards, part 1: Bradley-Terry reward models trained on preference pairs (``stages/reward_model.py``).

- :mod:`~posttrain.reward_model.pairs`: pairs from a preference file or the reward stage's scored rollouts;
  dedup, decontamination against the eval split, the train / held-out split (torch-free).
- :mod:`~posttrain.reward_model.train`: the BT loss, one member's resumable training loop, pairwise statistics.
- :mod:`~posttrain.reward_model.scorer`: the artifact (K members + manifest) and :func:`load_reward_model`, which
  scores a batch of (prompt, completion) texts as a ``[B, K]`` array.
"""

from posttrain.reward_model.pairs import PAIR_SCHEMA, finalize, read_preference_file, rollout_pairs
from posttrain.reward_model.scorer import RewardScorer, encode, load_reward_model
from posttrain.reward_model.train import bt_loss, ensemble_stats, pairwise, train_member

__all__ = ["PAIR_SCHEMA", "RewardScorer", "bt_loss", "encode", "ensemble_stats", "finalize", "load_reward_model",
           "pairwise", "read_preference_file", "rollout_pairs", "train_member"]
