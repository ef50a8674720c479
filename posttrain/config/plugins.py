"""Reward plug-ins named ``package.module:function`` in ``reward.rewards[].name``: imported and checked at load.

A plug-in is checked before any work, so a typo fails in one line naming the key instead of after hours of
generation: the module imports, the attribute exists, it is a plain module-level function (a process pool
sends it to its workers by reference, so closures, lambdas, bound methods and callable objects are refused)
and its signature takes one positional batch of ``Sample`` plus exactly the configured ``kwargs``:
``fn(samples, **kwargs) -> one value per sample`` (``posttrain.rewards.per_sample`` turns a one-sample function
into that). A function whose first parameter is annotated ``Sample`` (the one-sample signature of old) is refused
with that hint.

Importing the user's module is the only import this package makes at run time; what that module imports is
its own business (the config stays torch-free for the built-in rewards, which ``names.REWARDS`` lists).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from typing import Any

_REF = re.compile(r"[A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)*:[A-Za-z_]\w*")


def is_plugin(name: str) -> bool:
    """A reward name that points at code (``package.module:function``) rather than a key of ``REWARDS``."""
    return ":" in name


def load_reward(ref: str) -> Callable[..., Any]:
    """Import ``package.module:function`` and return the function; ``ValueError`` (one line) when it cannot
    be imported or is not a valid reward function."""
    if not _REF.fullmatch(ref):
        raise ValueError(f"{ref!r} is not 'package.module:function'")
    module_name, attr = ref.split(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # ImportError, or whatever the module raises while importing
        first = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"cannot import {module_name!r} ({type(e).__name__}: {first})") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"module {module_name!r} has no attribute {attr!r}")
    if not inspect.isfunction(fn):
        raise ValueError(f"{ref} is a {type(fn).__name__}, not a function: a reward is a module-level function "
                         "fn(samples, **kwargs) -> one float | None per sample")
    if fn.__module__ != module_name or fn.__qualname__ != attr:
        raise ValueError(f"{ref} is {fn.__module__}:{fn.__qualname__}; name the function where it is defined (a "
                         "process pool imports it by that name)")
    return fn


def check_kwargs(ref: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """Refuse a signature that cannot be called as ``fn(samples, **kwargs)`` (``ValueError``, one line)."""
    first = next(iter(inspect.signature(fn).parameters.values()), None)
    ann = getattr(first, "annotation", None)
    if not hasattr(fn, "__wrapped__") and getattr(ann, "__name__", ann) == "Sample":
        raise ValueError(f"{ref} takes one Sample; a reward takes a batch: fn(samples, **kwargs) -> one value per "
                         "sample (decorate a one-sample function with posttrain.rewards.per_sample)")
    try:
        inspect.signature(fn).bind(object(), **kwargs)
    except TypeError as e:
        params = list(inspect.signature(fn).parameters)
        raise ValueError(f"{ref}{inspect.signature(fn)} cannot be called as fn(samples, **{sorted(kwargs)}): {e} "
                         f"(it takes {params})") from None
