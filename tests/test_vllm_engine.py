"""The real-engine tier: our ``VLLMBackend`` on a real vLLM engine (vLLM's CPU build in ``.venv-vllm``).

``make test-vllm`` (``pytest tests/test_vllm*.py`` in ``.venv-vllm``, the last step of ``make test``; the tier's
tests are marked ``vllm``). Skipped
where vLLM is not installed. One engine is built for the module (about 20-40 s on two cores) on the tiny
default Llama shape (head_dim 32: vLLM's CPU attention supports 32-512, not the 16 of the fast tests' model),
in float32 so the engine and the trainer compute the same distribution.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: the default takes half the host

from posttrain.config import ConfigError, TinyModel, VLLMOptions  # noqa: E402
from posttrain.modeling import build_char_tokenizer, build_tiny_model, load_model, save_checkpoint  # noqa: E402
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids, generator  # noqa: E402

SHAPE = TinyModel(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=256)
OPTS = VLLMOptions(dtype="float32", max_model_len=256, enforce_eager=True)  # no inductor compile


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("vllm") / "policy"
    tok = build_char_tokenizer()
    save_checkpoint(build_tiny_model(SHAPE, tok, 0), tok, d)
    return d


@pytest.fixture(scope="module")
def engine(folder):
    """(trainer model, tokenizer, backend): the backend built as every stage builds it."""
    tok = build_char_tokenizer()
    model = load_model(str(folder), "float32")
    return model, tok, BACKENDS["vllm"](model, tok, 256, OPTS)


def trainer_logprobs(model: torch.nn.Module, prompt: list[int], completion: list[int], temperature: float = 1.0
                     ) -> torch.Tensor:
    """The trainer's log-prob of each completion token: one full forward, logits / T, log-softmax, gather."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).squeeze(1)


def gap(model, prompts, groups) -> float:
    """Mean |sampler - trainer| log-prob over every token of every completion."""
    diffs = [(torch.tensor(c.logprobs) - trainer_logprobs(model, p, c.token_ids)).abs()
             for p, g in zip(prompts, groups, strict=True) for c in g if c.token_ids]
    return float(torch.cat(diffs).mean())


PROMPTS = ["12+34=", "7*8=", "100-1=", "3*3*3="]


def test_real_outputs_become_completions_n_greater_than_1_stop_and_length(engine):
    model, tok, backend = engine
    ids = chat_prompt_ids(tok, PROMPTS)
    groups = backend.generate(ids, 4, SamplingParams(1.0, 1.0, 12, 0))
    assert [len(g) for g in groups] == [4] * len(PROMPTS)
    for g in groups:
        for c in g:
            assert len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs)
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == 12
            else:  # the stop token is kept, as the hf backend keeps it
                assert c.token_ids[-1] in backend.stop_token_ids
    # stop ids hit often: a backend whose stop set is half the vocabulary gives "stop" finishes, stop id last
    from posttrain.rollout.vllm import VLLMBackend

    half = VLLMBackend(backend.engine, list(range(0, len(tok), 2)))
    stopped = [c for g in half.generate(ids, 4, SamplingParams(1.0, 1.0, 12, 1)) for c in g]
    assert any(c.finish_reason == "stop" for c in stopped)
    assert all(c.token_ids[-1] % 2 == 0 for c in stopped if c.finish_reason == "stop")
    # a stop string ends the text before it, as in the hf backend
    texts = VLLMBackend(backend.engine, backend.stop_token_ids, ["1"]).generate(ids, 4, SamplingParams(1.0, 1.0, 24, 2))
    assert all("1" not in c.text for g in texts for c in g)


def test_sampler_logprobs_equal_the_trainers_in_float32(engine):
    model, tok, backend = engine
    ids = chat_prompt_ids(tok, PROMPTS)
    for temperature in (1.0, 0.7):
        groups = backend.generate(ids, 2, SamplingParams(temperature, 1.0, 16, 3))
        diffs = [(torch.tensor(c.logprobs) - trainer_logprobs(model, p, c.token_ids, temperature)).abs()
                 for p, g in zip(ids, groups, strict=True) for c in g]
        assert float(torch.cat(diffs).mean()) <= 1e-5, temperature


def test_identical_prompts_get_different_completions_and_samples_are_not_correlated_across_prompts(engine):
    """Found on the real engine: one seed per call, and vLLM seeds sample j of each request with seed + j, so
    identical prompts got identical completions and sample j agreed across distinct prompts 90-99% of tokens."""
    _, tok, backend = engine
    same = backend.generate(chat_prompt_ids(tok, ["5+5="] * 6), 1, SamplingParams(1.0, 1.0, 16, 4))
    assert len({tuple(g[0].token_ids) for g in same}) == 6
    distinct = [f"{a}+{a + 3}=" for a in range(10, 26)]
    groups = backend.generate(chat_prompt_ids(tok, distinct), 4, SamplingParams(1.0, 1.0, 8, 5))
    # the first sampled token of sample j across distinct prompts: random models spread over ~100 characters,
    # so two prompts agree by chance rarely; with correlated seeds nearly always
    pairs = agree = 0
    for j in range(4):
        firsts = [g[j].token_ids[0] for g in groups]
        for a in range(len(firsts)):
            for b in range(a + 1, len(firsts)):
                pairs, agree = pairs + 1, agree + (firsts[a] == firsts[b])
    assert agree / pairs < 0.2, agree / pairs


def test_a_call_whose_seeded_prompts_exceed_one_engine_step_runs_on_cpu(engine):
    """Found on the real engine: seeded requests + chunked prefill crash vllm-cpu 0.32 ("CPU Generator does not
    use offset") once a call's prompt tokens exceed max_num_batched_tokens (4096). Chunked prefill is off on CPU
    by default (rollout.vllm.enable_chunked_prefill: null); with it on, this call crashed (watched)."""
    _, tok, backend = engine
    ids = chat_prompt_ids(tok, [f"{1000 + i}*{i % 9 + 2}= and some padding text" for i in range(256)])
    assert sum(map(len, ids)) > 4096
    groups = backend.generate(ids, 1, SamplingParams(1.0, 1.0, 4, 8))
    assert len(groups) == 256 and all(len(g[0].token_ids) >= 1 for g in groups)


def _one_step(model: torch.nn.Module, tok, seed: int = 0) -> None:
    """One real AdamW step on an SFT loss: the weights move."""
    torch.manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2)
    ids = torch.tensor([chat_prompt_ids(tok, ["2+2="])[0] + tok("4").input_ids])
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()


def test_weight_sync_after_a_real_optimizer_step_and_the_prefix_cache_trap(engine, folder, monkeypatch):
    model, tok, backend = engine
    ids = chat_prompt_ids(tok, [p * 25 for p in PROMPTS])  # >= one whole prefix-cache block (128 on CPU)
    sp = SamplingParams(1.0, 1.0, 8, 6)
    backend.load_weights(model, "v0")
    before = backend.generate(ids, 2, sp)
    assert gap(model, ids, before) <= 1e-5
    trained = load_model(str(folder), "float32", trainable=True)
    _one_step(trained, tok)
    assert gap(trained, ids, before) > 1e-3  # the step moved the distribution
    # the trap, proven by disabling the reset: the cached prompt KV of the old weights serves the new ones
    monkeypatch.setattr(backend.engine, "reset_prefix_cache", lambda: None)
    backend.load_weights(trained, "v1")
    stale = gap(trained, ids, backend.generate(ids, 2, sp))
    monkeypatch.undo()
    backend.engine.reset_prefix_cache()
    fresh = gap(trained, ids, backend.generate(ids, 2, sp))
    assert fresh <= 1e-5 < stale, (fresh, stale)
    backend.load_weights(model, "v0-again")  # the module's engine serves the folder's weights again


def test_a_lora_policy_is_synced_merged(engine, folder):
    from posttrain.config import LoraCfg
    from posttrain.modeling import make_trainable

    model, tok, backend = engine
    lora = make_trainable(load_model(str(folder), "float32", trainable=True),
                          LoraCfg(r=4, alpha=8, dropout=0.0, target_modules="all-linear"), False)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.copy_(0.05 * torch.randn_like(p))
    ids = chat_prompt_ids(tok, PROMPTS)
    backend.load_weights(lora, "lora-1")
    groups = backend.generate(ids, 2, SamplingParams(1.0, 1.0, 12, 7))
    assert gap(lora, ids, groups) <= 1e-5 and gap(model, ids, groups) > 1e-3
    backend.load_weights(model, "v0-after-lora")


def test_the_stage_thread_count_holds_after_the_engine_is_built(engine):
    """Found on the real engine: vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole
    process, so the rl stage's update ran on the engine's threads whatever runtime.train_threads said."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(before)
    assert torch.get_num_threads() == before


def test_an_explicit_sleep_level_on_cpu_is_one_line_before_any_engine(folder):
    tok = build_char_tokenizer()
    with pytest.raises(ConfigError, match="sleep_level: 1 needs vLLM's sleep mode") as e:
        BACKENDS["vllm"](load_model(str(folder), "float32"), tok, 8, VLLMOptions(sleep_level=1))
    assert "\n" not in str(e.value)


def test_the_generator_names_vllms_cpu_build():
    from importlib.metadata import version

    assert generator("vllm") == f"vllm-cpu {version('vllm-cpu')}"  # this tier runs in .venv-vllm


def test_one_engine_per_rank_under_torchrun_with_external_launcher(folder, tmp_path):
    """H1 (read in vLLM's source): under torchrun the default executor put every rank's engine on device 0 and
    built vLLM's world group over the trainer's ranks. With ``external_launcher`` each rank's engine serves its
    own trainer's weights (after a sync), the trainer's group still works, and the job exits cleanly (vLLM's
    groups destroyed before the trainer's: left to the engine's exit hook, each rank printed a traceback)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(repo / "tests" / "vllm_ranks.py"), str(folder), str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=repo)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    assert all(x["world"] == 2 and x["all_reduce"] == 3.0 for x in ranks)  # 1 + 2
    assert all(x["max_gap"] < 1e-4 for x in ranks), [x["max_gap"] for x in ranks]  # each engine: its own trainer
    # one request, one seed on both ranks: what differs is each engine's weights, its own rank's
    assert (ranks[0]["tokens"], ranks[0]["logprobs"]) != (ranks[1]["tokens"], ranks[1]["logprobs"])


def test_fsdp2_streams_the_weights_into_each_ranks_engine_without_the_full_copy(folder, tmp_path):
    """Issue 50, item 1: under FSDP2 each rank's engine was synced from ``Dist.plain``'s full copy of the policy.
    ``tests/vllm_fsdp2.py`` (2 ranks, gloo): each rank holds half the weights, takes an AdamW step, syncs its
    engine from ``Dist.for_generation``'s stream; the copy is still unallocated after the sync, and the engine
    samples from the new weights (log-prob gap < 1e-4) and not the old ones (gap > 1e-3)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        str(repo / "tests" / "vllm_fsdp2.py"), str(folder), str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=repo)
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    print(ranks)
    for x in ranks:
        assert x["world"] == 2 and x["local_params"] < x["params"] and x["copy_bytes_after_sync"] == 0
        assert x["gap_new"] < 1e-4 < 1e-3 < x["gap_old"], x


def _teach(model: torch.nn.Module, tok, transcripts: dict[str, str], steps: int = 200) -> torch.nn.Module:
    """A copy of ``model`` trained (AdamW, completion tokens only) to write each prompt's transcript, tool call
    and observation included: a policy that calls tools, as the SFT stage's tool demos teach one."""
    import copy

    torch.manual_seed(0)
    m = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    seqs = []
    for p, t in transcripts.items():
        prompt = chat_prompt_ids(tok, [p])[0]
        ids = prompt + tok(t, add_special_tokens=False).input_ids + [tok.eos_token_id]
        seqs.append((torch.tensor([ids]), torch.tensor([[-100] * len(prompt) + ids[len(prompt):]])))
    for _ in range(steps):
        for ids, labels in seqs:
            m(input_ids=ids, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m.eval()


def test_tool_rollouts_on_the_engine_equal_the_hf_backends_and_mask_observations(engine):
    """Multi-turn tool rollouts through the real engine: the closing tag is a vLLM stop string of the call, the
    turn's ids keep it, the observation's ids are appended and the engine continues from prompt + every id so far.
    Greedy transcripts equal the hf backend's token for token; sampled ones carry the trainer's log-prob on every
    model token and 0 on observation tokens. Before the backend passed the call's stop strings to vLLM, the engine
    ran past the tag and wrote its own observation as model tokens: "<tool=calc>2+3</tool><obs>5</obs>5<obs>5</obs>5",
    no tool called (watched)."""
    from posttrain.config import ToolsCfg
    from posttrain.tools import ToolBackend, ToolContext

    model, tok, backend = engine
    taught = _teach(model, tok, {"2+3=": "<tool=calc>2+3</tool><obs>5</obs>5",
                                 "4*6=": "<tool=calc>4*6</tool><obs>24</obs>24"})
    backend.load_weights(taught, "tool-demo")
    try:
        cfg, ctx = ToolsCfg(enabled=True, names=["calc"]), ToolContext(sandbox=lambda: pytest.fail("calc only"))
        on_engine = ToolBackend(backend, tok, cfg, ctx)
        on_hf = ToolBackend(BACKENDS["hf"](taught, tok, 8), tok, cfg, ctx)
        ids = chat_prompt_ids(tok, ["2+3=", "4*6="])
        greedy = SamplingParams(0.0, 1.0, 48, 0)
        a = [c for g in on_engine.generate(ids, 1, greedy) for c in g]
        b = [c for g in on_hf.generate(ids, 1, greedy) for c in g]
        assert [c.text for c in a] == ["<tool=calc>2+3</tool><obs>5</obs>5", "<tool=calc>4*6</tool><obs>24</obs>24"]
        assert [(c.token_ids, c.loss_mask, c.tool_calls, c.finish_reason) for c in a] == \
            [(c.token_ids, c.loss_mask, c.tool_calls, c.finish_reason) for c in b]
        assert [c.loss_mask.count(0) for c in a] == [len("<obs>5</obs>"), len("<obs>24</obs>")]
        sampled = on_engine.generate(ids, 4, SamplingParams(1.0, 1.0, 48, 1))
        assert sum(c.tool_calls for g in sampled for c in g) >= 4
        for p, g in zip(ids, sampled, strict=True):
            for c in g:
                m = torch.tensor(c.loss_mask, dtype=torch.bool)
                lp = trainer_logprobs(taught, p, c.token_ids)
                assert torch.allclose(lp[m], torch.tensor(c.logprobs)[m], atol=1e-4)
                assert all(x == 0.0 for x, k in zip(c.logprobs, c.loss_mask, strict=True) if not k)
    finally:
        backend.load_weights(model, "after-tools")
