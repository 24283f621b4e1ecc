"""The dispatcher: ``override(fn, table)`` traces once, rewrites, caches, runs.

The data path: the user's function is traced once per input signature to a
jaxpr. The rewrite walks it equation by equation; an equation whose name is in
the table is re-bound inside a ``jax.custom_vjp`` (VJP rule) or
``jax.custom_jvp`` (JVP rule) whose primal is the equation itself, so the
forward pass is unchanged. Any equation parameter that holds a jaxpr (jit,
scan, while, cond, remat, shard_map, …) is rewritten recursively, but only when
something inside it matches; everything else is re-bound untouched. The
rewritten program runs under ``jax.jit``, cached per signature.

JAX internals are reached only through :mod:`gradkit._src.compat`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar, overload

import jax
import numpy as np

from gradkit._src import compat, named, validate
from gradkit._src.errors import GradkitError, near_misses
from gradkit._src.rule import OpView, Rule, freeze_params
from gradkit._src.table import RuleTable

F = TypeVar("F", bound=Callable[..., Any])


# --------------------------------------------------------------------------- names


def op_name(eqn: Any) -> str:
    """The name a table entry must have to match ``eqn``."""
    name = compat.eqn_name(eqn)
    if name.startswith(compat.NAMED_OP_PREFIX):
        inst = named.lookup(name)
        return inst.name if inst is not None else name.split(":", 2)[-1]
    return name


class _Scanner:
    """Collects the op names in a jaxpr and its sub-jaxprs (memoised per jaxpr)."""

    def __init__(self) -> None:
        self._memo: dict[int, tuple[Any, frozenset[str]]] = {}

    def names(self, jaxpr: Any) -> frozenset[str]:
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        hit = self._memo.get(id(jaxpr))
        if hit is not None and hit[0] is jaxpr:
            return hit[1]
        found: set[str] = set()
        for eqn in jaxpr.eqns:
            found.add(op_name(eqn))
            if compat.is_custom_derivative(eqn):
                continue  # its own rule defines the derivative; do not look inside
            for _, sub in compat.jaxpr_params(eqn.params):
                for j in sub if isinstance(sub, tuple) else (sub,):
                    found |= self.names(j)
        result = frozenset(found)
        self._memo[id(jaxpr)] = (jaxpr, result)
        return result


# --------------------------------------------------------------------------- rewrite


class Rewriter:
    """Evaluates a jaxpr with the table's rules applied (one per top-level trace)."""

    def __init__(self, table: RuleTable, scanner: _Scanner | None = None,
                 on_match: Callable[[str, Any], None] | None = None) -> None:
        self.table = table
        self.table_names = table.names()
        self.scanner = scanner or _Scanner()
        self.on_match = on_match
        self._rewritten: dict[int, tuple[Any, Any]] = {}

    def needs(self, jaxpr: Any) -> bool:
        return not self.table_names.isdisjoint(self.scanner.names(jaxpr))

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = {}
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [compat.read_atom(env, a) for a in eqn.invars]
            with compat.source_of(eqn):
                outs = self._eval_eqn(eqn, invals)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [compat.read_atom(env, a) for a in jaxpr.outvars]

    def _eval_eqn(self, eqn: Any, invals: list[Any]) -> list[Any]:
        name = op_name(eqn)
        rule = self.table.get(name)
        if rule is not None:
            if self.on_match is not None:
                self.on_match(name, eqn)
            return apply_rule(rule, eqn, name, invals)
        if compat.is_custom_derivative(eqn) or not compat.has_subjaxprs(eqn):
            return compat.bind(eqn, invals)
        if not any(self.needs(j) for _, sub in compat.jaxpr_params(eqn.params)
                   for j in (sub if isinstance(sub, tuple) else (sub,))):
            return compat.bind(eqn, invals)
        if compat.is_shard_map(eqn):
            body = eqn.params["jaxpr"]
            return compat.bind_shard_map(eqn, invals, lambda *xs: self.eval(body, (), xs))
        params = dict(eqn.params)
        for key, sub in compat.jaxpr_params(eqn.params):
            params[key] = tuple(map(self.rewrite, sub)) if isinstance(sub, tuple) else self.rewrite(sub)
        return compat.bind(eqn, invals, params)

    def rewrite(self, jaxpr: Any) -> Any:
        """A new Jaxpr/ClosedJaxpr with the rules applied (or the same one if none match)."""
        if not self.needs(jaxpr):
            return jaxpr
        hit = self._rewritten.get(id(jaxpr))
        if hit is not None and hit[0] is jaxpr:
            return hit[1]
        is_closed = isinstance(jaxpr, compat.ClosedJaxpr)
        inner = jaxpr.jaxpr if is_closed else jaxpr
        consts = jaxpr.consts if is_closed else ()
        structs = [compat.aval_struct(a) for a in compat.in_avals(inner)]
        new = compat.trace(lambda *xs: self.eval(inner, consts, xs), structs)
        if is_closed:
            result: Any = new
        elif new.consts:
            raise GradkitError(
                "internal: rewriting an open sub-jaxpr produced constants; please report this with the "
                "function that triggered it.")
        else:
            result = new.jaxpr
        self._rewritten[id(jaxpr)] = (jaxpr, result)
        return result


# --------------------------------------------------------------------------- rules


def _view(eqn: Any, name: str, invals: Sequence[Any], outs: Sequence[Any]) -> tuple[OpView, Any]:
    """The OpView a rule sees, and a function mapping op outputs to ``outs`` leaves."""
    inst = named.lookup(eqn.params.get("name", "")) if eqn.primitive.name in ("jit", "pjit") else None
    source = compat.source_line(eqn)
    if inst is not None:
        out = inst.outputs(list(outs))
        outputs = tuple(out) if isinstance(out, tuple) else (out,)
        return OpView(name, inst.args(list(invals)), outputs, freeze_params(inst.kwargs), source), inst
    return OpView(name, tuple(invals), tuple(outs), freeze_params(eqn.params), source), None


def _output_struct(eqn: Any, inst: Any, flat: Sequence[Any]) -> Any:
    """Flat per-output values in the shape the rule sees (bare value for one output)."""
    if inst is not None:
        return inst.outputs(list(flat))
    return flat[0] if len(flat) == 1 else tuple(flat)


def _as_tuple(eqn: Any, inst: Any, outs: Sequence[Any]) -> tuple[Any, ...]:
    if inst is not None:
        out = inst.outputs(list(outs))
        return tuple(out) if isinstance(out, tuple) else (out,)
    return tuple(outs)


def apply_rule(rule: Rule, eqn: Any, name: str, invals: list[Any]) -> list[Any]:
    """Re-binds ``eqn`` inside a custom_vjp/custom_jvp that carries ``rule``."""
    # Literal inputs are constants of the program: they are closed over, not
    # differentiated, and the rule's cotangent for them is dropped.
    dyn_pos = [i for i, a in enumerate(eqn.invars) if not compat.is_literal(a)]
    dyn_inputs = [invals[i] for i in dyn_pos]
    # The closures below outlive this trace (JAX keeps the custom_vjp's bwd and
    # the custom_jvp's rule with the compiled program), so they keep only the
    # literal inputs: holding `invals` itself would leak this trace's tracers
    # (jax.checking_leaks() reports it).
    literals = [None if i in dyn_pos else x for i, x in enumerate(invals)]
    del invals

    def full(dyn: Sequence[Any]) -> list[Any]:
        vals = list(literals)
        for i, x in zip(dyn_pos, dyn):
            vals[i] = x
        return vals

    def primal(*dyn: Any) -> list[Any]:
        return compat.bind(eqn, full(dyn))

    primal.__name__ = primal.__qualname__ = compat.rule_wrapper_name(name)

    if rule.mode == "vjp":
        fn = jax.custom_vjp(primal)

        def fwd(*dyn: Any) -> tuple[list[Any], Any]:
            outs = primal(*dyn)
            return outs, (dyn, outs)

        def bwd(res: Any, g: list[Any]) -> tuple[Any, ...]:
            dyn, outs = res
            all_in = full(dyn)
            view, inst = _view(eqn, name, all_in, outs)
            g = [None if validate.is_float0(x) else x for x in g]
            cts = validate.checked_call(rule, view, _output_struct(eqn, inst, g))
            flat = validate.align(rule, view, cts, view.inputs, "cotangent")
            flat = validate.check_all(rule, view, flat, all_in, "cotangent")
            return tuple(flat[i] for i in dyn_pos)

        fn.defvjp(fwd, bwd)
        try:
            return list(fn(*dyn_inputs))
        except TypeError as e:
            if not compat.is_forward_mode_of_custom_vjp_error(e):
                raise
            raise GradkitError(
                f"rule {rule.name} for op '{name}' at {compat.source_line(eqn)} is a VJP rule (gk.vjp_rule): it "
                "defines reverse mode only, and forward-mode differentiation (jax.jvp, jacfwd, linearize, "
                "hessian's outer jacfwd) reached it. Use jax.grad / jax.vjp / jacrev, or write the rule with "
                "gk.jvp_rule, which serves both modes.") from e

    fn = jax.custom_jvp(primal)

    def jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
        outs = fn(*primals)  # calling fn keeps the rule in force at every order
        all_in = full(primals)
        view, inst = _view(eqn, name, all_in, outs)
        t_all: list[Any] = [None] * len(literals)
        for i, t in zip(dyn_pos, tangents):
            t_all[i] = None if validate.is_float0(t) else t
        t_in = inst.args(t_all) if inst is not None else tuple(t_all)
        t_out = validate.checked_call(rule, view, t_in)
        flat = validate.align(rule, view, t_out, _as_tuple(eqn, inst, outs), "output tangent")
        flat = validate.check_all(rule, view, flat, outs, "output tangent")
        _check_linear(rule, view, inst, t_all, outs)
        return outs, flat

    fn.defjvp(jvp)
    return list(fn(*dyn_inputs))


def _check_linear(rule: Rule, view: OpView, inst: Any, t_all: list[Any], outs: Sequence[Any]) -> None:
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

    def tangent_map(*ts: Any) -> list[Any]:
        t = list(t_all)
        for i, x in zip(live, ts):
            t[i] = x
        t_out = rule.fn(view, inst.args(t) if inst is not None else tuple(t))
        flat = validate.align(rule, view, t_out, view.outputs, "output tangent")
        return [x for x, o in zip(flat, outs) if x is not None and validate.has_tangent_space(o)]

    def transpose(*ts: Any) -> Any:
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


# --------------------------------------------------------------------------- override


@dataclasses.dataclass
class _Entry:
    inline: Callable[..., Any]  # evaluates the rewritten program into the caller's trace
    run: Callable[..., Any]  # the same, compiled: for eager calls
    out_tree: Any
    matched: frozenset[str]


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, compat.Tracer))


def _aval_key(x: Any) -> tuple[Any, ...]:
    return compat.aval_key(x)


def _static_key(x: Any) -> Any:
    """Cache key of a static (non-array) argument leaf.

    Keyed by type as well as value: ``1``, ``1.0`` and ``True`` are equal in
    Python but trace to different programs (int, float, bool arithmetic).
    Floats are keyed by their bits, so ``-0.0`` and ``0.0`` (equal in Python,
    different under ``1 / x``) get their own programs and every NaN hits one
    entry (``nan != nan`` would otherwise miss the cache on every call).
    """
    if isinstance(x, float):
        return (type(x), x.hex())
    if isinstance(x, complex):
        return (type(x), x.real.hex(), x.imag.hex())
    return (type(x), x)


class Overridden:
    """A function with a rule table applied; made by :func:`override`."""

    def __init__(self, fn: Callable[..., Any], table: RuleTable, strict: bool) -> None:
        self._fn = fn
        self._table = table
        self._strict = strict
        self._cache: dict[Any, _Entry] = {}
        self._lock = threading.Lock()
        self.trace_count = 0
        self._eager = jax.jit(lambda *a, **k: self._call(*jax.tree_util.tree_flatten((a, k))))
        functools.update_wrapper(self, fn)

    @property
    def table(self) -> RuleTable:
        return self._table

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if leaves and all(isinstance(x, jax.Array) and not isinstance(x, compat.Tracer) for x in leaves):
            # Eager call with arrays only: dispatch through jax.jit's C++ fast path;
            # its trace lands in _call below (inlined), once per signature.
            return self._eager(*args, **kwargs)
        return self._call(leaves, treedef)

    def _call(self, leaves: list[Any], treedef: Any) -> Any:
        # The hot path of every call: one pass over the leaves builds the key.
        dyn_pos_l: list[int] = []
        dyn: list[Any] = []
        statics_l: list[Any] = []
        parts: list[Any] = [treedef, compat.trace_context()]
        for i, x in enumerate(leaves):
            if _is_array(x):
                dyn_pos_l.append(i)
                dyn.append(x)
                statics_l.append(None)
                parts.append(compat.aval_key(x))
            else:
                statics_l.append(x)
                parts.append(_static_key(x))
        dyn_pos, statics = tuple(dyn_pos_l), tuple(statics_l)
        key = tuple(parts)
        try:
            entry = self._cache.get(key)
        except TypeError:
            bad = next(x for x in statics if not _hashable(x))
            raise GradkitError(
                f"override({_fname(self._fn)}): argument value of type {type(bad).__name__} is not an array "
                "and not hashable. Non-array arguments are static (part of the cache key), so they must be "
                "hashable: pass arrays as jax/numpy arrays, and containers as tuples or dicts.") from None
        if entry is None:
            entry = self._build(treedef, dyn_pos, statics, dyn)
            if entry is None:  # closes over outer tracers: not cacheable
                return self._run_uncached(treedef, dyn_pos, statics, dyn)
            with self._lock:
                self._cache.setdefault(key, entry)
        # Under an outer trace (jit, grad, vmap, ...) the program is inlined into
        # it; an eager call runs it compiled.
        traced = any(isinstance(x, compat.Tracer) for x in dyn)
        try:
            out = entry.inline(*dyn) if traced else entry.run(*dyn)
        except TypeError as e:
            # Forward mode reached a VJP rule inside a sub-program (scan, cond, ...),
            # where JAX raises without naming the op (top-level ones are named in apply_rule).
            if not compat.is_forward_mode_of_custom_vjp_error(e):
                raise
            vjp_ops = sorted(n for n in entry.matched if self._table[n].mode == "vjp")
            raise GradkitError(
                f"override({_fname(self._fn)}): forward-mode differentiation (jax.jvp, jacfwd, hessian's "
                f"outer jacfwd, linearize) reached an op with a VJP rule ({', '.join(repr(n) for n in vjp_ops)}). "
                "gk.vjp_rule defines reverse mode only: use jax.grad / jax.vjp / jacrev, or give these ops a "
                "gk.jvp_rule (which serves both modes).") from e
        return jax.tree_util.tree_unflatten(entry.out_tree, out)

    def _flat_fn(self, treedef: Any, dyn_pos: tuple[int, ...], statics: tuple[Any, ...],
                 out_box: list[Any]) -> Callable[..., Any]:
        def flat(*dyn: Any) -> list[Any]:
            with self._lock:
                self.trace_count += 1
            leaves = list(statics)
            for i, x in zip(dyn_pos, dyn):
                leaves[i] = x
            args, kwargs = jax.tree_util.tree_unflatten(treedef, leaves)
            out = self._fn(*args, **kwargs)
            out_leaves, out_box[0] = jax.tree_util.tree_flatten(out)
            return out_leaves
        # JAX's messages about this trace name the user's function, not `flat`
        # (the signature stays flat's own: `dyn[i]`, explained by _trace's note).
        flat.__wrapped__ = self._fn  # type: ignore[attr-defined]
        flat.__signature__ = inspect.signature(_dyn_signature)  # type: ignore[attr-defined]
        return flat

    def _trace(self, treedef: Any, dyn_pos: tuple[int, ...], statics: tuple[Any, ...],
               dyn: Sequence[Any]) -> tuple[Any, Any]:
        out_box: list[Any] = [None]
        structs = [jax.ShapeDtypeStruct(*_aval_key(x)[:2], weak_type=_aval_key(x)[2]) for x in dyn]
        try:
            closed = compat.trace(self._flat_fn(treedef, dyn_pos, statics, out_box), structs)
        except compat.CONCRETIZATION_ERRORS as e:
            # JAX's error type is kept (code catching it keeps working); the note
            # says why a function that runs eagerly fails under override.
            names = _dyn_names(self._fn, treedef, len(statics), dyn_pos)
            compat.add_note(e, (
                f"[gradkit] gk.override traces {_fname(self._fn)} once per input signature, like jax.jit: its "
                f"array arguments ({', '.join(f'dyn[{i}] is {n}' for i, n in enumerate(names))}) are abstract "
                "there, so Python `if`/`while`/`int()`/NumPy on them fail even though the plain function runs "
                "eagerly. Use jnp.where / lax.cond / lax.while_loop, or pass such values as Python numbers "
                "or other non-array values, which override treats as static."))
            raise
        return closed, out_box[0]

    def _build(self, treedef: Any, dyn_pos: tuple[int, ...], statics: tuple[Any, ...],
               dyn: Sequence[Any]) -> _Entry | None:
        closed, out_tree = self._trace(treedef, dyn_pos, statics, dyn)
        if any(isinstance(c, compat.Tracer) for c in closed.consts):
            return None
        scanner = _Scanner()
        present = scanner.names(closed.jaxpr)
        matched = present & self._table.names()
        if self._strict:
            _check_strict(self._fn, self._table, present)
        if not matched:
            def inline(*xs: Any) -> list[Any]:
                return compat.eval_jaxpr(closed, xs)
        else:
            rewriter = Rewriter(self._table, scanner)

            def inline(*xs: Any) -> list[Any]:
                return rewriter.eval(closed.jaxpr, closed.consts, xs)
        return _Entry(inline=inline, run=jax.jit(inline), out_tree=out_tree, matched=frozenset(matched))

    def _run_uncached(self, treedef: Any, dyn_pos: tuple[int, ...], statics: tuple[Any, ...],
                      dyn: Sequence[Any]) -> Any:
        closed, out_tree = self._trace(treedef, dyn_pos, statics, dyn)
        scanner = _Scanner()
        if self._strict:
            _check_strict(self._fn, self._table, scanner.names(closed.jaxpr))
        out = Rewriter(self._table, scanner).eval(closed.jaxpr, closed.consts, dyn)
        return jax.tree_util.tree_unflatten(out_tree, out)

    def rewritten_jaxpr(self, *args: Any, **kwargs: Any) -> Any:
        """The program after the rewrite, as a ClosedJaxpr (for inspection).

        Examples:
          >>> import jax.numpy as jnp, gradkit as gk
          >>> f = gk.override(jnp.sqrt, {"sqrt": gk.vjp_rule(lambda op, g: (g,))})
          >>> "custom_vjp_call" in str(f.rewritten_jaxpr(1.0))
          True
        """
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        dyn_pos = tuple(i for i, x in enumerate(leaves) if _is_array(x) or isinstance(x, (float, int, bool)))
        dyn = [jax.numpy.asarray(leaves[i]) for i in dyn_pos]
        statics = tuple(None if i in dyn_pos else x for i, x in enumerate(leaves))
        closed, _ = self._trace(treedef, dyn_pos, statics, dyn)
        rewriter = Rewriter(self._table)
        return compat.trace(lambda *xs: rewriter.eval(closed.jaxpr, closed.consts, xs),
                            [jax.ShapeDtypeStruct(*_aval_key(x)[:2]) for x in dyn])

    def __repr__(self) -> str:
        return f"<gradkit.override of {_fname(self._fn)} with {len(self._table)} rules>"


def _dyn_signature(*dyn: Any) -> None:  # the signature JAX sees for the flat traced function
    pass


def _dyn_names(fn: Any, treedef: Any, n_leaves: int, dyn_pos: tuple[int, ...]) -> list[str]:
    """The user's names for the array leaves ``dyn[i]``: ``x``, ``params['w']``, ``batch[0]``."""
    names: dict[int, str] = {}
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    try:  # best effort: only for an error message (custom pytree nodes may reject int leaves)
        args, kwargs = jax.tree_util.tree_unflatten(treedef, list(range(n_leaves)))
        for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            head, rest = path[0].idx, path[1:]  # type: ignore[attr-defined]
            if head == 0:
                pos = rest[0].idx  # type: ignore[attr-defined]
                usable = pos < len(params) and params[pos].kind in (
                    inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                base = params[pos].name if usable else f"args[{pos}]"
            else:
                base = str(rest[0].key)  # type: ignore[attr-defined]
            names[leaf] = base + jax.tree_util.keystr(tuple(rest[1:]))
    except Exception:  # noqa: BLE001
        pass
    return [names.get(i, f"argument leaf {i}") for i in dyn_pos]


def _hashable(x: Any) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _fname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _check_strict(fn: Any, table: RuleTable, present: frozenset[str]) -> None:
    unmatched = sorted(table.names() - present)
    if not unmatched:
        return
    lines = []
    for name in unmatched:
        close = near_misses(name, present)
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        lines.append(f"  '{name}'{hint}")
    raise GradkitError(
        f"override({_fname(fn)}, strict=True): {len(unmatched)} rule(s) matched no op in the traced program:\n"
        + "\n".join(lines)
        + f"\nOps in the program: {', '.join(sorted(present))}. Fix the names, or drop strict=True.")


def _as_table(table: Any) -> RuleTable:
    if isinstance(table, RuleTable):
        return table
    if isinstance(table, Mapping):
        return RuleTable(table)
    raise GradkitError(
        f"override expects a RuleTable or a dict of rules as its table, got {type(table).__name__}. "
        "Write gk.override(fn, gk.RuleTable({'sqrt': rule})).")


@overload
def override(fn: F, table: RuleTable | Mapping[str, Rule], *, strict: bool = False) -> F: ...
@overload
def override(fn: RuleTable | Mapping[str, Rule], table: None = None, *,
             strict: bool = False) -> Callable[[F], F]: ...


def override(fn, table=None, *, strict=False):
    """Applies a rule table to every matching op in ``fn``, at any depth.

    The result computes exactly what ``fn`` computes; only gradients change,
    where an op's name (primitive, :func:`op` name, or a custom_jvp/custom_vjp
    function's name) is in ``table``. Ops inside ``jit``, ``scan``,
    ``fori_loop``, ``while_loop``, ``cond``, ``switch``, ``checkpoint`` and
    ``shard_map`` are matched too. ``fn`` is traced once per input signature
    (array shapes and dtypes, pytree structure; non-array arguments are static)
    and runs compiled, like ``jax.jit``.

    Args:
      fn: a pure function of arrays and pytrees of arrays.
      table: a :class:`RuleTable` or a dict from op name to :class:`Rule`.
      strict: raise if a rule in the table matches no op (guards against typos).

    Returns:
      A function with ``fn``'s signature. Also usable as ``@override(table)``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> safe = gk.vjp_rule(lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),))
      >>> @gk.override({"sqrt": safe})
      ... def f(x):
      ...     return jnp.where(x > 0, jnp.sqrt(x), 0.0)
      >>> float(jax.grad(f)(0.0)), float(jax.grad(f)(4.0))
      (0.0, 0.25)
    """
    if table is None:
        if callable(fn) and not isinstance(fn, Mapping):
            raise GradkitError(
                f"override({_fname(fn)}) needs a rule table: gk.override(fn, table) or @gk.override(table).")
        tbl = _as_table(fn)
        return lambda f: override(f, tbl, strict=strict)
    if not callable(fn):
        raise GradkitError(f"override expects a function as its first argument, got {type(fn).__name__}.")
    return Overridden(fn, _as_table(table), strict)
