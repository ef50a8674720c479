"""``key.path=value`` overrides of ``params.yaml``, as ``dvc exp run -S`` applies them.

:func:`parse_overrides` validates overrides against a copy of the parsed file (values are YAML 1.2, read with
:func:`~posttrain.config.params.read_yaml` as DVC reads params) and returns the params they give and the
edits; :func:`render_overrides` returns the file's text with the edits applied, a ruamel round trip that
keeps comments, anchors and key order (what ``dvc exp run -S`` writes). Nothing here writes a file: the
caller (the Prefect flow) decides where the text goes and for how long. Every refusal is a one-line
:class:`ConfigError` naming the override. Torch-free, like the rest of ``posttrain.config``.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from posttrain.config.base import ConfigError
from posttrain.config.params import Params, load_params, parse_params, read_yaml

Edit = tuple[tuple[str, ...], Any]  # (("rl", "lr"), 1e-05): the key path and its new value


def _yaml_problem(e: Exception) -> str:
    """A ruamel error in one line: ``while parsing a flow sequence: expected ',' or ']', but got '<stream end>'``."""
    parts = [getattr(e, "context", None), getattr(e, "problem", None)]
    return ": ".join(p for p in parts if p) or " ".join(str(e).split())


def _parse_edit(override: str) -> Edit:
    """``rl.lr=1e-5`` -> ``(("rl", "lr"), 1e-05)``; the value is YAML (``[1, 2]``, ``off``, ``null``)."""
    from ruamel.yaml import YAMLError

    key, sep, value = override.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise ConfigError(f"override {override!r}: expected key.path=value")
    try:
        return keys, read_yaml(value)
    except YAMLError as e:
        raise ConfigError(f"override {override!r}: value is not valid YAML: {_yaml_problem(e)}") from None


def _set(tree: Any, keys: tuple[str, ...], value: Any) -> None:
    """``tree[k0][k1]...[kn] = value``; ``tree`` and each of ``k0..kn-1`` must be a section (a mapping)."""
    node = tree
    for depth in range(len(keys)):
        if not isinstance(node, dict):
            where = ".".join(keys[:depth]) or "the top level"
            raise ConfigError(f"override {'.'.join(keys)}: {where} is not a section of params.yaml")
        if depth < len(keys) - 1:
            node = node.get(keys[depth])
    node[keys[-1]] = value


def parse_overrides(params_path: str | Path, overrides: Sequence[str]) -> tuple[Params, list[Edit]]:
    """The params ``overrides`` give when applied to the file at ``params_path``, validated, and the edits.
    Nothing is written. Raises :class:`ConfigError` (one line) naming the override or the key it breaks."""
    from ruamel.yaml import YAMLError

    path = Path(params_path)
    edits = [_parse_edit(ov) for ov in overrides]
    if not edits:
        return load_params(path), edits
    if not path.is_file():
        raise ConfigError(f"{path}: file not found")
    try:
        raw = read_yaml(path.read_text())  # a fresh parse: the copy the edits are tried on
    except YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_yaml_problem(e)}") from None
    for keys, value in edits:
        _set(raw, keys, value)
    return parse_params(raw, f"{path} with overrides {list(overrides)}"), edits


def render_overrides(text: str, edits: Sequence[Edit]) -> str:
    """``text`` (a params file) with ``edits`` applied: a ruamel round trip, comments, anchors and key order
    kept, new values in block style (as ``dvc exp run -S`` writes params.yaml). ``edits`` come from
    :func:`parse_overrides`, so every path exists."""
    if not edits:
        return text
    from ruamel.yaml import YAML

    rt = YAML()
    rt.default_flow_style = False
    data = rt.load(text)
    for keys, value in edits:
        _set(data, keys, value)
    buf = io.StringIO()
    rt.dump(data, buf)
    return buf.getvalue()
