"""Policy weights by version, as files: the transport from the trainer to generator processes (a vLLM
generator loads a version into its staging model, then copies it into its engine: ``worker.generator_main``).

``v_NNNNNN.pt`` in one folder, each written whole (a temp file renamed in, so a reader never sees half of
one); the trainer publishes a version after every update and removes the ones older than the previous, and a
generator loads the newest version at or above what it needs between two steps (``acquire``). A file removed
while a generator opens it is retried with the newer one; one removed while it reads stays readable (POSIX).
Files rather than shared memory: a version is immutable once written, so no generator can see weights change
under it inside a sample, and no locking or reference counting of buffers is needed.

A version holds the *trainable* tensors only (a LoRA policy's adapters: tens of MB where the whole state dict
would be the frozen base too, 14.2 GiB at 7B in bf16); every generator built its model from the same policy
folder, so the frozen rest is already there, and ``acquire`` loads a version over it (an unexpected key is an
error, never ignored). The trainer's thread only snapshots those tensors; one writer thread per store saves and
renames them, so the disk write is off the trainer's critical path (``flush`` waits for it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

POLL_S = 0.02


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A snapshot (detached copies in host memory: no second copy on the accelerator) of ``model``'s trainable
    parameters by state-dict name; every parameter when none is trainable (a frozen full-weight copy)."""
    named = list(model.named_parameters())
    chosen = [(n, p) for n, p in named if p.requires_grad] or named
    return {n: p.detach().to("cpu", copy=True) for n, p in chosen}


class WeightStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._writer: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    def path(self, version: int) -> Path:
        return self.root / f"v_{version:06d}.pt"

    def versions(self) -> list[int]:
        return sorted(int(p.stem[2:]) for p in self.root.glob("v_*.pt"))

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Snapshot ``model``'s trainable weights as ``version`` and return; the writer thread saves them and
        removes versions older than ``version - 1`` (an earlier write's error is raised here)."""
        self.flush()  # in order, one snapshot at a time (never two in memory); a failed write fails the stage
        state = trainable_state(model)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="weights")
        self._pending = self._writer.submit(self._write, state, version)

    def _write(self, state: dict[str, torch.Tensor], version: int) -> None:
        tmp = self.root / f".v_{version:06d}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.path(version))
        for v in self.versions():
            if v < version - 1:
                self.path(v).unlink(missing_ok=True)

    def flush(self) -> None:
        """Wait until every published version is on disk; a failed write is raised once (not again by a later
        ``flush`` while the stage unwinds from it)."""
        pending = self._pending
        if pending is None:
            return
        try:
            pending.result()
        finally:  # done (written or failed: reported here, once); a wait interrupted (Ctrl-C) keeps it pending
            if pending.done():
                self._pending = None

    def acquire(self, need: int, model: torch.nn.Module, loaded: int | None, stopped: Callable[[], bool]
                ) -> int | None:
        """Wait until a version >= ``need`` exists, load the newest into ``model`` (unless it is ``loaded``, the
        one it holds) and return it; None once ``stopped()``."""
        while not stopped():
            found = self.versions()
            v = found[-1] if found else None
            if v is not None and v >= need:
                if v == loaded:
                    return v
                try:
                    state = torch.load(self.path(v), map_location="cpu", weights_only=True)
                except FileNotFoundError:  # removed since listed: a newer one exists
                    continue
                missing_ok = model.load_state_dict(state, strict=False)
                if missing_ok.unexpected_keys:
                    raise RuntimeError(f"weights v{v} hold tensors this model lacks: {missing_ok.unexpected_keys[:3]}")
                return v
            time.sleep(POLL_S)
        return None
