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

from gradkit._src.stable import *  # noqa: F403  (the public names: exactly those in __all__)
from gradkit._src.stable import __all__ as __all__
