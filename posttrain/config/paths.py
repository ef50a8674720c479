"""``paths:``: every file and folder the pipeline reads or writes (``dvc.yaml`` reads them through ``${paths.*}``)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from posttrain.config.base import Section

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
