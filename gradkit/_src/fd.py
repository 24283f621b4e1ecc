"""Finite differences: the one helper ``check_grads``, ``compare`` and ``audit`` share.

:func:`differences` evaluates a function at ``x ± step`` along some flat
coordinates of ``x`` (one ``vmap``-ed, jitted call when the function allows)
and returns the central differences, and on request the one-sided ones,
which tell a kink or a jump (left and right differ) from a derivative.
Callers run it under ``jax.enable_x64`` with float64 inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

NOT_JITTABLE = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)


def call_jit(f: Callable[..., Any], *args: Any) -> Any:
    """``jax.jit(f)(*args)``, or ``f(*args)`` for a function that needs concrete values."""
    try:
        return jax.jit(f)(*args)
    except NOT_JITTABLE:
        return f(*args)


def select_coords(n: int, limit: int, must: Sequence[int] = ()) -> np.ndarray:
    """All ``n`` flat coordinates, or ``limit`` of them (seeded sample that keeps ``must``)."""
    if n <= limit:
        return np.arange(n)
    rng = np.random.RandomState(0)
    pick = set(int(m) for m in must[:limit])
    rest = [int(j) for j in rng.permutation(n) if int(j) not in pick]
    return np.array(sorted(list(pick) + rest[: limit - len(pick)]))


@dataclasses.dataclass(frozen=True)
class Differences:
    """Differences of ``h`` at ``x``, one column per probed coordinate: shape ``(size(h(x)), len(coords))``.

    Attributes:
      central: ``(h(x + s) − h(x − s)) / 2s`` (0 where both sides are equal, inf included).
      forward, backward: ``(h(x + s) − h(x)) / s`` and ``(h(x) − h(x − s)) / s``
        (``None`` unless asked for).
      finite: the function was finite at every point used.
      magnitude: ``max(|h(x + s)|, |h(x − s)|)``, what float64 rounding in the
        difference scales with (``check_grads`` widens its tolerance by it).
    """

    central: np.ndarray
    forward: np.ndarray | None
    backward: np.ndarray | None
    finite: np.ndarray
    magnitude: np.ndarray | None = None


def _diff(a: np.ndarray, b: np.ndarray, step: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(a == b, 0.0, a - b) / step


def differences(h: Callable[[Any], Any], x: Any, coords: np.ndarray, step: float | np.ndarray,
                one_sided: bool = False) -> Differences:
    """Finite differences of ``h`` at ``x`` along the flat coordinates ``coords``.

    Args:
      h: a function of one array (``x``'s shape) returning an array.
      x: the point.
      coords: flat indices into ``x`` to perturb, one at a time.
      step: the step, one for all coordinates or one per coordinate.
      one_sided: also evaluate ``h(x)`` and return the one-sided differences.
    """
    x = jnp.asarray(x)
    m = len(coords)
    steps = np.broadcast_to(np.asarray(step, dtype=np.float64), (m,))
    rows = np.zeros((m, x.size), dtype=np.dtype(x.dtype))
    rows[np.arange(m), coords] = steps
    basis = jnp.asarray(rows.reshape((m,) + x.shape))
    points = [x[None] + basis, x[None] - basis] + ([x[None]] if one_sided else [])
    flat_h = lambda v: jnp.ravel(h(v))
    try:
        vals = np.asarray(call_jit(jax.vmap(flat_h), jnp.concatenate(points)), dtype=np.float64)
    except Exception:  # a function that does not vmap: one call per point
        vals = np.stack([np.asarray(flat_h(p), dtype=np.float64) for p in jnp.concatenate(points)])
    plus, minus = vals[:m], vals[m:2 * m]
    finite = np.isfinite(plus) & np.isfinite(minus)
    central = (_diff(plus, minus, 2 * steps[:, None])).T
    forward = backward = None
    if one_sided:
        f0 = vals[2 * m:2 * m + 1]
        finite &= np.isfinite(f0)
        forward = _diff(plus, f0, steps[:, None]).T
        backward = _diff(f0, minus, steps[:, None]).T
    with np.errstate(invalid="ignore"):
        magnitude = np.fmax(np.abs(plus), np.abs(minus)).T
    return Differences(central, forward, backward, finite.T, magnitude)
