"""Stable sums and differences of exponentials: logaddexp, log1mexp, log_sub_exp, softplus_inverse, log_cosh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.core.named import op as _op
from gradkit._src.stable import numerics as _k
from gradkit._src.stable.util import slope_jvp, split_constant, two_diff

Array = jax.Array
_LN2_DIGITS = "0.693147180559945309417232121458176568075500134360255254120680"


def _sigmoid_of_difference(x: Array, y: Array) -> tuple[Array, Array]:
    """``(sigmoid(x - y), sigmoid(y - x))`` with ``x - y`` taken exactly (TwoSum)."""
    hi, lo = two_diff(x, y)
    same_inf = (x == y) & jnp.isinf(x)
    hi = jnp.where(same_inf, 0.0, hi)  # equal infinities: the limit along x == y
    return _k.sigmoid_of_sum(hi, lo), _k.sigmoid_of_sum(-hi, -lo)


@jax.custom_jvp
def _logaddexp(x, y):
    amax = jnp.maximum(x, y)
    delta = x - y
    return jnp.where(jnp.isnan(delta), x + y, amax + jnp.log1p(jnp.exp(-jnp.abs(delta))))


@_logaddexp.defjvp
def _logaddexp_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    wx, wy = _sigmoid_of_difference(x, y)
    return _logaddexp(x, y), tx * wx + ty * wy


@_op("logaddexp")
def logaddexp(x: ArrayLike, y: ArrayLike) -> Array:
    """``log(exp(x) + exp(y))``, stable, with a finite gradient everywhere.

    Naive: ``jnp.log(jnp.exp(x) + jnp.exp(y))`` overflows; ``jnp.logaddexp``
    is stable but its gradient ``exp(x - out)`` is NaN at
    ``(-inf, -inf)`` and loses accuracy when ``out`` is large (the rounding
    of ``out`` lands in the exponent). This computes the gradient as
    ``(sigmoid(x - y), sigmoid(y - x))`` with ``x - y`` taken exactly; it is
    ``(1/2, 1/2)`` wherever ``x == y``, infinities included.

    Examples:
      >>> import jax, gradkit as gk
      >>> g = jax.grad(gk.stable.logaddexp, argnums=(0, 1))
      >>> [float(v) for v in g(-float("inf"), -float("inf"))]
      [0.5, 0.5]
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _logaddexp(x, y)


# =========================================================================== log(1 - exp)


def _expm1_recip(x):
    """``1 / expm1(x)`` (log1mexp's derivative), kept below -1 for ``x < 0``.

    1/expm1(x) < -1 there, but it rounds to -1 from x = -17 (float32) on;
    below -1, log1mexp = -log1p(g) is NaN as well.
    """
    g = _k.expm1_recip(jnp.where(x == 0, 0.0, x))  # -0 is in the domain: +inf there
    below = float(np.nextafter(np.array(-1.0, x.dtype), np.array(-2.0, x.dtype)))
    return jnp.where(x < 0, jnp.minimum(g, below), g)


@jax.custom_jvp
def _log1mexp(x):
    # log(1 - e^-x) = -log1p(1 / expm1(x)): the value from the derivative, so
    # XLA computes it once and sums log1p of it in one fused reduction. log1p
    # damps the derivative's error (its condition number is below 1).
    return -jnp.log1p(_expm1_recip(x))


@jax.custom_jvp
def _log1mexp_slope(x):
    return _expm1_recip(x)


@_log1mexp_slope.defjvp
def _log1mexp_slope_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    s = _log1mexp_slope(x)
    return s, -t * (s * (1.0 + s))  # (1/expm1)' = -e^x / expm1^2 = -s (1 + s)


slope_jvp(_log1mexp, _log1mexp_slope)


@_op("log1mexp")
def log1mexp(x: ArrayLike) -> Array:
    """``log(1 - exp(-x))`` for ``x ≥ 0`` (NaN for ``x < 0``).

    Naive: ``jnp.log(1 - jnp.exp(-x))`` cancels for small ``x`` (``1e-8``
    gives ``-inf`` in float32) and loses ``exp(-x)`` for large ``x``. This
    computes the derivative ``g = 1 / expm1(x)`` without cancellation (the
    series of ``x / expm1(x)`` over ``x`` below ``log 2``, ``e^-x / (1 - e^-x)``
    above, one division with the rounding of both parts and ``exp``'s error
    applied after it: within 1.2 ULP) and the value as ``-log1p(g)``
    (``1 - e^-x = 1 / (1 + g)``; well conditioned for every ``x > 0``). ``g`` is finite for every ``x > 0`` and
    ``+inf`` at 0.

    Examples:
      >>> import jax, gradkit as gk
      >>> round(float(jax.grad(gk.stable.log1mexp)(1e-8)) / 1e8, 4)
      1.0
    """
    (x,) = _k.as_inexact(x)
    return _log1mexp(x)


@jax.custom_jvp
def _log_sub_exp(x, y):
    d = jnp.where(x == y, 1.0, x - y)
    out = x + _log1mexp(d)
    return jnp.where(x == y, jnp.where(jnp.isposinf(x), jnp.nan, -jnp.inf), out)


@_log_sub_exp.defjvp
def _log_sub_exp_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    hi, lo = two_diff(x, y)
    same_inf = (x == y) & jnp.isinf(x)
    hi = jnp.where(same_inf, 0.0, hi)

    dx = -_k.expm1_recip_of_sum(-hi, -lo)
    dy = -_k.expm1_recip_of_sum(hi, lo)
    return _log_sub_exp(x, y), tx * dx + ty * dy


@_op("log_sub_exp")
def log_sub_exp(x: ArrayLike, y: ArrayLike) -> Array:
    """``log(exp(x) - exp(y))`` for ``x ≥ y`` (NaN for ``x < y``).

    Naive: ``jnp.log(jnp.exp(x) - jnp.exp(y))`` overflows and cancels. This
    computes ``x + log1mexp(x - y)``; ``-inf`` at ``x == y``. The gradient is
    ``(-1/expm1(y - x), -1/expm1(x - y))`` with ``x - y`` taken exactly.

    Examples:
      >>> import jax, gradkit as gk
      >>> round(float(gk.stable.log_sub_exp(1000.0, 999.0)), 4)
      999.5413
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _log_sub_exp(x, y)


@jax.custom_jvp
def _softplus_inverse(x):
    # log(e^x - 1) is 0 at x = log 2, where x + log(1 - e^-x) cancels; there (|d| < 1/4) use
    # log1p(2 expm1(d)), d = x - log 2 exact enough; below, log(expm1(x)); above,
    # x + log1p(-e^-x). Both expm1 are one Taylor series (|argument| < 0.45), e^-x is
    # exp_parts' and both log1p are one log: log1p(u) = log(v) + (u - (v - 1)) / v with
    # v = 1 + u rounded (v - 1 is exact). XLA's exp, log and log1p each cost, in a loop
    # fusion, as much as all the rest.
    dtype = np.dtype(x.dtype)
    ln2_hi, ln2_lo = split_constant(_LN2_DIGITS, dtype)
    d = (x - ln2_hi) - ln2_lo * _k.one_of(jnp.abs(x) + 1.0)  # XLA would fold the two constants into one
    near = jnp.abs(d) < 0.25
    low = (x < ln2_hi) & ~near
    em = _k.expm1_series(jnp.where(near, d, jnp.where(low, x, 0.0)), 0.45)
    clamp = (np.finfo(dtype).maxexp - 2) * float(np.log(2.0))  # beyond, e^-x is below the smallest normal
    k, m, c = _k.exp_parts(-jnp.where(near | low, 1.0, jnp.minimum(x, clamp)))
    p2 = _k.pow2(k, dtype)
    beyond = x >= clamp
    u = jnp.where(near, 2.0 * em, jnp.where(beyond, 0.0, -(m * p2)))
    u_lo = jnp.where(near | beyond, 0.0, -(c * p2))
    v = jnp.where(low, em, 1.0 + u)
    corr = jnp.where(low, 0.0, ((u - (v - _k.one_of(v + 2.0))) + u_lo) / v)  # a value only: no double where
    lg = jnp.log(v) + corr
    return jnp.where(near | low, lg, x + lg)  # a select last: XLA sums it in a loop, not in YNNPACK


@_softplus_inverse.defjvp
def _softplus_inverse_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus_inverse(x), t * -_k.expm1_recip(-x)


@_op("softplus_inverse")
def softplus_inverse(x: ArrayLike) -> Array:
    """``log(exp(x) - 1)``, the inverse of softplus, for ``x > 0``.

    Naive: ``jnp.log(jnp.expm1(x))`` overflows for ``x > 88.7`` (float32)
    and its gradient is ``inf/inf = NaN`` there. This computes
    ``x + log1p(-exp(-x))`` (``log1p(2 expm1(x - log 2))`` next to its zero
    at ``log 2``); the derivative is ``1 / (1 - exp(-x))``.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(gk.stable.softplus_inverse(200.0)), float(jax.grad(gk.stable.softplus_inverse)(200.0))
      (200.0, 1.0)
    """
    (x,) = _k.as_inexact(x)
    return _softplus_inverse(x)


@jax.custom_jvp
def _log_cosh(x):
    a = jnp.abs(x)
    small = a < 1.0
    s = jnp.where(small, a, 0.0)
    e = _k.expm1_series(0.5 * s, 0.5)
    sinh_half = 0.5 * (e + e / (e + 1.0))
    # |x| >= 1: |x| + log1p(expm1(-2|x|)/2), with expm1(-2|x|) = exp(-2|x|) - 1
    # (|2x| >= 2), the exp that _k.tanh evaluates for the derivative. One
    # log1p serves both branches, and |x| is added as b sign(floor(b)),
    # b = max(x, -x) (|x| where |x| >= 1, else 0): no select and nothing
    # shared with the derivative, so XLA:CPU sums the values in one fused
    # (YNNPACK) reduction, log1p included, reading only x and the argument.
    e2 = jnp.exp(-2.0 * a)
    lg = jnp.log1p(jnp.where(small, 2.0 * sinh_half * sinh_half, 0.5 * (e2 - 1.0)))
    b = jnp.maximum(x, -x)
    return lg + b * jnp.sign(jnp.floor(b))


slope_jvp(_log_cosh, _k.tanh)


@_op("log_cosh")
def log_cosh(x: ArrayLike) -> Array:
    """``log(cosh(x))``, stable for every ``x``.

    Naive: ``jnp.log(jnp.cosh(x))`` overflows for ``|x| > 89`` (float32) with
    a NaN gradient, and ``|x| + softplus(-2|x|) - log 2`` cancels near 0.
    This uses ``log1p(2 sinh(x/2)^2)`` for ``|x| < 1`` and
    ``|x| + log1p(expm1(-2|x|)/2)`` beyond; the derivative is ``tanh(x)``.

    Examples:
      >>> import jax, gradkit as gk
      >>> round(float(gk.stable.log_cosh(1000.0)), 3)
      999.307
      >>> float(jax.grad(gk.stable.log_cosh)(1000.0))
      1.0
    """
    (x,) = _k.as_inexact(x)
    return _log_cosh(x)
