"""Closure conversion for custom_gradient / custom_jvp, and whether grad_fn is linear.

Nothing that JAX traces lazily (a custom_vjp's fwd, a custom_jvp's rule) may
close over a tracer: when that trace happens, inside the transformation of
the named op's ``jit``, a captured tracer of an enclosing jit/vmap/grad is
foreign and JAX fails with "No constant handler for type ...Tracer" (JAX's
custom_vjp/custom_jvp inside jit, closing over outer tracers). So the user's
function and its closure are traced to jaxprs when the named op is traced,
and every tracer they capture is passed explicitly. The jaxprs are kept
open (their consts detached): since jax 0.11 a jaxpr holds its consts, and a
kept closed jaxpr would keep the captured tracers, and their trace, alive.

Forward mode for ``custom_gradient`` is ``grad_fn`` transposed
(:func:`forward_problem` says when that is not possible).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import compat
from gradkit._src.core import walk
from gradkit._src.function_gradients.call import Call, as_tangent, inexact, zero_tangent


@dataclasses.dataclass(frozen=True, eq=False)
class JaxprFn:
    """A traced function whose captured tracers were hoisted out: call it with them, then the inputs.

    Holds an open jaxpr (consts as leading inputs), the concrete consts, and
    which const slots are filled by the captured values at each call.
    """

    jaxpr: compat.Jaxpr
    slots: tuple[int, ...]
    fixed: tuple[object, ...]

    @classmethod
    def trace(cls, fn: Callable[..., Sequence[object]],
              structs: Sequence[jax.ShapeDtypeStruct]) -> tuple[JaxprFn, list[jax.Array]]:
        jaxpr, consts = compat.detach_consts(compat.trace(fn, list(structs)))
        slots = tuple(i for i, c in enumerate(consts) if isinstance(c, compat.Tracer))
        fixed = tuple(None if i in slots else c for i, c in enumerate(consts))
        return cls(jaxpr, slots, fixed), [consts[i] for i in slots]

    def __call__(self, captured: Sequence[jax.Array], args: Sequence[jax.Array]) -> list[jax.Array]:
        consts: list[object] = list(self.fixed)
        for i, c in zip(self.slots, captured):
            consts[i] = c
        return compat.eval_open(self.jaxpr, [*consts, *args])


@dataclasses.dataclass(frozen=True, eq=False)
class ClosureStatic:
    """grad_fn / jvp_fn traced over its float inputs; which inputs it takes, which outputs are not None."""

    fn: JaxprFn
    in_mask: tuple[bool, ...]
    out_mask: tuple[bool, ...]


@jax.tree_util.register_pytree_node_class
class Closure:
    """A closure-converted grad_fn / jvp_fn: static jaxpr, captured values as pytree leaves (residuals)."""

    def __init__(self, static: ClosureStatic, captured: Sequence[jax.Array]):
        self.static = static
        self.captured = list(captured)

    def tree_flatten(self) -> tuple[list[jax.Array], ClosureStatic]:
        return self.captured, self.static

    @classmethod
    def tree_unflatten(cls, static: ClosureStatic, captured: Sequence[jax.Array]) -> Closure:
        return cls(static, captured)

    def linear(self, *float_inputs: jax.Array) -> tuple[jax.Array, ...]:
        """The non-None outputs, as a function of the float inputs (what jax.linear_transpose needs)."""
        return tuple(self.static.fn(self.captured, float_inputs))

    def __call__(self, inputs: Sequence[jax.Array]) -> list[jax.Array | None]:
        """One output (or None) per out_mask entry from one input per in_mask entry."""
        vals = iter(self.linear(*[x for x, keep in zip(inputs, self.static.in_mask) if keep]))
        return [next(vals) if m else None for m in self.static.out_mask]


def _close(fn: Callable[..., list[object]], structs: Sequence[jax.ShapeDtypeStruct],
           in_mask: tuple[bool, ...]) -> Closure:
    """Traces ``fn`` (float inputs -> list with None entries) and hoists what it captured."""
    mask_box: list[tuple[bool, ...]] = []

    def nonzero(*xs: jax.Array) -> list[object]:
        outs = fn(*xs)
        mask_box.append(tuple(o is not None for o in outs))
        return [o for o in outs if o is not None]

    jfn, captured = JaxprFn.trace(nonzero, structs)
    return Closure(ClosureStatic(jfn, in_mask, mask_box[-1]), captured)


def close_grad_fn(call: Call, grad_fn: Callable[..., object], dyn: Sequence[jax.Array], outputs: object,
                  out: Sequence[jax.Array], multi: bool) -> Closure:
    """grad_fn as a function of the float output cotangents, one gradient (or None) per differentiated leaf."""
    float_out = tuple(inexact(o.dtype) for o in out)

    def flat(*float_cts: jax.Array) -> list[object]:
        it = iter(float_cts)
        return call.gradients(grad_fn, dyn, [next(it) if keep else None for keep in float_out], multi)

    structs = [compat.struct_like(o, weak_type=False) for o, keep in zip(out, float_out) if keep]
    return _close(flat, structs, float_out)


def close_jvp_fn(call: Call, jvp_fn: Callable[..., object], dyn: Sequence[jax.Array], outputs: object,
                 out: Sequence[jax.Array]) -> Closure:
    """jvp_fn as a function of the float input tangents, one tangent (or None) per output leaf."""
    float_in = tuple(inexact(jnp.result_type(x)) for x in dyn)

    def flat(*float_ts: jax.Array) -> list[object]:
        it = iter(float_ts)
        ts = [next(it) if keep else None for keep in float_in]
        result = call.info.call_closure(jvp_fn, call.user_tangents(ts), "tangent")
        return call.tangents_out(result, outputs, out)

    structs = [compat.struct_like(x, weak_type=False) for x, keep in zip(dyn, float_in) if keep]
    return _close(flat, structs, float_in)


def transposed(closure: Closure, dyn: Sequence[jax.Array], out: Sequence[jax.Array | np.ndarray],
               tangents: Sequence[jax.Array | jax.custom_derivatives.SymbolicZero | None],
               ) -> list[jax.Array | np.ndarray]:
    """Output tangents ``J t`` from grad_fn (``v ↦ Jᵀ v``) by linear transposition."""
    float_out = closure.static.in_mask
    structs = [compat.struct_like(o, weak_type=False) for o, keep in zip(out, float_out) if keep]
    t_float: Sequence[jax.Array] = ()
    if structs:
        t_in = tuple(as_tangent(t, x) for t, x, m in zip(tangents, dyn, closure.static.out_mask) if m)
        t_float = jax.linear_transpose(closure.linear, *structs)(t_in)
    it = iter(t_float)
    return [next(it) if keep else zero_tangent(o) for o, keep in zip(out, float_out)]


# --------------------------------------------------------------------------- is grad_fn linear?


def forward_problem(static: ClosureStatic, cap_structs: Sequence[jax.ShapeDtypeStruct],
                    out: Sequence[jax.Array | jax.ShapeDtypeStruct]) -> str | None:
    """Why grad_fn, as a function of the upstream gradients, has no transpose; ``None`` when it has.

    Two checks, both abstract (no computation): every gradient is a linear
    function of upstream, with no term that does not depend on it
    (:func:`_affine_problem`: JAX's transposition would silently drop such a
    term, and reverse mode, derived from the transpose, would no longer be
    grad_fn); and JAX can transpose it.
    """
    structs = [compat.struct_like(o, weak_type=False) for o, keep in zip(out, static.in_mask) if keep]
    if not structs:
        return None  # no float output: the JVP is zero
    problem = _affine_problem(static.fn, len(structs))
    if problem is not None:
        return problem
    out_structs = [compat.struct_of(v.aval) for v in static.fn.jaxpr.outvars]

    def transpose(cap: Sequence[jax.Array], cts: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
        return jax.linear_transpose(Closure(static, cap).linear, *structs)(tuple(cts))

    try:
        jax.eval_shape(transpose, cap_structs, out_structs)
    except Exception as e:  # what JAX says about the primitive it cannot transpose
        said = str(e).strip().splitlines()
        return f"JAX cannot transpose it ({type(e).__name__}{': ' + said[0] if said else ''})"
    return None


# Primitives that are linear in their linear operands only when the others are zero:
# ``g + c``, ``where(m, g, c)``, ``c.at[i].set(g)``, ``concatenate([g, c])``, ``pad(g, c)``.
_SUM_LIKE = frozenset({"add", "sub", "add_any", "select_n", "concatenate", "pad", "scatter", "scatter-add",
                       "scatter_add", "dynamic_update_slice"})
# Operands that are never linear data (a predicate, indices).
_INDEX_OPERANDS = {"select_n": (0,), "scatter": (1,), "scatter-add": (1,), "scatter_add": (1,)}
# Primitives whose output is zero when their (first) operand is.
_KEEPS_ZERO = frozenset({"broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "expand_dims",
                         "transpose", "copy", "copy_p", "neg", "slice", "dynamic_slice", "gather", "reduce_sum"})


def _is_zero_const(value: object) -> bool:
    try:
        arr = np.asarray(value)
    except Exception:
        return False
    return arr.size <= 65536 and arr.dtype != object and not np.any(arr)


def _affine_problem(fn: JaxprFn, n_upstream: int) -> str | None:
    """Whether some gradient has a part that does not depend on upstream, or passes upstream through a non-float."""
    jaxpr = fn.jaxpr
    invars = list(jaxpr.invars)
    linear = set(invars[len(invars) - n_upstream:])
    zero = {v for v, c in zip(invars, fn.fixed) if c is not None and _is_zero_const(c)}
    problem = _propagate(jaxpr, linear, zero)
    if problem is not None:
        return problem
    for v in jaxpr.outvars:
        if not _linear_or_zero(v, linear, zero):
            return "a gradient it returns does not depend on upstream (a constant, or upstream dropped)"
    return None


def _linear_or_zero(a: compat.Var | compat.Literal, linear: set[compat.Var], zero: set[compat.Var]) -> bool:
    if isinstance(a, compat.Literal):  # compat.is_literal, narrowed
        return _is_zero_const(a.val)
    return a in linear or a in zero


def _propagate(jaxpr: compat.Jaxpr, linear: set[compat.Var], zero: set[compat.Var]) -> str | None:
    """Marks the variables of ``jaxpr`` that depend linearly on ``linear`` (or are zero); a problem found."""
    for eqn in jaxpr.eqns:
        lin_in = [not compat.is_literal(a) and a in linear for a in eqn.invars]
        name = eqn.primitive.name
        if not any(lin_in):
            if name in _KEEPS_ZERO and eqn.invars and _linear_or_zero(eqn.invars[0], set(), zero):
                zero.update(eqn.outvars)
            elif name == "mul" and any(_linear_or_zero(a, set(), zero) for a in eqn.invars):
                zero.update(eqn.outvars)
            continue
        where = f"{name} at {compat.source_line(eqn)}"
        if any(not inexact(v.aval.dtype) for v in eqn.outvars if hasattr(v.aval, "dtype")):
            return f"it turns upstream into a non-float value ({where})"
        if name in _SUM_LIKE:
            skip = _INDEX_OPERANDS.get(name, ())
            n_data = 2 if name == "dynamic_update_slice" else len(eqn.invars)
            for i, a in enumerate(eqn.invars[:n_data]):
                if i not in skip and not _linear_or_zero(a, linear, zero):
                    return f"it adds a term that does not depend on upstream ({where})"
        subs = walk.subprograms(eqn.params) if walk.enters(eqn) or compat.is_custom_derivative(eqn) else []
        if len(subs) == 1:
            inner = compat.jaxpr_parts(subs[0])[0]
            if len(inner.invars) == len(eqn.invars) and len(inner.outvars) == len(eqn.outvars) \
                    and not inner.constvars:
                inner_lin = {v for v, a in zip(inner.invars, eqn.invars) if not compat.is_literal(a) and a in linear}
                inner_zero = {v for v, a in zip(inner.invars, eqn.invars) if _linear_or_zero(a, set(), zero)}
                problem = _propagate(inner, inner_lin, inner_zero)
                if problem is not None:
                    return problem
                for o, v in zip(eqn.outvars, inner.outvars):
                    if compat.is_literal(v) or v not in inner_lin:
                        if _linear_or_zero(v, set(), inner_zero):
                            zero.add(o)
                        continue
                    linear.add(o)
                continue
        linear.update(eqn.outvars)  # the rest: JAX's transposition decides
    return None
