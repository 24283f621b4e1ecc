"""Ready rule tables: ``gk.override(f, gk.tables.SAFE)``; combine them with ``|``.

Every rule in these tables is a JVP rule: forward mode (``jax.jvp``,
``jacfwd``), reverse mode (``grad``, ``vjp``, ``jacrev``: JAX transposes the
rule), ``hessian`` and every higher order go through it, under ``jit`` and
``vmap`` too. ``SAFE``, ``STABLE``, ``STRAIGHT_THROUGH`` and ``BROADENED``
target JAX primitives only, so they change nothing but the derivative of those
primitives wherever a program uses them; ``STABLE_FUNCTIONS`` is opt-in and
matches functions by name.

``SAFE``
  For every primitive whose derivative is infinite somewhere (sqrt, rsqrt,
  cbrt, log, log1p, div, rem, pow, integer_pow, atan2, acos, asin, acosh,
  atanh, lgamma, digamma, erf_inv) and every elementwise product or mask
  (mul, square, max, min, reduce_max, reduce_min): JAX's own derivative,
  except that each of its products is 0 wherever one factor is 0 and the
  other infinite — ``0 * inf`` is 0, in both orders, at any order of
  differentiation. So wherever the function's value is finite, ``jax.grad``,
  ``jacrev``, ``jacfwd`` and ``jvp`` give one answer: a derivative masked *before* the singular op
  in forward mode (``jnp.where(x > 0, jnp.log(x), 0)``, the "double where"
  problem of JAX's FAQ) and one masked *after* it in reverse mode
  (``arccos(clip(y))``, ``sqrt(sum(x ** 2))`` at 0, ``pow(d2, 0.5)`` of a
  zero distance, ``sqrt(x) * mask``) are both 0. The line: the masks are
  elementwise (``where``/``select``, ``clip``, ``maximum``/``minimum``,
  ``relu``, ``abs``, a product); a mask applied by a matrix product
  (``dot_general``) or a derivative that overflows is not covered.
  Elsewhere the arithmetic is JAX's, operation for operation and in JAX's
  order (gradkit replays JAX's own rule of the installed version, and masks
  the operands of each product rather than its result, so XLA fuses it as it
  fuses JAX's): a gradient that was finite is unchanged, and a compiled
  ``jit(grad(...))`` or ``jit(jvp(...))`` is bit-identical to JAX's; when one
  value receives three or more cotangents, XLA may sum them in another order,
  and where XLA's simplifier merges two of JAX's own quotients (JAX 0.8's
  ``atanh``') SAFE keeps them apart (last-bit differences). So do a ``jvp``
  that sums two products (``atan2``, ``div`` with both operands varying: XLA
  fuses one of them with the sum into a multiply-add, and which one depends
  on the program) and a quotient by an operand broadcast along a size-1
  dimension (XLA computes JAX's as a product by the reciprocal). Every
  signature of the primitives is served: ``lax.mul``'s ``out_dtype`` with
  mixed operand dtypes (its derivative computed in the dtypes JAX's is),
  weak types, broadcasting operands, integer operands.

  What it does not fix:

  * a singularity the (co)tangent actually reaches: the gradient of ``sqrt``
    at 0 stays ``inf`` when the result is used, in every mode (``sqrt(|x|)``
    at 0; for a norm, :func:`gradkit.stable.safe_norm` is accurate near 0 too);
  * overflow and cancellation inside a formula: ``log(1 + exp(x))`` at
    ``x = 100`` is ``inf`` forward and NaN backward whatever the primitives'
    rules (use :func:`gradkit.stable.log1pexp`, or ``STABLE_FUNCTIONS`` on a
    named op). ``exp`` is deliberately not in SAFE: a zero cotangent reaching
    an overflowed ``exp`` is usually ``1/inf`` from downstream, not a mask,
    and zeroing it would turn the NaN into a wrong 0;
  * second derivatives at a point where the first exists only because a
    singularity was masked (the Hessian of a norm at the zero vector, whose
    true value is infinite): ``jax.hessian`` (forward over reverse) gives 0,
    reverse over reverse NaN, forward over forward ``inf``;
  * SAFE assumes a zero (co)tangent means "unused" (masked by ``where``,
    multiplied by 0, a zero direction of ``jacfwd``). A cotangent that is 0
    because a product underflowed gives 0 where the true gradient may not be:
    check with ``gk.audit``.

Opt-in ``{"exp": "safe", "dot_general": "safe"}`` (fully masked softmax rows)
  A softmax over a row whose scores are all ``-inf`` (``jnp.where(mask,
  scores, -jnp.inf)`` with a row fully masked) is NaN in the forward pass: its
  max shift computes ``-inf - (-inf)``. A loss that drops the row with a
  ``where`` is finite and so is its true gradient, but JAX's is NaN: the
  backward multiplies the NaN row by its zero cotangent in ``exp``'s
  derivative and in the product with V (``p @ v``: V's cotangent is
  ``p^T g``). These two rules, not in any ready table, give those products 0:
  ``exp`` where its value is NaN (an overflow's ``0 * inf`` stays NaN), and
  ``dot_general`` (``@``, ``einsum``) for a row that is non-finite along the
  whole contraction, where the (co)tangent it meets is 0. Elsewhere they are
  JAX's derivative (XLA may round the last bit differently).
  ``gk.override(loss, gk.tables.SAFE | {"exp": "safe", "dot_general": "safe"})``
  fixes it with no code change (``gk.audit`` finds and verifies it). A loss
  that multiplies the NaN row by 0 has a NaN value (``NaN * 0``): no rule
  fixes that; mask with ``jnp.finfo(dtype).min`` or ``jax.nn.softmax(scores,
  where=mask)``, and drop rows with ``jnp.where``.

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

``BROADENED`` (for repeated eigenvalues and singular values)
  ``eigh`` and ``svd`` (``jnp.linalg.eigh``, ``eigvalsh``, ``svd``,
  ``jax.scipy.linalg.polar(method="svd")``, …): JAX's derivative with every
  ``1/gap`` factor (``1/(w_j - w_i)``; ``1/(s_j - s_i)`` and ``1/s``) replaced
  by its Lorentzian broadening ``x / (x^2 + eps * scale^2)``, the technique of
  differentiable tensor-network codes. Where the spectrum is separated it is
  JAX's gradient (relative bias ``eps / gap^2``); at a repeated eigenvalue
  or singular value, where JAX's is ``inf`` or NaN, it is finite. ``eps`` is
  relative to the spectrum's scale (``max |w|``, the largest singular value),
  so one value serves a matrix of any norm: 1e-12 in float64, 1e-9 in float32
  (:func:`broadened` sets it). ``svd`` broadens only ``1/(s_j - s_i)`` of
  JAX's ``1/(s_j^2 - s_i^2)``, keeping ``1/(s_j + s_i)`` exact, so the
  rotation between ``U`` and ``V`` keeps its true derivative. It also
  differentiates ``full_matrices=True`` for non-square matrices, which JAX
  refuses (the extra columns in the gauge ``U_perp^T dU_perp = 0``).

  At a degeneracy the first derivative is the true gradient where the loss
  depends on each cluster of equal eigenvalues (singular values) only
  through what does not change inside it: the spectrum alone
  (``sum(f(w))``, ``jnp.linalg.norm(a, 2)``), the projector onto a *whole*
  cluster (``V_S V_S^T``, a subspace overlap, any contraction invariant under
  rotations inside the cluster), the polar factor ``U V^T``. It is finite
  but *not* the true gradient where the loss weights a cluster's vectors by
  functions of its values: a matrix function ``V f(w) V^T`` or a
  reconstruction ``U S V^T`` (the true derivative has ``f'(w)`` inside the
  cluster, which the broadening drops: differentiate the matrix function
  itself, ``jax.scipy.linalg.expm``, a polynomial, or the matrix); nor are
  second and higher derivatives at a degeneracy, for any loss (the first
  derivative is itself weighted by the cluster's values). Single vectors of
  a cluster have no derivative at all. Real inputs only; complex inputs and
  ``subset_by_index`` raise a ``[gradkit]`` error.

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

from gradkit._src.rules.tables import BROADENED as BROADENED
from gradkit._src.rules.tables import F32_BACKWARD as F32_BACKWARD
from gradkit._src.rules.tables import SAFE as SAFE
from gradkit._src.rules.tables import STABLE as STABLE
from gradkit._src.rules.tables import STABLE_FUNCTIONS as STABLE_FUNCTIONS
from gradkit._src.rules.tables import STRAIGHT_THROUGH as STRAIGHT_THROUGH
from gradkit._src.rules.tables import broadened as broadened
from gradkit._src.rules.tables import describe as describe
from gradkit._src.rules.tables import library as library
from gradkit._src.rules.tables import upcast_backward as upcast_backward

__all__ = [
    "BROADENED",
    "F32_BACKWARD",
    "SAFE",
    "STABLE",
    "STABLE_FUNCTIONS",
    "STRAIGHT_THROUGH",
    "broadened",
    "describe",
    "library",
    "upcast_backward",
]
