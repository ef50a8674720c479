"""``paths:``: every file and folder the pipeline reads or writes (``dvc.yaml`` reads them through ``${paths.*}``)."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Annotated

from pydantic import Field, model_validator

from posttrain.config.base import Refusal, Section

PathStr = Annotated[str, Field(min_length=1)]  # '' would write into the repo root


class Paths(Section):
    """Every file and folder the pipeline reads or writes. ``dvc.yaml`` reads these through ``${paths.*}``."""

    curated_dir: PathStr = Field(description="curate outputs: train.parquet, sft.parquet, eval.parquet, quarantine")
    curate_report_dir: PathStr = Field(description="decontamination report (JSON + Markdown)")
    base_model: PathStr = Field(description="the starting checkpoint, imported by the model stage (HF folder + "
                                "manifest.json)")
    sft_model: PathStr = Field(description="the cold-start SFT checkpoint (HF folder)")
    sft_checkpoints: PathStr = Field(description="resumable sft checkpoints; NOT a DVC out, so a re-run finds them")
    sft_report_dir: PathStr = Field(description="sft training log (CSV for dvc plots)")
    rollout_dir: PathStr = Field(description="rollout stage: rollouts.parquet (G samples per prompt, SFT policy)")
    rollout_checkpoints: PathStr = Field(description="rollout's finished chunks while it runs (a killed run resumes "
                                         "from them); NOT a DVC out, removed once rollouts.parquet is written")
    reward_dir: PathStr = Field(description="reward stage: rewards.parquet (reward columns by prompt_id, sample), "
                          "pass_rates.parquet")
    reward_report_dir: PathStr = Field(description="reward audit (JSON + Markdown)")
    judge_cache: PathStr = Field(description="the llm_judge call cache (JSONL, one judgement a line): a DVC out of "
                                 "reward kept between runs (persist), so a re-run does not ask again")
    reward_model_dir: PathStr = Field(description="reward_model@<name>: <dir>/<name>/ holds member_0..K-1 (HF "
                                      "folders) and manifest.json: one artifact (reward_model.load_reward_model)")
    reward_model_data_dir: PathStr = Field(description="reward_model@<name>: <dir>/<name>/pairs.parquet (the pairs "
                                           "that trained or were held out, with their split)")
    reward_model_checkpoints: PathStr = Field(description="resumable reward_model checkpoints; NOT a DVC out")
    reward_model_report_dir: PathStr = Field(description="reward_model@<name>: <dir>/<name>/: member_<k>/"
                                             "train_log.csv, report.md, quarantine.jsonl (malformed preference rows)")
    rl_model: PathStr = Field(description="the RL policy (HF folder)")
    rl_dir: PathStr = Field(description="rl stage data: per-step rollout shards, the selected prompts")
    rl_checkpoints: PathStr = Field(description="resumable rl checkpoints + in-flight shards; NOT a DVC out")
    rl_report_dir: PathStr = Field(description="rl training log (CSV for dvc plots)")
    student_sft_model: PathStr = Field(description="the student after its cold start (HF folder)")
    student_model: PathStr = Field(description="the distilled student (HF folder)")
    distill_checkpoints: PathStr = Field(description="resumable distill checkpoints; NOT a DVC out")
    distill_report_dir: PathStr = Field(description="distill training log (CSV + PNG)")
    eval_report_dir: PathStr = Field(description="evaluate report: generations.parquet, report.md")
    metrics_dir: PathStr = Field(description="one <stage>.json per stage, for `dvc metrics show`")

    @model_validator(mode="after")
    def _apart(self) -> Paths:
        """No relative path that climbs out (``..``: DVC tracks and removes only what is inside the repository, and
        an output outside it is written where no lineage sees it; an absolute path is checked against the
        repository by ``outside``, which ``posttrain validate`` and ``posttrain repro`` call: a stage run by hand
        or a test may write anywhere), and no two at one place or one inside another (two stages would replace or
        delete each other's files)."""
        parts: dict[str, tuple[str, ...]] = {}
        for key, value in self.model_dump().items():
            p = PurePosixPath(value.replace("\\", "/"))
            if ".." in p.parts:
                raise Refusal(key, f"{value!r} climbs out of the repository: give a path inside it, without ..")
            parts[key] = tuple(x for x in p.parts if x != ".")
        seen: list[str] = []
        for b, pb in parts.items():
            for a in seen:
                pa = parts[a]
                n = min(len(pa), len(pb))
                if pa[:n] == pb[:n]:
                    what = "the same path as" if pa == pb else "inside" if len(pb) > len(pa) else "around"
                    raise Refusal(b, f"{getattr(self, b)!r} is {what} paths.{a} ({getattr(self, a)!r}): two "
                                  "stages would replace or delete each other's files")
            seen.append(b)
        return self

    def outside(self, root: Path) -> str | None:
        """``paths.<key>: '<value>' is outside the repository <root>`` for the first path not inside ``root`` (the
        folder of params.yaml, where DVC runs), or None."""
        top = root.resolve()
        for key, value in self.model_dump().items():
            if not (top / value).resolve().is_relative_to(top):
                return f"paths.{key}: {value!r} is outside the repository {top}: DVC would neither track nor " \
                       "restore it; give a path inside it"
        return None
