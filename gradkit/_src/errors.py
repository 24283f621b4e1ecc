"""The one error type gradkit raises, and helpers that format its messages."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

PREFIX = "[gradkit]"


class GradkitError(Exception):
    """Raised for every problem gradkit detects; the message starts with ``[gradkit]``.

    Messages name what was being done (rule, op, source line), what was
    expected and what was got, and how to fix it.

    Examples:
      >>> import gradkit as gk
      >>> try:
      ...     gk.RuleTable({"sqrt": 3})
      ... except gk.GradkitError as e:
      ...     print(str(e).split(":")[0])
      [gradkit] table entry 'sqrt' is not a rule
    """

    def __init__(self, message: str):
        if not message.startswith(PREFIX):
            message = f"{PREFIX} {message}"
        super().__init__(message)


class GradkitWarning(UserWarning):
    """Warned when gradkit computes something it cannot vouch for; the message starts with ``[gradkit]``.

    E.g. :func:`gradkit.attribution.lrp` warns of an op on the relevance path
    that no rule covers. Turn it into an error with Python's ``warnings``
    filters (or ``lrp(..., strict=True)``).

    Examples:
      >>> import gradkit as gk
      >>> issubclass(gk.GradkitWarning, UserWarning)
      True
    """


def callable_name(fn: object, *, module: bool = False) -> str:
    """The name messages give a function: its qualified name, else its name, else its type's name.

    ``module=True`` prefixes the defining module (not for builtins): a rule's
    default name and cache key use that form.
    """
    qual = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    where = getattr(fn, "__module__", None) or "" if module else ""
    return f"{where}.{qual}" if where and where != "builtins" else str(qual)


def near_misses(name: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    return difflib.get_close_matches(name, sorted(set(candidates)), n=n, cutoff=0.6)


def describe(x: Any) -> str:
    """Short description of a value for error messages: ``float32[3,4]``, ``Python float``."""
    if x is None:
        return "None"
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        kind = "NumPy array " if type(x).__module__ == "numpy" else ""
        return f"{kind}{dtype}[{','.join(map(str, shape))}]"
    if isinstance(x, (bool, int, float, complex)):
        return f"Python {type(x).__name__}"
    return type(x).__name__
