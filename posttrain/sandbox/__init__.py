"""Running untrusted (model-written) Python: a bubblewrap sandbox per program (:mod:`.bwrap`: why bubblewrap,
what is isolated), its limits and result (:mod:`.executor`, :mod:`.result`), and a pool that runs many at once
(:mod:`.pool`). Where bubblewrap is missing or cannot create namespaces, :class:`SandboxUnavailable` is raised
and nothing runs. docs/sandbox.md says what is and is not covered."""

from posttrain.sandbox.bwrap import SandboxUnavailable
from posttrain.sandbox.executor import Sandbox
from posttrain.sandbox.pool import Program, SandboxPool
from posttrain.sandbox.result import STATUSES, Result, Status

__all__ = ["STATUSES", "Program", "Result", "Sandbox", "SandboxPool", "SandboxUnavailable", "Status"]
