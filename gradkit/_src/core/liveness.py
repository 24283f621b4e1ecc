"""Where a path is masked: the dataflow SAFE reads to tell a mask from a value zero.

A derivative path through an equation is *masked* for an element when
structure, not arithmetic, makes it contribute nothing:

* a selection does not take it — the unused side of ``select_n`` (``where``),
  of ``max``/``min`` (JAX's forward mode: the side that is not the result;
  both at a tie), of ``clamp``;
* it is multiplied by a zero that does not depend on the differentiated
  inputs — a literal, a constant of the program, a value behind
  ``stop_gradient`` or computed from booleans (a 0/1 mask) — in a product or a
  contraction (``dot_general``: per contracted term).

Two passes over one program (a body: scan, cond and while bodies are
programs of their own; their boundaries count as live, which leaves JAX's
answer):

* **up** (forward): for each value, the elements that some unmasked path
  reaches from the program's inputs;
* **down** (backward): for each value, the elements from which some unmasked
  path reaches the program's outputs.

A SAFE rule then masks an element of its equation where no live path
arrives (up) or none leaves (down). Each value is ``True`` (every element
live), ``False`` (none) or a boolean array. With ``values=None`` the passes
run *statically*: anything that depends on a runtime value is :data:`DYN`;
an equation whose masks are all statically ``True`` needs no mask at all and
keeps JAX's own equation.

Everything not known here is live (conservative: JAX's answer, NaN included).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradkit._src import compat
from gradkit._src.core import mask_ops, walk


class _Dyn:
    """A liveness that depends on runtime values (static mode)."""

    def __repr__(self) -> str:
        return "DYN"


DYN = _Dyn()
Live = bool | _Dyn | jax.Array | np.ndarray

# Elementwise primitives: each output element depends on the same element of each operand.
ELEMENTWISE = frozenset({
    "neg", "sign", "floor", "ceil", "round", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic",
    "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma",
    "igamma", "igammac", "igamma_grad_a", "random_gamma_grad", "bessel_i0e", "bessel_i1e", "erf", "erfc",
    "erf_inv", "sqrt", "rsqrt", "cbrt", "abs", "integer_pow", "pow", "add", "sub", "div", "rem", "atan2",
    "nextafter", "square", "real", "imag", "conj", "complex", "polygamma", "zeta", "regularized_incomplete_beta",
    "convert_element_type", "reduce_precision", "copy", "copy_p", "add_any", "mul", "max", "min",
    "select_n", "clamp",
})
# Linear structural primitives: liveness moves as the values do (the primitive itself, and its transpose).
STRUCTURAL = frozenset({
    "reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "slice", "dynamic_slice",
    "dynamic_update_slice", "pad", "concatenate", "gather", "rev", "reduce_sum", "cumsum", "scatter-add",
    "scatter_add", "select_and_gather_add", "split", "stack",
})
# Primitives whose outputs carry no derivative.
_NO_DERIVATIVE = frozenset({"stop_gradient"})


def _inexact(atom: compat.Atom) -> bool:
    return bool(jnp.issubdtype(walk.shaped(atom.aval).dtype, jnp.inexact))


def _shape(atom: compat.Atom) -> tuple[int, ...]:
    return tuple(walk.shaped(atom.aval).shape)


class _Ops:
    """Boolean algebra on liveness values; static mode turns anything runtime into :data:`DYN`.

    ``nonzero_constant(atom)``: whether the program computes ``atom`` from literals alone, every element
    finite and nonzero (the seed of a ``jax.grad`` inside the program): a factor that masks nothing.
    """

    def __init__(self, static: bool, nonzero_constant: Callable[[compat.Atom], bool] | None = None) -> None:
        self.static = static
        self.nonzero_constant = nonzero_constant or (lambda atom: False)

    def or_(self, a: Live, b: Live) -> Live:
        if a is True or b is True:
            return True
        if a is False:
            return b
        if b is False:
            return a
        if isinstance(a, _Dyn) or isinstance(b, _Dyn):
            return DYN
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):  # static, known at trace time
            return _norm(np.logical_or(a, b))
        return jnp.logical_or(a, b)

    def and_(self, a: Live, b: Live) -> Live:
        if a is False or b is False:
            return False
        if a is True:
            return b
        if b is True:
            return a
        if isinstance(a, _Dyn) or isinstance(b, _Dyn):
            return DYN
        if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
            return _norm(np.logical_and(a, b))
        return jnp.logical_and(a, b)

    def array(self, a: Live, shape: tuple[int, ...]) -> jax.Array:
        if isinstance(a, bool):
            return jnp.full(shape, a)
        assert not isinstance(a, _Dyn)
        if isinstance(a, np.ndarray):
            return jnp.asarray(np.broadcast_to(a, shape))
        return jnp.broadcast_to(a, shape)

    def runtime(self, fn: Callable[[], jax.Array]) -> Live:
        return DYN if self.static else fn()


def _norm(x: np.ndarray) -> Live:
    """A liveness known at trace time: ``True``/``False`` where it is uniform, else the array."""
    if bool(np.all(x)):
        return True
    if not bool(np.any(x)):
        return False
    return x


def _static_structural(eqn: compat.JaxprEqn, live: Sequence[Live], d: Live | None) -> Live | list[Live]:
    """A structural op's liveness at trace time (its pattern depends on shapes and params only): up when
    ``d`` is ``None``, else down (one per input). :data:`DYN` where an operand that is not carried (an index)
    is not a literal, or a liveness is not known."""
    if any(isinstance(x, _Dyn) for x in live) or isinstance(d, _Dyn) or any(
            not _inexact(a) and not isinstance(a, compat.Literal) for a in eqn.invars):
        return DYN if d is None else [DYN if _inexact(a) else False for a in eqn.invars]

    def literal(atom: compat.Atom) -> Any:
        assert isinstance(atom, compat.Literal)  # checked above: every operand not carried is a literal
        return atom.val

    ops = _Ops(False)
    with jax.ensure_compile_time_eval():
        if d is None:
            return _norm(np.asarray(_apply_structural(ops, literal, eqn, list(live))))
        outs = _transpose_structural(ops, literal, eqn, d)
        return [_norm(np.asarray(x)) if not isinstance(x, bool) else x for x in outs]


class Unknown(Exception):
    """A value the masks need cannot be computed apart from the program (an effect on its way)."""


Values = Callable[[compat.Atom], Any]


def _value(values: Values | None, atom: compat.Atom) -> Any:
    if isinstance(atom, compat.Literal):
        return atom.val
    assert values is not None
    return values(atom)


def _nonzero(ops: _Ops, values: Values | None, up: Live, atom: compat.Atom) -> Live:
    """Where the factor ``atom`` is not a masking zero: it varies (``up``) or it is not 0."""
    if up is True:
        return True
    if not isinstance(atom, compat.Literal) and ops.nonzero_constant(atom):
        return True
    if isinstance(atom, compat.Literal):
        v = np.asarray(atom.val)
        nz = bool(np.all(v != 0))
        return ops.or_(up, True) if nz else (up if not np.any(v != 0) else ops.or_(up, DYN if ops.static
                                                                                          else jnp.asarray(v != 0)))
    if ops.static:
        return DYN
    return ops.or_(up, jnp.asarray(_value(values, atom)) != 0)


def up_pass(jaxpr: compat.Jaxpr, values: Values | None,
            nonzero_constant: Callable[[compat.Atom], bool] | None = None,
            static: dict[compat.Var, Live] | None = None, need: set[compat.Var] | None = None
            ) -> dict[compat.Var, Live]:
    """For each variable: where some unmasked path from the program's inputs reaches it.

    With ``static`` (the static pass's answer) and ``need`` (:func:`demand`), only the variables in ``need``
    are computed; every other one keeps its static liveness."""
    ops = _Ops(values is None, nonzero_constant)
    up: dict[compat.Var, Live] = {}
    for v in jaxpr.invars:
        up[v] = _inexact(v)
    for v in jaxpr.constvars:
        up[v] = False
    if static is not None:
        up.update(static)

    def get(a: compat.Atom) -> Live:
        return False if isinstance(a, compat.Literal) else up.get(a, False)

    for eqn in jaxpr.eqns:
        if need is not None and not any(v in need for v in eqn.outvars):
            continue
        name = eqn.primitive.name
        ins = [get(a) for a in eqn.invars]
        outs: list[Live]
        if name in _NO_DERIVATIVE or not any(x is not False for x, a in zip(ins, eqn.invars) if _inexact(a)):
            outs = [False] * len(eqn.outvars)
        else:
            try:
                outs = [_up_rule(ops, values, eqn, ins)] if len(eqn.outvars) == 1 else [True] * len(eqn.outvars)
            except Unknown:
                outs = [True] * len(eqn.outvars)
        for v, o in zip(eqn.outvars, outs):
            up[v] = _fit(o, v) if _inexact(v) else False
    return up


def _fit(live: Live, atom: compat.Atom, reduce: bool = False) -> Live:
    """``live`` for ``atom``. An operand broadcast by its op (a rank-0 factor times a vector): up, the
    liveness broadcast; down (``reduce``), live where any element it reaches is. Any other shape (a rule
    that does not know the op) is live everywhere — JAX's answer, never a mask too many."""
    if isinstance(live, (bool, _Dyn)):
        return live
    shape = _shape(atom)
    if tuple(live.shape) == shape:
        return live
    if isinstance(live, np.ndarray):  # known at trace time: NumPy (jnp would stage it into the trace)
        lead = live.ndim - len(shape)
        if reduce and lead >= 0 and all(a in (1, b) for a, b in zip(shape, live.shape[lead:])):
            axes = tuple(range(lead)) + tuple(lead + i for i, a in enumerate(shape) if a == 1 != live.shape[lead + i])
            return _norm(np.reshape(np.any(live, axis=axes), shape))
        try:
            return _norm(np.broadcast_to(live, shape).copy()) if not reduce else True
        except ValueError:
            return True
    if reduce:
        lead = live.ndim - len(shape)
        if lead >= 0 and all(a in (1, b) for a, b in zip(shape, live.shape[lead:])):
            axes = tuple(range(lead)) + tuple(lead + i for i, a in enumerate(shape) if a == 1 != live.shape[lead + i])
            return jnp.reshape(jnp.any(live, axis=axes, keepdims=False), shape) if axes else live
        return True
    try:
        return jnp.broadcast_to(live, shape)
    except ValueError:
        return True


def _up_rule(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, ins: list[Live]) -> Live:
    name = eqn.primitive.name
    a = eqn.invars
    out = eqn.outvars[0]
    if name == "select_n":
        cases = ins[1:]
        if all(c is True for c in cases):
            return True
        if all(c is False for c in cases):
            return False
        if ops.static:
            return DYN
        p = jnp.asarray(_value(values, a[0]))
        if len(cases) == 2 and p.dtype == bool:  # the predicate itself, no select of masks
            p = jnp.broadcast_to(p, _shape(out))
            return ops.or_(ops.and_(cases[0], jnp.logical_not(p)), ops.and_(cases[1], p))
        return lax.select_n(p, *[ops.array(c, _shape(out)) for c in cases])
    if name == "mul":
        return ops.or_(ops.and_(ins[0], _nonzero(ops, values, ins[1], a[1])),
                       ops.and_(ins[1], _nonzero(ops, values, ins[0], a[0])))
    if name in ("max", "min"):
        chosen: Live = _chosen(ops, values, name, a, ins, _shape(out), up=True)
        return chosen
    if name == "clamp":
        clamped: Live = _clamp(ops, values, a, ins, _shape(out), None)
        return clamped
    if name == "dot_general":
        return _dot_up(ops, values, eqn, ins)
    if name in ("reduce_max", "reduce_min"):
        if ins[0] is True:
            return True
        return ops.runtime(lambda: _reduce_chosen_up(ops, values, eqn, ins[0]))
    if name == "reduce_prod":
        if ins[0] is True:
            return True
        return ops.runtime(lambda: jnp.any(_prod_live(ops, values, eqn, ins[0], True),
                                           axis=tuple(eqn.params["axes"])))
    if name in ELEMENTWISE:
        live: Live = False
        for x, atom in zip(ins, a):
            if _inexact(atom):
                live = ops.or_(live, x)
        return live
    if name in STRUCTURAL:
        if all(x is True or not _inexact(atom) for x, atom in zip(ins, a)) and name in _ONTO:
            return True
        if ops.static:
            static = _static_structural(eqn, ins, None)
            assert not isinstance(static, list)
            return static
        return _apply_structural(ops, values, eqn, ins)
    return True  # not known here: live


# Structural primitives under which an all-live input stays all-live.
_ONTO = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "rev", "reduce_sum",
                   "cumsum", "slice", "dynamic_slice", "gather", "concatenate", "split", "stack"})


def _chosen(ops: _Ops, values: Values | None, name: str, a: Sequence[compat.Atom], live: list[Live],
            shape: tuple[int, ...], up: bool, d_out: Live = True) -> Any:
    """``max``/``min``: the side JAX's derivative takes (both at a tie)."""
    if ops.static:
        return DYN if up else [DYN if live_i is not False else False for live_i in live]

    def side(i: int) -> jax.Array:
        # taken unless the other side wins outright: both at a tie, and both where a value is NaN (no claim)
        x, y = (jnp.asarray(_value(values, a[j])) for j in (i, 1 - i))
        return jnp.broadcast_to(~(x < y) if name == "max" else ~(x > y), shape)

    if up:
        return ops.or_(ops.and_(live[0], side(0)), ops.and_(live[1], side(1)))
    return [ops.and_(d_out, side(0)), ops.and_(d_out, side(1))]


def _clamp(ops: _Ops, values: Values | None, a: Sequence[compat.Atom], live: list[Live], shape: tuple[int, ...],
           d_out: Live | None) -> Any:
    """``clamp(lo, x, hi)``: the operand JAX's derivative takes (strict inequalities, as JAX's rule)."""
    if ops.static:
        return DYN if d_out is None else [DYN, DYN, DYN]
    lo, x, hi = (jnp.broadcast_to(jnp.asarray(_value(values, v)), shape) for v in a)
    takes = [(lo > x) & (lo < hi), (x > lo) & (x < hi), hi < x]
    if d_out is None:
        out: Live = False
        for t, lv in zip(takes, live):
            out = ops.or_(out, ops.and_(lv, t))
        return out
    return [ops.and_(d_out, t) for t in takes]


def _as_f32(ops: _Ops, x: Live, atom: compat.Atom) -> jax.Array:
    return ops.array(x, _shape(atom)).astype(jnp.float32)


def _dot_up(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, ins: list[Live]) -> Live:
    a, b = eqn.invars
    nz_a, nz_b = _nonzero(ops, values, ins[0], a), _nonzero(ops, values, ins[1], b)
    if (ins[0] is True and nz_b is True) or (ins[1] is True and nz_a is True):
        return True
    if ops.static:
        return DYN
    return ops.or_(_dot_mask(ops, eqn, ins[0], nz_b), _dot_mask(ops, eqn, nz_a, ins[1]))


def _dot_mask(ops: _Ops, eqn: compat.JaxprEqn, x: Live, y: Live, side: int | None = None) -> Live:
    """``dot_general``'s masks (core/mask_ops.py): up (``side`` None; ``x``, ``y``: the lhs's and rhs's), or
    down to operand ``side`` (``x``: the output's, ``y``: the other operand's nonzero factors)."""
    if x is False or y is False:
        return False
    if x is True and y is True:
        return True
    shapes = [_shape(atom) for atom in (*eqn.invars, eqn.outvars[0])]
    x_, y_ = (None if m is True else ops.array(m, sh) for m, sh in
              zip((x, y), (shapes[0], shapes[1]) if side is None else (shapes[2], shapes[1 - side])))
    return mask_ops.dot_up(eqn, x_, y_) if side is None else mask_ops.dot_back(eqn, x_, y_, side)


def _reduce_chosen_up(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, live: Live) -> jax.Array:
    x = jnp.asarray(_value(values, eqn.invars[0]))
    out = jnp.asarray(_value(values, eqn.outvars[0]))
    axes = tuple(eqn.params["axes"])
    at = x == jnp.expand_dims(out, axes)
    return jnp.any(ops.and_(ops.array(live, x.shape), at), axis=axes)  # type: ignore[arg-type]


def _prod_live(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, live: Live, up: bool) -> jax.Array:
    """``reduce_prod``: per element, whether its term is not multiplied by a constant zero of its group (and,
    up, whether a live path reaches it): the product of the others is then not identically 0."""
    x = eqn.invars[0]
    axes = tuple(eqn.params["axes"])
    zero = (~ops.array(_nonzero(ops, values, live, x), _shape(x))).astype(jnp.int32)  # constant zeros
    others = jnp.sum(zero, axis=axes, keepdims=True) - zero  # constant zeros among the other terms
    free = others == 0
    return free & ops.array(live, _shape(x)) if up else free


def _apply_structural(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, ins: list[Live]) -> jax.Array:
    if eqn.primitive.name in mask_ops.BOOLEAN:  # the op itself on the masks
        return mask_ops.structural(eqn, [ops.array(x, _shape(atom)) if _inexact(atom) else _value(values, atom)
                                         for x, atom in zip(ins, eqn.invars)])
    args = [_as_f32(ops, x, atom) if _inexact(atom) else _value(values, atom) for x, atom in zip(ins, eqn.invars)]
    out: jax.Array = compat.bind_primitive(eqn.primitive, args, dict(eqn.params))[0]
    return out > 0


def down_pass(jaxpr: compat.Jaxpr, values: Values | None, up: dict[compat.Var, Live],
              nonzero_constant: Callable[[compat.Atom], bool] | None = None,
              static: dict[compat.Var, Live] | None = None, need: set[compat.Var] | None = None
              ) -> dict[compat.Var, Live]:
    """For each variable: where some unmasked path from it reaches the program's outputs (``static`` and
    ``need``: as :func:`up_pass`)."""
    ops = _Ops(values is None, nonzero_constant)
    down: dict[compat.Var, Live] = {}
    if static is not None:
        down.update((v, x) for v, x in static.items() if need is None or v not in need)

    def add(atom: compat.Atom, live: Live) -> None:
        if isinstance(atom, compat.Literal) or up.get(atom, False) is False:
            return  # nothing varies there: no derivative to mask
        if need is not None and atom not in need:
            return
        down[atom] = ops.or_(down.get(atom, False), _fit(live, atom, reduce=True))

    for v in jaxpr.outvars:
        if not isinstance(v, compat.Literal) and _inexact(v):
            add(v, True)
    for eqn in reversed(jaxpr.eqns):
        if need is not None and not any(a in need for a in eqn.invars if not isinstance(a, compat.Literal)):
            continue
        d_outs = [down.get(v, False) for v in eqn.outvars]
        if all(d is False for d in d_outs):
            continue
        name = eqn.primitive.name
        if name in _NO_DERIVATIVE:
            continue
        ins = [False if isinstance(a, compat.Literal) else up.get(a, False) for a in eqn.invars]
        try:
            if len(eqn.outvars) != 1:
                raise Unknown
            for atom, live in zip(eqn.invars, _down_rule(ops, values, eqn, ins, d_outs[0])):
                if live is not False and _inexact(atom):
                    add(atom, live)
        except Unknown:
            for atom in eqn.invars:
                if _inexact(atom):
                    add(atom, True)
    return down


def _down_rule(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, ins: list[Live], d: Live) -> list[Live]:
    name = eqn.primitive.name
    a = eqn.invars
    shape = _shape(eqn.outvars[0])
    if name == "select_n":
        if ops.static:
            return [False] + [ops.and_(d, DYN) for _ in a[1:]]
        p = jnp.asarray(_value(values, a[0]))
        return [False] + [ops.and_(d, jnp.broadcast_to(p == i if p.dtype != bool else (p if i else ~p), shape))
                          for i in range(len(a) - 1)]
    if name == "mul":
        return [ops.and_(d, _nonzero(ops, values, ins[1], a[1])), ops.and_(d, _nonzero(ops, values, ins[0], a[0]))]
    if name in ("max", "min"):
        if ops.static:
            return [ops.and_(d, DYN), ops.and_(d, DYN)]
        return list(_chosen(ops, values, name, a, ins, shape, up=False, d_out=d))
    if name == "clamp":
        if ops.static:
            return [ops.and_(d, DYN)] * 3
        return list(_clamp(ops, values, a, ins, shape, d))
    if name == "dot_general":
        return _dot_down(ops, values, eqn, ins, d)
    if name in ("reduce_max", "reduce_min"):
        if ops.static:
            return [DYN]
        x = jnp.asarray(_value(values, a[0]))
        out = jnp.asarray(_value(values, eqn.outvars[0]))
        axes = tuple(eqn.params["axes"])
        spread = jnp.broadcast_to(jnp.expand_dims(ops.array(d, shape), axes), x.shape)
        return [spread & (x == jnp.expand_dims(out, axes))]
    if name == "reduce_prod":
        if ins[0] is True and d is True:
            return [True]
        if ops.static:
            return [DYN]
        axes = tuple(eqn.params["axes"])
        spread = jnp.broadcast_to(jnp.expand_dims(ops.array(d, shape), axes), _shape(a[0]))
        return [spread & _prod_live(ops, values, eqn, ins[0], False)]
    if name in ELEMENTWISE:
        return [d if _inexact(atom) else False for atom in a]
    if name in STRUCTURAL:
        if d is True and name in _ONTO_BACK:
            return [True if _inexact(atom) else False for atom in a]
        if ops.static:
            static = _static_structural(eqn, ins, d)
            assert isinstance(static, list)
            return static
        return _transpose_structural(ops, values, eqn, d)
    raise Unknown


# Structural primitives whose transpose takes an all-live cotangent to all-live operands.
_ONTO_BACK = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "rev", "broadcast_in_dim", "reduce_sum",
                        "cumsum", "concatenate", "split", "stack"})


def _dot_down(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, ins: list[Live], d: Live) -> list[Live]:
    a, b = eqn.invars
    nz = [_nonzero(ops, values, ins[0], a), _nonzero(ops, values, ins[1], b)]
    if d is True and nz[1] is True and nz[0] is True:
        return [True, True]
    if ops.static:
        return [DYN, DYN]
    return [_dot_mask(ops, eqn, d, nz[1], 0), _dot_mask(ops, eqn, d, nz[0], 1)]


def _transpose_structural(ops: _Ops, values: Values | None, eqn: compat.JaxprEqn, d: Live) -> list[Live]:
    back = mask_ops.transpose_structural(eqn, ops.array(d, _shape(eqn.outvars[0])))
    if back is not None:
        return back
    idx = [i for i, atom in enumerate(eqn.invars) if _inexact(atom)]
    fixed = {i: _value(values, atom) for i, atom in enumerate(eqn.invars) if i not in idx}

    def f(*xs: jax.Array) -> jax.Array:
        args: list[Any] = []
        it = iter(xs)
        for i in range(len(eqn.invars)):
            args.append(next(it) if i in idx else fixed[i])
        y: jax.Array = compat.bind_primitive(eqn.primitive, args, dict(eqn.params))[0]
        return y

    structs = [jax.ShapeDtypeStruct(_shape(eqn.invars[i]), jnp.float32) for i in idx]
    d_f = ops.array(d, _shape(eqn.outvars[0])).astype(jnp.float32)
    cts = jax.linear_transpose(f, *structs)(d_f)
    out: list[Live] = [False] * len(eqn.invars)
    for i, ct in zip(idx, cts):
        out[i] = ct > 0
    return out


def demand(jaxpr: compat.Jaxpr, up: dict[compat.Var, Live], down: dict[compat.Var, Live],
           eqns: Sequence[compat.JaxprEqn]) -> tuple[set[compat.Var], set[compat.Var]]:
    """The variables whose liveness the masks of ``eqns`` need at run time: static :data:`DYN` (``up``,
    ``down``: the static passes) on the way to them — up from the producers, down from the consumers.
    Every other variable's static liveness is its value."""
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    consumers: dict[compat.Var, list[compat.JaxprEqn]] = {}
    for e in jaxpr.eqns:
        if e.primitive.name not in _NO_DERIVATIVE:
            for a in e.invars:
                if not isinstance(a, compat.Literal):
                    consumers.setdefault(a, []).append(e)
    need_up: set[compat.Var] = set()
    need_down: set[compat.Var] = set()
    stack: list[tuple[bool, compat.Atom]] = [(True, a) for e in eqns for a in e.invars]
    stack.extend((False, v) for e in eqns for v in e.outvars)
    while stack:
        is_up, v = stack.pop()
        if isinstance(v, compat.Literal):
            continue
        seen, live = (need_up, up) if is_up else (need_down, down)
        if v in seen or not isinstance(live.get(v), _Dyn):
            continue
        seen.add(v)
        if is_up:
            p = producer.get(v)
            stack.extend((True, a) for a in (p.invars if p is not None else ()))
        else:
            for c in consumers.get(v, ()):
                stack.extend((False, o) for o in c.outvars)
                stack.extend((True, a) for a in c.invars)
    return need_up, need_down


def dead(eqn: compat.JaxprEqn, up: dict[compat.Var, Live], down: dict[compat.Var, Live], ops_static: bool
         ) -> list[Live]:
    """Per input of ``eqn``: where its derivative path through ``eqn`` is masked (``True``: everywhere live
    paths are missing; ``False``: nowhere)."""
    ops = _Ops(ops_static)
    d = down.get(eqn.outvars[0], False)
    out: list[Live] = []
    for atom in eqn.invars:
        u = False if isinstance(atom, compat.Literal) else up.get(atom, False)
        live = ops.and_(u, d)
        out.append(_not(live))
    return out


def _not(x: Live) -> Live:
    if isinstance(x, bool):
        return not x
    if isinstance(x, _Dyn):
        return DYN
    if isinstance(x, np.ndarray):
        return _norm(np.logical_not(x))
    return jnp.logical_not(x)
