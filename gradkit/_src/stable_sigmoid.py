"""Stable functions of the softplus family: log1pexp (softplus), log_sigmoid, sigmoid, silu."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import numerics as _k
from gradkit._src.named import op as _op
from gradkit._src.stable_util import split_constant

Array = jax.Array


@jax.custom_jvp
@_k._lowp  # exp(80) overflows float16
def _log1pexp(x):
    # log1p(e^x) > x, and rounds to x once e^x is capped (x > 80). The exp is
    # the one of the derivative _k.sigmoid(x) = q / (1 + q): XLA evaluates it
    # once, sums max(x, log1p(q)) in one fused reduction and reads only q for
    # the derivative.
    return jnp.maximum(x, jnp.log1p(_k.sigmoid_exp(x)))


@_log1pexp.defjvp
def _log1pexp_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _log1pexp(x), t * _k.sigmoid(x)


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


@_sigmoid.defjvp
def _sigmoid_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _sigmoid(x), t * _k.sigmoid_prime(x)


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


# silu'(x) = sigmoid'(x) (1 + x + e^x) for x < 0; the root of 1 + x + e^x is
# r = -1 - W(1/e), and 1 + x + e^x = d + e^r expm1(d) with d = x - r, which
# has no cancellation near the root (silu's minimum).
_SILU_ROOT = "-1.27846454276107379510935873902298015543947748861974576545318"
_SILU_EXP_ROOT = "0.278464542761073795109358739022980155439477488619745765453178"
# (far, shift, clamp): below -far, e^x < eps^2, so silu = x e^x and silu' = (1 + x) e^x to
# working precision; there e^x is kept as 2^shift e^x (a normal number down to -clamp, where
# silu' is far below the smallest normal) and scaled back at the end, exactly.
_SILU_FAR = {np.dtype(np.float32): (40.0, 64, 130.0), np.dtype(np.float64): (75.0, 200, 760.0)}
_SILU_NEAR = 0.25  # |x - r| below which 1 + x + e^x is taken around its root


def _silu_exp(x):
    """``(e, far)``: ``e = exp(-|x|)``, except ``2^shift exp(x)`` where ``far = x < -far``.

    The one ``exp`` of silu's value and derivative (both build it from the
    same expression, so XLA evaluates it once): the kernel's, within 0.62
    ULP, where XLA's ``exp`` is off by up to 1 ULP, which ``(1 + x) e^x``
    would carry into its result.
    """
    far_x, shift, clamp = _SILU_FAR[np.dtype(x.dtype)]
    k, m, _ = _k.exp_parts(-jnp.minimum(jnp.abs(x), clamp))
    far = x < -far_x
    return m * _k.pow2(jnp.where(far, k + shift, k), x.dtype), far


def _far_scale(dtype: Any) -> float:
    return 2.0 ** -_SILU_FAR[np.dtype(dtype)][1]


@jax.custom_jvp
@_k._lowp
def _silu_prime(x):
    e, far = _silu_exp(x)
    # With e = exp(-|x|): silu' = N / (1 + e)^2, N = 1 + e (1 + x) for x >= 0
    # and N = e g, g = 1 + x + e, for x < 0. (1 + e)^2 and the sums are
    # taken exactly (a value and its rounding error), so the result is one
    # division plus a correction: no rounding but exp's, the products' and
    # the last is left. Within 1/4 of g's root, g = d K + e_r (expm1(d) - d)
    # with d = x - r and K = 1 + e_r = -r: no cancellation and no e. Infinite
    # x are clamped (then e = 0 gives the limits 1 and 0 without 0 * inf).
    x = jnp.clip(x, -1e4, 1e4)
    big, big_lo = _k.square_one_plus(e)
    one = _k.one_of(big)
    xp1 = 1.0 + x
    xp1_lo = jnp.where(x < 0, x - (xp1 - one), 0.0)  # 1 + x is exact for x <= -1/2, and x >= 0 is not needed
    g, g_lo = _k.two_sum(xp1, e)
    r_hi, r_lo = split_constant(_SILU_ROOT, x.dtype)
    k_hi, k_lo = split_constant(_SILU_ROOT[1:], x.dtype)
    e_r = float(Fraction(Decimal(_SILU_EXP_ROOT)))
    d = (x - r_hi) - r_lo * one  # one: XLA would fold the two constants into one
    near = jnp.abs(d) < _SILU_NEAR
    dn = jnp.where(near, d, 0.0)
    d_lo = ((x - r_hi) - d) - r_lo * one
    gk_hi, gk_lo = _k.two_prod(dn, jnp.full_like(dn, k_hi))
    gn, gn_lo = _k.two_sum(gk_hi, gk_lo + (dn * k_lo + d_lo * k_hi) + e_r * (_k.expm1_series(dn, _SILU_NEAR) - dn))
    g = jnp.where(near, gn, g)
    g_lo = jnp.where(near, gn_lo, g_lo + xp1_lo)
    p = e * xp1
    num = jnp.where(x < 0, e * g, 1.0 + p)
    # low parts from num itself, so that they match the num the division sees
    num_lo = jnp.where(x < 0, _k.prod_lo(e, g, num) + e * g_lo, _k.sum_lo(p, num))
    out = _k.div_df(num, num_lo, big, big_lo)
    # Far below 0: silu' = e^x (1 + x) to working precision, e = 2^shift e^x.
    return jnp.where(far, (e * xp1) * _far_scale(x.dtype), out)


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
    e, far = _silu_exp(x)
    s = jnp.where(x >= 0, 1.0, e) / (1.0 + e)  # sigmoid(x), as _k.sigmoid computes it
    return jnp.where(far, (x * e) * _far_scale(x.dtype), x * s)


@_silu.defjvp
def _silu_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _silu(x), t * _silu_prime(x)


@_op("silu")
def silu(x: ArrayLike) -> Array:
    """``x * sigmoid(x)`` (swish), with an accurate derivative.

    Naive: autodiff of ``x * jax.nn.sigmoid(x)`` inherits ``s (1 - s)`` and
    loses all accuracy for large ``|x|``; the derivative
    ``s (1 + x (1 - s))`` also cancels near its zero at ``x ≈ -1.2785``.
    This computes the derivative as ``(1 + e (1 + x)) / (1 + e)^2`` for
    ``x ≥ 0`` and ``e (1 + x + e) / (1 + e)^2`` for ``x < 0``
    (``e = exp(-|x|)``, from an ``exp`` kernel within 0.62 ULP), the factor
    ``1 + x + e`` expanded around its root so it keeps full relative accuracy
    there, every sum and product taken exactly and the quotient rounded once:
    within 1.5 ULP over the float32 range.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.silu)(0.0))
      0.5
    """
    (x,) = _k.as_inexact(x)
    return _silu(x)
