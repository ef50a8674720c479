"""Models: build, load (whole, or empty on the meta device), make trainable (LoRA, checkpointing), save.

- ``model.base: tiny`` builds a small Llama-architecture model from ``model.tiny`` (:func:`build_tiny_model`),
  saved with ``save_pretrained``; it reloads offline with ``AutoModelForCausalLM`` (and vLLM) from the folder.
- Anything else is a local HF folder or a hub id, loaded with ``from_pretrained``. With
  ``HF_HUB_OFFLINE=1`` an id that is not cached fails fast with :class:`ModelLoadError`.
- :func:`empty_model` is a folder's model without its weights (the meta device): what a rank builds when rank 0
  alone reads the weights (``Dist.wrap`` for the policy, ``Dist.load_frozen`` / ``Dist.load_on_rank0`` for frozen
  models).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from posttrain.config import LoraCfg, ModelCfg, TinyModel
from posttrain.config.model import hub_offline
from posttrain.errors import ModelLoadError


def build_tiny_model(cfg: TinyModel, tokenizer: PreTrainedTokenizerBase, seed: int, vocab_size: int | None = None
                     ) -> LlamaForCausalLM:
    """A freshly initialised Llama of the configured size (deterministic under ``seed``); ``vocab_size``
    defaults to the tokenizer's length (a real teacher's config may have more rows: pass its own)."""
    config = LlamaConfig(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def keep_layers(model: PreTrainedModel, n: int, dtype: str = "float32", meta: bool = False) -> PreTrainedModel:
    """A new model of ``model``'s architecture with ``n`` of its decoder layers, evenly spaced, the first and the
    last kept (``distill.student: {layers: n}``), and its embeddings, norms and head; weights copied in ``dtype``
    (``meta``: the structure only, on the meta device). Works for any HF decoder whose layer weights are named
    ``...layers.<i>....``."""
    import copy
    import re

    total = model.config.num_hidden_layers
    if not 1 <= n < total:
        raise ValueError(f"keep {n} of {total} layers: the student must have fewer layers than the teacher, and one")
    idx = [round(i * (total - 1) / (n - 1)) for i in range(n)] if n > 1 else [total - 1]
    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention kinds (sliding windows)
        config.layer_types = [config.layer_types[i] for i in idx]
    with torch.device("meta"):
        student = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    student.generation_config = copy.deepcopy(model.generation_config)
    if meta:
        return student.eval()
    where = {old: new for new, old in enumerate(idx)}
    layer = re.compile(r"^(.*\.layers\.)(\d+)(\..*)$")
    state = {}
    for k, v in model.state_dict().items():
        m = layer.match(k)
        if m is None:
            state[k] = v.to(getattr(torch, dtype), copy=True)
        elif int(m.group(2)) in where:
            state[f"{m.group(1)}{where[int(m.group(2))]}{m.group(3)}"] = v.to(getattr(torch, dtype), copy=True)
    student.load_state_dict(state, assign=True, strict=True)
    buffers = dict(model.named_buffers())
    for k, v in list(student.named_buffers()):  # non-persistent buffers (rotary frequencies): not in a state dict
        if v.is_meta:
            m = layer.match(k)
            src = k if m is None else f"{m.group(1)}{idx[int(m.group(2))]}{m.group(3)}"
            owner, _, name = k.rpartition(".")
            student.get_submodule(owner)._buffers[name] = buffers[src].clone()
    student.tie_weights()
    left = [k for k, v in [*student.named_parameters(), *student.named_buffers()] if v.is_meta]
    if left:
        raise ValueError(f"keep_layers: {left[:3]} not filled from the teacher")
    return student.eval()


def is_local(name: str) -> bool:
    return Path(name).exists() or name.startswith((".", "/")) or os.sep + os.sep in name


def load_model(name: str, dtype: str = "float32", device: str | torch.device = "cpu", trainable: bool = False,
               revision: str | None = None, attn_implementation: str = "sdpa") -> PreTrainedModel:
    """Causal LM from a local folder or hub id, in eval mode on ``device``.

    ``trainable``: the weights are fp32 masters whatever ``dtype`` is (the optimizer then keeps fp32 state
    too); run forward/backward under :func:`autocast` in ``dtype``. Otherwise (inference only, or the frozen
    base under LoRA) the weights are stored in ``dtype``."""
    try:
        model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32 if trainable else getattr(torch, dtype),
                                                     revision=revision, attn_implementation=attn_implementation)
    except (OSError, ValueError) as e:
        raise ModelLoadError(load_hint(name, e)) from None
    slow_bf16(dtype, device)
    return model.to(device).eval()


def slow_bf16(dtype: str, device: str | torch.device) -> bool:
    """True, with a warning, for bf16 on an x86 CPU without AVX512-BF16 or AMX: there its matmuls run at a
    fifth of fp32's (14.6 against 71.1 GFLOP/s on a 2-core AMD EPYC; docs/performance.md), so fp32 is faster."""
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    if dtype != "bfloat16" or torch.device(device).type != "cpu" or not x86:
        return False
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return False
    logging.getLogger(__name__).warning("model.dtype bfloat16 on a CPU without bf16 instructions (AVX512-BF16, AMX): "
                                        "its matmuls run several times slower than float32's; set model.dtype: float32")
    return True


def autocast(dtype: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Mixed precision: ops inside run in ``dtype`` where autocast allows (matmuls), reductions stay fp32.
    A no-op for float32, so the default path is bit-for-bit what it was. Gradients land in the fp32 masters."""
    if dtype == "float32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, dtype))


def load_hint(name: str, e: Exception) -> str:
    if is_local(name) and not Path(name).exists():
        return f"model {name!r}: no such folder"
    if hub_offline() and not Path(name).exists():
        return f"model {name!r}: not a local folder and HF_HUB_OFFLINE=1 (hub ids need the hub or a cache)"
    return f"model {name!r}: {str(e).splitlines()[0]}"


def load_policy(name: str, cfg: ModelCfg, device: torch.device, meta: bool = False) -> PreTrainedModel:
    """A model folder to train: fp32 masters for full fine-tuning, or the base in ``cfg.dtype`` + fresh LoRA
    adapters (:func:`make_trainable`). ``meta`` (FSDP2 ranks but rank 0: ``Dist.loads_on_meta``): built on the
    meta device from the folder's config, no weight read; ``Dist.wrap`` shards it and rank 0 broadcasts the
    weights."""
    if meta:
        model = empty_model(name, cfg.attn_implementation, dtype=policy_dtype(cfg))
    else:
        model = load_model(name, cfg.dtype, device, trainable=cfg.lora is None,
                           attn_implementation=cfg.attn_implementation)
    return make_trainable(model, cfg.lora, cfg.gradient_checkpointing)


def policy_dtype(cfg: ModelCfg) -> str:
    """The dtype a policy's weights are stored in: fp32 masters for full fine-tuning, ``cfg.dtype`` for the
    frozen base under LoRA (its adapters are fp32 either way)."""
    return "float32" if cfg.lora is None else cfg.dtype


def empty_model(name: str, attn_implementation: str = "sdpa", revision: str | None = None,
                dtype: str = "float32") -> PreTrainedModel:
    """The model of folder ``name`` on the meta device in ``dtype`` (fp32 masters by default; a frozen model's
    ``model.dtype``, as :func:`load_model` stores it): its config and generation config, no weights."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name, revision=revision)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype),
                                                     attn_implementation=attn_implementation)
        if Path(name, "generation_config.json").is_file() or not is_local(name):
            model.generation_config = GenerationConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as e:
        raise ModelLoadError(load_hint(name, e)) from None
    return model.eval()


def make_trainable(model: PreTrainedModel, lora: LoraCfg | None, gradient_checkpointing: bool) -> PreTrainedModel:
    """Gradient checkpointing (non-reentrant, so a frozen base needs no input-grad hook) and, with ``lora``,
    ``peft`` LoRA adapters (the base frozen; adapters in fp32 even on a bf16 base: peft's autocast_adapter_dtype)."""
    if gradient_checkpointing:  # transformers >= 5.2x names it activation checkpointing
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora is None:
        return model
    import peft

    pcfg = peft.LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
                           target_modules=lora.target_modules)
    return peft.get_peft_model(model, pcfg)


def is_lora(model: torch.nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a peft model exists only once peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def adapter_off(model: torch.nn.Module) -> contextlib.AbstractContextManager:
    """Inside: a LoRA model computes as its frozen base (the KL reference without a second copy). A no-op for a
    plain model."""
    return model.disable_adapter() if is_lora(model) else contextlib.nullcontext()


def trainable_params(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


ENV_KWARGS = ("local_files_only",)  # what transformers records in tokenizer_config.json from the load's environment


def save_checkpoint(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: Path,
                    dtype: str = "float32") -> None:
    """``save_pretrained`` model + tokenizer into ``path`` (a standard HF folder), weights in ``dtype``
    (``model.dtype``: a bf16 run's artifacts are half the size of its fp32 masters, which stay in the resumable
    checkpoint; ``config.json`` says ``dtype``). A LoRA model is saved merged (a plain folder that
    ``from_pretrained`` and vLLM load) with its adapter in ``path/adapter``; the model in memory keeps its
    adapter and dtype (the merge and the cast run on copies, tensor by tensor, tied weights cast once)."""
    if is_lora(model):
        import copy

        model.save_pretrained(path / "adapter", safe_serialization=True)
        model = copy.deepcopy(model).merge_and_unload()
    target, cast, memo = getattr(torch, dtype), {}, {}
    for k, v in model.state_dict().items():
        if v.is_floating_point() and v.dtype != target:
            key = (v.data_ptr(), v.dtype, tuple(v.shape))  # a tied weight: one cast tensor, saved once
            v = memo.setdefault(key, v.to(target))
        cast[k] = v
    model.save_pretrained(path, safe_serialization=True, state_dict=cast if memo else None)
    config = json.loads((path / "config.json").read_text())
    if config.get("dtype") != dtype:  # save_pretrained writes the in-memory model's dtype
        (path / "config.json").write_text(json.dumps({**config, "dtype": dtype}, indent=2, sort_keys=True) + "\n")
    env_kwargs = {k: tokenizer.init_kwargs.pop(k) for k in ENV_KWARGS if k in tokenizer.init_kwargs}
    try:  # the load's environment (HF_HUB_OFFLINE=1 -> local_files_only) is not the tokenizer's: same bytes anywhere
        tokenizer.save_pretrained(path)
    finally:
        tokenizer.init_kwargs.update(env_kwargs)


def checkpoint_digest(path: str | Path) -> str:
    """Short sha256 of a checkpoint folder's weight files (what sampled a rollout), or of a hub id's name."""
    import hashlib

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) + sorted(p.glob("*.bin")) if p.is_dir() else []
    if not files:
        return f"name:{path}"
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def resolve_device(pref: str) -> torch.device:
    if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu")


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())

