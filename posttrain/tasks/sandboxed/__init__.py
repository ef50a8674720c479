"""The programs ``codeexec`` runs inside the sandbox, as real files (linted, read as text, never imported here):
``harness.py`` (main: runs the tests, writes the verdict), ``runner.py`` (the solution's own interpreter) and
``codec.py`` (plain data across the pipe between them, exec'd by both). See :mod:`posttrain.tasks.codeexec`."""
