"""Upcast-backward rules: an op's derivative computed in float32 for a bfloat16/float16 program.

A rule is a JVP rule: it upcasts the op's inputs and tangents, re-evaluates
the op in float32 (a primitive with its parameters; a ``jax.jit``-ed or
``custom_jvp``/``custom_vjp`` function matched by name, by evaluating its
program with every low-precision float type replaced by float32), takes JAX's
own JVP of that, and casts the output tangent back to the op's dtype. The
forward value is the op's own (the dispatcher keeps it); only the tangent,
and through JAX's transposition the cotangent, changes.

What it buys: the derivative is computed from the float32 value of the op,
not from its rounded low-precision output, and every cancellation *inside*
the op happens in float32. ``tanh``'s ``1 - t^2`` at ``t = 0.995`` keeps its
bits; ``log_softmax``'s cotangent ``g - p * sum(g)`` at the label, where
``p ~ 1`` (the ``p - 1`` of cross-entropy), is exact before the one final
rounding. A cancellation *between* ops (two bfloat16 cotangents summed in
``add_any``) happens outside any rule and is not helped: only a function that
contains it (``fn:log_softmax``, ``fn:standardize``) can be upcast as a whole.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from gradkit._src import compat
from gradkit._src.core import walk
from gradkit._src.core.rule import OpView, Rule, Tangents
from gradkit._src.errors import GradkitError

A = TypeVar("A")
_DTYPE_PARAMS = ("new_dtype", "preferred_element_type", "dtype")


def _is_low(dtype: DTypeLike | None, target: np.dtype) -> bool:
    return (dtype is not None and jnp.issubdtype(dtype, jnp.floating)
            and jnp.finfo(dtype).bits < jnp.finfo(target).bits)


def _up(x: A, target: np.dtype) -> A | jax.Array | np.ndarray:
    dtype = getattr(x, "dtype", None)
    if _is_low(dtype, target):
        if isinstance(x, (jax.Array, compat.Tracer)):
            return jax.lax.convert_element_type(x, target)
        return np.asarray(x, target)
    return x


def _as(x: ArrayLike, dtype: DTypeLike) -> jax.Array | np.ndarray:
    if isinstance(x, (jax.Array, compat.Tracer)):
        return x if x.dtype == dtype else jax.lax.convert_element_type(x, dtype)
    return np.asarray(x, dtype)


def _params(params: Mapping[str, object], target: np.dtype) -> dict[str, object]:
    out: dict[str, Any] = dict(params)  # JAX's equation params: a dtype param is whatever np.dtype reads
    for key in _DTYPE_PARAMS:
        v = out.get(key)
        if v is not None and not isinstance(v, (str, bool)):
            try:
                low = _is_low(np.dtype(v), target)
            except TypeError:
                continue
            if low:
                out[key] = target
    return out


def _body(params: Mapping[str, object]) -> tuple[object, int] | None:
    """The program of a matched function: ``(closed jaxpr, leading inputs it does not take)``."""
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        closed = params.get(key)
        if compat.is_jaxpr(closed):
            return closed, 0
    return None


def eval_upcast(closed: object, args: Sequence[ArrayLike], target: np.dtype, where: str) -> list[ArrayLike]:
    """Evaluates a jaxpr with every low-precision float value and dtype parameter in ``target``."""
    jaxpr, consts = compat.jaxpr_parts(closed)
    env: dict[compat.Var, ArrayLike] = {}
    for v, x in zip(jaxpr.constvars, consts):
        env[v] = _up(x, target)
    for v, x in zip(jaxpr.invars, args):
        env[v] = _up(x, target)
    for eqn in jaxpr.eqns:
        ins = [_up(compat.read_atom(env, a), target) for a in eqn.invars]
        if compat.is_jit(eqn) or compat.is_custom_derivative(eqn):
            body = _body(eqn.params)
            if body is None:  # pragma: no cover - every call primitive carries its program
                raise GradkitError(f"{where}: cannot read the program of `{eqn.primitive.name}`.")
            # A custom derivative inside is dropped: its body is differentiated in float32 instead.
            outs = eval_upcast(body[0], ins, target, where)
        elif walk.has_subprograms(eqn):
            raise GradkitError(
                f"{where}: the function contains `{eqn.primitive.name}` (a loop or branch), which the float32 "
                "re-evaluation does not enter. Upcast the primitives inside it instead (list their names).")
        else:
            outs = compat.bind(eqn, ins, _params(eqn.params, target))
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [compat.read_atom(env, a) for a in jaxpr.outvars]


def upcast_rule(name: str, dtype: DTypeLike = jnp.float32) -> Rule:
    """The JVP rule computing op ``name``'s derivative in ``dtype`` (see the module docstring)."""
    target = np.dtype(dtype)
    label = f"gradkit.upcast_backward[{name}]"

    def rule(op: OpView, tangents: Tangents) -> object:
        inputs = list(op.inputs)
        diff = [t is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact) for x, t in zip(inputs, tangents)]
        if not any(diff):
            return None
        where = f"rule {label} for op '{op.name}' at {op.source}"
        body = _body(op.params)
        run: Callable[[Sequence[ArrayLike]], list[ArrayLike]]
        if body is not None:
            program = body[0]

            def run(xs: Sequence[ArrayLike]) -> list[ArrayLike]:
                return eval_upcast(program, xs, target, where)
        else:
            prim = compat.primitive_by_name(op.name)
            if prim is None:
                raise GradkitError(
                    f"{where}: upcast_backward re-evaluates a JAX primitive or a jax.jit / custom_jvp function "
                    f"matched by name ('fn:<name>'); '{op.name}' is neither (a gk.op?). Key the table by the "
                    "primitives inside it, or by the 'fn:' name of a jitted function.")
            params = _params(op.params, target)

            def run(xs: Sequence[ArrayLike]) -> list[ArrayLike]:
                return compat.bind_primitive(prim, [_up(x, target) for x in xs], params)

        idx = [i for i, d in enumerate(diff) if d]

        def f(*dyn: jax.Array) -> tuple[ArrayLike, ...]:
            xs = [_up(x, target) for x in inputs]
            for i, x in zip(idx, dyn):
                xs[i] = x
            return tuple(run(xs))

        primals = tuple(_up(inputs[i], target) for i in idx)
        ts = tuple(_as(t, p.dtype) for i, p in zip(idx, primals) if (t := tangents[i]) is not None)  # diff: not None
        _, t_out = jax.jvp(f, primals, ts)
        cast = [t.astype(jnp.result_type(o)) if jnp.issubdtype(jnp.result_type(o), jnp.inexact) else None
                for t, o in zip(t_out, op.outputs)]
        return cast[0] if len(cast) == 1 else tuple(cast)

    return Rule(rule, mode="jvp", name=label,
                key=("gradkit", "upcast_backward", (("dtype", target.name), ("op", name))))


def upcast_table(names: Sequence[str], target: DTypeLike) -> dict[str, Rule]:

    bad = [n for n in names if not isinstance(n, str) or not n or n != n.strip()]
    if bad or not names:
        raise GradkitError(
            f"upcast_backward: expected op names such as 'exp', 'tanh' or 'fn:log_softmax', got {list(names)!r}.")
    try:
        t = np.dtype(target)
    except TypeError:
        t = None
    if t is None or not jnp.issubdtype(t, jnp.floating) or jnp.finfo(t).bits < 32:
        raise GradkitError(f"upcast_backward: dtype must be float32 or float64, got {target!r}.")
    return {n: upcast_rule(n, t) for n in names}

