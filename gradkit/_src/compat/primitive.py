"""gradkit's own primitive, ``safe_scale``: the masked product that makes SAFE rules serve every mode."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax
import numpy as np
from jax import lax as _lax
from jax._src import core as _core
from jax._src.interpreters import mlir as _mlir_src
from jax._src.lib.mlir import ir as _ir
from jax._src.lib.mlir.dialects import hlo as _hlo
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching
from jax.interpreters import mlir as _mlir
from jax.typing import ArrayLike, DTypeLike

from gradkit._src.compat.jaxprs import Primitive, ShapedArray
from gradkit._src.errors import GradkitError as _GradkitError

# =========================================================================== gradkit's own primitive: safe_scale
#
# ``safe_scale(t, d)`` is ``t * d`` (or ``t / d``), exactly 0 where ``t == 0``:
# the masked product that lets the SAFE rules be JVP rules. A ``custom_vjp``
# cannot sit inside a tangent (JAX has no transpose rule for
# ``custom_vjp_call``), and ``jnp.where(t == 0, 0, t * d)`` is not linear in
# ``t`` as JAX sees it, so the mask needs a primitive with its own transpose
# rule. Registering rules for a primitive gradkit defines is extension: no
# rule of JAX's own primitives is touched.


safe_scale_p: Primitive = Primitive("gradkit_safe_scale")

#: The primitives gradkit defines (and registers rules for); nothing else is registered.
OWN_PRIMITIVES: frozenset[Primitive] = frozenset({safe_scale_p})


def safe_scale(t: ArrayLike, d: ArrayLike, *, divide: bool = False, out_dtype: DTypeLike | None = None) -> jax.Array:
    """``t * d`` (``t / d`` with ``divide``), exactly 0 where ``t == 0``; linear in ``t``.

    ``t`` and ``d`` must have the same shape, and the same dtype unless
    ``out_dtype`` is given: then, as ``lax.mul``'s ``out_dtype``, both are
    converted to it first, and the transpose computes in ``t``'s dtype (as
    JAX's transpose of ``mul``). Where ``t`` is 0 the
    result is 0 whatever ``d`` is (``inf``, NaN), in value and at every order
    of differentiation; a product (not a quotient) is also 0 where ``d`` is 0
    and ``t`` is infinite or NaN. Elsewhere it is the plain product, bit for bit.
    """
    t, d = match_varying([t, d])
    out: jax.Array = safe_scale_p.bind(t, d, divide=bool(divide),
                                       out_dtype=None if out_dtype is None else np.dtype(out_dtype))
    return out


def _nonfinite(x: jax.Array) -> jax.Array:
    """``x`` is inf or NaN (real or complex: ``x - x`` is NaN exactly then)."""
    return _lax.ne(_lax.sub(x, x), _lax.full_like(x, 0))


def _masked_operands(t: jax.Array, d: jax.Array, divide: bool) -> tuple[jax.Array, jax.Array]:
    """The operands whose plain product (quotient) is the masked one.

    Product: ``0 * inf`` and ``inf * 0`` are both 0 (TensorFlow's
    ``multiply_no_nan`` convention, in both argument orders): an infinite or
    NaN factor is replaced by 0 where the other one is 0. So a singular
    derivative masked *after* it in reverse mode (``arccos(clip(y))``: the
    cotangent ``-inf`` meets clip's 0 mask) gives 0, as forward mode does where
    the mask comes first. Quotient: ``0 / d`` is 0 whatever ``d`` is (``d``
    replaced by 1 where it is 0 or not finite); ``t / 0`` is the singularity
    itself and stays, and so does ``inf / inf``: an infinite tangent over an
    infinite value is an overflow (``log1p(exp(200))``), not a mask.
    The operation on the masked operands is the plain one, and elsewhere they
    are the operands themselves, so the result is ``t * d``
    bit for bit, sign of zero included, and XLA fuses it (FMA contraction with
    a following add) exactly as it fuses JAX's own product.
    """
    zero = _lax.full_like(t, 0)
    t_zero = _lax.eq(t, zero)
    if divide:
        d_bad = _lax.bitwise_or(_lax.eq(d, zero), _nonfinite(d))
        return t, _lax.select(_lax.bitwise_and(t_zero, d_bad), _lax.full_like(d, 1), d)
    d_zero = _lax.eq(d, zero)
    t_out = _lax.select(_lax.bitwise_and(d_zero, _nonfinite(t)), zero, t)
    d_out = _lax.select(_lax.bitwise_and(t_zero, _nonfinite(d)), zero, d)
    return t_out, d_out


def _converted(x: jax.Array, dtype: np.dtype | None) -> jax.Array:
    """``x`` as ``dtype`` (``out_dtype``'s conversion of an operand; none without one)."""
    return x if dtype is None or x.dtype == dtype else _lax.convert_element_type(x, dtype)


def _safe_scale_value(t: jax.Array, d: jax.Array, *, divide: bool, out_dtype: np.dtype | None = None) -> jax.Array:
    tm, dm = _masked_operands(_converted(t, out_dtype), _converted(d, out_dtype), divide)
    return _lax.div(tm, dm) if divide else _lax.mul(tm, dm)


def _safe_scale_abstract_eval(t: ShapedArray, d: ShapedArray, *, divide: bool,
                              out_dtype: np.dtype | None) -> ShapedArray:
    if t.shape != d.shape or (t.dtype != d.dtype and out_dtype is None):
        raise _GradkitError(f"internal: safe_scale needs operands of one shape and dtype, got {t.str_short()} "
                            f"and {d.str_short()}; please report this with the function that triggered it.")
    # as lax's binary operations (mul with out_dtype: the result in that dtype)
    return t.update(dtype=t.dtype if out_dtype is None else out_dtype, weak_type=t.weak_type and d.weak_type)


def _safe_scale_jvp(primals: Sequence[jax.Array], tangents: Sequence[jax.Array | _ad.Zero], *,
                    divide: bool, out_dtype: np.dtype | None) -> tuple[jax.Array, jax.Array | _ad.Zero]:
    t, d = primals
    dt, dd = tangents
    out = safe_scale(t, d, divide=divide, out_dtype=out_dtype)
    terms = []
    if not isinstance(dt, _ad.Zero):
        terms.append(safe_scale(dt, d, divide=divide, out_dtype=out_dtype))
    if not isinstance(dd, _ad.Zero):
        # d(t*d)/dd = t, d(t/d)/dd = -t/d^2: both 0 where t == 0, and the term is
        # selected away there, so an inf or NaN tangent of d never leaks through.
        # Masked like the value: the term is 0 where the value is masked to 0
        # (on the operands as the value sees them: converted to out_dtype).
        t, d, dd = _converted(t, out_dtype), _converted(d, out_dtype), _converted(dd, out_dtype)
        coef = t if not divide else _lax.neg(safe_scale(safe_scale(t, d, divide=True), d, divide=True))
        zero = _lax.full_like(t, 0)
        dropped = _lax.eq(t, zero)
        if not divide:
            dropped = _lax.bitwise_or(dropped, _lax.bitwise_and(_lax.eq(d, zero), _nonfinite(t)))
        terms.append(_lax.select(dropped, _lax.full_like(dd, 0), _lax.mul(coef, dd)))
    if not terms:
        return out, _ad.Zero.from_primal_value(out)  # type: ignore[attr-defined]
    return out, terms[0] if len(terms) == 1 else _lax.add(terms[0], terms[1])


def _safe_scale_transpose(ct: jax.Array | _ad.Zero, t: _ad.UndefinedPrimal, d: jax.Array, *,
                          divide: bool, out_dtype: np.dtype | None) -> list[jax.Array | _ad.Zero | None]:
    if _ad.is_undefined_primal(d) or not _ad.is_undefined_primal(t):
        raise _GradkitError("internal: safe_scale is linear in its first operand only; please report this with "
                            "the function that triggered it.")
    if isinstance(ct, _ad.Zero):
        return [_ad.Zero(t.aval), None]
    # With out_dtype, as JAX's transpose of mul: the product in the operand's dtype (mul(ct, y, out_dtype=x.dtype)).
    return [safe_scale(ct, d, divide=divide, out_dtype=None if out_dtype is None else t.aval.dtype), None]


def _safe_scale_batch(args: Sequence[jax.Array], dims: Sequence[int | None], *,
                      divide: bool, out_dtype: np.dtype | None) -> tuple[jax.Array, int | None]:
    t, d = args
    bt, bd = dims
    if bt == bd:
        return safe_scale(t, d, divide=divide, out_dtype=out_dtype), bt
    if bt is not None:
        size = t.shape[bt]
    else:
        assert bd is not None  # bt != bd
        size = d.shape[bd]

    def front(x: jax.Array, b: int | None) -> jax.Array:
        if b is None:
            return _lax.broadcast(x, (size,))
        return jax.numpy.moveaxis(x, b, 0)

    return safe_scale(front(t, bt), front(d, bd), divide=divide, out_dtype=out_dtype), 0


# Inside shard_map, operands of one operation must vary over the same manual axes; JAX's lax wrappers
# insert the casts (pvary) themselves, and a program re-played equation by equation must too.
_auto_vary = getattr(_core, "auto_insert_reshard", None) or getattr(_core, "standard_insert_pvary", None)


def match_varying(args: Sequence[ArrayLike]) -> list[ArrayLike]:
    """``args`` cast to vary over the same ``shard_map`` axes, as JAX's lax wrappers do (no-op elsewhere)."""
    if _auto_vary is None or len(args) < 2:
        return list(args)
    return list(_auto_vary(*args))


safe_scale_p.def_impl(_safe_scale_value)
safe_scale_p.def_abstract_eval(_safe_scale_abstract_eval)
_ad.primitive_jvps[safe_scale_p] = _safe_scale_jvp
_ad.primitive_transposes[safe_scale_p] = _safe_scale_transpose
_batching.primitive_batchers[safe_scale_p] = _safe_scale_batch
# The lowering of the value for any dtype (complex ones among them): lax operations, traced per equation.
_lower_by_tracing = _mlir.lower_fun(_safe_scale_value, multiple_results=False)
# How JAX's own elementwise lowerings give their result its sharding (Explicit mesh axes): 0.9+ / 0.8.
_typed_result = getattr(_mlir_src, "lower_with_explicit_types", None) or _mlir_src.lower_with_sharding_in_types


def _safe_scale_lowering(ctx: _mlir_src.LoweringRuleContext, t: _ir.Value, d: _ir.Value, *,
                         divide: bool, out_dtype: np.dtype | None) -> Sequence[_ir.Value]:

    """StableHLO for a real ``safe_scale``: the masks of :func:`_safe_scale_value` as nested selects.

    Nothing is traced (``lower_fun`` traced the lax version again for every
    equation). Each mask is a ``select`` on the lax version's own comparison
    instead of a ``select`` on a conjunction: ``d`` becomes 0 where
    ``t == 0`` and then where ``d`` is not finite (``select(t == 0,
    select(is_finite(d), d, 0), d)``), ``t`` likewise with ``d == 0``; a
    quotient's ``d`` becomes 1 where ``t == 0`` and ``d`` is 0 or not finite.
    The comparisons are the lax version's ``==`` (XLA's CPU backend reads a
    subnormal as 0 there, and ``!=`` or other forms of the masks compile to
    instructions that do not), each select picks the operand the lax
    version picks, element for element, and the final ``multiply``/``divide``
    is the same operation on the same operands: the same bits, and XLA fuses
    it (FMA contraction with a following add) as it fuses JAX's own product.
    No ``not``/``and``/``or`` of predicates: nine operations for a product
    instead of eleven, six for a quotient instead of seven, fewer for XLA to
    fuse and compile where SAFE rules are many.
    Complex operands keep the lax version (``is_finite`` takes real values only).
    With ``out_dtype``, both operands are converted to it first, as ``lax.mul``
    lowers its ``out_dtype``.
    """
    aval = cast(ShapedArray, ctx.avals_out[0])  # JAX types avals abstractly; an array result's is shaped
    if not jax.numpy.issubdtype(aval.dtype, jax.numpy.floating):
        return _lower_by_tracing(ctx, t, d, divide=divide, out_dtype=out_dtype)
    if out_dtype is not None:
        ins = [cast(ShapedArray, a) for a in ctx.avals_in]
        t, d = (x if a.dtype == aval.dtype else _mlir_src.convert_hlo(ctx, x, a, a.update(dtype=aval.dtype))
                for x, a in zip((t, d), ins))
    zero = _mlir_src.full_like_aval(ctx, 0, aval)
    t_zero = _mlir_src.compare_hlo(t, zero, "EQ", "FLOAT")
    d_zero = _mlir_src.compare_hlo(d, zero, "EQ", "FLOAT")
    if divide:
        one = _mlir_src.full_like_aval(ctx, 1, aval)
        d_good = _hlo.select(d_zero, one, _hlo.select(_hlo.is_finite(d), d, one))  # d, or 1 where it is bad
        out = _hlo.divide(t, _hlo.select(t_zero, d_good, d))
    else:
        t_out = _hlo.select(d_zero, _hlo.select(_hlo.is_finite(t), t, zero), t)
        d_out = _hlo.select(t_zero, _hlo.select(_hlo.is_finite(d), d, zero), d)
        out = _hlo.multiply(t_out, d_out)
    return [_typed_result(ctx, out, ctx.avals_out[0])]


_mlir.register_lowering(safe_scale_p, _safe_scale_lowering)


# =========================================================================== gradkit's own primitive: masked_scale
#
# ``masked_scale(t, d, m)`` is ``t * d`` (or ``t / d``), exactly 0 where the boolean ``m`` is true: the
# product of a tangent by a primal factor on a path that dataflow found masked (SAFE). The mask is an
# operand, not a property of ``t``: a tangent that is 0 by value (2y at y = 0) is multiplied as JAX
# multiplies it. Linear in ``t``; the transpose is masked by the same ``m``, and so is the derivative
# in ``d`` (at every order the masked elements stay exactly 0).

masked_scale_p: Primitive = Primitive("gradkit_masked_scale")
OWN_PRIMITIVES = frozenset({safe_scale_p, masked_scale_p})


def masked_scale(t: ArrayLike, d: ArrayLike, m: ArrayLike, *, divide: bool = False,
                 out_dtype: DTypeLike | None = None) -> jax.Array:
    """``t * d`` (``t / d`` with ``divide``), exactly 0 where ``m`` is true; linear in ``t``.

    ``t``, ``d`` and the boolean ``m`` have one shape; ``out_dtype`` as in
    :func:`safe_scale`. Where ``m`` is false the result is the plain product
    bit for bit (the operands are selected, then multiplied: XLA fuses the
    product as it fuses JAX's own).
    """
    t, d, m = match_varying([t, d, m])
    out: jax.Array = masked_scale_p.bind(t, d, m, divide=bool(divide),
                                         out_dtype=None if out_dtype is None else np.dtype(out_dtype))
    return out


def _masked_value(t: jax.Array, d: jax.Array, m: jax.Array, *, divide: bool,
                  out_dtype: np.dtype | None = None) -> jax.Array:
    t, d = _converted(t, out_dtype), _converted(d, out_dtype)
    zero = _lax.full_like(t, 0)
    tm = _lax.select(m, zero, t)
    dm = _lax.select(m, _lax.full_like(d, 1 if divide else 0), d)
    return _lax.div(tm, dm) if divide else _lax.mul(tm, dm)


def _masked_abstract_eval(t: ShapedArray, d: ShapedArray, m: ShapedArray, *, divide: bool,
                          out_dtype: np.dtype | None) -> ShapedArray:
    if t.shape != d.shape or m.shape != t.shape or (t.dtype != d.dtype and out_dtype is None):
        raise _GradkitError(f"internal: masked_scale needs operands of one shape and dtype, got {t.str_short()}, "
                            f"{d.str_short()} and {m.str_short()}; please report this with the function that "
                            "triggered it.")
    return t.update(dtype=t.dtype if out_dtype is None else out_dtype, weak_type=t.weak_type and d.weak_type)


def _masked_jvp(primals: Sequence[jax.Array], tangents: Sequence[jax.Array | _ad.Zero], *,
                divide: bool, out_dtype: np.dtype | None) -> tuple[jax.Array, jax.Array | _ad.Zero]:
    t, d, m = primals
    dt, dd, _ = tangents
    out = masked_scale(t, d, m, divide=divide, out_dtype=out_dtype)
    terms = []
    if not isinstance(dt, _ad.Zero):
        terms.append(masked_scale(dt, d, m, divide=divide, out_dtype=out_dtype))
    if not isinstance(dd, _ad.Zero):
        # d(t*d)/dd = t, d(t/d)/dd = -t/d^2: masked like the value, so a masked element stays 0
        t, d, dd = _converted(t, out_dtype), _converted(d, out_dtype), _converted(dd, out_dtype)
        if divide:
            coef = _lax.neg(masked_scale(masked_scale(t, d, m, divide=True), d, m, divide=True))
        else:
            coef = t
        terms.append(masked_scale(dd, coef, m))
    if not terms:
        return out, _ad.Zero.from_primal_value(out)  # type: ignore[attr-defined]
    return out, terms[0] if len(terms) == 1 else _lax.add(terms[0], terms[1])


def _masked_transpose(ct: jax.Array | _ad.Zero, t: _ad.UndefinedPrimal, d: jax.Array, m: jax.Array, *,
                      divide: bool, out_dtype: np.dtype | None) -> list[jax.Array | _ad.Zero | None]:
    if _ad.is_undefined_primal(d) or _ad.is_undefined_primal(m) or not _ad.is_undefined_primal(t):
        raise _GradkitError("internal: masked_scale is linear in its first operand only; please report this with "
                            "the function that triggered it.")
    if isinstance(ct, _ad.Zero):
        return [_ad.Zero(t.aval), None, None]
    return [masked_scale(ct, d, m, divide=divide, out_dtype=None if out_dtype is None else t.aval.dtype), None, None]


def _masked_batch(args: Sequence[jax.Array], dims: Sequence[int | None], *,
                  divide: bool, out_dtype: np.dtype | None) -> tuple[jax.Array, int | None]:
    if len(set(dims)) == 1:
        return masked_scale(*args, divide=divide, out_dtype=out_dtype), dims[0]
    size = next(x.shape[b] for x, b in zip(args, dims) if b is not None)

    def front(x: jax.Array, b: int | None) -> jax.Array:
        return _lax.broadcast(x, (size,)) if b is None else jax.numpy.moveaxis(x, b, 0)

    t, d, m = (front(x, b) for x, b in zip(args, dims))
    return masked_scale(t, d, m, divide=divide, out_dtype=out_dtype), 0


masked_scale_p.def_impl(_masked_value)
masked_scale_p.def_abstract_eval(_masked_abstract_eval)
_ad.primitive_jvps[masked_scale_p] = _masked_jvp
_ad.primitive_transposes[masked_scale_p] = _masked_transpose
_batching.primitive_batchers[masked_scale_p] = _masked_batch
_mlir.register_lowering(masked_scale_p, _mlir.lower_fun(_masked_value, multiple_results=False))
