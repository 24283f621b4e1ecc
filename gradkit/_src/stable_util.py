"""Helpers shared by the stable-function modules (``gradkit/_src/stable_*.py``)."""

from __future__ import annotations

from collections.abc import Callable
from decimal import Decimal
from fractions import Fraction
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

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

