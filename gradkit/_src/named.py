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

import collections
import dataclasses
import functools
import itertools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax

from gradkit._src import args as args_lib
from gradkit._src import compat
from gradkit._src.errors import GradkitError

F = TypeVar("F", bound=Callable[..., Any])

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
    kwargs: dict[str, Any]
    out_tree: Any = None
    jit_name: str = ""

    @classmethod
    def of(cls, name: str, call_args: Sequence[Any], kwargs: dict[str, Any],
           dynamic: Callable[[Any], bool] = args_lib.array_or_number) -> tuple[Signature, list[Any]]:
        """The signature of a call and its dynamic leaves (those where ``dynamic`` holds)."""
        split, dyn = args_lib.partition(tuple(call_args), dynamic)
        return cls(name, split, dict(kwargs)), dyn

    @functools.cached_property
    def key(self) -> Any:
        """Hashable cache key (:func:`args.static_key` for every static value); ``TypeError`` if unhashable."""
        kw_leaves, kw_tree = jax.tree_util.tree_flatten(self.kwargs)
        return (self.split.key, kw_tree, tuple(args_lib.static_key(x) for x in kw_leaves))

    def args(self, dyn: Sequence[Any]) -> tuple[Any, ...]:
        """The positional arguments, with ``dyn`` (one value per ``jit`` input) at the dynamic leaves."""
        return tuple(self.split.combine(list(dyn)))

    def outputs(self, flat: Sequence[Any]) -> Any:
        """The structured outputs from one value per ``jit`` output."""
        return jax.tree_util.tree_unflatten(self.out_tree, list(flat))

    def dynamic(self, per_leaf: Sequence[Any]) -> list[Any]:
        """From one value per leaf of :meth:`args` (statics included), those of the ``jit`` inputs."""
        return [per_leaf[i] for i in self.split.dyn_pos]


# jit name -> signature. Weak: an entry lives while its decorated function
# (whose per-signature cache holds it) or a traced program (custom_gradient's
# rules hold theirs) does, so functions decorated on the fly do not pile up.
# The last 128 also stay alive here, for a function decorated inside
# a traced function and dropped before the dispatcher reads the program.
_REGISTRY: weakref.WeakValueDictionary[str, Signature] = weakref.WeakValueDictionary()
_RECENT: collections.deque[Signature] = collections.deque(maxlen=128)


def lookup(jit_name: str) -> Signature | None:
    return _REGISTRY.get(jit_name)


def register(sig: Signature) -> None:
    """Gives ``sig`` a fresh ``jit`` name and registers it."""
    with _lock:
        sig.jit_name = f"{compat.NAMED_OP_PREFIX}{next(_counter)}:{sig.name}"
        _REGISTRY[sig.jit_name] = sig
        _RECENT.append(sig)


def compile_op(sig: Signature, body: Callable[[list[Any]], Any]) -> Callable[..., list[Any]]:
    """``jax.jit`` of ``body`` (dynamic leaves -> outputs) under ``sig``'s jit name; flat outputs."""

    def flat_body(*dyn: Any) -> list[Any]:
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
        jitted: dict[Any, tuple[Signature, Callable[..., Any]]] = {}

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for k, v in kwargs.items():
                if any(args_lib.is_array(x) for x in jax.tree_util.tree_leaves(v)):
                    raise GradkitError(
                        f"named op '{name}' got an array in keyword argument `{k}`; keyword arguments of a "
                        f"named op are static. Pass arrays positionally: {name}(..., {k}).")
            sig, dyn = Signature.of(name, args, kwargs)
            try:
                key = sig.key
            except TypeError as e:
                raise GradkitError(
                    f"named op '{name}' got an unhashable static argument ({e}). Non-array arguments are "
                    "static and must be hashable: use a tuple instead of a list, or pass an array.") from None
            entry = jitted.get(key)
            if entry is None:
                with _lock:
                    entry = jitted.get(key)
                if entry is None:
                    register(sig)
                    def call(d: Sequence[Any], sig: Any = sig) -> Any:
                        return fn(*sig.args(d), **sig.kwargs)

                    entry = (sig, compile_op(sig, call))
                    with _lock:
                        entry = jitted.setdefault(key, entry)
            sig, call = entry
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
