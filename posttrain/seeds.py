"""Every derived seed of the pipeline, named once.

One pipeline ``seed`` (plus ``rl.seed`` / ``distill.seed`` for seeds of an arm) reaches every random choice
through these functions, so two places can never derive the same seed by accident, and the constants (primes,
far apart) are written once. Changing any of them changes every result downstream: the default pipeline's
outputs are pinned by ``dvc.lock``.
"""

from __future__ import annotations

PRIME = 7919  # spreads small indices (chunks, ranks' torch seeds, the eval draw) far apart
RANK_STRIDE = 1_000_033  # sampling seeds of different ranks never meet
STEP_STRIDE = 1_000_003  # an arm's seed times this, plus the step: the arms' step seeds never meet


def chunk(seed: int, c: int) -> int:
    """Generation chunk ``c`` of one ``sample_rows`` call."""
    return seed + PRIME * c


def rank(seed: int, r: int) -> int:
    """The sampling seed of rank ``r`` (each rank samples its own share of a step's prompts)."""
    return seed + RANK_STRIDE * r


def process(seed: int, r: int) -> int:
    """Torch's global seed in rank ``r``'s process (dropout-like randomness differs per rank)."""
    return seed + PRIME * r


def eval_draw(seed: int) -> int:
    """The generator draw of the held-out eval split, apart from the training draw."""
    return seed + PRIME


def rl_step(arm: int, step: int) -> int:
    """Seed of RL step ``step`` (its sampling rounds and minibatch order); ``arm`` = seed + rl.seed."""
    return arm * STEP_STRIDE + step * 1009


def refill_round(step_seed: int, k: int) -> int:
    """Sampling round ``k`` of one step (0: the step's batch; 1...: dynamic sampling's refills)."""
    return step_seed + 17 * k


def prior_round(step_seed: int, k: int) -> int:
    """The adaptive prior budget's extra samples after round ``k``."""
    return refill_round(step_seed, k) + 5


def distill_step(arm: int, step: int) -> int:
    """Seed of distillation step ``step`` (phases A-C); ``arm`` = seed + distill.seed."""
    return arm * STEP_STRIDE + 7 * step + 3


def distill_cursor(arm: int) -> int:
    """The distillation prompt order."""
    return arm + 2


def student_init(seed: int) -> int:
    """A fresh student's initial weights (apart from the base model's, built from ``seed``)."""
    return seed + 1


def sft_format(seed: int, step: int) -> list[int]:
    """The generator key of SFT step ``step``'s chain-of-thought / bare-answer draws."""
    return [seed, STEP_STRIDE, step]


def request(seed: int, i: int) -> int:
    """Request ``i`` of one vLLM ``generate`` call (one prompt). vLLM seeds sample ``j`` of a request with
    ``seed + j``, so requests are hashed 63 bits apart: no two requests' sample streams meet by chance."""
    import numpy as np

    return int(np.random.SeedSequence([seed, i]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def tool_turn(sampling_seed: int, k: int) -> int:
    """Turn ``k`` >= 1 of a multi-turn tool rollout (turn 0 is the call's own ``sampling_seed``)."""
    return sampling_seed + 31 * k + 11
