"""sinc and its derivatives of every order."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import numerics as _k
from gradkit._src.named import op as _op

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


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def sinc_derivative(k: int, x: jax.Array) -> jax.Array:
    """The ``k``-th derivative of ``sinc(x) = sin(pi x)/(pi x)``, correct at every order.

    A Maclaurin series on ``|x| < 1`` (where the closed form cancels), the
    Leibniz expansion of ``sin(pi x) * (pi x)^-1`` elsewhere.
    """
    return _k._lowp(functools.partial(_sinc_derivative, k))(x)


def _sinc_derivative(k: int, x: jax.Array) -> jax.Array:
    a = jnp.abs(x)
    # The closed forms cancel near 0 from k = 1 on; the series cancels near the
    # first zero of sinc at 1. Value: series only next to 0; first derivative:
    # series on |x| < 0.5, where both are well conditioned.
    cut = 1e-2 if k == 0 else 0.5 if k == 1 else _SINC_CUT
    small = a < cut
    # The closed form's input: orders 0 and 1 guard it alike (it is finite
    # from 1e-2 on), so a value and its derivative share sinpi, cospi and the
    # quotient sin(pi x) / (pi x).
    guard = small if k > 1 else a < 1e-2
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
    xb = jnp.where(guard | inf, 1.0, x)
    pix = np.pi * xb
    sp, cp = _k.sinpi(xb), _k.cospi(xb)
    phases = [sp, cp, -sp, -cp]
    total = jnp.zeros_like(x)
    inv = 1.0 / xb
    if k == 0:
        big = sp / pix
    elif k == 1:
        big = (cp - sp / pix) * inv
    else:
        for j in range(k + 1):
            m = k - j  # derivative order of (pi x)^-1: (-1)^m m! / (pi x^(m+1))
            coef = math.comb(k, j) * math.pi ** j * (-1) ** m * math.factorial(m) / math.pi
            total = total + coef * phases[j % 4] * inv ** (m + 1)
        big = total
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
    return sinc_derivative(0, x)
