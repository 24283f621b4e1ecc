"""sinc and its derivatives of every order."""

from __future__ import annotations

import functools
import math
from decimal import Decimal
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.core.named import op as _op
from gradkit._src.stable import numerics as _k
from gradkit._src.stable.util import split_constant

Array = jax.Array


def _sinc_series_coeffs(k: int, count: int) -> list[float]:
    """Coefficients c_m of the k-th derivative of sinc: sum_m c_m x^(2m + (k mod 2))."""
    out = []
    for n in range(count):
        p = 2 * n  # sinc = sum_n (-1)^n pi^(2n) x^(2n) / (2n+1)!
        if p < k:
            continue
        c = (-1) ** n * math.pi ** p / math.factorial(p + 1) * math.factorial(p) / math.factorial(p - k)
        out.append(c)
    return out


_SINC_CUT = 1.0

_PI = "3.14159265358979323846264338327950288419716939937510582097494459"
# sin(t) = t + t^3 S(t^2), cos(t) = 1 - t^2/2 + t^4 C(t^2): Taylor coefficients
_SIN_TAIL = [(-1) ** (j + 1) / math.factorial(2 * j + 3) for j in range(14)]
_COS_TAIL = [(-1) ** j / math.factorial(2 * j + 4) for j in range(14)]


# Tail terms of (sin, cos) kept as value + rounding error: float32 keeps -t^3/6 (next to the zeros
# of sinc' beyond the third, the rounding of the rest is below what the nearest floats resolve),
# float64 keeps eight of each (its floats come much closer to the zeros).
_DF_TERMS = {np.dtype(np.float32): (1, 0), np.dtype(np.float64): (8, 8)}
_MAX_DF = 8
# (-1)^j / (2j + 1)! and (-1)^j / (2j + 2)!, exactly (as fractions)
_SIN_EXACT = [Fraction((-1) ** j, math.factorial(2 * j + 1)) for j in range(_MAX_DF + 1)]
_COS_EXACT = [Fraction((-1) ** (j + 1), math.factorial(2 * j + 2)) for j in range(_MAX_DF + 1)]


def _mul(a, a_lo, b, b_lo):
    """``(a + a_lo)(b + b_lo)`` as ``hi + lo`` (the ``a_lo b_lo`` term dropped)."""
    p, p_lo = _k.two_prod(a, b)
    return p, p_lo + (a * b_lo + a_lo * b)


def _add(a, a_lo, b, b_lo):
    """``(a + a_lo) + (b + b_lo)`` as ``hi + lo``, ``|lo| <= ulp(hi)``."""
    s, s_lo = _k.two_sum(a, b)
    return _k.two_sum(s, s_lo + (a_lo + b_lo))


def _mul_const(a: jax.Array, a_lo: jax.Array, c: Fraction, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(a + a_lo) c`` as ``hi + lo`` for an exact constant ``c``."""
    t = np.dtype(dtype).type
    c_hi = t(float(c))
    c_lo = float(t(float(c - Fraction(float(c_hi)))))
    p, p_lo = _k.two_prod(a, jnp.full_like(a, float(c_hi)))
    return p, p_lo + (a * c_lo + a_lo * float(c_hi))


def _sincospi_df(a: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``sin(pi a)`` and ``cos(pi a)`` as unevaluated sums ``hi + lo``, error ~0.05 ULP.

    ``a = m/2 + w`` exactly with ``|w| <= 1/4``; ``t = pi w`` as ``t_hi + t_lo``
    (``pi`` in two parts, the product exact); then ``sin t = t + t^3 S`` and
    ``cos t = (1 - t^2/2) + t^4 C`` with ``t^2`` exact and the rounding of
    ``1 - t^2/2`` recovered, so that only the small tails are rounded. The
    quadrant ``m mod 4`` swaps and negates.
    """
    dtype = a.dtype
    pi_hi, pi_lo = split_constant(_PI, dtype)
    r2 = a - 2.0 * jnp.round(0.5 * a)  # [-1, 1], exact
    m = jnp.round(2.0 * r2)  # -2 .. 2
    w = r2 - 0.5 * m
    t_hi, t_lo = _k.two_prod(w, jnp.full_like(w, pi_hi))
    t_lo = t_lo + w * pi_lo
    tt, tt_lo = _k.two_square(t_hi)
    tt_lo = tt_lo + 2.0 * t_hi * t_lo
    eps = _k._eps(dtype)
    ns = _k._terms(_SIN_TAIL, (math.pi / 4) ** 2, 1, eps)
    nc = _k._terms(_COS_TAIL, (math.pi / 4) ** 2, 1, eps)
    # The first tail terms (t^3 .. t^7 and t^4 .. t^8) exactly enough that next to a zero of
    # sinc' (where the terms of pi x cos(pi x) - sin(pi x) cancel) only the rest is rounded.
    s_hi, s_lo = t_hi, t_lo
    c_hi = 1.0 - 0.5 * tt
    c_lo = ((_k.one_of(c_hi) - c_hi) - 0.5 * tt) - 0.5 * tt_lo  # exact but for tt_lo
    ks, kc = _DF_TERMS[np.dtype(dtype)]
    pw, pw_lo = t_hi, t_lo  # t^(2j + 1)
    for j in range(1, ks + 1):
        pw, pw_lo = _mul(pw, pw_lo, tt, tt_lo)
        s_hi, s_lo = _add(s_hi, s_lo, *_mul_const(pw, pw_lo, _SIN_EXACT[j], dtype))
    p2, p2_lo = tt, tt_lo  # t^(2j + 2)
    for j in range(1, kc + 1):
        p2, p2_lo = _mul(p2, p2_lo, tt, tt_lo)
        c_hi, c_lo = _add(c_hi, c_lo, *_mul_const(p2, p2_lo, _COS_EXACT[j], dtype))
    s_hi, s_lo = _add(s_hi, s_lo, (pw * tt) * _k._horner(tt, _SIN_TAIL[ks:max(ns, ks + 1)]), 0.0)
    c_hi, c_lo = _add(c_hi, c_lo, (p2 * tt) * _k._horner(tt, _COS_TAIL[kc:max(nc, kc + 1)]), 0.0)
    q = jnp.mod(m, 4.0)
    swap = (q == 1.0) | (q == 3.0)
    sin_hi, sin_lo = jnp.where(swap, c_hi, s_hi), jnp.where(swap, c_lo, s_lo)
    cos_hi, cos_lo = jnp.where(swap, s_hi, c_hi), jnp.where(swap, s_lo, c_lo)
    sneg = q >= 2.0
    cneg = (q == 1.0) | (q == 2.0)
    return (jnp.where(sneg, -sin_hi, sin_hi), jnp.where(sneg, -sin_lo, sin_lo),
            jnp.where(cneg, -cos_hi, cos_hi), jnp.where(cneg, -cos_lo, cos_lo))


# sin(pi f) / (pi f) - 1 = sum_k (-1)^k pi^(2k) f^(2k) / (2k + 1)!, for |f| <= 1/2
_SINPI_RATIO = [(-1) ** k * math.pi ** (2 * k) / math.factorial(2 * k + 1) for k in range(1, 16)]


def _sinc_value(x: jax.Array) -> jax.Array:
    """``sin(pi x) / (pi x)`` from ``|x| = n + f``, ``n`` an integer and ``f`` exact, ``|f| <= 1/2``.

    ``sinc(x) = (-1)^n (f + f w) / |x|`` with ``1 + w = sin(pi f) / (pi f)``
    (``|w| <= 0.37``, a polynomial in ``f^2``): no ``pi x`` is rounded, so
    nothing is lost next to the integers, and no part of it is shared with
    the derivative. About thirty operations and one division, a third of
    the double-float ``sin(pi x)`` the derivative needs: XLA sums the values
    in a loop of their own, so their cost adds to the gradient's.
    Within 1.9 ULP (float32), 1.4 (float64).
    """
    dtype = x.dtype
    a = jnp.minimum(jnp.abs(x), 2.0 ** (np.finfo(dtype).nmant + 1))  # beyond, integers: 0 (inf too)
    n = jnp.round(a)
    f = a - n
    sign = 1.0 - 2.0 * (n - 2.0 * jnp.floor(0.5 * n))
    z = f * f
    w = z * _k._horner(z, _SINPI_RATIO[:_k._terms(_SINPI_RATIO, 0.5, 2, _k._eps(dtype))])
    zero = a == 0.0
    out = sign * ((f + f * w) / jnp.where(zero, 1.0, a))
    return jnp.where(zero, 1.0, out)


def _pi_times(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    pi_hi, pi_lo = split_constant(_PI, a.dtype)
    pa, pa_lo = _k.two_prod(a, jnp.full_like(a, pi_hi))
    return pa, pa_lo + a * pi_lo


# The first three zeros of sinc' (tan(pi z) = pi z). Next to them pi x cos(pi x) - sin(pi x)
# cancels beyond what float32's rounded sin/cos tails allow (float64 keeps more tail terms
# exact instead): there sinc' is a short Taylor series in d = x - z, with d exact and the
# coefficients from y = sinc: x y'' + 2y' + pi^2 x y = 0, y'(z) = 0,
# y(z) = (-1)^n / sqrt(1 + pi^2 z^2). Zero n lies in (n, n + 1/2).
_ZEROS = (
    "1.43029665312420275777219844545854836892203",
    "2.45902403295676137944546903258682051494729",
    "3.47088972434701977140107680233426386436907",
)
_ZERO_WINDOW = 3e-3  # (pi d)^5 / 5! < 1e-10 relative: four coefficients
_WINDOWED = len(_ZEROS)  # zeros with a window (float32; beyond them the tails' rounding is below what floats resolve)


@functools.cache
def _zero_tables(dtype: np.dtype) -> tuple[np.ndarray, ...]:
    """Per zero n (row 0 unused): z as hi + lo, then sinc'(z + d) = sum_j c_j d^j, c_1 as hi + lo."""
    t = np.dtype(dtype).type
    rows = [[0.0] * 7]
    p2 = math.pi ** 2
    for n, s in enumerate(_ZEROS, start=1):
        z_hi, z_lo = split_constant(s, dtype)
        z = float(Fraction(Decimal(s)))
        y = [(-1) ** n / math.sqrt(1.0 + p2 * z * z), 0.0]  # y, y'
        for k in range(4):  # z y^(k+2) = -((k+2) y^(k+1) + pi^2 (z y^(k) + k y^(k-1)))
            prev = y[k - 1] if k >= 1 else 0.0
            y.append(-((k + 2) * y[k + 1] + p2 * (z * y[k] + k * prev)) / z)
        c1 = float(t(y[2]))
        rows.append([z_hi, z_lo, c1, y[2] - c1, y[3] / 2, y[4] / 6, y[5] / 24])
    return tuple(np.asarray(col, dtype) for col in zip(*rows))


def _near_zeros(a: jax.Array, out: jax.Array) -> jax.Array:
    """``out`` with sinc'(a) replaced by its Taylor series next to the first zeros (float32 only).

    Zero ``n`` lies in ``(n, n + 1/2)``, so ``floor(a)`` picks its row: one window, its
    constants chosen by selects, serves all of them.
    """
    if np.dtype(a.dtype) != np.float32:
        return out
    n = jnp.floor(a)
    cols = []
    for col in _zero_tables(a.dtype):
        c = jnp.full_like(a, float(col[_WINDOWED]))
        for i in range(_WINDOWED - 1, 0, -1):
            c = jnp.where(n == i, float(col[i]), c)
        cols.append(c)
    z_hi, z_lo, c1, c1_lo, c2, c3, c4 = cols
    dh = a - z_hi  # exact next to z
    d = dh - z_lo
    d_lo = (dh - d) - z_lo
    # c1_lo enters through a product: XLA (jax < 0.12) folds c1 + (c1_lo + t) into (c1 + c1_lo) + t
    poly = c1 + d * (c2 + d * (c3 + d * c4))
    p, p_lo = _k.two_prod(d, poly)  # rounded once, whether or not XLA fuses a multiply-add here
    inside = (n >= 1.0) & (n <= float(_WINDOWED)) & (jnp.abs(dh) < _ZERO_WINDOW)
    return jnp.where(inside, p + (p_lo + (d * c1_lo + d_lo * c1)), out)


def _sinc_prime_closed(x: jax.Array) -> jax.Array:
    """``sinc'(x) = (pi x cos(pi x) - sin(pi x)) / (pi x^2)`` for ``|x| >= 1/2`` with a rounded once.

    Numerator and denominator are unevaluated sums (error-free products and
    sums of :func:`_sincospi_df`'s parts); one division and a correction.
    Next to a zero of sinc' (tan(pi x) = pi x) the numerator cancels, and
    only the small sin/cos tails' rounding is left (relative to the terms).
    """
    dtype = x.dtype
    a = jnp.abs(x)
    huge = a >= 2.0 ** (np.finfo(dtype).nmant + 1)  # an integer: sinc' = cos(pi a)/a
    a = jnp.where(huge, 1.0, a)
    sa, sa_lo, ca, ca_lo = _sincospi_df(a)
    pa, pa_lo = _pi_times(a)
    p, p_lo = _k.two_prod(pa, ca)
    p_lo = p_lo + (pa * ca_lo + pa_lo * ca)
    f, f_lo = _k.two_sum(p, -sa)
    f, f_lo = _k.two_sum(f, f_lo + (p_lo - sa_lo))  # f may cancel: its low part back below ulp(f)
    d, d_lo = _k.two_prod(pa, a)
    d_lo = d_lo + pa_lo * a
    out = _k.div_df(f, f_lo, d, d_lo)
    xa = jnp.abs(x)
    whole = jnp.where(xa - 2.0 * jnp.round(0.5 * xa) == 0.0, 1.0, -1.0) / jnp.where(huge, xa, 1.0)
    out = _near_zeros(a, jnp.where(huge, whole, out))
    return jnp.where(x < 0, -out, out)



@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def sinc_derivative(k: int, x: jax.Array) -> jax.Array:
    """The ``k``-th derivative of ``sinc(x) = sin(pi x)/(pi x)``, correct at every order.

    A Maclaurin series on ``|x| < 1`` (where the closed form cancels), the
    Leibniz expansion of ``sin(pi x) * (pi x)^-1`` elsewhere.
    """
    return _k._lowp(functools.partial(_sinc_derivative, k))(x)


def _sinc_derivative(k: int, x: jax.Array) -> jax.Array:
    if k == 0:
        return _sinc_value(x)
    a = jnp.abs(x)
    # The closed forms cancel near 0; the series cancels near the first zero
    # of sinc at 1. First derivative: series on |x| < 0.5, where both are well
    # conditioned.
    cut = 0.5 if k == 1 else _SINC_CUT
    small = a < cut
    xs = jnp.where(small, x, 0.0)
    eps = _k._eps(x.dtype)
    coeffs = _sinc_series_coeffs(k, 80)
    n = len(coeffs)
    for i in range(1, len(coeffs)):
        if abs(coeffs[i]) * cut ** (2 * i) < eps / 16 * max(abs(coeffs[0]), 1e-300):
            n = i
            break
    z = xs * xs
    series = _k._horner(z, coeffs[:n])
    if k % 2:
        series = xs * series
    inf = jnp.isinf(x)
    xb = jnp.where(small | inf, 1.0, x)
    if k == 1:
        big = _sinc_prime_closed(xb)
    else:
        sp, cp = _k.sinpi(xb), _k.cospi(xb)
        phases = [sp, cp, -sp, -cp]
        inv = 1.0 / xb
        big = jnp.zeros_like(x)
        for j in range(k + 1):
            m = k - j  # derivative order of (pi x)^-1: (-1)^m m! / (pi x^(m+1))
            coef = math.comb(k, j) * math.pi ** j * (-1) ** m * math.factorial(m) / math.pi
            big = big + coef * phases[j % 4] * inv ** (m + 1)
    return jnp.where(small, series, jnp.where(inf, 0.0, big))


@sinc_derivative.defjvp
def _sinc_derivative_jvp(k, primals, tangents):
    (x,), (t,) = primals, tangents
    return sinc_derivative(k, x), t * sinc_derivative(k + 1, x)



@_op("sinc")
def sinc(x: ArrayLike) -> Array:
    """``sin(pi x) / (pi x)``, 1 at 0, accurate at every order of differentiation.

    Naive: ``jnp.sin(jnp.pi * x) / (jnp.pi * x)`` is ``0/0`` at 0, and for
    large ``x`` the rounding of ``pi * x`` ruins ``sin``. ``jnp.sinc`` fixes
    the value at 0, but its derivatives away from 0 are autodiff of the
    quotient, whose terms cancel next to the zeros of ``sinc'`` (where
    ``tan(pi x) = pi x``; ``jnp.sinc``'s gradient is off by up to 1.7e7 ULP).
    This reduces ``x`` exactly (``sin(pi x)`` is exactly 0 at integers):
    the value is ``(-1)^n sin(pi f) / (pi x)`` with ``x = n + f`` and
    ``sin(pi f) / (pi f)`` a polynomial in ``f`` (within 1.9 ULP); the
    derivative computes ``sin(pi x)`` and ``cos(pi x)`` as a value plus its
    rounding error and ``pi x cos(pi x) - sin(pi x)`` from them exactly, so
    that it is rounded once (within 1.1 ULP, next to the zeros of ``sinc'``
    too, where float32 uses a short Taylor series around the first three).
    Higher orders use the Maclaurin series for ``|x| < 1``
    and the Leibniz expansion beyond: ``sinc'(0) = 0``,
    ``sinc''(0) = -pi^2/3``, and so on at every order; ``sinc(±inf) = 0``.

    Examples:
      >>> import jax, gradkit as gk
      >>> round(float(jax.grad(jax.grad(gk.stable.sinc))(0.0)), 5)
      -3.28987
    """
    (x,) = _k.as_inexact(x)
    return sinc_derivative(0, x)
