"""The Reproductions grid (``experiments/reproduce.py`` runs it): the task difficulty of every run, the knobs
every arm resets to their defaults, and each experiment's arms (``dvc exp run -S`` overrides) and claims."""

from __future__ import annotations

from typing import Any

# The harder task: a of 3..5 digits (the default 2..4 saturates: RL 98.5% greedy); room for the longer chain
DIFFICULTY = {"task.min_digits": 3, "task.max_digits": 5, "rollout.sampling.max_new_tokens": 96,
              "rl.sampling.max_new_tokens": 96, "evaluate.sampling.max_new_tokens": 96,
              "distill.max_new_tokens": 96, "evaluate.samples_per_prompt": 64, "evaluate.ks": "[1,2,4,8,16,32,64]"}
# every knob an arm touches, at its default, so one run's -S never leaks into the next (dvc exp run edits
# the workspace's params.yaml)
DEFAULTS = {"rl.advantage": "grpo", "rl.dynamic_sampling": "skip", "rl.token_select": "all", "rl.token_rho": 0.2,
            "rl.steps": 40, "rl.samples_per_prompt": 8, "rl.kl_coef": 0.0, "rl.ref_reset": "null",
            "rl.entropy_coef": 0.0,
            "rl.prior_budget": 0, "rl.select.strategy": "pass_band", "rl.select.top_k": 1,
            "distill.seed": 0, "distill.teacher": "models/rl", "distill.warmup.steps": 10,
            "distill.on_policy.steps": 30, "distill.grpo_steps": 0}
K256 = {"evaluate.samples_per_prompt": 256, "evaluate.ks": "[1,2,4,8,16,32,64,128,256]"}  # pass@k to 256
SFT_BASE = {"name": "sft", "over": {}, "target": "evaluate@sft", "model": "sft"}

# An experiment: arms (name -> -S overrides; the name is the run's, so an arm two experiments share is one
# run), claims (text, verdict kind, first arm, second arm), and optionally: eval (overrides of base and arms),
# base (the reference run), target/model (what an arm evaluates), seed_key (the knob that seeds an arm).
EXPERIMENTS: dict[str, dict[str, Any]] = {
    "psr_nsr": {
        "paper": "The Surprising Effectiveness of Negative Reinforcement (Zhu et al. 2025)",
        "setting": "Qwen2.5-Math-7B / Qwen3-4B, MATH, pass@k to 256",
        "arms": {"grpo": {}, "psr": {"rl.advantage": "psr", "rl.dynamic_sampling": "off"},
                 "nsr": {"rl.advantage": "nsr", "rl.dynamic_sampling": "off"},
                 "w_reinforce": {"rl.advantage": "w_reinforce", "rl.dynamic_sampling": "off"}},
        "claims": [("NSR >= base (SFT) at every k", "geq_all", "nsr", "base"),
                   ("PSR > base at pass@1", "gt_k1", "psr", "base"),
                   ("PSR < base at the largest k", "lt_kmax", "psr", "base"),
                   ("W-REINFORCE >= GRPO at every k", "geq_all", "w_reinforce", "grpo")],
    },
    "psr_nsr_k256": {  # the same claims to the paper's k = 256 (GRPO's arm shared with prorl)
        "paper": "The Surprising Effectiveness of Negative Reinforcement (Zhu et al. 2025)",
        "setting": "Qwen2.5-Math-7B / Qwen3-4B, MATH, pass@k to 256",
        "eval": K256,
        "base": {"name": "sft_k256", "over": {}, "target": "evaluate@sft", "model": "sft"},
        "arms": {"grpo_k256": {}, "psr_k256": {"rl.advantage": "psr", "rl.dynamic_sampling": "off"},
                 "nsr_k256": {"rl.advantage": "nsr", "rl.dynamic_sampling": "off"}},
        "claims": [("NSR >= base (SFT) at every k to 256", "geq_all", "nsr_k256", "base"),
                   ("PSR < base at k = 256", "lt_kmax", "psr_k256", "base"),
                   ("NSR > PSR at k = 256", "gt_kmax", "nsr_k256", "psr_k256")],
    },
    "entropy": {
        "paper": "Beyond the 80/20 Rule: High-Entropy Minority Tokens (Wang et al. 2025)",
        "setting": "Qwen3-8B/14B/32B base, DAPO, AIME",
        "arms": {"grpo": {}, "top20": {"rl.token_select": "top_entropy", "rl.token_rho": 0.2},
                 "bottom80": {"rl.token_select": "bottom_entropy", "rl.token_rho": 0.2}},
        "claims": [("top-20% entropy tokens ~ all tokens (pass@1)", "approx_k1", "top20", "grpo"),
                   ("top-20% > bottom-80% (pass@1)", "gt_k1", "top20", "bottom80")],
    },
    "one_shot": {
        "paper": "Reinforcement Learning for Reasoning with One Training Example (Wang et al. 2025)",
        "setting": "Qwen2.5-Math-1.5B, 1 example vs the 1.2k DeepScaleR subset, MATH500",
        "arms": {"grpo": {},
                 "one_shot": {"rl.select.strategy": "top_variance", "rl.select.top_k": 1, "rl.entropy_coef": 0.001},
                 "one_shot_noent": {"rl.select.strategy": "top_variance", "rl.select.top_k": 1}},
        "claims": [("1-shot RLVR recovers >= 80% of the full-data gain over base (pass@1)", "share80", "one_shot",
                    "grpo"),
                   ("the entropy bonus helps 1-shot RLVR (pass@1)", "gt_k1", "one_shot", "one_shot_noent")],
    },
    "prior": {
        "paper": "V0.5 / Reinforce-Ada: prior-fused baseline, adaptive rollout budget",
        "setting": "stable at group size 4 (accuracy vs samples spent)",
        "arms": {"grpo": {}, "grpo_g4": {"rl.samples_per_prompt": 4},
                 "prior_g4": {"rl.samples_per_prompt": 4, "rl.advantage": "prior_fused", "rl.dynamic_sampling": "off",
                              "rl.prior_budget": 16}},
        "claims": [("prior-fused G=4 > GRPO G=4 (pass@1)", "gt_k1", "prior_g4", "grpo_g4"),
                   ("prior-fused G=4 ~ GRPO G=8 (pass@1)", "approx_k1", "prior_g4", "grpo")],
    },
    "prorl": {
        "paper": "ProRL (Liu et al. 2025) vs the pass@k crossover (Yue et al. 2025)",
        "setting": "DeepSeek-R1-Distill-Qwen-1.5B, 2k+ steps, KL + reference resets, pass@k to 256",
        "eval": K256,
        "base": {"name": "sft_k256", "over": {}, "target": "evaluate@sft", "model": "sft"},
        "arms": {"grpo_k256": {},
                 "grpo120_k256": {"rl.steps": 120},
                 "prorl120_k256": {"rl.steps": 120, "rl.kl_coef": 0.04,
                                   "rl.ref_reset": "{every: 40, optimizer: true}"}},
        "claims": [("GRPO (40 steps) < base at k = 256 (the crossover)", "lt_kmax", "grpo_k256", "base"),
                   ("GRPO (120 steps) < base at k = 256", "lt_kmax", "grpo120_k256", "base"),
                   ("ProRL (120 steps, KL + resets) >= base at every k to 256", "geq_all", "prorl120_k256", "base"),
                   ("ProRL > GRPO at equal steps (120), k = 256", "gt_kmax", "prorl120_k256", "grpo120_k256")],
    },
    "distill": {
        "paper": "Beyond GRPO and On-Policy Distillation (sparse-to-dense)",
        "setting": "RL the strongest model, then distil it into the deployment student",
        "base": {"name": "student_sft", "over": {"rl.seed": 1}, "target": "evaluate@student_sft",
                 "model": "student_sft"},
        "target": "evaluate@student", "model": "student", "seed_key": "distill.seed",
        "common": {"rl.seed": 1},  # the teacher: GRPO seed 1 (models/rl, from DVC's run-cache)
        "arms": {"bridge": {},
                 "direct_grpo": {"distill.warmup.steps": 0, "distill.on_policy.steps": 0, "distill.grpo_steps": 40},
                 "sft_teacher": {"distill.teacher": "models/sft"}},
        "claims": [("bridge from the RL teacher > direct GRPO on the student (pass@1)", "gt_k1", "bridge",
                    "direct_grpo"),
                   ("bridge from the RL teacher > bridge from the SFT teacher (pass@1)", "gt_k1", "bridge",
                    "sft_teacher"),
                   ("bridge > the student's cold start (pass@1)", "gt_k1", "bridge", "base")],
    },
}
