"""What every stage's ``main()`` shares: load params (exit 2 on a bad config), set threads and seeds, track
the run in MLflow (``posttrain.tracking``; the store lives beside the params file).

A stage module looks like::

    def run(params, inputs, out) -> dict: ...      # pure of params.yaml, argv and path choices
    def main() -> None:
        stage_main("curate", lambda p: run(p, inputs_from(p), outs_from(p)))
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from posttrain.config import EXIT_CONFIG_ERROR, ConfigError, Params, load_params
from posttrain.errors import StageError


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    if "torch" in sys.modules:  # stages that never import torch (curate) do not pay for it
        sys.modules["torch"].manual_seed(seed)


def setup(params: Params) -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(params.runtime.train_threads)
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    seed_everything(params.seed)


def expected_failure(stage: str, e: BaseException) -> str | None:
    """One line for a failure a user can fix (out of memory, a missing file), None for a bug."""
    torch = sys.modules.get("torch")
    if isinstance(e, MemoryError) or (torch is not None and isinstance(e, torch.OutOfMemoryError)):
        where = "GPU" if torch is not None and isinstance(e, torch.OutOfMemoryError) else "host"
        return (f"out of {where} memory. Lower {stage}.micro_batch_size (or the generate batch size) and re-run: "
                "a changed micro-batch size resumes from the last checkpoint")
    if isinstance(e, FileNotFoundError):
        return f"file not found: {e.filename or e}"
    return None


def stage_main(name: str, body: Callable[[Params], dict[str, Any]], argv: list[str] | None = None) -> None:
    """Parse ``--params``, validate, run ``body``; one-line errors: config -> exit 2, stage -> exit 1."""
    ap = argparse.ArgumentParser(prog=f"python -m stages.{name}")
    ap.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(message)s", datefmt="%H:%M:%S")
    try:
        params = load_params(args.params)
    except ConfigError as e:
        print(f"posttrain: {e}", file=sys.stderr)
        sys.exit(EXIT_CONFIG_ERROR)
    setup(params)
    t0 = time.time()
    from posttrain.tracking import stage_run

    try:
        with stage_run(name, params, Path(args.params).resolve().parent):
            body(params)
    except StageError as e:
        print(f"posttrain {name}: {e}", file=sys.stderr)
        sys.exit(1)
    except Exception as e:  # expected failures get one line too; anything else is a bug: its traceback stays
        line = expected_failure(name, e)
        if line is None:
            raise
        print(f"posttrain {name}: {line}", file=sys.stderr)
        sys.exit(1)
    logging.getLogger(name).info("done in %.1fs", time.time() - t0)
