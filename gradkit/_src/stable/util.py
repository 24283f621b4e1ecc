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
