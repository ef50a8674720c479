"""Error types shared across the library (kept import-light: no torch here)."""


class StageError(RuntimeError):
    """A stage that ran but must fail (e.g. contamination above the configured limit). Exit code 1."""


class ModelLoadError(StageError):
    """A model or tokenizer that cannot be loaded (missing folder, hub unreachable/offline)."""
