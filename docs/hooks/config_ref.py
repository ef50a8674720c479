"""MkDocs hook: the configuration reference, generated from the code at build time (never written by hand).

``docs/configuration.md`` holds the marker ``<!-- config-reference -->``; this hook replaces it with one table
per ``params.yaml`` section, walked from the pydantic v2 models behind ``from posttrain.config import Params``
(the only import it relies on: ``posttrain.config`` may be a module or a package). For every field: its key
path (``rl.select.min_pass_rate``), its type with the model's constraints, its default (or ``default_factory``
result, or "required"), and its ``description``; a model's class docstring describes its section. Nested
models become their own sections: ``rl.select``; a list of models ``curate.sources[]``; a dict of models
``x.<name>``; a discriminated union ``Annotated[A | B, Field(discriminator="kind")]`` one section per variant
(``task`` with ``kind: arith``, ``task`` with ``kind: math``).

A failed import fails the build (a reference that silently vanished would be worse than none), and so, under
``mkdocs build --strict``, does a ``posttrain.config`` that pulls in torch: validating params is torch-free
by contract, and the docs build must stay fast.
"""

from __future__ import annotations

import enum
import inspect
import json
import logging
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from mkdocs.exceptions import PluginError

MARKER = "<!-- config-reference -->"
PAGE = "configuration.md"
log = logging.getLogger("mkdocs.hooks.config_ref")


# ------------------------------------------------------------------------------------------------ build hooks
def on_config(config: Any) -> Any:
    """Put the repository root (the folder of mkdocs.yml) first on ``sys.path``, so the build documents the
    checkout it runs in, installed or not."""
    root = str(Path(config.config_file_path).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise PluginError(f"config_ref: {PAGE} lacks the marker {MARKER}")
    had_torch = "torch" in sys.modules
    try:
        from posttrain.config import Params
    except Exception as e:  # noqa: BLE001 - any failure here must stop the build, with its cause
        raise PluginError(f"config_ref: `from posttrain.config import Params` failed: {type(e).__name__}: {e}") from e
    if not had_torch and "torch" in sys.modules:
        log.warning("config_ref: importing posttrain.config imported torch; validating params must stay torch-free")
    return markdown.replace(MARKER, render(Params))


# ------------------------------------------------------------------------------------------------- the walk
def _is_model(tp: Any) -> bool:
    from pydantic import BaseModel

    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _strip(tp: Any) -> tuple[Any, list[Any]]:
    """``Annotated[X, m1, m2]`` -> ``(X, [m1, m2])`` (nested Annotated flattened)."""
    meta: list[Any] = []
    while get_origin(tp) is Annotated:
        tp, *more = get_args(tp)
        meta.extend(more)
    return tp, meta


def _union_args(tp: Any) -> list[Any] | None:
    if get_origin(tp) in (Union, types.UnionType):
        return list(get_args(tp))
    return None


def _discriminator(meta: list[Any]) -> str | None:
    for m in meta:
        d = getattr(m, "discriminator", None)
        if isinstance(d, str):
            return d
    return None


@dataclass
class Child:
    """A nested section found in a field's type: where it lives and which model describes it."""

    path: str  # key path of the nested section: rl.select, curate.sources[], evaluate.models.<name>
    model: Any
    variant: str | None = None  # "kind: arith" for a member of a discriminated union
    anchor: str = ""  # unique on the page; set when the parent's row links to it


@dataclass
class Section:
    path: str
    model: Any
    variant: str | None = None
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # key, type, default, description
    anchor: str = ""


def _yaml_name(attr: str, info: Any) -> str:
    """The key as written in params.yaml: a field's (validation) alias when it has one, else its name."""
    alias = info.validation_alias if isinstance(info.validation_alias, str) else info.alias
    return alias if isinstance(alias, str) and alias else attr


def _children(tp: Any, path: str, disc: str | None = None) -> list[Child]:
    """Every model reachable in ``tp`` with the key path it lives at (containers add ``[]`` / ``.<name>``)."""
    tp, meta = _strip(tp)
    disc = _discriminator(meta) or disc
    if _is_model(tp):
        return [Child(path, tp, _variant(tp, disc))]
    members = _union_args(tp)
    if members is not None:
        out: list[Child] = []
        for m in members:
            out.extend(_children(m, path, disc))
        return out
    origin, args = get_origin(tp), get_args(tp)
    if origin in (list, set, frozenset, tuple, typing.Sequence) or (origin and _name(origin) in {"Sequence"}):
        out = []
        for a in args:
            if a is not Ellipsis:
                out.extend(_children(a, f"{path}[]", disc))
        return _dedupe(out)
    if origin is dict or (origin and _name(origin) in {"Mapping", "MutableMapping"}):
        return _children(args[1], f"{path}.<name>", disc) if len(args) == 2 else []
    return []


def _dedupe(children: list[Child]) -> list[Child]:
    seen, out = set(), []
    for c in children:
        if (c.path, c.model) not in seen:
            seen.add((c.path, c.model))
            out.append(c)
    return out


def _variant(model: Any, disc: str | None) -> str | None:
    """``kind: arith`` for a member of a union discriminated by ``kind`` (its field's one Literal value)."""
    if not disc or disc not in model.model_fields:
        return None
    tp, _ = _strip(model.model_fields[disc].annotation)
    if get_origin(tp) is Literal:
        return f"{disc}: " + " | ".join(_scalar(v) for v in get_args(tp))
    return None


def collect(model: Any, path: str = "", variant: str | None = None, out: list[Section] | None = None,
            stack: tuple[Any, ...] = (), anchor: str = "top-level", used: set[str] | None = None) -> list[Section]:
    """Sections in reading order: a section's own table first, then its nested sections, depth first."""
    out = [] if out is None else out
    used = {anchor} if used is None else used
    sec = Section(path, model, variant, anchor=anchor)
    out.append(sec)
    nested: list[Child] = []
    for attr, info in model.model_fields.items():
        name = _yaml_name(attr, info)
        key = f"{path}.{name}" if path else name
        kids = _dedupe([c for c in _children(info.annotation, key, info.discriminator
                                             if isinstance(info.discriminator, str) else None)
                        if c.model not in stack + (model,)])
        for c in kids:
            c.anchor = _unique(_anchor(c.path, c.variant), used)
        nested.extend(kids)
        kind_of = variant if variant and variant.split(":", 1)[0] in (name, attr) else None  # the discriminator field
        sec.rows.append((key, _type_cell(info.annotation, info.metadata), _default_cell(info, kids),
                         _description_cell(info, kids, kind_of)))
    for c in nested:
        collect(c.model, c.path, c.variant, out, stack + (model,), c.anchor, used)
    return out


def _unique(anchor: str, used: set[str]) -> str:
    out, n = anchor, 2
    while out in used:
        out, n = f"{anchor}-{n}", n + 1
    used.add(out)
    return out


# ---------------------------------------------------------------------------------------------- formatting
def _name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or getattr(tp, "_name", None) or str(tp)


def _scalar(v: Any) -> str:
    """A value as it would be written in params.yaml (flow style)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, enum.Enum):
        return _scalar(v.value)
    if isinstance(v, str):  # quoted only where YAML 1.2 (how DVC and the stages read params) needs it
        plain = v and v.strip() == v and not re.search(r"[:#{}\[\],&*!|>'\"%@`]", v) \
            and v.lower() not in {"null", "true", "false", "~"}
        return v if plain else json.dumps(v)
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, Path):
        return str(v)
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_scalar(k)}: {_scalar(x)}" for k, x in v.items()) + "}"
    if isinstance(v, list | tuple | set | frozenset):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if hasattr(v, "model_dump"):
        return _scalar(v.model_dump(mode="json"))
    return str(v)


def _fmt_type(tp: Any) -> str:
    tp, _ = _strip(tp)
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any"
    members = _union_args(tp)
    if members is not None:
        return " | ".join(_fmt_type(m) for m in members)
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(_scalar(v) for v in get_args(tp))
    if origin is not None:
        args = get_args(tp)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return f"tuple[{_fmt_type(args[0])}, ...]"
        inner = ", ".join(_fmt_type(a) for a in args)
        return f"{_name(origin)}[{inner}]" if args else _name(origin)
    if _is_model(tp):
        return tp.__name__
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(_scalar(m.value) for m in tp)
    return _name(tp)


_CONSTRAINTS = (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("multiple_of", "multiple of"),
                ("min_length", "min length"), ("max_length", "max length"), ("pattern", "matches"))


def _constraints(meta: list[Any]) -> list[str]:
    out = []
    for m in meta:
        for attr, sym in _CONSTRAINTS:
            v = getattr(m, attr, None)
            if v is not None and not callable(v):
                out.append(f"{sym} {v}")
    return out


def _code(s: str) -> str:
    """An inline code span that survives any backticks in ``s``."""
    ticks = "``" if "`" in s else "`"
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s}{pad}{ticks}"


def _type_cell(tp: Any, meta: list[Any]) -> str:
    cell = _code(_fmt_type(tp))
    more = _constraints(meta) + _constraints(_strip(tp)[1])
    if more:
        cell += " (" + ", ".join(more) + ")"
    return cell


def _default_cell(info: Any, kids: list[Child]) -> str:
    if info.default_factory is not None:
        takes_data = getattr(info, "default_factory_takes_data", None)  # pydantic >= 2.10
        if takes_data is None:
            try:
                ps = list(inspect.signature(info.default_factory).parameters.values())
                takes_data = len(ps) == 1 and ps[0].kind in (ps[0].POSITIONAL_ONLY, ps[0].POSITIONAL_OR_KEYWORD) \
                    and ps[0].default is ps[0].empty
            except (TypeError, ValueError):
                takes_data = False
        if takes_data:  # pydantic >= 2.10: a factory of the validated data
            return "computed from the other fields"
        try:
            value = info.default_factory()
        except Exception:  # noqa: BLE001 - show what we can; the build must not fail on a factory
            return "computed"
    elif info.is_required():
        return "**required**"
    else:
        value = info.default
    if hasattr(value, "model_dump") and kids:
        changed = _changed_fields(value)
        if changed is not None and not changed:  # the section's own defaults: its table says them
            v = _variant(type(value), kids[0].variant.split(":")[0] if kids[0].variant else None)
            return f"{_code(v)} (its defaults)" if v else "its section's defaults"
        if changed:  # a default that differs from the section's class defaults: say how
            return _code(_scalar(changed)) + ", the rest its section's defaults"
    return _code(_scalar(value))


def _changed_fields(value: Any) -> dict[str, Any] | None:
    """The fields of a default model instance that differ from its class's defaults ({} when none; None when the
    class cannot be built without arguments, i.e. the default is given in full)."""
    try:
        base = type(value)()
    except Exception:  # noqa: BLE001 - required fields: no class defaults to compare with
        return None
    mine, theirs = value.model_dump(mode="json"), base.model_dump(mode="json")
    return {k: v for k, v in mine.items() if theirs.get(k) != v}


_ROLES = re.compile(r":(?:class|func|meth|attr|mod|data|obj|exc|py:\w+):`~?([^`]+)`")


def md_text(s: str) -> str:
    """Docstring/description text -> Markdown: RST roles and ``literals`` become code spans; outside code,
    characters Markdown or HTML would eat (``<name>``, ``a*b``, table pipes) are escaped."""
    s = _ROLES.sub(r"``\1``", s)
    out = []
    for i, part in enumerate(re.split(r"(``.+?``|`[^`]+`)", s)):
        if i % 2:  # a code span: keep, normalise to single backticks when possible
            body = part.strip("`")
            out.append(_code(body))
        else:
            part = part.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
            part = re.sub(r"([*_|\\\[\]])", r"\\\1", part)
            out.append(part)
    return "".join(out)


def _description_cell(info: Any, kids: list[Child], kind_of: str | None = None) -> str:
    parts = []
    if info.description:
        text = md_text(" ".join(info.description.split()))
        parts.append(text if text.endswith((".", "!", "?")) else text + ".")
    elif kind_of is not None:
        parts.append(f"Selects this variant ({_code(kind_of)}).")
    extra = info.json_schema_extra
    if isinstance(extra, dict) and extra.get("fingerprint") is False:
        parts.append("*Not part of the resume fingerprint: changing it between a kill and a resume resumes.*")
    if kids:
        links = ", ".join(f"[{_code(_heading(c.path, c.variant))}](#{c.anchor})" for c in kids)
        parts.append(f"See {links}.")
    return " ".join(parts) or " "


def _anchor(path: str, variant: str | None = None) -> str:
    base = path or "top-level"
    if variant:
        base += "-" + variant.split(":", 1)[1].strip()
    return re.sub(r"[^a-z0-9]+", "-", base.lower()).strip("-")


def _heading(path: str, variant: str | None) -> str:
    return f"{path} ({variant})" if variant else path


def _docstring(model: Any) -> str:
    doc = model.__dict__.get("__doc__")  # the class's own: never a base class's (e.g. the shared Section base)
    if not doc:
        return ""
    text = inspect.cleandoc(doc)
    text = re.sub(r"::\n", ":\n", text)  # RST literal blocks stay indented: Markdown code blocks
    paras = text.split("\n\n")
    return "\n\n".join(p if p.startswith("    ") else md_text(p) for p in paras)


def render(root: Any) -> str:
    sections = collect(root)
    lines: list[str] = []
    for sec in sections:
        top = "." not in sec.path and "[]" not in sec.path  # the root and its sections: h2; nested: h3
        level = "##" if top else "###"
        title = _code(_heading(sec.path, sec.variant)) if sec.path else "Top level"
        lines += [f"{level} {title} {{ #{sec.anchor} }}", ""]
        doc = _docstring(sec.model)
        if doc:
            lines += [doc, ""]
        if sec.path:
            lines += [f"Model: `{sec.model.__module__}.{sec.model.__qualname__}`.", ""]
        else:
            lines += [f"The root model `{sec.model.__module__}.{sec.model.__qualname__}`: every key of "
                      "`params.yaml` below is one of its fields, or a field of a section nested in it.", ""]
        if sec.rows:
            lines += ["| key | type | default | description |", "|---|---|---|---|"]
            lines += [f"| {_code(k)} | {t} | {d} | {desc} |" for k, t, d, desc in sec.rows]
            lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":  # python docs/hooks/config_ref.py: print the generated Markdown
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from posttrain.config import Params

    print(render(Params))
