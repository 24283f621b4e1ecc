"""The SAFE rules: a primitive's own derivative, exactly 0 where the incoming (co)tangent is 0.

A SAFE rule is a JVP rule built from JAX's own JVP rule of the primitive:
gradkit traces ``jax.jvp`` of the primitive once per signature and re-plays
that program with every product of the tangent by a primal quantity
(``mul(t, d)``, ``div(t, d)``) replaced by :func:`compat.safe_scale`, which is
0 wherever the tangent is 0, and, for a product, also where the primal factor
is 0 and the tangent infinite (``0 * inf`` is 0 both ways). So, operation for
operation, each product in JAX's own order:

* forward mode: the tangent is JAX's ``t * f'(x)``, and 0 wherever ``t`` is 0
  (``0 * inf`` and ``0 * NaN`` never happen);
* reverse mode (JAX transposes the rule): the cotangent is JAX's own, in JAX's
  order of operations, and 0 wherever the incoming cotangent is 0 — or where
  a mask applied after the op (``clip``'s, ``max``'s, a ``mul`` by 0) meets an
  infinite cotangent, so reverse mode gives what forward mode gives where the
  mask comes first;
* higher orders: the primal quantities of the derivative (``0.5 / sqrt(x)``,
  ``y ** -2``) are themselves computed with safe derivatives, so a zero
  cotangent stays 0 through ``hessian`` and ``grad(grad(...))``.

Following JAX's program rather than hand-written formulas keeps the gradients
bit-identical to JAX's on every supported JAX version, whose formulas differ
(newer versions write ``acos``' with ``one_minus_square``, ``acosh``' as a
product of two ``rsqrt``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike, DTypeLike

from gradkit._src import compat
from gradkit._src.core import walk
from gradkit._src.core.rule import OpView
from gradkit._src.errors import GradkitError

# How an equation of the JVP program is re-played.
_PRIMAL = "primal"  # the primitive itself on the primal inputs: the op's own output is used
_VALUE = "value"  # a primal quantity (part of f'(x)): computed with safe derivatives of its own
_SCALE = "scale"  # tangent times/over primal quantities: one safe_scale
_LINEAR = "linear"  # any other operation on tangents (neg, add, convert, broadcast, ...): as is


@dataclasses.dataclass(frozen=True)
class _Scale:
    """``source * factor`` (or ``source / factor``), masked where ``source`` is 0 (and ``0 * inf`` both ways)."""

    source: compat.Atom  # the tangent-side atom
    factor: compat.Atom  # the primal atom
    divide: bool
    # lax.mul's out_dtype (JAX 0.10+): operands of mixed dtypes, both converted to the result's dtype first,
    # and the transpose in the tangent's own dtype, as JAX's mul and its transpose
    out_dtype: bool = False
    # The factor is a 0/1 indicator, a boolean converted (reduce_max's location_indicators): this boolean.
    # The product is then select(b, t, 0), which is what XLA makes of JAX's own t * convert(b) (+0 where b
    # is false, whatever t's sign; 0 for an infinite t: masked, as SAFE wants).
    indicator: compat.Atom | None = None
    # The differentiated inputs (their positions among the tangents) the tangent ``source`` comes from.
    origins: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class _Program:
    """JAX's JVP of one primitive application, annotated for the safe re-play."""

    jaxpr: compat.Jaxpr
    consts: tuple[object, ...]
    kinds: tuple[str, ...]  # one per equation
    scales: tuple[_Scale | None, ...]  # for _SCALE equations

    @property
    def masks(self) -> bool:
        return _SCALE in self.kinds


def _is_inexact(x: object) -> bool:
    return bool(jnp.issubdtype(compat.aval_of(x).dtype, jnp.inexact))


def _finite_literal(a: compat.Atom) -> bool:
    return isinstance(a, compat.Literal) and bool(np.all(np.isfinite(a.val)))


def _same_params(a: Mapping[str, object], b: Mapping[str, object]) -> bool:
    try:
        return bool(dict(a) == dict(b))
    except Exception:
        return False


def _trace_program(prim: compat.Primitive, params: tuple[tuple[str, object], ...],
                   structs: tuple[jax.ShapeDtypeStruct, ...], diff: tuple[bool, ...]) -> _Program:
    kw = dict(params)
    idx = [i for i, d in enumerate(diff) if d]

    def jvp_of(*args: jax.Array) -> object:
        primals, tangents = list(args[:len(structs)]), args[len(structs):]

        def f(*dyn: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
            xs = list(primals)
            for i, x in zip(idx, dyn):
                xs[i] = x
            out = compat.bind_primitive(prim, xs, kw)
            return out[0] if len(out) == 1 else tuple(out)

        return jax.jvp(f, tuple(primals[i] for i in idx), tuple(tangents))[1]

    # JAX's own rules assume its default promotion (pow's rule mixes an integer exponent into a float
    # result): traced under it, they become explicit converts, whatever the user's setting.
    with jax.numpy_dtype_promotion("standard"):
        closed = compat.trace(jvp_of, [*structs, *(structs[i] for i in idx)])
    jaxpr, consts = compat.jaxpr_parts(closed)
    eqns = list(jaxpr.eqns)
    primal_vars = list(jaxpr.invars[:len(structs)])
    linear = set(jaxpr.invars[len(structs):])
    origin: dict[object, frozenset[int]] = {v: frozenset({k}) for k, v in enumerate(jaxpr.invars[len(structs):])}
    indicators = {e.outvars[0]: e.invars[0] for e in eqns  # a boolean converted to a number: a 0/1 indicator
                  if e.primitive.name == "convert_element_type" and not compat.is_literal(e.invars[0])
                  and walk.shaped(e.invars[0].aval).dtype == np.dtype(bool)}
    kinds: list[str] = []
    scales: list[_Scale | None] = []
    for eqn in eqns:
        lin = [not compat.is_literal(a) and a in linear for a in eqn.invars]
        kind, scale = _LINEAR, None
        if not any(lin):
            # The primitive's own result: same primitive, inputs and parameters (integer_pow's JVP
            # has another integer_pow of x, with y - 1), computed once, first.
            same = (eqn.primitive is prim and list(eqn.invars) == primal_vars and _same_params(eqn.params, kw)
                    and _PRIMAL not in kinds)
            kind = _PRIMAL if same else _VALUE
        else:
            linear.update(eqn.outvars)
            came = frozenset().union(*(origin.get(a, frozenset()) for a, is_lin in zip(eqn.invars, lin) if is_lin))
            for v in eqn.outvars:
                origin[v] = came
            name = eqn.primitive.name
            if len(lin) == 2 and sum(lin) == 1 and (name == "mul" or (name == "div" and lin[0])):
                src, factor = eqn.invars[lin.index(True)], eqn.invars[1 - lin.index(True)]
                if not _finite_literal(factor):  # a product with a finite constant needs no mask
                    # Each product masked on its own, in JAX's order of operations: the values are
                    # JAX's wherever nothing is 0 * inf, in forward and in reverse mode.
                    indicator = (indicators.get(factor) if name == "mul" and isinstance(factor, compat.Var)
                                 else None)
                    kind, scale = _SCALE, _Scale(src, factor, name == "div",
                                                 eqn.params.get("out_dtype") is not None, indicator,
                                                 tuple(sorted(origin.get(src, frozenset()))))
        kinds.append(kind)
        scales.append(scale)
    return _Program(jaxpr, tuple(consts), tuple(kinds), tuple(scales))


@functools.lru_cache(maxsize=4096)
def _cached_program(prim: compat.Primitive, params: tuple[tuple[str, object], ...],
                    structs: tuple[jax.ShapeDtypeStruct, ...], diff: tuple[bool, ...], context: Hashable) -> _Program:
    del context  # part of the key only: x64 and friends change the traced program
    return _trace_program(prim, params, structs, diff)


def program(prim: compat.Primitive, params: Mapping[str, object], inputs: Sequence[ArrayLike],
            diff: tuple[bool, ...]) -> _Program:
    """JAX's JVP of ``prim`` at inputs like ``inputs`` w.r.t. the inputs flagged in ``diff`` (cached)."""
    items = tuple(sorted(dict(params).items()))
    structs = tuple(compat.struct_of(compat.aval_of(x), placement=False) for x in inputs)
    try:
        return _cached_program(prim, items, structs, diff, compat.trace_context())
    except TypeError as e:  # an unhashable parameter: trace it every time
        if "unhashable" not in str(e):
            raise
        return _trace_program(prim, items, structs, diff)


def as_dtype(x: ArrayLike, dtype: DTypeLike) -> jax.Array | np.ndarray:
    """``x`` as ``dtype``: a convert for JAX values (no ``jnp.asarray``: under ``vmap`` that is a
    ``device_put``, which makes JAX import and register more of itself), NumPy for constants."""
    if isinstance(x, (jax.Array, compat.Tracer)):
        return x if x.dtype == dtype else lax.convert_element_type(x, dtype)
    return np.asarray(x, dtype)


def _step_mask(step: _Scale, masks: Sequence[ArrayLike | None] | None, shape: tuple[int, ...]) -> jax.Array | None:
    """Where the product ``step`` is masked: on every path its tangent comes from (``None``: nowhere)."""
    if masks is None:
        return None
    picked = [masks[k] for k in (step.origins or range(len(masks)))]
    if not picked or any(m is None for m in picked):
        return None
    m = cast(jax.Array, picked[0])
    for other in picked[1:]:
        m = jnp.logical_and(m, cast(jax.Array, other))
    if np.shape(m) != shape:
        try:
            m = jnp.broadcast_to(m, shape)
        except ValueError:
            return None
    return m


def _apply_scale(step: _Scale, env: dict[compat.Var, object], aval: compat.ShapedArray,
                 masks: Sequence[ArrayLike | None] | None = None) -> jax.Array:
    shape, dtype = tuple(aval.shape), aval.dtype
    if masks is not None:  # masks found by dataflow: masked_scale, JAX's product elsewhere
        dm = compat.read_atom(env, step.factor)
        dm = jnp.broadcast_to(dm if step.out_dtype and _is_array(dm) else as_dtype(dm, dtype), shape)
        um = compat.read_atom(env, step.source)
        um = jnp.broadcast_to(um, shape) if np.shape(um) != shape else um
        m = _step_mask(step, masks, shape)
        if m is None:
            prod: jax.Array = (lax.div(um, dm) if step.divide else
                               (lax.mul(um, dm) if not step.out_dtype else
                                lax.mul(as_dtype(um, dtype), as_dtype(dm, dtype))))
            return prod
        return compat.masked_scale(um, dm, m, divide=step.divide, out_dtype=dtype if step.out_dtype else None)
    d = compat.read_atom(env, step.factor)
    d = jnp.broadcast_to(d if step.out_dtype and _is_array(d) else as_dtype(d, dtype), shape)
    u = compat.read_atom(env, step.source)
    u = jnp.broadcast_to(u, shape) if np.shape(u) != shape else u  # a rank-0 or size-1 operand: broadcast
    if step.indicator is not None and u.dtype == dtype:
        b, u = compat.match_varying([jnp.broadcast_to(compat.read_atom(env, step.indicator), shape), u])
        picked: jax.Array = lax.select(b, u, lax.full_like(u, 0))  # linear in u: transposes to a select
        return picked
    scaled: jax.Array = compat.safe_scale(u, d, divide=step.divide, out_dtype=dtype if step.out_dtype else None)
    return scaled


def _is_array(x: object) -> bool:
    return isinstance(x, (jax.Array, compat.Tracer, np.ndarray))


def replay(prog: _Program, primals: Sequence[ArrayLike], tangents: Sequence[ArrayLike],
           outputs: Sequence[jax.Array] | None = None,
           masks: Sequence[ArrayLike | None] | None = None) -> list[jax.Array]:
    """Evaluates the program with masked products; ``outputs`` stand for the primitive's own result.

    Without ``masks``, each product is 0 where its tangent is 0 (``safe_scale``: the opt-in rules). With
    ``masks`` (one boolean per differentiated input, found by dataflow), a product is 0 exactly where
    the paths its tangent comes from are masked, and JAX's product elsewhere; the primal quantities of
    the derivative are masked where every path is.
    """
    every: ArrayLike | None = None
    if masks is not None and masks and all(m is not None for m in masks):
        every = cast(jax.Array, masks[0])
        for other in masks[1:]:
            every = jnp.logical_and(every, cast(jax.Array, other))
    env: dict[compat.Var, object] = {}
    jaxpr = prog.jaxpr
    for v, c in zip(jaxpr.constvars, prog.consts):
        env[v] = c
    for v, x in zip(jaxpr.invars, [*primals, *tangents]):
        env[v] = x
    for eqn, kind, step in zip(jaxpr.eqns, prog.kinds, prog.scales):
        if kind == _SCALE:
            assert step is not None  # every scaled equation has its scale
            outs = [_apply_scale(step, env, walk.shaped(eqn.outvars[0].aval), masks)]
        else:
            ins = [compat.read_atom(env, a) for a in eqn.invars]
            if kind == _PRIMAL and outputs is not None:
                outs = list(outputs)
            elif kind in (_PRIMAL, _VALUE) and masks is not None:
                shape = tuple(walk.shaped(eqn.outvars[0].aval).shape) if len(eqn.outvars) == 1 else None
                fits = every is not None and shape is not None and np.shape(every) == shape
                outs = (masked_bind(eqn.primitive, eqn.params, ins, [compat.is_literal(a) for a in eqn.invars],
                                    cast(jax.Array, every)) if fits else
                        compat.bind_primitive(eqn.primitive, compat.match_varying(ins), dict(eqn.params)))
            elif kind in (_PRIMAL, _VALUE):
                outs = safe_bind(eqn.primitive, eqn.params, ins, [compat.is_literal(a) for a in eqn.invars])
            else:
                outs = compat.bind(eqn, compat.match_varying(ins))
        for v, x in zip(eqn.outvars, outs):
            env[v] = x
    return [compat.read_atom(env, a) for a in jaxpr.outvars]


def safe_bind(prim: compat.Primitive, params: Mapping[str, object], inputs: Sequence[ArrayLike],
              fixed: Sequence[bool] | None = None) -> list[jax.Array]:
    """``prim`` applied to ``inputs``, with a safe derivative (a ``custom_jvp``) where its JVP scales.

    The value is the primitive's own; only its derivative changes, and only
    where JAX's rule multiplies a tangent by a primal quantity. Inputs flagged
    in ``fixed`` (constants of the program) are not differentiated.
    """
    kw = dict(params)
    fixed = fixed or [False] * len(inputs)
    diff = tuple(_is_inexact(x) and not c for x, c in zip(inputs, fixed))
    inputs = compat.match_varying(inputs)
    if prim.multiple_results or not any(diff) or walk.subprograms(kw) or _by_constant(prim, inputs, fixed):
        return compat.bind_primitive(prim, inputs, kw)
    try:
        prog = program(prim, kw, inputs, diff)
    except Exception:
        return compat.bind_primitive(prim, inputs, kw)
    if not prog.masks:
        return compat.bind_primitive(prim, inputs, kw)
    idx = [i for i, d in enumerate(diff) if d]

    # Every input is an argument, the fixed ones too: JAX memoizes the traced
    # JVP with the program, so it must close over no value of this trace
    # (inside shard_map, match_varying made even the constants traced values).
    @jax.custom_jvp
    def f(*xs: jax.Array) -> jax.Array:
        out: jax.Array = compat.bind_primitive(prim, list(xs), kw)[0]
        return out

    @f.defjvp
    def f_jvp(primals: tuple[jax.Array, ...], tangents: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        out = f(*primals)  # the fixed inputs' tangents are dropped: they are constants of the program
        return out, replay(prog, list(primals), [tangents[i] for i in idx], [out])[0]

    return [f(*inputs)]


def masked_bind(prim: compat.Primitive, params: Mapping[str, object], inputs: Sequence[ArrayLike],
                fixed: Sequence[bool] | None, dead: ArrayLike | Sequence[ArrayLike | None]) -> list[jax.Array]:
    """``prim`` applied to ``inputs``, its derivative exactly 0 where dataflow found the paths masked.

    ``dead``: one boolean array per input (``None`` for one with no mask: JAX's product), or one array for
    all of them. The value is the primitive's own; the derivative is JAX's, each product by a primal
    factor replaced by ``masked_scale`` (JAX's product where nothing is masked), at every order.
    """
    kw = dict(params)
    fixed = list(fixed or [False] * len(inputs))
    per_input = list(dead) if isinstance(dead, (list, tuple)) else [dead] * len(inputs)
    diff = tuple(_is_inexact(x) and not c for x, c in zip(inputs, fixed))
    inputs = compat.match_varying(inputs)
    if prim.multiple_results or not any(diff) or walk.subprograms(kw):
        return compat.bind_primitive(prim, inputs, kw)
    try:
        program(prim, kw, inputs, diff)
    except Exception:
        return compat.bind_primitive(prim, inputs, kw)
    n = len(inputs)
    try:  # an elementwise primitive: every mask in the output's shape
        shape = tuple(np.broadcast_shapes(*(np.shape(x) for x in inputs)))
        mask_args = [jnp.zeros(shape, bool) if m is None else jnp.broadcast_to(cast(jax.Array, m), shape)
                     for m in per_input]
    except ValueError:
        return compat.bind_primitive(prim, inputs, kw)
    has_mask = [m is not None for m in per_input]

    def primal(*args: jax.Array) -> jax.Array:
        out: jax.Array = compat.bind_primitive(prim, list(args[:n]), kw)[0]
        return out

    primal.__name__ = primal.__qualname__ = compat.rule_wrapper_name(prim.name)  # as the splicer names rules
    f = jax.custom_jvp(primal)

    def f_jvp(primals: tuple[jax.Array, ...], tangents: tuple[Any, ...]) -> tuple[jax.Array, jax.Array]:
        xs, ms = list(primals[:n]), primals[n:]
        out = f(*primals)
        live = tuple(d and not isinstance(t, SymbolicZero) for d, t in zip(diff, tangents[:n]))
        if not any(live):
            return out, lax.full_like(out, 0)
        prog = program(prim, kw, xs, live)
        ts = [as_dtype(t, compat.aval_of(x).dtype) for x, t, d in zip(xs, tangents[:n], live) if d]
        masks = [ms[i] if has_mask[i] else None for i, d in enumerate(live) if d]
        return out, replay(prog, xs, ts, [out], masks)[0]

    f.defjvp(f_jvp, symbolic_zeros=True)
    return [f(*inputs, *mask_args)]


def _by_constant(prim: compat.Primitive, inputs: Sequence[object], fixed: Sequence[bool]) -> bool:
    """``c * x``, ``x * c`` or ``x / c`` with ``c`` a finite nonzero constant: its safe derivative is JAX's.

    The case of :func:`keeps_jax_derivative`, for a primal quantity of a
    derivative (``2 * x`` in ``x ** 2``'s): no ``custom_jvp`` layer for it.
    """
    if prim.name not in ("mul", "div") or len(inputs) != 2 or sum(fixed) != 1 or (prim.name == "div" and fixed[0]):
        return False
    c = inputs[list(fixed).index(True)]
    return not isinstance(c, compat.Tracer) and nonzero_normal(c)


def nonzero_normal(c: object) -> bool:
    """Every element of the constant ``c`` is finite and nonzero, and not subnormal (a float).

    Subnormals are excluded: XLA's CPU backend reads them as 0, and there
    ``safe_scale`` masks where a plain product would not.
    """
    a = np.asarray(c)
    if a.dtype.kind == "f" or a.dtype.name in ("bfloat16", "float16") or jnp.issubdtype(a.dtype, jnp.floating):
        tiny = float(jnp.finfo(a.dtype).tiny)
        m = np.abs(a.astype(np.float64))
        return bool(a.size and np.all(np.isfinite(m)) and np.all(m >= tiny))
    return bool(a.size and np.all(a != 0)) if a.dtype.kind in "iub" else False


# --------------------------------------------------------------------------- the rules


def _lax_params(target: str, op: OpView) -> dict[str, object]:
    """The primitive's parameters for a rule retargeted to another op (a gk.op wrapping the primitive)."""
    fn = getattr(lax, target, None)
    error: Exception | None = None
    # A named op's keyword arguments may be the primitive's (integer_pow's y); a jit-ed function's are jit's.
    for kw in (dict(op.params), {}):
        try:
            jaxpr = jax.make_jaxpr(lambda *xs, kw=kw: fn(*xs, **kw))(*op.inputs)  # type: ignore[misc]
            return dict(next(e for e in compat.jaxpr_parts(jaxpr)[0].eqns if e.primitive.name == target).params)
        except Exception as e:
            error = error or e
    raise GradkitError(
        f"rule gradkit.safe[{target}] for op '{op.name}' at {op.source}: the op's inputs and keyword arguments "
        f"({len(op.inputs)} inputs, {sorted(op.params)}) do not make one lax.{target} call ({error}). Use "
        f"{{rule = \"safe\", op = \"{target}\"}} only on an op that computes lax.{target} of its inputs.")


class SafeRuleFn(Protocol):
    """A SAFE JVP rule function, with the predicate the splicer reads (:func:`keeps_jax_derivative`)."""

    keeps_jax_derivative: Callable[..., bool]

    def __call__(self, op: OpView, tangents: tuple[jax.Array | None, ...], /) -> object: ...


def safe_rule(target: str, masked: bool = True) -> SafeRuleFn:
    """The SAFE JVP rule for primitive ``target`` (usable on an op that wraps it, too).

    With ``masked``, the rule carries ``masked``: the binder the dispatcher uses on the primitive itself,
    with masks found by dataflow (core/masks.py). Without, or on an op that wraps the primitive, the
    rule masks wherever the incoming (co)tangent is 0.
    """
    prim = compat.primitive_by_name(target)
    if prim is None:  # pragma: no cover - every SAFE target is a lax primitive
        raise GradkitError(f"internal: no JAX primitive named {target!r} for a SAFE rule.")

    def rule(op: OpView, tangents: tuple[jax.Array | None, ...]) -> jax.Array | tuple[jax.Array, ...] | None:
        inputs = list(op.inputs)
        diff = tuple(t is not None and _is_inexact(x) for x, t in zip(inputs, tangents))
        if not any(diff):
            return None
        own = op.name == target
        params = dict(op.params) if own else _lax_params(target, op)
        prog = program(prim, params, inputs, diff)
        ts = [as_dtype(t, compat.aval_of(x).dtype) for x, t, d in zip(inputs, tangents, diff) if d and t is not None]
        out = replay(prog, inputs, ts, op.outputs if own else None)
        return out[0] if len(out) == 1 else tuple(out)

    fn = cast(SafeRuleFn, rule)
    fn.keeps_jax_derivative = keeps_jax_derivative  # read by the splicer
    if masked:
        def bind_masked(eqn: compat.JaxprEqn, ins: Sequence[ArrayLike], dead: Sequence[ArrayLike | None]
                        ) -> list[jax.Array]:
            return masked_bind(eqn.primitive, eqn.params, ins, [compat.is_literal(a) for a in eqn.invars], dead)

        fn.masked = bind_masked  # type: ignore[attr-defined]
    return fn


def keeps_jax_derivative(eqn: compat.JaxprEqn, constant: Callable[[compat.Atom], object] = lambda atom: None) -> bool:
    """Whether SAFE's rule on ``eqn`` is JAX's own derivative, bit for bit, at every order.

    ``constant(atom)`` is the value of an input the program computes from
    literals alone (``broadcast_in_dim 1.0``, ``0.5 * that``: the seed of a
    ``jax.grad`` inside the program), every element equal, or ``None``.
    Two cases, read from the equation and those values alone:

    * no input of an inexact type varies (every one a literal or such a
      constant): the derivative is 0 in every mode and at every order,
      with or without the rule;
    * ``x * c``, ``c * x`` or ``x / c`` with ``c`` a literal or such a
      constant, finite, nonzero and not subnormal: the rule's one product
      is ``safe_scale(t, c)``, which masks nothing there (``t * c``,
      ``t / c``, bit for bit), and it has no primal quantity to make safe.

    The splicer leaves such an equation as it is: no ``custom_jvp`` layer,
    no rule traced, no mask for XLA to compile.
    """
    values = [a.val if isinstance(a, compat.Literal) else constant(a) for a in eqn.invars]
    if all(v is not None or not jnp.issubdtype(walk.shaped(a.aval).dtype, jnp.inexact)
           for a, v in zip(eqn.invars, values)):
        return True
    fixed = [v is not None for v in values]
    return _by_constant(eqn.primitive, values, fixed)


# --------------------------------------------------------------------------- opt-in: a fully masked row's NaN
#
# A softmax over a row whose scores are all -inf computes -inf - (-inf) = NaN for the whole row in its
# max shift. A loss that drops that row with a `where` has a finite value, but the backward pass
# multiplies the row's NaN by its zero cotangent: in `exp`'s derivative (exp(x) t) and in the matrix
# product that follows (p @ v: v's cotangent is p^T g). These rules give those products exactly 0 where
# the (co)tangent is 0 and the value is NaN: the derivative of a loss that never uses the row.


def safe_exp_rule() -> Callable[[OpView, tuple[jax.Array | None, ...]], jax.Array | None]:
    """``exp``'s JVP ``t * exp(x)``, 0 where ``t`` is 0 and the value is NaN (a NaN input); JAX's elsewhere.

    An overflowed ``exp`` (``inf``) keeps JAX's ``0 * inf = NaN``: a zero
    cotangent reaching it is usually ``1/inf`` from downstream, not a mask
    (why ``exp`` is not in SAFE).
    """

    def rule(op: OpView, tangents: tuple[jax.Array | None, ...]) -> jax.Array | None:
        t0 = tangents[0] if tangents else None
        if t0 is None:
            return None
        y = op.outputs[0]
        t = as_dtype(t0, compat.aval_of(y).dtype)
        nan = jnp.isnan(y)
        # both branches are transposed: the plain product must not meet the NaN either
        return jnp.where(nan, compat.safe_scale(t, y), t * jnp.where(nan, jnp.zeros((), y.dtype), y))

    return rule


def _dead_term(prim: compat.Primitive, params: dict[str, Any], primal: jax.Array, t: jax.Array | np.ndarray,
               primal_is_lhs: bool, out_aval: compat.ShapedArray) -> jax.Array:
    """The tangent term ``dot(primal, t)`` (or ``dot(t, primal)``), 0 where ``t`` meets a dead row as 0.

    A dead row of ``primal``: all its elements along the contracting dims are non-finite (a fully
    masked softmax row). Its products with ``t`` are 0 where the ``t`` it meets is 0 — the
    two-sided zero product of SAFE, for the row as a whole — and NaN elsewhere (JAX gives NaN or
    inf there). Rows with some finite elements are JAX's. Linear in ``t``: the dead rows are zeroed
    in the primal, and their contribution is ``safe_scale`` of a NaN by ``t``'s sum along the
    contraction, broadcast over the dead rows.
    """
    (lc, rc), (lb, rb) = params["dimension_numbers"]
    pc, pb, tc, tb = (lc, lb, rc, rb) if primal_is_lhs else (rc, rb, lc, lb)
    pc, pb, tc, tb = (tuple(int(d) for d in x) for x in (pc, pb, tc, tb))
    shape, dtype = tuple(out_aval.shape), out_aval.dtype
    nb = len(pb)
    p_free = [d for d in range(np.ndim(primal)) if d not in pc and d not in pb]
    t_free = [d for d in range(np.ndim(t)) if d not in tc and d not in tb]
    size = int(np.prod([np.shape(primal)[d] for d in pc], dtype=np.int64))
    dead = jnp.all(~jnp.isfinite(primal), axis=pc, keepdims=True) & (size > 0)
    rest_primal = jnp.where(dead, jnp.zeros((), primal.dtype), primal)
    args = [rest_primal, t] if primal_is_lhs else [t, rest_primal]
    rest = compat.bind_primitive(prim, args, params)[0]
    # the output dims of the primal's free dims, and of t's
    p_at, t_at = (nb, nb + len(p_free)) if primal_is_lhs else (nb + len(t_free), nb)
    keep_p = [d for d in range(np.ndim(primal)) if d not in pc]
    m = jnp.squeeze(dead, axis=pc) if pc else dead
    m = lax.transpose(m, tuple([keep_p.index(d) for d in pb] + [keep_p.index(d) for d in p_free]))
    # Both masks in the output's sharding (Explicit mesh axes: the product's out_sharding; the primal factor
    # may be replicated where the output is sharded), as the product they select in.
    sharding = getattr(out_aval, "sharding", None)
    m_out = lax.broadcast_in_dim(m, shape, tuple(range(nb)) + tuple(range(p_at, p_at + len(p_free))),
                                 out_sharding=sharding)
    nan = jnp.full(np.shape(t), jnp.nan, t.dtype)
    hit = compat.safe_scale(t, nan)  # NaN where t is not 0, else 0: linear in t
    e = jnp.sum(hit, axis=tc) if tc else hit
    keep_t = [d for d in range(np.ndim(t)) if d not in tc]
    e = lax.transpose(e, tuple([keep_t.index(d) for d in tb] + [keep_t.index(d) for d in t_free]))
    e_out = lax.broadcast_in_dim(as_dtype(e, dtype), shape, tuple(range(nb)) + tuple(range(t_at, t_at + len(t_free))),
                                 out_sharding=sharding)
    bad = compat.safe_scale(e_out, as_dtype(m_out, dtype))  # the NaN only on dead rows (0 · NaN is 0 here)
    rest = as_dtype(rest, dtype)
    return jnp.where(m_out, rest + bad, rest)


def safe_dot_general_rule() -> Callable[[OpView, tuple[jax.Array | None, ...]], jax.Array | None]:
    """``dot_general``'s JVP with dead rows (all non-finite along the contraction) 0 where their tangent is 0."""
    prim = compat.primitive_by_name("dot_general")
    if prim is None:  # pragma: no cover - a lax primitive
        raise GradkitError("internal: no JAX primitive named 'dot_general' for a SAFE rule.")

    def rule(op: OpView, tangents: tuple[jax.Array | None, ...]) -> jax.Array | None:
        params = dict(op.params)

        if "dimension_numbers" not in params or len(op.inputs) != 2:
            raise GradkitError(
                f"rule gradkit.safe[dot_general] for op '{op.name}' at {op.source}: the op is not a "
                "lax.dot_general (no dimension_numbers). Use {\"dot_general\": \"safe\"} on the primitive "
                "dot_general (jnp.matmul, @, jnp.einsum, jnp.dot).")
        lhs, rhs = op.inputs
        out_aval = compat.aval_of(op.outputs[0])
        terms = []
        for k, (primal, t) in enumerate(((lhs, tangents[1]), (rhs, tangents[0]))):
            if t is None or not _is_inexact(t):
                continue
            terms.append(_dead_term(prim, params, primal, as_dtype(t, compat.aval_of(op.inputs[1 - k]).dtype), k == 0,
                                    out_aval))

        if not terms:
            return None
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    return rule
