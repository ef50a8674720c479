"""Imported first by the reward pool's forkserver (``pool._preload``), so every worker forked from it inherits this.

A worker started by a non-fork method re-runs the stage's ``__main__`` module (``python -m stages.rl``) as
``__mp_main__``; the forkserver has already imported that module (so the re-run costs nothing), which makes
``runpy`` warn in every worker that it was "found in sys.modules". Harmless here: stage modules have no import
side effects (their work is under ``if __name__ == "__main__"``).
"""

import warnings

warnings.filterwarnings("ignore", message=r".*found in sys\.modules after import of package", category=RuntimeWarning)
