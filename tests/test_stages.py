"""Each stage's run() on tiny fixtures (seconds on CPU)."""

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.config import parse_params
from posttrain.errors import StageError
from posttrain.schema import read_parquet, read_problems
from stages import curate, evaluate, sft


def _outs(p):
    P = p.paths
    return {
        "curate": {"curated_dir": Path(P.curated_dir), "report_dir": Path(P.curate_report_dir),
                   "metrics": Path(P.metrics_dir) / "curate.json"},
        "sft": {"base_model": Path(P.base_model), "model": Path(P.sft_model), "checkpoints": Path(P.sft_checkpoints),
                "report_dir": Path(P.sft_report_dir), "metrics": Path(P.metrics_dir) / "sft.json"},
        "evaluate": {"report_dir": Path(P.eval_report_dir), "metrics": Path(P.metrics_dir) / "evaluate.json"},
    }


def _messy_jsonl(path: Path) -> None:
    """GSM8K-format rows, 3 good and one of each kind of bad."""
    good = [{"question": f"Tom has {i} apples and buys {i + 3} more at the shop. How many apples now?",
             "answer": f"{i}+{i + 3}={2 * i + 3}\n#### {2 * i + 3}"} for i in range(3)]
    lines = [json.dumps(g).encode() for g in good]
    lines += [
        b'{"question": "broken json", "answer": ',  # invalid JSON
        b'{"question": "caf\xe9 latte?", "answer": "#### 3"}',  # not UTF-8
        json.dumps({"question": "no answer field"}).encode(),  # missing field
        json.dumps({"question": "", "answer": "#### 1"}).encode(),  # empty prompt
        json.dumps({"question": "x" * 5000, "answer": "#### 1"}).encode(),  # absurd length
        json.dumps({"question": "What is the capital?", "answer": "#### "}).encode(),  # empty gold
        json.dumps({"question": "Unparseable gold here?", "answer": "#### \\frac{"}).encode(),  # bad gold
        json.dumps(good[0]).encode(),  # exact duplicate
        json.dumps([1, 2]).encode(),  # not an object
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")


def test_curate_synthetic_counts_reconcile(tiny):
    p = parse_params(tiny)
    counts = curate.run(p, {}, _outs(p)["curate"])
    assert counts["in"] == counts["kept"] + counts["quarantined"] + counts["duplicates"] + counts["contaminated"]
    d = Path(p.paths.curated_dir)
    train, demos, ev = (read_problems(d / f"{s}.parquet") for s in ("train", "sft", "eval"))
    assert len(ev) == 12 and len(demos) == 100 and len(train) == counts["train"]
    ids = [r["id"] for r in train + demos]
    assert len(ids) == len(set(ids))  # SFT demos and RL prompts are disjoint
    eval_prompts = {r["prompt"] for r in ev}
    assert not eval_prompts & {r["prompt"] for r in train + demos}  # decontaminated against eval
    report = json.loads((Path(p.paths.curate_report_dir) / "decontamination.json").read_text())
    assert report["benchmarks"]["eval_split"]["matched_rows"] == counts["contaminated"]
    assert (Path(p.paths.curate_report_dir) / "decontamination.md").read_text().startswith("# Decontamination")


def test_curate_quarantines_malformed_rows(tiny, tmp_path):
    src = tmp_path / "messy.jsonl"
    _messy_jsonl(src)
    tiny["task"] = {"kind": "math"}
    tiny["curate"]["sources"] = [{"kind": "file", "name": "messy", "path": str(src), "format": "gsm8k"}]
    tiny["curate"]["eval"] = {"source": {"kind": "file", "name": "messy_eval", "path": str(src), "format": "gsm8k",
                                         "limit": 1}, "size": 1}
    tiny["curate"]["sft_size"] = 1
    p = parse_params(tiny)
    counts = curate.run(p, {}, _outs(p)["curate"])
    assert counts["in"] == 12
    assert counts["quarantined"] == 8
    assert counts["duplicates"] == 1
    assert counts["contaminated"] == 1  # row 0 is also the eval split's only row
    assert counts["kept"] == 2
    q = [json.loads(line) for line in (Path(p.paths.curated_dir) / "quarantine.jsonl").read_text().splitlines()]
    reasons = " | ".join(r["reason"] for r in q)
    for expected in ("invalid JSON", "not UTF-8", "malformed row", "empty prompt", "prompt length",
                     "unparseable gold", "not a JSON object"):
        assert expected in reasons


def test_curate_fails_above_contamination_limit(tiny):
    tiny["curate"]["decontam"]["max_contaminated_frac"] = 0.0
    tiny["curate"]["sources"][0]["num_rows"] = 3000  # enough draws to hit the 12 eval problems
    p = parse_params(tiny)
    with pytest.raises(StageError, match="max_contaminated_frac"):
        curate.run(p, {}, _outs(p)["curate"])
    assert (Path(p.paths.curate_report_dir) / "decontamination.md").exists()  # the report is still written


def test_sft_then_evaluate(tiny):
    p = parse_params(tiny)
    o = _outs(p)
    curate.run(p, {}, o["curate"])
    m = sft.run(p, {"demos": Path(p.paths.curated_dir) / "sft.parquet"}, o["sft"])
    assert m["steps"] == 8 and m["resumed_from_step"] == 0
    log_lines = (Path(p.paths.sft_report_dir) / "train_log.csv").read_text().splitlines()
    assert log_lines[0].startswith("step,phase,loss") and len(log_lines) == 1 + 4
    assert not Path(p.paths.sft_checkpoints).exists()  # removed once the model is written
    for path in (p.paths.base_model, p.paths.sft_model):  # standard HF folders, reloadable offline
        AutoModelForCausalLM.from_pretrained(path)
        assert AutoTokenizer.from_pretrained(path).chat_template

    res = evaluate.run(p, {"eval": Path(p.paths.curated_dir) / "eval.parquet", "models": dict(p.evaluate.models)},
                       o["evaluate"])
    for name in ("base", "sft"):
        r = res["eval"][name]
        assert r["n"] == 12 and 0 <= r["greedy"] <= 1
        assert r["pass@1"] <= r["pass@2"] <= r["pass@4"]  # pass@k is monotone in k
        assert r["pass@1_ci"][0] <= r["pass@1"] <= r["pass@1_ci"][1]
    gens = read_parquet(Path(p.paths.eval_report_dir) / "generations.parquet")
    assert len(gens) == 2 * 12 * (1 + 4)
    assert "| sft |" in (Path(p.paths.eval_report_dir) / "report.md").read_text()


def test_evaluate_counts_unscorable_gold_out_of_denominators(tiny, tmp_path):
    """A benchmark row whose gold cannot be parsed is unscorable: never counted correct."""
    from posttrain.schema import PROBLEM_SCHEMA, write_parquet

    p = parse_params(tiny)
    o = _outs(p)
    curate.run(p, {}, o["curate"])
    sft.run(p, {"demos": Path(p.paths.curated_dir) / "sft.parquet"}, o["sft"])
    rows = [{"id": "g:0", "source": "g", "task": "arith", "prompt": "12*3=", "answer": "36", "solution": None},
            {"id": "g:1", "source": "g", "task": "arith", "prompt": "12*4=", "answer": "n/a", "solution": None}]
    write_parquet(tmp_path / "ev.parquet", rows, PROBLEM_SCHEMA)
    res = evaluate.run(p, {"eval": tmp_path / "ev.parquet", "models": {"sft": p.paths.sft_model}}, o["evaluate"])
    assert res["eval"]["sft"]["n"] == 1 and res["eval"]["sft"]["unscorable"] == 1
