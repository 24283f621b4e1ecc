"""Stable reductions over axes: logsumexp, softmax, log_softmax."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.typing import ArrayLike

from gradkit._src.core.named import op as _op
from gradkit._src.stable import numerics as _k
from gradkit._src.stable.util import named, norm_axes, static_axis

Array = jax.Array


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


@functools.cache
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
def logsumexp_op(a, b, where, *, axis=None, keepdims=False, return_sign=False):
    arrays = [a] + ([b] if b is not None else [])
    arrays = list(_k.as_inexact(*arrays))
    if where is not None:
        arrays.append(jnp.asarray(where, bool))
    bcast = jnp.broadcast_arrays(*arrays)
    a = bcast[0]
    b_ = bcast[1] if b is not None else jnp.zeros((), a.dtype)
    w_ = arrays[-1] if where is not None else jnp.zeros((), bool)
    axes = norm_axes(axis, a.ndim)
    fn = _logsumexp_fn(axes, bool(keepdims), bool(return_sign), b is not None, where is not None)
    return fn(a, b_, w_)


@named("logsumexp")
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
    return logsumexp_op(a, b, where, axis=static_axis(axis), keepdims=bool(keepdims),
                         return_sign=bool(return_sign))


@functools.cache
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
def softmax_op(x, where, *, axis=-1):
    (x,) = _k.as_inexact(x)
    w = jnp.zeros((), bool) if where is None else jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    return _softmax_fn(norm_axes(axis, x.ndim), False, where is not None)(x, w)


@_op("log_softmax")
def log_softmax_op(x, where, *, axis=-1):
    (x,) = _k.as_inexact(x)
    w = jnp.zeros((), bool) if where is None else jnp.broadcast_to(jnp.asarray(where, bool), x.shape)
    return _softmax_fn(norm_axes(axis, x.ndim), True, where is not None)(x, w)


@named("softmax")
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
    return softmax_op(x, where, axis=static_axis(axis))


@named("log_softmax")
def log_softmax(x: ArrayLike, axis: Any = -1, where: ArrayLike | None = None) -> Array:
    """``x - logsumexp(x)`` over ``axis``, finite for infinite inputs.

    Naive: ``x - jnp.log(jnp.sum(jnp.exp(x)))`` overflows; ``jax.nn.log_softmax``
    subtracts the maximum but gives ``inf - inf = NaN`` (value and gradient)
    where an input is ``+inf`` or all are ``-inf``. Same values as JAX for
    finite inputs; at those points this returns the limit along equal inputs,
    with the derivative ``t - sum(softmax(x) t)``. Masked entries are ``-inf``
    with a zero derivative.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> gk.stable.log_softmax(jnp.full(2, -jnp.inf)).tolist() == [-0.6931471824645996] * 2
      True
    """
    return log_softmax_op(x, where, axis=static_axis(axis))
