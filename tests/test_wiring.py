"""dvc.yaml, params.yaml and the code agree: one name per stage, deps = the modules a stage imports."""

import ast
from pathlib import Path

import pytest
import yaml
from conftest import REPO, repo_params

from posttrain.config import parse_params

RAW = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
DVC = {name: st.get("do", st) for name, st in RAW.items()}  # a foreach stage's body (evaluate: one per model)


def _module_file(mod: str) -> Path | None:
    base = REPO / Path(*mod.split("."))
    for cand in (base.with_suffix(".py"), base / "__init__.py"):
        if cand.exists():
            return cand
    return None


def _imports(path: Path, lazy: bool = True) -> set[str]:
    """posttrain/stages modules imported by ``path``; ``lazy=False`` skips imports inside functions (the
    registry-name checks in config.py import registries lazily: they decide which names validate, not what a
    stage computes)."""
    tree = ast.parse(path.read_text())
    nodes = ast.walk(tree) if lazy else [n for top in tree.body if not isinstance(top, ast.FunctionDef | ast.ClassDef)
                                         for n in ast.walk(top)]
    mods = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module:
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names)
    return {m for m in mods if m.split(".")[0] in {"posttrain", "stages"}}


def transitive_files(stage: str) -> set[Path]:
    seen, todo = set(), [REPO / "stages" / f"{stage}.py"]
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        for m in _imports(f, lazy=f.parent.name == "stages"):
            parts = m.split(".")  # importing a.b.c runs a/__init__.py and a/b/__init__.py first
            for g in (_module_file(".".join(parts[:k])) for k in range(1, len(parts) + 1)):
                if g is not None:
                    todo.append(g)
    return seen


def _covered(f: Path, deps: list[str]) -> bool:
    rel = f.relative_to(REPO)
    return any(rel == Path(d) or Path(d) in rel.parents for d in deps)


def test_stage_names_match_modules_and_params():
    params = repo_params()
    for name, stage in DVC.items():
        assert (REPO / "stages" / f"{name}.py").exists()
        assert stage["cmd"] == f"python -m stages.{name}" + (" --model ${key}" if "foreach" in RAW[name] else "")
        assert name in params, f"params.yaml has no section {name!r}"


def test_deps_list_every_imported_library_module():
    for name, stage in DVC.items():
        deps = [d for d in stage["deps"] if not d.startswith("${")]
        for f in transitive_files(name):
            if f.name == "__init__.py" and f.parent.name in {"stages", "posttrain"}:
                continue  # package markers only
            assert _covered(f, deps), f"dvc.yaml stage {name!r}: deps miss {f.relative_to(REPO)}"


def test_stages_do_not_import_each_other():
    for name in DVC:
        others = {f"stages.{o}" for o in DVC if o != name}
        assert not _imports(REPO / "stages" / f"{name}.py") & others


def test_all_paths_come_from_params():
    params = repo_params()
    literal = {v for v in params["paths"].values()}
    for name, stage in DVC.items():
        entries = [e if isinstance(e, str) else next(iter(e)) for key in ("deps", "outs", "metrics", "plots")
                   for e in stage.get(key, [])]
        for e in entries:
            assert not any(e == v or e.startswith(v + "/") for v in literal), \
                f"stage {name}: {e} written in dvc.yaml instead of ${{paths.*}}"
    # every evaluated checkpoint is a dep: evaluate runs once per evaluate.models entry, its path the dep
    assert RAW["evaluate"]["foreach"] == "${evaluate.models}" and "${item}" in DVC["evaluate"]["deps"]


def test_no_param_is_named_like_a_field_dvcs_run_cache_ignores():
    """DVC's run-cache key (dvc/stage/cache.py: dict_sha256(..., exclude=[size, nfiles])) drops every key
    named `size` or `nfiles` at any depth, params included: changing such a param makes `dvc repro` restore the
    outputs of the old value from the run-cache (seen here with `curate.eval.size`, now `rows`)."""
    from pydantic import BaseModel

    from posttrain.config import Params

    def names(model: type[BaseModel], prefix: str = "") -> list[str]:
        out = []
        for name, f in model.model_fields.items():
            out.append(prefix + name)
            for t in getattr(f.annotation, "__args__", ()) + (f.annotation,):
                if isinstance(t, type) and issubclass(t, BaseModel):
                    out += names(t, f"{prefix}{name}.")
        return out

    every = names(Params)
    assert "curate.eval.rows" in every  # the walk reaches nested sections
    assert not [n for n in every if n.rsplit(".", 1)[-1] in {"size", "nfiles"}]


def test_every_dvc_param_is_written_in_every_params_file():
    # DVC refuses to run a stage whose listed param is absent from the file, even when pydantic has a default
    # (found when runtime.distributed.* became rl/distill params: the real-run profile lacked them)
    for f in [REPO / "params.yaml", *sorted((REPO / "profiles").glob("*.yaml"))]:
        raw = yaml.safe_load(f.read_text())
        for name, stage in DVC.items():
            for key in stage.get("params", []):
                node = raw
                for part in key.split("."):
                    assert isinstance(node, dict) and part in node, f"{f.name}: {key} (a dvc param of {name}) missing"
                    node = node[part]


@pytest.mark.parametrize("f", sorted((REPO / "profiles").glob("*.yaml")), ids=lambda f: f.name)
def test_every_profile_loads(f):
    """A profile is a whole params file users copy over params.yaml: it must load as it is (a section added to
    params.yaml and not to a profile made profiles/tools.yaml fail at load: paths.judge_cache missing; watched).
    A profile reading benchmark files loads where ``$POSTTRAIN_BENCH`` holds them, and skips elsewhere."""
    from conftest import BENCH

    text = f.read_text()
    if "${POSTTRAIN_BENCH}" in text and not BENCH.is_dir():
        pytest.skip(f"{f.name} reads ${{POSTTRAIN_BENCH}}, unset here")
    parse_params(yaml.safe_load(text))


@pytest.mark.slow
def test_the_tests_that_read_benchmark_files_pass_in_a_clone_with_nothing_beside_it(tmp_path):
    """A clone of the repository alone (no ``../shared``, ``POSTTRAIN_BENCH`` unset): every fast test of the
    modules that read benchmark files (or build the BPE tokenizer from them) passes or skips saying why. Before,
    such a clone failed 4 tests and errored 12 (``file not found: ../shared/benchmarks/...``)."""
    import os
    import re
    import subprocess
    import sys

    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    clone = tmp_path / "alone" / "posttrain"
    for f in files:
        if (REPO / f).is_file() and not f.startswith("site/"):
            (clone / f).parent.mkdir(parents=True, exist_ok=True)
            (clone / f).write_bytes((REPO / f).read_bytes())
    readers = sorted({f for f in files if f.startswith("tests/test_") and f.endswith(".py") and re.search(
        r"BENCH|bench_file|tests.realmodel", (REPO / f).read_text())})
    assert {"tests/test_code_task.py", "tests/test_rewards.py", "tests/test_realmodel.py"} <= set(readers)
    env = {k: v for k, v in os.environ.items() if k != "POSTTRAIN_BENCH"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                        "not slow and not vllm and not realmodel", *readers], cwd=clone, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-4000:]
    skips = [line for line in r.stdout.splitlines() if line.startswith("SKIPPED") and "vllm" not in line]
    assert skips and all("POSTTRAIN_BENCH" in line for line in skips), skips


def test_no_stage_output_is_uncached_unless_a_metric_or_a_plot():
    """DVC leaves a stage with an uncached output that is neither a metric nor a plot out of its run-cache
    (``Stage.run``: ``no_cache_outs``), so a value tried before runs again instead of being restored: the run facts
    (metrics/<stage>.run.json) first went in as ``cache: false`` outs and the flows' run-cache test failed."""
    for name, stage in DVC.items():
        for out in stage.get("outs", []):
            if isinstance(out, dict):
                (path, opts), = out.items()
                assert opts.get("cache", True), f"dvc.yaml stage {name!r}: {path} is cache: false outside metrics/plots"
