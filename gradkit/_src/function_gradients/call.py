"""custom_gradient / custom_jvp: the user's function, what it and its closure return, and the checks.

:class:`FnInfo` is the decorated function (what error messages say about
it); :class:`Call` is that function at one call signature: it runs the
function, and turns what ``grad_fn`` / ``jvp_fn`` return into one checked
value per dynamic leaf (or output leaf), ``None`` for none.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from gradkit._src import compat
from gradkit._src.core import args as args_lib
from gradkit._src.core import named, validate
from gradkit._src.errors import GradkitError, describe

Kind = Literal["vjp", "both", "jvp"]


class _StaticLeaf:
    """Marks a static leaf in an index tree (a plain object, so it is a pytree leaf)."""

    def __repr__(self) -> str:
        return "<static>"


STATIC = _StaticLeaf()
is_array = args_lib.is_array
is_number = args_lib.is_number


def inexact(dtype: DTypeLike) -> bool:
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def summary(x: object) -> str:
    """``describe`` that also looks one level into tuples, lists and dicts."""
    if isinstance(x, (tuple, list)):
        inner = ", ".join(summary(v) if not isinstance(v, (tuple, list, dict)) else type(v).__name__ for v in x)
        return f"{type(x).__name__} ({inner})" if x else f"empty {type(x).__name__}"
    if isinstance(x, dict):
        return f"dict with keys {sorted(map(str, x))}"
    if callable(x) and not is_array(x):
        return f"function {getattr(x, '__name__', type(x).__name__)}"
    return describe(x)


def is_zero(t: object) -> bool:
    """A symbolic zero, a float0 tangent or None: no tangent/cotangent at all."""
    return (t is None or isinstance(t, jax.custom_derivatives.SymbolicZero)
            or getattr(t, "dtype", None) == jax.dtypes.float0)


def zero_tangent(x: jax.Array | np.ndarray) -> jax.Array | np.ndarray:
    if inexact(x.dtype):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def as_tangent(t: ArrayLike | jax.custom_derivatives.SymbolicZero | None, x: ArrayLike) -> jax.Array:
    dtype = jnp.result_type(x)
    if t is None or isinstance(t, jax.custom_derivatives.SymbolicZero) or is_zero(t):
        return jnp.zeros(np.shape(x), dtype)
    return jnp.asarray(t).astype(dtype)


# --------------------------------------------------------------------------- the user's function


@dataclasses.dataclass(eq=False)
class FnInfo:
    """The decorated function and what error messages say about it.

    ``method``: defined in a class body (or its first parameter is ``self``),
    so the first positional argument is bound, as TensorFlow binds ``self``.
    """

    fn: Callable[..., object]
    name: str
    kind: Kind
    method: bool = False

    @property
    def decorator(self) -> str:
        return "custom_jvp" if self.kind == "jvp" else "custom_gradient"

    @property
    def closure(self) -> str:
        return "jvp_fn" if self.kind == "jvp" else "grad_fn"

    @functools.cached_property
    def where(self) -> str:
        code = getattr(inspect.unwrap(self.fn), "__code__", None)
        loc = f" (defined at {code.co_filename}:{code.co_firstlineno})" if code is not None else ""
        return f"{self.decorator} function '{self.name}'{loc}"

    @functools.cached_property
    def params(self) -> tuple[list[str], str | None]:
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return [], None
        pos = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        return pos, var

    def accepted(self, params: Mapping[str, object]) -> dict[str, object]:
        """The op params that ``fn`` accepts as keyword arguments (all of them if it takes ``**kwargs``)."""
        try:
            sig = inspect.signature(self.fn).parameters
        except (TypeError, ValueError):
            return {}
        if any(p.kind == p.VAR_KEYWORD for p in sig.values()):
            return dict(params)
        names = {n for n, p in sig.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        return {k: v for k, v in params.items() if k in names}

    def arg_name(self, i: int) -> str:
        pos, var = self.params
        if i < len(pos):
            return f"`{pos[i]}`"
        if var is not None:
            return f"`{var}[{i - len(pos)}]`"
        return f"argument {i}"

    def split(self, result: object) -> tuple[object, Callable[..., object]]:
        """``(outputs, closure)`` from what ``fn`` returned: ``(out, f)`` or ``(o1, o2, ..., f)``."""
        if isinstance(result, (tuple, list)) and len(result) >= 2:
            closure = result[-1]
            if callable(closure) and not is_array(closure):
                return (result[0] if len(result) == 2 else tuple(result[:-1])), closure
        raise GradkitError(
            f"{self.where} must return `(outputs, {self.closure})` (or `out1, out2, ..., {self.closure}`), "
            f"a tuple whose last element is the {self.closure} function; got {summary(result)}. "
            f"Write `return y, {self.closure}`.")

    def call_closure(self, closure: Callable[..., object], args: Sequence[object], what: str) -> object:
        """Calls grad_fn / jvp_fn. What it raises keeps its type; a note names the function."""
        try:
            result = closure(*args)
        except GradkitError:
            raise
        except Exception as e:
            compat.add_note(e, self._note(e, args, what))
            raise
        if (self.kind != "jvp" and isinstance(result, tuple) and len(result) == 2 and callable(result[1])
                and not is_array(result[1])):
            raise GradkitError(
                f"{self.where}: its {self.closure} returned `(gradients, grad_grad_fn)`, TensorFlow's nested "
                "form, which gradkit does not support. A grad_fn written with JAX operations is differentiated "
                "automatically, so grad of grad already works; to control the second derivative, compute the "
                "gradient with another @gk.custom_gradient function inside grad_fn.")
        return result

    def _note(self, e: Exception, args: Sequence[object], what: str) -> str:
        note = f"[gradkit] raised in the {self.closure} of {self.where}."
        if isinstance(e, compat.CONCRETIZATION_ERRORS):
            note += (f" {self.closure} is traced with abstract {what}s: use jnp.where / lax.cond rather than "
                     "Python `if` on their values.")
        elif isinstance(e, TypeError) and any(a is None for a in jax.tree_util.tree_leaves(
                args, is_leaf=lambda x: x is None)):
            per = "positional argument" if self.kind == "jvp" else "output"
            none_for = "static arguments and integer leaves" if self.kind == "jvp" else "integer outputs"
            note += f" It gets one {what} per {per}, None for {none_for}."
        return note


# --------------------------------------------------------------------------- one call signature


@dataclasses.dataclass(eq=False)
class Call:
    """The decorated function at one :class:`named.Signature`.

    ``bound`` leading positional arguments (``self`` of a method) are not
    differentiated: their array leaves are closed over.
    """

    info: FnInfo
    sig: named.Signature
    bound: int = 0
    out_tree: jax.tree_util.PyTreeDef | None = None

    @functools.cached_property
    def n_bound_dyn(self) -> int:
        """How many dynamic leaves belong to the bound arguments (they come first)."""
        if not self.bound:
            return 0
        n_leaves = sum(c.num_leaves for c in self.sig.split.treedef.children()[:self.bound])
        return sum(1 for p in self.sig.split.dyn_pos if p < n_leaves)

    @property
    def n_dyn(self) -> int:
        """Differentiated dynamic leaves."""
        return len(self.sig.split.dyn_pos) - self.n_bound_dyn

    def run(self, dyn: Sequence[jax.Array]) -> tuple[object, Callable[..., object], list[jax.Array]]:
        """Calls the user's function on all dynamic leaves: (outputs, closure, flat output arrays)."""
        outputs, closure = self.info.split(self.info.fn(*self.sig.args(dyn), **self.sig.kwargs))
        leaves, self.out_tree = jax.tree_util.tree_flatten(outputs)
        flat = []
        for i, x in enumerate(leaves):
            if is_number(x):
                x = jnp.asarray(x)
            elif not is_array(x):
                raise GradkitError(
                    f"{self.info.where}: output leaf {i} is {summary(x)}; outputs must be arrays (or "
                    "pytrees of arrays). Return non-array values through a separate function.")
            flat.append(x)
        return outputs, closure, flat

    def outputs(self, flat: Sequence[object]) -> Any:
        assert self.out_tree is not None, "run() sets out_tree"
        return jax.tree_util.tree_unflatten(self.out_tree, list(flat))

    def index_args(self) -> tuple[object, ...]:
        """The differentiated positional arguments, each dynamic leaf replaced by its index, static ones by STATIC."""
        nb = self.n_bound_dyn
        n = len(self.sig.split.dyn_pos)
        return tuple(self.sig.split.scatter(list(range(-nb, n - nb)), fill=STATIC))[self.bound:]

    def user_tangents(self, tangents: Sequence[object]) -> tuple[object, ...]:
        """Tangents (one per differentiated leaf) structured like the arguments; None for the others."""
        per = [None] * self.n_bound_dyn + [None if is_zero(t) else t for t in tangents]
        return tuple(self.sig.split.scatter(per))[self.bound:]

    def gradients(self, closure: Callable[..., object], dyn: Sequence[jax.Array], ct_leaves: Sequence[object],
                  outputs_multi: bool) -> list[object]:
        """Calls grad_fn on the output cotangents; one checked gradient (or None) per differentiated leaf."""
        info = self.info
        ups = self.outputs(ct_leaves)
        result = info.call_closure(closure, tuple(ups) if outputs_multi else (ups,), "upstream gradient")
        refs = self.index_args()
        names = [info.arg_name(i + self.bound) for i in range(len(refs))]
        flat = _align(info, result, refs, names, "gradient", "positional argument")
        markers = jax.tree_util.tree_leaves(refs)
        labels = [lab for r, name in zip(refs, names) for lab in _labels(r, name)]
        grads: list[object] = [None] * len(dyn)
        for v, marker, label in zip(flat, markers, labels):
            if marker is STATIC:
                continue  # static arguments have no gradient; whatever grad_fn said is dropped
            grads[marker] = _check(info, v, dyn[marker], label, "gradient")
        return grads

    def tangents_out(self, result: object, outputs: object, out: Sequence[jax.Array]) -> list[object]:
        """Checks jvp_fn's result; one tangent (or None) per output leaf."""
        ref = self.outputs(list(range(len(out))))
        refs, names = (list(ref), [f"output {i}" for i in range(len(ref))]) if is_multi(outputs) else (
            [ref], ["the output"])
        flat = _align(self.info, result, refs, names, "output tangent", "output")
        labels = [lab for r, name in zip(refs, names) for lab in _labels(r, name)]
        return [_check(self.info, v, o, label, "output tangent") for v, o, label in zip(flat, out, labels)]


def is_multi(outputs: object) -> bool:
    return isinstance(outputs, (tuple, list))


# --------------------------------------------------------------------------- checks


def _unwrap_single(value: object, ref: object) -> object:
    """For one expected entry, accept both ``g`` and ``(g,)``."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        if not isinstance(ref, (tuple, list)) or value[0] is None or isinstance(value[0], (tuple, list)):
            return value[0]
    return value


def _align(info: FnInfo, value: object, refs: Sequence[object], labels: Sequence[str], what: str,
           expected: str) -> list[object]:
    """Matches ``value`` (one entry per element of ``refs``) to ``refs``'s leaves, ``None`` anywhere.

    Returns one entry per leaf of ``refs`` (concatenated, in order) with the
    matching value or ``None``.
    """
    n = len(refs)
    if value is None:
        return [None] * sum(len(jax.tree_util.tree_leaves(r)) for r in refs)
    if n == 1:
        parts: Sequence[object] = (_unwrap_single(value, refs[0]),)
    elif not isinstance(value, (tuple, list)):
        raise GradkitError(
            f"{info.where}: its {info.closure} must return a tuple of {n} {what}s, one per {expected}; "
            f"got {summary(value)}. Return ({', '.join(labels)}) in that order, None for no {what}.")
    elif len(value) != n:
        hint = ""
        if info.kind != "jvp" and len(value) == n + 1 and not info.method:
            hint = (" If the first argument is `self`, define the function in the class body (a method's "
                    "`self` is bound, as in TensorFlow, and gets no gradient).")
        raise GradkitError(
            f"{info.where}: its {info.closure} returned {len(value)} {what}s, expected {n}: one per "
            f"{expected} ({', '.join(labels)}). Use None for no {what}.{hint}")
    else:
        parts = value
    out: list[object] = []
    for part, ref, label in zip(parts, refs, labels):
        out.extend(validate.match_leaves(part, ref, info.where, what, label))
    return out


def _check(info: FnInfo, value: object, like: ArrayLike, label: str, what: str) -> object:
    """``value`` as an array of ``like``'s shape and dtype; ``None`` stays ``None``.

    Any boolean, integer or floating value is cast to ``like``'s dtype
    (documented: parameters are never promoted). ``like`` has no tangent
    space (integer, boolean) → ``None``, whatever the closure returned.
    """
    return validate.check_leaf(value, like, where=f"{info.where}: its {info.closure}", leaf=label, what=what,
                               cast="real", absent="none")


def _labels(ref: object, base: str) -> list[str]:
    """One label per leaf of ``ref``: ``base`` or ``base[...]`` with the leaf's key path."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(ref)[0]]
    if len(paths) == 1 and not paths[0]:
        return [base]
    return [f"{base}{jax.tree_util.keystr(p)}" for p in paths]
