"""Helpers shared by the stable-function modules (``gradkit/_src/stable_*.py``)."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

Array = jax.Array
F = TypeVar("F", bound=Callable[..., Any])


def named(name: str) -> Callable[[F], F]:
    """Marks a public wrapper with the op name its inner named op carries."""

    def mark(fn: F) -> F:
        fn.gradkit_op_name = name  # type: ignore[attr-defined]
        return fn

    return mark


def split_constant(value: str, dtype: Any) -> tuple[float, float]:
    """``value`` (decimal string) as ``hi + lo`` in ``dtype``."""
    exact = Fraction(Decimal(value))
    t = np.dtype(dtype).type
    hi = t(float(exact))
    lo = t(float(exact - Fraction(float(hi))))
    return float(hi), float(lo)


def where0(cond: Array, x: Array, fill: float = 1.0) -> Array:
    """``x`` where ``cond`` else ``fill``: the inner half of a double where."""
    return jnp.where(cond, x, fill)


def slope_jvp(fn: Any, slope: Callable[[Array], Array]) -> None:
    """Gives ``fn``, a ``jax.custom_jvp`` of one array, the derivative ``slope``: ``(fn(x), t * slope(x))``.

    Higher orders differentiate ``slope`` (which may be a ``custom_jvp`` too).
    """

    @fn.defjvp
    def fn_jvp(primals: tuple[Array], tangents: tuple[Array]) -> tuple[Array, Array]:
        (x,), (t,) = primals, tangents
        return fn(x), t * slope(x)


def norm_axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (tuple, list)):
        return tuple(sorted(a % ndim for a in axis))
    return (int(axis) % ndim,)


def static_axis(axis: Any) -> Any:
    if isinstance(axis, list):
        return tuple(axis)
    if isinstance(axis, (np.integer,)):
        return int(axis)
    return axis


def two_diff(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x - y`` as ``hi + lo`` exactly (Knuth's TwoSum); ``lo = 0`` where ``hi`` is not finite."""
    hi = lax.optimization_barrier(x - y)
    yy = lax.optimization_barrier(x - hi)  # the y that was actually subtracted
    lo = (x - (hi + yy)) + (yy - y)
    return hi, jnp.where(jnp.isfinite(hi), lo, 0.0)


def pow2_floor(m: jax.Array) -> jax.Array:
    """The largest power of two ``<= m`` (1 where ``m`` is 0 or not finite); always a normal number.

    Dividing by a power of two is exact, so ``S * sqrt(sum((x / S)^2))`` equals
    the naive 2-norm wherever that does not overflow or underflow, and is
    finite and accurate where it does.
    """
    ok = jnp.isfinite(m) & (m > 0)
    _, e = jnp.frexp(jnp.where(ok, m, 1.0))
    return jnp.where(ok, jnp.ldexp(jnp.ones_like(m), e - 1), 1.0)


def scaled_pair(x: Array, y: Array, y_fill: float) -> tuple[Array, Array, Array, Array, Array]:
    """``(m, ok, s, x / s, y / s)``, for a derivative of ``(x, y)`` that squares them.

    ``m = max(|x|, |y|)``; ``s`` is the largest power of two ``<= m``
    (:func:`pow2_floor`): dividing by it is exact and brings ``m`` into
    [1, 2), so the squares and their sum neither overflow nor underflow.
    Where ``m`` is 0 or not finite (``ok`` false) the quotients are ``1`` and
    ``y_fill``, for the caller to replace. They leave through an optimization
    barrier, which stops XLA from merging a later ``(x / s) / d`` into
    ``x / (s d)``, which overflows.
    """
    m = jnp.maximum(jnp.abs(x), jnp.abs(y))
    ok = jnp.isfinite(m) & (m > 0)
    scale = pow2_floor(jnp.where(ok, m, 1.0))
    xs, ys = lax.optimization_barrier((jnp.where(ok, x, 1.0) / scale, jnp.where(ok, y, y_fill) / scale))
    return m, ok, scale, xs, ys
