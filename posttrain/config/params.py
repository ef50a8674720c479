"""The root of ``params.yaml``: every section, the rules across sections, and loading with one-line errors.

Every section is a pydantic model with ``extra="forbid"``: an unknown key, a wrong type, an out-of-range value,
a refused combination or a missing input file fails in :func:`load_params` before any work, with a
:class:`ConfigError` whose message names the key path (``sft.lr: ...``). Stage ``main()`` functions and the
CLI turn that error into one line on stderr and exit code 2. A key renamed so that one concept has one name
(``names.RENAMED``) is refused naming its new name.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationError, model_validator

from posttrain.config import names, rules
from posttrain.config.base import MAX_SEED, ConfigError, Refusal, Section, shown
from posttrain.config.curate import Curate, SyntheticSource
from posttrain.config.distill import Distill
from posttrain.config.evaluate import Evaluate, Report
from posttrain.config.judge import Judge
from posttrain.config.model import ModelCfg
from posttrain.config.paths import Paths
from posttrain.config.prefect import PrefectCfg
from posttrain.config.reward import Reward
from posttrain.config.reward_model import RewardModel
from posttrain.config.rl import Rl
from posttrain.config.rollout import Rollout, VLLMOptions
from posttrain.config.runtime import Runtime
from posttrain.config.sandbox import SandboxCfg
from posttrain.config.sft import Sft
from posttrain.config.task import ArithTask, TaskSpec
from posttrain.config.tools import ToolsCfg
from posttrain.config.tracking import TrackingCfg


class Params(Section):
    """Everything a run of the pipeline is: one section per stage, plus the shared ones."""

    seed: int = Field(0, ge=0, le=MAX_SEED, description="one seed for data generation, init, sampling and shuffling")
    paths: Paths
    runtime: Runtime = Field(default_factory=Runtime)
    task: TaskSpec = Field(default_factory=ArithTask)
    model: ModelCfg = Field(default_factory=ModelCfg)
    curate: Curate
    sft: Sft
    rollout: Rollout
    reward: Reward
    reward_model: RewardModel = Field(default_factory=RewardModel)
    judge: Judge = Field(default_factory=Judge)
    rl: Rl
    distill: Distill
    evaluate: Evaluate
    report: Report = Field(default_factory=Report)
    prefect: PrefectCfg = Field(default_factory=PrefectCfg)
    tracking: TrackingCfg = Field(default_factory=TrackingCfg)
    sandbox: SandboxCfg = Field(default_factory=SandboxCfg)
    tools: ToolsCfg = Field(default_factory=ToolsCfg)

    def vllm_options(self) -> VLLMOptions:
        """``rollout.vllm`` with the defaults that follow other sections filled in (``dtype``: ``model.dtype``,
        the trainer's): what every stage hands the vllm backend."""
        v = self.rollout.vllm
        return v if v.dtype is not None else v.model_copy(update={"dtype": self.model.dtype})

    def sampler_id(self) -> str:
        """What samples, as resume fingerprints see it: ``hf``, or ``vllm:<engine dtype>``."""
        b = self.rollout.backend
        return b if b == "hf" else f"{b}:{self.vllm_options().dtype}"

    @model_validator(mode="after")
    def _cross(self) -> Params:
        """Rules across sections (each section's own rules are in its ``_rules``)."""
        synthetic = any(isinstance(s, SyntheticSource) for s in self.curate.sources)
        if (synthetic or self.curate.eval.source is None) and self.task.kind not in names.GENERATED_TASKS:
            raise Refusal("curate", "the synthetic generator (a synthetic source, or eval.source unset) needs "
                          f"task.kind in {list(names.GENERATED_TASKS)}")
        if self.distill.grpo_steps and (self.rl.kl_coef > 0 or self.rl.kl_reward_coef > 0):
            raise Refusal("distill.grpo_steps", "> 0 with rl.kl_coef or rl.kl_reward_coef > 0: phase C has no KL "
                          "reference yet; set both to 0 or distill.grpo_steps: 0")
        unknown = sorted({m for pair in self.report.compare for m in pair} - set(self.evaluate.models))
        if unknown:
            raise Refusal("report.compare", f"{unknown} not in evaluate.models {list(self.evaluate.models)}")
        own = {"paths.student_sft_model": self.paths.student_sft_model, "paths.student_model": self.paths.student_model}
        for key, path in own.items():
            if Path(self.distill.teacher) == Path(path):
                raise Refusal("distill.teacher", f"{self.distill.teacher!r} is {key}, an output of the distill stage "
                              "itself: the teacher must be a model made before it (e.g. paths.rl_model)")
        if self.rl.ref_reset is not None and self.model.lora is not None:
            raise Refusal("rl.ref_reset", "with model.lora is not supported: the LoRA policy's reference is its "
                          "frozen base (adapter off), which a reset would have to overwrite with the merge")
        rules.check(self)
        d = self.runtime.distributed
        if d.world_size > 1:
            if d.strategy == "fsdp2" and self.model.lora is not None:
                raise Refusal("runtime.distributed.strategy", "fsdp2 with model.lora is not supported; use ddp "
                              "(LoRA's frozen base needs no sharding of gradients or optimizer state)")
        return self

def repo_root(params_file: str | Path) -> Path:
    """The pipeline's repository of a params file: the nearest folder holding ``dvc.yaml`` from the file's folder
    up (a profile under ``profiles/`` belongs to the repository above it, wherever the command runs from); the
    file's folder if none. Where a run's MLflow store (``mlflow.db``) and git state are."""
    here = Path(params_file).resolve().parent
    return next((d for d in (here, *here.parents) if (d / "dvc.yaml").is_file()), here)


def stage_metrics(metrics_dir: str | Path, stage: str) -> Path:
    """A stage's metrics file: ``metrics/<stage>.json``; of one foreach instance ``metrics/<stage>/<key>.json``
    (``evaluate@sft`` -> ``metrics/evaluate/sft.json``)."""
    return Path(metrics_dir) / f"{stage.replace('@', '/')}.json"


_UNION_TAGS = {"synthetic", "file", "hub", "arith", "code", "math"}


def _loc(loc: tuple[Any, ...]) -> str:
    """``('curate', 'sources', 0, 'file', 'path')`` -> ``curate.sources[0].path`` (union tags dropped)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or "[" in str(part):
            continue  # discriminated-union branch names are not keys of the file
        else:
            out += ("." if out else "") + str(part)
    return out or "<root>"


# Names other trainers (TRL, verl, open-r1) give to keys posttrain names otherwise: a "did you mean" beyond spelling
SYNONYMS = {"learning_rate": "lr", "num_generations": "samples_per_prompt", "beta": "kl_coef",
            "max_completion_length": "max_new_tokens", "epsilon": "clip_eps_low", "epsilon_high": "clip_eps_high",
            "per_device_train_batch_size": "micro_batch_size", "max_steps": "steps", "num_train_epochs": "epochs"}


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """The keys the params model accepts beside ``loc``'s last part (an unknown key), following sections and
    lists; [] where the path passes through a union or a free-form mapping."""
    node: Any = Params
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if part in _UNION_TAGS:  # a discriminated union's branch: the member whose `kind` is this tag
            node = next((a for a in _members(node) if getattr(a.model_fields.get("kind"), "default", None) == part),
                        node)
            continue
        fields = getattr(node, "model_fields", None)
        if not fields or part not in fields:
            return []
        node = fields[part].annotation
        members = _members(node)
        node = members[0] if len(members) == 1 else members if members else node  # Optional/list of a section
    return list(getattr(node, "model_fields", {}) or [])


def _members(node: Any) -> list[Any]:
    """The sections inside an annotation (``X | None``, ``list[X]``, ``Annotated[A | B, ...]``), depth first."""
    if isinstance(node, list):
        return node
    out = []
    for a in typing.get_args(node):
        out += [a] if hasattr(a, "model_fields") else _members(a)
    return out


def _suggest(loc: tuple[Any, ...]) -> str:
    """'; did you mean X?' for an unknown key, from the section's own keys (spelling, or another trainer's name)."""
    import difflib

    names_here = _fields_at(loc)
    known = {n: n for n in names_here} | {k: v for k, v in SYNONYMS.items() if v in names_here}
    close = difflib.get_close_matches(str(loc[-1]), list(known), n=1, cutoff=0.75)
    return f"; did you mean {known[close[0]]!r}?" if close else ""


def _describe(err: dict[str, Any]) -> str:
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key" + _suggest(err["loc"])
    elif "input" in err and err["type"] not in {"missing"} and not isinstance(err["input"], dict | list):
        msg = f"{msg}, got {shown(err['input'])}"
    return msg


def _renamed(raw: dict[str, Any]) -> str | None:
    """The first old key of ``names.RENAMED`` present in ``raw``, as 'old: renamed to new'."""
    for old, new in names.RENAMED.items():
        node: Any = raw
        for part in old.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is not KeyError:
            return f"{old}: renamed to {new}"
    return None


def parse_params(raw: dict[str, Any], origin: str = "params") -> Params:
    """Validate a params mapping; raise :class:`ConfigError` naming the first bad key path."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level")
    renamed = _renamed(raw)
    if renamed:
        raise ConfigError(f"{origin}: {renamed}")
    try:
        return Params.model_validate(raw)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        more = f" (+{len(errs) - 1} more)" if len(errs) > 1 else ""
        where, what = _loc(first["loc"]), _describe(first)
        refusal = (first.get("ctx") or {}).get("error")
        if isinstance(refusal, Refusal):  # a section's cross-field rule: name the field it refuses
            if where == "<root>":
                raise ConfigError(f"{origin}: {refusal.key}: {refusal}{more}") from None
            raise ConfigError(f"{origin}: {where}.{refusal.key}: Value error, {refusal}{more}") from None
        if where == "<root>":  # a check across sections: its message starts with the key it names
            raise ConfigError(f"{origin}: {what.removeprefix('Value error, ')}{more}") from None
        raise ConfigError(f"{origin}: {where}: {what}{more}") from None


def read_yaml(text: str) -> Any:
    """Params YAML as DVC reads and writes it: YAML 1.2 (ruamel), where ``off``/``yes``/``no`` are strings.
    (PyYAML's 1.1 reads ``off`` as false: ``dvc exp run -S rl.dynamic_sampling=off`` writes it unquoted.)
    Nesting deeper than Python's recursion allows (no params file nests past 10) raises ``YAMLError``."""
    from ruamel.yaml import YAML, YAMLError

    try:
        return YAML(typ="safe", pure=True).load(text)
    except RecursionError:
        raise YAMLError("nested too deeply") from None


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``. Raises :class:`ConfigError` (one line) on any problem."""
    from ruamel.yaml import YAMLError

    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: file not found")
    try:
        text = p.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text (byte {e.start}: {e.reason}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot be read ({e.strerror})") from None
    try:
        raw = read_yaml(text)
    except YAMLError as e:  # the editor's file:line:column form, where ruamel knows the position
        mark = getattr(e, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(p)
        what = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{where}: not valid YAML: {what[:200]}") from None
    return parse_params(raw or {}, origin=str(p))
