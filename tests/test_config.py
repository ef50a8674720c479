import subprocess
import sys
import time

import pytest
import yaml
from conftest import REPO, repo_params, tiny_raw

from posttrain.config import ConfigError, load_params, parse_params
from posttrain.errors import ModelLoadError
from posttrain.modeling import load_model


def test_repo_params_validate():
    p = load_params(REPO / "params.yaml")
    assert p.sft.total_steps == sum(ph.steps for ph in p.sft.phases)


@pytest.mark.parametrize("mutate,expected", [
    (lambda p: p["sft"].update(bach_size=3), "sft.bach_size: unknown key"),
    (lambda p: p["sft"].update(lr="fast"), "sft.lr: Input should be a valid number"),
    (lambda p: p["curate"]["decontam"].update(threshold=1.5), "curate.decontam.threshold: Input should be less"),
    (lambda p: p.update(curate={**p["curate"], "sources": [{"kind": "file", "name": "x", "path": "nope.jsonl",
                                                            "format": "gsm8k"}]}),
     "curate.sources[0].path: Value error, file not found: nope.jsonl"),
    (lambda p: p["evaluate"].update(ks=[1, 128]),
     "evaluate.ks: Value error, every k must be in [1, samples_per_prompt=64]"),
    (lambda p: p.pop("sft"), "sft: Field required"),
    (lambda p: p["task"].update(kind="chess"), "task: Input tag 'chess'"),
    # combinations that would silently do the wrong thing (issue: correctness at real settings)
    (lambda p: p["model"].update(dtype="float16"), "model.dtype: Value error, float16 needs loss scaling"),
    (lambda p: p["rl"]["sampling"].update(temperature=0), "rl.sampling.temperature: Value error, RL needs "),
    (lambda p: p["rl"]["sampling"].update(top_p=0.9), "rl.sampling.top_p: Value error, the trainer cannot score"),
    (lambda p: p["rl"].update(kl_estimator="k1"), "rl.kl_estimator: Input should be 'k2' or 'k3'"),
    (lambda p: p["rl"].update(advantage="reinforce_pp"), "rl.dynamic_sampling: Value error, reinforce_pp"),
    (lambda p: p["rl"].update(advantage="reinforce_pp", dynamic_sampling="off", kl_coef=0.1),
     "rl.kl_coef: Value error, reinforce_pp puts the KL in the reward"),
    (lambda p: p["rl"].update(advantage="rloo", kl_coef=0.1), "rl.kl_coef: Value error, rloo puts the KL in the"),
    (lambda p: p["rl"].update(token_select="top"), "rl.token_select: Value error, unknown token selection 'top'"),
    (lambda p: p["rl"]["select"].update(strategy="best"), "rl.select.strategy: Value error, unknown prompt selec"),
    (lambda p: p["report"].update(compare=[["sft", "teacher"]]), "params: report.compare: ['teacher'] not in"),
    # several processes: multi-node needs a rendezvous; no sharded LoRA
    (lambda p: p["runtime"].update(distributed={"nnodes": 2}),
     "runtime.distributed.rdzv_endpoint: Value error, nnodes > 1 needs"),
    (lambda p: (p["runtime"].update(distributed={"nproc_per_node": 2, "strategy": "fsdp2"}),
                p["model"].update(lora={"r": 4})), "params: runtime.distributed.strategy: fsdp2 with model.lora"),
])
def test_bad_config_names_the_key(mutate, expected):
    raw = repo_params()
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        parse_params(raw)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


@pytest.mark.slow  # over 2 s: out of the fast suite
@pytest.mark.parametrize("cmd", [["posttrain.cli", "validate", "--params"], ["stages.curate", "--params"]])
def test_broken_params_exit_2_with_one_line(tmp_path, cmd):
    raw = repo_params()
    raw["sft"]["lr"] = "fast"
    bad = tmp_path / "params.yaml"
    bad.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", *cmd, str(bad)], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "sft.lr" in r.stderr
    assert not (tmp_path / "data").exists()  # failed before any work


def test_hub_id_offline_fails_fast(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t = time.time()
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        load_model("someone/not-a-cached-model")
    assert time.time() - t < 10
    with pytest.raises(ModelLoadError, match="no such folder"):
        load_model("./models/does-not-exist")


def test_the_real_run_profile_is_a_valid_params_file():
    """profiles/real-gsm8k.yaml is what the docs (real-models.md) tell users to copy over params.yaml: it must stay
    valid as the params schema changes (the slow real-model DAG test runs it shrunk)."""
    p = parse_params(yaml.safe_load((REPO / "profiles" / "real-gsm8k.yaml").read_text()))
    assert p.task.kind == "math" and p.model.lora is not None and p.rollout.num_prompts is None
    assert "<|im_end|>" in p.model.prompt.stop and "\\boxed{}" in p.model.prompt.instruction


def test_distributed_stages_relaunch_under_torchrun_with_the_same_arguments():
    from posttrain.runner import torchrun_argv

    raw = repo_params()
    raw["sft"]["micro_batch_size"] = 4  # 64 = 16 ranks x 4
    raw["runtime"]["distributed"] = {"nproc_per_node": 8}
    one = torchrun_argv("rl", parse_params(raw), ["--params", "p.yaml"])
    assert one == [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=8", "--standalone", "-m",
                   "stages.rl", "--params", "p.yaml"]
    raw["runtime"]["distributed"] = {"nproc_per_node": 8, "nnodes": 2, "rdzv_endpoint": "node0:29500"}
    two = torchrun_argv("rl", parse_params(raw), [])
    assert two[3:] == ["--nproc_per_node=8", "--nnodes=2", "--rdzv_backend=c10d", "--rdzv_endpoint=node0:29500",
                       "--rdzv_id=posttrain-rl", "-m", "stages.rl"]


def test_params_are_read_as_yaml_1_2_like_dvc_writes_them(tmp_path):
    """`dvc exp run -S rl.dynamic_sampling=off` writes `dynamic_sampling: off` unquoted (DVC's YAML is 1.2,
    where `off` is a string); a YAML 1.1 reader takes it for the boolean false and the stage refused it."""
    text = (REPO / "params.yaml").read_text().replace("dynamic_sampling: skip", "dynamic_sampling: off")
    (tmp_path / "params.yaml").write_text(text)
    assert load_params(tmp_path / "params.yaml").rl.dynamic_sampling == "off"


def _minimal() -> dict:
    """params.yaml reduced to its required keys: every other value is the model's default."""
    raw = repo_params()
    return {"paths": raw["paths"], "curate": {"sources": raw["curate"]["sources"]},
            "sft": {"phases": raw["sft"]["phases"]}, "rollout": {}, "reward": {"rewards": raw["reward"]["rewards"]},
            "rl": {}, "distill": {"teacher": raw["distill"]["teacher"]},
            "evaluate": {"models": raw["evaluate"]["models"]}}


# docs/configuration.md "Refused combinations": row -> (what to set on the minimal params, the key the error names).
# Each sets one side of the rule; the other side keeps its default.
REFUSALS = {
    "`rl.advantage: psr` with `rl.dynamic_sampling` not `off`": ({"rl": {"advantage": "psr"}}, "rl.dynamic_sampling"),
    "`rl.advantage: nsr` with `rl.dynamic_sampling` not `off`": ({"rl": {"advantage": "nsr"}}, "rl.dynamic_sampling"),
    "`rl.advantage: w_reinforce` with `rl.dynamic_sampling` not `off`":
        ({"rl": {"advantage": "w_reinforce"}}, "rl.dynamic_sampling"),
    "`rl.advantage: reinforce_pp` with `rl.dynamic_sampling` not `off`":
        ({"rl": {"advantage": "reinforce_pp"}}, "rl.dynamic_sampling"),
    "`rl.advantage: rloo` with `rl.kl_coef` > 0": ({"rl": {"advantage": "rloo", "kl_coef": 0.1}}, "rl.kl_coef"),
    "`rl.advantage: reinforce_pp` with `rl.kl_coef` > 0":
        ({"rl": {"advantage": "reinforce_pp", "dynamic_sampling": "off", "kl_coef": 0.1}}, "rl.kl_coef"),
    "`rl.prior_budget` > 0 without `rl.advantage: prior_fused`": ({"rl": {"prior_budget": 8}}, "rl.prior_budget"),
    "`rl.ref_reset` without `rl.kl_coef` or `rl.kl_reward_coef` > 0": ({"rl": {"ref_reset": {"every": 5}}},
                                                                      "rl.ref_reset"),
    "`rl.ref_reset` with `model.lora`": ({"rl": {"ref_reset": {"every": 5}, "kl_coef": 0.1}, "model": {"lora": {}}},
                                         "rl.ref_reset: with model.lora"),
    "`rl.sampling.temperature: 0`": ({"rl": {"sampling": {"temperature": 0}}}, "rl.sampling.temperature"),
    "`rl.sampling.top_p` < 1": ({"rl": {"sampling": {"top_p": 0.9}}}, "rl.sampling.top_p"),
    "`model.dtype: float16`": ({"model": {"dtype": "float16"}}, "model.dtype"),
    "`distill.grpo_steps` > 0 with `rl.kl_coef` or `rl.kl_reward_coef` > 0":
        ({"distill": {"grpo_steps": 2}, "rl": {"kl_reward_coef": 0.1}}, "distill.grpo_steps"),
    "`runtime.distributed.strategy: fsdp2` with `model.lora`":
        ({"runtime": {"distributed": {"nproc_per_node": 2, "strategy": "fsdp2"}}, "model": {"lora": {}}},
         "runtime.distributed.strategy"),
    "`runtime.distributed.nnodes` > 1 without `rdzv_endpoint`": ({"runtime": {"distributed": {"nnodes": 2}}},
                                                                 "runtime.distributed.rdzv_endpoint"),
    "`evaluate.ks` beyond `evaluate.samples_per_prompt`": ({"evaluate": {"ks": [16]}}, "evaluate.ks"),
    "a synthetic source, or no `curate.eval.source`, with `task.kind: math`": ({"task": {"kind": "math"}}, "curate"),
    "`report.compare` naming a model not in `evaluate.models`": ({"report": {"compare": [["sft", "teacher"]]}},
                                                                 "report.compare"),
    "`model.prompt.system` for the tiny model (its chat template has no system turn)":
        ({"model": {"prompt": {"system": "You are helpful."}}}, "model.prompt.system"),
    "`tracking.champion` naming a metric evaluate does not write": ({"tracking": {"champion": "eval.pass@5"}},
                                                                    "tracking.champion"),
    "`task.min_digits` > `task.max_digits`": ({"task": {"kind": "arith", "min_digits": 5}}, "task.min_digits"),
    "`model.tiny.hidden_size` not divisible by `model.tiny.num_heads`": ({"model": {"tiny": {"hidden_size": 130}}},
                                                                         "model.tiny.hidden_size"),
    "`model.prompt.template` without exactly one `{prompt}`": ({"model": {"prompt": {"template": "Q: A:"}}},
                                                              "model.prompt.template"),
    "`rl.overlap` with `rl.dynamic_sampling: refill`":
        ({"rl": {"overlap": {}, "dynamic_sampling": "refill"}}, "rl.dynamic_sampling"),
    "`rl.overlap` with `rl.prior_budget` > 0":
        ({"rl": {"overlap": {}, "advantage": "prior_fused", "dynamic_sampling": "off", "prior_budget": 8}},
         "rl.prior_budget"),
    "`tools.parallel_calls` with `tools.format: tag`": ({"tools": {"parallel_calls": True}}, "tools.parallel_calls"),
    "`tools.parallel_calls` with SFT tool demos (`sft.phases[*].tool_frac` > 0)":
        ({"tools": {"parallel_calls": True, "format": "qwen"},
          "sft": {"phases": [{"steps": 1, "cot_frac": 0.5, "tool_frac": 0.3}]}}, "tools.parallel_calls"),
    "a `tool_cost` reward with a nonzero weight while `tools.enabled` is false":
        ({"reward": {"rewards": [{"name": "correct"}, {"name": "tool_cost", "weight": 0.05}]}},
         "reward.rewards[1].weight"),
    "`rl.overlap` with `runtime.distributed` of more than one process":
        ({"rl": {"overlap": {}}, "runtime": {"distributed": {"nproc_per_node": 2}}},
         "runtime.distributed.nproc_per_node"),
    "`rl.overlap` with `tools.enabled`": ({"rl": {"overlap": {}}, "tools": {"enabled": True}, "distill": {
        "warmup": {"steps": 0}, "on_policy": {"steps": 0}, "grpo_steps": 0}}, "tools.enabled"),
    "a renamed key (table above)": ({"rl": {"group_size": 8}}, "rl.group_size: renamed to rl.samples_per_prompt"),
    "`reward.rewards[].kwargs` a reward function does not take, or of another type":
        ({"reward": {"rewards": [{"name": "overlong", "kwargs": {"bufer": 16}}]}}, "reward.rewards[0].kwargs.bufer"),
    "`reward.rewards[].name` a plug-in (`package.module:function`) that does not import, or is not a module-level "
    "function": ({"reward": {"rewards": [{"name": "no_such_module_xyz:score"}]}}, "reward.rewards[0].name"),
    "`rl.save_steps` outside 1..`rl.steps`": ({"rl": {"save_steps": [41]}}, "rl.save_steps"),
    "`rl.correction.kwargs` a correction does not take, or out of its bounds":
        ({"rl": {"correction": {"name": "mis_token", "kwargs": {"low": 2.0}}}}, "rl.correction.kwargs.low"),
    "`rl.tis` together with `rl.correction`": ({"rl": {"tis": {"cap": 2}, "correction": {"name": "icepop"}}}, "rl.tis"),
    "`curate.sft_size` ≥ the rows synthetic sources generate": ({"curate": {"sft_size": 20000}}, "curate.sft_size"),
    "`reward_model.micro_batch_size` > `reward_model.batch_size`":
        ({"reward_model": {"micro_batch_size": 64}}, "reward_model.micro_batch_size"),
    "a `reward_model.models` source neither `paths.reward_dir` nor a `.jsonl` file":
        ({"reward_model": {"models": {"x": "data/rollout"}}}, "reward_model.models.x"),
    "`reward_model.verifier` not among `reward.rewards`, with a source `paths.reward_dir`":
        ({"reward_model": {"models": {"x": "data/reward"}, "verifier": "math_verify"}}, "reward_model.verifier"),
    "a `max_new_tokens` that, with the longest prompt, exceeds the model's context":
        ({"rollout": {"sampling": {"max_new_tokens": 1000}}}, "rollout.sampling.max_new_tokens"),
}


def _merge(raw: dict, over: dict) -> dict:
    for k, v in over.items():
        raw[k] = _merge(raw.get(k, {}), v) if isinstance(v, dict) and v and isinstance(raw.get(k), dict) else v
    return raw


def test_every_documented_refusal_fires_with_the_other_value_left_at_its_default():
    """Found by this test: a rule written as a field validator never ran on a default (``advantage: psr`` with
    ``dynamic_sampling`` left at ``skip`` was accepted); every section's rules now run after validation."""
    text = (REPO / "docs" / "configuration.md").read_text().split("## Refused combinations", 1)[1].split("\n## ")[0]
    documented = [row.split(" | ")[0].removeprefix("| ") for row in text.splitlines()
                  if row.startswith("| ") and not row.startswith("| combination")]
    assert sorted(documented) == sorted(REFUSALS)  # every documented rule is tested, every tested rule documented
    parse_params(_minimal())  # the minimal params themselves are valid
    for row, (over, key) in REFUSALS.items():
        with pytest.raises(ConfigError) as e:
            parse_params(_merge(_minimal(), over))
        assert f": {key}" in str(e.value), (row, str(e.value))


def test_config_names_are_the_registries_names():
    """config validates names against torch-free tuples (config/names.py); each must be its registry's keys."""
    from posttrain import algos, corrections, divergences, rewards, rollout
    from posttrain.config import names
    from posttrain.rl import select

    assert names.REWARDS == tuple(rewards.REWARDS)
    assert names.ADVANTAGES == tuple(algos.ADVANTAGES)
    assert names.POLICY_LOSSES == tuple(algos.POLICY_LOSSES)
    assert names.TOKEN_SELECTIONS == tuple(algos.TOKEN_SELECTIONS)
    assert names.PROMPT_SELECTIONS == tuple(select.PROMPT_SELECTIONS)
    assert names.KL_ESTIMATORS == tuple(algos.KL_ESTIMATORS)
    assert names.CORRECTIONS == tuple(corrections.CORRECTIONS)
    assert sorted(names.DIVERGENCES) == sorted(divergences.DIVERGENCES)
    assert names.AGGREGATIONS == algos.AGGREGATIONS
    assert names.BACKENDS == tuple(rollout.BACKENDS)


def test_validating_params_imports_no_torch():
    """What the import-linter contract says, at run time: loading params.yaml pulls in no ML framework."""
    code = ("import sys; from posttrain.config import load_params; load_params('params.yaml'); "
            "print(sorted(m for m in ('torch', 'transformers', 'math_verify', 'peft') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_every_params_key_is_documented_where_it_is_declared():
    """Each leaf field has a description (the generated configuration reference shows it); each section model
    has a docstring."""
    import typing

    from pydantic import BaseModel

    from posttrain.config import Params

    undocumented, seen = [], set()

    def walk(model: type[BaseModel]) -> None:
        if model in seen:
            return
        seen.add(model)
        if not model.__doc__:
            undocumented.append(model.__name__)
        for name, f in model.model_fields.items():
            kinds = [t for a in (f.annotation, *typing.get_args(f.annotation)) for t in (typing.get_args(a) or (a,))]
            sections = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
            for s in sections:
                walk(s)
            if not sections and not f.description:
                undocumented.append(f"{model.__name__}.{name}")

    walk(Params)
    assert undocumented == []


@pytest.mark.parametrize("edit,key", [
    (lambda r: r["rl"].setdefault("select", {}).update(min_pass_rate=0.9, max_pass_rate=0.1),
     "rl.select.max_pass_rate"),
    (lambda r: r["evaluate"].update(ks=[]), "evaluate.ks"),
    (lambda r: r["model"].setdefault("prompt", {}).update(stop=["</answer>", ""]), "model.prompt.stop"),
    (lambda r: r["model"].update(base="m" * 100_000), "model.base"),
    (lambda r: r["paths"].update(rl_model=r["paths"]["sft_model"]), "paths.rl_model"),
    (lambda r: r["paths"].update(rl_model=r["paths"]["sft_model"] + "/rl"), "paths.rl_model"),
    (lambda r: r["paths"].update(sft_model="models"), "paths.sft_model"),  # around base_model (models/base)
    (lambda r: r["paths"].update(rl_model="../elsewhere/rl"), "paths.rl_model"),
    (lambda r: r["distill"].update(teacher=r["paths"]["student_model"]), "distill.teacher"),
    (lambda r: r["distill"].update(teacher=r["paths"]["student_sft_model"] + "/"), "distill.teacher"),
])
def test_contradictions_the_fuzz_found_are_refused_at_load_naming_the_key(edit, key):
    """Issue 49, finding 8: each of these loaded (and failed later or silently: an empty pass band selects no
    prompt, ks [] evaluates nothing, an empty stop ends every completion at once, two stages at one path or one
    inside another delete each other's outputs, an output outside the repository escapes DVC, a teacher that is
    distill's own output). Now one line naming the key, before any work."""
    raw = tiny_raw(None)
    edit(raw)
    with pytest.raises(ConfigError) as e:
        parse_params(raw)
    msg = str(e.value)
    assert msg.startswith(f"params: {key}: ") and "\n" not in msg, msg


@pytest.mark.parametrize("base,says", [("./no/such/model", "no such folder"), ("weights/nope.gguf", "no such file"),
                                       ("nobody/uncached-model-xyz", "not in the local hub cache")])
def test_validate_refuses_a_model_that_cannot_be_imported_here(tmp_path, base, says):
    """Issue 49, finding 8: ``posttrain validate`` accepted a missing local model.base and an uncached hub id offline;
    the run failed in sft ~20 s later, after DVC had deleted that stage's outputs. Now validate (and repro, which
    loads params the same way) exits 2 with one line first."""
    import os

    raw = repo_params()
    raw["model"]["base"] = base
    f = tmp_path / "params.yaml"
    f.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "validate", "-p", str(f)], capture_output=True,
                       text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and says in r.stderr, r.stderr
    assert "model.base: " in r.stderr


def test_validate_refuses_an_absolute_output_outside_the_repository(tmp_path):
    """Issue 49, finding 8: an output outside the repository loaded, and DVC would neither track nor restore it.
    A stage run by hand (or a test) may write anywhere, so load accepts an absolute path; ``posttrain validate``
    and ``posttrain repro``, which know the repository (the params file's folder), refuse it: exit 2, one line."""
    raw = repo_params()
    raw["paths"]["rl_model"] = str(tmp_path / "elsewhere")
    (tmp_path / "repo").mkdir()
    f = tmp_path / "repo" / "params.yaml"
    f.write_text(yaml.safe_dump(raw))
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "validate", "-p", str(f)], capture_output=True,
                       text=True, env={**__import__("os").environ, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "paths.rl_model: " in r.stderr and "is outside the repository" in r.stderr


@pytest.mark.slow  # a copy of the repository and dvc: over 2 s
def test_repro_of_a_profile_runs_in_the_repository_and_leaves_params_yaml_as_it_was(tmp_path):
    """Issue 46, finding 2: ``posttrain repro -p profiles/x.yaml`` took profiles/ as the repository (it created
    profiles/.dvc and profiles/mlflow.db and failed). Now the repository is the one holding dvc.yaml; the profile
    is what params.yaml reads for the run, the checkout's own text after; DVC options pass after ``--``."""
    import os

    from conftest import copy_repo

    repo = tmp_path / "repo"
    repo.mkdir()
    copy_repo(repo, tiny_raw(None))
    own = (repo / "params.yaml").read_text()
    profile = tiny_raw(None)
    profile["rl"]["lr"] = 7.5e-6
    (repo / "profiles" / "mine.yaml").write_text(yaml.safe_dump(profile))
    r = subprocess.run([sys.executable, "-m", "posttrain.cli", "repro", "-p", "profiles/mine.yaml", "--", "--dry",
                        "model"], cwd=repo, capture_output=True, text=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "DVC_NO_ANALYTICS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "Running stage 'model'" in r.stdout + r.stderr
    assert not (repo / "profiles" / ".dvc").exists() and not (repo / "profiles" / "mlflow.db").exists()
    assert (repo / "params.yaml").read_text() == own


def test_a_file_source_reads_its_folder_from_the_environment_and_its_pin_refuses_other_bytes(tmp_path, monkeypatch):
    """``${POSTTRAIN_BENCH}/x.jsonl``: the same params on every machine; unset, one line naming the key and the
    variable; ``sha256`` pins the bytes (a one-byte change is refused before any work)."""
    import hashlib

    from posttrain.sources import read_source

    rows = b'{"question": "1+1?", "answer": "#### 2"}\n'
    (tmp_path / "g.jsonl").write_bytes(rows)
    src = {"kind": "file", "name": "g", "path": "${POSTTRAIN_BENCH}/g.jsonl", "format": "gsm8k",
           "sha256": hashlib.sha256(rows).hexdigest()}
    raw = repo_params()
    raw["curate"]["sources"] = [src]
    monkeypatch.delenv("POSTTRAIN_BENCH", raising=False)
    with pytest.raises(ConfigError, match=r"curate.sources\[0\].path: Value error, "
                       r"\$\{POSTTRAIN_BENCH\} is not set: export it as the folder holding g.jsonl"):
        parse_params(raw)
    monkeypatch.setenv("POSTTRAIN_BENCH", str(tmp_path))
    p = parse_params(raw)
    assert p.curate.sources[0].path == "${POSTTRAIN_BENCH}/g.jsonl"  # the params as written: DVC sees no change
    assert [r for r in read_source(p.curate.sources[0], p.task, 0)][0][1]["answer"] == "2"
    (tmp_path / "g.jsonl").write_bytes(rows.replace(b"2", b"3"))
    with pytest.raises(ConfigError, match=r"curate.sources\[0\].sha256: .*g.jsonl has sha256 [0-9a-f]{64}, not "
                       "the pinned"):
        parse_params(raw)


@pytest.mark.parametrize("section,key,hint", [
    ("rl", "lerning_rate", "did you mean 'lr'?"),  # spelling of another trainer's name for it
    ("rl", "num_generations", "did you mean 'samples_per_prompt'?"),  # TRL's name
    ("sft", "bach_size", "did you mean 'batch_size'?"),
    ("curate", "sorces", "did you mean 'sources'?"),
    ("task", "min_digitz", "did you mean 'min_digits'?"),  # inside a discriminated union (task.kind: arith)
    ("rl", "zzz", None),  # nothing close: no guess
])
def test_an_unknown_key_suggests_the_nearest_known_one(section, key, hint):
    raw = repo_params()
    raw[section][key] = 1
    with pytest.raises(ConfigError) as e:
        parse_params(raw)
    assert f"{section}.{key}: unknown key" in str(e.value)
    assert (hint in str(e.value)) if hint else "did you mean" not in str(e.value)


def test_a_yaml_syntax_error_names_its_line_and_column(tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("seed: 0\nrl:\n  lr: [1, 2\n  steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{bad}:4:8: not valid YAML: expected ',' or '\]', but got ':'$"):
        load_params(bad)


def test_version_flag_prints_the_version():
    from typer.testing import CliRunner

    from posttrain import __version__
    from posttrain.cli import app

    r = CliRunner().invoke(app, ["--version"])
    assert r.exit_code == 0 and r.output == f"posttrain {__version__}\n"


def test_validate_reads_a_profiles_local_paths_from_its_repository_wherever_it_runs(tmp_path, monkeypatch):
    """``posttrain validate -p profiles/x.yaml`` from outside the repository: ``model.base: models/base`` is the
    repository's folder, not ``profiles/models/base`` (it was: exit 2, "no such folder")."""
    from typer.testing import CliRunner

    from posttrain.cli import app

    repo = tmp_path / "repo"
    (repo / "profiles").mkdir(parents=True)
    (repo / "dvc.yaml").write_text("stages: {}\n")
    (repo / "models" / "base").mkdir(parents=True)
    (repo / "models" / "base" / "config.json").write_text("{}")
    raw = repo_params()
    raw["model"]["base"] = "models/base"
    (repo / "profiles" / "x.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    r = CliRunner().invoke(app, ["validate", "-p", "repo/profiles/x.yaml"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("value,offline", [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False),
                                           ("", False), ("no", False), ("off", False)])
def test_hf_hub_offline_is_read_as_huggingface_hub_reads_it(monkeypatch, value, offline):
    """One reading of ``HF_HUB_OFFLINE`` for validation, sources and model loading, huggingface_hub's: before,
    validation took "no" and "off" for offline and the loaders took only "1" (review)."""
    from posttrain.config.model import hub_offline

    monkeypatch.setenv("HF_HUB_OFFLINE", value)
    assert hub_offline() is offline


@pytest.mark.parametrize("stage, want", [("rl", 3600.0), ("distill", 3600.0), ("sft", 600.0), ("sft*", 900.0),
                                         ("rl*", 7200.0)])
def test_each_distributed_stage_joins_its_process_group_with_its_own_collective_timeout(tmp_path, monkeypatch,
                                                                                       stage, want):
    """Issue 50 item 6: one 600 s collective timeout for every stage was short beside the minutes one rl or
    distill rank can generate longer than another at long completions. ``runtime.distributed.stage_timeout_s``
    (rl and distill 3600 s by default): a stage's process group waits the larger of its entry and ``timeout_s``
    (``sft*``: sft with ``stage_timeout_s: {sft: 900}``; ``rl*``: rl with ``timeout_s: 7200``, raised past its
    entry by a user with long completions)."""
    from posttrain import distributed, runner

    raw = repo_params()
    raw["tracking"]["enabled"] = False
    if stage == "sft*":
        stage, raw["runtime"]["distributed"]["stage_timeout_s"] = "sft", {"sft": 900}
    if stage == "rl*":
        stage, raw["runtime"]["distributed"]["timeout_s"] = "rl", 7200
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    got = []
    monkeypatch.setattr(distributed, "launched", lambda: True)
    monkeypatch.setattr(distributed, "init", lambda backend, strategy, timeout_s: got.append(timeout_s))
    monkeypatch.setattr(distributed, "shutdown", lambda: None)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.chdir(tmp_path)
    runner.stage_main(stage, lambda p: {}, ["--params", str(path)], distributed=True)
    assert got == [want]
    raw["runtime"]["distributed"]["stage_timeout_s"] = {"evaluate": 10}  # a stage that never joins a group
    with pytest.raises(ConfigError, match="stage_timeout_s"):
        parse_params(raw)
