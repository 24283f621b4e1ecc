"""Named ops: a composite function that appears as one equation a table can target.

``gk.op("log1pexp")(fn)`` wraps ``fn`` in ``jax.jit`` under a reserved name, so
the traced program holds a single ``jit`` equation for each call. Unmatched,
it is exactly ``jax.jit(fn)``: same values, same gradients.

Each call signature (argument structure, static values, keyword arguments)
of a named op is one :class:`Signature`, registered under the ``jit`` name
it traces to, so the dispatcher can rebuild a rule's ``op.inputs`` and
``op.outputs`` from the equation's flat values. ``gk.custom_gradient``
functions are named ops too and use the same class.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import jax

from gradkit._src import compat
from gradkit._src.core import args as args_lib
from gradkit._src.core.cache import LRU
from gradkit._src.errors import GradkitError

F = TypeVar("F", bound=Callable[..., object])
T = TypeVar("T")

_counter = itertools.count()
_lock = threading.Lock()


@dataclasses.dataclass(eq=False)
class Signature:
    """One call signature of a named op.

    Attributes:
      name: the op name tables use.
      split: the positional arguments (a tuple) split into dynamic leaves,
        which become the ``jit`` equation's inputs, and static ones.
      kwargs: the keyword arguments (all static).
      out_tree: the output structure, set when the op is traced.
      jit_name: the name of the ``jit`` equation, set by :func:`register`.
    """

    name: str
    split: args_lib.Split
    kwargs: dict[str, object]
    out_tree: jax.tree_util.PyTreeDef | None = None
    jit_name: str = ""

    @classmethod
    def of(cls, name: str, call_args: Sequence[object], kwargs: Mapping[str, object],
           dynamic: Callable[[object], bool] = args_lib.array_or_number) -> tuple[Signature, list[Any]]:
        """The signature of a call and its dynamic leaves (those where ``dynamic`` holds)."""
        split, dyn = args_lib.partition(tuple(call_args), dynamic)
        return cls(name, split, dict(kwargs)), dyn

    @functools.cached_property
    def key(self) -> Hashable:
        """Hashable cache key (:func:`args.static_key` for every static value); ``TypeError`` if unhashable."""
        kw_leaves, kw_tree = jax.tree_util.tree_flatten(self.kwargs)
        return (self.split.key, kw_tree, tuple(args_lib.static_key(x) for x in kw_leaves))

    def args(self, dyn: Sequence[object]) -> tuple[object, ...]:
        """The positional arguments, with ``dyn`` (one value per ``jit`` input) at the dynamic leaves."""
        return tuple(self.split.combine(list(dyn)))

    def outputs(self, flat: Sequence[object]) -> object:
        """The structured outputs from one value per ``jit`` output."""
        assert self.out_tree is not None, "a named op's outputs are read after it is traced"
        structured: object = jax.tree_util.tree_unflatten(self.out_tree, list(flat))
        return structured

    def dynamic(self, per_leaf: Sequence[T]) -> list[T]:
        """From one value per leaf of :meth:`args` (statics included), those of the ``jit`` inputs."""
        return [per_leaf[i] for i in self.split.dyn_pos]


# jit name -> signature, for the dispatcher to read a named op's equation.
# Who keeps a signature alive: the decorated function's per-signature cache
# (an LRU), the last MAXSIZE registered (so a function decorated inside a
# traced function and dropped at once is still found when a cached trace of
# an enclosing jax.jit is read later), and, for as long as an overridden
# function's program lives, that program (pinned while it is traced, see
# `pinning`). A signature found by none of them is an error
# (`require`), never a silent fallback.
_REGISTRY: weakref.WeakValueDictionary[str, Signature] = weakref.WeakValueDictionary()
_RECENT: LRU[str, Signature] = LRU("named op signatures")
_pins = threading.local()


def lookup(jit_name: str) -> Signature | None:
    return _REGISTRY.get(jit_name)


def require(jit_name: str, where: str) -> Signature:
    """The signature of a named op's ``jit`` equation; a ``[gradkit]`` error if it is gone."""
    sig = _REGISTRY.get(jit_name)
    if sig is None:
        raise GradkitError(
            f"named op '{jit_name.split(':', 2)[-1]}' at {where}: its call signature is no longer known (the "
            "op was decorated inside a function that was traced earlier and the decorated function is gone), "
            "so its rule cannot see its inputs. Decorate the op once, at module level, and call that "
            "function, or clear the cached traces first with jax.clear_caches().")
    return sig


def register(sig: Signature) -> None:
    """Gives ``sig`` a fresh ``jit`` name and registers it."""
    with _lock:
        sig.jit_name = f"{compat.NAMED_OP_PREFIX}{next(_counter)}:{sig.name}"
        _REGISTRY[sig.jit_name] = sig
    _RECENT.setdefault(sig.jit_name, sig)


@contextlib.contextmanager
def pinning() -> Iterator[dict[str, Signature]]:
    """Collects (strongly) every named op signature called in this thread while the block runs.

    The dispatcher traces a user's function inside it and keeps the result
    with the program, so every named op of the program stays readable
    however many there are.
    """
    stack = getattr(_pins, "stack", None)
    if stack is None:
        stack = _pins.stack = []
    pinned: dict[str, Signature] = {}
    stack.append(pinned)
    try:
        yield pinned
    finally:
        stack.pop()


def pin(sig: Signature) -> None:
    """Records ``sig`` in every :func:`pinning` block open in this thread (cheap when none is)."""
    stack = getattr(_pins, "stack", None)
    if stack:
        for pinned in stack:
            pinned[sig.jit_name] = sig


def compile_op(sig: Signature, body: Callable[[list[jax.Array]], object]) -> Callable[..., list[jax.Array]]:
    """``jax.jit`` of ``body`` (dynamic leaves -> outputs) under ``sig``'s jit name; flat outputs."""

    def flat_body(*dyn: jax.Array) -> list[jax.Array]:
        flat, sig.out_tree = jax.tree_util.tree_flatten(body(list(dyn)))
        return flat

    flat_body.__name__ = flat_body.__qualname__ = sig.jit_name
    return jax.jit(flat_body)


def op(name: str) -> Callable[[F], F]:
    """Makes a function one named operation that a rule table can target.

    Inside any traced program the decorated function appears as a single
    equation named ``name``; ``gk.override(f, {name: rule})`` then replaces its
    gradient, and the rule sees the function's inputs (positional arguments,
    pytrees allowed) and outputs. Keyword arguments are static (they appear in
    ``op.params``). Unmatched, the function behaves exactly like itself under
    ``jax.jit``.

    Args:
      name: the op name tables use, e.g. ``"log1pexp"``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> @gk.op("log1pexp")
      ... def log1pexp(x):
      ...     return jnp.log1p(jnp.exp(x))
      >>> sigmoid_grad = gk.vjp_rule(lambda op, g: (g * jax.nn.sigmoid(op.inputs[0]),))
      >>> f = gk.override(log1pexp, {"log1pexp": sigmoid_grad})
      >>> float(jax.grad(log1pexp)(100.0)), float(jax.grad(f)(100.0))
      (nan, 1.0)
    """
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise GradkitError(f"gk.op: the name must be a non-empty string without surrounding spaces, got {name!r}.")

    def decorate(fn: F) -> F:
        if not callable(fn):
            raise GradkitError(f"gk.op({name!r}) decorates a function, got {type(fn).__name__}.")
        # One signature (and jit name) per call key: static values, and the
        # dynamic leaves' whole types, so a trace's output structure belongs
        # to exactly the calls that share that trace.
        jitted: LRU[Hashable, tuple[Signature, Callable[..., list[jax.Array]]]] = LRU(f"gk.op({name!r})")

        @functools.wraps(fn)
        def wrapper(*args: object, **kwargs: object) -> object:
            for k, v in kwargs.items():
                if any(args_lib.is_array(x) for x in jax.tree_util.tree_leaves(v)):
                    raise GradkitError(
                        f"named op '{name}' got an array in keyword argument `{k}`; keyword arguments of a "
                        f"named op are static. Pass arrays positionally: {name}(..., {k}).")
            sig, dyn = Signature.of(name, args, kwargs)
            try:
                key = args_lib.call_key(sig.key, dyn)
            except TypeError as e:
                raise GradkitError(
                    f"named op '{name}' got an unhashable static argument ({e}). Non-array arguments are "
                    "static and must be hashable: use a tuple instead of a list, or pass an array.") from None
            entry = jitted.get(key)
            if entry is None:
                register(sig)

                def call(d: Sequence[jax.Array], sig: Signature = sig) -> object:

                    return fn(*sig.args(d), **sig.kwargs)

                entry = jitted.setdefault(key, (sig, compile_op(sig, call)))
            sig, call = entry
            pin(sig)
            try:
                flat_out = call(*dyn)
            except compat.CONCRETIZATION_ERRORS as e:
                code = getattr(fn, "__code__", None)
                where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
                compat.add_note(e, (
                    f"[gradkit] named op '{name}'{where} is traced like jax.jit (the `dyn[i]` above are its "
                    "array and Python-number positional arguments, in order): they are abstract, so Python "
                    "control flow on them fails. Use jnp.where / lax.cond, or pass static values as keyword "
                    "arguments."))
                raise
            return sig.outputs(flat_out)

        wrapper.gradkit_op_name = name  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate
