"""Gradient estimators: straight-through, clipping, scaling, reversal, and a tap.

Each function is the identity (or the quantizer) in the forward pass and
changes only what flows backward. They are plain functions you call inside
your model, the local counterpart of a rule table:

* straight-through estimators (:func:`ste_round`, :func:`ste_floor`,
  :func:`ste_ceil`, :func:`ste_sign`, :func:`straight_through` for your own
  quantizer): the forward value is exactly the quantized value, the
  derivative is the identity. Built with ``jax.custom_jvp`` (not the
  ``x + stop_gradient(q(x) - x)`` trick, whose value ``x + (q - x)`` can
  differ from ``q`` in the last bit), so forward mode and higher orders work.
* :func:`clip_gradient`, :func:`scale_gradient`, :func:`reverse_gradient`:
  identity forward; the cotangent is clipped, scaled or negated. Scales may
  be traced arrays, so a schedule (e.g. :func:`dann_schedule`) changes them
  without recompiling.
* :func:`tap`: identity forward; the backward pass hands the cotangent to a
  host callback (JAX has no ``register_hook``).

Examples:
  >>> import jax, jax.numpy as jnp
  >>> from gradkit import estimators as est
  >>> float(est.ste_round(1.7)), float(jax.grad(est.ste_round)(1.7))
  (2.0, 1.0)
"""

from gradkit._src.rules.estimators import clip_gradient as clip_gradient
from gradkit._src.rules.estimators import dann_schedule as dann_schedule
from gradkit._src.rules.estimators import reverse_gradient as reverse_gradient
from gradkit._src.rules.estimators import scale_gradient as scale_gradient
from gradkit._src.rules.estimators import ste_ceil as ste_ceil
from gradkit._src.rules.estimators import ste_floor as ste_floor
from gradkit._src.rules.estimators import ste_round as ste_round
from gradkit._src.rules.estimators import ste_sign as ste_sign
from gradkit._src.rules.estimators import straight_through as straight_through
from gradkit._src.rules.estimators import tap as tap

__all__ = [
    "clip_gradient",
    "dann_schedule",
    "reverse_gradient",
    "scale_gradient",
    "ste_ceil",
    "ste_floor",
    "ste_round",
    "ste_sign",
    "straight_through",
    "tap",
]
