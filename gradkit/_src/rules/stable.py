"""The machinery of the STABLE rules, and an op's own derivative for the generic rules.

A STABLE rule is a JVP rule that differentiates a stable function (a
:mod:`gradkit.stable` function or a numerics kernel, each a ``jax.custom_jvp``)
at the matched op's inputs, so forward mode, reverse mode (by transposition)
and every higher order use the stable derivative.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from gradkit._src import compat
from gradkit._src.core.rule import JvpRuleFn, OpView, Tangents
from gradkit._src.errors import GradkitError
from gradkit._src.stable import numerics as _k


def is_foreign_jit(op: OpView) -> bool:
    """A ``jax.jit``-ed function matched by name (not a gradkit named op): its params are jit's."""
    return compat.is_jaxpr(op.params.get("jaxpr"))


def _custom_call_consts(op: OpView) -> int:
    """How many leading inputs of a matched ``custom_jvp``/``custom_vjp`` call are closed-over constants."""
    if "call_jaxpr" in op.params or "fun_jaxpr" in op.params:
        return int(op.params.get("num_consts", 0) or 0)
    return 0


def _is_custom_jvp_call(op: OpView) -> bool:
    """A ``jax.custom_jvp`` function matched by name (``fn:logaddexp``): its params are the call's."""
    return "call_jaxpr" in op.params and "jvp_jaxpr_fun" in op.params


def op_function(op: OpView, rule_name: str) -> Callable[..., jax.Array | tuple[jax.Array, ...]]:
    """The matched op as a function of its inputs, to get its own (JAX) derivative.

    Available for primitives, ``jax.jit``-ed functions matched by name and
    ``jax.custom_jvp`` functions matched by name (their own rule is their derivative).
    """
    params = dict(op.params)
    if is_foreign_jit(op):
        closed = params["jaxpr"]

        def fun(*xs: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
            out = compat.eval_jaxpr(closed, xs)
            return out[0] if len(out) == 1 else tuple(out)

        return fun
    prim = compat.primitive_by_name("custom_jvp_call" if _is_custom_jvp_call(op) else op.name)
    if prim is None:
        raise GradkitError(
            f"rule {rule_name} for op '{op.name}' at {op.source} needs the op's own derivative, which gradkit "
            "can rebuild only for JAX primitives and jax.jit-ed functions matched by name. For a gk.op or a "
            "custom_jvp function, write the rule with gk.jvp_rule / gk.vjp_rule, or wrap the call site with "
            "gradkit.estimators.scale_gradient / clip_gradient instead.")

    def prim_fun(*xs: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
        out = compat.bind_primitive(prim, xs, params)
        return out[0] if len(out) == 1 else tuple(out)

    return prim_fun


def _zeros_for(x: ArrayLike) -> jax.Array | np.ndarray:
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros(np.shape(x), jnp.result_type(x))
    return np.zeros(np.shape(x), jax.dtypes.float0)


def default_jvp(op: OpView, tangents: Tangents, rule_name: str) -> jax.Array | tuple[jax.Array, ...]:
    """``jax.jvp`` of the op's own function (see :func:`op_function`)."""
    primals = tuple(op.inputs)
    ts = tuple(_zeros_for(p) if t is None else t for p, t in zip(primals, tangents))
    _, t_out = jax.jvp(op_function(op, rule_name), primals, ts)
    out: jax.Array | tuple[jax.Array, ...] = t_out  # as op_function returns
    return out


# The primitives' kernels, each with its output tangent alone: what the kernel's own JVP rule computes for
# the tangent (numerics.py: `_sigmoid_jvp`, `_tanh_jvp`, `_expm1_jvp`), operation for operation, so the
# derivative is the same at every order (tests/test_stable_tangent_only.py). A rule for the primitive needs no
# value: the matched equation computes it, and jax.jvp of the kernel would trace, lower and compile the
# kernel's value once more per match.
_TANGENT_ONLY: dict[Callable[..., object], Callable[[jax.Array, jax.Array], jax.Array]] = {
    _k.sigmoid: lambda x, t: t * _k.sigmoid_prime(x),
    _k.tanh: lambda x, t: t * (4.0 * _k.sigmoid_prime(2.0 * x)),
    _k.expm1: lambda x, t: t * jnp.exp(x),
}


def jvp_via(body: Callable[..., object], keywords: tuple[str, ...] = (), *,
            label: str = "gradkit.stable") -> JvpRuleFn:
    """A JVP rule that differentiates ``body(*op.inputs, **params)``, a stable function with a custom_jvp.

    Only float inputs are differentiated (``None`` and boolean/integer inputs
    are held fixed); only ``keywords`` are read from ``op.params`` (a foreign
    op's params are not the body's). A ``jax.jit``-ed function matched by
    name whose signature the body cannot know (keyword arguments such as an
    ``axis``) keeps its own derivative.

    The stable derivatives are for real inputs: a primitive or a JAX function
    with a complex input keeps its own (JAX's) derivative, as if the rule did
    not match (a gradkit named op's own derivative is the body's anyway).

    A one-input kernel with a known output tangent (``_TANGENT_ONLY``: the
    rules of ``logistic``, ``tanh``, ``expm1``) computes that tangent alone.
    """
    tangent_only = _TANGENT_ONLY.get(body) if not keywords else None

    def rule(op: OpView, tangents: Tangents) -> object:
        if (keywords and is_foreign_jit(op)) or (_complex(op.inputs) and _has_own_function(op)):
            return default_jvp(op, tangents, label)
        skip = _custom_call_consts(op)
        inputs, tangents = list(op.inputs[skip:]), tuple(tangents[skip:])
        idx = [i for i, x in enumerate(inputs)
               if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
        kw = {k: op.params[k] for k in keywords if k in op.params}

        def f(*xs: jax.Array) -> object:
            args = list(inputs)
            for i, x in zip(idx, xs):
                args[i] = x
            return body(*args, **kw)

        primals = tuple(_as_array(inputs[i]) for i in idx)
        ts = tuple(jnp.zeros_like(p) if (t := tangents[i] if i < len(tangents) else None) is None else
                   _as_array(t, p.dtype) for i, p in zip(idx, primals))

        if tangent_only is not None and len(inputs) == len(primals) == 1:
            return tangent_only(primals[0], ts[0])
        try:
            _, t_out = jax.jvp(f, primals, ts)
        except TypeError as e:
            raise GradkitError(
                f"rule {label} for op '{op.name}' at {op.source}: the stable derivative takes the arguments of "
                f"{getattr(body, '__name__', 'the stable function')}, but the op has {len(inputs)} inputs "
                f"({_describe(inputs)}): {e}. A 'fn:' or named-op key matches any function of that name; give "
                "this one its own rule, or rename it.") from None
        return t_out

    return rule


def _has_own_function(op: OpView) -> bool:
    """:func:`op_function` can rebuild the op (a gradkit named op's own derivative is the body's)."""
    return is_foreign_jit(op) or _is_custom_jvp_call(op) or compat.primitive_by_name(op.name) is not None


def _complex(xs: Sequence[ArrayLike | None]) -> bool:
    return any(x is not None and jnp.issubdtype(jnp.result_type(x), jnp.complexfloating) for x in xs)


def _as_array(x: ArrayLike, dtype: DTypeLike | None = None) -> jax.Array:
    # No jnp.asarray on traced values: under vmap it is a device_put, which imports more of JAX.
    if isinstance(x, (jax.Array, compat.Tracer)):
        return x if dtype is None or x.dtype == dtype else jax.lax.convert_element_type(x, dtype)
    return jnp.asarray(x, dtype)


def _describe(xs: Sequence[object]) -> str:

    return ", ".join(f"{compat.aval_of(x).str_short()}" if x is not None else "None" for x in xs)
