"""Size and time of a resumable checkpoint, and of a saved model folder, before and after issue 27's changes.

Two models: the pipeline's tiny default (``model.tiny``) and a bigger built Llama (hidden 768, 8 layers, ~56M
parameters, the char tokenizer; as ``benchmarks/evaluate_memory.py``). For each, full fine-tuning and LoRA
(r 16, all linear layers), after one AdamW step:

- ``old``: what ``checkpoint.save_resumable`` wrote before: one ``torch.save`` file with the full model state
  (a LoRA model's frozen base included) and the optimizer state;
- ``new``: ``checkpoint.save`` (DCP, trainable parameters and their moments only, meta.json sidecar), and its
  ``checkpoint.restore`` into a fresh model and optimizer.

and the HF model folder (``modeling.save_checkpoint``) in float32 and in bfloat16. Arms alternate within each
repeat; every repeat is printed.

    python benchmarks/checkpoint.py [REPEATS]   # default 2

prints a table and writes benchmarks/results/checkpoint.json.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain import checkpoint, modeling  # noqa: E402
from posttrain.config import LoraCfg, TinyModel  # noqa: E402

MODELS = {"tiny (default)": TinyModel(),
          "big (768x8)": TinyModel(hidden_size=768, num_layers=8, num_heads=12, intermediate_size=2048,
                                   max_position_embeddings=256)}


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


def _setup(shape: TinyModel, lora: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    tok = modeling.build_char_tokenizer()
    torch.manual_seed(0)
    model = modeling.make_trainable(modeling.build_tiny_model(shape, tok, 0), LoraCfg() if lora else None, False)
    opt = torch.optim.AdamW(modeling.trainable_params(model), lr=1e-4)
    ids = torch.arange(64).reshape(2, 32) % 90 + 4
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    return model, opt


def _old(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> tuple[float, float]:
    path.parent.mkdir(parents=True)
    t0 = time.perf_counter()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "fingerprint": "fp"}, path)
    t1 = time.perf_counter()
    state = torch.load(path, weights_only=False, map_location="cpu")
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return t1 - t0, time.perf_counter() - t1


def _new(model: torch.nn.Module, opt: torch.optim.Optimizer, path: Path) -> tuple[float, float]:
    t0 = time.perf_counter()
    checkpoint.save(path, 1, "fp", model, opt, {"log": []})
    t1 = time.perf_counter()
    checkpoint.restore(path, "fp", model, opt)
    return t1 - t0, time.perf_counter() - t1


def main() -> None:
    repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    work = Path(tempfile.mkdtemp())
    tok = modeling.build_char_tokenizer()
    rows = []
    for mname, shape in MODELS.items():
        for lora in (False, True):
            model, opt = _setup(shape, lora)
            n, n_train = modeling.num_params(model), len(torch.nn.utils.parameters_to_vector(
                modeling.trainable_params(model)))
            for rep in range(repeats):
                for arm, fn in (("old", _old), ("new", _new)) if rep % 2 == 0 else (("new", _new), ("old", _old)):
                    path = work / f"{arm}-{rep}"
                    save_s, load_s = fn(model, opt, path / "ck.pt" if arm == "old" else path)
                    rows.append({"model": mname, "params": n, "trainable": n_train, "lora": lora,
                                 "what": f"resumable checkpoint, {arm}", "repeat": rep, "bytes": _size(path),
                                 "save_s": round(save_s, 3), "load_s": round(load_s, 3)})
                    shutil.rmtree(path)
            for dtype in ("float32", "bfloat16"):
                path = work / f"folder-{dtype}"
                t0 = time.perf_counter()
                modeling.save_checkpoint(model, tok, path, dtype)
                rows.append({"model": mname, "params": n, "trainable": n_train, "lora": lora,
                             "what": f"model folder, {dtype}", "repeat": 0,
                             "bytes": _size(path) - (_size(path / "adapter") if lora else 0),
                             "save_s": round(time.perf_counter() - t0, 3), "load_s": None})
                shutil.rmtree(path)
    shutil.rmtree(work)
    print(f"| model | params | trainable | LoRA | what | repeat | MB | save s | load s |\n|{'---|' * 9}")
    for r in rows:
        print(f"| {r['model']} | {r['params']:,} | {r['trainable']:,} | {r['lora']} | {r['what']} | {r['repeat']} "
              f"| {r['bytes'] / 1e6:.2f} | {r['save_s']} | {r['load_s'] if r['load_s'] is not None else '-'} |")
    out = ROOT / "benchmarks" / "results" / "checkpoint.json"
    out.write_text(json.dumps({"command": "python benchmarks/checkpoint.py " + str(repeats), "rows": rows},
                              indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
