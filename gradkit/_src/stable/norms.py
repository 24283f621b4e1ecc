"""Norms without overflow and with a finite gradient at 0: hypot, safe_norm, normalize."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from gradkit._src.core.named import op as _op
from gradkit._src.stable import numerics as _k
from gradkit._src.stable.util import named, norm_axes, pow2_floor, scaled_pair, static_axis

Array = jax.Array


@jax.custom_jvp
def _hypot(x, y):
    m = jnp.maximum(jnp.abs(x), jnp.abs(y))
    scale = pow2_floor(m)
    xs, ys = x / scale, y / scale
    h = scale * jnp.sqrt(xs * xs + ys * ys)
    return jnp.where(jnp.isinf(x) | jnp.isinf(y), jnp.inf, h)


@_hypot.defjvp
def _hypot_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    m, ok, _, xs, ys = scaled_pair(x, y, 1.0)  # (x, y) / s, s a power of two
    # (x, y) / hypot: the squares and their sum exactly, the square root corrected by one Newton
    # step on that sum, each quotient rounded once (the rounded x^2 + y^2 and sqrt cost up to 2 ULP)
    sq, sq_lo = _k.two_square(xs)
    sq2, sq2_lo = _k.two_square(ys)
    big, big_lo = _k.two_sum(sq, sq2)
    big_lo = big_lo + (sq_lo + sq2_lo)
    hs = jnp.sqrt(big)
    hs_lo = (big_lo - _k.prod_lo(hs, hs, big)) * (0.5 / hs)
    inf = jnp.isinf(m)
    n_inf = jnp.where(jnp.isinf(x), 1.0, 0.0) + jnp.where(jnp.isinf(y), 1.0, 0.0)
    ux = jnp.where(ok, _k.div_df(xs, 0.0, hs, hs_lo),
                   jnp.where(inf, jnp.where(jnp.isinf(x), jnp.sign(x), 0.0) / jnp.sqrt(n_inf), 0.0))
    uy = jnp.where(ok, _k.div_df(ys, 0.0, hs, hs_lo),
                   jnp.where(inf, jnp.where(jnp.isinf(y), jnp.sign(y), 0.0) / jnp.sqrt(n_inf), 0.0))
    nan = jnp.isnan(m)
    ux = jnp.where(nan, m, ux)
    uy = jnp.where(nan, m, uy)
    return _hypot(x, y), tx * ux + ty * uy


@_op("hypot")
def hypot(x: ArrayLike, y: ArrayLike) -> Array:
    """``sqrt(x^2 + y^2)`` without overflow, gradient 0 at the origin.

    Naive: ``jnp.sqrt(x**2 + y**2)`` overflows from ``1.8e19`` (float32),
    underflows below ``1e-19``, and its gradient is ``0/0 = NaN`` at the
    origin. This divides both inputs by the same power of two first (exact,
    so the value equals the naive one wherever that is finite); the gradient
    is ``(x, y) / hypot(x, y)``, and 0 at the origin (the convention of
    :func:`safe_norm`).

    Examples:
      >>> import jax, gradkit as gk
      >>> round(float(gk.stable.hypot(3e30, 4e30)) / 1e30, 6)
      5.0
      >>> [float(g) for g in jax.grad(gk.stable.hypot, argnums=(0, 1))(0.0, 0.0)]
      [0.0, 0.0]
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _hypot(x, y)


def _unit(x, axes):
    """``(u, n)``: ``x / ||x||_2`` (0 for a zero slice) and ``||x||_2`` over ``axes``, keepdims.

    Scales by a power of two first, so nothing overflows or underflows
    before the result does; an infinite entry gives the unit vector along
    the infinite entries.
    """
    m = jnp.max(jnp.abs(x), axis=axes, keepdims=True)
    scale = pow2_floor(m)
    xs = x / scale
    inf = jnp.isinf(m)
    xs = jnp.where(inf, jnp.where(jnp.isinf(x), jnp.sign(x), 0.0), xs)
    ns = jnp.sqrt(jnp.sum(xs * xs, axis=axes, keepdims=True))
    n = jnp.where(inf, jnp.inf, scale * ns)
    u = xs / jnp.where(ns == 0, 1.0, ns)
    return u, n


@functools.cache
def _norm2_fn(axes, keepdims, min_norm):
    def squeeze(v):
        return v if keepdims else jnp.squeeze(v, axes)

    @jax.custom_jvp
    def fn(x):
        _, n = _unit(x, axes)
        return squeeze(jnp.where(n <= min_norm, min_norm, n))

    @fn.defjvp
    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        _, n = _unit(x, axes)
        small = n <= min_norm
        u, _ = _unit(jnp.where(small, 1.0, x), axes)
        dot = jnp.sum(u * t, axis=axes, keepdims=True)
        return fn(x), squeeze(jnp.where(small, 0.0, dot))

    return fn


def _is_two_norm(ord, axis, ndim):
    if ord is None:
        return True
    if ord == "fro":
        return True
    if ord == 2:
        return isinstance(axis, int) or (axis is None and ndim == 1)
    return False


@_op("safe_norm")
def safe_norm_op(x, *, ord=None, axis=None, keepdims=False, min_norm=0.0):
    (x,) = _k.as_inexact(x)
    if _is_two_norm(ord, axis, x.ndim):
        axes = norm_axes(axis if not (ord == "fro" and axis is None) else None, x.ndim)
        return _norm2_fn(axes, keepdims, min_norm)(x)
    n = jnp.linalg.norm(x, ord=ord, axis=axis, keepdims=True)
    small = n <= min_norm
    ns = jnp.linalg.norm(jnp.where(small, 1.0, x), ord=ord, axis=axis, keepdims=True)
    out = jnp.where(small, min_norm, ns)
    if keepdims:
        return out
    return jnp.squeeze(out, norm_axes(axis, x.ndim) if axis is not None else None)


@named("safe_norm")
def safe_norm(x: ArrayLike, ord: Any = None, axis: Any = None, keepdims: bool = False,
              min_norm: float = 0.0) -> Array:
    """``jnp.linalg.norm(x, ord, axis)``, with gradient 0 where the norm is ``≤ min_norm``.

    Naive: the gradient of ``jnp.linalg.norm`` at 0 is ``x / ||x|| = 0/0 =
    NaN`` (JAX: "working as intended", jax#21723). This returns
    ``max(norm, min_norm)``-style values as optax's ``safe_norm`` does
    (``min_norm`` where the norm is ``≤ min_norm``, with zero gradient), for
    every ``ord`` and ``axis`` ``jnp.linalg.norm`` accepts. The 2-norm (and
    Frobenius norm) is computed after scaling by a power of two, so it does
    not overflow for ``1e20``-sized or underflow for ``1e-20``-sized float32
    inputs; its derivative is ``x / ||x||``.

    Args:
      x: input array.
      ord: as ``jnp.linalg.norm`` (``None``, ``2``, ``1``, ``inf``, ``'fro'``,
        ``'nuc'``, any ``p``…).
      axis: as ``jnp.linalg.norm``.
      keepdims: keep reduced axes.
      min_norm: norms at or below this are replaced by it, with zero gradient.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> jax.grad(gk.stable.safe_norm)(jnp.zeros(3)).tolist()
      [0.0, 0.0, 0.0]
      >>> round(float(gk.stable.safe_norm(jnp.array([3e20, 4e20]))) / 1e20, 6)
      5.0
    """
    if ord is not None and not isinstance(ord, str):
        ord = float(ord) if not float(ord).is_integer() or abs(float(ord)) == float("inf") else int(ord)
    return safe_norm_op(x, ord=ord, axis=static_axis(axis), keepdims=bool(keepdims),
                         min_norm=float(min_norm))


@functools.cache
def _normalize_fn(axes):
    @jax.custom_jvp
    def fn(x):
        u, _ = _unit(x, axes)
        return u

    @fn.defjvp
    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        _, n = _unit(x, axes)
        ok = jnp.isfinite(n) & (n > 0)
        u, n = _unit(jnp.where(ok, x, 1.0), axes)
        q = t - u * jnp.sum(u * t, axis=axes, keepdims=True)
        return fn(x), jnp.where(ok, q / n, jnp.where(jnp.isnan(n), n, 0.0))

    return fn


@_op("normalize")
def normalize_op(x, *, axis=-1):
    (x,) = _k.as_inexact(x)
    return _normalize_fn(norm_axes(axis, x.ndim))(x)


@named("normalize")
def normalize(x: ArrayLike, axis: Any = -1) -> Array:
    """``x / ||x||_2`` over ``axis``, 0 for a zero slice, with a finite gradient.

    Naive: ``x / jnp.linalg.norm(x)`` is ``0/0 = NaN`` at 0 (value and
    gradient), the norm overflows for float32 entries from ``1e19``, and
    epsilon fixes (``x / max(||x||, 1e-12)``) change values near 0. Here the
    value is exact wherever the naive one is finite (power-of-two scaling),
    0 at 0, and the Jacobian ``(I - u u^T) / ||x||`` is finite wherever
    ``||x||`` is a normal number; at 0 it is 0 (a convention: the true
    derivative does not exist there).

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> [round(v, 6) for v in gk.stable.normalize(jnp.array([3e30, 4e30])).tolist()]
      [0.6, 0.8]
      >>> jax.jacobian(gk.stable.normalize)(jnp.zeros(2)).tolist()
      [[0.0, 0.0], [0.0, 0.0]]
    """
    return normalize_op(x, axis=static_axis(axis))
