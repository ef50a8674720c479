"""benchmarks/rl_vs_trl.py builds each of our arms' params as its docstring says: the benchmark's settings on
top of a profile, and the arm's own change (and nothing else), validated as a stage would be."""

import importlib.util

import pytest
from conftest import REPO

spec = importlib.util.spec_from_file_location("rl_vs_trl", REPO / "benchmarks" / "rl_vs_trl.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)

PROFILE = str(REPO / "profiles" / "smollm2-arith.yaml")


@pytest.mark.parametrize("arm", sorted(bench.OURS))
def test_arm_params(arm: str) -> None:
    p = bench.bench_params(PROFILE, 3, arm, seed=2)
    assert (p.rl.steps, p.rl.seed, p.rl.dynamic_sampling) == (3, 2, "off")
    assert p.rl.checkpoint_every == 4  # no resumable checkpoint inside the timed loop
    assert p.rl.pack is (arm == "ours_pack")
    assert p.rollout.backend == ("vllm" if arm == "ours_vllm" else "hf")
    if arm == "ours_k1":  # staleness 1 is refused without a correction: the benchmark adds icepop
        assert p.rl.overlap.max_staleness == 1 and p.rl.correction.name == "icepop"
    else:
        assert p.rl.overlap is None
    # the settings both loops share are the profile's, whatever the arm
    assert (p.rl.prompts_per_step, p.rl.samples_per_prompt, p.rl.lr) == (8, 8, 1e-5)
