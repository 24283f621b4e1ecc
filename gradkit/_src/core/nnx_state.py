"""Flax NNX modules among an overridden function's arguments: their state changes are kept, as ``nnx.jit`` keeps them.

``override(fn, table)`` traces ``fn`` like ``jax.jit``. A Flax NNX module is
a JAX pytree (flax >= 0.11), so a plain trace would take it apart into
arrays, run ``fn`` on a copy, and drop every change ``fn`` makes to it: the
running statistics of ``BatchNorm``, the counter of a ``Dropout``'s RNG
stream (the mask then repeats every step). ``nnx.jit`` exists for this; here
an overridden function does what ``nnx.jit`` does, with the public
:func:`flax.nnx.update_context` protocol (four steps)::

    outside (1) split the caller's graph nodes ─► pure arguments (graphdef static, leaves arrays)
    inside  (2) merge them into fresh nodes, run fn, (3) split the argument nodes and the output
    outside (4) merge: the caller's own nodes are updated in place (Variables, attributes,
                structure), nodes fn returned are the caller's objects where they alias them

The inside runs in a second overridden function, over the pure function, with
the same table and ``strict`` (the dispatcher hands :class:`Route` the maker
of it: this module does not import the dispatcher): it is traced once per
signature (the graphdefs are static parts of the key, as in ``nnx.jit``),
its rules spliced in, and compiled or inlined exactly as any overridden call.
``.lower``, ``.trace`` and ``.eval_shape`` with graph nodes among the
arguments are ``nnx.jit``'s own (:meth:`Route.staged`).

Flax is optional: nothing here imports it. :func:`has_graph_nodes` looks in
``sys.modules``; when ``flax.nnx`` was never imported, an overridden call pays
for one dictionary look-up.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Hashable, Mapping
from types import ModuleType
from typing import Generic, Protocol, TypeVar, cast

import jax
import numpy as np

from gradkit._src import compat
from gradkit._src.core import module_paths
from gradkit._src.errors import GradkitError, callable_name

__all__ = ["Route", "has_graph_nodes"]

_NNX = "flax.nnx"

R = TypeVar("R")
T = TypeVar("T")
# What the pure function returns: the argument nodes' new state (None: unchanged) and fn's output, nodes split.
_Pure = tuple["list[_Split] | None", object]


class _SplitContext(Protocol):
    """``flax.nnx.split_context``'s context (flax is not imported: the protocol says what is used)."""

    def flatten(self, node: object, *, with_paths: bool) -> tuple[Hashable, list[object]]: ...


class _MergeContext(Protocol):
    """``flax.nnx.merge_context``'s context."""

    def unflatten(self, graphdef: Hashable, leaves: list[object]) -> object: ...


class Inner(Protocol):
    """The second overridden function, over the pure function (the dispatcher makes it: ``Overridden``)."""

    trace_count: int

    def __call__(self, *args: object, **kwargs: object) -> _Pure: ...

    def clear_cache(self) -> None: ...


class _Split:
    """One graph node, split: its graphdef (static, part of the trace key) and its leaves (arrays)."""

    __slots__ = ("graphdef", "leaves")

    def __init__(self, graphdef: Hashable, leaves: list[object]) -> None:
        self.graphdef = graphdef
        self.leaves = leaves


jax.tree_util.register_pytree_node(
    _Split,
    lambda s: (s.leaves, s.graphdef),
    lambda graphdef, leaves: _Split(graphdef, list(leaves)),
)


def _is_split(x: object) -> bool:
    return type(x) is _Split


# Values that are never graph nodes and hold none: the common arguments skip the pytree walk.
_PLAIN: frozenset[type] = frozenset({compat.ArrayImpl, int, float, bool, complex, str, type(None), _Split})
_LEAVES = (compat.ArrayImpl, compat.Tracer, np.ndarray, np.generic, int, float, bool, complex, str, bytes,
           type(None))


def _graph_node_test(nnx: ModuleType) -> Callable[[object], bool]:
    """``flax.nnx``'s own test for a graph node: a Module, Rngs, Optimizer, any ``nnx.Pytree``, a Variable."""
    test: Callable[[object], bool] = nnx.graph.is_graph_node
    return test


def has_graph_nodes(args: tuple[object, ...], kwargs: Mapping[str, object]) -> bool:
    """Whether a call's arguments hold Flax NNX graph nodes (modules, variables, ``nnx.Rngs``), at any depth.

    False at once when ``flax.nnx`` was never imported: flax is never
    imported here.

    Examples:
      >>> import jax.numpy as jnp
      >>> has_graph_nodes((jnp.ones(3), 2.0), {})
      False
    """
    nnx = sys.modules.get(_NNX)
    if nnx is None:
        return False
    is_node = _graph_node_test(nnx)
    # Builtin containers are walked here (a parameter dict costs a type check per leaf); other
    # pytrees, which may hold a module among their children, by jax.tree_util.
    todo = [*args, *kwargs.values()]
    while todo:
        x = todo.pop()
        t = type(x)
        if t in _PLAIN:
            continue
        if t is dict and isinstance(x, dict):
            todo.extend(x.values())
        elif (t is tuple or t is list) and isinstance(x, (tuple, list)):
            todo.extend(x)
        elif is_node(x):
            return True
        elif not isinstance(x, (compat.Tracer, np.ndarray, np.generic)):
            is_leaf = lambda y: _is_split(y) or is_node(y)
            if any(is_node(leaf) for leaf in jax.tree_util.tree_leaves(x, is_leaf=is_leaf)):
                return True
    return False


class Route(Generic[R]):
    """The NNX path of one overridden function: split, the pure function overridden, merge back.

    The dispatcher makes one per overridden function, on its first call with
    graph nodes, and gives it what this module needs of the dispatcher:
    ``override_pure`` makes the second overridden function (the same table,
    ``strict`` and rule cache) over a pure function, and ``count`` adds that
    function's traces to the count of the one the user holds.
    """

    def __init__(self, fn: Callable[..., R], override_pure: Callable[[Callable[..., _Pure]], Inner],
                 count: Callable[[int], None], *, scoped: bool = False) -> None:
        nnx = sys.modules[_NNX]
        if not all(hasattr(nnx, n) for n in ("update_context", "split_context", "merge_context", "SplitContext")) \
                or not hasattr(nnx.SplitContext, "flatten"):
            version = getattr(sys.modules.get("flax"), "__version__", "?")
            raise GradkitError(
                f"override({callable_name(fn)}): its arguments hold Flax NNX modules, whose state changes "
                "(BatchNorm statistics, RNG counters) gradkit keeps with flax.nnx's update_context API, which this "
                f"flax ({version}) lacks. Upgrade flax (>= 0.11), or pass the state explicitly: graphdef, state = "
                "nnx.split(model) outside, nnx.merge(graphdef, state) inside, and return nnx.state(model).")
        self._nnx = nnx
        self._fn = fn
        self._count = count
        self._is_node = _graph_node_test(nnx)
        self._scoped = scoped  # the table has scoped rules: modules are inside their attribute paths while fn runs
        self._jitted: object | None = None  # nnx.jit of the overridden function, for .lower/.trace/.eval_shape
        self._lock = threading.Lock()

        def pure(*pure_args: object, **pure_kwargs: object) -> _Pure:
            return self._inside(pure_args, pure_kwargs)

        name = callable_name(fn)
        pure.__name__, pure.__qualname__ = name.rsplit(".", 1)[-1], name
        pure.__doc__ = getattr(fn, "__doc__", None)
        # JAX's and gradkit's messages about the trace name the user's function and its parameters.
        vars(pure).update(__wrapped__=fn)
        self._inner = override_pure(pure)

    def clear_cache(self) -> None:
        """Drops the pure function's programs and the ``nnx.jit`` made for the ahead-of-time stages."""
        self._inner.clear_cache()
        self._jitted = None

    def staged(self, overridden: Callable[..., R], stage: str, args: tuple[object, ...],
               kwargs: Mapping[str, object]) -> object:
        """``nnx.jit(overridden).<stage>(*args, **kwargs)``: ``lower``, ``trace`` or ``eval_shape`` as ``nnx.jit``'s.

        ``nnx.jit`` splits the graph nodes into pure arguments for JAX's stage
        and wraps what it returns: the compiled function takes the modules
        and writes their new state back; ``eval_shape`` changes nothing of the
        caller's. Inside, ``overridden`` runs on the merged nodes as in any
        call under ``nnx.jit``, so the program is the rewritten one.
        """
        jitted = self._jitted
        if jitted is None:
            with self._lock:
                if self._jitted is None:
                    self._jitted = self._nnx.jit(overridden)
                jitted = self._jitted
        method = getattr(jitted, stage, None)
        if method is None:
            version = getattr(sys.modules.get("flax"), "__version__", "?")
            raise GradkitError(
                f"override({callable_name(self._fn)}).{stage}: its arguments hold Flax NNX modules, which gradkit "
                f"stages as nnx.jit does, and nnx.jit of this flax ({version}) has no .{stage}. Upgrade flax, or "
                f"split the module yourself: graphdef, state = nnx.split(model), then .{stage} a function of the "
                "state that calls nnx.merge(graphdef, state).")
        return method(*args, **kwargs)

    # --- (1) and (4): outside, in the caller's trace

    def __call__(self, args: tuple[object, ...], kwargs: Mapping[str, object]) -> R:
        nnx = self._nnx
        before = self._inner.trace_count
        nodes: list[object] = []

        def split(node: object) -> _Split:
            nodes.append(node)
            return _Split(*ctx.flatten(node, with_paths=False))

        with nnx.update_context(self):
            ctx: _SplitContext
            with nnx.split_context(self) as ctx:
                pure_args, pure_kwargs = self._map_nodes(split, (args, dict(kwargs)))
            nodes_out, out = self._inner(*pure_args, **pure_kwargs)
            if self._inner.trace_count != before:  # the function the user holds counts these traces
                self._count(self._inner.trace_count - before)
            if nodes_out is not None or any(map(_is_split, jax.tree_util.tree_leaves(out, is_leaf=_is_split))):
                self._check_writable(nodes)
            with nnx.merge_context(self, False) as mctx:
                _, merged = _merge_all(mctx, (nodes_out, out))
        return cast(R, merged)  # fn's own output: its nodes merged back

    def _check_writable(self, nodes: list[object]) -> None:
        """Refuses, before anything is written, when a Variable of the caller's nodes cannot be updated here.

        Flax checks each Variable as it writes it, after the node holding it
        was emptied for the update: a refusal there would leave the caller's
        module without its attributes. ``_can_update`` is the test Flax's own
        transforms make before they extract a graph (``flax.nnx.extract``).
        """
        for _, x in self._nnx.iter_graph(nodes):
            if isinstance(x, self._nnx.Variable) and not _can_update(x):
                raise GradkitError(_trace_level_message(self._fn, x))

    # --- (2) and (3): inside, while the second overridden function traces

    def _inside(self, pure_args: tuple[object, ...], pure_kwargs: dict[str, object]) -> _Pure:
        nnx = self._nnx
        ctx: _MergeContext
        with nnx.merge_context(self, True) as ctx:
            args, kwargs = _merge_all(ctx, (pure_args, pure_kwargs))
        nodes = [x for x in jax.tree_util.tree_leaves((args, kwargs), is_leaf=self._is_node) if self._is_node(x)]
        before = self._snapshot(nodes)
        if not self._scoped:
            out = self._fn(*args, **kwargs)
        else:
            token = object()  # this trace's: a module's paths from any other trace are not read
            tagged = self._tag((args, kwargs), token)
            ids = module_paths.equinox_paths((args, kwargs))
            found = [*(p for ps in tagged.values() for p in ps), *(p for ps in ids.values() for p in ps)]
            out = None
            try:
                with module_paths.tracing(ids, found, token):
                    out = self._fn(*args, **kwargs)
            finally:  # the paths go before anything is split: the state written back is fn's alone
                self._untag([*nodes, *self._nodes_in(out)])
        changed = not _same(before, self._snapshot(nodes))
        sctx: _SplitContext
        with nnx.split_context(self) as sctx:
            def split(node: object) -> _Split:
                return _Split(*sctx.flatten(node, with_paths=False))

            # Unchanged argument nodes are not written back (decided once per signature, at trace time):
            # a read-only module keeps working where writing would fail, e.g. one closed over by a jax.grad
            # function, whose Variables belong to the trace outside it.
            return [split(n) for n in nodes] if changed else None, self._map_nodes(split, out)

    # --- module paths as scopes (module_paths): on the merged copies only, never on the caller's nodes

    def _nodes_in(self, tree: object) -> list[object]:
        return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=self._is_node) if self._is_node(x)]

    def _tag(self, tree: object, token: object) -> dict[int, tuple[module_paths.Path, ...]]:
        """Each module reachable from the call's arguments carries this trace's ``token`` and its attribute paths
        (:data:`module_paths.TAG`).

        A static attribute: the copies Flax's transforms make inside ``fn``
        (``nnx.vmap``, ``nnx.scan``, ``nnx.remat``) carry it too. Set without
        Flax's attribute bookkeeping, so that removing it leaves the module
        exactly as it was. ``nnx.List``/``nnx.Dict`` hold their entries and
        run nothing: their entries carry the paths.
        """
        nnx = self._nnx
        containers = tuple(getattr(nnx, n) for n in ("List", "Dict") if hasattr(nnx, n))

        def is_module(x: object) -> bool:
            return isinstance(x, nnx.Module) and not isinstance(x, containers)

        found = module_paths.find(module_paths.roots(tree, self._is_node), self._children, is_module)
        for node, paths in found.values():
            module_paths.wrap_methods(type(node), nnx.Module)
            object.__setattr__(node, module_paths.TAG, (token, tuple(paths)))
        return {i: tuple(paths) for i, (_, paths) in found.items()}

    def _children(self, node: object) -> list[tuple[module_paths.Path, object]]:
        """The graph nodes an NNX node holds, each with its key path: attributes, list/dict entries."""
        out: list[tuple[module_paths.Path, object]] = []
        variable = self._nnx.Variable
        if isinstance(node, variable):
            return out
        for key, value in vars(node).items():
            name = str(key)  # flax 0.12.0 keeps an nnx.List's entries under their int indices
            if name.startswith("_pytree__") or name == module_paths.TAG or isinstance(value, variable):
                continue
            if self._is_node(value):
                out.append(((name,), value))
            elif not isinstance(value, _LEAVES):  # a list, tuple, dict or other pytree that may hold nodes
                leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=self._is_node)[0]
                out.extend(((name, *(module_paths.key_name(k) for k in kp)), x) for kp, x in leaves
                           if self._is_node(x) and not isinstance(x, variable))
        return out

    def _untag(self, nodes: list[object]) -> None:
        tag = module_paths.TAG
        for _, x in self._nnx.iter_graph(nodes):
            if tag in getattr(x, "__dict__", ()):
                delattr(x, tag)  # Flax's own delattr: its record of the attribute goes too, if a transform made one

    def _snapshot(self, nodes: list[object]) -> tuple[Hashable, list[object]]:
        """The argument nodes' graphdef (structure, static attributes) and leaves: did ``fn`` change them?"""
        ctx: _SplitContext
        with self._nnx.split_context() as ctx:  # no tag: no part in the update protocol
            graphdef, leaves = ctx.flatten(nodes, with_paths=False)
        return graphdef, leaves

    def _map_nodes(self, f: Callable[[object], object], tree: T) -> T:
        """``tree`` with each graph node ``n`` replaced by ``f(n)`` (nodes are not entered)."""
        is_node = self._is_node
        mapped: T = jax.tree_util.tree_map(lambda x: f(x) if is_node(x) else x, tree, is_leaf=is_node)
        return mapped  # the same structure, nodes replaced


def _can_update(variable: object) -> bool:
    """Whether Flax lets ``variable`` be written here: ``Variable._can_update`` (flax 0.12.x, x >= 1); before
    it, the test ``Variable.__setattr__`` makes (its trace state is this trace's), which flax 0.12.0 — what
    pip gives JAX 0.8 — has."""
    can = getattr(variable, "_can_update", None)
    if can is not None:
        return bool(can)
    state = getattr(variable, "_trace_state", None)
    return state is None or bool(state.is_valid())


def _same(a: tuple[Hashable, list[object]], b: tuple[Hashable, list[object]]) -> bool:
    """Same graphdef, and the very same leaf objects (an untouched Variable keeps its value object)."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(x is y for x, y in zip(a[1], b[1]))


def _merge_all(ctx: _MergeContext, tree: T) -> T:
    """``tree`` with each :class:`_Split` merged back into a graph node, in order, in one merge context."""
    merged: T = jax.tree_util.tree_map(
        lambda x: ctx.unflatten(x.graphdef, x.leaves) if _is_split(x) else x, tree, is_leaf=_is_split)
    return merged  # the same structure, graph nodes in place of the splits


def _trace_level_message(fn: Callable[..., object], variable: object) -> str:
    return (
        f"override({callable_name(fn)}): the Flax NNX state it changed cannot be written back: a "
        f"{type(variable).__name__} of a module passed to it was created outside the JAX transform this call runs "
        "in (e.g. a model closed over by a jax.jit or jax.grad function), and Flax allows no update from another "
        "trace level. gradkit keeps NNX state changes as nnx.jit does, and refuses rather than drop them; nothing "
        "was changed. Pass the module through the transforms as an argument (nnx.jit / nnx.grad / "
        "nnx.value_and_grad, which carry NNX state, instead of jax.jit / jax.grad), or call the overridden "
        "function outside them.")

