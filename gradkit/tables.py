"""Ready rule tables: ``gk.override(f, gk.tables.SAFE)``; combine them with ``|``.

Every rule in these tables is a JVP rule: forward mode (``jax.jvp``,
``jacfwd``), reverse mode (``grad``, ``vjp``, ``jacrev``: JAX transposes the
rule), ``hessian`` and every higher order go through it, under ``jit`` and
``vmap`` too. ``SAFE``, ``STABLE`` and ``STRAIGHT_THROUGH`` target JAX
primitives only, so they change nothing but the derivative of those primitives
wherever a program uses them; ``STABLE_FUNCTIONS`` is opt-in and matches
functions by name.

``SAFE``
  For every primitive whose derivative is infinite somewhere (sqrt, rsqrt,
  cbrt, log, log1p, div, rem, pow, integer_pow, atan2, acos, asin, acosh,
  atanh, lgamma, digamma, erf_inv): JAX's own derivative, except that it is
  exactly 0 wherever the incoming tangent (forward mode) or cotangent
  (reverse mode) is 0, so ``0 * inf`` and ``0 * NaN`` never happen, at any
  order. This removes the NaN gradients of the guarded-function family
  (``jnp.where(x > 0, jnp.log(x), 0)``, the "double where" problem of JAX's
  FAQ) without the second ``where``. ``mul`` has a safe rule too (its
  derivative is the other operand: ``-inf`` in ``jnp.where(p > 0, p *
  jnp.log(p), 0)`` at 0) but is not in ``SAFE``, since it would wrap every
  multiplication of a model: add it with ``gk.tables.SAFE | {"mul": "safe"}``,
  or use :func:`gradkit.stable.xlogy`.
  Where the (co)tangent is nonzero the arithmetic is JAX's, operation for
  operation (gradkit replays JAX's own rule of the installed version), so in
  reverse mode a gradient that was finite is unchanged: compiled in one
  program (``jit(grad(...))``) it is bit-identical for a unit cotangent; with
  other cotangents, or when one value receives three or more cotangents, XLA
  may fuse or sum differently (last-bit differences).

  What it does not fix:

  * a singularity the (co)tangent actually reaches: the gradient of ``sqrt``
    at 0 stays ``inf`` when the result is used (``jnp.linalg.norm(x)`` at
    ``x = 0`` is ``0 / 0`` after ``sqrt``: use :func:`gradkit.stable.safe_norm`);
  * overflow and cancellation inside a formula: ``log(1 + exp(x))`` at
    ``x = 100`` is ``inf`` forward and NaN backward whatever the primitives'
    rules (use :func:`gradkit.stable.log1pexp`, or ``STABLE_FUNCTIONS`` on a
    named op). ``exp`` is deliberately not in SAFE: a zero cotangent reaching
    an overflowed ``exp`` is usually ``1/inf`` from downstream, not a mask,
    and zeroing it would turn the NaN into a wrong 0;
  * SAFE assumes a zero (co)tangent means "unused" (masked by ``where``,
    multiplied by 0, a zero direction of ``jacfwd``). A cotangent that is 0
    because a product underflowed gives 0 where the true gradient may not be:
    check with ``gk.audit``.

``STRAIGHT_THROUGH``
  ``round``, ``floor``, ``ceil``, ``sign``: the identity's derivative
  (straight-through estimator). It does not make the forward pass
  differentiable: the value is still the rounded one.

``STABLE``
  The primitives whose JAX derivative is inaccurate, with an accurate one:
  ``logistic`` (``jax.nn.sigmoid``: ``s(1-s)`` → ``σ(x)σ(-x)``, which does
  not round to 0 at ``x = 20``), ``tanh`` (``(1+t)(1-t)`` cancels) and
  ``expm1`` (``expm1(x) + 1`` cancels). It does not change a value, and
  cannot fix a formula that overflows before the primitive (see
  ``STABLE_FUNCTIONS`` and :mod:`gradkit.stable`).

``STABLE_FUNCTIONS`` (opt-in)
  Functions matched by name, given the derivative of their
  :mod:`gradkit.stable` twin: every :mod:`gradkit.stable` op name
  (``log1pexp``, ``logsumexp``, ``safe_norm``, …), so a named op of that name
  (your own ``gk.op("log1pexp")`` composite, say) gets the stable gradient;
  and ``"fn:<name>"`` keys for the JAX functions whose derivative overflows
  or cancels: ``fn:softplus``, ``fn:log_sigmoid``, ``fn:silu``
  (``jax.nn``), ``fn:logaddexp`` (``jnp.logaddexp``), ``fn:xlogy``,
  ``fn:xlog1py`` (``jax.scipy.special``), ``fn:sinc``, ``fn:hypot``
  (``jnp``). A ``"fn:"`` key matches *any* jitted or ``custom_jvp``/
  ``custom_vjp`` function of that Python name, your own included: a function
  of yours called ``softplus`` gets softplus's derivative, whatever it
  computes. ``jax.nn.logsumexp`` and ``jax.nn.softmax`` are inlined by JAX
  (no function to match): use :func:`gradkit.stable.logsumexp` and
  :func:`gradkit.stable.softmax`. Only the derivative changes: the value is
  still the original function's (``jax.nn.softplus(1000.0)`` is finite, but a
  naive ``log(1 + exp(x))`` op stays ``inf``).

``F32_BACKWARD`` (for bfloat16 / float16 models)
  The derivatives of ``jax.nn.log_softmax`` and ``jax.nn.standardize`` (layer
  norm) whole, of ``exp``, ``log``, ``rsqrt``, ``tanh``, ``logistic`` and
  ``add``, and of any jitted function named ``softmax`` or ``logsumexp``,
  computed in float32 from the op's inputs and cast back; the forward pass is
  unchanged, bit for bit. Use it when a low-precision model trains on
  confident predictions: a cross-entropy's ``p - 1`` at ``p ~ 1`` keeps its
  bits, and a bias gradient is summed over the batch in float32. It cannot
  remove the forward pass's own rounding (bf16 logits), which bounds the
  gain: ``benchmarks/bench_f32_backward.py`` measures about 8x lower error
  than plain bf16 autodiff against float64 on its classifier and transformer
  block, at no extra step time on CPU. A program already in float32 is
  unchanged. :func:`upcast_backward` makes such a table for other ops.

Examples:
  >>> import jax, jax.numpy as jnp, gradkit as gk
  >>> f = lambda x: jnp.where(x > 0, jnp.log(x), 0.0)
  >>> float(jax.grad(f)(0.0)), float(jax.grad(gk.override(f, gk.tables.SAFE))(0.0))
  (nan, 0.0)
  >>> float(jax.jacfwd(gk.override(f, gk.tables.SAFE))(0.0))  # forward mode too
  0.0
  >>> g = gk.override(lambda x: jax.nn.softplus(x), gk.tables.STABLE_FUNCTIONS)
  >>> float(jax.hessian(g)(0.0))
  0.25
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as _jnp

from gradkit._src import library as _lib
from gradkit._src import upcast_rules as _up
from gradkit._src.table import RuleTable

__all__ = ["F32_BACKWARD", "SAFE", "STABLE", "STABLE_FUNCTIONS", "STRAIGHT_THROUGH", "describe", "library",
           "upcast_backward"]

SAFE: RuleTable = RuleTable(_lib.ready_table("safe", "SAFE"))

STRAIGHT_THROUGH: RuleTable = RuleTable(
    {name: _lib.make_rule("straight_through", name) for name in ("round", "floor", "ceil", "sign")})

STABLE: RuleTable = RuleTable(_lib.ready_table("stable", "STABLE"))

STABLE_FUNCTIONS: RuleTable = RuleTable(_lib.ready_table("stable", "STABLE_FUNCTIONS"))


# Chosen by measurement: benchmarks/bench_f32_backward.py --ablation (see the module docstring). "add":
# an add that broadcasts a bias sums its cotangent over the batch, in bfloat16 unless upcast.
_F32_BACKWARD_OPS = ("fn:log_softmax", "fn:logsumexp", "fn:softmax", "fn:standardize", "exp", "log", "rsqrt",
                     "tanh", "logistic", "add")


def upcast_backward(*op_names: str, dtype: Any = _jnp.float32) -> RuleTable:
    """A table computing the named ops' derivatives in ``dtype`` (float32) for low-precision programs.

    Each rule upcasts the op's inputs and tangents, re-evaluates the op in
    ``dtype`` (a primitive, or the program of a ``jax.jit``/``custom_jvp``
    function keyed ``"fn:<name>"``), takes JAX's derivative there and casts the
    tangent back to the op's dtype. The forward pass is unchanged, bit for
    bit; every mode (``grad``, ``jvp``, ``jacfwd``, ``hessian``) goes through
    the rules. Ops whose inputs are already ``dtype`` or wider are
    differentiated as before (in their own precision).

    Args:
      *op_names: primitive names (``"exp"``, ``"tanh"``) and ``"fn:<name>"``
        keys of jitted functions (``"fn:log_softmax"``).
      dtype: the precision of the derivative: ``jnp.float32`` (default) or ``jnp.float64``.

    Returns:
      A :class:`~gradkit.RuleTable`; combine it with others with ``|``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> f = lambda x: jnp.tanh(x)
      >>> x = jnp.bfloat16(3.0)
      >>> float(jax.grad(f)(x)), float(jax.grad(gk.override(f, gk.tables.upcast_backward("tanh")))(x))
      (0.0078125, 0.0098876953125)
    """
    return RuleTable(_up.upcast_table(list(op_names), dtype))


F32_BACKWARD: RuleTable = upcast_backward(*_F32_BACKWARD_OPS)


def library() -> Mapping[str, _lib.LibraryRule]:
    """The named rules a config can use, by name (each has ``name``, ``doc``, ``params``, ``signature()``).

    Examples:
      >>> import gradkit as gk
      >>> gk.tables.library()["clamped_log"].signature()
      'clamped_log(eps: float (optional))'
    """
    return dict(_lib.LIBRARY)


def describe(table: Mapping[str, object]) -> dict[str, str]:
    """One line per entry of a table: what its rule does (for docs and ``gradkit rules``).

    Examples:
      >>> import gradkit as gk
      >>> gk.tables.describe(gk.tables.SAFE)["log"]
      'safe: 1/x: inf at 0'
      >>> gk.tables.describe(gk.tables.STABLE_FUNCTIONS)["fn:softplus"]
      "stable: jax.nn.softplus / gk.op('softplus'): d = sigmoid(x)"
    """
    table = table if isinstance(table, RuleTable) else RuleTable(table)
    out = {}
    for name, rule in table.items():
        key = rule.key
        if len(key) == 3 and key[0] == "gradkit" and key[1] in _lib.LIBRARY:
            params = dict(key[2])
            family = _lib.FAMILIES.get(key[1])
            if family is not None and params.get("op") in family:
                out[name] = f"{key[1]}: {family[params['op']].doc}"
            elif key[1] == "straight_through":
                out[name] = "straight_through: identity gradient"
            else:
                args = ", ".join(f"{k}={v!r}" for k, v in params.items())
                out[name] = f"{key[1]}({args}): {_lib.LIBRARY[key[1]].doc}" if args else \
                    f"{key[1]}: {_lib.LIBRARY[key[1]].doc}"
        else:
            out[name] = rule.name or type(rule).__name__
    return out
