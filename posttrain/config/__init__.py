"""Typed models of ``params.yaml``: one module per params section, every field documented where declared.

``load_params`` / ``parse_params`` validate a file or mapping (``params.py``); the section models are
re-exported here so ``from posttrain.config import Rl`` works. Torch-free (an import-linter contract): the
registry names a section validates against live in ``names.py``.
"""

from posttrain.config.base import EXIT_CONFIG_ERROR, NOT_RESULT, ConfigError, Refusal, Section
from posttrain.config.correction import CORRECTION_KWARGS, CorrectionSpec, Tis
from posttrain.config.curate import (
    BenchmarkSpec,
    Curate,
    CurateEval,
    Decontam,
    Dedup,
    FileSource,
    HubSource,
    SourceSpec,
    SyntheticSource,
    Validation,
)
from posttrain.config.distill import Distill, DistillOnPolicy, DistillPhase, DistillWarmup, TeacherLayers
from posttrain.config.evaluate import Evaluate, Report
from posttrain.config.judge import Judge, LlmJudgeKwargs
from posttrain.config.model import LoraCfg, ModelCfg, PromptCfg, TinyModel
from posttrain.config.overrides import Edit, parse_overrides, render_overrides
from posttrain.config.params import Params, load_params, parse_params, read_yaml, repo_root, stage_metrics
from posttrain.config.paths import Paths
from posttrain.config.prefect import PrefectCfg
from posttrain.config.reward import Reward, RewardSpec
from posttrain.config.reward_model import RewardModel
from posttrain.config.rl import BATCH_BASELINE, KL_IN_REWARD, RefReset, Rl, RlSampling, RlSelect
from posttrain.config.rollout import Rollout, Sampling, VLLMOptions
from posttrain.config.runtime import Distributed, Runtime
from posttrain.config.sandbox import SandboxCfg
from posttrain.config.sft import Sft, SftPhase
from posttrain.config.task import ArithTask, CodeTask, MathTask, TaskSpec
from posttrain.config.tools import ToolsCfg
from posttrain.config.tracking import TrackingCfg

__all__ = [
    "ArithTask", "BATCH_BASELINE", "BenchmarkSpec", "CORRECTION_KWARGS", "CodeTask", "ConfigError", "CorrectionSpec",
    "Curate", "CurateEval", "Decontam", "Dedup", "Distill", "DistillOnPolicy", "DistillPhase", "DistillWarmup",
    "Distributed", "EXIT_CONFIG_ERROR", "Edit", "Evaluate", "FileSource", "HubSource", "Judge", "KL_IN_REWARD",
    "LlmJudgeKwargs", "LoraCfg",
    "MathTask", "ModelCfg", "NOT_RESULT", "Params", "Paths", "PrefectCfg", "PromptCfg", "RefReset", "Refusal", "Report",
    "Reward", "RewardModel", "RewardSpec", "Rl", "RlSampling", "RlSelect", "Rollout", "Runtime", "Sampling",
    "SandboxCfg", "Section", "Sft", "SftPhase", "SourceSpec", "SyntheticSource", "TaskSpec", "TeacherLayers", "Tis",
    "TinyModel",
    "ToolsCfg", "TrackingCfg", "VLLMOptions", "Validation", "load_params", "parse_overrides", "parse_params",
    "read_yaml", "render_overrides", "repo_root", "stage_metrics",
]
