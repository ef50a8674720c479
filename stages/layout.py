"""Each stage's inputs and outputs, from params; what it needs before it starts; the check that runs first.

``<stage>(params)`` (``evaluate`` and ``reward_model`` take the model's name too) returns the stage's
``(inputs, outputs)`` path dicts, which its ``main`` passes to ``run`` (``stages.<stage>.paths`` is the same
function; ``model``, which needs nothing upstream, keeps its own). ``NEEDS[stage](params, name)`` lists the
inputs an upstream stage writes.

``preflight``: ``python -m stages.<stage>`` imports this package before the stage's own module (torch,
transformers: about 6 s here), and ``stages/__init__.py`` runs ``preflight`` then, so a params file that does
not validate (exit 2) or an input no upstream stage has written yet (exit 1) is refused in one line within a
second, before any import of the stage's work, any MLflow run and any output touched (``runner.preflight``;
``stage_main`` makes the same checks again when a stage is called as a function). Only torch-free modules here.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError, Params


def curate(p: Params) -> tuple[dict[str, Any], dict[str, Path]]:
    return {}, {"curated_dir": Path(p.paths.curated_dir), "report_dir": Path(p.paths.curate_report_dir),
                "metrics": Path(p.paths.metrics_dir) / "curate.json"}


def sft(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    P = p.paths
    return {"demos": Path(P.curated_dir) / "sft.parquet", "base": Path(P.base_model)}, {
        "model": Path(P.sft_model), "checkpoints": Path(P.sft_checkpoints),
        "report_dir": Path(P.sft_report_dir), "metrics": Path(P.metrics_dir) / "sft.json"}


def rollout(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    P = p.paths
    return ({"train": Path(P.curated_dir) / "train.parquet", "policy": Path(P.sft_model)},
            {"rollouts": Path(P.rollout_dir) / "rollouts.parquet", "metrics": Path(P.metrics_dir) / "rollout.json",
             "checkpoints": Path(P.rollout_checkpoints)})


def reward(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    P = p.paths
    return {"rollouts": Path(P.rollout_dir) / "rollouts.parquet"}, {
        "rewards": Path(P.reward_dir) / "rewards.parquet", "pass_rates": Path(P.reward_dir) / "pass_rates.parquet",
        "report_dir": Path(P.reward_report_dir), "metrics": Path(P.metrics_dir) / "reward.json",
        "judge_cache": Path(P.judge_cache)}


def reward_model(p: Params, name: str) -> tuple[dict[str, Any], dict[str, Path]]:
    """The inputs and outputs of ``reward_model@<name>``."""
    if name not in p.reward_model.models:
        raise ConfigError(f"reward_model --model {name!r}: not a key of reward_model.models "
                          f"{list(p.reward_model.models)}")
    P = p.paths
    return ({"name": name, "source": Path(p.reward_model.models[name]),
             "rollouts": Path(P.rollout_dir) / "rollouts.parquet", "eval": Path(P.curated_dir) / "eval.parquet",
             "sft_model": Path(P.sft_model)},
            {"model": Path(P.reward_model_dir) / name, "data": Path(P.reward_model_data_dir) / name,
             "checkpoints": Path(P.reward_model_checkpoints) / name,
             "report_dir": Path(P.reward_model_report_dir) / name,
             "metrics": Path(P.metrics_dir) / "reward_model" / f"{name}.json"})


def rl(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    P = p.paths
    return ({"train": Path(P.curated_dir) / "train.parquet", "pass_rates": Path(P.reward_dir) / "pass_rates.parquet",
             "policy": Path(P.sft_model)},
            {"model": Path(P.rl_model), "rl_dir": Path(P.rl_dir), "checkpoints": Path(P.rl_checkpoints),
             "report_dir": Path(P.rl_report_dir), "metrics": Path(P.metrics_dir) / "rl.json"})


def distill(p: Params) -> tuple[dict[str, Path], dict[str, Path]]:
    P = p.paths
    return ({"demos": Path(P.curated_dir) / "sft.parquet", "train": Path(P.curated_dir) / "train.parquet",
             "teacher": Path(p.distill.teacher)},
            {"student_sft": Path(P.student_sft_model), "student": Path(P.student_model),
             "checkpoints": Path(P.distill_checkpoints), "report_dir": Path(P.distill_report_dir),
             "metrics": Path(P.metrics_dir) / "distill.json"})


def evaluate(p: Params, name: str) -> tuple[dict[str, Any], dict[str, Path]]:
    """The inputs and outputs of ``evaluate@<name>``."""
    if name not in p.evaluate.models:
        raise ConfigError(f"evaluate --model {name!r}: not a key of evaluate.models {list(p.evaluate.models)}")
    return ({"eval": Path(p.paths.curated_dir) / "eval.parquet", "name": name, "model": p.evaluate.models[name]},
            {"dir": Path(p.paths.eval_report_dir) / "models" / name,
             "metrics": Path(p.paths.metrics_dir) / "evaluate" / f"{name}.json"})


def report(p: Params) -> tuple[dict[str, Any], dict[str, Path]]:
    return ({"models_dir": Path(p.paths.eval_report_dir) / "models"},
            {"dir": Path(p.paths.eval_report_dir) / "summary", "metrics": Path(p.paths.metrics_dir) / "report.json"})


def _evaluated(p: Params, name: str) -> list[Path]:
    """The eval split, and the model when a pipeline stage writes it (a ``paths`` entry; a hub id is not); a
    name that is no key of ``evaluate.models``: ConfigError."""
    path = evaluate(p, name)[0]["model"]
    made = {str(Path(v)) for v in p.paths.model_dump().values()}
    return [Path(p.paths.curated_dir) / "eval.parquet", *([Path(path)] if path and str(Path(path)) in made else [])]


def _named(p: Params, name: str | None) -> list[Path]:
    """Nothing an upstream must write first (its rollouts are optional); the name checked (ConfigError)."""
    reward_model(p, name or "")
    return []


# the inputs an upstream stage writes; ``name``: the model of a per-model stage (None for the others)
NEEDS: dict[str, Callable[[Params, str | None], Iterable[Path]]] = {
    "sft": lambda p, _: sft(p)[0].values(),
    "rollout": lambda p, _: rollout(p)[0].values(),
    "reward": lambda p, _: reward(p)[0].values(),
    "rl": lambda p, _: rl(p)[0].values(),
    "distill": lambda p, _: [distill(p)[0]["demos"], distill(p)[0]["train"]],
    "evaluate": lambda p, name: _evaluated(p, name or ""),
    "report": lambda p, _: [report(p)[0]["models_dir"]],
    "reward_model": lambda p, name: _named(p, name),
}
PER_MODEL = ("evaluate", "reward_model")  # stages run once per model: ``--model NAME``, named ``<stage>@<name>``


def preflight(argv: list[str] | None = None) -> None:
    """For ``python -m stages.<stage> [--model NAME] [--params FILE]`` (``argv``: ``sys.orig_argv``): the params
    checked and the stage's upstream inputs looked for, before the stage's module is imported. Anything else
    (another program importing ``stages``, ``--help``) passes through untouched."""
    from posttrain import runner

    argv = list(sys.orig_argv if argv is None else argv)
    if "-m" not in argv:
        return
    i = argv.index("-m")
    module, rest = (argv[i + 1] if i + 1 < len(argv) else ""), argv[i + 2:]
    stage = module.removeprefix("stages.")
    if not module.startswith("stages.") or stage not in {*NEEDS, "model", "curate"}:
        return
    if {"-h", "--help"} & set(rest):
        return
    name = None
    if stage in PER_MODEL:
        name, rest = runner.model_arg(rest)
    needs = NEEDS.get(stage)
    runner.preflight(f"{stage}@{name}" if name else stage, runner.params_arg(stage, rest),
                     None if needs is None else (lambda p: needs(p, name)))
