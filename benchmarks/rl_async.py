"""Asynchronous RL (``rl.overlap``) against the synchronous loop: wall time and samples/s of a short ``rl`` run
on the default task.

Arms: ``sync`` (``rl.overlap: null``; ``runtime.generate_threads`` / ``train_threads`` as in params.yaml: 2),
``sync1`` (the same on 1 thread: separates the effect of the thread count from that of the overlap) and
``k0``, ``k1``, ``k2``, ``k4`` (``rl.overlap.max_staleness`` 0, 1, 2, 4; ``--generators`` generator processes of 1 torch
thread, a trainer of 1 thread: generation on one core, training on the other). Each arm is ``stages.rl.run``
for ``--steps`` steps on the pipeline's own inputs (``--root``: a checkout where ``dvc repro reward`` has run:
its curated train split, the SFT pass rates and ``models/sft``), outputs in a temp folder. The arms alternate
within every repeat (their order rotates from repeat to repeat) and every repeat is reported.

``wall_s``: the whole ``rl.run`` call (model loads, generator spawns and the final save included); ``loop_s``:
the stage's own ``seconds`` (first step to last, the generators' start-up inside it); ``samples_per_s``:
samples / loop_s; ``step_samples_per_s``: the median of the per-step figures of the train log after the first
step (steady state), and the medians of its ``gen_s``, ``reward_s``, ``update_s`` and (under rl.overlap) ``wait_s``.

``--backend vllm`` runs every arm with ``rollout.backend: vllm`` (run it with ``.venv-vllm``'s python): the
synchronous arms with the colocated engine, the overlap arms with one engine per generator process; each arm
then runs in its own process (one vLLM engine per process lifetime).

    python benchmarks/rl_async.py [--root /work/main] [--params params.yaml] [--steps 8] [--repeats 2] \\
        [--backend hf] [--json benchmarks/results/rl_async.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from posttrain.config import parse_params  # noqa: E402
from posttrain.config.params import read_yaml  # noqa: E402
from stages import rl  # noqa: E402

ARMS = {"sync": None, "sync1": None, "k0": 0, "k1": 1, "k2": 2, "k4": 4}  # sync1: the synchronous loop on 1 thread


def run_arm(root: Path, raw: dict[str, Any], arm: str, generators: int, work: Path) -> dict[str, Any]:
    """One arm: here (hf), or under vLLM in a fresh process (one engine per process lifetime)."""
    if raw["rollout"]["backend"] != "vllm":
        return run_arm_here(root, raw, arm, generators, work)
    spec = work / "arm.json"
    spec.write_text(json.dumps({"root": str(root), "raw": raw, "arm": arm, "generators": generators}))
    subprocess.run([sys.executable, __file__, "--one-arm", str(spec)], check=True)
    return json.loads((work / "result.json").read_text())


def run_arm_here(root: Path, raw: dict[str, Any], arm: str, generators: int, work: Path) -> dict[str, Any]:
    k = ARMS[arm]
    raw = json.loads(json.dumps(raw))
    if arm == "sync1":
        raw["runtime"].update({"generate_threads": 1, "train_threads": 1})
    raw["rl"]["overlap"] = None if k is None else {"max_staleness": k, "generators": generators,
                                                   "generator_threads": 1, "trainer_threads": 1}
    if k and raw["rl"].get("correction") is None:  # k > 0 needs a correction (the stage refuses it otherwise)
        raw["rl"]["correction"] = {"name": "icepop"}
    p = parse_params(raw)
    ins = {name: root / path for name, path in rl.paths(p)[0].items()}
    out = {k2: work / k2 for k2 in ("model", "rl_dir", "checkpoints", "report_dir")} | {"metrics": work / "rl.json"}
    t = time.perf_counter()
    m = rl.run(p, ins, out)
    wall = time.perf_counter() - t
    with open(out["report_dir"] / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    log = rows[1:] or rows  # steady state: after the first step

    def med(key: str) -> float | None:
        return round(statistics.median(float(r[key]) for r in log), 3) if key in log[0] else None

    return {"wall_s": round(wall, 2), "loop_s": m["seconds"], "samples": m["samples"],
            "samples_per_s": round(m["samples"] / m["seconds"], 1), "step_samples_per_s": med("samples_per_s"),
            # where a steady step goes: generation and scoring (in the generator under rl.overlap), the
            # update, and the trainer's wait for the queue
            "gen_s": med("gen_s"), "reward_s": med("reward_s"), "update_s": med("update_s"), "wait_s": med("wait_s"),
            "final_reward": m["final_reward"], "staleness": m.get("staleness")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=".", help="a checkout whose default pipeline ran up to reward (its inputs)")
    ap.add_argument("--params", default="params.yaml", help="the params (this checkout's by default)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--generators", type=int, default=1)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--json", default="benchmarks/results/rl_async.json")
    ap.add_argument("--one-arm", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one_arm:  # a vLLM arm in its own process (run_arm)
        spec, work = json.loads(Path(args.one_arm).read_text()), Path(args.one_arm).parent
        res = run_arm_here(Path(spec["root"]), spec["raw"], spec["arm"], spec["generators"], work)
        (work / "result.json").write_text(json.dumps(res))
        return
    root = Path(args.root).resolve()
    raw = read_yaml(Path(args.params).read_text())
    raw["rl"].update({"steps": args.steps, "checkpoint_every": args.steps, "save_steps": []})
    raw["runtime"]["progress"] = False
    raw["rollout"]["backend"] = args.backend
    rows, load_start = [], os.getloadavg()
    print(f"{'repeat':>6} {'arm':>5} {'wall_s':>7} {'loop_s':>7} {'samples':>7} {'samples/s':>9} {'step s/s':>8} "
          f"{'gen_s':>6} {'upd_s':>6} {'wait_s':>6}  staleness")
    for rep in range(args.repeats):
        order = args.arms[rep % len(args.arms):] + args.arms[: rep % len(args.arms)]
        for arm in order:
            with tempfile.TemporaryDirectory(prefix=f"rl_async_{arm}_") as tmp:
                r = {"repeat": rep, "arm": arm, **run_arm(root, raw, arm, args.generators, Path(tmp))}
            rows.append(r)
            print(f"{rep:>6} {arm:>5} {r['wall_s']:>7} {r['loop_s']:>7} {r['samples']:>7} {r['samples_per_s']:>9} "
                  f"{r['step_samples_per_s']:>8} {r['gen_s']:>6} {r['update_s']:>6} {r['wait_s'] or '':>6}  "
                  f"{r['staleness'] or ''}", flush=True)
    summary = {arm: {key: statistics.median(r[key] for r in rows if r["arm"] == arm)
                     for key in ("wall_s", "loop_s", "samples_per_s", "step_samples_per_s")} for arm in args.arms}
    print("median per arm:", json.dumps(summary))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "command": " ".join([Path(sys.executable).name, *sys.argv]), "backend": args.backend, "steps": args.steps,
        "repeats": args.repeats,
        "generators": args.generators, "cpus": os.cpu_count(), "machine": platform.machine(),
        "load_avg_start_end": [load_start, os.getloadavg()], "rows": rows, "median": summary}, indent=2) + "\n")


if __name__ == "__main__":
    main()
