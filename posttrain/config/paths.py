"""``paths:``: every file and folder the pipeline reads or writes (``dvc.yaml`` reads them through ``${paths.*}``)."""

from __future__ import annotations

from pydantic import Field

from posttrain.config.base import Section


class Paths(Section):
    """Every file and folder the pipeline reads or writes. ``dvc.yaml`` reads these through ``${paths.*}``."""

    curated_dir: str = Field(description="curate outputs: train.parquet, sft.parquet, eval.parquet, quarantine")
    curate_report_dir: str = Field(description="decontamination report (JSON + Markdown)")
    base_model: str = Field(description="the starting checkpoint, saved by sft (HF folder)")
    sft_model: str = Field(description="the cold-start SFT checkpoint (HF folder)")
    sft_checkpoints: str = Field(description="resumable sft checkpoints; NOT a DVC out, so a re-run finds them")
    sft_report_dir: str = Field(description="sft training log (CSV for dvc plots)")
    rollout_dir: str = Field(description="rollout stage: rollouts.parquet (G samples per prompt, SFT policy)")
    reward_dir: str = Field(description="reward stage: scored.parquet, pass_rates.parquet")
    reward_report_dir: str = Field(description="reward audit (JSON + Markdown)")
    rl_model: str = Field(description="the RL policy (HF folder)")
    rl_dir: str = Field(description="rl stage data: per-step rollout shards, the selected prompts")
    rl_checkpoints: str = Field(description="resumable rl checkpoints + in-flight shards; NOT a DVC out")
    rl_report_dir: str = Field(description="rl training log (CSV for dvc plots)")
    student_sft_model: str = Field(description="the student after its cold start (HF folder)")
    student_model: str = Field(description="the distilled student (HF folder)")
    distill_checkpoints: str = Field(description="resumable distill checkpoints; NOT a DVC out")
    distill_report_dir: str = Field(description="distill training log (CSV + PNG)")
    eval_report_dir: str = Field(description="evaluate report: generations.parquet, report.md")
    metrics_dir: str = Field(description="one <stage>.json per stage, for `dvc metrics show`")
