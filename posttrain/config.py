"""Typed models of ``params.yaml``.

Every section of ``params.yaml`` is a pydantic model with ``extra="forbid"``: an unknown key, a wrong
type, an out-of-range value or a missing input file fails in :func:`load_params` before any work,
with a :class:`ConfigError` whose message names the key path (``sft.lr: ...``). Stage ``main()``
functions and the CLI turn that error into one line on stderr and exit code 2.

Every field is documented where it is declared; ``params.yaml`` carries the values.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

EXIT_CONFIG_ERROR = 2


class ConfigError(ValueError):
    """A params file that cannot be used. ``str()`` is one line naming the key path."""


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# Marks a field that changes how a run computes, not what it computes (micro-batching, packing, checkpoint
# cadence): resume fingerprints (``training.fingerprint``) leave it out, so changing it between a kill and a
# resume (the usual out-of-memory fix) resumes instead of starting over.
NOT_RESULT: dict[str, Any] = {"fingerprint": False}


# --------------------------------------------------------------------------------------------- paths
class Paths(_Model):
    """Every file and folder the pipeline reads or writes. ``dvc.yaml`` reads these through ``${paths.*}``."""

    curated_dir: str = Field(description="curate outputs: train.parquet, sft.parquet, eval.parquet, quarantine")
    curate_report_dir: str = Field(description="decontamination report (JSON + Markdown)")
    base_model: str = Field(description="the starting checkpoint, saved by sft (HF folder)")
    sft_model: str = Field(description="the cold-start SFT checkpoint (HF folder)")
    sft_checkpoints: str = Field(description="resumable sft checkpoints; NOT a DVC out, so a re-run finds them")
    sft_report_dir: str = Field(description="sft training log (CSV for dvc plots)")
    rollout_dir: str = Field(description="rollout stage: rollouts.parquet (G samples per prompt, SFT policy)")
    reward_dir: str = Field(description="reward stage: scored.parquet, pass_rates.parquet")
    reward_report_dir: str = Field(description="reward audit (JSON + Markdown)")
    rl_model: str = Field(description="the RL policy (HF folder)")
    rl_dir: str = Field(description="rl stage data: per-step rollout shards, the selected prompts")
    rl_checkpoints: str = Field(description="resumable rl checkpoints + in-flight shards; NOT a DVC out")
    rl_report_dir: str = Field(description="rl training log (CSV for dvc plots)")
    student_sft_model: str = Field(description="the student after its cold start (HF folder)")
    student_model: str = Field(description="the distilled student (HF folder)")
    distill_checkpoints: str = Field(description="resumable distill checkpoints; NOT a DVC out")
    distill_report_dir: str = Field(description="distill training log (CSV + PNG)")
    eval_report_dir: str = Field(description="evaluate report: generations.parquet, report.md")
    metrics_dir: str = Field(description="one <stage>.json per stage, for `dvc metrics show`")


# ---------------------------------------------------------------------------------------------- task
class ArithTask(_Model):
    """The embedded synthetic task: ``a*b=`` with a multi-digit ``a`` and a one-digit ``b``.

    Its chain of thought multiplies digit by digit from the right with explicit carries and ends in
    ``answer: <n>``; the verifier is an exact integer check.
    """

    kind: Literal["arith"] = "arith"
    min_digits: int = Field(2, ge=1, le=12, description="fewest digits of the multi-digit factor a")
    max_digits: int = Field(4, ge=1, le=12, description="most digits of a (difficulty knob)")
    min_multiplier: int = Field(2, ge=0, le=9, description="smallest one-digit factor b")
    max_multiplier: int = Field(9, ge=0, le=9, description="largest one-digit factor b")

    @model_validator(mode="after")
    def _ranges(self) -> ArithTask:
        if self.min_digits > self.max_digits:
            raise ValueError("min_digits must be <= max_digits")
        if self.min_multiplier > self.max_multiplier:
            raise ValueError("min_multiplier must be <= max_multiplier")
        return self


class MathTask(_Model):
    """Math word problems (GSM8K / MATH / AIME formats), scored with ``math-verify``."""

    kind: Literal["math"] = "math"


TaskSpec = Annotated[ArithTask | MathTask, Field(discriminator="kind")]


# ---------------------------------------------------------------------------------------------- model
class TinyModel(_Model):
    """Size of the Llama-architecture model built from a config when ``model.base`` is ``tiny``."""

    hidden_size: int = Field(128, ge=8, description="width (d_model)")
    num_layers: int = Field(4, ge=1, description="decoder layers")
    num_heads: int = Field(4, ge=1, description="attention heads (hidden_size must divide evenly)")
    intermediate_size: int = Field(512, ge=8, description="SwiGLU MLP width")
    max_position_embeddings: int = Field(256, ge=16, description="longest prompt + completion, in tokens")

    @model_validator(mode="after")
    def _heads(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be divisible by num_heads")
        return self


class LoraCfg(_Model):
    """LoRA adapters (``peft``) on the trained model: SFT, RL and distill train only these; the saved model is
    the merged HF folder (``from_pretrained`` and vLLM load it as is), the adapter is kept in its ``adapter/``."""

    r: int = Field(16, ge=1, description="adapter rank")
    alpha: int = Field(32, ge=1, description="scaling numerator (the update is alpha / r * B A)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0: the RL ratio of an "
                           "on-policy step stays exactly 1)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, k_proj, v_proj, o_proj]) or "
        "'all-linear' (every linear layer but the LM head)")


class PromptCfg(_Model):
    """How a problem becomes the model's input, and where generation stops. Applied once, when the base
    policy (or a pretrained student) is loaded: the chat template and the stop tokens are written into the
    model folder (tokenizer_config.json, generation_config.json), so every model descending from it, and
    vLLM or ``from_pretrained`` users of it, prompt and stop the same way."""

    system: str | None = Field(None, description="system message put first in every conversation (the chat "
                               "template must render system messages)")
    instruction: str = Field("", description="appended to every user prompt, e.g. '\\nPlease reason step by "
                             "step, and put your final answer within \\boxed{}.' for the math task")
    template: str | None = Field(None, description="for a model without a chat template: a plain prompt with "
                                 "'{prompt}', e.g. 'Question: {prompt}\\nAnswer:' (the completion follows, then "
                                 "EOS). A model with neither is refused")
    stop: list[str] = Field([], description="extra stops: a string that is one token (e.g. '<|im_end|>') "
                            "becomes a stop token id beside generation_config's EOS ids; any other string stops "
                            "generation when the decoded completion contains it (cut from the text)")

    @field_validator("template")
    @classmethod
    def _has_slot(cls, v: str | None) -> str | None:
        if v is not None and v.count("{prompt}") != 1:
            raise ValueError("must contain '{prompt}' exactly once")
        return v


class ModelCfg(_Model):
    base: str = Field(
        "tiny",
        description="'tiny' builds a fresh Llama from model.tiny + a character tokenizer; otherwise a local "
        "HF folder or a hub id (needs the hub; with HF_HUB_OFFLINE=1 a hub id fails fast)",
    )
    revision: str | None = Field(None, description="hub revision (commit sha, tag or branch) of model.base: pin "
                                 "a commit sha for a reproducible run; recorded in MLflow and the lineage")
    tiny: TinyModel = Field(default_factory=TinyModel, description="used only when base == 'tiny'")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype. Training keeps fp32 master weights and optimizer state and runs "
        "forward/backward under torch.autocast in this dtype (mixed precision); inference-only models (evaluate, "
        "the rollout stage, a distillation teacher, a KL reference) are loaded in it. With LoRA the frozen base "
        "is stored in this dtype and the adapters in fp32")
    lora: LoraCfg | None = Field(None, description="null: full fine-tuning; else train LoRA adapters")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in "
                                         "backward (less memory, ~30% more compute)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel passed to from_pretrained (flash_attention_2 needs the package "
        "and a GPU)")
    prompt: PromptCfg = Field(default_factory=PromptCfg)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v == "float16":
            raise ValueError("float16 needs loss scaling, which this pipeline does not do (its gradients "
                             "underflow silently); use bfloat16 (same memory, fp32's exponent range) or float32")
        return v


# -------------------------------------------------------------------------------------------- runtime
class Distributed(_Model):
    """Several training processes (``posttrain.distributed``): sft, rl and distill relaunch themselves under
    ``torchrun`` when ``nproc_per_node * nnodes`` > 1. Global batch = per-rank micro-batches x ranks x
    accumulation: ``sft.batch_size``, ``rl.prompts_per_step`` x ``group_size`` and the distill batches stay the
    *global* batch, split over ranks, so a run's result does not depend on the world size beyond fp32 reduction
    order (sft, and an rl/distill update from the same samples) and sampling (rl/distill ranks generate their
    share of prompts with their own seeds: reproducible for a given world size)."""

    nproc_per_node: int = Field(1, ge=1, description="processes per machine (one per GPU)")
    nnodes: int = Field(1, ge=1, description="machines; above 1 every machine runs the same stage command and "
                        "they meet at rdzv_endpoint")
    strategy: Literal["ddp", "fsdp2"] = Field("ddp", description="ddp: replicated model, all-reduced gradients; "
                                              "fsdp2: fully_shard per decoder layer (parameters, gradients, "
                                              "optimizer state sharded)")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="auto = nccl on CUDA, else gloo")
    rdzv_endpoint: str | None = Field(None, description="host:port of node 0, needed when nnodes > 1")
    timeout_s: float = Field(600, gt=0, description="a collective waiting longer fails the stage (a dead rank "
                             "cannot hang the others past this)")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes

    @model_validator(mode="after")
    def _nodes(self) -> Distributed:
        if self.nnodes > 1 and not self.rdzv_endpoint:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port of node 0)")
        return self


class Runtime(_Model):
    train_threads: int = Field(2, ge=1, description="torch threads for training steps (2 is fastest here)")
    generate_threads: int = Field(2, ge=1, description="torch threads for generation (2 is fastest here from "
                                  "batch 64 up: benchmarks/rollout.py)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    progress: bool = Field(True, description="show tqdm progress bars on long loops")
    distributed: Distributed = Field(default_factory=Distributed)


# --------------------------------------------------------------------------------------------- curate
class SyntheticSource(_Model):
    """Problems drawn from the task generator (``task`` must be ``arith``)."""

    kind: Literal["synthetic"] = "synthetic"
    name: str = Field("arith", description="source name recorded in every row's `source`")
    num_rows: int = Field(4000, ge=1, description="rows to generate (duplicates are then removed)")


class FileSource(_Model):
    """A local JSONL or Parquet file, read line by line (JSONL) so malformed rows are quarantined."""

    kind: Literal["file"] = "file"
    name: str = Field(description="source name recorded in every row's `source`")
    path: str = Field(description="path to .jsonl/.json/.parquet, relative to the repo root")
    format: Literal["gsm8k", "math", "generic"] = Field(
        description="gsm8k: question/answer with '#### n'; math: problem/answer (or solution with \\boxed{}); "
        "generic: prompt/answer[/solution]"
    )
    limit: int | None = Field(None, ge=1, description="read at most this many rows")

    @field_validator("path")
    @classmethod
    def _exists(cls, v: str) -> str:
        if not Path(v).is_file():
            raise ValueError(f"file not found: {v}")
        return v


class HubSource(_Model):
    """A dataset loaded by ``datasets.load_dataset(hub_id, config, split=split)``."""

    kind: Literal["hub"] = "hub"
    name: str = Field(description="source name recorded in every row's `source`")
    hub_id: str = Field(description="e.g. openai/gsm8k")
    config: str | None = Field(None, description="dataset config name, e.g. 'main'")
    split: str = Field("train", description="split to load")
    revision: str | None = Field(None, description="dataset revision (commit sha, tag or branch): pin a sha for a "
                                 "reproducible run; recorded in the curate report and MLflow")
    format: Literal["gsm8k", "math", "generic"] = Field(description="see FileSource.format")
    limit: int | None = Field(None, ge=1, description="read at most this many rows")


SourceSpec = Annotated[SyntheticSource | FileSource | HubSource, Field(discriminator="kind")]
BenchmarkSpec = Annotated[FileSource | HubSource, Field(discriminator="kind")]


class Decontam(_Model):
    ngram: int = Field(8, ge=1, description="word n-gram size; texts shorter than n words form one n-gram")
    threshold: float = Field(
        0.5, gt=0, le=1,
        description="flag a row when the share of its n-grams found in a benchmark item, or the share of a "
        "benchmark item's n-grams found in the row, reaches this",
    )
    boilerplate_frac: float = Field(
        0.2, gt=0, le=1,
        description="n-grams present in more than this share of a benchmark's items (shared instructions "
        "such as 'put your final answer within \\boxed{}') are not indexed",
    )
    benchmarks: list[BenchmarkSpec] = Field(
        default_factory=list,
        description="benchmark sets to decontaminate against; the held-out eval split is always included",
    )
    max_contaminated_frac: float | None = Field(
        None, ge=0, le=1, description="fail the stage when more than this share of rows is contaminated"
    )


class Dedup(_Model):
    near_ngram: int = Field(5, ge=1, description="n-gram size for near-duplicate detection")
    near_threshold: float = Field(0.8, gt=0, le=1, description="n-gram overlap at which a row is a near-duplicate")


class Validation(_Model):
    min_prompt_chars: int = Field(3, ge=1, description="shorter prompts are quarantined")
    max_prompt_chars: int = Field(4000, ge=1, description="longer prompts are quarantined (absurd length)")
    max_answer_chars: int = Field(200, ge=1, description="longer gold answers are quarantined")


class CurateEval(_Model):
    """The held-out eval split. Training rows are always decontaminated against it."""

    source: SourceSpec | None = Field(
        None, description="where eval problems come from; None = the task generator (task arith only), "
        "seeded apart from the training draw"
    )
    rows: int = Field(200, ge=1, description="eval rows kept (after validation and dedup). Not named `size`: "
                      "DVC's run-cache key drops every key named size or nfiles (dvc_data's Meta fields), so a "
                      "changed `size` param would restore the old outputs")


class Curate(_Model):
    sources: list[SourceSpec] = Field(min_length=1, description="where training problems come from")
    max_quarantined_frac: float = Field(0.5, ge=0, le=1, description="fail the stage when a source (training or "
                                        "eval) has more than this share of its rows quarantined: a wrong format "
                                        "or file, not a few bad rows")
    eval: CurateEval = Field(default_factory=CurateEval)
    sft_size: int = Field(2000, ge=0, description="rows set aside, with solutions, as SFT demonstrations")
    dedup: Dedup = Field(default_factory=Dedup)
    decontam: Decontam = Field(default_factory=Decontam)
    validation: Validation = Field(default_factory=Validation)


# ------------------------------------------------------------------------------------------------ sft
class SftPhase(_Model):
    """One phase of the cold start. The default mixed-format cold start is two phases: full chain-of-thought
    demos, then a short phase whose demos are mostly bare answers (``4738*7=`` -> ``answer: 33166``).
    The model then answers directly by default (often wrong) but can still reason when it samples a CoT:
    exactly what RL can reinforce (an SFT model merely stopped early gives GRPO nothing to work with)."""

    steps: int = Field(ge=1, description="optimizer steps in this phase")
    cot_frac: float = Field(1.0, ge=0, le=1, description="share of demos shown with their full solution; "
                            "the rest show the bare final answer")


class Sft(_Model):
    phases: list[SftPhase] = Field(min_length=1, description="run in order; the LR schedule spans all phases")
    batch_size: int = Field(64, ge=1, description="sequences per optimizer step (micro_batch * accumulation)")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward pass (gradient accumulation "
                                  "up to batch_size; exact token-mean either way)", json_schema_extra=NOT_RESULT)
    lr: float = Field(2e-3, gt=0, description="peak AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0, description="linear warmup, then cosine decay to 0")
    max_grad_norm: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(100, ge=1, description="save a resumable checkpoint every N steps",
                                  json_schema_extra=NOT_RESULT)
    log_every: int = Field(10, ge=1, description="write a training-log row every N steps")

    @model_validator(mode="after")
    def _micro(self) -> Sft:
        if self.batch_size % self.micro_batch_size:
            raise ValueError("batch_size must be a multiple of micro_batch_size")
        return self

    @property
    def total_steps(self) -> int:
        return sum(p.steps for p in self.phases)


class Sampling(_Model):
    temperature: float = Field(1.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(96, ge=1)


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


def _registered(kind: str, name: str) -> str:
    """Fail at config load on a name no registry knows, listing the valid ones."""
    if kind == "reward":
        from posttrain.rewards import REWARDS as reg
    elif kind == "advantage":
        from posttrain.algos import ADVANTAGES as reg
    elif kind == "token selection":
        from posttrain.algos import TOKEN_SELECTIONS as reg
    elif kind == "prompt selection":
        from posttrain.grpo import PROMPT_SELECTIONS as reg
    else:
        from posttrain.algos import POLICY_LOSSES as reg
    if name not in reg:
        raise ValueError(f"unknown {kind} {name!r}; valid: {sorted(reg)}")
    return name


# -------------------------------------------------------------------------------------------- rollout
class VLLMOptions(_Model):
    """The vllm backend's engine (posttrain/rollout/vllm.py); the hf backend ignores it. None of it changes
    which tokens are sampled: it is left out of DVC params and checkpoint fingerprints."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of GPU memory the engine may "
                                          "take (weights + KV cache); colocated with the trainer in rl/distill, "
                                          "so leave room for the update", json_schema_extra=NOT_RESULT)
    sleep_level: Literal[0, 1, 2] = Field(1, description="during each update the engine sleeps: 1 offloads its "
                                          "weights to CPU, 2 discards them (reloaded at the next sync), 0 never "
                                          "sleeps", json_schema_extra=NOT_RESULT)
    max_model_len: int | None = Field(None, ge=1, description="context length the KV cache is sized for; None: "
                                      "the model config's", json_schema_extra=NOT_RESULT)
    enforce_eager: bool = Field(False, description="no CUDA graphs (faster start, slower decode)",
                                json_schema_extra=NOT_RESULT)


class Rollout(_Model):
    backend: Literal["hf", "vllm"] = Field("hf", description="rollout backend (vllm: GPU-worker environment)")
    num_prompts: int | None = Field(
        512, ge=1, description="train prompts to score (a seeded shuffle's first N). RL selects its prompts by "
        "these pass rates, so only scored prompts can reach RL: null scores the whole training split (the "
        "real-run profile); the tiny default scores 512 to keep the CPU run short")
    group_size: int = Field(8, ge=1, description="G: completions per prompt")
    sampling: Sampling = Field(default_factory=Sampling)
    batch_size: int = Field(256, ge=1, description="sequences per generate() call")
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="engine settings of the vllm backend "
                              "(used by every stage that generates with it)")


# --------------------------------------------------------------------------------------------- reward
class RewardSpec(_Model):
    name: str = Field(description="a key of posttrain.rewards.REWARDS")
    weight: float = Field(1.0, description="weight in the summed reward (0 = logged only)")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward function")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        return _registered("reward", v)


class Reward(_Model):
    rewards: list[RewardSpec] = Field(min_length=1, description="summed with their weights")
    max_unscorable_frac: float = Field(0.05, ge=0, le=1, description="fail the stage above this unscorable share")
    audit_examples: int = Field(3, ge=0, description="scored completions shown per reward bucket in the audit")


# ------------------------------------------------------------------------------------------------- rl
# Estimators whose papers place the KL or the baseline differently from GRPO (the combinations are refused).
KL_IN_REWARD = {"reinforce_pp": "Hu 2025, REINFORCE++", "rloo": "Ahmadian et al. 2024, RLOO"}
BATCH_BASELINE = {"reinforce_pp": "Hu 2025, REINFORCE++: a global batch mean and std",
                  "psr": "Zhu et al. 2025: no baseline, every correct sample reinforced",
                  "nsr": "Zhu et al. 2025: no baseline, every wrong sample pushed down",
                  "w_reinforce": "Zhu et al. 2025: no baseline, rewards {+0.1, -1}"}


class RlSelect(_Model):
    """Prompt selection from the reward stage's pass rates (of the SFT policy)."""

    strategy: str = Field("pass_band", description="a key of posttrain.grpo.PROMPT_SELECTIONS: pass_band keeps "
                          "every prompt in [min_pass_rate, max_pass_rate]; top_variance keeps the top_k of those by "
                          "reward variance p(1 - p) (1-shot RLVR)")
    min_pass_rate: float = Field(0.01, ge=0, le=1, description="drop prompts solved less often (never solved)")
    max_pass_rate: float = Field(0.99, ge=0, le=1, description="drop prompts solved more often (always solved)")
    top_k: int = Field(1, ge=1, description="prompts kept by top_variance (1: 1-shot RLVR)")

    @field_validator("strategy")
    @classmethod
    def _strategy(cls, v: str) -> str:
        return _registered("prompt selection", v)


class RefReset(_Model):
    """ProRL's reference resets (Liu et al. 2025): the KL anchor moves to the current policy periodically."""

    every: int = Field(ge=1, description="after every N-th step the reference becomes a copy of the policy")
    optimizer: bool = Field(False, description="also clear the optimizer's state (Adam moments) at each reset")


class Tis(_Model):
    """Truncated importance sampling of the sampler/trainer mismatch (posttrain.algos.TIS)."""

    mode: Literal["token", "sequence"] = Field("token", description="a key of posttrain.algos.TIS: one weight "
                                               "per token, or one per sequence (the product of its ratios)")
    cap: float = Field(2.0, ge=1, description="weights min(pi_trainer / pi_sampler, cap)")


class Rl(_Model):
    steps: int = Field(40, ge=1, description="rollout -> reward -> update rounds")
    seed: int = Field(0, ge=0, description="added to the pipeline seed for RL's sampling and prompt order: "
                      "several seeds of an RL arm on the same curate/sft outputs (the pipeline seed re-runs all)")
    prompts_per_step: int = Field(16, ge=1, description="B: prompts per round")
    group_size: int = Field(8, ge=2, description="G: samples per prompt")
    sampling: RlSampling = Field(default_factory=RlSampling, description="temperature > 0 and top_p 1: the "
                                 "trainer scores logits / temperature, the distribution sampled from")
    generate_batch_size: int = Field(256, ge=1, description="sequences per generate() call (part of the result: "
                                     "each chunk of prompts is seeded by its index)")
    lr: float = Field(3e-5, gt=0, description="AdamW learning rate (constant); tiny models collapse at >= 1e-4")
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    advantage: str = Field("grpo", description="a key of posttrain.algos.ADVANTAGES")
    policy_loss: str = Field("ppo_clip", description="a key of posttrain.algos.POLICY_LOSSES")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses reduce to a scalar (separate from the loss)")
    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="ratio clip below 1")
    clip_eps_high: float = Field(0.28, ge=0, description="ratio clip above 1 (DAPO clip-higher)")
    dual_clip: float | None = Field(None, gt=1, description="dual-clip constant c for negative advantages")
    kl_coef: float = Field(0.0, ge=0, description="KL *loss* to the frozen SFT reference, estimator "
                           "kl_estimator (GRPO's placement); 0 = no KL loss")
    kl_estimator: Literal["k2", "k3"] = Field(
        "k3", description="per-token KL loss term (posttrain.algos.KL_ESTIMATORS): k3 = GRPO's (its gradient is "
        "that of KL(ref || pi)); k2 = (logp - ref)^2 / 2 (its gradient is that of KL(pi || ref))")
    kl_reward_coef: float = Field(0.0, ge=0, description="KL *in the reward* (RLOO, REINFORCE++): each sample's "
                                  "reward minus coef * sum over its tokens of (sampler logp - ref logp), before "
                                  "advantages; 0 = off. With kl_coef and this both 0 the reference is never loaded")
    entropy_coef: float = Field(0.0, ge=0, description="entropy bonus coefficient")
    prior_budget: int = Field(0, ge=0, description="adaptive rollout budget (V0.5 / Reinforce-Ada) with "
                              "advantage prior_fused: extra samples per step, G at a time, for prompts whose "
                              "prior their group rejects; they refresh the prior and are not trained on")
    token_select: str = Field("all", description="a key of posttrain.algos.TOKEN_SELECTIONS: which completion "
                              "tokens carry the policy gradient (top_entropy: the top token_rho share of the step's "
                              "tokens by the sampling policy's entropy; bottom_entropy: the rest)")
    token_rho: float = Field(0.2, gt=0, le=1, description="the share top_entropy keeps (0.2 in the paper)")
    ref_reset: RefReset | None = Field(None, description="ProRL: reset the KL reference to the current policy "
                                       "every N steps (needs kl_coef or kl_reward_coef > 0); null = never")
    tis: Tis | None = Field(None, description="truncated importance sampling of the policy-gradient term by "
                            "pi_trainer / pi_sampler (for a sampler whose log-probs differ from the trainer's, e.g. "
                            "vLLM); null = off. The mean |trainer - sampler| log-prob gap is logged every step")
    epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    minibatches: int = Field(1, ge=1, description="optimizer steps per pass (old log-probs are recomputed "
                             "when epochs * minibatches > 1; otherwise the update is exactly on-policy)")
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward (gradient accumulation)",
                                  json_schema_extra=NOT_RESULT)
    pack: bool = Field(False, description="pack each micro-batch's sequences into rows of twice the longest "
                       "(block-diagonal attention via position ids) instead of padding them: the same loss and "
                       "gradient over fewer tokens; pays off when lengths vary widely (README Performance)",
                       json_schema_extra=NOT_RESULT)
    dynamic_sampling: Literal["off", "skip", "refill"] = Field(
        "skip", description="DAPO: groups whose rewards are all equal carry no signal: off = keep them, skip = "
        "drop them from the update, refill = sample more prompts until the batch is full (or max_refill_rounds)")
    max_refill_rounds: int = Field(2, ge=0, description="extra sampling rounds per step with refill")
    max_idle_steps: int = Field(5, ge=1, description="stop the stage with an error after this many steps in a "
                                "row with nothing to update (every group skipped or unscorable); each is warned")
    select: RlSelect = Field(default_factory=RlSelect)
    checkpoint_every: int = Field(10, ge=1, description="resumable checkpoint every N steps",
                                  json_schema_extra=NOT_RESULT)
    save_steps: list[int] = Field(default_factory=list, description="also save HF checkpoints of these steps "
                                  "(under paths.rl_dir/checkpoints/step_N) for evaluation")

    @field_validator("advantage")
    @classmethod
    def _adv(cls, v: str) -> str:
        return _registered("advantage", v)

    @field_validator("policy_loss")
    @classmethod
    def _loss(cls, v: str) -> str:
        return _registered("policy_loss", v)

    @field_validator("kl_coef")
    @classmethod
    def _kl_placement(cls, v: float, info: ValidationInfo) -> float:
        adv = info.data.get("advantage")
        if v > 0 and adv in KL_IN_REWARD:
            raise ValueError(f"{adv} puts the KL in the reward ({KL_IN_REWARD[adv]}), not in the loss: set "
                             "rl.kl_reward_coef instead and rl.kl_coef: 0")
        return v

    @field_validator("prior_budget")
    @classmethod
    def _prior_budget(cls, v: int, info: ValidationInfo) -> int:
        if v and info.data.get("advantage") != "prior_fused":
            raise ValueError("extra samples refresh the priors of advantage prior_fused; set rl.advantage: "
                             "prior_fused or rl.prior_budget: 0")
        return v

    @field_validator("token_select")
    @classmethod
    def _token_select(cls, v: str) -> str:
        return _registered("token selection", v)

    @field_validator("ref_reset")
    @classmethod
    def _ref_reset(cls, v: RefReset | None, info: ValidationInfo) -> RefReset | None:
        if v is not None and not (info.data.get("kl_coef") or info.data.get("kl_reward_coef")):
            raise ValueError("a reference reset needs a reference: set rl.kl_coef or rl.kl_reward_coef > 0")
        return v

    @field_validator("dynamic_sampling")
    @classmethod
    def _baseline(cls, v: str, info: ValidationInfo) -> str:
        adv = info.data.get("advantage")
        if v != "off" and adv in BATCH_BASELINE:
            raise ValueError(f"{adv} has no per-group baseline ({BATCH_BASELINE[adv]}): a group whose rewards are all "
                             "equal still carries signal, so skipping it changes the estimator; set "
                             "rl.dynamic_sampling: off")
        return v


# -------------------------------------------------------------------------------------------- distill
class DistillPhase(_Model):
    """Shared knobs of the warmup (A) and on-policy (B) phases."""

    steps: int = Field(0, ge=0, description="optimizer steps in this phase (0 = skip the phase)")
    prompts_per_step: int = Field(16, ge=1, description="training prompts per step")
    samples_per_prompt: int = Field(4, ge=1, description="completions per prompt")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate (constant)")


class DistillWarmup(DistillPhase):
    """Phase A: the student learns from the teacher's own samples (forward KL)."""

    targets: Literal["soft", "hard"] = Field(
        "soft", description="soft: token-level forward KL to the teacher's distributions; hard: SFT on the samples")
    filter_correct: bool = Field(False, description="keep only teacher samples the task verifier accepts "
                                 "(rejection sampling)")


class DistillOnPolicy(DistillPhase):
    """Phase B: on-policy distillation: the student samples, the teacher scores the same tokens."""

    divergence: Literal["reverse_kl", "forward_kl", "jsd"] = Field(
        "reverse_kl", description="per-token divergence (posttrain.algos.DIVERGENCES)")
    beta: float = Field(0.5, ge=0, le=1, description="generalized JSD interpolation (0 = forward, 1 = reverse KL)")
    student_frac: float = Field(1.0, ge=0, le=1, description="share of prompts sampled by the student; the rest "
                                "are sampled by the teacher")


class Distill(_Model):
    teacher: str = Field(description="teacher checkpoint (a paths.* alias); must share the student's tokenizer")
    student: TinyModel | str = Field(
        default_factory=lambda: TinyModel(num_layers=2),
        description="a size (a fresh Llama built like model.tiny, with the teacher's tokenizer and vocabulary "
        "size) or a pretrained model: a local HF folder or hub id (e.g. a smaller model of the teacher's family). "
        "Either way the student first gets its own cold start (the sft recipe); model.lora applies to it too")
    student_revision: str | None = Field(None, description="hub revision of a pretrained student")
    seed: int = Field(0, ge=0, description="added to the pipeline seed for phases A-C's sampling and prompt order "
                      "(not the student's init or cold start): seeds of a distillation arm on one teacher")
    warmup: DistillWarmup = Field(default_factory=DistillWarmup)
    on_policy: DistillOnPolicy = Field(default_factory=DistillOnPolicy)
    grpo_steps: int = Field(0, ge=0, description="phase C: student GRPO after the bridge, with the rl section's "
                            "algorithm settings (0 = off)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature of phases A and B; the divergences "
                               "compare student and teacher distributions of logits / temperature")
    max_new_tokens: int = Field(80, ge=1)
    micro_batch_size: int = Field(64, ge=1, description="sequences per forward/backward",
                                  json_schema_extra=NOT_RESULT)
    checkpoint_every: int = Field(10, ge=1, description="resumable checkpoint every N steps of phases A-C",
                                  json_schema_extra=NOT_RESULT)


# ------------------------------------------------------------------------------------------- evaluate
class Evaluate(_Model):
    models: dict[str, str] = Field(
        min_length=1,
        description="name -> checkpoint path, each evaluated by its own DVC stage evaluate@<name> (a dep: so an "
        "experiment re-evaluates only the models whose inputs changed) and shown side by side in this order by "
        "the report stage. `python -m stages.evaluate --model NAME` also takes a hub id; dvc repro needs paths",
    )
    backend: Literal["hf", "vllm"] = Field("hf", description="rollout backend used for generation")
    num_samples: int = Field(8, ge=1, description="samples per prompt for pass@k / maj@k")
    ks: list[int] = Field(default_factory=lambda: [1, 4, 8], description="k values for pass@k and maj@k")
    sampling: Sampling = Field(default_factory=Sampling, description="sampled decoding (greedy is always run)")
    batch_size: int = Field(256, ge=1, description="sequences per generate() call")
    limit: int | None = Field(None, ge=1, description="evaluate at most this many prompts per split")
    sample_prompts: int | None = Field(None, ge=1, description="sampled metrics (pass@k, maj@k) on the first N "
                                       "prompts of each split only (greedy runs on all); None = all")
    benchmarks: list[BenchmarkSpec] = Field(default_factory=list, description="extra benchmark files/hub sets")
    bootstrap: int = Field(1000, ge=10, description="bootstrap resamples for 95% intervals")

    @model_validator(mode="after")
    def _ks(self) -> Evaluate:
        bad = [k for k in self.ks if k < 1 or k > self.num_samples]
        if bad:
            raise ValueError(f"every k must be in [1, num_samples={self.num_samples}], got {bad}")
        return self


# -------------------------------------------------------------------------------------------- report
class Report(_Model):
    """The side-by-side report over every evaluate@<name> stage's results (stages/report.py)."""

    compare: list[tuple[str, str]] = Field(default_factory=list, description="model pairs (names of "
                                           "evaluate.models) given paired differences and checked for a pass@k "
                                           "crossing (e.g. [sft, rl])")


# ------------------------------------------------------------------------------------------------ root
# ---------------------------------------------------------------------------------------------- prefect
# DAG order, as in dvc.yaml; evaluate runs once per model (evaluate@<name>, a foreach stage)
STAGES = ("curate", "sft", "rollout", "reward", "rl", "distill", "evaluate", "report")


def stage_metrics(metrics_dir: str | Path, stage: str) -> Path:
    """A stage's metrics file: ``metrics/<stage>.json``; of one foreach instance ``metrics/<stage>/<key>.json``
    (``evaluate@sft`` -> ``metrics/evaluate/sft.json``)."""
    return Path(metrics_dir) / f"{stage.replace('@', '/')}.json"


class PrefectCfg(_Model):
    """How ``flows/pipeline.py`` schedules the stages (read by the flow, by no stage: no dvc.yaml param)."""

    resources: dict[str, Literal["cpu", "gpu"]] = Field(
        default_factory=lambda: {"curate": "cpu", "sft": "gpu", "rollout": "gpu", "reward": "cpu", "rl": "gpu",
                                 "distill": "gpu", "evaluate": "gpu"},
        description="resource class per stage: a 'gpu' stage runs as a stage-flow deployment on gpu_pool "
        "when the pipeline runs with routing on; a 'cpu' stage runs in the pipeline's own flow run",
    )
    cpu_pool: str = Field("cpu", description="work pool of the pipeline deployment (and of cpu stages)")
    gpu_pool: str = Field("gpu", description="work pool of the stage deployment that gpu stages run on")
    retries: int = Field(1, ge=0, description="retries of a failed stage task (a retry resumes from the "
                         "stage's own checkpoints; DVC skips what is already up to date)")
    retry_delay_s: float = Field(5.0, ge=0, description="seconds between retries")
    dvc_remote: str | None = Field(None, description="DVC remote a worker in another checkout pulls a "
                                   "stage's deps from and pushes its outs to (None: workers share this checkout); "
                                   "the pipeline's params (overrides included) are sent to the worker")
    gpu_python: str | None = Field(None, description="the interpreter a gpu worker runs gpu stages with (e.g. "
                                   ".venv-gpu/bin/python from `make setup-gpu`: CUDA torch + vLLM, no prefect), "
                                   "relative to the worker's checkout; null: the worker's own")
    workspace_wait_s: float = Field(3600.0, ge=0, description="a pipeline run waits this long for another run "
                                    "in the same checkout to finish (one run per workspace: overrides rewrite "
                                    "params.yaml), then refuses naming it; 0 = refuse at once")

    @field_validator("resources")
    @classmethod
    def _stages(cls, v: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(v) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are {list(STAGES)}")
        return {s: v.get(s, "cpu") for s in STAGES}


# --------------------------------------------------------------------------------------------- tracking
class TrackingCfg(_Model):
    """MLflow tracking of every stage run (posttrain/tracking.py); read by no stage's code: no dvc.yaml param."""

    enabled: bool = Field(True, description="log every stage run to MLflow (false: log nothing)")
    uri: str | None = Field(None, description="tracking/registry URI, e.g. http://127.0.0.1:5000; None: "
                            "sqlite:///<absolute repo path>/mlflow.db with artifacts in <repo>/mlartifacts")
    experiment: str = Field("posttrain", description="MLflow experiment of the stage runs")
    outbox: str = Field(".mlflow-outbox", description="where runs wait when the store is unreachable "
                        "(`posttrain tracking sync` sends them)")
    model_prefix: str = Field("posttrain-", description="registered model names: <prefix>sft, <prefix>rl, ...")
    champion: str | None = Field("eval.greedy", description="evaluate moves the `champion` alias of a model "
                                 "to the evaluated version when this metric (<split>.<metric> of metrics/"
                                 "evaluate.json) beats the current champion's; None: never")


class Params(_Model):
    seed: int = Field(0, description="one seed for data generation, init, sampling and shuffling")
    paths: Paths
    runtime: Runtime = Field(default_factory=Runtime)
    task: TaskSpec = Field(default_factory=ArithTask)
    model: ModelCfg = Field(default_factory=ModelCfg)
    curate: Curate
    sft: Sft
    rollout: Rollout
    reward: Reward
    rl: Rl
    distill: Distill
    evaluate: Evaluate
    report: Report = Field(default_factory=Report)
    prefect: PrefectCfg = Field(default_factory=PrefectCfg)
    tracking: TrackingCfg = Field(default_factory=TrackingCfg)

    @model_validator(mode="after")
    def _cross(self) -> Params:
        synthetic = any(isinstance(s, SyntheticSource) for s in self.curate.sources)
        if (synthetic or self.curate.eval.source is None) and self.task.kind != "arith":
            raise ValueError("curate: the synthetic generator (a synthetic source, or eval.source unset) "
                             "needs task.kind == 'arith'")
        unknown = sorted({m for pair in self.report.compare for m in pair} - set(self.evaluate.models))
        if unknown:
            raise ValueError(f"report.compare: {unknown} not in evaluate.models {list(self.evaluate.models)}")
        if self.rl.ref_reset is not None and self.model.lora is not None:
            raise ValueError("rl.ref_reset with model.lora is not supported: the LoRA policy's reference is its "
                             "frozen base (adapter off), which a reset would have to overwrite with the merge")
        d = self.runtime.distributed
        if d.world_size > 1:
            if d.strategy == "fsdp2" and self.model.lora is not None:
                raise ValueError("runtime.distributed.strategy: fsdp2 with model.lora is not supported; use ddp "
                                 "(LoRA's frozen base needs no sharding of gradients or optimizer state)")
            if self.sft.batch_size % (d.world_size * self.sft.micro_batch_size):
                raise ValueError(f"sft.batch_size: {self.sft.batch_size} must be a multiple of world size "
                                 f"{d.world_size} (runtime.distributed) x sft.micro_batch_size "
                                 f"{self.sft.micro_batch_size}")
        return self


def _loc(loc: tuple[Any, ...]) -> str:
    """``('curate', 'sources', 0, 'file', 'path')`` -> ``curate.sources[0].path`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in {"synthetic", "file", "hub", "arith", "math"} or "[" in str(part):
            continue  # discriminated-union branch names are not keys of the file
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


def _describe(err: dict[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif "input" in err and err["type"] not in {"missing"} and not isinstance(err["input"], dict | list):
        msg = f"{msg}, got {err['input']!r}"
    return msg


def parse_params(raw: dict[str, Any], origin: str = "params") -> Params:
    """Validate a params mapping; raise :class:`ConfigError` naming the first bad key path."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        where, what = _loc(first["loc"]), _describe(first)
        if where == "<root>":  # a check across sections: its message starts with the key it names
            raise ConfigError(f"{origin}: {what.removeprefix('Value error, ')}{more}") from None
        raise ConfigError(f"{origin}: {where}: {what}{more}") from None


def read_yaml(text: str) -> Any:
    """Params YAML as DVC reads and writes it: YAML 1.2 (ruamel), where ``off``/``yes``/``no`` are strings.
    (PyYAML's 1.1 reads ``off`` as false: ``dvc exp run -S rl.dynamic_sampling=off`` writes it unquoted.)"""
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(text)


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``. Raises :class:`ConfigError` (one line) on any problem."""
    from ruamel.yaml import YAMLError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: file not found")
    try:
        raw = read_yaml(p.read_text())
    except YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from None
    return parse_params(raw or {}, origin=str(p))
