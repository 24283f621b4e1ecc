"""The dispatcher: ``override(fn, table)`` traces once, splices the rules in, runs.

The data path, per input signature (array types, pytree structure, static
values, JAX config):

1. ``fn`` is traced once, as ``jax.jit(fn)`` would trace it: one ``jit``
   equation whose body is ``fn``'s program.
2. The body is rewritten by splicing (:mod:`gradkit._src.core.splice`): each
   equation whose name is in the table, at any depth (jit, scan, while,
   cond, remat, shard_map, custom_linear_solve, ...), is replaced by one
   ``custom_vjp``/``custom_jvp`` equation carrying the rule, traced once per
   distinct signature. Everything else is shared, not re-traced.
3. The cached program is bound as that single ``jit`` equation: inline in an
   enclosing trace (jit, grad, vmap, ...), compiled for an eager call.

``Overridden.lower`` / ``trace`` / ``eval_shape`` are ``jax.jit``'s stages of
the function whose program is that equation (``jax.stages`` objects; the
static arguments are ``static_argnums``/``static_argnames``).

So ``override(fn, table)`` with no matching rule *is* ``jax.jit(fn)``: same
values, same gradients in every transform. JAX internals are reached only
through :mod:`gradkit._src.compat`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
import types
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast, overload

import jax

from gradkit._src import compat
from gradkit._src.core import args as _args
from gradkit._src.core import masks, module_paths, named, nnx_state, strict, walk
from gradkit._src.core.cache import LRU
from gradkit._src.core.rule import Rule
from gradkit._src.core.splice import CacheInfo, Replacements, Splicer, op_name
from gradkit._src.core.table import RuleTable
from gradkit._src.errors import GradkitError, callable_name

F = TypeVar("F", bound=Callable[..., object])
R = TypeVar("R", covariant=True)  # what the overridden function returns
T = TypeVar("T")

__all__ = ["Overridden", "op_name", "override"]


@dataclasses.dataclass(frozen=True)
class _Entry:
    """One input signature's program (closed jaxprs: a ``Jaxpr`` with its consts from jax 0.11 on)."""


    outer: compat.Jaxpr  # the one-equation jaxpr calling the rewritten body (its consts: values fn closes over)
    body: compat.Jaxpr  # the rewritten program (the jit equation's body)
    out_tree: jax.tree_util.PyTreeDef
    matched: Mapping[str, str]  # op name -> source line of its first match
    # The named ops the program calls, held for as long as the program is:
    # their rules read their signatures when it is differentiated.
    named_ops: Mapping[str, named.Signature] = dataclasses.field(default_factory=dict)

    def user_custom_vjp(self) -> bool:
        """Whether the program has custom_vjp functions of its own (not gradkit's rules)."""
        return any(e.primitive.name in compat.CUSTOM_VJP_PRIMITIVES and compat.rule_target(e) is None
                   for e, _ in walk.equations(self.body, enter=lambda e: not compat.is_opaque(e)))

    def call(self, *dyn: object) -> list[jax.Array]:
        return compat.eval_jaxpr(self.outer, dyn)

    @functools.cached_property
    def run(self) -> Callable[..., list[jax.Array]]:
        return jax.jit(self.call)


_ARRAY = compat.ArrayImpl
_is_array = _args.is_array


class Overridden(Generic[R]):
    """A function with a rule table applied; made by :func:`override`.

    It is a jitted function: called, it runs what ``jax.jit(fn)`` runs with
    the table's rules spliced in. Like a ``jax.jit`` object it has the
    ahead-of-time stages :meth:`lower`, :meth:`trace` and :meth:`eval_shape`,
    which return JAX's own objects for the rewritten program
    (``.compile()``, ``.as_text()``, ``.cost_analysis()``, ``.jaxpr``).

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> fixed = gk.override(lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)), gk.tables.SAFE)
      >>> x = jnp.arange(4.0)
      >>> compiled = fixed.lower(x).compile()
      >>> float(compiled(x)) == float(fixed(x)), compiled.cost_analysis() is not None
      (True, True)
      >>> "custom_jvp_call" in str(fixed.trace(x).jaxpr)  # the rewritten program
      True
      >>> fixed.eval_shape(x)
      ShapeDtypeStruct(shape=(), dtype=float32)
    """

    def __init__(self, fn: Callable[..., R], table: RuleTable, strict: bool) -> None:
        # updated=(): copying fn.__dict__ would copy an inner Overridden's table
        # and caches over this one's (override(override(f, t1), t2)).
        functools.update_wrapper(self, fn, updated=())
        self._fn = fn
        self._table = table
        self._strict = strict
        self._cache: LRU[Hashable, _Entry] = LRU(f"override({callable_name(fn)})")
        self._lock = threading.Lock()
        self._replacements = Replacements()
        self.trace_count = 0
        self._nnx: nnx_state.Route[R] | None = None  # the Flax NNX route, made on the first call with NNX nodes
        self._eager = self._jit()

    @property
    def table(self) -> RuleTable:
        return self._table

    def cache_info(self) -> CacheInfo:
        """How often the function and the rule replacements were traced, and reused.

        Examples:
          >>> import jax, jax.numpy as jnp, gradkit as gk
          >>> def blocks(x):
          ...     for _ in range(48):
          ...         x = jnp.sqrt(x + 1.0)
          ...     return x
          >>> half = gk.vjp_rule(lambda op, g: (g * 0.5 / op.outputs[0],))  # sqrt's derivative
          >>> f = gk.override(blocks, {"sqrt": half})
          >>> _ = jax.grad(f)(1.0)
          >>> f.cache_info()
          CacheInfo(traces=1, replacements=1, reuses=47)
        """
        r = self._replacements
        return CacheInfo(self.trace_count, r.traced, r.reused)

    def clear_cache(self) -> None:
        """Drops every traced program and rule replacement of this function (``jax.clear_caches()`` does too).

        The caches are bounded (the 2048 most recently used signatures, JAX's
        own bound); this frees them now, e.g. after a sweep over many shapes.

        Examples:
          >>> import jax.numpy as jnp, gradkit as gk
          >>> f = gk.override(jnp.sqrt, gk.tables.SAFE)
          >>> _ = f(jnp.float32(4.0))
          >>> f.clear_cache()
          >>> f.cache_size()
          0
        """
        self._cache.cache_clear()
        self._replacements.clear()
        self._eager.clear_cache()
        if self._nnx is not None:
            self._nnx.clear_cache()

    def cache_size(self) -> int:
        """How many input signatures have a traced program in the cache now (at most 2048)."""
        return len(self._cache)

    def __get__(self, instance: object, owner: type | None = None) -> Callable[..., R]:
        """As a method: ``@gk.override(table)`` in a class body binds ``self`` like a plain function.

        ``self`` is an argument like any other: a pytree (an ``eqx.Module``,
        a registered dataclass) contributes its arrays, any other object is
        static (keyed by its hash), as under ``jax.jit(f)(obj, ...)``.
        """
        return self if instance is None else types.MethodType(self, instance)

    def __call__(self, *args: object, **kwargs: object) -> R:
        if nnx_state.has_graph_nodes(args, kwargs):  # Flax NNX modules: their state changes are kept, as nnx.jit
            return self._nnx_route()(args, kwargs)
        if args and not kwargs:  # the common eager call: concrete arrays, no pytree to flatten
            for a in args:
                if type(a) is not _ARRAY:
                    break
            else:
                out: R = self._eager(*args)
                return out
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
        if leaves and all(isinstance(x, jax.Array) and not isinstance(x, compat.Tracer) for x in leaves):
            # Eager call with arrays only: jax.jit's C++ fast path; its trace
            # lands in _call below, once per signature.
            eager_out: R = self._eager(*args, **kwargs)
            return eager_out
        return self._call(leaves, treedef)

    # --- jax.jit's ahead-of-time stages

    def lower(self, *args: object, **kwargs: object) -> jax.stages.Lowered:
        """``jax.jit``'s ``lower`` for the rewritten program: JAX's :class:`jax.stages.Lowered`.

        As for a ``jax.jit`` function: ``.compile()`` gives a
        :class:`jax.stages.Compiled` to call with the array arguments,
        ``.as_text()`` the StableHLO, ``.cost_analysis()`` XLA's estimates.
        The program is the one a call runs, rules spliced in (its value is
        ``jax.jit(fn)``'s, bit for bit); differentiate first to lower a
        gradient: ``jax.jit(jax.grad(fixed)).lower(x)``.

        Arguments are taken as a call takes them. Arrays (and
        ``jax.ShapeDtypeStruct``\\ s) are traced; a top-level argument with
        no array leaf (a Python number, a string, a tuple of them) is static,
        as under ``jax.jit(..., static_argnums=...)``: the compiled function
        is called without it. A pytree argument that mixes arrays with
        non-array leaves (an ``eqx.Module``) has no ``jax.jit`` form: a
        :class:`GradkitError` says how to split it. With Flax NNX modules
        among the arguments, this is ``nnx.jit(fixed).lower(...)``: Flax's
        wrapper of JAX's object, whose compiled function takes the modules
        and writes their new state back, as ``nnx.jit``'s does.

        Examples:
          >>> import jax, jax.numpy as jnp, gradkit as gk
          >>> fixed = gk.override(lambda x, n: jnp.sqrt(x) * n, gk.tables.SAFE)
          >>> lowered = fixed.lower(jnp.ones(3), 2)  # n = 2 is static
          >>> "stablehlo.sqrt" in lowered.as_text()
          True
          >>> lowered.compile()(jnp.full(3, 4.0))
          Array([4., 4., 4.], dtype=float32)
        """
        return cast(jax.stages.Lowered, self._stage("lower", args, kwargs))

    def trace(self, *args: object, **kwargs: object) -> jax.stages.Traced:
        """``jax.jit``'s ``trace`` for the rewritten program: JAX's :class:`jax.stages.Traced`.

        Its ``.jaxpr`` is the program a call runs (one ``jit`` equation whose
        body carries the rules as ``custom_vjp_call``/``custom_jvp_call``
        equations), ``.lower()`` continues as :meth:`lower`. Arguments as in
        :meth:`lower`.

        Examples:
          >>> import jax.numpy as jnp, gradkit as gk
          >>> fixed = gk.override(lambda x: jnp.where(x > 0, jnp.log(x), 0.0), gk.tables.SAFE)
          >>> traced = fixed.trace(jnp.ones(3))
          >>> "custom_jvp_call" in str(traced.jaxpr), traced.lower().compile()(jnp.ones(3))
          (True, Array([0., 0., 0.], dtype=float32))
        """
        return cast(jax.stages.Traced, self._stage("trace", args, kwargs))

    def eval_shape(self, *args: object, **kwargs: object) -> Any:  # a pytree of ShapeDtypeStructs, as jax's
        """The output's shapes and dtypes without computing it: ``jax.ShapeDtypeStruct``\\ s, as ``jax.eval_shape``.

        Arguments as a call takes them, any pytree (arrays or
        ``jax.ShapeDtypeStruct``\\ s traced, everything else static), Flax
        NNX modules as ``nnx.jit(fixed).eval_shape`` takes them (their
        state is left as it was).

        Examples:
          >>> import jax, jax.numpy as jnp, gradkit as gk
          >>> fixed = gk.override(lambda p, x: {"y": p["w"] @ x, "n": x.size}, gk.tables.SAFE)
          >>> fixed.eval_shape({"w": jax.ShapeDtypeStruct((2, 3), jnp.float32)}, jnp.ones(3))["y"]
          ShapeDtypeStruct(shape=(2,), dtype=float32)
        """
        if nnx_state.has_graph_nodes(args, kwargs):
            return self._nnx_route().staged(self, "eval_shape", args, kwargs)
        split, dyn = _args.partition((args, kwargs), _traced_leaf)

        def flat(*d: object) -> R:
            return self._call(*jax.tree_util.tree_flatten(split.combine(d)))

        return jax.eval_shape(flat, *dyn)

    def _stage(self, stage: str, args: tuple[object, ...], kwargs: Mapping[str, object]) -> object:
        """``jax.jit(...).<stage>(*args, **kwargs)`` of the function a call runs, statics as ``jax.jit``'s."""
        if nnx_state.has_graph_nodes(args, kwargs):
            return self._nnx_route().staged(self, stage, args, kwargs)
        static_argnums: list[int] = []
        static_argnames: list[str] = []
        named: list[tuple[int | str, object]] = [*enumerate(args), *kwargs.items()]
        for where, value in named:
            leaves = jax.tree_util.tree_leaves(value)
            traced = [_traced_leaf(x) for x in leaves]
            if all(traced):
                continue  # arrays (or no leaf at all: None, an empty container), as jax.jit takes them
            if any(traced):
                raise GradkitError(self._mixed_message(stage, where, value))
            if not _hashable(value):
                raise GradkitError(
                    f"override({callable_name(self._fn)}).{stage}: argument {_arg_name(self._fn, where)} "
                    f"({type(value).__name__}) is not an array and not hashable. Non-array arguments are static "
                    "(part of the cache key), so they must be hashable: pass arrays as jax/numpy arrays, and "
                    "containers as tuples or dicts.")
            if isinstance(where, int):
                static_argnums.append(where)
            else:
                static_argnames.append(where)
        jitted = self._jit(tuple(static_argnums), tuple(static_argnames)) \
            if static_argnums or static_argnames else self._eager
        return compat.staged(jitted, stage, f"override({callable_name(self._fn)})")(*args, **kwargs)

    def _mixed_message(self, stage: str, where: int | str, value: object) -> str:
        path, leaf = next((p, x) for p, x in jax.tree_util.tree_flatten_with_path(value)[0] if not _traced_leaf(x))
        name = _arg_name(self._fn, where)
        return (
            f"override({callable_name(self._fn)}).{stage}: argument {name} mixes arrays with a non-array leaf "
            f"({name}{jax.tree_util.keystr(path)} is {type(leaf).__name__}). A call takes such a leaf as static, "
            "but jax.jit's stages take static values only as whole arguments. Pass the non-array parts as their "
            "own arguments (static, as jax.jit's static_argnums: the compiled function is then called without "
            "them), close over them (functools.partial), or split the pytree (eqx.partition) and lower a "
            "function of its arrays.")

    def _jit(self, static_argnums: tuple[int, ...] = (), static_argnames: tuple[str, ...] = ()) -> Any:
        """``jax.jit`` of the function a call runs: its trace lands in :meth:`_call`, once per signature."""
        def eager(*a: object, **k: object) -> R:
            return self._call(*jax.tree_util.tree_flatten((a, k)))

        eager.__name__ = eager.__qualname__ = callable_name(self._fn).rsplit(".", 1)[-1]
        return jax.jit(eager, static_argnums=static_argnums, static_argnames=static_argnames)

    # --- Flax NNX: nnx_state's route, given what it needs of the dispatcher

    def _nnx_route(self) -> nnx_state.Route[R]:
        route = self._nnx
        if route is None:
            with self._lock:
                if self._nnx is None:
                    self._nnx = nnx_state.Route(self._fn, self._override_pure, self._add_traces,
                                                scoped=bool(self._table.scoped_ops))
                route = self._nnx
        return route

    def _override_pure(self, pure: Callable[..., T]) -> Overridden[T]:
        """The second overridden function of the NNX route: this table, ``strict`` and rule cache."""
        inner = Overridden(pure, self._table, self._strict)
        # One table, one cache of rule replacements: cache_info() of the function the user holds counts them.
        inner._replacements = self._replacements
        return inner

    def _add_traces(self, n: int) -> None:
        with self._lock:
            self.trace_count += n

    # --- the call

    def _call(self, leaves: list[object], treedef: jax.tree_util.PyTreeDef) -> R:
        # The hot path of every call under a trace: one key (args.call_key) per call.
        split, dyn = _args.partition_leaves(leaves, treedef, _is_array)
        key = self._key(split, dyn)
        entry = self._cache.get(key)
        cacheable = True
        if entry is None:
            entry = self._build(split, dyn, count=True)
            cacheable = not any(isinstance(c, compat.Tracer) for c in compat.jaxpr_parts(entry.outer)[1])
            if cacheable:  # else fn closes over an enclosing trace's values: used for this call only
                entry = self._cache.setdefault(key, entry)
        # Under an enclosing trace (jit, grad, vmap, ...) the one equation joins
        # it; an eager call runs it compiled.
        traced = any(isinstance(x, compat.Tracer) for x in dyn)
        try:
            out = entry.call(*dyn) if traced or not cacheable else entry.run(*dyn)
        except TypeError as e:
            self._explain_forward_mode(entry, e)
            raise
        result: R = jax.tree_util.tree_unflatten(entry.out_tree, out)
        return result

    def _key(self, split: _args.Split, dyn: Sequence[object]) -> Hashable:
        try:
            return _args.call_key(split.key, dyn)
        except TypeError:
            bad = next((x for x in split.statics if x is not None and not _hashable(x)), None)
            raise GradkitError(
                f"override({callable_name(self._fn)}): argument value of type {type(bad).__name__} is not an array "
                "and not hashable. Non-array arguments are static (part of the cache key), so they must be "
                "hashable: pass arrays as jax/numpy arrays, and containers as tuples or dicts.") from None

    def _explain_forward_mode(self, entry: _Entry, e: TypeError) -> None:
        """Forward mode reached a VJP rule: say which ops; JAX's own error keeps its type otherwise."""
        if not compat.is_forward_mode_of_custom_vjp_error(e):
            return
        vjp_ops = sorted(n for n in entry.matched if self._table[n].mode == "vjp")
        if not vjp_ops:
            return  # the program's own custom_vjp: JAX's error as JAX raises it
        where = ", ".join(f"'{n}' at {entry.matched[n]}" for n in vjp_ops)
        msg = (f"override({callable_name(self._fn)}): forward-mode differentiation (jax.jvp, jacfwd, hessian's outer "
               f"jacfwd, linearize) reached an op with a VJP rule ({where}). gk.vjp_rule defines reverse mode "
               "only: use jax.grad / jax.vjp / jacrev, or give these ops a gk.jvp_rule (which serves both modes).")
        if entry.user_custom_vjp():  # it may be the program's own custom_vjp: keep JAX's error, add the hint
            compat.add_note(e, "[gradkit] or: " + msg.split(": ", 1)[1])
            return
        raise GradkitError(msg) from e

    def _flat_fn(self, split: _args.Split, out_box: list[jax.tree_util.PyTreeDef | None],
                 count: bool) -> Callable[..., list[object]]:
        scoped = bool(self._table.scoped_ops)

        def flat(*dyn: object) -> list[object]:
            if count:
                with self._lock:
                    self.trace_count += 1
            args, kwargs = split.combine(dyn)
            # Scoped rules: the Equinox modules among the arguments are inside their attribute paths while they
            # run (NNX modules: nnx_state); otherwise, and for a trace inside this one, module calls enter nothing.
            ids = module_paths.equinox_paths((args, kwargs)) if scoped else None
            with module_paths.tracing(ids, [p for ps in (ids or {}).values() for p in ps]):
                out = self._fn(*args, **kwargs)
            out_leaves, out_box[0] = jax.tree_util.tree_flatten(out)
            return out_leaves
        # JAX's messages about this trace name the user's function, not `flat`
        # (the signature stays flat's own: `dyn[i]`, explained by _trace's note).
        flat.__name__ = flat.__qualname__ = callable_name(self._fn).rsplit(".", 1)[-1]
        vars(flat).update(__wrapped__=self._fn, __signature__=inspect.signature(_dyn_signature))
        return flat

    def _build(self, split: _args.Split, dyn: Sequence[object], count: bool) -> _Entry:
        """Traces ``fn`` for this signature and splices the table's rules into its program."""
        out_box: list[jax.tree_util.PyTreeDef | None] = [None]
        try:
            with named.pinning() as named_ops, module_paths.collecting() as found:
                outer = compat.trace_jit(self._flat_fn(split, out_box, count), dyn)
        except compat.CONCRETIZATION_ERRORS as e:
            # JAX's error type is kept (code catching it keeps working); the note
            # says why a function that runs eagerly fails under override.
            names = _dyn_names(self._fn, split)
            compat.add_note(e, (
                f"[gradkit] gk.override traces {callable_name(self._fn)} once per input signature, like jax.jit: its "
                f"array arguments ({', '.join(f'dyn[{i}] is {n}' for i, n in enumerate(names))}) are abstract "
                "there, so Python `if`/`while`/`int()`/NumPy on them fail even though the plain function runs "
                "eagerly. Use jnp.where / lax.cond / lax.while_loop, or pass such values as Python numbers "
                "or other non-array values, which override treats as static."))
            raise
        (call,) = compat.jaxpr_parts(outer)[0].eqns
        body = call.params["jaxpr"]
        strict.check_indices(self._fn, self._table, body)  # an index inside a loop's stack: an error, always
        if self._strict:
            strict.check(self._fn, self._table, body, found)
        splicer = Splicer(self._table, self._replacements)
        masked = splicer.masked_names
        masked_body = masks.rewrite(body, splicer.masked_match, splicer.keeps_call, masked) if masked else body
        new_body = walk.Rewrite(splicer, scoped=splicer.scoped)(masked_body)
        if new_body is not body:
            outer = compat.replace_eqns(outer, [call.replace(params={**call.params, "jaxpr": new_body})])
        out_tree = out_box[0]
        assert out_tree is not None  # set by the trace
        return _Entry(outer, new_body, out_tree, dict(splicer.matched), named_ops)

    def rewritten_jaxpr(self, *args: object, **kwargs: object) -> compat.Jaxpr:
        """The program a call with these arguments runs, after the rewrite (for inspection).

        Exactly what the call would run: non-array arguments (Python numbers
        included) are static, weak types are kept, ``strict`` is honoured; it
        does not count as a trace (``cache_info().traces``).

        Examples:
          >>> import jax.numpy as jnp, gradkit as gk
          >>> f = gk.override(jnp.sqrt, {"sqrt": gk.vjp_rule(lambda op, g: (g,))})
          >>> "custom_vjp_call" in str(f.rewritten_jaxpr(jnp.float32(1.0)))
          True
        """
        split, dyn = _args.partition((args, kwargs), _is_array)
        entry = self._cache.get(self._key(split, dyn)) or self._build(split, dyn, count=False)
        return entry.body

    def __repr__(self) -> str:
        return f"<gradkit.override of {callable_name(self._fn)} with {len(self._table)} rules>"


def _dyn_signature(*dyn: object) -> None:  # the signature JAX sees for the flat traced function
    pass


def _dyn_names(fn: Callable[..., object], split: _args.Split) -> list[str]:
    """The user's names for the array leaves ``dyn[i]``: ``x``, ``params['w']``, ``batch[0]``."""
    names: dict[int, str] = {}
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    try:  # best effort: only for an error message (custom pytree nodes may reject int leaves)
        args, kwargs = jax.tree_util.tree_unflatten(split.treedef, list(range(split.num_leaves)))
        for path, leaf in jax.tree_util.tree_flatten_with_path((args, kwargs))[0]:
            head, rest = path[0].idx, path[1:]
            if head == 0:
                pos = rest[0].idx
                usable = pos < len(params) and params[pos].kind in (
                    inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                base = params[pos].name if usable else f"args[{pos}]"
            else:
                base = str(rest[0].key)
            names[leaf] = base + jax.tree_util.keystr(tuple(rest[1:]))
    except Exception:
        pass
    return [names.get(i, f"argument leaf {i}") for i in split.dyn_pos]


def _traced_leaf(x: object) -> bool:
    """A leaf the stages trace: an array (as a call's) or a ``jax.ShapeDtypeStruct`` standing for one."""
    return _is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _arg_name(fn: Callable[..., object], where: int | str) -> str:
    """The user's name of positional argument ``where`` (``x``, else ``args[i]``), or a keyword's."""
    if isinstance(where, str):
        return where
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    usable = where < len(params) and params[where].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return params[where].name if usable else f"args[{where}]"


def _hashable(x: object) -> bool:
    try:
        hash(x)
    except TypeError:
        return False
    return True


def _as_table(table: object) -> RuleTable:

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


def override(fn: F | RuleTable | Mapping[str, Rule], table: RuleTable | Mapping[str, Rule] | None = None, *,
             strict: bool = False) -> F | Callable[[F], F]:
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
      strict: raise if the table matches nothing it should (guards against typos and
        wrong scopes): each entry of yours must match an op (inside its scope); a shipped
        table (``gk.tables.SAFE``, ...) is one unit, which passes when some rule of it
        matches (inside its scope). The error names what it checked.

    Returns:
      A function with ``fn``'s signature (an :class:`Overridden`), with ``jax.jit``'s
      ahead-of-time stages: ``.lower(x)`` (``.compile()``, ``.as_text()``,
      ``.cost_analysis()``), ``.trace(x)`` and ``.eval_shape(x)`` of the rewritten
      program. Also usable as ``@override(table)``.

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
                f"override({callable_name(fn)}) needs a rule table: gk.override(fn, table) or @gk.override(table).")
        tbl = _as_table(fn)
        return lambda f: override(f, tbl, strict=strict)
    if not callable(fn):
        raise GradkitError(f"override expects a function as its first argument, got {type(fn).__name__}.")
    # The same call signature as fn (functools.update_wrapper), which a Generic[R] cannot spell.
    return cast(F, Overridden(fn, _as_table(table), strict))
