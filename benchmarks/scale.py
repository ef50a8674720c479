"""Wall time and peak RSS of curate, rollout and reward at 10^4-10^6 prompts, each stage in its own process.

Per size N and arm (``after``: this checkout; ``before``: another checkout, e.g. main, passed as ``--before``),
alternating the arms' order from size to size on this noisy machine:

- curate: the synthetic arithmetic source, ``num_rows = N + sft_size`` (a of 4-8 digits: duplicates grow
  faster than N, 3% of the rows at 10^5, 25% at 3x10^6; ``--digits 7 12``: almost none);
- rollout: the tiny default model (``model.tiny`` of params.yaml, built by one sft step as the tests build
  theirs), every prompt of curate's train split, 1 sample each, ``--new-tokens`` new tokens (sizes up to
  ``--rollout-max``);
- rollout_io: the rollout stage's data path alone, without the model: N synthetic completions in chunks of 256
  rows, kept in a list and written at the end (before: the old stage) or buffered into parts and assembled
  (after: ``streaming.PartialParquet`` as the stage runs it by default: a part every 30 s or 8,192 rows), so the
  data path's memory is measured at sizes the model cannot reach on CPU;
- reward: N synthetic rollouts (one per prompt, 12-16 tokens, half correct), written once per size and shared by
  the arms, so reward scales past what rollout reaches on CPU;
- rl: the rl stage on curate's train split of N prompts, every one selected (synthetic pass rates of 0.5), the
  tiny policy, 2 steps of 4 prompts x 2 samples: what the stage costs before and around its steps (reading and
  selecting the pool, tokenizing, the checkpoint fingerprint, the outputs) as the pool grows.

Each stage runs as ``python -m stages.<name> --params ...`` in the arm's checkout; its peak RSS is the child's
``ru_maxrss`` from ``os.wait4`` (that process alone). A stage past ``--timeout`` seconds is killed and recorded.

    python benchmarks/scale.py --sizes 10000 100000 1000000 --before /path/to/main [--rollout-max 100000]

prints a table and writes benchmarks/results/scale.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import yaml

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SFT_SIZE, EVAL_ROWS = 100, 50


def params(repo: Path, root: Path, n: int, new_tokens: int, policy: Path, arm_has_partial: bool,
           digits: tuple[int, int] = (4, 8)) -> dict[str, Any]:
    """The arm's own params.yaml (``repo``'s: a section another checkout lacks is an unknown key there), sized."""
    p = yaml.safe_load((repo / "params.yaml").read_text())
    p["paths"] = {k: str(root / v) for k, v in p["paths"].items()}
    if not arm_has_partial:
        p["paths"].pop("rollout_checkpoints", None)
    p["paths"]["sft_model"] = str(policy)
    p["runtime"]["progress"] = False
    p["tracking"]["enabled"] = False
    p["task"].update({"min_digits": digits[0], "max_digits": digits[1]})
    p["curate"]["sources"][0]["num_rows"] = n + SFT_SIZE
    p["curate"]["sft_size"], p["curate"]["eval"]["rows"] = SFT_SIZE, EVAL_ROWS
    p["sft"].update({"phases": [{"steps": 1, "cot_frac": 1.0}], "batch_size": 8, "micro_batch_size": 8,
                     "warmup_steps": 0, "checkpoint_every": 1, "log_every": 1})
    p["rollout"].update({"num_prompts": None, "samples_per_prompt": 1, "generate_batch_size": 256})
    p["rollout"]["sampling"]["max_new_tokens"] = new_tokens
    return p


def stage(repo: Path, name: str, params_file: Path, timeout: float) -> dict[str, Any]:
    """Run one stage in its own process; wall seconds, its peak RSS (MiB), exit code."""
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = params_file.with_name(f"{Path(name).stem}.log").open("w")
    t0 = time.time()
    cmd = [PY, name] if name.endswith(".py") else [PY, "-m", f"stages.{name}", "--params", str(params_file)]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.time() - t0 > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            pid, status, ru = os.wait4(proc.pid, 0)
            break
        time.sleep(0.05)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"wall_s": round(time.time() - t0, 1), "peak_rss_mib": round(ru.ru_maxrss / 1024, 1),
            "rc": proc.returncode, "timed_out": time.time() - t0 > timeout}


SCHEMA = pa.schema([("prompt_id", pa.string()), ("sample", pa.int32()), ("prompt", pa.string()),
                    ("answer", pa.string()), ("task", pa.string()), ("completion", pa.string()),
                    ("token_ids", pa.list_(pa.int32())), ("logprobs", pa.list_(pa.float32())),
                    ("num_tokens", pa.int32()), ("finish_reason", pa.string()), ("policy", pa.string()),
                    ("temperature", pa.float32()),
                    ("top_p", pa.float32()), ("max_new_tokens", pa.int32()), ("seed", pa.int64())])  # ROLLOUT_SCHEMA


def synthetic_rows(start: int, stop: int) -> list[dict[str, Any]]:
    """Rollout rows ``start .. stop-1`` (one sample per prompt, 12-16 tokens, every other one wrong)."""
    rng = random.Random(start)
    rows = []
    for i in range(start, stop):
        a, b = rng.randrange(1000, 10**8), rng.randrange(2, 10)
        k = 12 + i % 5
        rows.append({"prompt_id": f"arith:{i}", "sample": 0, "prompt": f"{a}*{b}=", "answer": str(a * b),
                     "task": "arith", "completion": f"answer: {a * b + i % 2}", "token_ids": [7] * k,
                     "logprobs": [-0.5] * k, "num_tokens": k, "finish_reason": "stop", "policy": "synthetic",
                     "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16, "seed": 0})
    return rows


def synthetic_rates(train: Path, folder: Path) -> None:
    """pass_rates.parquet for every prompt of ``train``: 4 samples, 2 correct (pass rate and mean reward 0.5)."""
    ids = pq.read_table(train, columns=["id"]).column("id")
    n = len(ids)
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"prompt_id": ids, "n": pa.array([4] * n, pa.int32()),
                             "scorable": pa.array([4] * n, pa.int32()), "n_correct": pa.array([2] * n, pa.int32()),
                             "pass_rate": pa.array([0.5] * n, pa.float32()),
                             "mean_reward": pa.array([0.5] * n, pa.float32())}), folder / "pass_rates.parquet")


def synthetic_rollouts(path: Path, n: int) -> None:
    """``n`` scorable rollout rows, written a batch at a time."""
    with pq.ParquetWriter(path, SCHEMA) as w:
        for start in range(0, n, 50_000):
            w.write_table(pa.Table.from_pylist(synthetic_rows(start, min(n, start + 50_000)), schema=SCHEMA))


IO_CHILD = """
import sys
sys.path.insert(0, {bench!r})
from scale import synthetic_rows
n, arm, folder = {n}, {arm!r}, {folder!r}
from posttrain.schema import ROLLOUT_SCHEMA
chunks = ((c, synthetic_rows(c * 256, min(n, (c + 1) * 256))) for c in range((n + 255) // 256))
if arm == "before":  # the old rollout stage: every row in one list, one write at the end
    from posttrain.schema import write_parquet
    rows = []
    for _, chunk in chunks:
        rows.extend(chunk)
    write_parquet(folder + "/rollouts.parquet", rows, ROLLOUT_SCHEMA)
else:
    from posttrain.streaming import PartialParquet
    part = PartialParquet(folder + "/partial", {{"params": "x"}}, (n + 255) // 256, ROLLOUT_SCHEMA,
                          flush_seconds=30.0)  # rollout.checkpoint_every_s's default
    for c, chunk in chunks:
        part.write(c, chunk)
    part.assemble(folder + "/rollouts.parquet")
    part.remove()
"""


def io_child(repo: Path, n: int, arm: str, folder: Path, timeout: float) -> dict[str, Any]:
    """The rollout data path alone (``IO_CHILD``) in its own process."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "io_child.py"
    script.write_text(IO_CHILD.format(bench=str(Path(__file__).parent), n=n, arm=arm, folder=str(folder)))
    return stage(repo, str(script), folder / "params.yaml", timeout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    ap.add_argument("--stages", nargs="+", default=["curate", "rollout", "rollout_io", "reward"])
    ap.add_argument("--merge", action="store_true", help="keep --out's results of the stages not run now")
    ap.add_argument("--before", type=Path, help="checkout of the old code (the 'before' arm); omitted: after only")
    ap.add_argument("--after", type=Path, default=ROOT, help="checkout of the new code (default: this one; a "
                    "snapshot keeps edits made while the benchmark runs out of it)")
    ap.add_argument("--before-max", type=int, default=10**7, help="largest size the before arm runs")
    ap.add_argument("--rollout-max", type=int, default=100_000, help="largest size rollout runs at")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--digits", type=int, nargs=2, default=[4, 8], help="the curate source's a: min, max digits")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "scale.json")
    a = ap.parse_args()
    work = a.work or Path(tempfile.mkdtemp(prefix="scale-"))
    arms = {"after": a.after.resolve()} | ({"before": a.before.resolve()} if a.before else {})
    # the policy: the tiny default model after one sft step (this checkout), shared by every run
    pol_root = work / "policy"
    pol_root.mkdir(parents=True, exist_ok=True)
    needs_policy = "rollout" in a.stages or "rl" in a.stages
    # (the policy is trained on the default 4-8 digits whatever --digits: rollout and rl time its throughput)
    pp = params(arms["after"], pol_root, 1000, a.new_tokens, pol_root / "models" / "sft", True)
    (pol_root / "params.yaml").write_text(yaml.safe_dump(pp))
    for name in ("curate", "sft") if needs_policy else ():
        r = stage(arms["after"], name, pol_root / "params.yaml", a.timeout)
        assert r["rc"] == 0, (name, r, (pol_root / f"{name}.log").read_text()[-2000:])
    policy = pol_root / "models" / "sft"
    results: list[dict[str, Any]] = []
    old = json.loads(a.out.read_text()) if a.merge and a.out.exists() else {"results": []}
    kept = [r for r in old["results"] if r["stage"] not in a.stages]  # --merge: the other stages' earlier results
    commands = old.get("commands", [])
    for si, n in enumerate(a.sizes):
        order = list(arms) if si % 2 == 0 else list(arms)[::-1]  # alternate which arm goes first
        if "reward" in a.stages:
            synthetic_rollouts(work / f"rollouts-{n}.parquet", n)
        for arm in order:
            if arm == "before" and n > a.before_max:
                continue
            root = work / arm / str(n)
            root.mkdir(parents=True, exist_ok=True)
            p = params(arms[arm], root, n, a.new_tokens, policy, (arms[arm] / "posttrain" / "streaming.py").exists(),
                       tuple(a.digits))
            (root / "params.yaml").write_text(yaml.safe_dump(p))
            for name in a.stages:
                if name == "rollout" and (n > a.rollout_max or not (root / "data" / "curated").exists()):
                    continue
                if name == "rollout_io":
                    r = io_child(arms[arm], n, arm, root / "io", a.timeout)
                    results.append({"stage": name, "arm": arm, "n": n, "rows": n if r["rc"] == 0 else None, **r})
                    print(json.dumps(results[-1]), flush=True)
                    continue
                if name == "rl":
                    rp = copy.deepcopy(p)
                    rp["paths"]["reward_dir"] = str(root / "synthetic_rates")
                    synthetic_rates(root / "data" / "curated" / "train.parquet", root / "synthetic_rates")
                    rp["rl"].update({"steps": 2, "prompts_per_step": 4, "samples_per_prompt": 2, "checkpoint_every": 10,
                                     "save_steps": [], "select": {"min_pass_rate": 0.0, "max_pass_rate": 1.0}})
                    rp["rl"]["sampling"]["max_new_tokens"] = a.new_tokens
                    (root / "params-rl.yaml").write_text(yaml.safe_dump(rp))
                    r = stage(arms[arm], name, root / "params-rl.yaml", a.timeout)
                elif name == "reward":  # the shared synthetic rollouts, in place of this arm's rollout output
                    rp = copy.deepcopy(p)
                    rp["paths"]["rollout_dir"] = str(root / "synthetic")
                    (root / "synthetic").mkdir(exist_ok=True)
                    target = root / "synthetic" / "rollouts.parquet"
                    target.unlink(missing_ok=True)
                    os.link(work / f"rollouts-{n}.parquet", target)
                    (root / "params-reward.yaml").write_text(yaml.safe_dump(rp))
                    r = stage(arms[arm], name, root / "params-reward.yaml", a.timeout)
                else:
                    r = stage(arms[arm], name, root / "params.yaml", a.timeout)
                m = root / "metrics" / f"{name}.json"
                info = json.loads(m.read_text()) if m.exists() and r["rc"] == 0 else {}
                rows = {"curate": info.get("train"), "rollout": info.get("samples"),
                        "reward": info.get("samples"), "rl": info.get("selected_prompts")}[name]
                dups = {"digits": a.digits, "duplicates": info.get("duplicates")} if name == "curate" else {}
                results.append({"stage": name, "arm": arm, "n": n, "rows": rows, **r, **dups})
                print(json.dumps(results[-1]), flush=True)
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"commands": [*commands, " ".join(sys.argv)], "new_tokens": a.new_tokens,
                                     "digits": a.digits, "results": kept + results}, indent=1) + "\n")
    print(f"\n{'stage':8} {'arm':7} {'N':>9} {'rows':>9} {'wall s':>8} {'peak RSS MiB':>13} {'rc':>4}")
    for r in results:
        print(f"{r['stage']:8} {r['arm']:7} {r['n']:>9} {r['rows'] or '-':>9} {r['wall_s']:>8} "
              f"{r['peak_rss_mib']:>13} {r['rc']:>4}{' (timed out)' if r['timed_out'] else ''}")


if __name__ == "__main__":
    main()
