"""Accurate elementwise kernels that the stable functions' derivatives are built from.

Each kernel is a ``jax.custom_jvp`` whose derivative is written with other
kernels, so every order of differentiation is finite and accurate, and every
branch is guarded ("double where"), so an unselected branch never feeds an
``inf`` or ``NaN`` into a derivative.

Why not the XLA primitives directly: on XLA:CPU ``expm1`` is off by up to
4.5 ULP in float32, ``tanh`` by 3.9 (float32) / 6.5 (float64) ULP, ``log1p`` by
2.4 ULP in float32 and 127 ULP in float64, ``exp`` by 1 (float32) / 1.36
(float64) ULP, and ``sin(pi * x)`` loses all accuracy for large ``x``. The
kernels below use short Taylor series where the primitive cancels, exact
argument reductions, and error-free transformations (a value and its
rounding error: :func:`two_sum`, :func:`two_prod`, :func:`div_df`) where a
result must be rounded once; the accuracy benchmark
(``benchmarks/accuracy.py``) measures the result.

Two XLA behaviours break error-free transformations silently, and the code
below is written around them: the algebraic simplifier rewrites
``(a + c) - c`` to ``a`` for a constant ``c`` (jax < 0.12; hence
:func:`one_of`), and XLA:CPU fuses ``a * b + c`` into a fused multiply-add
wherever LLVM finds one, and computes a value again in each fusion that needs
it (hence products only of exact halves, and low parts computed from the very
value they belong to).
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# --------------------------------------------------------------------------- dtypes


def as_inexact(*xs: jax.typing.ArrayLike) -> tuple[jax.Array, ...]:
    """Arrays of one common floating dtype (integers become the default float)."""
    arrs = [jnp.asarray(x) for x in xs]
    dtype = jnp.result_type(*arrs)
    if not jnp.issubdtype(dtype, jnp.inexact):
        dtype = jnp.result_type(float)
    return tuple(a.astype(dtype) for a in arrs)


def _work_dtype(dtype: np.dtype) -> np.dtype:
    """float16/bfloat16 are computed in float32, then rounded back."""
    return np.dtype(np.float32) if np.dtype(dtype).itemsize < 4 else np.dtype(dtype)


def _lowp(fn):
    """Runs ``fn`` in float32 for half-precision inputs."""

    @functools.wraps(fn)
    def wrapper(x, *rest):
        dtype = x.dtype
        work = _work_dtype(dtype)
        if work == dtype:
            return fn(x, *rest)
        rest = tuple(r.astype(work) if getattr(r, "dtype", None) == dtype else r for r in rest)
        return fn(x.astype(work), *rest).astype(dtype)

    return wrapper


def _eps(dtype: np.dtype) -> float:
    return float(jnp.finfo(dtype).eps)


def _horner(z: jax.Array, coeffs: list[float]) -> jax.Array:
    """``coeffs[0] + coeffs[1] z + coeffs[2] z^2 + ...``."""
    acc = jnp.full_like(z, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * z + c
    return acc


def _terms(coeffs: list[float], radius: float, power: int, eps: float) -> int:
    """How many terms of ``sum c_k r^(power k)`` are needed for ``eps/16`` relative accuracy."""
    for n, c in enumerate(coeffs):
        if n > 0 and abs(c) * radius ** (power * n) < eps / 16:
            return n
    return len(coeffs)


# --------------------------------------------------------------------------- series


def _bernoulli(n: int) -> list[Fraction]:
    a = [Fraction(0)] * (n + 1)
    out = []
    for m in range(n + 1):
        a[m] = Fraction(1, m + 1)
        for j in range(m, 0, -1):
            a[j - 1] = j * (a[j - 1] - a[j])
        out.append(a[0])
    return out


_B = _bernoulli(80)
# tanh x = x * sum_n TANH[n] x^(2n)
_TANH = [float(Fraction(2 ** (2 * n) * (2 ** (2 * n) - 1)) * _B[2 * n] / math.factorial(2 * n))
         for n in range(1, 40)]
# expm1 x = x + x^2 * sum_k EXPM1[k] x^k
_EXPM1 = [1.0 / math.factorial(k + 2) for k in range(30)]

# Largest argument of each series.
_TANH_CUT = 0.625
_EXPM1_CUT = 1.0


# --------------------------------------------------------------------------- exp family


def expm1_series(x: jax.Array, radius: float = _EXPM1_CUT) -> jax.Array:
    """``exp(x) - 1`` by its Taylor series, for ``|x| < radius <= 1`` only (no ``exp``; not a kernel:
    callers that differentiate it wrap it in their own ``custom_jvp``)."""
    n = _terms(_EXPM1, radius, 1, _eps(x.dtype))
    return x + (x * x) * _horner(x, _EXPM1[:n])


@jax.custom_jvp
@_lowp
def expm1(x: jax.Array) -> jax.Array:
    """``exp(x) - 1``: a Taylor series on ``|x| < 1``, ``exp(x) - 1`` elsewhere (≤ 1.3 ULP)."""
    small = jnp.abs(x) < _EXPM1_CUT
    xs = jnp.where(small, x, 0.0)
    return jnp.where(small, expm1_series(xs), jnp.exp(jnp.where(small, 0.0, x)) - 1.0)


@expm1.defjvp
def _expm1_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return expm1(x), t * jnp.exp(x)


# log(f) = 2 atanh(s), s = (f - 1)/(f + 1): R = z (2/3 + 2z/5 + 2z^2/7 + ...), z = s^2 <= 0.0295.
_LOG_R = [2.0 / (2 * i + 3) for i in range(16)]


@jax.custom_jvp
@_lowp
def log1p(x: jax.Array) -> jax.Array:
    """``log(1 + x)`` within 1 ULP (XLA:CPU's is off by 2.4 ULP in float32, 127 in float64).

    ``1 + x = 2^k (f + f_lo)`` exactly with ``f`` in [0.71, 1.42]; then
    ``log(1 + x) = k log 2 + log f + f_lo / f``, and with ``g = f - 1``
    (exact), ``s = g / (2 + g)``: ``log f = g - g^2/2 + s (g^2/2 + R)``, where
    the large terms ``g`` and ``g^2/2`` are nearly exact and the rounded
    ones are small (the classic arrangement of fdlibm's ``log1p``).
    """
    dtype = np.dtype(x.dtype)
    u = 1.0 + x
    u_lo = sum_lo(x, u)
    mant, ex = jnp.frexp(u)
    low = mant < math.sqrt(0.5)
    f = jnp.where(low, 2.0 * mant, mant)
    k = (ex - low.astype(ex.dtype)).astype(dtype)
    g = f - 1.0
    s = g / (2.0 + g)
    z = s * s
    n = _terms(_LOG_R, 0.0295, 1, _eps(dtype) / 8)
    r = z * _horner(z, _LOG_R[:n])
    hfsq = 0.5 * (g * g)
    c1, c2 = _EXP[dtype][0], _EXP[dtype][1]  # log 2 = c1 + c2, k c1 exact
    corr = u_lo / jnp.where(u > 0, u, 1.0)  # log(u + u_lo) - log(u); all of the result where x << eps
    out = k * c1 - ((hfsq - (s * (hfsq + r) + (k * c2 + corr))) - g)
    return jnp.where(u > 0, jnp.where(jnp.isinf(u), u, out), jnp.where(u == 0, -jnp.inf, jnp.nan))


@log1p.defjvp
def _log1p_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return log1p(x), t / (1.0 + x)


# exp(x) = 2^k exp(r), r = x - k log 2 (Cody and Waite: log 2 = C1 + C2 with C1 short
# enough that k C1 is exact), exp(r) = 1 + r + r^2 (1/2 + r P(r)) on |r| <= log(2)/2 with a
# Chebyshev fit P (error far below 0.01 ULP). The integer type builds 2^k from its bits.
_EXP = {
    np.dtype(np.float32): (0.693145751953125, 1.4286068203094173e-06, np.int32, 23, 127,
                           (0.16666666666666666, 0.041666554532615786, 0.008333320877775163,
                            0.001392619766942992, 0.0001988271397598067)),
    np.dtype(np.float64): (0.6931471803691238, 1.9082149292705877e-10, np.int64, 52, 1023,
                           (0.16666666666666666, 0.04166666666666667, 0.008333333333333333,
                            0.0013888888888883742, 0.0001984126984126641, 2.4801587325574868e-05,
                            2.755731923997518e-06, 2.7557273608709007e-07, 2.5052077979399947e-08,
                            2.0914701283103285e-09, 1.6084337425329933e-10)),
}


def exp_parts(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(k, m, c)`` with ``exp(x) = 2^k (m + c)``: ``m`` in [0.7, 1.42], ``|c| <= ulp(m)``, error ≤ 0.21 ULP of ``m``.

    ``2^k m`` is ``exp(x)`` within 0.62 ULP (XLA:CPU's ``exp``: 1 ULP); ``c`` is what a compensated
    formula adds. ``k`` is a float; scale with :func:`pow2` (normal for ``x >= log(tiny)``).
    """
    c1, c2, _, _, _, tail = _EXP[np.dtype(x.dtype)]
    k = jnp.round(x * (1.0 / math.log(2.0)))
    r_hi = x - k * c1  # exact: k c1 is, and it is within a factor 2 of x
    r_lo = -(k * c2)
    r = r_hi + r_lo
    t = r_lo + (r * r) * (0.5 + r * _horner(r, list(tail)))  # exp(r) - 1 - r_hi
    p, p_lo = two_sum(r_hi, t)
    m = 1.0 + p
    return k, m, (p - (m - one_of(m))) + p_lo


def pow2(k: jax.Array, dtype: np.dtype) -> jax.Array:
    """``2^k`` for integral float ``k``, from its bits; ``k`` is clamped to the normal range."""
    _, _, itype, bits, bias, _ = _EXP[np.dtype(dtype)]
    k = jnp.clip(k, 1 - bias, bias)
    return lax.bitcast_convert_type((k.astype(itype) + bias) << bits, dtype)


def exp(x: jax.Array) -> jax.Array:
    """``exp(x)`` within 0.81 ULP (float64; XLA:CPU's is off by up to 1.36) or XLA's own (float32, 1 ULP).

    Not a kernel (no derivative rule): for values that derivatives are built
    from where ``exp``'s error is damped (silu, where it is not, calls :func:`exp_parts`).
    """
    if np.dtype(x.dtype) != np.float64:
        return jnp.exp(x)
    k, m, _ = exp_parts(x)
    _, _, _, _, bias, _ = _EXP[np.dtype(x.dtype)]
    return jnp.where(k < 1 - bias, 0.0, jnp.where(k > bias, jnp.inf, m * pow2(k, x.dtype)))


_LN2 = math.log(2.0)
_BERN = [float(_B[2 * j + 2] / math.factorial(2 * j + 2)) for j in range(30)]  # x/expm1(x) - 1 + x/2 in x^2


def _expm1_recip(x: jax.Array, lo: jax.Array | None) -> jax.Array:
    # N/D, D one that no fused multiply-add can change (XLA may recompute it for the correction in
    # another fusion): |x| < log 2: N = x/expm1(x) (a series, 1 - x/2 exact), D = x; beyond,
    # N = e or -1, D = 1 - e, e = exp(-|x|) <= 1/2 from exp_parts (not XLA's exp: in a loop fusion
    # it costs as much as all the rest). exp's error (which 1/(1 - e) would double) and the
    # rounding of N and D enter the correction, where a recomputation is harmless.
    dtype = np.dtype(x.dtype)
    ax = jnp.abs(x)
    small = ax < _LN2
    xs = jnp.where(small, x, 1.0)
    half = 0.5 * xs
    s1 = 1.0 - half
    z = xs * xs
    tail = z * _horner(z, _BERN[:_terms(_BERN, _LN2, 2, _eps(dtype) / 4)]) + ((one_of(s1) - s1) - half)
    n_hi = s1 + tail
    n_lo = tail - (n_hi - s1)  # Fast2Sum: |s1| >= |tail|
    bias = _EXP[dtype][4]
    clamp = (bias - 1) * _LN2  # beyond, e is 0 (XLA:CPU flushes subnormals) and 1/expm1 is 0 or -1
    ab = jnp.minimum(jnp.where(small, _LN2, ax), clamp)
    k, m, c = exp_parts(-ab)
    p2 = pow2(k, dtype)
    e, e_err = m * p2, c * p2  # exp(-ab) = e + e_err (power-of-two scaling is exact)
    beyond = ax >= clamp  # (NaN stays NaN)
    e, e_err = jnp.where(beyond, 0.0, e), jnp.where(beyond, 0.0, e_err)
    den = 1.0 - e
    pos = x > 0
    num = jnp.where(small, n_hi, jnp.where(pos, e, -1.0))
    num_lo = jnp.where(small, n_lo, jnp.where(pos, e_err, 0.0))
    d = jnp.where(small, xs, den)
    d_lo = jnp.where(small, 0.0, ((one_of(den) - den) - e) - e_err)
    g = jnp.where(x == 0, 1.0 / x, div_first_order(num, num_lo, d, d_lo))  # ±inf at ±0
    if lo is None:
        return g
    # expm1(x + lo) = expm1(x) + lo e^x: 1/expm1(x + lo) = g - lo g (1 + g)
    return jnp.where(jnp.isfinite(g), g - (lo * g) * (1.0 + g), g)


@jax.custom_jvp
@_lowp
def expm1_recip(x: jax.Array) -> jax.Array:
    """``1 / expm1(x)`` within 1.2 ULP: the derivative of ``log1mexp`` (and, at ``-x``, of ``softplus_inverse``).

    One division and a first-order correction (:func:`div_first_order`)
    carrying the rounding of numerator and denominator and ``exp``'s error
    (from :func:`exp_parts`). ``±inf`` at ``±0``, ``-1`` at ``-inf``, 0 at ``+inf``.
    """
    return _expm1_recip(x, None)


@jax.custom_jvp
def expm1_recip_of_sum(x: jax.Array, lo: jax.Array) -> jax.Array:
    """``1 / expm1(x + lo)`` for a small ``lo`` (the low part of an exact difference; ``log_sub_exp``)."""
    return _lowp(_expm1_recip)(x, lo)


@expm1_recip.defjvp
def _expm1_recip_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    g = expm1_recip(x)
    return g, -t * (g * (1.0 + g))  # (1/expm1)' = -e^x / expm1^2 = -g (1 + g)


@expm1_recip_of_sum.defjvp
def _expm1_recip_of_sum_jvp(primals, tangents):
    (x, lo), (tx, tlo) = primals, tangents
    g = expm1_recip_of_sum(x, lo)
    return g, -(tx + tlo) * (g * (1.0 + g))


# sigmoid's exponent is capped here: sigmoid(80) rounds to 1 in float32 and
# float64, and exp(80) is finite in both.
_SIGMOID_CAP = 80.0


def sigmoid_exp(x: jax.Array) -> jax.Array:
    """``q = exp(min(x, 80))``: :func:`sigmoid` is ``q / (1 + q)``, and ``log1pexp`` is ``max(x, log1p(q))``.

    Not a kernel; callers that compute a value from it and a derivative with
    :func:`sigmoid` write it the same way, so XLA evaluates one ``exp``.
    """
    return exp(jnp.minimum(x, _SIGMOID_CAP))


def _sigmoid_of_sum(x: jax.Array, lo: jax.Array | None) -> jax.Array:
    # q / (1 + q) with 1 + q = s + s_lo exactly. With a low part lo of x: sigmoid(x + lo) =
    # (q + q lo) / (s + s_lo), rounded once (div_df); without, the cheaper first-order quotient
    # (within 2 ULP, 1.96 measured: exp's error, the division's rounding and the last addition's).
    q = sigmoid_exp(x)
    s = 1.0 + q
    if lo is None:
        return div_first_order(q, 0.0, s, sum_lo(q, s))
    lo = jnp.where(x < _SIGMOID_CAP, lo, 0.0)  # q e^lo = q (1 + lo) needs a small lo; above the cap it is 1 anyway
    return div_df(q, q * lo, s, sum_lo(q, s))


@jax.custom_jvp
@_lowp
def sigmoid(x: jax.Array) -> jax.Array:
    """``1 / (1 + exp(-x)) = q / (1 + q)``, ``q = exp(min(x, 80))``: never overflows (≤ 2 ULP).

    ``1 + q`` is taken exactly (as ``s + s_lo``), so only ``exp``'s error,
    the division's and one last addition remain; the correction
    ``q s_lo / s^2`` needs no second division (:func:`recip_approx`). One
    input: a derivative XLA:CPU computes in one pass over ``q``.
    """
    return _sigmoid_of_sum(x, None)


@sigmoid.defjvp
def _sigmoid_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return sigmoid(x), t * sigmoid_prime(x)


@jax.custom_jvp
def sigmoid_of_sum(x: jax.Array, lo: jax.Array) -> jax.Array:
    """``sigmoid(x + lo)`` for a small ``lo`` (the low part of an exact difference), rounded once."""
    return _lowp(_sigmoid_of_sum)(x, lo)


@sigmoid_of_sum.defjvp
def _sigmoid_of_sum_jvp(primals, tangents):
    (x, lo), (tx, tlo) = primals, tangents
    return sigmoid_of_sum(x, lo), (tx + tlo) * sigmoid_prime(x)


@jax.custom_jvp
@_lowp
def sigmoid_prime(x: jax.Array) -> jax.Array:
    """``σ(x) σ(-x) = e / (1 + e)^2``, ``e = exp(-|x|)``, with ``(1 + e)^2`` taken exactly (≤ 2 ULP).

    One ``exp``, which a value written with the same ``exp(-|x|)`` shares
    (``gk.stable.sigmoid``, ``silu``); its error is damped by
    ``(1 - e)/(1 + e)``. ``(1 + e)^2 = S + S_lo`` exactly (:func:`square_one_plus`),
    so what remains is the division's rounding and one last addition
    (:func:`div_first_order`).
    """
    e = exp(-jnp.abs(x))
    big, big_lo = square_one_plus(e)
    return div_first_order(e, 0.0, big, big_lo)


@sigmoid_prime.defjvp
def _sigmoid_prime_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    # σ'' = σ' (1 - 2σ) = -σ' tanh(x/2)
    return sigmoid_prime(x), -t * sigmoid_prime(x) * tanh(0.5 * x)


@jax.custom_jvp
@_lowp
def tanh(x: jax.Array) -> jax.Array:
    """``tanh``: odd Taylor series on ``|x| < 0.625``, ``1 - 2/(1 + e^(2|x|))`` elsewhere (≤ 0.8 ULP)."""
    a = jnp.abs(x)
    small = a < _TANH_CUT
    s = jnp.where(small, a, 0.0)
    n = _terms(_TANH, _TANH_CUT, 2, _eps(x.dtype))
    z = s * s
    series = s + s * (z * _horner(z, _TANH[1:n])) if n > 1 else s
    e = jnp.exp(-2.0 * a)  # in (0, 1] for every a: no guard needed (and log_cosh shares it)
    big = 1.0 - 2.0 * (e / (1.0 + e))
    r = jnp.where(small, series, big)
    return jnp.where(x < 0, -r, r)


@tanh.defjvp
def _tanh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return tanh(x), t * (4.0 * sigmoid_prime(2.0 * x))


# --------------------------------------------------------------------------- sin(pi x)


def _reduce2(x: jax.Array) -> jax.Array:
    """``x - 2 round(x / 2)``, exactly, in [-1, 1] (0 for non-integers beyond 2^p)."""
    return x - 2.0 * jnp.round(0.5 * x)


@jax.custom_jvp
@_lowp
def sinpi(x: jax.Array) -> jax.Array:
    """``sin(pi x)`` with an exact reduction of ``x`` (exactly 0 at integers, ≤ 1.6 ULP)."""
    fin = jnp.isfinite(x)
    r = _reduce2(jnp.where(fin, x, 0.0))
    r = jnp.where(jnp.abs(r) > 0.5, jnp.where(r > 0, 1.0, -1.0) - r, r)  # sin(pi - t) = sin t
    return jnp.where(fin, jnp.sin(np.pi * r), jnp.nan)


@jax.custom_jvp
@_lowp
def cospi(x: jax.Array) -> jax.Array:
    """``cos(pi x) = sin(pi (1/2 - r))``, ``r = |x mod 2|`` in [0, 1] (exactly 0 at half-integers, ≤ 1.9 ULP).

    One ``sin``, and the same reduction as :func:`sinpi` (XLA shares it).
    ``1/2 - r`` is exact for ``r >= 1/4``; below, its rounding moves the
    result by under 0.6 ULP, where ``cos`` is flat.
    """
    fin = jnp.isfinite(x)
    r = jnp.abs(_reduce2(jnp.where(fin, x, 0.0)))  # [0, 1]
    return jnp.where(fin, jnp.sin(np.pi * (0.5 - r)), jnp.nan)


@sinpi.defjvp
def _sinpi_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return sinpi(x), t * (np.pi * cospi(x))


@cospi.defjvp
def _cospi_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return cospi(x), -t * (np.pi * sinpi(x))


# --------------------------------------------------------------------------- exact sums


def one_of(s: jax.Array) -> jax.Array:
    """1 as ``sign(s)`` for ``s > 0``: a 1 XLA cannot fold.

    XLA (jax < 0.12) rewrites ``(a + 1) - 1`` to ``a``, which would erase the
    rounding error that an error-free sum recovers; ``(a + 1) - sign(a + 1)``
    is left alone.
    """
    return jnp.sign(s)


def sum_lo(b: jax.Array, s: jax.Array) -> jax.Array:
    """The rounding error of ``s = 1 + b``: ``(1 + b) - s``, exactly, for any ``b > -1``.

    Dekker's Fast2Sum, the larger addend first (``max(b, 1)``: no constant,
    so XLA cannot fold ``s - 1`` into ``b``).
    """
    big = jnp.maximum(b, 1.0)
    return jnp.minimum(b, 1.0) - (s - big)


def two_sum(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a + b = s + lo`` exactly (Knuth's TwoSum; no constant operands, which XLA may fold)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


# XLA:CPU fuses a*b + c into a fused multiply-add wherever LLVM finds one, also when a*b has other uses,
# and computes a value again in each fusion that needs it. An error-free transformation written with a
# rounded product (Dekker's a*b - p, Veltkamp's c - (c - a) with c = a*s) then silently loses its low
# part. Here products are only ever exact (of halves split by masking bits), so an FMA changes nothing.
_SPLIT_MASK: dict = {np.dtype(np.float32): (np.int32, np.int32(-(1 << 12))),  # keep 12 of 24 bits
                     np.dtype(np.float64): (np.int64, np.int64(-(1 << 27)))}  # keep 26 of 53 bits


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a = hi + lo`` with ``hi`` the upper half of the significand (its low bits masked), ``lo`` exact.

    Products of halves are exact (float64: all but ``lo * lo``, within
    2^-106 of the product).
    """
    itype, mask = _SPLIT_MASK[np.dtype(a.dtype)]
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(a, itype) & mask, a.dtype)
    return hi, a - hi


def two_prod(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a b = p + lo`` exactly, ``p`` within an ULP of ``a b`` (from exact partial products).

    ``p`` is not always the rounded ``a b``; it is always consistent with
    ``lo``, whatever XLA fuses.
    """
    ah, al = _split(a)
    bh, bl = _split(b)
    mid, mid_lo = two_sum(ah * bl, al * bh)
    p, e = two_sum(ah * bh, mid)
    return p, e + (mid_lo + al * bl)


def prod_lo(a: jax.Array, b: jax.Array, p: jax.Array) -> jax.Array:
    """``a b - p``, for a given ``p`` within an ULP of ``a b`` (a select's output, not a bare ``a * b``).

    With ``p`` the very value a caller goes on to use, the pair ``(p, lo)`` is
    consistent even where XLA recomputes ``a b`` in another fusion.
    """
    ah, al = _split(a)
    bh, bl = _split(b)
    mid, mid_lo = two_sum(ah * bl, al * bh)
    return ((ah * bh - p) + mid) + (mid_lo + al * bl)


def two_square(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``a^2 = p + lo`` exactly (:func:`two_prod` ``(a, a)``): ``a = h + l``, ``h^2 + 2 h l`` by Fast2Sum, ``+ l^2``."""
    ah, al = _split(a)
    hh = ah * ah
    mid = 2.0 * (ah * al)
    p = hh + mid
    return p, ((hh - p) + mid) + al * al


def square_one_plus(e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(1 + e)^2 = S + S_lo`` for ``0 <= e <= 1``: ``s = fl(1 + e)`` squared exactly, plus ``2 s s_lo``."""
    s = 1.0 + e
    big, lo = two_square(s)
    return big, lo + 2.0 * s * sum_lo(e, s)


def div_df(num: jax.Array, num_lo: jax.Array | float, den: jax.Array, den_lo: jax.Array | float) -> jax.Array:
    """``(num + num_lo) / (den + den_lo)`` rounded once: ``y = num r`` plus its exact residual times ``r``.

    ``r ≈ 1/den`` (:func:`recip_approx`, 7e-6 float32, 4e-11 float64); the
    residual ``(num + num_lo) - y (den + den_lo)`` from exact partial products,
    so only the last addition rounds. No division (XLA gives a division used
    twice a fusion of its own, and recomputes what it shares in each). Near
    overflow or underflow, ``num / den``: the low parts are below its last bit.
    """
    fi = jnp.finfo(den.dtype)
    hi = float(fi.max) / 2.0 ** (fi.nmant // 2 + 3)
    lo = float(fi.tiny) * 2.0 ** (fi.nmant + 3)
    ad = jnp.abs(den)
    ds = jnp.where((ad < hi) & (ad > lo), den, 1.0)
    r = recip_approx(ds, 2 if fi.bits <= 32 else 3)
    y = num * r
    ok = (ds == den) & (jnp.abs(y) < hi) & (jnp.abs(y) > lo)  # ds == den: den in range
    ys = jnp.where(ok, y, 0.0)
    yh, yl = _split(ys)
    dh, dl = _split(ds)
    # num - y den exactly: num - yh dh is exact (Sterbenz), the other partial products are small
    mid, mid_lo = two_sum(yh * dl, yl * dh)
    res = (((num - yh * dh) - mid) - (mid_lo + yl * dl)) + (num_lo - ys * den_lo)
    return jnp.where(ok, ys + res * r, num / den)


def div_first_order(num: jax.Array, num_lo: jax.Array | float, den: jax.Array,
                    den_lo: jax.Array | float) -> jax.Array:
    """``(num + num_lo) / (den + den_lo)``: one division, the low parts applied to first order.

    ``num / den`` plus ``(num_lo - (num / den) den_lo) / den`` with ``1/den``
    from :func:`recip_approx`; the division appears once, so XLA fuses it all
    into its consumer. Keeps what :func:`div_df` removes, the division's own
    rounding (0.5 ULP), at a quarter of the cost. Needs a normal ``den``,
    computed with no product a fused multiply-add could round differently in
    another fusion: the correction must see the ``den`` that was divided by.
    """
    r = recip_approx(den)
    corr = -(num * r) * (den_lo * r)
    if not (isinstance(num_lo, float) and num_lo == 0.0):
        corr = corr + num_lo * r
    return num / den + corr


_RECIP_MAGIC: dict = {np.dtype(np.float32): (np.int32, 0x7EF311C3),
                     np.dtype(np.float64): (np.int64, 0x7FDE6238DA3C2118)}


def recip_approx(s: jax.Array, steps: int = 1) -> jax.Array:
    """``1/s`` for normal ``s`` of either sign without a division: a bit trick and Newton steps.

    Relative error 5% with none, then 0.3%, 7e-6, 4e-11 (the error squares):
    one step for a correction, more for :func:`div_df`'s quotient.
    """
    itype, magic = _RECIP_MAGIC[np.dtype(s.dtype)]
    r = lax.bitcast_convert_type(itype(magic) - lax.bitcast_convert_type(s, itype), s.dtype)
    for _ in range(steps):
        r = r * (2.0 - s * r)
    return r
