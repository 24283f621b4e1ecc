"""Safe versions of functions with a singular point: sqrt, log, division, pow, arctan2, arccos, arcsin, x log y."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from gradkit._src.core.named import op as _op
from gradkit._src.stable import numerics as _k
from gradkit._src.stable.util import named, scaled_pair, slope_jvp, where0

Array = jax.Array


# =========================================================================== safe_*


@jax.custom_jvp
def _safe_sqrt(x):
    return jnp.sqrt(jnp.maximum(x, 0.0))


@_safe_sqrt.defjvp
def _safe_sqrt_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # From the value, as jnp.sqrt's rule: y > 0 exactly where x > 0, and
    # XLA computes sqrt once (no second pass over x for rsqrt(x)).
    y = _safe_sqrt(x)
    pos = y > 0
    return y, t * jnp.where(pos, 0.5 / where0(pos, y), 0.0)


@_op("safe_sqrt")
def safe_sqrt(x: ArrayLike) -> Array:
    """``sqrt(x)`` for ``x > 0``, 0 for ``x ≤ 0``, with derivative 0 at ``x ≤ 0``.

    Naive: ``jnp.sqrt`` has derivative ``0.5 / sqrt(0) = inf`` at 0, which
    becomes NaN as soon as it meets a zero cotangent (``jnp.where(x > 0,
    jnp.sqrt(x), 0)``, norms of zero vectors, distances between equal
    points). Elsewhere it is ``jnp.sqrt``, bit for bit: the value, and the
    derivative ``0.5 / y`` computed from the value ``y`` as ``jnp.sqrt``'s
    rule does (XLA may rewrite ``jnp.sqrt``'s, when the value is not needed,
    to ``0.5 * rsqrt(x)``, which can differ in the last bit).

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.safe_sqrt)(0.0)), float(jax.grad(gk.stable.safe_sqrt)(4.0))
      (0.0, 0.25)
    """
    (x,) = _k.as_inexact(x)
    return _safe_sqrt(x)


@functools.cache
def _safe_log_fn(eps):
    @jax.custom_jvp
    def fn(x):
        return jnp.log(jnp.maximum(x, _eps_for(eps, x.dtype)))

    @fn.defjvp
    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        ok = x >= _eps_for(eps, x.dtype)
        return fn(x), t * jnp.where(ok, 1.0 / where0(ok, x), 0.0)

    return fn


def _eps_for(eps, dtype):
    return float(jnp.finfo(dtype).tiny) if eps is None else eps


@_op("safe_log")
def safe_log_op(x, *, eps=None):
    (x,) = _k.as_inexact(x)
    return _safe_log_fn(eps)(x)


@named("safe_log")
def safe_log(x: ArrayLike, eps: float | None = None) -> Array:
    """``log(max(x, eps))``: finite value and gradient everywhere.

    Naive: ``jnp.log(x)`` is ``-inf`` at 0 with derivative ``inf``, NaN
    below 0. This clamps the argument at ``eps`` (default: the smallest
    normal number of the dtype, so it equals ``jnp.log`` on every normal
    positive input); the derivative is ``1/x`` for ``x ≥ eps`` and 0 below.

    Args:
      x: input.
      eps: the clamp; a static Python float.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.safe_log)(0.0)), float(jax.grad(gk.stable.safe_log)(2.0))
      (0.0, 0.5)
    """
    return safe_log_op(x, eps=None if eps is None else float(eps))


@jax.custom_jvp
def _safe_div(x, y):
    zero = y == 0
    return jnp.where(zero, 0.0, x / where0(~zero, y))


@_safe_div.defjvp
def _safe_div_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    zero = y == 0
    ys = where0(~zero, y)
    q = lax.optimization_barrier(x / ys)  # else XLA rewrites (x / y) / y to x / (y * y), which overflows
    return _safe_div(x, y), jnp.where(zero, 0.0, tx / ys - ty * (q / ys))


@_op("safe_div")
def safe_div(x: ArrayLike, y: ArrayLike) -> Array:
    """``x / y``, and 0 where ``y == 0`` (TensorFlow's ``divide_no_nan``).

    Naive: ``jnp.where(y == 0, 0, x / y)`` has NaN gradients at ``y == 0``
    (``0 * inf``). Here value and both partial derivatives are 0 where
    ``y == 0``; elsewhere ``(1/y, -x/y^2)``, with ``x/y^2`` computed as
    ``(x/y)/y`` so it does not overflow early.

    Examples:
      >>> import jax, gradkit as gk
      >>> [float(g) == 0 for g in jax.grad(gk.stable.safe_div, argnums=(0, 1))(1.0, 0.0)]
      [True, True]
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _safe_div(x, y)


@jax.custom_jvp
def _safe_arctan2(y, x):
    return jnp.arctan2(y, x)


@_safe_arctan2.defjvp
def _safe_arctan2_jvp(primals, tangents):
    (y, x), (ty, tx) = primals, tangents
    m, ok, scale, xs, ys = scaled_pair(x, y, 0.0)  # (x, y) / s, s a power of two
    d = xs * xs + ys * ys
    nan = jnp.isnan(m)
    dy = jnp.where(ok, (xs / d) / scale, jnp.where(nan, m, 0.0))
    dx = jnp.where(ok, -(ys / d) / scale, jnp.where(nan, m, 0.0))
    return _safe_arctan2(y, x), ty * dy + tx * dx


@_op("safe_arctan2")
def safe_arctan2(y: ArrayLike, x: ArrayLike) -> Array:
    """``arctan2(y, x)`` with gradient 0 at the origin.

    Naive: the gradient ``(x, -y) / (x^2 + y^2)`` is ``0/0 = NaN`` at the
    origin and overflows/underflows in ``x^2 + y^2`` for large/small inputs
    (float32: from ``1e19`` / below ``1e-19``). This scales both inputs by a
    power of two before squaring, and sets the gradient to 0 at the origin
    (a convention: the true derivative does not exist there).

    Examples:
      >>> import jax, gradkit as gk
      >>> [float(g) for g in jax.grad(gk.stable.safe_arctan2, argnums=(0, 1))(0.0, 0.0)]
      [0.0, 0.0]
    """
    y, x = jnp.broadcast_arrays(*_k.as_inexact(y, x))
    return _safe_arctan2(y, x)


def _pow_shift(dtype: Any) -> int:
    """A power of two (its exponent) that brings x^(y/2) near the under- or overflow threshold to about 1."""
    # 2^(2s) and 2^(-2s) are normal: each scaling back is one multiplication (XLA folds a chain
    # of constant factors into one, which would underflow)
    return (int(jnp.finfo(dtype).maxexp) - 3) // 2


@jax.custom_jvp
def _safe_pow(x, y):
    return jnp.power(x, y)


@_safe_pow.defjvp
def _safe_pow_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = _safe_pow(x, y)
    y0 = y == 0
    x0 = x == 0
    log_x = jnp.log(jnp.where(x0, 1.0, x))
    # y - 1 is rounded; its error ym1_lo moves x^(y-1) by the factor 1 + ym1_lo log x.
    ys = jnp.where(y0, 1.0, y)
    one = _k.one_of(jnp.abs(ys) + 2.0)
    ym1, ym1_lo = _k.two_sum(ys, -one)
    corr = jnp.where(x0, 0.0, ym1_lo * log_x)
    p = jnp.power(x, ym1)
    dx = y * p
    # x^(y-1) can underflow where y x^(y-1) does not: take it as y h^2, h = x^((y-1)/2),
    # h^2 exact (two_square, on h 2^s to keep its low part normal) and scaled back at the end.
    tiny = float(jnp.finfo(x.dtype).tiny)
    s = _pow_shift(x.dtype)
    half = jnp.power(x, 0.5 * ym1) * 2.0 ** s
    sq, sq_lo = _k.two_square(half)
    low = jnp.abs(p) < tiny
    lowv = (y * sq + (y * sq_lo + (y * sq) * corr)) * 2.0 ** (-2 * s)
    dx = jnp.where(low, lowv, jnp.where(corr == 0, dx, dx + dx * corr))  # corr == 0: dx may be inf
    dx = jnp.where(y0, 0.0, dx)
    # x^y can overflow where x^y log x does not (|log x| < 1): take it as h^2 log x, h = x^(y/2),
    # h^2 exact on h 2^-s and scaled back at the end.
    half_y = jnp.power(x, 0.5 * y) * 2.0 ** -s
    hq, hq_lo = _k.two_square(half_y)
    big = (hq * log_x + hq_lo * log_x) * 2.0 ** (2 * s)
    dy = jnp.where(jnp.isinf(out) & jnp.isfinite(x) & jnp.isfinite(y), big, out * log_x)
    dy = jnp.where(x0 & (y >= 0), 0.0, jnp.where(x0, -jnp.inf, dy))
    return out, tx * dx + ty * dy


@_op("safe_pow")
def safe_pow(x: ArrayLike, y: ArrayLike) -> Array:
    """``x ** y`` with finite gradients at ``x = 0`` where the true ones are.

    Naive: ``d/dx = y x^(y-1)`` is ``0 * inf = NaN`` at ``x = 0, y = 0``,
    and ``d/dy = x^y log x`` is ``0 * -inf = NaN`` at ``x = 0``. Here
    ``d/dx`` is 0 where ``y == 0`` and ``d/dy`` is 0 where ``x == 0`` and
    ``y ≥ 0`` (PyTorch's conventions). ``d/dx`` stays ``+inf`` at
    ``x = 0, 0 < y < 1``, where the true derivative is infinite. Elsewhere
    ``d/dx`` corrects for the rounding of ``y - 1`` (whose error ``x^(y-1)``
    would multiply by ``log x``), and both partials stay finite where
    ``x^(y-1)`` underflows or ``x^y`` overflows but the derivative does not.

    Examples:
      >>> import jax, gradkit as gk
      >>> [float(g) for g in jax.grad(gk.stable.safe_pow, argnums=(0, 1))(0.0, 0.0)]
      [0.0, 0.0]
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _safe_pow(x, y)


def _acos_slope(x):
    """``1 / sqrt(1 - x^2)`` as ``1 / sqrt((1 - |x|)(1 + |x|))``; at ``|x| == 1`` the slope at the float next
    to 1; 0 beyond.

    ``1 - x*x`` loses ``x*x``'s rounding error to cancellation near ±1 (46 ULP at
    x = 0.999 in float64 on an H200) unless XLA contracts it into a fused
    multiply-add, as XLA:CPU does; ``1 - |x|`` is exact there (Sterbenz), so
    the product form is within 2 ULP on every backend.
    """
    a = jnp.abs(x)
    inside = a < 1.0
    edge = 1.0 - float(jnp.finfo(x.dtype).epsneg)
    ac = jnp.where(inside, a, edge)
    slope = lax.rsqrt((1.0 - ac) * (1.0 + ac))
    return jnp.where(a <= 1.0, slope, jnp.where(jnp.isnan(x), x, 0.0))


@jax.custom_jvp
def _safe_arccos(x):
    return jnp.arccos(jnp.clip(x, -1.0, 1.0))


@_safe_arccos.defjvp
def _safe_arccos_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _safe_arccos(x), -t * _acos_slope(x)


@jax.custom_jvp
def _safe_arcsin(x):
    # XLA:CPU's asin flushes inputs below ~4e-38 to 0 (float32); asin(x) = x there.
    tiny = jnp.abs(x) < 1e-10
    return jnp.where(tiny, x, jnp.arcsin(jnp.clip(jnp.where(tiny, 0.0, x), -1.0, 1.0)))


slope_jvp(_safe_arcsin, _acos_slope)


@_op("safe_arccos")
def safe_arccos(x: ArrayLike) -> Array:
    """``arccos(clip(x, -1, 1))`` with a finite gradient everywhere.

    Naive: ``jnp.arccos`` has derivative ``-1/sqrt(1 - x^2) = -inf`` at
    ``±1`` (cosine similarities of parallel vectors) and is NaN for inputs
    that rounding pushed just past ±1. Here the input is clipped to [-1, 1],
    the derivative is JAX's ``-1/sqrt(1 - x^2)`` inside, the slope at the float next to ±1 at exactly ±1
    (``-1/sqrt(eps)``: about -2900 in float32), and 0 beyond (where the
    clipped function is flat).

    Examples:
      >>> import jax, gradkit as gk
      >>> float(gk.stable.safe_arccos(1.0000001)), bool(jax.numpy.isfinite(jax.grad(gk.stable.safe_arccos)(1.0)))
      (0.0, True)
    """
    (x,) = _k.as_inexact(x)
    return _safe_arccos(x)


@_op("safe_arcsin")
def safe_arcsin(x: ArrayLike) -> Array:
    """``arcsin(clip(x, -1, 1))`` with a finite gradient everywhere.

    The same conventions as :func:`safe_arccos`: derivative
    ``1/sqrt(1 - x^2)`` inside, the slope at the float next to ±1 at
    exactly ±1, 0 beyond.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.safe_arcsin)(0.0))
      1.0
    """
    (x,) = _k.as_inexact(x)
    return _safe_arcsin(x)


# =========================================================================== x log y


def _x_times(log: Any, y_slope_denominator: Any, name: str) -> Any:
    """``x * log(y)``, 0 where ``x == 0`` (unless ``y`` is NaN), as a ``jax.custom_jvp`` named ``name``.

    ``d/dx = log(y)``; ``d/dy = x / y_slope_denominator(y, x == 0)`` and 0
    wherever ``x == 0`` (the denominator is given a ``y`` made safe there).
    """

    def value(x, y):
        return jnp.where((x != 0) | jnp.isnan(y), x * log(y), 0.0)

    value.__name__ = value.__qualname__ = name  # what a rule table sees: fn:<name>
    fn = jax.custom_jvp(value)

    @fn.defjvp
    def fn_jvp(primals, tangents):
        (x, y), (tx, ty) = primals, tangents
        zero = x == 0
        dy = jnp.where(zero, 0.0, x / y_slope_denominator(y, zero))
        return fn(x, y), tx * log(y) + ty * dy

    return fn


_xlogy = _x_times(jnp.log, lambda y, zero: jnp.where(zero, 1.0, y), "_xlogy")  # d/dy = x / y
_xlog1py = _x_times(_k.log1p, lambda y, zero: 1.0 + jnp.where(zero, 0.0, y), "_xlog1py")  # d/dy = x / (1 + y)


@_op("xlogy")
def xlogy(x: ArrayLike, y: ArrayLike) -> Array:
    """``x * log(y)``, defined as 0 where ``x == 0`` (unless ``y`` is NaN).

    Naive: ``x * jnp.log(y)`` is ``0 * -inf = NaN`` at ``x = 0, y = 0``, and
    the derivative in ``y``, ``x / y``, is ``0/0 = NaN`` there (also in
    ``jax.scipy.special.xlogy``). Here ``d/dy`` is 0 wherever ``x == 0``;
    ``d/dx = log(y)`` is ``-inf`` at ``y = 0`` (the true value).

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.xlogy, argnums=1)(0.0, 0.0))
      0.0
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _xlogy(x, y)


@_op("xlog1py")
def xlog1py(x: ArrayLike, y: ArrayLike) -> Array:
    """``x * log1p(y)``, defined as 0 where ``x == 0`` (unless ``y`` is NaN).

    Naive: ``x * jnp.log1p(y)`` is NaN at ``x = 0, y = -1`` and its ``y``
    derivative ``x / (1 + y)`` is ``0/0`` there. Here ``d/dy`` is 0 wherever
    ``x == 0``.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.xlog1py, argnums=1)(0.0, -1.0))
      0.0
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _xlog1py(x, y)
