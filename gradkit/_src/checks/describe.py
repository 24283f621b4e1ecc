"""How the checks and the audit describe what they look at: names, numbers, non-finite values.

Shared by :mod:`~gradkit._src.checks.check`, :mod:`~gradkit._src.checks.compare` and the
audit modules: a function's readable name, a name per input leaf
(``params['w']``), numbers as people read them, and the one counter of
NaN/inf elements.
"""

from __future__ import annotations

import inspect
import math
import os
import re
from collections.abc import Callable, Sequence
from typing import Any, SupportsInt, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src.checks.sourcepath import notebook_cell
from gradkit._src.errors import callable_name

_T = TypeVar("_T")

# --------------------------------------------------------------------------- functions and inputs


def fn_name(fn: object) -> str:
    """A readable name for ``fn`` (unwraps gk.override and functools.partial)."""
    inner = getattr(fn, "__wrapped__", None) or getattr(fn, "_fn", None) or fn
    return callable_name(inner).split(".<locals>.")[-1]


def def_source(fn: object) -> str:
    """``file:line`` where ``fn`` (unwrapped) is defined, or ``""``."""
    inner = fn
    for _ in range(4):
        inner = getattr(inner, "__wrapped__", None) or getattr(inner, "_fn", None) or inner
    code = getattr(inner, "__code__", None)
    return f"{short_path(code.co_filename)}:{code.co_firstlineno}" if code is not None else ""


def arg_names(fn: Callable[..., object], n: int) -> list[str]:
    """Names for ``n`` positional arguments of ``fn``: its parameter names where it has them."""
    names: list[str] = []
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            break
    return [names[i] if i < len(names) else f"args[{i}]" for i in range(n)]


def leaf_names(fn: Callable[..., object], args: Sequence[object]) -> list[str]:
    """One readable name per leaf of ``tuple(args)``, in flattening order (``x``, ``p['w']``)."""
    top = arg_names(fn, len(args))
    names = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tuple(args))[0]:
        head = top[path[0].idx] if path and hasattr(path[0], "idx") else "args"
        names.append(head + jax.tree_util.keystr(tuple(path[1:])))
    return names


def is_float(x: object) -> bool:
    """A floating-point array or a Python float (what gets differentiated)."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, float)
    return bool(jnp.issubdtype(dtype, jnp.floating))


def to_f64(x: _T) -> _T | jax.Array:
    """``x`` as a float64 array if it is floating point (call inside ``jax.enable_x64``)."""
    return jnp.asarray(x, dtype=jnp.float64) if is_float(x) else x


# --------------------------------------------------------------------------- numbers


def fmt(v: Any) -> str:  # anything: what float() refuses is shown with str()
    """A number as people read it: 0.5, 1e-08, -inf, nan."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        return str(v)
    if math.isnan(v) or math.isinf(v):
        return str(v)
    if v == 0:
        return "0"
    if 1e-3 <= abs(v) < 1e5:
        return f"{v:.6g}"
    return f"{v:.3g}"


def fmt_index(idx: Sequence[SupportsInt]) -> str:
    """``[1,2]`` for a multi-index; ``""`` for a scalar's empty one."""
    return "[" + ",".join(str(int(i)) for i in idx) + "]" if len(idx) else ""


def one_line(msg: str, n: int = 1, limit: int = 300) -> str:
    """The first ``n`` non-blank lines of a message, joined and cut to ``limit`` characters."""
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return " ".join(lines[:n])[:limit]


def short_path(path: str) -> str:
    """``path`` as a reader should see it: ``cell In[3]`` in a notebook, relative below the cwd, else absolute."""
    cell = notebook_cell(path)
    if cell is not None:
        return cell
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive (Windows)
        return path
    return rel if not rel.startswith(os.pardir) else path


def relative_error(value: np.ndarray, reference: np.ndarray, floor: float) -> np.ndarray:
    """``|value − reference| / max(|reference|, floor)``, element-wise; 0 where both are equal (inf == inf).

    The floor (an absolute tolerance) keeps it meaningful where the reference
    is 0: an error of 1e-17 against an exact 0 is 1e-17 / floor, not 1e+283.
    """
    value = np.asarray(value, dtype=np.float64)
    reference = np.asarray(reference, dtype=np.float64)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        same = (value == reference) | (np.isnan(value) & np.isnan(reference))
        err = np.where(same, 0.0, np.abs(value - reference))
        err = np.where(np.isnan(err), np.inf, err)
        return np.where(err == 0, 0.0, err / np.maximum(np.abs(reference), max(floor, 1e-300)))


# --------------------------------------------------------------------------- non-finite values


def nonfinite_mask(x: object, kind: str = "any") -> np.ndarray | None:
    """Where ``x`` is NaN (``kind="nan"``), ±inf (``"inf"``) or either (``"any"``); ``None`` if not inexact.

    The one place that decides what counts: bfloat16/float16 are widened
    first (NumPy has no isnan for them), complex values count by either part.
    """
    if x is None:
        return None
    a = np.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return None
    if a.dtype.itemsize < 4 or a.dtype.kind == "V":
        a = a.astype(np.float32)
    if kind == "nan":
        return np.isnan(a)
    if kind == "inf":
        return np.isinf(a)
    return ~np.isfinite(a)


def count_nonfinite(x: object, kind: str = "any") -> int:
    """How many elements of ``x`` are non-finite (see :func:`nonfinite_mask`); 0 for non-float values."""
    m = nonfinite_mask(x, kind)
    return 0 if m is None else int(m.sum())


# --------------------------------------------------------------------------- many leaves

_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]|\[\"((?:[^\"\\]|\\.)*)\"\]|\[(-?\d+)\]|\.(\w+)|\[<flat index (\d+)>\]")


def name_path(name: str) -> tuple[str, ...]:
    """A leaf name's parts: ``params['params']['Dense_0']['bias']`` -> ``('params', 'params', 'Dense_0', 'bias')``.

    The first part is the argument (``x``, ``args[1]``); a name not in the
    form :func:`leaf_names` writes is one part.
    """
    head = re.match(r"args\[\d+\]|[A-Za-z_]\w*", name)
    if head is None:
        return (name,)
    parts, pos = [head.group(0)], head.end()
    while pos < len(name):
        m = _KEY.match(name, pos)
        if m is None:
            return (name,)
        parts.append(next(g for g in m.groups() if g is not None))
        pos = m.end()
    return tuple(parts)


def group_leaves(names: Sequence[str], limit: int = 6) -> list[tuple[str, list[int]]]:
    """Leaves grouped by module path: ``[("params/params/Dense_0/*", [0, 1]), ("x", [2])]``.

    The path is cut at the deepest depth that leaves at most ``limit``
    groups (a group of one leaf keeps the leaf's own name); when that is a
    single group of several leaves, one level deeper (the caller shows the
    first groups and counts the rest).
    """
    paths = [name_path(n) for n in names]
    deepest = max((len(p) for p in paths), default=1)

    def at(depth: int) -> list[tuple[str, list[int]]]:
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, p in enumerate(paths):
            groups.setdefault(p[:depth], []).append(i)
        return [(names[ix[0]] if len(ix) == 1 and len(paths[ix[0]]) <= depth else "/".join(key) + "/*", ix)
                for key, ix in groups.items()]

    best = at(1)
    for depth in range(2, deepest + 1):
        g = at(depth)
        if len(g) > limit:
            break
        best = g
    if len(best) == 1 and len(best[0][1]) > 1 and len(names) > 1:
        depth = next(d for d in range(1, deepest + 1) if len(at(d)) > 1)
        best = at(depth)
    return best
