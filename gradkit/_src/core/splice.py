"""The rewrite: each matched equation is replaced by one equation that carries the rule.

A matched equation ``y = p[params] x`` becomes ``y = custom_vjp_call[...] x``
(VJP rule) or ``y = custom_jvp_call[...] x`` (JVP rule), whose primal is the
equation itself, so the forward pass is unchanged. The replacement is traced
once per *signature* — rule, op name, primitive, params, input types, literal
inputs, source line — and reused with its variables swapped for every
equation of that signature: 48 identical transformer blocks cost one trace.
Everything else in the program is shared, not re-traced
(:class:`gradkit._src.core.walk.Rewrite`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.compat import JaxprEqn
from gradkit._src.core import named, validate, walk
from gradkit._src.core.cache import LRU
from gradkit._src.core.rule import OpView, Rule, freeze_params
from gradkit._src.core.table import RuleTable
from gradkit._src.errors import GradkitError


def op_name(eqn: JaxprEqn) -> str:
    """The name a table entry must have to match ``eqn`` (see :func:`compat.eqn_name`)."""
    name = compat.eqn_name(eqn)
    if name.startswith(compat.NAMED_OP_PREFIX):
        inst = named.lookup(name)
        return inst.name if inst is not None else name.split(":", 2)[-1]
    return name


class CacheInfo(NamedTuple):
    """Counters of an overridden function's caches (see ``Overridden.cache_info``).

    Attributes:
      traces: times the user's function was traced (once per input signature).
      replacements: replacement equations traced (once per distinct matched signature).
      reuses: matched equations that reused a replacement traced before.
    """

    traces: int
    replacements: int
    reuses: int


def _params_key(params: Mapping[str, object]) -> Hashable | None:
    """A hashable key of an equation's params, or ``None`` if one is unhashable."""
    try:
        key = tuple(sorted(params.items(), key=lambda kv: kv[0]))
        hash(key)
    except TypeError:
        return None
    return key


def _literal_key(atom: compat.Literal) -> tuple[str, tuple[int, ...], bytes]:
    v = np.asarray(atom.val)
    return (v.dtype.str, v.shape, v.tobytes())


class Replacements:
    """Replacement equations by signature; shared by every trace of one overridden function."""

    def __init__(self) -> None:
        self._cache: LRU[Hashable, JaxprEqn] = LRU("rule replacements")
        self._lock = threading.Lock()
        self.traced = 0
        self.reused = 0

    def clear(self) -> None:
        self._cache.cache_clear()

    def splice(self, rule: Rule, name: str, eqn: JaxprEqn) -> JaxprEqn:
        """The equation that replaces ``eqn`` (same variables) and carries ``rule``."""
        dyn = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a)]
        params = _params_key(eqn.params)
        key: Hashable | None = None
        if params is not None:
            key = (rule, name, eqn.primitive, params, eqn.ctx, compat.source_line(eqn),
                   tuple(eqn.invars[i].aval for i in dyn),
                   tuple((i, _literal_key(a)) for i, a in enumerate(eqn.invars) if isinstance(a, compat.Literal)))
        template = self._cache.get(key) if key is not None else None
        if template is None:
            template = _replacement(rule, name, eqn, dyn)
            with self._lock:
                self.traced += 1
            if key is not None:
                self._cache.setdefault(key, template)
        else:
            with self._lock:
                self.reused += 1
        placed: JaxprEqn = template.replace(invars=[eqn.invars[i] for i in dyn], outvars=list(eqn.outvars),
                                            source_info=eqn.source_info, ctx=eqn.ctx)
        return placed


def _traced_captures(fn: object) -> list[str]:
    """Names of the values ``fn`` closes over (cells, defaults, ``partial`` arguments) that hold a tracer."""
    found: list[str] = []
    seen: set[int] = set()

    def visit(f: object, depth: int) -> None:
        if depth > 3 or id(f) in seen:
            return
        seen.add(id(f))
        if isinstance(f, functools.partial):
            for i, v in enumerate((*f.args, *f.keywords.values())):
                check(f"argument {i} of functools.partial({getattr(f.func, '__name__', f.func)!r})", v, depth)
            visit(f.func, depth + 1)
            return
        code = getattr(f, "__code__", None)
        for var, cell in zip(getattr(code, "co_freevars", ()), getattr(f, "__closure__", None) or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            check(f"`{var}`", value, depth)
        for i, v in enumerate(getattr(f, "__defaults__", None) or ()):
            check(f"default argument {i}", v, depth)

    def check(label: str, value: object, depth: int) -> None:
        if callable(value) and not isinstance(value, compat.Tracer):
            visit(value, depth + 1)
            return
        try:
            leaves = jax.tree_util.tree_leaves(value)
        except Exception:  # not a pytree JAX can flatten: not a traced value
            return
        if any(isinstance(x, compat.Tracer) for x in leaves):
            found.append(label)

    visit(fn, 0)
    return found


def _closure_error(rule: Rule, name: str, eqn: JaxprEqn, what: str) -> GradkitError:
    return GradkitError(
        f"rule {rule.name} for op '{name}' at {compat.source_line(eqn)} closes over a traced value ({what}): "
        "a value computed inside a jax.jit / grad / vmap trace, such as a scale computed in the training step. "
        "A table rule is compiled apart from that trace, so it cannot read it. Pass the value in instead: "
        "make it an input of the op (wrap the computation in gk.op(name) with the value as a positional "
        "argument and read op.inputs[i] in the rule), or write the function with gk.custom_gradient, "
        "whose grad_fn may close over traced values; a constant (Python or NumPy number) may be closed over.")


def _replacement(rule: Rule, name: str, eqn: JaxprEqn, dyn: list[int]) -> JaxprEqn:
    avals = [eqn.invars[i].aval for i in dyn]
    captured = _traced_captures(rule.fn)
    if captured:
        raise _closure_error(rule, name, eqn, ", ".join(captured))

    def fn(*xs: jax.Array) -> list[ArrayLike]:
        return apply_rule(rule, eqn, name, xs)

    with compat.source_of(eqn), eqn.ctx.manager:
        closed = compat.trace_avals(fn, avals, compat.rule_wrapper_name(name))
        if any(isinstance(c, compat.Tracer) for c in compat.jaxpr_parts(closed)[1]):
            raise _closure_error(rule, name, eqn, "reached through another function or object")
        single = compat.single_equation(closed)
        if single is None:  # more than one equation (or consts): wrap them in one jit equation
            single = compat.single_equation(compat.trace_avals(jax.jit(fn), avals, compat.rule_wrapper_name(name)))
    if single is None:
        raise GradkitError(
            f"internal: the rule {rule.name} for op '{name}' at {compat.source_line(eqn)} did not trace to one "
            "equation; please report this with the program that triggered it.")
    return single


class Splicer:
    """``replace`` for :class:`gradkit._src.core.walk.Rewrite`: matched equations -> their replacement."""

    def __init__(self, table: RuleTable, replacements: Replacements) -> None:
        self.table = table
        self.replacements = replacements
        self.matched: dict[str, str] = {}  # table key (op name, or "<scope>::<op>") -> source line of its first match
        self._scoped_ops = table.scoped_ops
        # Values the program computes from literals alone, every element equal (see _constant_value):
        # the walk hands over every equation of a program in order, so an input's entry is made before it is read.
        self._constants: dict[compat.Var, _Constant] = {}

    @property
    def scoped(self) -> bool:
        """Whether the table has scoped entries: the walk must pass each equation's enclosing scopes."""
        return bool(self._scoped_ops)

    def constant(self, atom: compat.Atom) -> np.generic | np.ndarray | None:
        """The value of ``atom`` (every element equal) if the program computes it from literals alone, else ``None``."""
        c = self._constants.get(atom) if not isinstance(atom, compat.Literal) else None
        return None if c is None else c.value

    def _rule_of(self, eqn: JaxprEqn, outer: tuple[str, ...]) -> tuple[str, Rule] | None:
        name = op_name(eqn)
        if name in self._scoped_ops:  # the equation's whole scopes: the enclosing equations' first
            return self.table.rule_for(name, outer + compat.name_scopes(eqn), lambda: compat.source_line(eqn))
        plain = self.table.get(name)
        return None if plain is None else (name, plain)

    @property
    def masked_names(self) -> frozenset[str]:
        """The primitives whose rule in the table is masked by dataflow (SAFE's singular ones)."""
        names = set()
        for key in self.table:
            rule = self.table.get(key)
            if rule is not None and _masked_binder(rule) is not None:
                names.add(key.split("::")[-1])
        return frozenset(names)

    def masked_match(self, eqn: JaxprEqn, outer: tuple[str, ...]) -> Callable[..., list[Any]] | None:
        """The masked binder for ``eqn`` (see :mod:`gradkit._src.core.masks`), or ``None``."""
        if walk.has_subprograms(eqn):
            return None
        hit = self._rule_of(eqn, outer)
        if hit is None or hit[0].split("::")[-1] != eqn.primitive.name:
            return None
        binder = _masked_binder(hit[1])
        if binder is None:
            return None
        if hit[0] not in self.matched:
            self.matched[hit[0]] = compat.source_line(eqn)
        replacements = self.replacements

        def counted(*args: Any) -> list[Any]:
            with replacements._lock:
                replacements.traced += 1
            return binder(*args)

        return counted

    def keeps_call(self, eqn: JaxprEqn) -> bool:
        """Whether a ``jit`` call stays a call (the table names it): not inlined for the masks."""
        name = op_name(eqn)
        return self.table.get(name) is not None or name in self._scoped_ops

    def __call__(self, eqn: JaxprEqn, outer: tuple[str, ...] = ()) -> list[JaxprEqn] | None:
        if not self.table:
            return None
        if eqn.invars and len(eqn.outvars) == 1:
            c = _constant_value(eqn, self._constants)
            if c is not None:
                self._constants[eqn.outvars[0]] = c
        hit = self._rule_of(eqn, outer)
        if hit is None:
            return None
        key, rule = hit
        name = op_name(eqn)
        if _masked_binder(rule) is not None and name == eqn.primitive.name:
            return None  # masked by dataflow (core/masks.py), or JAX's own where no mask reaches it
        if key not in self.matched:
            self.matched[key] = compat.source_line(eqn)
        # A library rule may know that, on this equation, it is JAX's own derivative bit for bit (SAFE's
        # product by a finite nonzero constant, a literal or a value computed from literals alone; an
        # equation with no varying input): the equation stays as it is, and costs nothing more.
        keeps = getattr(rule.fn, "keeps_jax_derivative", None)
        library = rule.key[:1] == ("gradkit",)
        if keeps is not None and name == eqn.primitive.name and library and keeps(eqn, self.constant):
            return None
        return [self.replacements.splice(rule, name, eqn)]


def _masked_binder(rule: Rule) -> Callable[..., list[Any]] | None:
    """A library rule's binder with dataflow masks (``rule.fn.masked``), or ``None``."""
    if rule.key[:1] != ("gradkit",):
        return None
    return getattr(rule.fn, "masked", None)


# --------------------------------------------------------------------------- constants of a program


class _Constant(NamedTuple):
    """A value computed from literals alone: every element ``value``, within a factor ``slack`` of it."""

    value: np.generic | np.ndarray  # a NumPy scalar (0-d) of the equation's output dtype
    slack: float  # >= 1: the value XLA computes lies in [value / slack, value * slack]


# Operations whose output is their one input's value (a splat stays a splat).
_SAME_VALUE = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "copy", "copy_p"})


def _constant_value(eqn: JaxprEqn, known: dict[compat.Var, _Constant]) -> _Constant | None:
    """The value of ``eqn``'s output if its inputs are literals or known constants and the operation is simple.

    Only values that are finite, nonzero and normal with a wide margin are
    kept (what SAFE needs to know about a factor): the check is made at
    every step, so XLA's own arithmetic on them (another rounding, a
    subnormal read as 0) lands on a finite, nonzero, normal value too. Any
    doubt gives ``None``: a constant not recognised only costs a mask.
    """
    # Runs for every equation while a program is rewritten: the cheap test first (most inputs are not constants).
    if any(not isinstance(a, compat.Literal) and a not in known for a in eqn.invars):
        return None
    dtype = walk.shaped(eqn.outvars[0].aval).dtype
    if not jax.numpy.issubdtype(dtype, jax.numpy.floating):  # before np.dtype: a PRNG key's dtype is not NumPy's
        return None
    out_dtype = np.dtype(dtype)
    ins: list[_Constant] = []
    for a in eqn.invars:
        if isinstance(a, compat.Literal):
            v = np.asarray(a.val)
            if v.ndim != 0 or not (jax.numpy.issubdtype(v.dtype, jax.numpy.floating)
                                   or jax.numpy.issubdtype(v.dtype, jax.numpy.integer)):
                return None
            ins.append(_Constant(v[()], 1.0))
        else:
            c = known.get(a)
            if c is None:
                return None
            ins.append(c)
    name = eqn.primitive.name
    eps = float(jax.numpy.finfo(out_dtype).eps)
    value: np.generic | np.ndarray
    try:
        with np.errstate(all="ignore"):
            if name in _SAME_VALUE and len(ins) == 1:
                value, slack = ins[0].value, ins[0].slack
            elif name == "convert_element_type" and len(ins) == 1:
                value, slack = ins[0].value, ins[0].slack * (1 + eps)
            elif name == "neg" and len(ins) == 1:
                value, slack = -np.asarray(ins[0].value, out_dtype), ins[0].slack
            elif name in ("mul", "div") and len(ins) == 2:
                x, y = (np.asarray(c.value, out_dtype) for c in ins)
                value, slack = (x * y if name == "mul" else x / y), ins[0].slack * ins[1].slack * (1 + eps)
            elif name == "reduce_sum" and len(ins) == 1:
                # n equal terms of one sign: no cancellation; each addition rounds once
                shape = walk.shaped(eqn.invars[0].aval).shape
                n = int(np.prod([shape[i] for i in eqn.params.get("axes", ())], dtype=np.int64))
                if n < 1 or n * eps > 0.25:
                    return None
                value = np.asarray(np.float64(ins[0].value) * n, out_dtype)
                slack = ins[0].slack * (1 + eps) ** (n + 1)
            else:
                return None
            scalar = np.asarray(value, out_dtype)[()]
            fi = jax.numpy.finfo(out_dtype)
            mag = abs(float(scalar))
            if not (np.isfinite(mag) and slack < 2.0 and mag / slack >= 4 * float(fi.tiny)
                    and mag * slack <= float(fi.max) / 4):
                return None
    except (TypeError, ValueError, OverflowError):
        return None
    return _Constant(scalar, slack)


def constant_value(eqn: JaxprEqn, known: dict[compat.Var, _Constant]) -> _Constant | None:
    """:func:`_constant_value` for other modules (SAFE's masks: a factor that masks nothing)."""
    return _constant_value(eqn, known)


# --------------------------------------------------------------------------- rules as custom_vjp / custom_jvp


def _view(eqn: JaxprEqn, name: str, inst: named.Signature | None, invals: Sequence[object], outs: Sequence[object],
          source: str) -> OpView:
    """The OpView a rule sees (a named op's ``inst`` rebuilds its arguments and outputs)."""
    if inst is not None:
        out = inst.outputs(list(outs))
        outputs = tuple(out) if isinstance(out, tuple) else (out,)
        return OpView(name, inst.args(list(invals)), outputs, freeze_params(inst.kwargs), source)
    return OpView(name, tuple(invals), tuple(outs), freeze_params(eqn.params), source)


def _per_input(inst: named.Signature | None, per_jit_input: Sequence[object]) -> tuple[object, ...]:
    """Tangents as the rule sees them: per op input (a named op's static leaves get ``None``)."""
    return inst.split.scatter(per_jit_input) if inst is not None else tuple(per_jit_input)


def _from_rule(inst: named.Signature | None, per_leaf: list[object]) -> list[object]:
    """One value per leaf of ``op.inputs`` -> one per jit input (a named op's static leaves dropped)."""
    return inst.dynamic(per_leaf) if inst is not None else per_leaf


def _structured(inst: named.Signature | None, flat: Sequence[object]) -> object:
    """Flat per-output values in the shape the rule sees (bare value for one output)."""
    if inst is not None:
        return inst.outputs(list(flat))
    return flat[0] if len(flat) == 1 else tuple(flat)


def apply_rule(rule: Rule, eqn: JaxprEqn, name: str, dyn_inputs: Sequence[jax.Array]) -> list[ArrayLike]:
    """``eqn`` applied to ``dyn_inputs`` (its non-literal inputs) inside a custom_vjp/custom_jvp carrying ``rule``."""
    # Literal inputs are constants of the program: closed over, not
    # differentiated; the rule's cotangent for them is dropped. The closures
    # below outlive this trace (JAX keeps the custom_vjp's bwd and the
    # custom_jvp's rule with the program), so they hold no tracer.
    dyn_pos = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a)]
    # Resolved once, here: the closures below keep the named op's signature alive.
    jit_name = eqn.params.get("name", "") if compat.is_jit(eqn) else ""
    # The user's line, taken now: inside a library's jitted body it is the caller's (compat.call_site), which
    # holds only while the program is rewritten, not when the rule runs.
    source = compat.source_line(eqn)
    inst = named.require(jit_name, source) if jit_name.startswith(compat.NAMED_OP_PREFIX) else None
    literals: list[ArrayLike | None] = [a.val if isinstance(a, compat.Literal) else None for a in eqn.invars]

    def full(dyn: Sequence[ArrayLike]) -> list[ArrayLike | None]:
        vals = list(literals)
        for i, x in zip(dyn_pos, dyn):
            vals[i] = x
        return vals  # no None left: dyn has one value per non-literal input

    def primal(*dyn: jax.Array) -> list[ArrayLike]:
        return compat.bind(eqn, full(dyn))

    primal.__name__ = primal.__qualname__ = compat.rule_wrapper_name(name)

    if rule.mode == "vjp":
        fn = jax.custom_vjp(primal)

        Residuals = tuple[tuple[jax.Array, ...], list[ArrayLike]]

        def fwd(*dyn: jax.Array) -> tuple[list[ArrayLike], Residuals]:
            outs = primal(*dyn)
            return outs, (dyn, outs)

        def bwd(res: Residuals, g: list[jax.Array]) -> tuple[ArrayLike, ...]:
            dyn, outs = res
            all_in = full(dyn)
            view = _view(eqn, name, inst, all_in, outs, source)
            g_in = [None if validate.is_float0(x) else x for x in g]
            cts = validate.checked_call(rule, view, _structured(inst, g_in))
            aligned = _from_rule(inst, validate.align(rule, view, cts, view.inputs, "cotangent"))
            flat = validate.check_all(rule, view, aligned, all_in, "cotangent")
            return tuple(flat[i] for i in dyn_pos)

        fn.defvjp(fwd, bwd)
        return list(fn(*dyn_inputs))

    jfn = jax.custom_jvp(primal)
    # A library rule takes None for an input that carries no tangent (a constant of the program, such as
    # data or a mask): it computes no term for it, as JAX's own rules do with their symbolic zeros. A user's
    # rule gets zeros there (JAX's instantiated zeros), as it always has.
    library = rule.key[:1] == ("gradkit",)

    def jvp(primals: tuple[jax.Array, ...], tangents: tuple[jax.Array | SymbolicZero, ...]
            ) -> tuple[list[ArrayLike], list[ArrayLike]]:
        outs = jfn(*primals)  # calling the custom function keeps the rule in force at every order
        all_in = full(primals)
        view = _view(eqn, name, inst, all_in, outs, source)
        t_all: list[jax.Array | None] = [None] * len(literals)
        for i, t in zip(dyn_pos, tangents):
            t_all[i] = None if isinstance(t, SymbolicZero) or validate.is_float0(t) else t
        t_out = validate.checked_call(rule, view, _per_input(inst, t_all))
        like = view.outputs
        aligned = validate.align(rule, view, t_out, like, "output tangent")
        flat = validate.check_all(rule, view, aligned, outs, "output tangent")
        if not library:  # library rules are linear by construction
            _check_linear(rule, view, inst, t_all, outs)
        return outs, flat

    jfn.defjvp(jvp, symbolic_zeros=library)
    return list(jfn(*dyn_inputs))


def _check_linear(rule: Rule, view: OpView, inst: named.Signature | None, t_all: list[jax.Array | None],
                  outs: Sequence[ArrayLike]) -> None:
    """Raises if a JVP rule is not linear in its tangents.

    Reverse mode transposes the rule; a nonlinear one (``t ** 2``, ``t * t``,
    ``jnp.clip(t)``) would otherwise fail deep inside JAX's transposition with
    "Transpose rule for 'integer_pow' not implemented" or a bare AssertionError,
    naming neither the rule nor the op. The check is abstract (``eval_shape``):
    it costs one more trace of the rule and no computation.
    """
    live = [i for i, t in enumerate(t_all) if t is not None]
    if not live:
        return
    structs = [jax.ShapeDtypeStruct(np.shape(t_all[i]), jax.numpy.result_type(t_all[i])) for i in live]

    def tangent_map(*ts: jax.Array) -> list[Any]:  # the rule's tangents, not checked here
        t = list(t_all)
        for i, x in zip(live, ts):
            t[i] = x
        t_out = rule.fn(view, _per_input(inst, t))
        flat = validate.align(rule, view, t_out, view.outputs, "output tangent")
        return [x for x, o in zip(flat, outs) if x is not None and validate.has_tangent_space(o)]  # arrays


    def transpose(*ts: jax.Array) -> object:

        # zeros_like of real outputs: they carry the outputs' full type (e.g.
        # shard_map's varying manual axes), which a ShapeDtypeStruct would not.
        cts = [jax.numpy.zeros_like(o) for o in tangent_map(*ts)]
        return jax.linear_transpose(tangent_map, *structs)(cts)

    try:
        jax.eval_shape(transpose, *structs)
    except GradkitError:
        raise
    except Exception as e:
        raise GradkitError(
            f"rule {rule.name} for op '{view.name}' at {view.source} is not linear in its tangents, so reverse "
            f"mode (jax.grad, which transposes it) cannot use it: JAX says {type(e).__name__}: {e}. A JVP rule "
            "must be linear in `tangents`: multiply them by functions of op.inputs / op.outputs, add them, "
            "select between them with jnp.where; never t ** 2, t * t, sin(t) or clip(t).") from e


