"""A real-architecture model we can build offline: a byte-level BPE tokenizer trained with ``tokenizers`` on the
shared GSM8K/MATH text (ChatML template, separate ``<|endoftext|>`` / ``<|im_end|>``, as Qwen2.5 base models
ship) and a ``Qwen2ForCausalLM`` from a config (random weights). Saved as a standard HF folder, it goes
through the same ``from_pretrained`` path a hub model does. Used by tests and benchmarks.

    python tests/realmodel.py OUT_DIR [--hidden 64 --layers 2 --vocab-pad 64]   # writes a model folder
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

BENCH = Path(os.environ.get("POSTTRAIN_BENCH") or "/POSTTRAIN_BENCH-is-unset")  # the benchmark files (conftest)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (  # Qwen2.5's template, default system prompt included
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def corpus(max_lines: int = 4000) -> list[str]:
    """Text to train the BPE on: GSM8K-train and MATH-500 from ``$POSTTRAIN_BENCH`` where they are, else the
    repository's own README and docs (English, numbers, LaTeX): a clone builds the tokenizer with nothing
    outside it. The tests that use it assert properties, not ids, so either corpus serves."""
    out: list[str] = []
    files = [BENCH / n for n in ("gsm8k_train.jsonl", "math500.jsonl")]
    if not all(f.is_file() for f in files):
        root = Path(__file__).resolve().parents[1]
        docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
        return [line for f in docs for line in f.read_text().splitlines() if line.strip()][:max_lines]
    for f in files:
        with open(f) as fh:
            for line in fh:
                row = json.loads(line)
                out += [str(v) for v in row.values() if isinstance(v, str)]
                if len(out) >= max_lines:
                    break
    return out


def bpe_tokenizer(vocab_size: int = 1024, chat_template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on benchmark text; eos = <|endoftext|> (a base model's), turns end with <|im_end|>."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = chat_template
    return fast


def qwen2(tok: PreTrainedTokenizerFast | None, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
          vocab_size: int | None = None, tie: bool = False, seed: int = 0, intermediate: int | None = None
          ) -> Qwen2ForCausalLM:
    """Qwen2 of the given shape; ``vocab_size`` defaults to len(tok) rounded up to 64 (real checkpoints pad
    theirs too: Qwen2.5 has 151,936 rows for 151,665 tokens)."""
    v = vocab_size or -(-len(tok) // 64) * 64
    cfg = Qwen2Config(vocab_size=v, hidden_size=hidden, intermediate_size=intermediate or 4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, tie_word_embeddings=tie,
                      eos_token_id=tok.eos_token_id if tok else None, bos_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    if tok is not None:
        model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, bos_token_id=None)
    return model


def full_logp_entropy(model, t, temperature):
    """The old path: the whole [B, T, V] logits, log-softmax over all of it. (Packed rows need use_cache=False:
    with a cache transformers does not derive the block-diagonal mask from the position ids.)"""
    if "gather" in t:
        logits = model(input_ids=t["ids"], position_ids=t["pos"], use_cache=False).logits
    else:
        logits = model(input_ids=t["ids"], attention_mask=t["attn"], use_cache=False).logits
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, -1)
    lp = logp_all.gather(-1, t["ids"][:, 1:, None]).squeeze(-1)
    ent = -(logp_all.exp() * logp_all).sum(-1)
    if "gather" in t:
        lp, ent = lp.flatten()[t["gather"]], ent.flatten()[t["gather"]]
    return lp * t["mask"], ent * t["mask"]


# Qwen2.5-0.5B's shape (config.json of the hub model): 494M parameters, the real vocabulary
QWEN25_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "tie": True,
              "model_vocab": 151_936}


def save_folder(path: Path, hidden: int = 64, layers: int = 2, vocab_size: int = 1024, tie: bool = False,
                seed: int = 0, chat_template: str | None = CHATML, heads: int = 4, kv_heads: int = 2,
                intermediate: int | None = None, model_vocab: int | None = None) -> Path:
    """A model folder: BPE tokenizer of ``vocab_size`` tokens, Qwen2 whose head has ``model_vocab`` rows
    (default: the tokenizer's length rounded up to 64)."""
    tok = bpe_tokenizer(vocab_size, chat_template)
    qwen2(tok, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, vocab_size=model_vocab, tie=tie,
          seed=seed, intermediate=intermediate).save_pretrained(path)
    tok.save_pretrained(path)
    return path


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--tie", action="store_true")
    a = ap.parse_args()
    print(save_folder(a.out, a.hidden, a.layers, a.vocab, a.tie))
