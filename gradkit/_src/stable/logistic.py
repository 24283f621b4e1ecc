"""Stable functions of the softplus family: log1pexp (softplus), log_sigmoid, sigmoid, silu."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.core.named import op as _op
from gradkit._src.stable import numerics as _k
from gradkit._src.stable.util import slope_jvp, split_constant

Array = jax.Array


@jax.custom_jvp
@_k._lowp  # exp(80) overflows float16
def _log1pexp(x):
    # log1p(e^x) > x, and rounds to x once e^x is capped (x > 80). The exp is
    # the one of the derivative _k.sigmoid(x) = q / (1 + q): XLA evaluates it
    # once, sums max(x, log1p(q)) in one fused reduction and reads only q for
    # the derivative.
    return jnp.maximum(x, jnp.log1p(_k.sigmoid_exp(x)))


slope_jvp(_log1pexp, _k.sigmoid)


@_op("log1pexp")
def log1pexp(x: ArrayLike) -> Array:
    """``log(1 + exp(x))`` (softplus), stable for every ``x``.

    Naive: ``jnp.log(1 + jnp.exp(x))`` overflows for ``x > 88.7`` (float32),
    and its gradient ``exp(x) / (1 + exp(x))`` is ``inf/inf = NaN`` there.
    This computes ``max(x, log1p(exp(min(x, 80))))`` (``log1p(e^x) > x``,
    and it rounds to ``x`` long before ``e^x`` is capped) and its derivative
    as ``sigmoid(x) = q / (1 + q)`` from the same ``q = exp(min(x, 80))``
    (never ``exp(x)/(1+exp(x))`` uncapped) with ``1 + q`` taken exactly and
    applied to first order: within 2 ULP over the float32 range (1.96 at
    most, on every float32 with ``0.5 <= |x| <= 24``), at the cost of the
    naive formula.
    ``softplus`` is the same function.

    Args:
      x: any real array.

    Returns:
      ``log(1 + exp(x))``, elementwise.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(gk.stable.log1pexp(100.0)), float(jax.grad(gk.stable.log1pexp)(100.0))
      (100.0, 1.0)
      >>> float(jax.grad(gk.stable.log1pexp)(0.0))
      0.5
    """
    (x,) = _k.as_inexact(x)
    return _log1pexp(x)


softplus = log1pexp


@jax.custom_jvp
@_k._lowp
def _log_sigmoid(x):
    return jnp.minimum(x, -jnp.log1p(_k.sigmoid_exp(-x)))  # -log1pexp(-x), as _log1pexp


@_log_sigmoid.defjvp
def _log_sigmoid_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _log_sigmoid(x), t * _k.sigmoid(-x)


@_op("log_sigmoid")
def log_sigmoid(x: ArrayLike) -> Array:
    """``log(sigmoid(x)) = -log1pexp(-x)``, stable for every ``x``.

    Naive: ``jnp.log(1 / (1 + jnp.exp(-x)))`` is ``-inf`` for ``x < -88.7``
    (float32) with a NaN gradient. This computes
    ``min(x, -log1p(exp(min(-x, 80))))``; the derivative is ``sigmoid(-x)``.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(gk.stable.log_sigmoid(-200.0)), float(jax.grad(gk.stable.log_sigmoid)(-200.0))
      (-200.0, 1.0)
    """
    (x,) = _k.as_inexact(x)
    return _log_sigmoid(x)


@jax.custom_jvp
@_k._lowp
def _sigmoid(x):
    # sigmoid from the exp(-|x|) of its derivative _k.sigmoid_prime (XLA
    # evaluates it once), with a select: XLA:CPU then sums the values in a
    # plain reduction instead of pulling the division into a YNNPACK fusion
    # that materializes its operands (1 + e among them, shared with the
    # derivative). Equal to _k.sigmoid(x) within its rounding.
    e = _k.exp(-jnp.abs(x))
    return jnp.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


slope_jvp(_sigmoid, _k.sigmoid_prime)


@_op("sigmoid")
def sigmoid(x: ArrayLike) -> Array:
    """``1 / (1 + exp(-x))`` with an accurate derivative.

    Naive: the textbook derivative ``s * (1 - s)`` (what ``jax.nn.sigmoid``
    uses by default) cancels for large ``x``: in float32 ``1 - s`` is 0 from
    ``x ≈ 17`` while the true derivative is ``exp(-x)``, an error of up to
    ~1e7 ULP. This computes the derivative as ``e / (1 + e)^2``,
    ``e = exp(-|x|)`` (``sigmoid(x) sigmoid(-x)`` without cancellation,
    from the one ``exp`` the value uses too), with ``(1 + e)^2`` taken
    exactly and applied to first order: within 2 ULP (1.95 at most), at the
    cost of the naive formula.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(jax.nn.sigmoid)(20.0)), float(jax.grad(gk.stable.sigmoid)(20.0)) > 0
      (0.0, True)
    """
    (x,) = _k.as_inexact(x)
    return _sigmoid(x)


# silu'(x) = sigmoid'(x) (1 + x + e^x) for x < 0; the root of 1 + x + e^x (silu's minimum) is
# r = -1 - W(1/e). Within 1/16 of it, silu'(r + d) = d P(d), P a polynomial (a Chebyshev fit of
# silu'(r + d) / d: relative error 5e-11 in float32, 8e-18 in float64; P(0) = silu''(r)).
_SILU_ROOT = "-1.27846454276107379510935873902298015543947748861974576545318"
_SILU_WINDOW = 1.0 / 16.0
_SILU_P = {
    np.dtype(np.float32): ("0.2178117057198000987797", "0.1466487963888192262048", "0.01887481041708593347603",
                           "-0.01522203338527895008631", "-0.006602690886143339519611"),
    np.dtype(np.float64): ("0.2178117057198000987797", "0.1466487969969471433931", "0.01887481422378233743211",
                           "-0.0152226552240182204071", "-0.006606589138438708610201", "0.0001266281752308891001884",
                           "0.0007985219574397433012279", "0.0001854460344600324500352",
                           "-0.00004093116108636220032658"),
}
# (far, shift, clamp): below -far, e^x < eps^2, so silu = x e^x and silu' = (1 + x) e^x to
# working precision; there e^x is kept as 2^shift e^x (a normal number down to -clamp, where
# silu' is far below the smallest normal) and scaled back at the end, exactly.
_SILU_FAR = {np.dtype(np.float32): (40.0, 64, 130.0), np.dtype(np.float64): (75.0, 200, 760.0)}


def _silu_exp(x):
    """``(e, e_err, far)``: ``e + e_err = exp(-|x|)``, except ``2^shift exp(x)`` where ``far = x < -far``.

    The one ``exp`` of silu's value and derivative (both build it from the
    same expression): the kernel's :func:`~gradkit._src.stable.numerics.exp_parts`,
    ``e`` within 0.62 ULP (XLA's ``exp`` is off by up to 1 ULP, which
    ``(1 + x) e^x`` would carry into its result) and ``e + e_err`` within 0.21.
    """
    far_x, shift, clamp = _SILU_FAR[np.dtype(x.dtype)]
    k, m, c = _k.exp_parts(-jnp.minimum(jnp.abs(x), clamp))
    far = x < -far_x
    p2 = _k.pow2(jnp.where(far, k + shift, k), x.dtype)
    return m * p2, c * p2, far  # power-of-two scaling is exact


def _far_scale(dtype: Any) -> float:
    return 2.0 ** -_SILU_FAR[np.dtype(dtype)][1]


def _silu_window(x, one):
    """``silu'(x) = d P(d)``, ``d = x - r``, for ``|d| < 1/16`` (0 elsewhere); ``d`` exact as ``(x - r_hi) - r_lo``."""
    dtype = np.dtype(x.dtype)
    r_hi, r_lo = split_constant(_SILU_ROOT, dtype)
    d = x - r_hi  # exact: x is within a factor 2 of r_hi
    near = jnp.abs(d) < _SILU_WINDOW
    dn = jnp.where(near, d, 0.0)
    coefs = _SILU_P[dtype]
    c0_hi, c0_lo = split_constant(coefs[0], dtype)
    poly = c0_hi + (c0_lo * one + dn * _k._horner(dn, [float(Fraction(Decimal(c))) for c in coefs[1:]]))
    return near, dn * poly - (r_lo * one) * poly  # one: XLA would fold the constants


@jax.custom_jvp
@_k._lowp
def _silu_prime(x):
    # With e = exp(-|x|) and s = 1 + e: silu' = N / s^2, N = s + x e for x >= 0 and N = e g,
    # g = 1 + x + e, for x < 0. s, s^2, g and N are taken exactly (a value and its low part, e's
    # error e_err in them), so what is left is the division's rounding (div_first_order) and
    # exp's remaining error. Infinite x are clamped (then e = 0 gives the limits 1 and 0 without
    # 0 * inf); within 1/16 of g's root, where g cancels, a polynomial around the root.
    x = jnp.clip(x, -1e4, 1e4)
    e, e_err, far = _silu_exp(x)
    s = 1.0 + e
    s_lo = _k.sum_lo(e, s) + e_err  # 1 + e + e_err = s + s_lo
    big, big_lo = _k.two_square(s)
    big_lo = big_lo + 2.0 * s * s_lo
    neg = x < 0
    xp1 = 1.0 + x
    g, g_lo = _k.two_sum(xp1, e)
    g_lo = g_lo + (_k.sum_lo(x, xp1) + e_err)  # 1 + x = xp1 + sum_lo exactly (x > -1; for x <= -1 it is 0)
    # one exact product for both signs: e g (x < 0) or x e (x >= 0, then added to s)
    p, p_lo = _k.two_prod(jnp.where(neg, e, x), jnp.where(neg, g, e))
    base = jnp.where(neg, 0.0, s)
    num = base + p  # Fast2Sum: s > 1 > x e for x >= 0
    num_lo = ((base - num) + p) + (p_lo + jnp.where(neg, e * g_lo + e_err * g, s_lo + x * e_err))
    out = _k.div_first_order(num, num_lo, big, big_lo)
    one = _k.one_of(s)
    near, win = _silu_window(x, one)
    out = jnp.where(near, win, out)
    # Far below 0: silu' = e^x (1 + x) to working precision, e = 2^shift e^x.
    return jnp.where(far, (e * xp1 + e_err * xp1) * _far_scale(x.dtype), out)


@_silu_prime.defjvp
def _silu_prime_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    fin = jnp.isfinite(x)
    xs = jnp.where(fin, x, 0.0)
    # silu'' = sigmoid'(x) (2 - x tanh(x/2))
    second = _k.sigmoid_prime(xs) * (2.0 - xs * _k.tanh(0.5 * xs))
    return _silu_prime(x), t * jnp.where(fin, second, jnp.where(jnp.isnan(x), x, 0.0))


@jax.custom_jvp
@_k._lowp
def _silu(x):
    e, _, far = _silu_exp(x)
    s = jnp.where(x >= 0, 1.0, e) / (1.0 + e)  # sigmoid(x), as _k.sigmoid computes it
    return jnp.where(far, (x * e) * _far_scale(x.dtype), x * s)


slope_jvp(_silu, _silu_prime)


@_op("silu")
def silu(x: ArrayLike) -> Array:
    """``x * sigmoid(x)`` (swish), with an accurate derivative.

    Naive: autodiff of ``x * jax.nn.sigmoid(x)`` inherits ``s (1 - s)`` and
    loses all accuracy for large ``|x|``; the derivative
    ``s (1 + x (1 - s))`` also cancels near its zero at ``x ≈ -1.2785``.
    This computes the derivative as ``(1 + e (1 + x)) / (1 + e)^2`` for
    ``x ≥ 0`` and ``e (1 + x + e) / (1 + e)^2`` for ``x < 0``
    (``e = exp(-|x|)`` and its error, from an ``exp`` kernel), every sum and
    product taken exactly and one division, and within 1/16 of the zero as
    ``(x - r) P(x - r)``, ``P`` a polynomial, so it keeps full relative
    accuracy there: within 1.2 ULP over the float32 range.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.silu)(0.0))
      0.5
    """
    (x,) = _k.as_inexact(x)
    return _silu(x)
