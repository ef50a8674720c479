"""The only place that builds, loads or saves models and tokenizers: ``posttrain.modeling.models`` (models:
build, load, load empty on the meta device, LoRA, save) and ``posttrain.modeling.prompts`` (tokenizers and the
prompt format), re-exported here, plus :func:`init_base`, the starting policy with its tokenizer.
"""

from __future__ import annotations

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from posttrain.config import ModelCfg
from posttrain.modeling.models import (
    adapter_off,
    autocast,
    build_tiny_model,
    checkpoint_digest,
    empty_model,
    is_lora,
    load_model,
    load_policy,
    make_trainable,
    num_params,
    resolve_device,
    save_checkpoint,
    trainable_params,
)
from posttrain.modeling.prompts import (
    BOS,
    CHAT_TEMPLATE,
    EOS,
    PAD,
    UNK,
    apply_prompt,
    build_char_tokenizer,
    load_tokenizer,
    plain_chat_template,
    stop_ids,
    wrap_chat_template,
)

__all__ = ["BOS", "CHAT_TEMPLATE", "EOS", "PAD", "UNK", "adapter_off", "apply_prompt", "autocast",
           "build_char_tokenizer",
           "build_tiny_model", "checkpoint_digest", "empty_model", "init_base", "is_lora", "load_model", "load_policy",
           "load_tokenizer", "make_trainable", "num_params", "plain_chat_template", "resolve_device",
           "save_checkpoint", "stop_ids", "trainable_params", "wrap_chat_template"]


def init_base(cfg: ModelCfg, seed: int, meta: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The starting policy and its tokenizer, prompt format and stops applied (:func:`apply_prompt`): built from
    ``model.tiny`` when ``model.base == 'tiny'``, else loaded (at ``model.revision``). fp32 master weights,
    or the frozen base in ``model.dtype`` when LoRA is on; not yet made trainable (:func:`make_trainable`).
    ``meta`` (``Dist.loads_on_meta``): a loaded base is built on the meta device, its weights read by rank 0
    only (see ``load_policy``); the tiny base is built on every rank (cheap, deterministic)."""
    if cfg.base == "tiny":
        tok = build_char_tokenizer()
        model = build_tiny_model(cfg.tiny, tok, seed)
    elif meta:
        model = empty_model(cfg.base, cfg.attn_implementation, cfg.revision)
        tok = load_tokenizer(cfg.base, cfg.revision)
    else:
        model = load_model(cfg.base, cfg.dtype, trainable=cfg.lora is None, revision=cfg.revision,
                           attn_implementation=cfg.attn_implementation)
        tok = load_tokenizer(cfg.base, cfg.revision)
    apply_prompt(model, tok, cfg.prompt, cfg.base)
    return model, tok
