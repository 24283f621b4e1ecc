"""Named ops: a composite function that appears as one equation a table can target.

``gk.op("log1pexp")(fn)`` wraps ``fn`` in ``jax.jit`` under a reserved name, so
the traced program holds a single ``jit`` equation for each call. Unmatched,
it is exactly ``jax.jit(fn)``: same values, same gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import jax
import numpy as np

from gradkit._src import compat
from gradkit._src.errors import GradkitError

F = TypeVar("F", bound=Callable[..., Any])

_counter = itertools.count()
_lock = threading.Lock()


@dataclasses.dataclass
class _Instance:
    """One (function, argument structure, static values) of a named op."""

    name: str
    in_tree: Any
    dyn_positions: tuple[int, ...]
    static_leaves: tuple[Any, ...]
    kwargs: dict[str, Any]
    out_tree: Any = None

    def args(self, dyn: list[Any]) -> tuple[Any, ...]:
        leaves = list(self.static_leaves)
        for pos, x in zip(self.dyn_positions, dyn):
            leaves[pos] = x
        return jax.tree_util.tree_unflatten(self.in_tree, leaves)

    def outputs(self, flat_out: list[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, flat_out)


# jit name -> instance. Keeps what a rule needs to rebuild the op's arguments.
_REGISTRY: dict[str, _Instance] = {}


def lookup(jit_name: str) -> _Instance | None:
    return _REGISTRY.get(jit_name)


def is_dynamic(x: Any) -> bool:
    """Arrays (JAX, NumPy) and Python numbers are traced; everything else is static."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, compat.Tracer, bool, int, float, complex))


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
        jitted: dict[Any, tuple[_Instance, Callable[..., Any]]] = {}

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            leaves, in_tree = jax.tree_util.tree_flatten(args)
            dyn_positions = tuple(i for i, x in enumerate(leaves) if is_dynamic(x))
            static_leaves = tuple(None if i in dyn_positions else x for i, x in enumerate(leaves))
            for k, v in kwargs.items():
                if any(is_dynamic(x) and not isinstance(x, (bool, int, float, complex))
                       for x in jax.tree_util.tree_leaves(v)):
                    raise GradkitError(
                        f"named op '{name}' got an array in keyword argument `{k}`; keyword arguments of a "
                        f"named op are static. Pass arrays positionally: {name}(..., {k}).")
            try:
                # Static values are keyed with their types: 2, 2.0 and True are equal
                # in Python but must not share a traced program.
                kw_leaves, kw_tree = jax.tree_util.tree_flatten(kwargs)
                key = (in_tree, dyn_positions, tuple((type(x), x) for x in static_leaves), kw_tree,
                       tuple(_typed(x) for x in kw_leaves))
                hash(key)
            except TypeError as e:
                raise GradkitError(
                    f"named op '{name}' got an unhashable static argument ({e}). Non-array arguments are "
                    "static and must be hashable: use a tuple instead of a list, or pass an array.") from None
            entry = jitted.get(key)
            if entry is None:
                with _lock:
                    entry = jitted.get(key)
                    if entry is None:
                        entry = _make_instance(name, fn, in_tree, dyn_positions, static_leaves, dict(kwargs))
                        jitted[key] = entry
            inst, call = entry
            try:
                flat_out = call(*[leaves[i] for i in dyn_positions])
            except compat.CONCRETIZATION_ERRORS as e:
                code = getattr(fn, "__code__", None)
                where = f" ({code.co_filename}:{code.co_firstlineno})" if code is not None else ""
                compat.add_note(e, (
                    f"[gradkit] named op '{name}'{where} is traced like jax.jit (the `dyn[i]` above are its "
                    "array and Python-number positional arguments, in order): they are abstract, so Python "
                    "control flow on them fails. Use jnp.where / lax.cond, or pass static values as keyword "
                    "arguments."))
                raise
            return inst.outputs(flat_out)

        wrapper.gradkit_op_name = name  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def _typed(x: Any) -> Any:
    if isinstance(x, float):
        return (float, x.hex())  # -0.0 and 0.0 differ; all NaNs are one key
    return (type(x), x)


def _make_instance(name: str, fn: Callable[..., Any], in_tree: Any, dyn_positions: tuple[int, ...],
                   static_leaves: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[_Instance, Callable[..., Any]]:
    jit_name = f"{compat.NAMED_OP_PREFIX}{next(_counter)}:{name}"
    inst = _Instance(name, in_tree, dyn_positions, static_leaves, kwargs)

    def body(*dyn: Any) -> list[Any]:
        out = fn(*inst.args(list(dyn)), **kwargs)
        flat, inst.out_tree = jax.tree_util.tree_flatten(out)
        return flat

    body.__name__ = body.__qualname__ = jit_name
    _REGISTRY[jit_name] = inst
    return inst, jax.jit(body)
