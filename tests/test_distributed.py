"""Several processes on CPU (torchrun, gloo, 2 ranks): the distributed paths give the one-process results.

- sft through the real launch path (``python -m stages.sft`` relaunching itself under torchrun): world size 2
  (DDP, a rank killed, resumed) ends with the weights of world size 1 for the same global batch, and so does
  the killed run's checkpoint resumed under FSDP2 and at world size 1;
- one rl update replayed from the same persisted rollout shard (``tests/dist_replay.py``: two epochs x two
  minibatches, so old log-probs and reference log-probs are filled by ranks and gathered), and one distill
  step on the same sequences, give the same weights at world size 1 and 2, for DDP, FSDP2 and DDP with LoRA;
- one rank SIGKILLed mid-run: the stage fails at once (no hang: torchrun stops the other rank; the collective
  timeout is the backstop), and re-running resumes from the last checkpoint to the one-process weights;
- sharded checkpoints (``tests/dist_ckpt.py``): FSDP2 saves through DCP with no full tensor gathered, each rank
  its half, and a checkpoint resumes at world size 2 -> 1, 1 -> 2 and 2 -> 2 (bit-identical in its own layout).
- loading (``tests/dist_frozen.py``): the frozen model (distill's teacher, rl's KL reference under DDP) and a pretrained
  distill student are read by rank 0 only, and every rank's copy is the one-process load bit for bit.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import launch
import pytest
import torch
import yaml
from conftest import REPO, tiny_model, tiny_raw
from safetensors.torch import load_file

from posttrain import checkpoint, modeling
from posttrain.config import TinyModel, parse_params
from posttrain.rewards import score_rows
from posttrain.rollout import BACKENDS, SamplingParams, sample_rows
from posttrain.runfacts import read_metrics
from posttrain.schema import SCORED_SCHEMA, write_parquet
from posttrain.tasks.arith import make_problem

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(REPO)}
TOL = 1e-6  # fp32: the same sums in another order


def _params(root: Path, curated: Path | None, nproc: int, strategy: str = "ddp", edit=None) -> Path:
    raw = tiny_raw(root)
    if curated is not None:  # the upstream of another run: its curated splits and its imported base
        raw["paths"]["curated_dir"] = str(curated)
        raw["paths"]["base_model"] = str(curated.parents[1] / "models" / "base")
    raw["runtime"].update({"train_threads": 1, "generate_threads": 1,
                           "distributed": {"nproc_per_node": nproc, "strategy": strategy, "timeout_s": 60}})
    if edit:
        edit(raw)
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw))
    return root / "params.yaml"


def _stage(name: str, params: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", f"stages.{name}", "--params", str(params)], cwd=REPO, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _ok(proc: subprocess.Popen) -> None:
    _, err = launch.communicate(proc, 300)
    assert proc.returncode == 0, err[-3000:]


def _ranks(nproc: int, script: str, *args: object, env: dict[str, str] = ENV) -> None:
    """``tests/<script> args`` as one process (``nproc`` 1) or under torchrun (gloo): it must exit 0 within 300 s
    (a hang fails with every process's stacks: ``tests/launch.py``)."""
    argv = [str(REPO / "tests" / script), *map(str, args)]
    cmd = [*launch.TORCHRUN, "--standalone", f"--nproc_per_node={nproc}", *argv] if nproc > 1 else [sys.executable,
                                                                                                      *argv]
    r = launch.run(cmd, env=env, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    common = a.keys() & b.keys()  # a state dict also lists a tied lm_head.weight, the safetensors file not
    assert len(common) >= len(b) - 1 and len(common) >= len(a) - 1
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in common)


def _weights(root: Path, model: str) -> dict[str, torch.Tensor]:
    return load_file(root / "models" / model / "model.safetensors")


def _shard(tmp_path: Path) -> tuple[Path, Path]:
    """A tiny policy folder and one step's scored rollouts of it (4 prompts x 4 samples), as the rl stage
    persists them."""
    p = parse_params(tiny_raw(tmp_path))
    model, tok = tiny_model(p.model, p.seed)
    policy = tmp_path / "policy"
    modeling.save_checkpoint(model, tok, policy)
    problems = []
    for i, (a, b) in enumerate([(12, 7), (345, 6), (81, 9), (7, 3)]):
        prompt, answer = make_problem(a, b)
        problems.append({"id": f"p{i}", "prompt": prompt, "answer": answer, "task": "arith"})
    backend = BACKENDS["hf"](model, tok, 64)
    rows, _ = sample_rows(backend, tok, problems, 4, SamplingParams(1.0, 1.0, 24, 5), policy="p0")
    rows = score_rows(rows, p.reward.rewards)
    assert len({r["reward"] for r in rows}) > 1  # some reward variance: the update has advantages
    shard = tmp_path / "shard.parquet"
    write_parquet(shard, rows, SCORED_SCHEMA)
    return policy, shard


@pytest.mark.slow
def test_rl_update_replayed_from_a_shard_gives_the_same_weights_at_world_size_1_and_2(tmp_path):
    policy, shard = _shard(tmp_path)

    def edit(raw):  # off-policy epochs and minibatches: old and reference log-probs are filled and gathered
        raw["rl"].update({"epochs": 2, "minibatches": 2, "kl_coef": 0.05, "micro_batch_size": 3})
        raw["distill"]["grpo_steps"] = 0  # phase C with a KL is refused at load

    def lora(raw):  # adapters on a frozen base; the reference is the adapter switched off
        edit(raw)
        raw["model"]["lora"] = {"r": 4, "alpha": 8, "dropout": 0.0, "target_modules": "all-linear"}

    res = {}
    for job, nproc, strategy in (("w1", 1, "ddp"), ("ddp", 2, "ddp"), ("fsdp2", 2, "fsdp2")):
        files = [_params(tmp_path / job / "full", None, nproc, strategy, edit)]
        if strategy == "ddp":  # LoRA with FSDP2 is refused
            files.append(_params(tmp_path / job / "lora", None, nproc, strategy, lora))
        files = [f.rename(f.with_name(f"{f.parent.name}.yaml")) for f in files]  # result keys: full, lora
        out = tmp_path / f"{job}.pt"
        _ranks(nproc, "dist_replay.py", out, policy, shard, *files)
        for key, v in torch.load(out).items():
            res[job if key == "full" else f"lora-{job}"] = v
    start = load_file(policy / "model.safetensors")
    assert any("lora_A" in k for k in res["lora-ddp"]["state"])
    for name, base in (("ddp", "w1"), ("fsdp2", "w1"), ("lora-ddp", "lora-w1")):
        diff = _max_diff(res[name]["state"], res[base]["state"])
        print(f"rl update world 2 {name} vs world 1: max |dw| = {diff:.3g}")
        assert diff < TOL
        for k in ("loss", "kl", "clipfrac", "entropy", "logprob_gap"):
            assert res[name]["metrics"][k] == pytest.approx(res[base]["metrics"][k], rel=1e-4, abs=1e-7), k
        diff = _max_diff(res[name]["student"], res[base]["student"])
        print(f"distill step (SGD, lr 1) world 2 {name} vs world 1: max |dw| = {diff:.3g}")
        assert diff < TOL
        assert res[name]["distill_metrics"]["reverse_kl"] == pytest.approx(
            res[base]["distill_metrics"]["reverse_kl"], rel=1e-3)
    # FSDP2's KL reference is sharded as the policy is (Dist.load_frozen), scored in lockstep (logprobs.fill; after
    # the reset rank 1 scores no sequence, rank 0 all of its: a rank's extra forward without a partner hung
    # until the collective timeout before): half the bytes on rank 0 at world size 2 after scoring (a full
    # copy per rank before; its root group stayed gathered after a forward), the same KL as world size 1
    print(f"reference bytes on rank 0: world 1 {res['w1']['ref_bytes']}, fsdp2 world 2 {res['fsdp2']['ref_bytes']}")
    assert 0 < res["fsdp2"]["ref_bytes"] <= 0.55 * res["w1"]["ref_bytes"]
    for name in ("w1", "ddp", "fsdp2"):  # ProRL's reset: the reference then scores as the updated policy
        assert res[name]["reset_gap"] is not None and res[name]["reset_gap"] < 1e-5, (name, res[name]["reset_gap"])
    # an update where rank 1 holds no sequence: the FSDP2 ranks agree to score the sharded reference (fillers on
    # rank 1) and get DDP's numbers (its reference is whole on each rank: no collective to pair)
    for k in ("kl", "loss", "entropy"):
        assert res["fsdp2"]["zero_rank"][k] == pytest.approx(res["ddp"]["zero_rank"][k], rel=1e-4, abs=1e-9), k
    assert res["ddp"]["zero_rank"]["kl"] > 0
    moved = {k: _max_diff(res["w1"][k], start) for k in ("state", "student")}
    print(f"world 1 moved the weights by {moved['state']:.3g} (rl) and {moved['student']:.3g} (distill)")
    assert min(moved.values()) > 1e-4  # both steps moved the weights


def _workers(launcher: int) -> dict[int, int]:
    """{LOCAL_RANK: pid} of the torchrun workers descending from ``launcher`` (read from /proc)."""
    def parent(pid: int) -> int:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])

    out = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        pid = int(name)
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            p = pid
            while p > 1 and p != launcher:
                p = parent(p)
        except (OSError, ValueError):
            continue
        rank = [kv.split(b"=")[1] for kv in env if kv.startswith(b"LOCAL_RANK=")]
        if p == launcher and rank:
            out[int(rank[0])] = pid
    return out


@pytest.mark.slow
@pytest.mark.extended  # CI leaves it out (time): make test-extended
def test_sft_at_world_size_2_equals_world_size_1_and_a_killed_rank_fails_cleanly_then_resumes(tmp_path):
    """sft through its real command. World size 2 (DDP) with rank 1 SIGKILLed after the first checkpoint: the
    stage must fail, not hang. Its checkpoint then resumes three ways: at world size 2 under DDP (the re-run),
    under FSDP2, and at world size 1. All end with the weights of an uninterrupted world-size-1 run."""
    def long(raw):
        raw["sft"].update({"phases": [{"steps": 150, "cot_frac": 1.0}, {"steps": 30, "cot_frac": 0.5}],
                           "checkpoint_every": 20})

    one = _params(tmp_path / "w1", None, 1, edit=long)
    _ok(_stage("model", one))
    _ok(_stage("curate", one))
    curated = tmp_path / "w1" / "data" / "curated"
    _ok(_stage("sft", one))

    two = _params(tmp_path / "ddp", curated, 2, edit=long)
    proc = _stage("sft", two)
    ckpt = tmp_path / "ddp" / "checkpoints" / "sft"
    deadline = time.time() + 120
    while not list(ckpt.glob("step_*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    workers = _workers(proc.pid)
    assert proc.poll() is None and set(workers) == {0, 1}, "the run ended before a rank could be killed"
    os.kill(workers[1], signal.SIGKILL)
    t0 = time.time()
    _, err = launch.communicate(proc, 120)  # a hang would time out here
    print(f"rank 1 killed: the stage exited {proc.returncode} after {time.time() - t0:.1f}s")
    assert proc.returncode == 1 and "rank 1 failed (killed by signal 9)" in err
    assert not (tmp_path / "ddp" / "models" / "sft").exists()
    killed_at = max(int(p.stem.split("_")[1]) for p in ckpt.glob("step_*"))

    runs = {"ddp": two, "fsdp2": _params(tmp_path / "fsdp2", curated, 2, "fsdp2", edit=long),
            "w1-resumed": _params(tmp_path / "w1-resumed", curated, 1, edit=long)}
    for name in ("fsdp2", "w1-resumed"):  # the killed DDP run's checkpoint, resumed elsewhere
        shutil.copytree(ckpt, tmp_path / name / "checkpoints" / "sft")
    for name, params in runs.items():
        _ok(_stage("sft", params))
        m = read_metrics(tmp_path / name / "metrics" / "sft.json")
        assert m["resumed_from_step"] >= killed_at > 0
        diff = _max_diff(_weights(tmp_path / name, "sft"), _weights(tmp_path / "w1", "sft"))
        print(f"killed at step {killed_at} (world size 2, ddp), resumed as {name}: max |dw| vs world size 1 = "
              f"{diff:.3g}")
        assert diff < 1e-5
    logs = {n: (tmp_path / n / "reports" / "sft" / "train_log.csv").read_text().splitlines() for n in ("w1", "ddp")}
    assert len(logs["ddp"]) == len(logs["w1"])  # the log carries over the pre-crash rows


def test_checkpoint_optimizer_state_is_keyed_by_name_and_loads_back():
    # the one-process half of "a checkpoint loads under any world size and strategy": names, not indices
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    msd, osd = checkpoint.model_state(m, opt)
    assert sorted(osd["state"]) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    assert osd["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    opt2 = torch.optim.AdamW(m.parameters(), lr=0.1)
    checkpoint.load_model_state(m, opt2, msd, osd)
    torch.testing.assert_close(opt2.state_dict()["state"][2]["exp_avg"], opt.state_dict()["state"][2]["exp_avg"])


@pytest.mark.slow
def test_rl_step_at_world_size_2_gathers_scalars_only_and_every_rank_gets_the_hand_computed_groups(tmp_path):
    """``tests/dist_collect.py``: one rl step (collect -> update -> shard) on a stand-in sampler, as one process and
    at world size 2 (gloo). Prompt i's sample j is correct iff j < i: rewards [0000], [1000], [1100], [1110].
    Each rank keeps its own groups (rank 0: p0, p1; rank 1: p2, p3) and its own tokens; what is all-gathered is
    exactly, per rank (2 ranks):
      collect: the sizes (2 x 8 bytes) + 2 x (8 samples x 4 float64 scalars: reward, correct, length, tool
      calls) = 16 + 512 = 528 bytes;
      update:  the sizes (16) + 2 x (8 sequences x 3 int64: rank, length, advantage != 0) = 16 + 384 = 400 bytes,
    whatever the completions' lengths (the step holds 1,240 tokens; a pickled gather of rows, the old path, sent
    every token id and log-prob to every rank). No ``all_gather_object`` runs (it raises in the script). Every
    rank computes GRPO's advantages of every group, by hand (unbiased std): [1000] -> mean 1/4, std 1/2 ->
    [1.5, -0.5, -0.5, -0.5]; [1100] -> mean 1/2, std sqrt(1/3) -> +-0.866025; [1110] -> [0.5, 0.5, 0.5, -1.5];
    [0000] -> 0. Rank 0's shard holds the step's rows in sampling order, the same as one process writes."""
    import pyarrow.parquet as pq

    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"w{nproc}"
        out.mkdir()
        _ranks(nproc, "dist_collect.py", out)
        runs[nproc] = [torch.load(out / f"rank{k}.pt") for k in range(nproc)]
    hand = torch.tensor([[0.0, 0, 0, 0], [1.5, -0.5, -0.5, -0.5], [0.866025, 0.866025, -0.866025, -0.866025],
                         [0.5, 0.5, 0.5, -1.5]])
    one, (r0, r1) = runs[1][0], runs[2]
    for res in (one, r0, r1):
        assert torch.allclose(res["adv"], hand, atol=1e-5) and res["zero_var_frac"] == 0.25
        assert res["rewards"].tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0]]
    assert (r0["local_groups"], r1["local_groups"]) == ([0, 1], [2, 3])  # each rank holds only its own rows
    assert r0["local_tokens"] + r1["local_tokens"] == one["local_tokens"] == 1240
    for res in (r0, r1):
        assert res["collect_bytes"] == 528 and res["step_bytes"] == 528 + 400
        assert res["metrics"] == r0["metrics"]  # the same reduced metrics on every rank
    assert r0["sent_bytes"] == 0 and r1["sent_bytes"] > 4 * 684  # rank 1's rows reach rank 0 (to be written) only
    assert one["collect_bytes"] == one["step_bytes"] == 0  # one process: nothing to gather
    for k in ("loss", "entropy", "grad_norm", "logprob_gap"):
        assert r0["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-5), k
    assert max(float((r0["state"][k] - one["state"][k]).abs().max()) for k in one["state"]) < TOL
    w1, w2 = (pq.read_table(tmp_path / f"w{n}" / "shard.parquet").drop_columns(["seed"]) for n in (1, 2))
    assert w2.equals(w1) and w1.num_rows == 16  # the same rows in the same order (seeds differ by rank)


def _ckpt_job(mode: str, nproc: int, strategy: str, ckpt: Path, out: Path) -> dict:
    _ranks(nproc, "dist_ckpt.py", mode, strategy, ckpt, out)
    return torch.load(out, weights_only=True)


@pytest.mark.slow
def test_fsdp2_checkpoint_is_sharded_on_disk_and_resumes_at_another_world_size(tmp_path):
    """FSDP2 at world size 2 saves through DCP without gathering any full tensor (each rank writes its own
    half); the checkpoint resumes at world size 1 and at world size 2, and a world-size-1 checkpoint resumes
    under FSDP2 at world size 2: all three end at the weights of an uninterrupted 4-step run."""
    straight = _ckpt_job("straight", 1, "ddp", tmp_path / "none", tmp_path / "straight.pt")["weights"]
    fs = tmp_path / "fsdp2"
    saved = _ckpt_job("save", 2, "fsdp2", fs, tmp_path / "saved.pt")
    assert saved["gathered"] == 0  # no full_tensor() while saving
    files = sorted((fs / "step_0000002").glob("*.distcp"))
    sizes = [f.stat().st_size for f in files]
    print(f"fsdp2 world 2 checkpoint: {len(files)} shard files, bytes {sizes}")
    assert len(files) == 2 and max(sizes) < 0.7 * sum(sizes)  # each rank wrote about half
    w1 = tmp_path / "w1"
    saved1 = _ckpt_job("save", 1, "ddp", w1, tmp_path / "saved1.pt")
    fsdp2 = _ckpt_job("straight", 2, "fsdp2", tmp_path / "none", tmp_path / "straight2.pt")["weights"]
    noise = _max_diff(fsdp2, straight)  # reduction order alone, amplified by four Adam steps
    print(f"uninterrupted fsdp2 world 2 vs world 1: max |dw| = {noise:.3g}")
    for name, nproc, strategy, ckpt, same in (("fsdp2 w2 -> w1", 1, "ddp", fs, straight),
                                              ("fsdp2 w2 -> fsdp2 w2", 2, "fsdp2", fs, fsdp2),
                                              ("w1 -> fsdp2 w2", 2, "fsdp2", w1, straight)):
        res = _ckpt_job("resume", nproc, strategy, ckpt, tmp_path / "resumed.pt")
        got = res["weights"]
        # the moving reference saved with it (reset to the policy at step 2) comes back under any strategy
        # (an FSDP2 reference was saved under its handle's names: w1 could not resume it)
        assert _max_diff(res["ref"], (saved if ckpt == fs else saved1)["weights"]) == 0.0, name
        diff, exact = _max_diff(got, straight), _max_diff(got, fsdp2 if same is fsdp2 else straight)
        print(f"checkpoint {name}: max |dw| vs uninterrupted world size 1 = {diff:.3g}")
        assert diff < 1e-5
        if same is fsdp2:  # the same layout throughout: the checkpoint changes nothing
            print(f"checkpoint {name}: max |dw| vs uninterrupted fsdp2 world 2 = {exact:.3g}")
            assert exact == 0


@pytest.mark.slow
def test_sft_of_a_loaded_base_under_fsdp2_reads_it_on_rank_0_only_and_equals_world_size_1(tmp_path):
    """model.base a folder (not the built tiny model): under FSDP2 rank 1 builds it on the meta device and gets
    rank 0's weights through the shards; the SFT result equals world size 1's."""
    p = parse_params(tiny_raw(tmp_path))
    model, tok = tiny_model(p.model, p.seed)
    base = tmp_path / "base"
    modeling.save_checkpoint(model, tok, base)

    def edit(raw):
        raw["model"]["base"] = str(base)

    one = _params(tmp_path / "w1", None, 1, edit=edit)
    _ok(_stage("model", one))
    _ok(_stage("curate", one))
    two = _params(tmp_path / "fsdp2", tmp_path / "w1" / "data" / "curated", 2, "fsdp2", edit)
    _ok(_stage("sft", one))
    _ok(_stage("sft", two))
    diff = _max_diff(_weights(tmp_path / "fsdp2", "sft"), _weights(tmp_path / "w1", "sft"))
    print(f"sft of a loaded base, fsdp2 world 2 (rank 1 on meta) vs world 1: max |dw| = {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_frozen_models_and_a_pretrained_student_are_read_by_rank_0_only_and_arrive_bit_for_bit(tmp_path, dtype):
    """``tests/dist_frozen.py`` at world size 2 (FSDP2, gloo), a model saved in ``dtype``: the frozen model (rl's
    KL reference under DDP, distill's teacher: ``Dist.load_on_rank0``) and a pretrained distill student (meta
    on rank 1, ``Dist.wrap``) are read from disk by rank 0 only (one weight file opened there, none on rank 1),
    and every rank's copy equals the one-process load bit for bit: the same dtype (``model.dtype`` for the frozen model,
    fp32 masters for the student), the tied LM head still tied, the rotary buffers (non-persistent) included."""
    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(TinyModel(hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64),
                                      tok, 0)
    folder, out = tmp_path / "m", tmp_path / "out"
    modeling.save_checkpoint(model, tok, folder, dtype)
    _ranks(2, "dist_frozen.py", folder, dtype, out)
    r0, r1 = (torch.load(f"{out}.{rank}", weights_only=True) for rank in (0, 1))
    print(f"{dtype}: weight files opened, rank 0 {len(r0['opened_frozen'])} + {len(r0['opened_student'])}, "
          f"rank 1 {len(r1['opened_frozen'])} + {len(r1['opened_student'])}")
    assert len(r0["opened_frozen"]) == len(r0["opened_student"]) == 1  # model.safetensors, on rank 0
    assert r1["opened_frozen"] == r1["opened_student"] == []  # rank 1 read no weights
    frozen = modeling.load_model(str(folder), dtype)
    student = modeling.load_model(str(folder), dtype, trainable=True)
    for name, alone in (("frozen", frozen), ("student", student)):
        want = {n: t for n, t in (*alone.named_parameters(), *alone.named_buffers())}
        assert "model.rotary_emb.inv_freq" in want and "model.rotary_emb.original_inv_freq" in want
        for res in (r0, r1):
            got = res[name]
            assert got.keys() == want.keys(), name
            for k, v in want.items():
                assert got[k].dtype == v.dtype and torch.equal(got[k], v), (name, k)
    for res in (r0, r1):
        assert res["dtype"] == f"torch.{dtype}" and res["tied"] and res["eos"] == frozen.generation_config.eos_token_id


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp2_keeps_gradients_sharded_between_micro_batches(tmp_path, dtype):
    """Issue 50, finding 1: ``Dist.grad_sync`` turned FSDP2's gradient sync off for every micro-batch but the last,
    so after the first micro-batch's backward each rank held the *whole* unsharded fp32 gradient (measured before
    the fix: 354,560 bytes per rank, the whole model, and no sharded grad), +28.4 GiB per rank at 7B. Now each
    micro-batch reduce-scatters: every rank holds its shard's gradient only (177,280 bytes = half) and nothing
    unsharded. ``tests/dist_grads.py`` at world size 2 (gloo), one accumulate step of 3 micro-batches.
    Finding 2: the full-weight copy (``Dist.plain``) was a deepcopy made at ``wrap``, in fp32, through every SFT
    step (watched fail: 354,560 bytes before any ``plain`` call); it is allocated at the first ``plain`` now, in
    ``model.dtype``. Finding 3: with ``model.dtype`` bf16 FSDP2 all-gathers in bf16 (MixedPrecisionPolicy; it
    gathered fp32), the gradients still reduce into fp32 shards. Item 1: a weight-copying backend (vLLM) takes the
    weights streamed (``Dist.for_generation``; watched fail: no such method), equal to the copy's and in its
    dtype, and the copy stays unallocated through it (``copy_bytes_before_plain`` is read after the stream)."""
    tok = modeling.build_char_tokenizer()
    model = modeling.build_tiny_model(TinyModel(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
                                      tok, 0)
    folder, out = tmp_path / "m", tmp_path / "out"
    modeling.save_checkpoint(model, tok, folder, "float32")
    _ranks(2, "dist_grads.py", folder, out, dtype, env={**ENV, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"})
    for rank in (0, 1):
        m = json.loads(Path(f"{out}.{rank}").read_text())
        print(rank, m)
        assert m["local_param_bytes"] * 2 == m["whole_param_bytes"]
        for when in ("after_first_backward", "after_second_backward"):
            assert m[when] == {"sharded_grad": m["local_param_bytes"], "unsharded_grad": 0}, (when, m)
        assert m["copy_bytes_before_plain"] == 0 and m["gathered_dtype"] == m["copy_dtype"] == [f"torch.{dtype}"]
        assert m["full_copy_bytes"] == m["whole_param_bytes"] // (1 if dtype == "float32" else 2)
        # item 1: vLLM's engine takes the weights streamed, equal to the copy's, with no copy allocated for them
        assert m["stream_names_are_the_copys"] and m["stream_equals_the_copy"]
        assert m["stream_dtype"] == m["copy_dtype"]
        # a tied weight (embeddings = LM head) is gathered once and streamed under both names
        assert m["tied"] == ["lm_head.weight"] and m["stream_gathers"] == m["distinct_params"], m
