"""Module attribute paths as scopes: a Flax NNX or Equinox module passed to an overridden function is inside its path.

Flax NNX records no name stack, and Equinox records only its layers' type
names (``eqx.nn.MLP/eqx.nn.Linear``), so ``RuleTable.within("enc")`` would
find nothing of an NNX model's ``enc`` submodule. While an overridden
function with scoped rules is traced, each call of a module method enters a
``jax.named_scope`` named for the module's attribute path
(:func:`gradkit._src.core.scope.path_entry`: ``.enc``, ``.layers.0``), so
the equations it makes carry the path as scopes do:

* **Which modules.** Those passed to the function, as arguments or inside
  one (a dict's key or a list's index starts their path; a module passed
  itself is the top), and every module reachable from them: attributes,
  ``nnx.List``/``nnx.Dict`` entries, tuple fields. A module reached under
  several paths is inside each (its entry ``.a|b`` matches either).
* **Relative entries.** A call inside another module's call enters the path
  relative to that module (``.lin`` under ``.enc``), as Flax linen's names
  nest, so an equation's scopes spell its whole path (``enc/lin``) however
  it was reached; a method calling another of its own module enters nothing.
* **How the hook knows a module.** An NNX module carries its paths in an
  attribute, :data:`TAG`, set on gradkit's own copies inside the trace (the
  caller's objects are never touched) and removed before their state is
  split back; the attribute is static, so the copies Flax's transforms make
  inside the trace (``nnx.vmap``, ``nnx.scan``, ``nnx.remat``, ``nnx.jit``)
  carry it too. An Equinox module is known by identity: the objects the
  trace rebuilt from the arguments (a copy made inside the function, e.g. by
  ``eqx.filter_vmap``, has only Equinox's type names).
* **The hook** wraps each module class's ``__call__`` and public methods
  once (:func:`wrap_methods`, under a lock). The wrapper reads a context
  variable, set only while gradkit traces a function with scoped rules
  (:func:`tracing`): anywhere else, and in every other thread, it calls the
  method and does nothing more. Neither JAX nor flax is patched, and flax
  and Equinox are never imported here (they are found in ``sys.modules``).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax

from gradkit._src.core.scope import path_entry

__all__ = ["Path", "TAG", "collecting", "dotted", "equinox_paths", "find", "roots", "tracing", "wrap_methods"]

Path = tuple[str, ...]
TAG = "_gradkit_module_paths"  # (trace token, paths) of an NNX module, on gradkit's copies inside the trace only
_WRAPS = "_gradkit_wraps"  # on a wrapper: the method it wraps
_MAX_PATHS = 8  # paths recorded per module (a module shared many times over is inside each of the first few)
_EQX = "equinox"


@dataclasses.dataclass(frozen=True)
class _Frame:
    """The state of one trace: modules known by identity, the paths of the module running innermost."""

    ids: Mapping[int, tuple[Path, ...]]
    token: object  # an NNX module's TAG counts in the trace that set it only (a stale one is ignored)
    current: tuple[Path, ...] = ((),)  # the top: paths are relative to the function's arguments


_FRAME: contextvars.ContextVar[_Frame | None] = contextvars.ContextVar("gradkit_module_frame", default=None)
_FOUND: contextvars.ContextVar[list[Path] | None] = contextvars.ContextVar("gradkit_module_found", default=None)
_WRAPPED: weakref.WeakSet[type] = weakref.WeakSet()
_LOCK = threading.Lock()


def dotted(path: Path) -> str:
    """A path as users write it: ``layers.3.attn``; the top is ``(top)``.

    Examples:
      >>> dotted(("layers", "3", "attn")), dotted(())
      ('layers.3.attn', '(top)')
    """
    return ".".join(path) or "(top)"


def key_name(key: object) -> str:
    """One component of a ``jax.tree_util`` key path: an attribute's name, a dict key, a sequence index."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def roots(tree: object, is_node: Callable[[object], bool]) -> list[tuple[Path, object]]:
    """The nodes in a call's ``(args, kwargs)``, each with its path: a dict key or list index inside an
    argument starts it, the argument itself is the top.

    Examples:
      >>> roots(((1, {"enc": "m"}), {"dec": "n"}), lambda x: isinstance(x, str))
      [(('enc',), 'm'), ((), 'n')]
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_node)[0]
    return [(tuple(key_name(k) for k in kp[2:]), x) for kp, x in leaves if is_node(x)]


def find(start: Iterable[tuple[Path, object]], children: Callable[[object], Iterable[tuple[Path, object]]],
         keep: Callable[[object], bool]) -> dict[int, tuple[object, list[Path]]]:
    """Every node reachable from ``start`` that ``keep`` accepts, by identity, with the paths it is reached
    under (at most a few each; a cycle is not followed).

    Examples:
      >>> tree = {"a": {"x": "leaf"}, "b": {}}
      >>> kids = lambda n: [((k,), v) for k, v in n.items()] if isinstance(n, dict) else []
      >>> sorted(p for _, ps in find([((), tree)], kids, lambda n: isinstance(n, dict)).values() for p in ps)
      [(), ('a',), ('b',)]
    """
    out: dict[int, tuple[object, list[Path]]] = {}
    expanded: dict[int, int] = {}

    def visit(node: object, path: Path, above: frozenset[int]) -> None:
        n = expanded.get(id(node), 0)
        if n >= _MAX_PATHS:
            return
        expanded[id(node)] = n + 1
        if keep(node):
            out.setdefault(id(node), (node, []))[1].append(path)
        inside = above | {id(node)}
        for sub, child in children(node):
            if id(child) not in inside:
                visit(child, path + sub, inside)

    for path, node in start:
        visit(node, path, frozenset())
    return out


def wrap_methods(cls: type, base: type) -> None:
    """Wraps ``__call__`` and the public methods of ``cls`` and its bases below ``base``, once per class.

    The wrapper does nothing but call the method outside :func:`tracing`.
    """
    if cls in _WRAPPED:
        return
    with _LOCK:
        for klass in cls.__mro__:
            if klass is base or not issubclass(klass, base) or klass in _WRAPPED:
                continue
            for name, value in list(vars(klass).items()):
                if (name == "__call__" or not name.startswith("_")) and inspect.isfunction(value) \
                        and _WRAPS not in vars(value):
                    setattr(klass, name, _wrapped(value))
            _WRAPPED.add(klass)


def _wrapped(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: object, *args: object, **kwargs: object) -> Any:
        frame = _FRAME.get()
        if frame is None:  # not inside gradkit's trace of a function with scoped rules
            return method(self, *args, **kwargs)
        paths = frame.ids.get(id(self))
        if paths is None:
            tag = getattr(self, "__dict__", {}).get(TAG)
            paths = tag[1] if isinstance(tag, tuple) and tag[0] is frame.token else None
        if not paths:
            return method(self, *args, **kwargs)
        entry, current = _enter(frame.current, paths)
        token = _FRAME.set(dataclasses.replace(frame, current=current))
        try:
            if entry is None:
                return method(self, *args, **kwargs)
            with jax.named_scope(entry):
                return method(self, *args, **kwargs)
        finally:
            _FRAME.reset(token)

    vars(call)[_WRAPS] = method
    return call


def _enter(current: tuple[Path, ...], paths: tuple[Path, ...]) -> tuple[str | None, tuple[Path, ...]]:
    """The name-stack entry of a call of a module at ``paths`` inside one at ``current``, and the new current.

    Relative to the running module where its paths extend it; none for the module itself (a method calling
    another of its own); else the whole paths (a module called from one that does not hold it).
    """
    below = [(c, p) for c in current for p in paths if p[:len(c)] == c]
    rel = sorted({p[len(c):] for c, p in below})
    if () in rel:
        return None, current
    if rel:
        return path_entry(rel), tuple(dict.fromkeys(p for _, p in below))
    return path_entry(sorted(paths)), paths


@contextlib.contextmanager
def tracing(ids: Mapping[int, tuple[Path, ...]] | None, found: Iterable[Path] = (),
            token: object = None) -> Iterator[None]:
    """While a function's body is traced: module calls enter their paths (``None``: they enter nothing).

    ``ids`` maps modules known by identity (Equinox's) to their paths; NNX
    modules carry theirs, ``(token, paths)`` in :data:`TAG`, read when
    ``token`` is this trace's. ``found`` is what :func:`collecting` hands to
    the strict check. Each trace sets its own state, so an overridden
    function traced inside another's starts from its own arguments.
    """
    collected = _FOUND.get()
    if collected is not None:
        collected.extend(found)
    token = _FRAME.set(None if ids is None else _Frame(ids, object() if token is None else token))
    try:
        yield
    finally:
        _FRAME.reset(token)


@contextlib.contextmanager
def collecting() -> Iterator[list[Path]]:
    """The module paths the traces inside this block found (for ``strict=True``'s message)."""
    found: list[Path] = []
    token = _FOUND.set(found)
    try:
        yield found
    finally:
        _FOUND.reset(token)


def equinox_paths(tree: object) -> dict[int, tuple[Path, ...]]:
    """The Equinox modules in a call's ``(args, kwargs)`` and below, by identity, with their paths.

    Empty at once when Equinox was never imported. Equinox's own machinery
    (``equinox._*``: bound methods, ``filter_jit`` wrappers) is not a module here.
    """
    eqx = sys.modules.get(_EQX)
    if eqx is None:
        return {}
    base: type = eqx.Module

    def is_module(x: object) -> bool:
        return isinstance(x, base) and not type(x).__module__.startswith("equinox._")

    def children(x: object) -> list[tuple[Path, object]]:
        leaves = jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x and isinstance(y, base))[0]
        return [(tuple(key_name(k) for k in kp), y) for kp, y in leaves if is_module(y)]

    found = find(roots(tree, is_module), children, is_module)
    for node, _ in found.values():
        wrap_methods(type(node), base)
    return {i: tuple(paths) for i, (_, paths) in found.items()}
