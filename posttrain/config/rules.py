"""The rules across ``params.yaml``'s sections (``Params._cross`` calls :func:`check`; each section's own rules
are in its ``_rules``): what one section asks of another, refused at load naming the key (exit 2). ``p`` is
the validated ``Params``, typed ``Any``: params.py imports this module (an import back would be a cycle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from posttrain.config import names
from posttrain.config.base import Refusal, shown
from posttrain.config.model import TinyModel


def check(p: Any) -> None:
    """Every rule below, on the validated ``Params`` ``p``."""
    if p.rl.overlap is not None:
        overlap(p)
    context(p)
    champion(p)
    reward_models(p)
    judge(p)
    tools(p)


def overlap(p: Any) -> None:
    """``rl.overlap`` runs generator processes (``rollout.backend``: hf, or a vLLM engine each) beside one
    trainer process: what it does not build is refused, naming the key that asks for it."""
    why = {"runtime.distributed.nproc_per_node": (p.runtime.distributed.world_size > 1, "x nnodes > 1 with "
                                                  "rl.overlap: the asynchronous trainer is one process; set "
                                                  "rl.overlap: null"),
           "tools.enabled": (p.tools.enabled, "true with rl.overlap: generators sample single-turn "
                             "completions only; set rl.overlap: null")}
    for key, (bad, message) in why.items():
        if bad:
            raise Refusal(key, message)


def judge(p: Any) -> None:
    """An ``llm_judge`` reward without ``base_url`` asks the server the stage starts: ``judge.serve`` must name
    one; a server nobody asks is refused too (it would cost its start for nothing)."""
    specs = [(i, s) for i, s in enumerate(p.reward.rewards) if s.name == "llm_judge"]
    for i, s in specs:
        if s.kwargs.get("base_url") is None and p.judge.serve is None:
            raise Refusal(f"reward.rewards[{i}].kwargs.base_url", "not set and judge.serve is null: give the "
                          "judge's URL (and kwargs.model), or a model folder in judge.serve")
    if p.judge.serve is not None and not any(s.kwargs.get("base_url") is None for _, s in specs):
        raise Refusal("judge.serve", "set, but no llm_judge reward without base_url asks the server it starts")


def tools(p: Any) -> None:
    """A priced ``tool_cost`` needs tool rollouts (else it is 0 for every sample: a price nobody pays); tool-use
    SFT demos (``sft.phases[*].tool_frac``) need a task that has them, their tool in ``tools.names`` and one call
    a turn (no ``tools.parallel_calls``)."""
    for i, s in enumerate(p.reward.rewards):
        if s.name == "tool_cost" and s.weight != 0 and not p.tools.enabled:
            raise Refusal(f"reward.rewards[{i}].weight", f"{s.weight:g} for tool_cost with tools.enabled: false: "
                          "no completion calls a tool, so the price is never paid (weight 0 logs it only)")
    if not p.sft.tool_demos:
        return
    tool = names.TOOL_DEMOS.get(p.task.kind)
    if tool is None:
        raise Refusal("sft.phases.tool_frac", f"> 0 needs a task with tool demos {list(names.TOOL_DEMOS)}, "
                      f"not {p.task.kind!r}")
    if tool not in p.tools.names:
        raise Refusal("tools.names", f"{p.tools.names} lacks {tool!r}, the tool the {p.task.kind} "
                      "task's SFT tool demos call (sft.phases.tool_frac > 0)")
    if p.tools.parallel_calls:
        raise Refusal("tools.parallel_calls", "true with SFT tool demos (sft.phases.tool_frac > 0): a demo shows "
                      "one call closed by its tag and answered at once, not a turn ended by the model's end of "
                      "turn; set parallel_calls: false or tool_frac: 0")


def reward_models(p: Any) -> None:
    """Each ``reward_model.models`` source is the reward stage's folder (pairs from scored rollouts: the verifier
    must be one of ``reward.rewards``, else no completion is labelled) or a preference JSONL file."""
    verifiers = {s.name for s in p.reward.rewards}
    for name, source in p.reward_model.models.items():
        if Path(source) == Path(p.paths.reward_dir):
            if p.reward_model.verifier not in verifiers:
                raise Refusal("reward_model.verifier", f"{p.reward_model.verifier!r} is not one of "
                              f"reward.rewards {sorted(verifiers)}: the rollouts of models.{name} carry no label")
        elif not source.endswith(".jsonl"):
            raise Refusal(f"reward_model.models.{name}", f"{shown(source)} is neither paths.reward_dir "
                          f"({p.paths.reward_dir!r}: pairs from scored rollouts) nor a .jsonl preference file")
    for i, spec in enumerate(p.reward.rewards):
        if spec.name == "reward_model":
            reward_model_path(p, f"reward.rewards[{i}].kwargs.path", spec.kwargs["path"])


def reward_model_path(p: Any, key: str, path: str) -> None:
    """A ``reward_model`` reward's folder: an existing reward model, or one this pipeline builds
    (``paths.reward_model_dir/<name>``, ``<name>`` in ``reward_model.models``) from a preference file; one
    trained on the reward stage's own scored rollouts cannot score them (a cycle: that stage comes first)."""
    built = Path(path).parent == Path(p.paths.reward_model_dir)
    name = Path(path).name
    if built and name in p.reward_model.models:
        if Path(p.reward_model.models[name]) == Path(p.paths.reward_dir):
            raise Refusal(key, f"{shown(path)} is trained on the reward stage's scored rollouts "
                          f"(reward_model.models.{name}): reward.rewards scores them first (a cycle); "
                          "train it on a preference file, or point at a reward model trained before")
        return
    if not (Path(path) / "manifest.json").is_file():
        known = sorted(p.reward_model.models)
        raise Refusal(key, f"{shown(path)} is not a reward model (no manifest.json there) nor one this pipeline "
                      f"builds (paths.reward_model_dir/<name> with <name> in reward_model.models {known})")


def champion(p: Any) -> None:
    """``tracking.champion`` names a number evaluate writes: a metric it never writes kept the champion alias
    where it was, silently, at every evaluation."""
    if p.tracking.champion is None:
        return
    split, metric = p.tracking.champion.split(".", 1)
    splits, metrics = p.evaluate.split_names(), p.evaluate.metric_names()
    if split not in splits or metric not in metrics:
        raise Refusal("tracking.champion", f"{shown(p.tracking.champion)} names no metric evaluate writes: "
                      f"<split>.<metric> with a split in {splits} and a metric in {sorted(metrics)}")


def context(p: Any) -> None:
    """Prompt + completion within the model's context, where both are known before any work: the built
    tiny model (and student) on a generated task (arithmetic, code), whose prompts are at most
    ``BOS <prompt> \n`` tokens of its character tokenizer; a local model folder's ``config.json`` (the
    prompt's length unknown: the completion alone must fit)."""
    sampled = {"rollout.sampling.max_new_tokens": p.rollout.sampling.max_new_tokens,
               "rl.sampling.max_new_tokens": p.rl.sampling.max_new_tokens,
               "evaluate.sampling.max_new_tokens": p.evaluate.sampling.max_new_tokens,
               "distill.max_new_tokens": p.distill.max_new_tokens}
    bound = getattr(p.task, "max_prompt_chars", None)  # BOS + prompt + newline, one token a character
    prompt = bound() + 2 if bound is not None and p.model.base == "tiny" else 1
    contexts: dict[str, tuple[int, list[str]]] = {}  # model -> (context, the max_new_tokens it samples with)
    if p.model.base == "tiny":
        contexts["model.tiny"] = (p.model.tiny.max_position_embeddings, list(sampled))
    elif (Path(p.model.base) / "config.json").is_file():
        import json

        n = json.loads((Path(p.model.base) / "config.json").read_text()).get("max_position_embeddings")
        if isinstance(n, int):
            contexts["model.base"] = (n, list(sampled))
    if isinstance(p.distill.student, TinyModel):  # phases A-B, C (rl sampling) and evaluate@student
        contexts["distill.student"] = (p.distill.student.max_position_embeddings,
                                       ["distill.max_new_tokens", "rl.sampling.max_new_tokens",
                                        "evaluate.sampling.max_new_tokens"])
    for where, (ctx, keys) in contexts.items():
        for key in keys:
            if prompt + sampled[key] > ctx:
                raise Refusal(key, f"{sampled[key]} + a prompt of up to {prompt} tokens exceeds the {ctx}-token "
                              f"context of {where} (max_position_embeddings)")
