"""``rl:``: the online GRPO-family loop (rollout -> reward -> update): prompt selection, sampling, the
advantage / policy-loss / token-selection registries by name, KL placement, dynamic sampling, the update's
batching and checkpoints. Cross-field rules live in ``Rl._rules`` (one ``model_validator(mode="after")``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config import names
from posttrain.config.base import (
    MAX_BATCH,
    MAX_COEF,
    MAX_COUNT,
    MAX_LR,
    MAX_ROWS,
    MAX_SAMPLES,
    MAX_SEED,
    MAX_THREADS,
    NOT_RESULT,
    Refusal,
    Section,
    registered,
    token_budget,
)
from posttrain.config.correction import CorrectionSpec, legacy_tis
from posttrain.config.rollout import Sampling


class RlSampling(Sampling):
    """Sampling inside the RL loop. The trainer scores ``logits / temperature`` (the distribution sampled
    from), so the on-policy ratio is exactly 1; it cannot score a top-p-truncated distribution."""

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("RL needs temperature > 0: greedy decoding gives every group identical samples, "
                             "so every group has zero reward variance and no advantage")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if v < 1:
            raise ValueError("the trainer cannot score the top-p-truncated distribution the sampler would draw "
                             "from (ratios and KL would be of another policy); use top_p: 1.0 for rl")
        return v


# Estimators whose papers place the KL or the baseline differently from GRPO (the combinations are refused).
KL_IN_REWARD = {"reinforce_pp": "Hu 2025, REINFORCE++", "rloo": "Ahmadian et al. 2024, RLOO"}
BATCH_BASELINE = {"reinforce_pp": "Hu 2025, REINFORCE++: a global batch mean and std",
                  "psr": "Zhu et al. 2025: no baseline, every correct sample reinforced",
                  "nsr": "Zhu et al. 2025: no baseline, every wrong sample pushed down",
                  "w_reinforce": "Zhu et al. 2025: no baseline, rewards {+0.1, -1}"}


class RlSelect(Section):
    """Prompt selection from the reward stage's pass rates (of the SFT policy)."""

    strategy: str = Field("pass_band", description="a key of posttrain.rl.select.PROMPT_SELECTIONS: pass_band keeps "
                          "every prompt in [min_pass_rate, max_pass_rate]; top_variance keeps the top_k of those by "
                          "reward variance p(1 - p) (1-shot RLVR); all keeps the whole train split, measured or not")
    min_pass_rate: float = Field(0.01, ge=0, le=1, description="drop prompts solved less often (never solved)")
    max_pass_rate: float = Field(0.99, ge=0, le=1, description="drop prompts solved more often (always solved)")
    top_k: int = Field(1, ge=1, le=MAX_ROWS, description="prompts kept by top_variance (1: 1-shot RLVR)")

    @model_validator(mode="after")
    def _band(self) -> RlSelect:
        if self.min_pass_rate > self.max_pass_rate:
            raise Refusal("max_pass_rate", f"{self.max_pass_rate} < min_pass_rate {self.min_pass_rate}: the pass "
                          "band is empty, so no prompt could ever be selected")
        return self

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        return registered("prompt selection", v, names.PROMPT_SELECTIONS)


class RefReset(Section):
    """ProRL's reference resets (Liu et al. 2025): the KL anchor moves to the current policy periodically."""

    every: int = Field(ge=1, le=MAX_COUNT,
                       description="after every N-th step the reference becomes a copy of the policy")
    optimizer: bool = Field(False, description="also clear the optimizer's state (Adam moments) at each reset")


class RlOverlap(Section):
    """Asynchronous RL (``posttrain.rl.overlap``): generator processes sample and score steps ahead with weights
    up to ``max_staleness`` versions old while the trainer updates; a version is the number of updates applied."""

    max_staleness: int = Field(0, ge=0, le=64, description="k: step s trains on samples generated with weights of "
                               "version >= s - k (version = updates applied); 0: each step waits for its own "
                               "weights (the synchronous loop's samples, generated in another process)")
    generators: int = Field(1, ge=1, le=64, description="generator processes (rollout.backend: hf, or one vLLM "
                            "engine each), each sampling and scoring whole steps (step s goes to generator s mod N)")
    generator_threads: int = Field(1, ge=1, le=MAX_THREADS, description="torch threads of each generator process",
                                   json_schema_extra=NOT_RESULT)
    trainer_threads: int = Field(1, ge=1, le=MAX_THREADS, description="torch threads of the trainer (replaces "
                                 "runtime.train_threads under rl.overlap)", json_schema_extra=NOT_RESULT)


# Why each technique that cannot run ahead of the trainer is refused under rl.overlap (Rl._rules).
OVERLAP_REFUSED = {
    "dynamic_sampling": "refill draws step s's extra prompts from the cursor after step s's rewards, so step s+1's "
                        "prompts are unknown until step s is scored and no generator can run ahead; use skip or off",
    "prior_budget": "the adaptive budget reads and refreshes the per-prompt priors the trainer updates every step; "
                    "a generator k versions ahead would read priors k steps old and race the trainer's updates; "
                    "set rl.prior_budget: 0 (advantage prior_fused itself works: the trainer computes it)",
}


class Rl(Section):
    """The rl stage (and distill's phase C, which trains the student with this section's algorithm)."""

    steps: int = Field(40, ge=1, le=MAX_COUNT,
                       description="rollout -> reward -> update rounds. How long to run, not what a step "
                       "computes (the learning rate is constant, seeds are per step): a killed run resumed with more "
                       "steps continues", json_schema_extra=NOT_RESULT)
    seed: int = Field(0, ge=0, le=MAX_SEED,
                      description="added to the pipeline seed for RL's sampling and prompt order: "
                      "several seeds of an RL arm on the same curate/sft outputs (the pipeline seed re-runs all)")
    prompts_per_step: int = Field(16, ge=1, le=MAX_BATCH, description="B: prompts per round")
    samples_per_prompt: int = Field(8, ge=2, le=MAX_SAMPLES, description="G: samples per prompt (the group)")
    sampling: RlSampling = Field(default_factory=RlSampling, description="temperature > 0 and top_p 1: the "
                                 "trainer scores logits / temperature, the distribution sampled from")
    generate_batch_size: int = Field(256, ge=1, le=MAX_BATCH,
                                     description="sequences per generate() call (part of the result: "
                                     "each chunk of prompts is seeded by its index)")
    lr: float = Field(3e-5, gt=0, le=MAX_LR,
                      description="AdamW learning rate (constant); tiny models collapse at >= 1e-4")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay")
    max_grad_norm: float = Field(1.0, gt=0, le=1e6, description="clip the global gradient norm to this")
    advantage: str = Field("grpo", description="a key of posttrain.algos.ADVANTAGES")
    policy_loss: str = Field("ppo_clip", description="a key of posttrain.algos.POLICY_LOSSES")
    loss_agg: Literal[names.AGGREGATIONS] = Field(
        "token-mean", description="how per-token losses reduce to a scalar (separate from the loss)")
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="ratio clip below 1")
    clip_eps_high: float = Field(0.28, ge=0, le=10, description="ratio clip above 1 (DAPO clip-higher)")
    dual_clip: float | None = Field(None, gt=1, le=1e6, description="dual-clip constant c for negative advantages")
    kl_coef: float = Field(0.0, ge=0, le=MAX_COEF, description="KL *loss* to the frozen SFT reference, estimator "
                           "kl_estimator (GRPO's placement); 0 = no KL loss")
    kl_estimator: Literal[names.KL_ESTIMATORS] = Field(
        "k3", description="per-token KL loss term (posttrain.algos.KL_ESTIMATORS): k3 = GRPO's (its gradient is "
        "that of KL(ref || pi)); k2 = (logp - ref)^2 / 2 (its gradient is that of KL(pi || ref))")
    kl_reward_coef: float = Field(0.0, ge=0, le=MAX_COEF,
                                  description="KL *in the reward* (RLOO, REINFORCE++): each sample's "
                                  "reward minus coef * sum over its tokens of (sampler logp - ref logp), before "
                                  "advantages; 0 = off. With kl_coef and this both 0 the reference is never loaded")
    entropy_coef: float = Field(0.0, ge=0, le=MAX_COEF, description="entropy bonus coefficient")
    prior_budget: int = Field(0, ge=0, le=MAX_BATCH, description="adaptive rollout budget (V0.5 / Reinforce-Ada) with "
                              "advantage prior_fused: extra samples per step, G at a time, for prompts whose "
                              "prior their group rejects; they refresh the prior and are not trained on")
    token_select: str = Field("all", description="a key of posttrain.algos.TOKEN_SELECTIONS: which completion "
                              "tokens carry the policy gradient (top_entropy: the top token_rho share of the step's "
                              "tokens by the sampling policy's entropy; bottom_entropy: the rest)")
    token_rho: float = Field(0.2, gt=0, le=1, description="the share top_entropy keeps (0.2 in the paper)")
    ref_reset: RefReset | None = Field(None, description="ProRL: reset the KL reference to the current policy "
                                       "every N steps (needs kl_coef or kl_reward_coef > 0); null = never")
    correction: CorrectionSpec | None = Field(
        None, description="an off-policy correction of the policy-gradient term by pi_trainer / pi_sampler (for a "
        "sampler whose log-probs differ from the trainer's, e.g. vLLM): {name, kwargs}, name a key of "
        "posttrain.corrections.CORRECTIONS; null = off. rl.tis: {mode, cap} is read as {name: tis_<mode>, kwargs: "
        "{cap}}. The mean |trainer - sampler| log-prob gap and the capped and masked token shares are logged every "
        "step")
    epochs: int = Field(1, ge=1, le=1000, description="passes over each rollout batch")
    minibatches: int = Field(1, ge=1, le=MAX_BATCH,
                             description="optimizer steps per pass (old log-probs are recomputed "
                             "when epochs * minibatches > 1; otherwise the update is exactly on-policy)")
    micro_batch_size: int = Field(64, ge=1, le=MAX_BATCH,
                                  description="sequences per forward/backward (gradient accumulation)",
                                  json_schema_extra=NOT_RESULT)
    max_tokens_per_micro_batch: int | None = token_budget()
    pack: bool = Field(False, description="pack each micro-batch's sequences into rows of twice the longest "
                       "(block-diagonal attention via position ids) instead of padding them: the same loss and "
                       "gradient over fewer tokens; pays off when lengths vary widely (docs: Performance)",
                       json_schema_extra=NOT_RESULT)
    dynamic_sampling: Literal["off", "skip", "refill"] = Field(
        "skip", description="DAPO: groups whose rewards are all equal carry no signal: off = keep them, skip = "
        "drop them from the update, refill = sample more prompts until the batch is full (or max_refill_rounds)")
    max_refill_rounds: int = Field(2, ge=0, le=100, description="extra sampling rounds per step with refill")
    max_idle_steps: int = Field(5, ge=1, le=MAX_COUNT,
                                description="stop the stage with an error after this many steps in a "
                                "row with nothing to update (every group skipped or unscorable); each is warned",
                                json_schema_extra=NOT_RESULT)
    select: RlSelect = Field(default_factory=RlSelect)
    overlap: RlOverlap | None = Field(None, description="asynchronous RL: generation in separate processes, up to "
                                      "max_staleness versions behind the trainer (docs/rl.md); null = the "
                                      "synchronous loop in one process")
    shard_tokens: bool = Field(True, description="store each sample's token ids and sampler log-probs in its step's "
                               "shard (data/rl/shards): what replays an update exactly and audits it; 63% of the "
                               "shards' bytes on the default run (784 -> 293 KB without); false at scale (10^6 "
                               "samples x 8k tokens is terabytes): the text, num_tokens, rewards and advantages kept")
    checkpoint_every: int = Field(10, ge=1, le=MAX_COUNT, description="resumable checkpoint every N steps",
                                  json_schema_extra=NOT_RESULT)
    save_steps: list[int] = Field(default_factory=list, description="also save HF checkpoints of these steps "
                                  "(under paths.rl_dir/checkpoints/step_N) for evaluation",
                                  json_schema_extra=NOT_RESULT)

    @model_validator(mode="before")
    @classmethod
    def _legacy_tis(cls, data: Any) -> Any:
        """``rl.tis: {mode, cap}``, the older spelling, becomes ``rl.correction`` before validation."""
        return legacy_tis(data)

    @field_validator("advantage")
    @classmethod
    def _adv(cls, v: str) -> str:
        return registered("advantage", v, names.ADVANTAGES)

    @field_validator("policy_loss")
    @classmethod
    def _loss(cls, v: str) -> str:
        return registered("policy_loss", v, names.POLICY_LOSSES)

    @field_validator("token_select")
    @classmethod
    def _token_select(cls, v: str) -> str:
        return registered("token selection", v, names.TOKEN_SELECTIONS)

    @model_validator(mode="after")
    def _rules(self) -> Rl:
        """Combinations that would silently do the wrong thing. After validation, so a field left at its
        default is checked like a written one (``advantage: psr`` with ``dynamic_sampling`` left at ``skip``)."""
        adv = self.advantage
        if self.kl_coef > 0 and adv in KL_IN_REWARD:
            raise Refusal("kl_coef", f"{adv} puts the KL in the reward ({KL_IN_REWARD[adv]}), not in the loss: set "
                          "rl.kl_reward_coef instead and rl.kl_coef: 0")
        if self.prior_budget and adv != "prior_fused":
            raise Refusal("prior_budget", "extra samples refresh the priors of advantage prior_fused; set "
                          "rl.advantage: prior_fused or rl.prior_budget: 0")
        if self.ref_reset is not None and not (self.kl_coef or self.kl_reward_coef):
            raise Refusal("ref_reset", "a reference reset needs a reference: set rl.kl_coef or rl.kl_reward_coef > 0")
        late = [s for s in self.save_steps if not 1 <= s <= self.steps]
        if late:
            raise Refusal("save_steps", f"{late} outside 1..rl.steps ({self.steps}): they would never be saved")
        if self.dynamic_sampling != "off" and adv in BATCH_BASELINE:
            raise Refusal("dynamic_sampling", f"{adv} has no per-group baseline ({BATCH_BASELINE[adv]}): a group "
                          "whose rewards are all equal still carries signal, so skipping it changes the estimator; "
                          "set rl.dynamic_sampling: off")
        if self.overlap is not None and self.overlap.max_staleness > 0 and self.correction is None:
            raise Refusal("overlap.max_staleness", f"{self.overlap.max_staleness} with no rl.correction: with one "
                          "optimizer step per batch the PPO ratio is exactly 1, the clip never acts, and samples "
                          "from weights up to k versions old would be trained as on-policy; set rl.correction "
                          "(e.g. {name: icepop} or {name: tis_token, kwargs: {cap: 2.0}}) or max_staleness: 0")
        if self.overlap is not None:
            for key, bad in (("dynamic_sampling", self.dynamic_sampling == "refill"),
                             ("prior_budget", self.prior_budget > 0)):
                if bad:
                    raise Refusal(key, f"{getattr(self, key)!r} with rl.overlap: {OVERLAP_REFUSED[key]}")
        return self
