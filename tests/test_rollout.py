"""Contract of every available rollout backend (vllm joins when importable, on GPU workers)."""

import importlib.util

import pytest
import torch

from posttrain.config import TinyModel
from posttrain.modeling import build_char_tokenizer, build_tiny_model
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids

AVAILABLE = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") and torch.cuda.is_available() else [])


def completion_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The oracle: log p(input_ids[:, t+1] | <= t) from the full [B, T, V] logits of a plain forward. [B, T-1]"""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)


@pytest.fixture(scope="module")
def tiny_model():
    tok = build_char_tokenizer()
    cfg = TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return build_tiny_model(cfg, tok, 0).eval(), tok


@pytest.mark.parametrize("name", AVAILABLE)
def test_backend_contract(name, tiny_model):
    model, tok = tiny_model
    backend = BACKENDS[name](model, tok, 5)  # batch smaller than prompts x n: exercises chunking
    ids = chat_prompt_ids(tok, ["12*3=", "4738*7=", "5*5="])
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=3)
    out = backend.generate(ids, 3, sp)
    assert [len(o) for o in out] == [3, 3, 3]
    for group in out:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) <= 12
            assert all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in {"stop", "length"}
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)
            assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)
    again = backend.generate(ids, 3, sp)  # seeded: same call, same completions
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in out]


def test_hf_sampler_logprobs_match_a_forward_pass(tiny_model):
    """At temperature 1 and top-p 1 the sampler's log-probs are the model's own (trainer recompute)."""
    model, tok = tiny_model
    ids = chat_prompt_ids(tok, ["4738*7="])
    c = BACKENDS["hf"](model, tok, 8).generate(ids, 1, SamplingParams(1.0, 1.0, 10, 0))[0][0]
    seq = torch.tensor([ids[0] + c.token_ids])
    lp = completion_logprobs(model, seq, torch.ones_like(seq))[0, len(ids[0]) - 1 :]
    assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4)


def test_greedy_is_argmax(tiny_model):
    model, tok = tiny_model
    ids = chat_prompt_ids(tok, ["12*3="])
    c = BACKENDS["hf"](model, tok, 8).generate(ids, 2, SamplingParams(0.0, 1.0, 6, 0))[0]
    assert c[0].token_ids == c[1].token_ids
    logits = model(torch.tensor([ids[0]])).logits[0, -1]
    assert c[0].token_ids[0] == int(logits.argmax())


def test_hf_batched_decode_matches_each_sequence_alone(tiny_model):
    """Left padding, the KV cache and rows leaving the batch at EOS mid-decode change nothing: greedy equals
    ``model.generate`` on each prompt alone, and every sampled completion's sampler log-probs equal a
    forward pass over that prompt + completion alone."""
    model, tok = tiny_model
    ids = chat_prompt_ids(tok, ["12*3=", "4738*7=", "5*5=", "99*9=", "1*1="])
    backend = BACKENDS["hf"](model, tok, 64)
    for p, (c,) in zip(ids, backend.generate(ids, 1, SamplingParams(0.0, 1.0, 12, 0)), strict=True):
        ref = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id)[0, len(p) :].tolist()
        assert c.token_ids == ref
    out = backend.generate(ids, 8, SamplingParams(1.0, 1.0, 60, 1))
    lengths = {len(c.token_ids) for g in out for c in g if c.finish_reason == "stop"}
    assert len(lengths) > 3  # rows did leave the batch at several different steps
    for p, group in zip(ids, out, strict=True):
        for c in group:
            seq = torch.tensor([p + c.token_ids])
            lp = completion_logprobs(model, seq, torch.ones_like(seq))[0, len(p) - 1 :]
            assert torch.allclose(lp, torch.tensor(c.logprobs), atol=1e-4)


def test_top_p_keeps_the_smallest_nucleus():
    from posttrain.rollout.hf import sample_next

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    seen = {int(sample_next(logits, SamplingParams(1.0, 0.8, 4, 0), gen)[0]) for _ in range(200)}
    assert seen == {0, 1}  # 0.5 + 0.3 reaches 0.8: tokens 2 and 3 are cut
    tok, lp = sample_next(logits, SamplingParams(1.0, 0.8, 4, 0), gen)
    assert torch.allclose(lp.exp(), torch.tensor([0.5 / 0.8, 0.3 / 0.8])[tok])  # renormalised nucleus


def test_the_growing_kv_cache_computes_what_transformers_dynamic_cache_does(tiny_model):
    """rollout/hf.py's GrowingLayer writes in place where DynamicLayer concatenates: the same logits through a
    prefill, the repeat for n samples, decode steps past a buffer doubling, and rows dropped mid-way."""
    from transformers import DynamicCache

    from posttrain.rollout.hf import growing_cache

    model, _ = tiny_model
    ids = torch.randint(4, 90, (3, 40))
    outs = []
    for cache in (DynamicCache(config=model.config), growing_cache(model.config)):
        with torch.no_grad():
            logits = [model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]]
            cache.batch_repeat_interleave(2)
            tok = logits[0].argmax(-1).repeat_interleave(2)[:, None]
            for step in range(60):  # 40 + 60 positions: past the first 64-position buffer
                if step == 30:
                    cache.batch_select_indices(torch.tensor([0, 2, 5]))
                    tok = tok[[0, 2, 5]]
                logits.append(model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1])
                tok = logits[-1].argmax(-1)[:, None]
        outs.append(logits)
    assert cache.get_seq_length() == 100
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_the_sampler_draws_each_token_with_its_probability():
    """Inverse-transform sampling (one uniform per row) against the softmax it samples: probabilities 0.5, 0.25,
    0.125, 0.125 at temperature 1; at temperature 2 the logits halve: 0.3694, 0.2612, 0.1847, 0.1847, computed
    as softmax(log([.5, .25, .125, .125]) / 2) = sqrt(p) / sum(sqrt(p)) = [.7071, .5, .3536, .3536] / 1.9142."""
    from posttrain.rollout.hf import sample_next

    p = torch.tensor([0.5, 0.25, 0.125, 0.125])
    logits = p.log().repeat(40_000, 1)
    gen = torch.Generator().manual_seed(0)
    for temperature, want in ((1.0, p), (2.0, torch.tensor([0.7071, 0.5, 0.3536, 0.3536]) / 1.9142)):
        tok, lp = sample_next(logits, SamplingParams(temperature, 1.0, 4, 0), gen)
        freq = torch.bincount(tok, minlength=4) / len(tok)
        assert torch.allclose(freq, want, atol=0.01), (temperature, freq)  # 3 sigma of 40,000 draws: ~0.0075
        assert torch.allclose(lp, want.log()[tok], atol=1e-3)


def test_hf_sampling_under_autocast_casts_each_weight_once(tiny_model):
    """The rl stage samples with the trainer's fp32 model inside one ``torch.autocast`` region (model.dtype
    bfloat16). Autocast caches a weight's bf16 cast for the region only outside ``inference_mode``: sampled in
    inference mode, every decoded token recast every weight (docs/performance.md, The compute floor). The tiny
    model's 1 layer has 8 weight matrices (q, k, v, o, gate, up, down, the tied head): 8 casts in all, where
    recasting per forward gives 8 per token (>= 40 for the >= 5 tokens asserted)."""
    from torch.profiler import profile

    model, tok = tiny_model
    shapes = {tuple(w.shape) for w in model.parameters() if w.dim() == 2}
    ids = chat_prompt_ids(tok, ["4738*7="])
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12, seed=0)
    with torch.autocast("cpu", dtype=torch.bfloat16), profile(record_shapes=True) as prof:
        c = BACKENDS["hf"](model, tok, 8).generate(ids, 1, sp)[0][0]
    weight_casts = sum(1 for e in prof.events() if e.name == "aten::_to_copy"
                       and e.input_shapes and tuple(e.input_shapes[0]) in shapes)
    assert len(c.token_ids) >= 5
    assert 0 < weight_casts <= 8, f"{weight_casts} weight casts for {len(c.token_ids)} tokens"


def test_hf_chunks_prompts_of_like_length_and_returns_the_callers_order(tiny_model, monkeypatch):
    """Prompts of 2, 9, 3 and 8 tokens, 2 per chunk: sorted by length the chunks pad to 3 and 9 positions
    (2*3 + 2*9 = 24 prefilled, 22 real) where the caller's order pads to 9 and 8 (2*9 + 2*8 = 34); each prompt's
    greedy completion still comes back at its own index (equal to that prompt generated alone)."""
    model, tok = tiny_model
    ids = [[1, 2], [3, 4, 5, 6, 7, 8, 9, 10, 11], [4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14]]
    backend = BACKENDS["hf"](model, tok, 2)
    widths = []
    chunk = backend._chunk
    monkeypatch.setattr(backend, "_chunk", lambda ps, *a, **k: widths.append(max(map(len, ps))) or chunk(ps, *a, **k))
    sp = SamplingParams(0.0, 1.0, 6, 0)
    out = backend.generate(ids, 1, sp)
    assert sorted(widths) == [3, 9]
    monkeypatch.undo()
    assert [g[0].token_ids for g in out] == [backend.generate([p], 1, sp)[0][0].token_ids for p in ids]
