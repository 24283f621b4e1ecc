"""Stable functions: correct, finite gradients wherever the true derivative is finite.

Every function here is a named op (:func:`gradkit.op`), so a rule table can
target it by name, built around a ``jax.custom_jvp``, so forward mode,
``jax.hessian`` and every higher order work. Derivatives are written with
accurate kernels (``gradkit/_src/numerics.py``): on XLA:CPU the elementwise
gradients have no non-finite value where the true derivative is finite, and
are within 2 ULP over the whole float32 range, except silu and hypot
(up to 2.3 ULP: XLA's ``exp`` alone is off by 0.84 ULP) and sinc next to the
zeros of its derivative (an error relative to a value near 0).
``benchmarks/accuracy.py`` measures all of them against mpmath.

Each docstring gives the naive formula, where it (or its gradient) breaks,
and what the function does there. Conventions at points where the true
derivative is infinite or undefined (``safe_*``, ``normalize`` at 0, …) are
stated per function.

Examples:
  >>> import jax, gradkit as gk
  >>> float(jax.grad(gk.stable.log1pexp)(100.0))
  1.0
"""

from __future__ import annotations

import functools
from decimal import Decimal
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradkit._src import numerics as _k
from gradkit._src.named import op as _op

__all__ = [
    "hypot",
    "log1mexp",
    "log1pexp",
    "log_cosh",
    "log_sigmoid",
    "log_softmax",
    "log_sub_exp",
    "logaddexp",
    "logsumexp",
    "normalize",
    "safe_arccos",
    "safe_arcsin",
    "safe_arctan2",
    "safe_div",
    "safe_log",
    "safe_norm",
    "safe_pow",
    "safe_sqrt",
    "sigmoid",
    "silu",
    "sinc",
    "softmax",
    "softplus",
    "softplus_inverse",
    "xlog1py",
    "xlogy",
]

Array = jax.Array
_LN2 = float(np.log(2.0))


def _named(name: str):
    """Marks a public wrapper with the op name its inner named op carries."""

    def mark(fn):
        fn.gradkit_op_name = name
        return fn

    return mark


def _split(value: str, dtype: Any) -> tuple[float, float]:
    """``value`` (decimal string) as ``hi + lo`` in ``dtype``."""
    exact = Fraction(Decimal(value))
    t = np.dtype(dtype).type
    hi = t(float(exact))
    lo = t(float(exact - Fraction(float(hi))))
    return float(hi), float(lo)


def _where0(cond: Array, x: Array, fill: float = 1.0) -> Array:
    """``x`` where ``cond`` else ``fill``: the inner half of a double where."""
    return jnp.where(cond, x, fill)


def _axes(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    if isinstance(axis, (tuple, list)):
        return tuple(sorted(a % ndim for a in axis))
    return (int(axis) % ndim,)


def _static_axis(axis: Any) -> Any:
    if isinstance(axis, list):
        return tuple(axis)
    if isinstance(axis, (np.integer,)):
        return int(axis)
    return axis


# =========================================================================== softplus family


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
    (never ``exp(x)/(1+exp(x))`` uncapped), within 2 ULP in float32.
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
    e = jnp.exp(-jnp.abs(x))
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
    ~1e7 ULP. This computes the derivative as ``e / (1 + e (2 + e))``,
    ``e = exp(-|x|)`` (``sigmoid(x) sigmoid(-x)`` without cancellation,
    from the one ``exp`` the value uses too), within 2 ULP.

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
_SILU_FAR = -64.0  # below, e^x underflows before x e^x does: silu uses e^(x + 64) e^-64
_SILU_NEAR = 0.25  # |x - r| below which 1 + x + e^x is taken around its root


def _silu_exp(x):
    """``(e, far)``: ``e = exp(-|x|)``, except ``exp(x + 64)`` where ``far = x < -64``.

    The one ``exp`` of silu's value and derivative: both build it from the
    same expression, so XLA evaluates it once.
    """
    far = x < _SILU_FAR
    return jnp.exp(jnp.where(far, x - _SILU_FAR, -jnp.abs(x))), far


@jax.custom_jvp
def _silu_prime(x):
    e, far = _silu_exp(x)
    # With e = exp(-|x|): silu' = (1 + e (1 + x)) / (1 + e)^2 for x >= 0 and
    # e g / (1 + e)^2, g = 1 + x + e, for x < 0; no cancellation except in g.
    # Within 1/4 of g's root use g = d + e^r expm1(d), d = x - r (a short
    # series); elsewhere 1 + x is exact (|x| >= 2) or the rounding of e moves
    # g by under one of its ULPs. Infinite x are clamped (then e = 0 gives
    # the limits 1 and 0 without 0 * inf); every branch is finite, so one
    # division serves them all.
    x = jnp.clip(x, -1e4, 1e4)
    r_hi, r_lo = _split(_SILU_ROOT, x.dtype)
    e_r = float(Fraction(Decimal(_SILU_EXP_ROOT)))
    d = lax.optimization_barrier(x - r_hi) - r_lo  # XLA would fold the two constants into one
    xp1 = 1.0 + x
    g = jnp.where(jnp.abs(d) < _SILU_NEAR, d + e_r * _k.expm1_series(d, _SILU_NEAR), xp1 + e)
    num = jnp.where(x < 0, e * g, 1.0 + e * xp1)
    out = num / (1.0 + e * (2.0 + e))
    # Below -64: silu' = e^x (1 + x) to float precision, with e = e^(x + 64).
    return jnp.where(far, (e * xp1) * float(np.exp(_SILU_FAR)), out)


@_silu_prime.defjvp
def _silu_prime_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    fin = jnp.isfinite(x)
    xs = jnp.where(fin, x, 0.0)
    # silu'' = sigmoid'(x) (2 - x tanh(x/2))
    second = _k.sigmoid_prime(xs) * (2.0 - xs * _k.tanh(0.5 * xs))
    return _silu_prime(x), t * jnp.where(fin, second, jnp.where(jnp.isnan(x), x, 0.0))


@jax.custom_jvp
def _silu(x):
    e, far = _silu_exp(x)
    s = jnp.where(x >= 0, 1.0, e) / (1.0 + e)  # sigmoid(x), as _k.sigmoid computes it
    return jnp.where(far, (x * e) * float(np.exp(_SILU_FAR)), x * s)


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
    This computes the derivative as ``s + x s'`` for ``x ≥ 0`` and
    ``s'(x) (1 + x + e^x)`` for ``x < 0``, the last factor expanded around
    its root so it keeps full relative accuracy there.

    Examples:
      >>> import jax, gradkit as gk
      >>> float(jax.grad(gk.stable.silu)(0.0))
      0.5
    """
    (x,) = _k.as_inexact(x)
    return _silu(x)


# =========================================================================== logaddexp / logsumexp


def _sigmoid_of_difference(x: Array, y: Array) -> tuple[Array, Array]:
    """``(sigmoid(x - y), sigmoid(y - x))`` with ``x - y`` taken exactly (TwoSum)."""
    hi, lo = _k.two_diff(x, y)
    same_inf = (x == y) & jnp.isinf(x)
    hi = jnp.where(same_inf, 0.0, hi)  # equal infinities: the limit along x == y
    ds = _k.sigmoid_prime(hi) * lo
    return _k.sigmoid(hi) + ds, _k.sigmoid(-hi) - ds


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


def _lse_weights(a, b, where, axes):
    """Softmax-style weights of logsumexp: ``w = b e^a / S`` (for ``a``) and ``v = e^a / S`` (for ``b``).

    Entries with ``b == 0`` are left out of the sum and the maximum (as in
    JAX) but still get ``v``. An infinite or all-``-inf`` maximum is handled
    by its limit along equal inputs: the weight is shared evenly by the
    entries equal to the maximum.
    """
    neg_inf = -jnp.inf
    mask = where if b is None else where & (b != 0)
    a_m = jnp.where(mask, a, neg_inf)
    m = jnp.max(a_m, axis=axes, keepdims=True)
    fin = jnp.isfinite(m)
    m_safe = lax.stop_gradient(jnp.where(fin, m, 0.0))
    a_safe = jnp.where(where & fin, a, 0.0)
    s = jnp.where(fin, a_safe - m_safe, jnp.where(a_m == m, 0.0, neg_inf))
    e = jnp.exp(jnp.where(where, s, neg_inf))
    be = e if b is None else jnp.where(mask, b * e, 0.0)
    total = jnp.sum(be, axis=axes, keepdims=True)
    any_in = jnp.any(mask, axis=axes, keepdims=True)
    total = jnp.where(any_in, total, 1.0)
    w = jnp.where(mask, be / total, 0.0)
    v = None if b is None else jnp.where(where, e / total, 0.0)
    return w, v


@functools.lru_cache(maxsize=None)
def _logsumexp_fn(axes, keepdims, return_sign, has_b, has_where):
    def forward(a, b, where):
        return jax.scipy.special.logsumexp(
            a, axis=axes, b=b if has_b else None, keepdims=keepdims, return_sign=return_sign,
            where=where if has_where else None)

    fn = jax.custom_jvp(forward)

    @fn.defjvp
    def jvp(primals, tangents):
        a, b, where = primals
        ta, tb, _ = tangents
        out = fn(a, b, where)
        mask = where if has_where else jnp.ones(a.shape, bool)
        w, v = _lse_weights(a, b if has_b else None, mask, axes)
        dot = jnp.sum(w * ta, axis=axes, keepdims=keepdims)
        if has_b:
            dot = dot + jnp.sum(v * tb, axis=axes, keepdims=keepdims)
        if return_sign:
            return out, (dot, jnp.zeros_like(out[1]))
        return out, dot

    return fn


@_op("logsumexp")
def _logsumexp_op(a, b, where, *, axis=None, keepdims=False, return_sign=False):
    arrays = [a] + ([b] if b is not None else [])
    arrays = list(_k.as_inexact(*arrays))
    if where is not None:
        arrays.append(jnp.asarray(where, bool))
    arrays = jnp.broadcast_arrays(*arrays)
    a = arrays[0]
    b_ = arrays[1] if b is not None else jnp.zeros((), a.dtype)
    w_ = arrays[-1] if where is not None else jnp.zeros((), bool)
    axes = _axes(axis, a.ndim)
    fn = _logsumexp_fn(axes, bool(keepdims), bool(return_sign), b is not None, where is not None)
    return fn(a, b_, w_)


@_named("logsumexp")
def logsumexp(a: ArrayLike, axis: Any = None, b: ArrayLike | None = None, keepdims: bool = False,
              return_sign: bool = False, where: ArrayLike | None = None) -> Any:
    """``log(sum(b * exp(a)))`` over ``axis``, with a finite gradient everywhere.

    Same signature and forward values as ``jax.scipy.special.logsumexp``.
    Naive: ``log(sum(exp(a)))`` overflows; JAX's version is stable but its
    gradient is NaN when every input is ``-inf`` (``0/0``) or when an input is
    ``+inf``. The gradient here is the softmax weights ``b e^(a - out)``,
    computed with the maximum subtracted; where the maximum is infinite
    (all ``-inf``, or some ``+inf``) it is the limit along equal inputs: the
    weight is shared evenly by the entries equal to the maximum. Entries
    masked by ``where`` get 0.

    Args:
      a: the exponents.
      axis: axis or axes to reduce (default: all).
      b: optional scale factors, broadcast against ``a``.
      keepdims: keep the reduced axes with size 1.
      return_sign: also return the sign of the sum (for negative ``b``).
      where: optional boolean mask of the entries to include.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> jax.grad(gk.stable.logsumexp)(jnp.full(4, -jnp.inf)).tolist()
      [0.25, 0.25, 0.25, 0.25]
    """
    return _logsumexp_op(a, b, where, axis=_static_axis(axis), keepdims=bool(keepdims),
                         return_sign=bool(return_sign))


@functools.lru_cache(maxsize=None)
def _softmax_fn(axes, log, has_where):
    def shifted(x, where):
        mask = where if has_where else jnp.ones(x.shape, bool)
        neg_inf = -jnp.inf
        x_m = jnp.where(mask, x, neg_inf)
        m = lax.stop_gradient(jnp.max(x_m, axis=axes, keepdims=True))
        fin = jnp.isfinite(m)
        s = jnp.where(fin, jnp.where(mask & fin, x, 0.0) - jnp.where(fin, m, 0.0),
                      jnp.where(x_m == m, 0.0, neg_inf))
        return jnp.where(mask, s, neg_inf), mask

    def forward(x, where):
        s, mask = shifted(x, where)
        e = jnp.exp(s)
        total = jnp.sum(e, axis=axes, keepdims=True)
        if log:
            return jnp.where(mask, s - jnp.log(total), -jnp.inf)
        return jnp.where(mask, e / total, 0.0)

    fn = jax.custom_jvp(forward)

    @fn.defjvp
    def jvp(primals, tangents):
        x, where = primals
        tx, _ = tangents
        out = fn(x, where)
        s, mask = shifted(x, where)
        e = jnp.exp(s)
        y = jnp.where(mask, e / jnp.sum(e, axis=axes, keepdims=True), 0.0)
        tx = jnp.where(mask, tx, 0.0)
        mean = jnp.sum(y * tx, axis=axes, keepdims=True)
        if log:
            return out, jnp.where(mask, tx - mean, 0.0)
        return out, y * (tx - mean)

    return fn


@_op("softmax")
def _softmax_op(x, where, *, axis=-1):
    (x,) = _k.as_inexact(x)
    w = jnp.zeros((), bool) if where is None else jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    return _softmax_fn(_axes(axis, x.ndim), False, where is not None)(x, w)


@_op("log_softmax")
def _log_softmax_op(x, where, *, axis=-1):
    (x,) = _k.as_inexact(x)
    w = jnp.zeros((), bool) if where is None else jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    return _softmax_fn(_axes(axis, x.ndim), True, where is not None)(x, w)


@_named("softmax")
def softmax(x: ArrayLike, axis: Any = -1, where: ArrayLike | None = None) -> Array:
    """``exp(x) / sum(exp(x))`` over ``axis``, finite for infinite inputs.

    Same values as ``jax.nn.softmax`` for finite inputs. Naive:
    ``exp(x) / sum(exp(x))`` overflows; ``jax.nn.softmax`` is NaN when the
    maximum is ``+inf`` or every input is ``-inf``. This returns the limit
    along equal inputs there (the ``+inf`` entries share the mass; all
    ``-inf`` gives uniform weights), with the usual ``y (t - sum(y t))``
    derivative. Entries masked by ``where`` are 0.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> gk.stable.softmax(jnp.array([jnp.inf, 0.0])).tolist()
      [1.0, 0.0]
    """
    return _softmax_op(x, where, axis=_static_axis(axis))


@_named("log_softmax")
def log_softmax(x: ArrayLike, axis: Any = -1, where: ArrayLike | None = None) -> Array:
    """``x - logsumexp(x)`` over ``axis``, finite for infinite inputs.

    Same values as ``jax.nn.log_softmax`` for finite inputs; where JAX gives
    ``inf - inf = NaN`` (an input ``+inf``, or all ``-inf``) this returns the
    limit along equal inputs. Masked entries are ``-inf`` with a zero
    derivative.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> gk.stable.log_softmax(jnp.full(2, -jnp.inf)).tolist() == [-0.6931471824645996] * 2
      True
    """
    return _log_softmax_op(x, where, axis=_static_axis(axis))


# =========================================================================== x log y


@jax.custom_jvp
def _xlogy(x, y):
    return jnp.where((x != 0) | jnp.isnan(y), x * jnp.log(y), 0.0)


@_xlogy.defjvp
def _xlogy_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    zero = x == 0
    dy = jnp.where(zero, 0.0, x / jnp.where(zero, 1.0, y))
    return _xlogy(x, y), tx * jnp.log(y) + ty * dy


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


@jax.custom_jvp
def _xlog1py(x, y):
    return jnp.where((x != 0) | jnp.isnan(y), x * _k.log1p(y), 0.0)


@_xlog1py.defjvp
def _xlog1py_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    zero = x == 0
    dy = jnp.where(zero, 0.0, x / (1.0 + jnp.where(zero, 0.0, y)))
    return _xlog1py(x, y), tx * _k.log1p(y) + ty * dy


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


# =========================================================================== log(1 - exp)


@_k._lowp
def _expm1_recip(x):
    """``1 / expm1(x)`` (log1mexp's derivative): ``1/y`` with ``y`` a Taylor series of ``expm1`` below
    ``log 2``, ``e / (1 - e)`` with ``e = exp(-x)`` (``1 - e`` in [1/2, 1), no cancellation) above."""
    small = jnp.abs(x) < _LN2
    y = _k.expm1_series(jnp.where(small, x, 0.0), _LN2)
    e = jnp.exp(-jnp.maximum(x, -80.0))  # finite: g = -1 below -80 instead of inf/inf
    g = jnp.where(small, 1.0, e) / jnp.where(small, y, 1.0 - e)
    # x < 0: 1/expm1(x) < -1, but it rounds to -1 from x = -17 (float32) on;
    # keep it below -1 there, so that log1mexp = -log1p(g) is NaN as well.
    below = float(np.nextafter(np.array(-1.0, x.dtype), np.array(-2.0, x.dtype)))
    return jnp.where(x < 0, jnp.minimum(g, below), g)


@jax.custom_jvp
@_k._lowp
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


@_log1mexp.defjvp
def _log1mexp_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _log1mexp(x), t * _log1mexp_slope(x)


@_op("log1mexp")
def log1mexp(x: ArrayLike) -> Array:
    """``log(1 - exp(-x))`` for ``x ≥ 0`` (NaN for ``x < 0``).

    Naive: ``jnp.log(1 - jnp.exp(-x))`` cancels for small ``x`` (``1e-8``
    gives ``-inf`` in float32) and loses ``exp(-x)`` for large ``x``. This
    computes the derivative ``g = 1 / expm1(x)`` without cancellation (a
    Taylor series of ``expm1`` below ``log 2``, ``e^-x / (1 - e^-x)`` above)
    and the value as ``-log1p(g)`` (``1 - e^-x = 1 / (1 + g)``; well
    conditioned for every ``x > 0``). ``g`` is finite for every ``x > 0`` and
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
    hi, lo = _k.two_diff(x, y)
    same_inf = (x == y) & jnp.isinf(x)
    hi = jnp.where(same_inf, 0.0, hi)

    def corr(z):
        return jnp.where(lo == 0, 0.0, lo * jnp.exp(jnp.where(lo == 0, 0.0, z)))

    dx = -1.0 / (_k.expm1(-hi) - corr(-hi))
    dy = -1.0 / (_k.expm1(hi) + corr(hi))
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
    return x + jnp.log(-_k.expm1(-x))


@_softplus_inverse.defjvp
def _softplus_inverse_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _softplus_inverse(x), t * (-1.0 / _k.expm1(-x))


@_op("softplus_inverse")
def softplus_inverse(x: ArrayLike) -> Array:
    """``log(exp(x) - 1)``, the inverse of softplus, for ``x > 0``.

    Naive: ``jnp.log(jnp.expm1(x))`` overflows for ``x > 88.7`` (float32)
    and its gradient is ``inf/inf = NaN`` there. This computes
    ``x + log(-expm1(-x))``; the derivative is ``1 / (1 - exp(-x))``.

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


@_log_cosh.defjvp
def _log_cosh_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _log_cosh(x), t * _k.tanh(x)


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
    return y, t * jnp.where(pos, 0.5 / _where0(pos, y), 0.0)


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


@functools.lru_cache(maxsize=None)
def _safe_log_fn(eps):
    @jax.custom_jvp
    def fn(x):
        return jnp.log(jnp.maximum(x, _eps_for(eps, x.dtype)))

    @fn.defjvp
    def jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        ok = x >= _eps_for(eps, x.dtype)
        return fn(x), t * jnp.where(ok, 1.0 / _where0(ok, x), 0.0)

    return fn


def _eps_for(eps, dtype):
    return float(jnp.finfo(dtype).tiny) if eps is None else eps


@_op("safe_log")
def _safe_log_op(x, *, eps=None):
    (x,) = _k.as_inexact(x)
    return _safe_log_fn(eps)(x)


@_named("safe_log")
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
    return _safe_log_op(x, eps=None if eps is None else float(eps))


@jax.custom_jvp
def _safe_div(x, y):
    zero = y == 0
    return jnp.where(zero, 0.0, x / _where0(~zero, y))


@_safe_div.defjvp
def _safe_div_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    zero = y == 0
    ys = _where0(~zero, y)
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
    m = jnp.maximum(jnp.abs(x), jnp.abs(y))
    ok = jnp.isfinite(m) & (m > 0)
    scale = _k.pow2_floor(jnp.where(ok, m, 1.0))
    # the barrier stops XLA from merging (x / s) / d / s into x / (s * d * s), which overflows
    xs, ys = lax.optimization_barrier((jnp.where(ok, x, 1.0) / scale, jnp.where(ok, y, 0.0) / scale))
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


@jax.custom_jvp
def _safe_pow(x, y):
    return jnp.power(x, y)


@_safe_pow.defjvp
def _safe_pow_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    out = _safe_pow(x, y)
    y0 = y == 0
    ym1 = jnp.where(y0, 1.0, y) - 1.0
    dx = y * jnp.power(x, ym1)
    # x^(y-1) can underflow where y x^(y-1) does not: take it as y x^h x^h, h = (y-1)/2.
    tiny = float(jnp.finfo(x.dtype).tiny)
    low = jnp.abs(dx) < 4.0 * tiny
    half = jnp.power(x, 0.5 * ym1)
    dx = jnp.where(y0, 0.0, jnp.where(low, (y * half) * half, dx))
    x0 = x == 0
    log_x = jnp.log(jnp.where(x0, 1.0, x))
    dy = jnp.where(x0 & (y >= 0), 0.0, jnp.where(x0, -jnp.inf, out * log_x))
    return out, tx * dx + ty * dy


@_op("safe_pow")
def safe_pow(x: ArrayLike, y: ArrayLike) -> Array:
    """``x ** y`` with finite gradients at ``x = 0`` where the true ones are.

    Naive: ``d/dx = y x^(y-1)`` is ``0 * inf = NaN`` at ``x = 0, y = 0``,
    and ``d/dy = x^y log x`` is ``0 * -inf = NaN`` at ``x = 0``. Here
    ``d/dx`` is 0 where ``y == 0`` and ``d/dy`` is 0 where ``x == 0`` and
    ``y ≥ 0`` (PyTorch's conventions). ``d/dx`` stays ``+inf`` at
    ``x = 0, 0 < y < 1``, where the true derivative is infinite.

    Examples:
      >>> import jax, gradkit as gk
      >>> [float(g) for g in jax.grad(gk.stable.safe_pow, argnums=(0, 1))(0.0, 0.0)]
      [0.0, 0.0]
    """
    x, y = jnp.broadcast_arrays(*_k.as_inexact(x, y))
    return _safe_pow(x, y)


def _acos_slope(x):
    """``1 / sqrt(1 - x^2)`` (JAX's formula: exact ``x`` makes ``1 - x^2`` benign near ±1); at ``|x| == 1``
    the slope at the float next to 1; 0 beyond."""
    a = jnp.abs(x)
    inside = a < 1.0
    edge = 1.0 - float(jnp.finfo(x.dtype).epsneg)
    xc = jnp.where(inside, x, jnp.where(x > 0, edge, -edge))
    slope = lax.rsqrt(1.0 - lax.square(xc))
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


@_safe_arcsin.defjvp
def _safe_arcsin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return _safe_arcsin(x), t * _acos_slope(x)


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


@_op("sinc")
def sinc(x: ArrayLike) -> Array:
    """``sin(pi x) / (pi x)``, 1 at 0, accurate at every order of differentiation.

    Naive: ``jnp.sin(jnp.pi * x) / (jnp.pi * x)`` is ``0/0`` at 0, and for
    large ``x`` the rounding of ``pi * x`` ruins ``sin``. ``jnp.sinc`` fixes
    the value at 0, but its derivatives away from 0 are autodiff of the
    quotient. This reduces ``x`` exactly (``sin(pi x)`` is exactly 0 at
    integers), uses the Maclaurin series of each derivative for
    ``|x| < 1``, and the Leibniz expansion beyond: ``sinc'(0) = 0``,
    ``sinc''(0) = -pi^2/3``, and so on at every order; ``sinc(±inf) = 0``.

    Examples:
      >>> import jax, gradkit as gk
      >>> round(float(jax.grad(jax.grad(gk.stable.sinc))(0.0)), 5)
      -3.28987
    """
    (x,) = _k.as_inexact(x)
    return _k.sinc_derivative(0, x)


# =========================================================================== norms


@jax.custom_jvp
def _hypot(x, y):
    m = jnp.maximum(jnp.abs(x), jnp.abs(y))
    scale = _k.pow2_floor(m)
    xs, ys = x / scale, y / scale
    h = scale * jnp.sqrt(xs * xs + ys * ys)
    return jnp.where(jnp.isinf(x) | jnp.isinf(y), jnp.inf, h)


@_hypot.defjvp
def _hypot_jvp(primals, tangents):
    (x, y), (tx, ty) = primals, tangents
    m = jnp.maximum(jnp.abs(x), jnp.abs(y))
    ok = jnp.isfinite(m) & (m > 0)
    scale = _k.pow2_floor(jnp.where(ok, m, 1.0))
    xs = jnp.where(ok, x, 1.0) / scale
    ys = jnp.where(ok, y, 1.0) / scale
    hs = jnp.sqrt(xs * xs + ys * ys)
    inf = jnp.isinf(m)
    n_inf = jnp.where(jnp.isinf(x), 1.0, 0.0) + jnp.where(jnp.isinf(y), 1.0, 0.0)
    ux = jnp.where(ok, xs / hs, jnp.where(inf, jnp.where(jnp.isinf(x), jnp.sign(x), 0.0) / jnp.sqrt(n_inf), 0.0))
    uy = jnp.where(ok, ys / hs, jnp.where(inf, jnp.where(jnp.isinf(y), jnp.sign(y), 0.0) / jnp.sqrt(n_inf), 0.0))
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
    scale = _k.pow2_floor(m)
    xs = x / scale
    inf = jnp.isinf(m)
    xs = jnp.where(inf, jnp.where(jnp.isinf(x), jnp.sign(x), 0.0), xs)
    ns = jnp.sqrt(jnp.sum(xs * xs, axis=axes, keepdims=True))
    n = jnp.where(inf, jnp.inf, scale * ns)
    u = xs / jnp.where(ns == 0, 1.0, ns)
    return u, n


@functools.lru_cache(maxsize=None)
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
def _safe_norm_op(x, *, ord=None, axis=None, keepdims=False, min_norm=0.0):
    (x,) = _k.as_inexact(x)
    if _is_two_norm(ord, axis, x.ndim):
        axes = _axes(axis if not (ord == "fro" and axis is None) else None, x.ndim)
        return _norm2_fn(axes, keepdims, min_norm)(x)
    n = jnp.linalg.norm(x, ord=ord, axis=axis, keepdims=True)
    small = n <= min_norm
    ns = jnp.linalg.norm(jnp.where(small, 1.0, x), ord=ord, axis=axis, keepdims=True)
    out = jnp.where(small, min_norm, ns)
    if keepdims:
        return out
    return jnp.squeeze(out, _axes(axis, x.ndim) if axis is not None else None)


@_named("safe_norm")
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
    return _safe_norm_op(x, ord=ord, axis=_static_axis(axis), keepdims=bool(keepdims),
                         min_norm=float(min_norm))


@functools.lru_cache(maxsize=None)
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
def _normalize_op(x, *, axis=-1):
    (x,) = _k.as_inexact(x)
    return _normalize_fn(_axes(axis, x.ndim))(x)


@_named("normalize")
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
    return _normalize_op(x, axis=_static_axis(axis))
