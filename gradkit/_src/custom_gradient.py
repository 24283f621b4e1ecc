"""Function-level gradients: TensorFlow-style ``custom_gradient`` and ``custom_jvp``.

The decorated function returns its outputs together with a closure that
computes the derivative (``grad_fn(*upstream)`` for reverse mode,
``jvp_fn(*tangents)`` for forward mode). The data path::

    @custom_gradient fn ──call──▶ named op: one ``jit`` equation named after fn
                                   (a table can retarget it, like any gk.op)
                                   └─▶ jax.custom_vjp  (mode="vjp")
                                       jax.custom_jvp  (mode="both", custom_jvp)

* When the named op is traced, ``fn`` is traced twice to jaxprs: once for
  the outputs, once for the closure, which is itself traced over abstract
  upstream (or tangent) values. Every tracer either captures (forward
  intermediates, values of an enclosing jit/vmap/scan) becomes an explicit
  input: the closure's captures are the residuals, the function's are extra
  operands of the custom_vjp/custom_jvp. Nothing JAX traces lazily closes
  over a tracer, so nothing leaks and nothing trips JAX's "No constant
  handler for type ...Tracer" (custom_vjp/custom_jvp inside jit closing over
  outer tracers). Captured operands that get differentiated are an error:
  the closure only defines derivatives for the arguments.
* An exception in the closure (e.g. a grad_fn that raises on purpose) is
  kept and raised when the function is differentiated, not on a forward call.
* The rule's primal output is computed by calling the custom function again,
  so the custom derivative applies at every order (``grad(grad(g ∘ f))``);
  XLA merges the duplicate forward computation.
* ``mode="both"`` derives forward mode from ``grad_fn`` by
  ``jax.linear_transpose``: ``grad_fn`` is the linear map ``v ↦ Jᵀv``, and its
  transpose ``t ↦ Jt`` is the JVP. It needs ``grad_fn`` to be linear in the
  upstream values, as every true gradient is.

Positional array arguments (JAX or NumPy arrays, tracers) are differentiable.
Every other leaf (Python numbers included) and every keyword argument is
static: part of the cache key, free for Python control flow, no gradient.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeVar, overload

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import compat, named, validate
from gradkit._src.errors import GradkitError, describe
from gradkit._src.rule import OpView, Rule

SymbolicZero = jax.custom_derivatives.SymbolicZero

F = TypeVar("F", bound=Callable[..., Any])
Mode = Literal["vjp", "both"]
_Kind = Literal["vjp", "both", "jvp"]


class _StaticLeaf:
    """Marks a static leaf in an index tree (a plain object, so it is a pytree leaf)."""

    def __repr__(self) -> str:
        return "<static>"


_STATIC = _StaticLeaf()


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, compat.Tracer))


def _is_python_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def _inexact(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.inexact)


def _summary(x: Any) -> str:
    """``describe`` that also looks one level into tuples, lists and dicts."""
    if isinstance(x, (tuple, list)):
        inner = ", ".join(_summary(v) if not isinstance(v, (tuple, list, dict)) else type(v).__name__ for v in x)
        return f"{type(x).__name__} ({inner})" if x else f"empty {type(x).__name__}"
    if isinstance(x, dict):
        return f"dict with keys {sorted(map(str, x))}"
    if callable(x) and not _is_array(x):
        return f"function {getattr(x, '__name__', type(x).__name__)}"
    return describe(x)


def _spec(shape: Sequence[int], dtype: Any) -> str:
    return f"{jnp.dtype(dtype)}[{','.join(map(str, shape))}]"


# --------------------------------------------------------------------------- the user's function


@dataclasses.dataclass(frozen=True, eq=False)
class _Fn:
    """The decorated function and what error messages say about it."""

    fn: Callable[..., Any]
    name: str
    kind: _Kind

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
    def _params(self) -> tuple[list[str], str | None]:
        try:
            params = inspect.signature(self.fn).parameters.values()
        except (TypeError, ValueError):
            return [], None
        pos = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var = next((p.name for p in params if p.kind == p.VAR_POSITIONAL), None)
        return pos, var

    def accepted(self, params: Any) -> dict[str, Any]:
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
        pos, var = self._params
        if i < len(pos):
            return f"`{pos[i]}`"
        if var is not None:
            return f"`{var}[{i - len(pos)}]`"
        return f"argument {i}"

    def split(self, result: Any) -> tuple[Any, Callable[..., Any]]:
        """``(outputs, closure)`` from what ``fn`` returned: ``(out, f)`` or ``(o1, o2, ..., f)``."""
        if isinstance(result, (tuple, list)) and len(result) >= 2:
            closure = result[-1]
            if callable(closure) and not _is_array(closure):
                return (result[0] if len(result) == 2 else tuple(result[:-1])), closure
        raise GradkitError(
            f"{self.where} must return `(outputs, {self.closure})` (or `out1, out2, ..., {self.closure}`), "
            f"a tuple whose last element is the {self.closure} function; got {_summary(result)}. "
            f"Write `return y, {self.closure}`.")

    def call_closure(self, closure: Callable[..., Any], args: Sequence[Any], what: str) -> Any:
        try:
            result = closure(*args)
        except GradkitError:
            raise
        except Exception as e:
            per = "positional argument" if self.kind == "jvp" else "output"
            if isinstance(e, jax.errors.ConcretizationTypeError):
                hint = (f"{self.closure} is traced with abstract {what}s: use jnp.where / lax.cond rather than "
                        "Python `if` on their values.")
            else:
                hint = (f"{self.closure} gets one {what} per {per}; it is None for "
                        f"{'static arguments and integer leaves' if self.kind == 'jvp' else 'integer outputs'}.")
            raise GradkitError(f"{self.where}: its {self.closure} raised {type(e).__name__}: {e}\n{hint}") from e
        if (self.kind != "jvp" and isinstance(result, tuple) and len(result) == 2 and callable(result[1])
                and not _is_array(result[1])):
            raise GradkitError(
                f"{self.where}: its {self.closure} returned `(gradients, grad_grad_fn)`, TensorFlow's nested "
                "form, which gradkit does not support. A grad_fn written with JAX operations is differentiated "
                "automatically, so grad of grad already works; to control the second derivative, compute the "
                "gradient with another @gk.custom_gradient function inside grad_fn.")
        return result


# --------------------------------------------------------------------------- one call signature


@dataclasses.dataclass(eq=False)
class _Signature:
    """One (argument structure, static values, keyword arguments) of a decorated function."""

    info: _Fn
    in_tree: Any
    dyn_positions: tuple[int, ...]
    static_leaves: tuple[Any, ...]
    kwargs: dict[str, Any]
    out_tree: Any = None

    @classmethod
    def of(cls, info: _Fn, args: tuple[Any, ...], kwargs: dict[str, Any],
           numbers_dynamic: bool = False) -> tuple[_Signature, list[Any]]:
        """The signature of a call, and its dynamic (array) leaves.

        ``numbers_dynamic``: Python numbers are dynamic too (an op's inputs,
        seen by a rule, may be concrete scalars).
        """
        leaves, in_tree = jax.tree_util.tree_flatten(args)
        dyn_positions = tuple(i for i, x in enumerate(leaves)
                              if _is_array(x) or (numbers_dynamic and _is_python_number(x)))
        dyn_set = set(dyn_positions)
        static = tuple(None if i in dyn_set else x for i, x in enumerate(leaves))
        return cls(info, in_tree, dyn_positions, static, dict(kwargs)), [leaves[i] for i in dyn_positions]

    def key(self) -> Any:
        statics = tuple((type(x), x) for x in self.static_leaves)
        kw = tuple(sorted((k, type(v), v) for k, v in self.kwargs.items()))
        return (self.in_tree, self.dyn_positions, statics, kw)

    def args(self, dyn: Sequence[Any]) -> tuple[Any, ...]:
        leaves = list(self.static_leaves)
        for pos, x in zip(self.dyn_positions, dyn):
            leaves[pos] = x
        return tuple(jax.tree_util.tree_unflatten(self.in_tree, leaves))

    def index_args(self) -> tuple[Any, ...]:
        """The positional arguments with each dynamic leaf replaced by its index, static ones by _STATIC."""
        markers: list[Any] = [_STATIC] * len(self.static_leaves)
        for j, pos in enumerate(self.dyn_positions):
            markers[pos] = j
        return tuple(jax.tree_util.tree_unflatten(self.in_tree, markers))

    def run(self, dyn: Sequence[Any]) -> tuple[Any, Callable[..., Any], list[Any]]:
        """Calls the user's function: (outputs, closure, flat output arrays)."""
        outputs, closure = self.info.split(self.info.fn(*self.args(dyn), **self.kwargs))
        leaves, self.out_tree = jax.tree_util.tree_flatten(outputs)
        flat = []
        for i, x in enumerate(leaves):
            if _is_python_number(x):
                x = jnp.asarray(x)
            elif not _is_array(x):
                raise GradkitError(
                    f"{self.info.where}: output leaf {i} is {_summary(x)}; outputs must be arrays (or "
                    "pytrees of arrays). Return non-array values through a separate function.")
            flat.append(x)
        return outputs, closure, flat

    def outputs(self, flat: Sequence[Any]) -> Any:
        return jax.tree_util.tree_unflatten(self.out_tree, list(flat))


# --------------------------------------------------------------------------- checks


def _unwrap_single(value: Any, ref: Any) -> Any:
    """For one expected entry, accept both ``g`` and ``(g,)``."""
    if isinstance(value, (tuple, list)) and len(value) == 1:
        if not isinstance(ref, (tuple, list)) or value[0] is None or isinstance(value[0], (tuple, list)):
            return value[0]
    return value


def _align(info: _Fn, value: Any, refs: Sequence[Any], labels: Sequence[str], what: str,
           expected: str) -> list[Any]:
    """Matches ``value`` (one entry per element of ``refs``) to ``refs``'s leaves, ``None`` anywhere.

    Returns one entry per leaf of ``refs`` (concatenated, in order) with the
    matching value or ``None``.
    """
    n = len(refs)
    if value is None:
        return [None] * sum(len(jax.tree_util.tree_leaves(r)) for r in refs)
    if n == 1:
        parts: Sequence[Any] = (_unwrap_single(value, refs[0]),)
    elif not isinstance(value, (tuple, list)):
        raise GradkitError(
            f"{info.where}: its {info.closure} must return a tuple of {n} {what}s, one per {expected}; "
            f"got {_summary(value)}. Return ({', '.join(labels)}) in that order, None for no {what}.")
    elif len(value) != n:
        raise GradkitError(
            f"{info.where}: its {info.closure} returned {len(value)} {what}s, expected {n}: one per "
            f"{expected} ({', '.join(labels)}). Use None for no {what}.")
    else:
        parts = value
    out: list[Any] = []
    for part, ref, label in zip(parts, refs, labels):
        out.extend(_match(info, part, ref, label, what))
    return out


def _match(info: _Fn, value: Any, ref: Any, label: str, what: str) -> list[Any]:
    return validate.match_leaves(value, ref, info.where, what, label)


def _check(info: _Fn, value: Any, like: Any, label: str, what: str) -> Any:
    """``value`` as an array of ``like``'s shape and dtype (cast if needed); ``None`` stays ``None``.

    ``like`` has no tangent space (integer, boolean) → ``None``, whatever the
    closure returned.
    """
    shape, dtype = tuple(np.shape(like)), jnp.result_type(like)
    if value is None or not _inexact(dtype):
        return None
    if _is_python_number(value):
        if shape != ():
            raise GradkitError(
                f"{info.where}: the {what} for {label} is a Python {type(value).__name__}, but {label} is "
                f"{_spec(shape, dtype)}. Return an array of that shape, e.g. jnp.full_like(x, value).")
        value = jnp.asarray(value)
    vshape, vdtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if vshape is None or vdtype is None:
        raise GradkitError(
            f"{info.where}: the {what} for {label} is {_summary(value)}; expected an array "
            f"{_spec(shape, dtype)} or None.")
    if tuple(vshape) != shape:
        hint = (" It looks broadcast: sum it over the broadcast axes (e.g. jnp.sum(g, axis=...))."
                if len(vshape) >= len(shape) and vshape != shape else "")
        raise GradkitError(
            f"{info.where}: the {what} for {label} has shape {tuple(vshape)}, expected {shape} "
            f"({_spec(shape, dtype)}, the shape of {label}).{hint}")
    if vdtype != dtype:
        if jnp.issubdtype(vdtype, jnp.complexfloating) and not jnp.issubdtype(dtype, jnp.complexfloating):
            raise GradkitError(
                f"{info.where}: the {what} for {label} is complex ({vdtype}) but {label} is real ({dtype}). "
                "Return a real value, e.g. jnp.real(g).")
        value = jnp.asarray(value).astype(dtype)  # documented: cast back to the input's dtype
    return value


def _labels(info: _Fn, ref: Any, base: str) -> list[str]:
    """One label per leaf of ``ref``: ``base`` or ``base[...]`` with the leaf's key path."""
    paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(ref)[0]]
    if len(paths) == 1 and not paths[0]:
        return [base]
    return [f"{base}{jax.tree_util.keystr(p)}" for p in paths]


def _gradients(sig: _Signature, closure: Callable[..., Any], dyn: Sequence[Any],
               ct_leaves: Sequence[Any], outputs_multi: bool) -> list[Any]:
    """Calls grad_fn on the output cotangents; returns one checked gradient (or None) per dynamic leaf."""
    info = sig.info
    ups = sig.outputs(ct_leaves)
    result = info.call_closure(closure, tuple(ups) if outputs_multi else (ups,), "upstream gradient")
    refs = sig.index_args()
    names = [info.arg_name(i) for i in range(len(refs))]
    flat = _align(info, result, refs, names, "gradient", "positional argument")
    markers = jax.tree_util.tree_leaves(refs)
    labels = [lab for r, name in zip(refs, names) for lab in _labels(info, r, name)]
    grads: list[Any] = [None] * len(dyn)
    for v, marker, label in zip(flat, markers, labels):
        if marker is _STATIC:
            continue  # static arguments have no gradient; whatever grad_fn said is dropped
        grads[marker] = _check(info, v, dyn[marker], label, "gradient")
    return grads


def _is_multi(outputs: Any) -> bool:
    return isinstance(outputs, (tuple, list))


def _output_refs(sig: _Signature, outputs: Any, n_out: int) -> tuple[list[Any], list[str]]:
    ref = sig.outputs(list(range(n_out)))
    if _is_multi(outputs):
        return list(ref), [f"output {i}" for i in range(len(ref))]
    return [ref], ["the output"]


def _tangents_out(sig: _Signature, result: Any, outputs: Any, out: Sequence[Any]) -> list[Any]:
    """Checks jvp_fn's result; one tangent (or None) per output leaf."""
    info = sig.info
    refs, names = _output_refs(sig, outputs, len(out))
    flat = _align(info, result, refs, names, "output tangent", "output")
    labels = [lab for r, name in zip(refs, names) for lab in _labels(info, r, name)]
    return [_check(info, v, o, label, "output tangent") for v, o, label in zip(flat, out, labels)]


def _zero_tangent(x: Any) -> Any:
    if _inexact(x.dtype):
        return jnp.zeros(x.shape, x.dtype)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _is_zero(t: Any) -> bool:
    """A symbolic zero, a float0 tangent or None: no tangent/cotangent at all."""
    return t is None or isinstance(t, SymbolicZero) or getattr(t, "dtype", None) == jax.dtypes.float0


def _struct(x: Any) -> jax.ShapeDtypeStruct:
    aval = compat.aval_of(x)
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


# --------------------------------------------------------------------------- closure conversion
#
# Nothing that JAX traces lazily (a custom_vjp's fwd, a custom_jvp's rule) may
# close over a tracer: when that trace happens, inside the transformation of
# the named op's ``jit``, a captured tracer of an enclosing jit/vmap/grad is
# foreign and JAX fails with "No constant handler for type ...Tracer" (JAX's
# custom_vjp/custom_jvp inside jit, closing over outer tracers). So the user's
# function and its closure are traced to jaxprs when the named op is traced,
# and every tracer they capture is passed explicitly.


@dataclasses.dataclass(frozen=True, eq=False)
class _JaxprFn:
    """A traced function whose captured tracers were hoisted out: call it with them, then the inputs."""

    jaxpr: Any
    slots: tuple[int, ...]
    fixed: tuple[Any, ...]

    @classmethod
    def trace(cls, fn: Callable[..., Sequence[Any]], structs: Sequence[Any]) -> tuple[_JaxprFn, list[Any]]:
        closed = compat.trace(fn, list(structs))
        consts = list(closed.consts)
        slots = tuple(i for i, c in enumerate(consts) if isinstance(c, compat.Tracer))
        fixed = tuple(None if i in slots else c for i, c in enumerate(consts))
        return cls(closed.jaxpr, slots, fixed), [consts[i] for i in slots]

    def __call__(self, captured: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        consts = list(self.fixed)
        for i, c in zip(self.slots, captured):
            consts[i] = c
        return list(compat.eval_jaxpr(compat.ClosedJaxpr(self.jaxpr, consts), list(args)))


@dataclasses.dataclass(frozen=True, eq=False)
class _ClosureStatic:
    """grad_fn / jvp_fn traced over its float inputs; which inputs it takes, which outputs are not None."""

    fn: _JaxprFn
    in_mask: tuple[bool, ...]
    out_mask: tuple[bool, ...]


@jax.tree_util.register_pytree_node_class
class _Closure:
    """A closure-converted grad_fn / jvp_fn: static jaxpr, captured values as pytree leaves (residuals)."""

    def __init__(self, static: _ClosureStatic, captured: Sequence[Any]):
        self.static = static
        self.captured = list(captured)

    def tree_flatten(self) -> tuple[list[Any], _ClosureStatic]:
        return self.captured, self.static

    @classmethod
    def tree_unflatten(cls, static: _ClosureStatic, captured: Sequence[Any]) -> _Closure:
        return cls(static, captured)

    def linear(self, *float_inputs: Any) -> tuple[Any, ...]:
        """The non-None outputs, as a function of the float inputs (what jax.linear_transpose needs)."""
        return tuple(self.static.fn(self.captured, float_inputs))

    def __call__(self, inputs: Sequence[Any]) -> list[Any]:
        """One output (or None) per out_mask entry from one input per in_mask entry."""
        vals = iter(self.linear(*[x for x, keep in zip(inputs, self.static.in_mask) if keep]))
        return [next(vals) if m else None for m in self.static.out_mask]


def _close(fn: Callable[..., list[Any]], structs: Sequence[Any], in_mask: tuple[bool, ...]) -> _Closure:
    """Traces ``fn`` (float inputs -> list with None entries) and hoists what it captured."""
    mask_box: list[tuple[bool, ...]] = []

    def nonzero(*xs: Any) -> list[Any]:
        outs = fn(*xs)
        mask_box.append(tuple(o is not None for o in outs))
        return [o for o in outs if o is not None]

    jfn, captured = _JaxprFn.trace(nonzero, structs)
    return _Closure(_ClosureStatic(jfn, in_mask, mask_box[-1]), captured)


def _close_grad_fn(sig: _Signature, grad_fn: Callable[..., Any], dyn: Sequence[Any], outputs: Any,
                   out: Sequence[Any]) -> _Closure:
    """grad_fn as a function of the float output cotangents, one gradient (or None) per dynamic leaf."""
    float_out = tuple(_inexact(o.dtype) for o in out)
    multi = _is_multi(outputs)

    def flat(*float_cts: Any) -> list[Any]:
        it = iter(float_cts)
        return _gradients(sig, grad_fn, dyn, [next(it) if keep else None for keep in float_out], multi)

    structs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o, keep in zip(out, float_out) if keep]
    return _close(flat, structs, float_out)


def _close_jvp_fn(sig: _Signature, jvp_fn: Callable[..., Any], dyn: Sequence[Any], outputs: Any,
                  out: Sequence[Any]) -> _Closure:
    """jvp_fn as a function of the float input tangents, one tangent (or None) per output leaf."""
    float_in = tuple(_inexact(jnp.result_type(x)) for x in dyn)

    def flat(*float_ts: Any) -> list[Any]:
        it = iter(float_ts)
        ts = [next(it) if keep else None for keep in float_in]
        result = sig.info.call_closure(jvp_fn, _user_tangents(sig, ts), "tangent")
        return _tangents_out(sig, result, outputs, out)

    structs = [jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)) for x, keep in zip(dyn, float_in) if keep]
    return _close(flat, structs, float_in)


def _user_tangents(sig: _Signature, tangents: Sequence[Any]) -> tuple[Any, ...]:
    """Tangents structured like the positional arguments; None for static and integer leaves."""
    leaves: list[Any] = [None] * len(sig.static_leaves)
    for pos, t in zip(sig.dyn_positions, tangents):
        leaves[pos] = None if _is_zero(t) else t
    return tuple(jax.tree_util.tree_unflatten(sig.in_tree, leaves))


def _transposed(where: str, closure: _Closure, dyn: Sequence[Any], out: Sequence[Any],
                tangents: Sequence[Any]) -> list[Any]:
    """Output tangents ``J t`` from grad_fn (``v ↦ Jᵀ v``) by linear transposition."""
    float_out = closure.static.in_mask
    structs = [jax.ShapeDtypeStruct(o.shape, o.dtype) for o, keep in zip(out, float_out) if keep]
    t_float: Sequence[Any] = ()
    if structs:
        t_in = tuple(_as_tangent(t, x) for t, x, m in zip(tangents, dyn, closure.static.out_mask) if m)
        try:
            t_float = jax.linear_transpose(closure.linear, *structs)(t_in)
        except Exception as e:
            raise GradkitError(
                f"{where} has mode='both', which gets forward mode by transposing grad_fn; that needs "
                f"grad_fn to be linear in its upstream values, and transposing it failed ({type(e).__name__}: "
                f"{e}). Keep grad_fn linear in upstream (no clipping or branching on upstream values), or use "
                "mode='vjp' (reverse mode only), or write the derivative with gk.custom_jvp.") from e
    it = iter(t_float)
    return [next(it) if keep else _zero_tangent(o) for o, keep in zip(out, float_out)]


def _as_tangent(t: Any, x: Any) -> Any:
    dtype = jnp.result_type(x)
    if _is_zero(t):
        return jnp.zeros(np.shape(x), dtype)
    return jnp.asarray(t).astype(dtype)


# --------------------------------------------------------------------------- the traced op


def _strip_tracebacks(e: BaseException) -> BaseException:
    """Drops the frames an exception holds (they hold tracers), keeping its message and chain."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


@dataclasses.dataclass(frozen=True, eq=False)
class _Plan:
    """The user's function traced once, for one trace of the named op.

    Static: holds jaxprs and no tracer (the custom_vjp / custom_jvp functions
    keep it alive inside the program, so it must not keep the trace's values).
    The op is called with (dynamic leaves, captured by primal, captured by residuals).
    """

    where: str
    kind: _Kind
    n_dyn: int
    n_primal: int
    n_residual: int
    primal: _JaxprFn
    residuals: _JaxprFn | None  # dyn -> what the closure captured (None: see `error`)
    closure: _ClosureStatic | None
    error: BaseException | None  # raised when differentiated, not on a forward-only call

    @classmethod
    def of(cls, sig: _Signature, dyn: Sequence[Any]) -> tuple[_Plan, list[Any]]:
        """The plan and the tracers to pass after the dynamic leaves."""
        structs = [_struct(x) for x in dyn]
        primal, cap_p = _JaxprFn.trace(lambda *d: sig.run(d)[2], structs)
        box: list[_ClosureStatic] = []

        def residuals(*d: Any) -> list[Any]:
            outputs, closure, out = sig.run(d)
            make = _close_jvp_fn if sig.info.kind == "jvp" else _close_grad_fn
            converted = make(sig, closure, d, outputs, out)
            box.append(converted.static)
            return converted.captured

        res_fn: _JaxprFn | None = None
        cap_r: list[Any] = []
        error: BaseException | None = None
        try:
            res_fn, cap_r = _JaxprFn.trace(residuals, structs)
        except Exception as e:  # e.g. a grad_fn that raises on purpose: only differentiation fails
            error = _strip_tracebacks(e)
        plan = cls(sig.info.where, sig.info.kind, len(dyn), len(cap_p), len(cap_r), primal, res_fn,
                   box[-1] if res_fn is not None else None, error)
        return plan, [*cap_p, *cap_r]

    @property
    def n_captured(self) -> int:
        return self.n_primal + self.n_residual

    def split(self, args: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        args = list(args)
        n, n_p = self.n_dyn, self.n_primal
        return args[:n], args[n:n + n_p], args[n + n_p:]

    def check(self, perturbed: Sequence[bool]) -> None:
        if self.error is not None:
            raise self.error
        if any(perturbed[self.n_dyn:]):
            closure = "jvp_fn" if self.kind == "jvp" else "grad_fn"
            raise GradkitError(
                f"{self.where} closes over a traced value that is being differentiated (a value computed "
                f"outside the function, not passed as an argument). Its {closure} only defines derivatives "
                "for the function's arguments: pass that value as an argument (and give its gradient), or "
                "wrap it in jax.lax.stop_gradient if it needs none.")

    def run_primal(self, *args: Any) -> list[Any]:
        dyn, cap_p, _ = self.split(args)
        return self.primal(cap_p, dyn)

    def closure_at(self, args: Sequence[Any]) -> _Closure:
        dyn, _, cap_r = self.split(args)
        assert self.residuals is not None and self.closure is not None
        return _Closure(self.closure, self.residuals(cap_r, dyn))


def _custom_vjp(plan: _Plan, op_name: str) -> Callable[..., list[Any]]:
    """The op as a jax.custom_vjp of (dynamic leaves, captured tracers)."""

    def op(*args: Any) -> list[Any]:
        return plan.run_primal(*args)

    op.__name__ = op.__qualname__ = op_name
    prim = jax.custom_vjp(op)

    def fwd(*args: Any) -> tuple[list[Any], _Closure]:
        plan.check([a.perturbed for a in args])
        vals = [a.value for a in args]
        out = prim(*vals)  # the custom function again: its rule holds at the next order too
        return out, plan.closure_at(vals)

    def bwd(closure: _Closure, cts: Sequence[Any]) -> tuple[Any, ...]:
        none = [None] * plan.n_captured
        if all(_is_zero(c) for c in cts):
            return (*([None] * plan.n_dyn), *none)
        cts = [jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c for c in cts]
        return (*closure(cts), *none)

    prim.defvjp(fwd, bwd, symbolic_zeros=True)
    return prim


def _custom_jvp(plan: _Plan, op_name: str) -> Callable[..., list[Any]]:
    """The op as a jax.custom_jvp of (dynamic leaves, captured tracers)."""

    def op(*args: Any) -> list[Any]:
        return plan.run_primal(*args)

    op.__name__ = op.__qualname__ = op_name
    prim = jax.custom_jvp(op)

    def jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[list[Any], list[Any]]:
        plan.check([not isinstance(t, SymbolicZero) for t in tangents])
        out = prim(*primals)  # the custom function again: its rule holds at the next order too
        closure = plan.closure_at(primals)
        dyn, t_dyn = list(primals[:plan.n_dyn]), list(tangents[:plan.n_dyn])
        if plan.kind == "both":
            return out, _transposed(plan.where, closure, dyn, out, t_dyn)
        t_out = closure([_as_tangent(t, x) for t, x in zip(t_dyn, dyn)])
        return out, [_zero_tangent(o) if t is None else t for t, o in zip(t_out, out)]

    prim.defjvp(jvp, symbolic_zeros=True)
    return prim


# --------------------------------------------------------------------------- the function's own Rule


def _make_rule(info: _Fn) -> Rule:
    """The decorated function's derivative as a table Rule, for retargeting another op to it."""

    def prepare(op: OpView) -> tuple[_Signature, list[Any], Any, Callable[..., Any], list[Any]]:
        sig, dyn = _Signature.of(info, tuple(op.inputs), info.accepted(op.params), numbers_dynamic=True)
        outputs, closure, out = sig.run(dyn)
        return sig, dyn, outputs, closure, out

    def to_inputs(sig: _Signature, per_dyn: Sequence[Any]) -> tuple[Any, ...]:
        leaves: list[Any] = [None] * len(sig.static_leaves)
        for pos, v in zip(sig.dyn_positions, per_dyn):
            leaves[pos] = v
        return tuple(jax.tree_util.tree_unflatten(sig.in_tree, leaves))

    def to_outputs(sig: _Signature, outputs: Any, flat: Sequence[Any]) -> tuple[Any, ...]:
        structured = sig.outputs(flat)
        return tuple(structured) if isinstance(outputs, tuple) else (structured,)

    if info.kind == "vjp":
        def vjp_fn(op: OpView, g: Any) -> tuple[Any, ...]:
            sig, dyn, outputs, grad_fn, out = prepare(op)
            try:
                cts = sig.out_tree.flatten_up_to(g)
            except (ValueError, TypeError) as e:
                raise GradkitError(
                    f"{info.where} used as the rule for op '{op.name}' at {op.source}: the op's output "
                    f"cotangent has the structure {jax.tree_util.tree_structure(g)}, but '{info.name}' "
                    f"returns {sig.out_tree}. Retarget it only to ops with the same inputs and outputs.") from e
            grads = _gradients(sig, grad_fn, dyn, cts, _is_multi(outputs))
            return to_inputs(sig, grads)

        return Rule(fn=vjp_fn, mode="vjp", name=f"{info.decorator}[{info.name}]")

    def jvp_fn(op: OpView, tangents: Any) -> tuple[Any, ...]:
        sig, dyn, outputs, closure, out = prepare(op)
        t_leaves = jax.tree_util.tree_structure(tuple(op.inputs)).flatten_up_to(tuple(tangents))
        t_dyn = [t_leaves[p] if _is_array(t_leaves[p]) or _is_python_number(t_leaves[p]) else None
                 for p in sig.dyn_positions]
        if info.kind == "both":
            converted = _close_grad_fn(sig, closure, dyn, outputs, out)
            t_out = _transposed(info.where, converted, dyn, out, t_dyn)
            t_out = [t if _inexact(o.dtype) else None for t, o in zip(t_out, out)]
        else:
            t_dyn = [_as_tangent(t, x) if _inexact(jnp.result_type(x)) else None for t, x in zip(t_dyn, dyn)]
            result = info.call_closure(closure, _user_tangents(sig, t_dyn), "tangent")
            t_out = _tangents_out(sig, result, outputs, out)
        return to_outputs(sig, outputs, t_out)

    return Rule(fn=jvp_fn, mode="jvp", name=f"{info.decorator}[{info.name}]")


# --------------------------------------------------------------------------- decorators


def _decorate(fn: Any, name: str | None, kind: _Kind) -> Any:
    decorator = "custom_jvp" if kind == "jvp" else "custom_gradient"
    if not callable(fn):
        raise GradkitError(f"gk.{decorator} decorates a function, got {type(fn).__name__}.")
    if name is None:
        name = getattr(fn, "__name__", None) or type(fn).__name__
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise GradkitError(
            f"gk.{decorator}: the name must be a non-empty string without surrounding spaces, got {name!r}.")
    info = _Fn(fn, name, kind)
    instances: dict[Any, tuple[Any, Callable[..., Any]]] = {}
    lock = threading.Lock()

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        for k, v in kwargs.items():
            if any(_is_array(x) for x in jax.tree_util.tree_leaves(v)):
                raise GradkitError(
                    f"{info.where} got an array in keyword argument `{k}`; keyword arguments are static (no "
                    f"gradient, part of the cache key). Pass arrays positionally: {name}(..., {k}).")
        sig, dyn = _Signature.of(info, args, kwargs)
        key = sig.key()
        try:
            entry = instances.get(key)
        except TypeError as e:
            raise GradkitError(
                f"{info.where} got an unhashable static argument ({e}). Non-array arguments and keyword "
                "arguments are static and must be hashable: use a tuple instead of a list, or pass an "
                "array.") from None
        if entry is None:
            with lock:
                entry = instances.get(key)
                if entry is None:
                    def body(*call_args: Any, **_: Any) -> Any:
                        # Runs while the named op's jit traces: the traced dynamic leaves.
                        leaves = jax.tree_util.tree_leaves(call_args)
                        dyn = [leaves[p] for p in sig.dyn_positions]
                        plan, captured = _Plan.of(sig, dyn)
                        make = _custom_vjp if kind == "vjp" else _custom_jvp
                        prim = make(plan, f"{info.decorator}[{info.name}]")
                        return sig.outputs(prim(*dyn, *captured))

                    entry = named._make_instance(name, body, sig.in_tree, sig.dyn_positions,
                                                 sig.static_leaves, sig.kwargs)
                    instances[key] = entry
        inst, call = entry
        return inst.outputs(call(*dyn))

    wrapper.gradkit_op_name = name  # type: ignore[attr-defined]
    wrapper.rule = _make_rule(info)  # type: ignore[attr-defined]
    wrapper.mode = "jvp" if kind == "jvp" else kind  # type: ignore[attr-defined]
    return wrapper


@overload
def custom_gradient(fn: F, *, name: str | None = None, mode: Mode = "vjp") -> F: ...
@overload
def custom_gradient(fn: None = None, *, name: str | None = None, mode: Mode = "vjp") -> Callable[[F], F]: ...


def custom_gradient(fn=None, *, name=None, mode="vjp"):
    """Defines a function's gradient with a closure, as TensorFlow's ``tf.custom_gradient`` does.

    The decorated function returns its outputs and a function ``grad_fn``:
    ``return y, grad_fn`` (one output) or ``return y1, y2, grad_fn`` /
    ``return (y1, y2), grad_fn`` (several). ``grad_fn`` receives one upstream
    gradient per output (``grad_fn(dy)``, ``grad_fn(dy1, dy2)``), each shaped
    like its output (``None`` for integer outputs), and returns one gradient
    per positional argument: a bare value for one argument, else a tuple. It
    may close over any value computed in the forward pass; those become
    residuals (closure conversion), so there is no leaked tracer under
    ``jit``, ``vmap``, ``scan`` or ``checkpoint``. ``grad_fn`` runs only
    when the function is differentiated (an error in it, e.g. a deliberate
    ``raise``, does not affect forward calls).

    * Pytrees: an argument or output may be any pytree of arrays; its
      gradient has the same structure. ``None`` means "no gradient" (zeros)
      for any argument, any subtree or any leaf.
    * Static arguments: positional arguments that are not arrays (Python
      numbers, strings, ...) and all keyword arguments are static: usable in
      Python control flow, part of the cache key (each new value traces
      again, like a ``jax.jit`` static argument), no gradient (what
      ``grad_fn`` returns for them is ignored).
    * Closures: the function may also close over values of an enclosing
      ``jit``, ``vmap`` or ``scan`` (a temperature, a scale). Their
      derivative is not defined by ``grad_fn``, so differentiating with
      respect to such a value is a :class:`GradkitError`: pass it as an
      argument instead.
    * Checks: a wrong number of gradients, a structure or shape that does
      not match the argument, is a :class:`GradkitError` naming the function.
      A gradient of another floating dtype (e.g. computed in float64 for a
      float32 argument) is cast to the argument's dtype, so parameters are
      never promoted; a complex gradient for a real argument is an error.
    * Higher order: ``grad_fn`` written with JAX operations is itself
      differentiated, so ``jax.grad(jax.grad(f))`` works, and the rule also
      holds for the outputs at higher orders. TensorFlow's nested form, where
      ``grad_fn`` returns ``(grads, grad_grad_fn)``, is rejected: call
      another ``custom_gradient`` function inside ``grad_fn`` instead.
    * Forward mode: with ``mode="vjp"`` (the default) the function supports
      reverse mode only (``jax.jvp``/``jacfwd``/``hessian`` raise, as for
      ``jax.custom_vjp``). With ``mode="both"``, forward mode is derived by
      transposing ``grad_fn`` (``jax.linear_transpose``), so one rule serves
      ``grad``, ``jvp``, ``jacfwd`` and ``hessian``; this needs ``grad_fn``
      to be linear in its upstream values, which every true gradient is (a
      ``grad_fn`` that clips or branches on ``upstream`` is not: keep
      ``mode="vjp"`` or use :func:`custom_jvp`).
    * Tables: the function is a named op (``name``, default the function's
      name), so ``gk.override(f, {name: rule})`` retargets it; its own rule
      is available as ``.rule``, a :class:`Rule` for another op's name.

    Args:
      fn: the function; returns ``(outputs, grad_fn)``.
      name: the op name tables use; defaults to ``fn.__name__``.
      mode: ``"vjp"`` (reverse mode) or ``"both"`` (also forward mode, by
        transposing ``grad_fn``).

    Returns:
      A function with ``fn``'s signature that returns only the outputs.
      Usable as ``@custom_gradient`` or ``@custom_gradient(name=..., mode=...)``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> @gk.custom_gradient
      ... def log1pexp(x):
      ...     e = jnp.exp(x)
      ...     def grad(upstream):
      ...         return upstream * (1 - 1 / (1 + e))
      ...     return jnp.log1p(e), grad
      >>> float(jax.grad(log1pexp)(100.0)), float(jax.grad(lambda x: jnp.log1p(jnp.exp(x)))(100.0))
      (1.0, nan)
      >>> @gk.custom_gradient(mode="both")
      ... def cube(x):
      ...     return x ** 3, lambda g: g * 3 * x ** 2
      >>> float(jax.hessian(cube)(2.0)), float(jax.jacfwd(cube)(2.0))
      (12.0, 12.0)
    """
    if mode not in ("vjp", "both"):
        raise GradkitError(f"gk.custom_gradient: mode must be 'vjp' or 'both', got {mode!r}.")
    if fn is None:
        return lambda f: _decorate(f, name, mode)
    if isinstance(fn, str):
        raise GradkitError(
            f"gk.custom_gradient({fn!r}): pass the op name as a keyword, @gk.custom_gradient(name={fn!r}).")
    return _decorate(fn, name, mode)


@overload
def custom_jvp(fn: F, *, name: str | None = None) -> F: ...
@overload
def custom_jvp(fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...


def custom_jvp(fn=None, *, name=None):
    """Defines a function's derivative with a forward-mode (JVP) closure; serves both modes.

    The forward-mode twin of :func:`custom_gradient`: the decorated function
    returns its outputs and ``jvp_fn``; ``jvp_fn`` receives one tangent per
    positional argument, structured like the argument (``None`` for static
    arguments and integer leaves), and returns the output tangents: a bare
    value for one output, a tuple for several, ``None`` anywhere for zero.
    ``jvp_fn`` may close over forward values. ``jvp``, ``jacfwd`` and
    ``hessian`` use it directly; ``grad``/``vjp`` transpose it, so it must be
    linear in the tangents. Tangents of another floating dtype are cast to
    the output's dtype. Static arguments, pytrees, tables (``.rule``) and
    higher orders work as for :func:`custom_gradient`.

    Compared with ``jax.custom_jvp``: no separate rule function, no
    ``nondiff_argnums``, and the rule shares forward intermediates through
    its closure.

    Args:
      fn: the function; returns ``(outputs, jvp_fn)``.
      name: the op name tables use; defaults to ``fn.__name__``.

    Returns:
      A function with ``fn``'s signature that returns only the outputs.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> @gk.custom_jvp
      ... def safe_norm(x):
      ...     n = jnp.sqrt(jnp.sum(x * x))
      ...     unit = jnp.where(n == 0, 0.0, x / jnp.where(n == 0, 1.0, n))
      ...     return n, lambda t: jnp.sum(unit * t)
      >>> zero = jnp.zeros(2)
      >>> jax.grad(safe_norm)(zero).tolist(), jax.jacfwd(safe_norm)(zero).tolist()
      ([0.0, 0.0], [0.0, 0.0])
    """
    if fn is None:
        return lambda f: _decorate(f, name, "jvp")
    if isinstance(fn, str):
        raise GradkitError(f"gk.custom_jvp({fn!r}): pass the op name as a keyword, @gk.custom_jvp(name={fn!r}).")
    return _decorate(fn, name, "jvp")
