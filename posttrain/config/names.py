"""The names each registry answers to, as torch-free tuples: what ``params.yaml`` may name.

The registries themselves (``posttrain.algos``, ``posttrain.rewards``, ``posttrain.rl.select``,
``posttrain.rollout``) import torch, transformers or math-verify; validating a params file must not, so the
config checks names against these tuples and ``tests/test_config.py`` asserts each tuple equals its registry's
keys (a registry that gains a function without its name here fails that test, not a user's run).
"""

from __future__ import annotations

REWARDS = ("correct", "math_verify", "format", "overlong", "code_tests", "reward_model",
           "llm_judge", "tool_cost")  # posttrain.rewards.REWARDS
LEARNED_REWARDS = ("reward_model", "llm_judge")  # rewards a model gives (not a verifier): the audit's learned section
RM_COMBINES = ("mean", "wco", "uwo", "uwo_std")  # posttrain.rewards.ensemble.COMBINES
RM_STEPS = ("off", "raw", "clip", "delta")  # off, or a key of posttrain.rewards.ensemble.STEP_TRANSFORMS
JUDGE_VERDICTS = ("score", "binary")  # posttrain.judge.verdict.VERDICTS
TASKS = ("arith", "code", "math")  # posttrain.tasks.TASKS
GENERATED_TASKS = ("arith", "code")  # tasks with a generator (a synthetic source; the default eval split)
FORMATS = ("gsm8k", "math", "generic", "humaneval")  # posttrain.sources.ADAPTERS: row formats of files and hub sets
ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "grpo_batch_std", "psr", "nsr", "w_reinforce",
              "prior_fused")  # posttrain.algos.ADVANTAGES
POLICY_LOSSES = ("ppo_clip", "vanilla_pg")  # posttrain.algos.POLICY_LOSSES
TOKEN_SELECTIONS = ("all", "top_entropy", "bottom_entropy")  # posttrain.algos.TOKEN_SELECTIONS
PROMPT_SELECTIONS = ("pass_band", "top_variance", "all")  # posttrain.rl.select.PROMPT_SELECTIONS
KL_ESTIMATORS = ("k2", "k3")  # posttrain.algos.KL_ESTIMATORS
CORRECTIONS = ("tis_token", "tis_sequence", "mis_token", "mis_sequence", "icepop")  # posttrain.corrections.CORRECTIONS
TIS = ("token", "sequence")  # rl.tis.mode, the older spelling of rl.correction: tis_<mode>
DIVERGENCES = ("reverse_kl", "forward_kl", "jsd")  # posttrain.divergences.DIVERGENCES
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # posttrain.algos.AGGREGATIONS
BACKENDS = ("hf", "vllm")  # posttrain.rollout.BACKENDS
TOOLS = ("python", "calc")  # posttrain.tools.TOOLS
TOOL_FORMATS = ("tag", "qwen")  # posttrain.tools.formats.FORMATS
PARALLEL_TOOL_FORMATS = ("qwen",)  # the formats with Format.parse_all (tools.parallel_calls)
TOOL_DEMOS = {"arith": "calc"}  # task -> the tool its SFT tool demos call (posttrain.tasks.TASKS[kind].tool_call)
DEDUP_METHODS = ("ngram", "minhash")  # posttrain.dedup.METHODS (params may also say "auto")

# DAG order, as in dvc.yaml; evaluate runs once per model (evaluate@<name>, a foreach stage), reward_model once
# per reward model (reward_model@<name>; none by default)
STAGES = ("model", "curate", "sft", "rollout", "reward", "reward_model", "rl", "distill", "evaluate", "report")

# Keys renamed so that one concept has one name; the old key is refused naming the new one.
RENAMED = {
    "rollout.batch_size": "rollout.generate_batch_size",
    "evaluate.batch_size": "evaluate.generate_batch_size",
    "rollout.group_size": "rollout.samples_per_prompt",
    "rl.group_size": "rl.samples_per_prompt",
    "evaluate.num_samples": "evaluate.samples_per_prompt",
}
