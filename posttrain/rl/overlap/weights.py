"""Policy weights by version, as files: the transport from the trainer to generator processes (a vLLM
generator loads a version into its staging model, then copies it into its engine: ``worker.generator_main``).

``v_NNNNNN.pt`` in one folder, each written whole (a temp file renamed in, so a reader never sees half of
one); the trainer publishes a version after every update and removes the ones older than the previous, and a
generator loads the newest version at or above what it needs between two steps (``acquire``). A file removed
while a generator opens it is retried with the newer one; one removed while it reads stays readable (POSIX).
Files rather than shared memory: a version is immutable once written, so no generator can see weights change
under it inside a sample, and no locking or reference counting of buffers is needed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

POLL_S = 0.02


class WeightStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> Path:
        return self.root / f"v_{version:06d}.pt"

    def versions(self) -> list[int]:
        return sorted(int(p.stem[2:]) for p in self.root.glob("v_*.pt"))

    def publish(self, model: torch.nn.Module, version: int) -> None:
        """Write ``model``'s weights as ``version`` and remove versions older than ``version - 1``."""
        tmp = self.root / f".v_{version:06d}.tmp"
        torch.save(model.state_dict(), tmp)
        os.replace(tmp, self.path(version))
        for v in self.versions():
            if v < version - 1:
                self.path(v).unlink(missing_ok=True)

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
                model.load_state_dict(state)
                return v
            time.sleep(POLL_S)
        return None
