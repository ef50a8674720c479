"""Peak memory of the evaluate stage over several models: is only one model resident at a time?

Builds three random-init Llamas of ~56M parameters (hidden 768, 8 layers: ~227 MB fp32 each, the char
tokenizer) as HF folders and 8 eval problems, then runs ``stages.evaluate`` on all three in a child process
and reads its peak RSS (``ru_maxrss``). One model resident at a time costs about one model's size; a
model still referenced while the next loads costs two. In bfloat16 the weights are converted on load (anonymous
memory); in float32 they stay memory-mapped from the safetensors files, whose clean pages RSS barely shows.

    python benchmarks/evaluate_memory.py [N] [DTYPE]  # N models (default 3), model.dtype (default bfloat16)

prints a table and writes benchmarks/results/evaluate_memory.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from posttrain import modeling  # noqa: E402
from posttrain.config import TinyModel  # noqa: E402
from posttrain.schema import PROBLEM_SCHEMA, write_parquet  # noqa: E402

BIG = TinyModel(hidden_size=768, num_layers=8, num_heads=12, intermediate_size=2048, max_position_embeddings=256)


def main() -> None:
    n_models = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    dtype = sys.argv[2] if len(sys.argv) > 2 else "bfloat16"
    work = Path(tempfile.mkdtemp())
    tok = modeling.build_char_tokenizer()
    models = {}
    for i in range(n_models):
        models[f"m{i}"] = str(work / f"m{i}")
        modeling.save_checkpoint(modeling.build_tiny_model(BIG, tok, i), tok, Path(models[f"m{i}"]))
    size_mb = modeling.num_params(modeling.build_tiny_model(BIG, tok, 0)) * 4 / 2**20
    write_parquet(work / "eval.parquet", [{"id": f"e:{i}", "source": "e", "task": "arith", "prompt": f"{12 + i}*3=",
                                           "answer": str((12 + i) * 3), "solution": None} for i in range(8)],
                  PROBLEM_SCHEMA)
    raw = yaml.safe_load((ROOT / "params.yaml").read_text())
    raw["paths"] = {k: str(work / k) for k in raw["paths"]}
    raw["runtime"]["progress"] = False
    raw["model"]["dtype"] = dtype
    raw["tracking"]["enabled"] = False
    raw["evaluate"].update({"models": models, "samples_per_prompt": 2, "ks": [1, 2], "sample_prompts": None,
                            "compare": [], "bootstrap": 10})
    raw["evaluate"]["sampling"]["max_new_tokens"] = 8
    (work / "params.yaml").write_text(yaml.safe_dump(raw))
    code = ("import resource, sys, json; from pathlib import Path; from posttrain.config import load_params; "
            "from stages import evaluate; p = load_params(sys.argv[1]); "
            "evaluate.run(p, {'eval': Path(sys.argv[2]), 'models': dict(p.evaluate.models)}, "
            "{'report_dir': Path(sys.argv[3]) / 'r', 'metrics': Path(sys.argv[3]) / 'm.json'}); "
            "print(json.dumps({'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))")
    r = subprocess.run([sys.executable, "-c", code, str(work / "params.yaml"), str(work / "eval.parquet"), str(work)],
                       capture_output=True, text=True, cwd=ROOT, check=True)
    peak = json.loads(r.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    res = {"models": n_models, "dtype": dtype, "model_mb_fp32": round(size_mb, 1), "peak_rss_mb": round(peak, 1),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=ROOT).stdout.strip()}
    print("| models | dtype | one model (fp32 MB) | evaluate peak RSS MB |\n|---:|---|---:|---:|")
    print(f"| {n_models} | {dtype} | {res['model_mb_fp32']} | {res['peak_rss_mb']} |")
    out = ROOT / "benchmarks" / "results" / "evaluate_memory.json"
    out.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
