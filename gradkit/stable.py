"""Stable functions: correct, finite gradients wherever the true derivative is finite.

Every function here is a named op (:func:`gradkit.op`), so a rule table can
target it by name, built around a ``jax.custom_jvp``, so forward mode,
``jax.hessian`` and every higher order work. Derivatives are written with
accurate kernels (``gradkit/_src/stable/numerics.py``): on XLA:CPU the elementwise
gradients have no non-finite value where the true derivative is finite, and
are within 2 ULP over the whole float32 range (sinc' next to its zeros
included), float64 too, except ``safe_pow`` in two bands a factor of 2 wide
where its power under- or overflows (up to 2.5 ULP). Where a derivative is a
small difference of large terms, or a quotient that a rounded ``exp`` or
``1 + e`` would spoil, it is computed as a value plus its rounding error
(error-free sums and products) and rounded once. ``benchmarks/accuracy.py``
measures all of them against mpmath.

Each docstring gives the naive formula, where it (or its gradient) breaks,
and what the function does there. Conventions at points where the true
derivative is infinite or undefined (``safe_*``, ``normalize`` at 0, …) are
stated per function.

Examples:
  >>> import jax, gradkit as gk
  >>> float(jax.grad(gk.stable.log1pexp)(100.0))
  1.0
"""

from gradkit._src.stable import hypot as hypot
from gradkit._src.stable import log1mexp as log1mexp
from gradkit._src.stable import log1pexp as log1pexp
from gradkit._src.stable import log_cosh as log_cosh
from gradkit._src.stable import log_sigmoid as log_sigmoid
from gradkit._src.stable import log_softmax as log_softmax
from gradkit._src.stable import log_sub_exp as log_sub_exp
from gradkit._src.stable import logaddexp as logaddexp
from gradkit._src.stable import logsumexp as logsumexp
from gradkit._src.stable import normalize as normalize
from gradkit._src.stable import safe_arccos as safe_arccos
from gradkit._src.stable import safe_arcsin as safe_arcsin
from gradkit._src.stable import safe_arctan2 as safe_arctan2
from gradkit._src.stable import safe_div as safe_div
from gradkit._src.stable import safe_log as safe_log
from gradkit._src.stable import safe_norm as safe_norm
from gradkit._src.stable import safe_pow as safe_pow
from gradkit._src.stable import safe_sqrt as safe_sqrt
from gradkit._src.stable import sigmoid as sigmoid
from gradkit._src.stable import silu as silu
from gradkit._src.stable import sinc as sinc
from gradkit._src.stable import softmax as softmax
from gradkit._src.stable import softplus as softplus
from gradkit._src.stable import softplus_inverse as softplus_inverse
from gradkit._src.stable import xlog1py as xlog1py
from gradkit._src.stable import xlogy as xlogy

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
