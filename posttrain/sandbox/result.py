"""What one sandboxed run gives back: a :class:`Result` whatever the program did (it never raises for anything
the program does: a crash, a limit hit, a syntax error, garbage on stdout)."""

from __future__ import annotations

import dataclasses
from typing import Literal

# ok: exit 0. error: a non-zero exit (an exception, a syntax error, sys.exit(3)). timeout: past wall_s (the
# tree was killed) or past cpu_s (RLIMIT_CPU's SIGXCPU/SIGKILL). memory: an allocation past memory_mb
# (MemoryError). output_limit: more than max_output_kb on stdout or stderr (the tree was killed). killed: ended
# by another signal. refused: bubblewrap would not set the sandbox up (nothing of the program ran).
Status = Literal["ok", "error", "timeout", "memory", "output_limit", "killed", "refused"]
STATUSES: tuple[Status, ...] = ("ok", "error", "timeout", "memory", "output_limit", "killed", "refused")


@dataclasses.dataclass(frozen=True)
class Result:
    """One program's run. ``exit_code``: its exit status (128 + n when signal n ended it; None when the run was
    killed from outside or refused). ``stdout``/``stderr``: decoded UTF-8 (invalid bytes replaced), each cut
    to ``max_output_kb``; ``truncated`` when either was cut. ``wall_s``: from the start (bwrap's set-up
    included) until the program exited or its kill was decided; the teardown of its process tree after that,
    which ``Sandbox.run`` waits for, is not counted. ``detail``: one line saying why, for an audit."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool
    wall_s: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        """Exit 0 within every limit."""
        return self.status == "ok"

    def to_dict(self) -> dict[str, object]:
        """A JSON-ready dict (audits, benchmark results)."""
        return dataclasses.asdict(self)
