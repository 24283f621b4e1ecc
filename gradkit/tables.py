"""Ready rule tables: ``gk.override(f, gk.tables.SAFE)``; combine them with ``|``.

``SAFE``
  For every primitive whose derivative is infinite somewhere (sqrt, rsqrt,
  cbrt, log, log1p, div, rem, pow, integer_pow with negative powers, atan2,
  acos, asin, acosh, atanh, lgamma, digamma, erf_inv): JAX's own VJP,
  except that it is exactly 0 wherever the incoming cotangent is 0, computed
  at a harmless point, so ``0 * inf`` and ``0 * NaN`` never happen. This
  removes the NaN gradients of the guarded-function family
  (``jnp.where(x > 0, jnp.log(x), 0)``, the "double where" problem of JAX's
  FAQ) without the second ``where``. ``mul`` has a safe rule too (its
  derivative is the other operand: ``-inf`` in ``jnp.where(p > 0, p *
  jnp.log(p), 0)`` at 0) but is not in ``SAFE``, since it would wrap every
  multiplication of a model: add it with
  ``gk.tables.SAFE | gk.RuleTable.from_dict({"mul": "safe"})``, or use
  :func:`gradkit.stable.xlogy`.
  Where the cotangent is nonzero the formula is JAX's, operation for
  operation: compiled in one program (``jit(grad(...))``) the gradient of a
  function whose gradient was finite is bit-identical; when one value
  receives three or more cotangents they may be summed in another order
  (last-bit differences).

  What it does not fix:

  * a singularity the cotangent actually reaches: the gradient of ``sqrt`` at
    0 stays ``inf`` when the result is used (``jnp.linalg.norm(x)`` at
    ``x = 0`` is ``0 / 0`` after ``sqrt``: use :func:`gradkit.stable.safe_norm`);
  * overflow and cancellation inside a formula: ``log(1 + exp(x))`` at
    ``x = 100`` is ``inf`` forward and NaN backward whatever the primitives'
    rules (use :func:`gradkit.stable.log1pexp`, or ``STABLE`` on a named op).
    ``exp`` is deliberately not in SAFE: a zero cotangent reaching an
    overflowed ``exp`` is usually ``1/inf`` from downstream, not a mask, and
    zeroing it would turn the NaN into a wrong 0;
  * SAFE assumes a zero cotangent means "unused" (masked by ``where``,
    multiplied by 0). A cotangent that is 0 because a product underflowed
    gives 0 where the true gradient may not be: check with ``gk.audit``;
  * SAFE rules are reverse-mode rules (``jax.custom_vjp``): ``grad``, ``vjp``
    and reverse-over-reverse work; ``jvp``/``jacfwd`` through a matched op do not.

``STRAIGHT_THROUGH``
  ``round``, ``floor``, ``ceil``, ``sign``: the identity's derivative
  (straight-through estimator), as JVP rules (forward and reverse mode).

``STABLE``
  Every :mod:`gradkit.stable` op name mapped to its stable derivative (JVP
  rules), so a named op of that name (your own ``gk.op("log1pexp")``
  composite, say) gets the stable gradient; plus the JAX functions and
  primitives with an inaccurate derivative, by the name the dispatcher
  matches: ``logistic`` (``jax.nn.sigmoid``: ``s(1-s)`` → ``σ(x)σ(-x)``),
  ``softplus``, ``log_sigmoid``, ``silu`` (the ``jax.nn`` functions),
  ``logaddexp`` (``jnp.logaddexp``), ``xlogy``/``xlog1py``
  (``jax.scipy.special``), ``sinc``, ``hypot`` (``jnp``), ``tanh`` and
  ``expm1`` (primitives: ``(1+t)(1-t)`` and ``expm1(x)+1`` cancel).

Examples:
  >>> import jax, jax.numpy as jnp, gradkit as gk
  >>> f = lambda x: jnp.where(x > 0, jnp.log(x), 0.0)
  >>> float(jax.grad(f)(0.0)), float(jax.grad(gk.override(f, gk.tables.SAFE))(0.0))
  (nan, 0.0)
"""

from __future__ import annotations

from collections.abc import Mapping

from gradkit._src import library as _lib
from gradkit._src.table import RuleTable

__all__ = ["SAFE", "STABLE", "STRAIGHT_THROUGH", "library"]

SAFE: RuleTable = RuleTable({name: _lib.make_rule("safe", name) for name in _lib.SAFE_RULES if name != "mul"})

STRAIGHT_THROUGH: RuleTable = RuleTable(
    {name: _lib.make_rule("straight_through", name) for name in ("round", "floor", "ceil", "sign")})

STABLE: RuleTable = RuleTable({name: _lib.make_rule("stable", name) for name in _lib.STABLE_DOCS})


def library() -> Mapping[str, _lib.LibraryRule]:
    """The named rules a config can use, by name (each has ``name``, ``doc``, ``params``, ``signature()``).

    Examples:
      >>> import gradkit as gk
      >>> gk.tables.library()["clamped_log"].signature()
      'clamped_log(eps: float (optional))'
    """
    return dict(_lib.LIBRARY)


def describe(table: Mapping[str, object]) -> dict[str, str]:
    """One line per entry of a ready table: what its rule does (for docs and ``gradkit rules``).

    Examples:
      >>> import gradkit as gk
      >>> gk.tables.describe(gk.tables.SAFE)["log"]
      'safe: 1/x: inf at 0'
    """
    out = {}
    for name in table:
        if name in SAFE and table.get(name) is SAFE.get(name):
            out[name] = f"safe: {_lib.SAFE_DOCS[name]}"
        elif name in STABLE and table.get(name) is STABLE.get(name):
            out[name] = f"stable: {_lib.STABLE_DOCS[name]}"
        elif name in STRAIGHT_THROUGH and table.get(name) is STRAIGHT_THROUGH.get(name):
            out[name] = "straight_through: identity gradient"
        else:
            rule = table[name]
            out[name] = getattr(rule, "name", "") or type(rule).__name__
    return out
