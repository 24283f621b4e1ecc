"""Every access gradkit makes to JAX internals lives in this module.

A JAX upgrade that moves one of these names is a change to this file only.
Checked against jax 0.8.0 and 0.10.2 (the oldest and newest supported, both in CI;
0.7.x fails the bit-for-bit gradient invariant in eager mode: its tracing inlines
jitted library functions such as ``jax.nn.softmax``).

What gradkit relies on, and why:

* ``jax.extend.core`` — ``Jaxpr``, ``ClosedJaxpr``, ``Literal``, ``Primitive``:
  the rewrite walks equations and re-binds them.
* ``Primitive.get_bind_params`` — turns an equation's params into the keyword
  arguments ``bind`` expects (it returned ``(subfuns, params)`` before
  jax 0.9.2 and returns ``params`` since; both are handled here).
* ``jax._src.source_info_util`` — the user's source line of an equation, and the
  context manager that makes re-bound equations keep it.
* ``jax._src.core.extend_axis_env_nd`` is *not* used: ``shard_map`` bodies are
  re-traced through the public ``jax.shard_map`` so JAX sets up the mesh itself.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax._src import api_util as _api_util
from jax._src import config as _jax_config
from jax._src import shard_map as _shard_map
from jax._src import linear_util as _lu
from jax._src import source_info_util as _siu
from jax._src import traceback_util as _tbu
from jax._src.interpreters import partial_eval as _pe
from jax.extend import core as jex_core

Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
Literal = jex_core.Literal
Primitive = jex_core.Primitive
JaxprEqn = jex_core.JaxprEqn
Tracer = jax.core.Tracer

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# Primitives whose sub-jaxprs define their own derivative: gradkit does not
# rewrite inside them (the user's rule wins) unless the table names them.
CUSTOM_DERIVATIVE_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
CUSTOM_VJP_PRIMITIVES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})

# A jitted function whose name carries this prefix is a gradkit named op.
NAMED_OP_PREFIX = "gk:"

_GRADKIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def register_source_exclusion() -> None:
    """Make JAX attribute equations to the user's frame, not to gradkit's.

    This is JAX's registration hook for libraries (Flax and Equinox use it too);
    it changes only which frame a traceback or source line points at.
    """
    _siu.register_exclusion(_GRADKIT_DIR)
    _tbu.register_exclusion(_GRADKIT_DIR)


# --------------------------------------------------------------------------- tracing


def trace(fn: Callable[..., Any], in_structs: Sequence[jax.ShapeDtypeStruct]) -> ClosedJaxpr:
    """Traces a flat function to a closed jaxpr (public ``jax.make_jaxpr``)."""
    return jax.make_jaxpr(fn)(*in_structs)


def trace_jit(fn: Callable[..., Any], args: Sequence[Any]) -> ClosedJaxpr:
    """``jax.make_jaxpr(jax.jit(fn))(*args)``: one ``jit`` equation whose ``jaxpr`` param is ``fn``'s program.

    ``args`` may be arrays or tracers of an enclosing trace: their full types
    (sharding on Explicit mesh axes, varying manual axes) are kept. Values
    ``fn`` closes over from an enclosing trace become consts of the outer
    jaxpr and extra inputs of the equation.
    """
    return jax.make_jaxpr(jax.jit(fn))(*args)


def trace_avals(fn: Callable[..., Sequence[Any]], avals: Sequence[Any], name: str = "gradkit") -> ClosedJaxpr:
    """Traces ``fn`` (flat inputs -> list of outputs) at exactly ``avals``, in the current context.

    Unlike ``make_jaxpr`` on ShapeDtypeStructs, the abstract values keep
    everything JAX attaches to them (weak type, sharding, varying manual
    axes), so an equation traced here fits where the original one stood.
    """
    dbg = _api_util.debug_info(name, fn, tuple(avals), {})
    jaxpr, _, consts = _pe.trace_to_jaxpr_dynamic(_lu.wrap_init(fn, debug_info=dbg), list(avals))
    return ClosedJaxpr(jaxpr, consts)


def single_equation(closed: ClosedJaxpr) -> JaxprEqn | None:
    """The one equation of ``closed`` if it maps the inputs, in order, to the outputs; else ``None``."""
    j, consts = jaxpr_parts(closed)
    if consts or len(j.eqns) != 1:
        return None
    eqn = j.eqns[0]
    if list(eqn.invars) != list(j.invars) or list(eqn.outvars) != list(j.outvars):
        return None
    if len(set(map(id, j.outvars))) != len(j.outvars):
        return None
    return eqn


def aval_struct(aval: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=getattr(aval, "weak_type", False))


def eval_jaxpr(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    return jex_core.jaxpr_as_fun(closed)(*args)


def in_avals(jaxpr: Jaxpr) -> list[Any]:
    return [v.aval for v in jaxpr.invars]


def read_atom(env: dict[Any, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def bind_params(primitive: Primitive, params: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    out = primitive.get_bind_params(params)
    if isinstance(out, tuple):  # jax < 0.9.2: (subfuns, params)
        subfuns, new_params = out
        return tuple(subfuns), new_params
    return (), out


def bind(eqn: JaxprEqn, invals: Sequence[Any], params: dict[str, Any] | None = None) -> list[Any]:
    """Binds ``eqn``'s primitive to ``invals``; returns the outputs as a list."""
    subfuns, bparams = bind_params(eqn.primitive, eqn.params if params is None else params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*subfuns, *invals, **bparams)
    return list(out) if eqn.primitive.multiple_results else [out]


@contextlib.contextmanager
def source_of(eqn: JaxprEqn) -> Iterator[None]:
    """Equations created inside keep ``eqn``'s user source line and name stack."""
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
        yield


def source_line(eqn: JaxprEqn | None) -> str:
    """``file:line (function)`` of the user code that created ``eqn``."""
    if eqn is None:
        return "unknown source line"
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is None:
        return "unknown source line"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def source_frame(eqn: JaxprEqn) -> tuple[str, int, str] | None:
    frame = _siu.user_frame(eqn.source_info.traceback)
    return None if frame is None else (frame.file_name, frame.start_line, frame.function_name)


def current_source_line() -> str:
    frame = _siu.user_frame(_siu.current().traceback)
    if frame is None:
        return "unknown source line"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


# --------------------------------------------------------------------------- names

JIT_PRIMITIVES = frozenset({"jit", "pjit"})  # "pjit" before jax 0.7, "jit" since
# A table key that targets a function by its Python name, not a primitive.
FUNCTION_PREFIX = "fn:"
# The function a table rule is wrapped in is named RULE_PREFIX + op + "]".
RULE_PREFIX = "gradkit_rule["


def is_jit(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in JIT_PRIMITIVES


def eqn_name(eqn: JaxprEqn) -> str:
    """The name a rule table matches.

    Two namespaces: a primitive's name (``"sqrt"``), and ``"fn:<name>"`` for
    a function the program calls by name: a ``jax.jit``-ed function
    (``jax.nn.softplus`` is ``jit[name=softplus]``) or a ``custom_jvp`` /
    ``custom_vjp`` function. A gradkit named op keeps its reserved jit name
    (NAMED_OP_PREFIX...), which the dispatcher resolves to the op's name.
    """
    prim = eqn.primitive.name
    if prim in JIT_PRIMITIVES:
        name = eqn.params.get("name") or ""
        if name.startswith(NAMED_OP_PREFIX):
            return name
        return FUNCTION_PREFIX + name if name else prim
    if prim in CUSTOM_DERIVATIVE_PRIMITIVES:
        fn_name = custom_function_name(eqn)
        return FUNCTION_PREFIX + fn_name if fn_name else prim
    return prim


def custom_function_name(eqn: JaxprEqn) -> str | None:
    """The Python name of the custom_jvp / custom_vjp function ``eqn`` calls, if known."""
    closed = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    debug = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    src = getattr(debug, "func_src_info", None) or ""
    return src.split(" ")[0] or None


def rule_wrapper_name(op: str) -> str:
    return f"{RULE_PREFIX}{op}]"


def rule_target(eqn: JaxprEqn) -> str | None:
    """For the equation of a table rule's wrapper, the op it overrides; else ``None``."""
    if eqn.primitive.name not in CUSTOM_DERIVATIVE_PRIMITIVES:
        return None
    name = custom_function_name(eqn) or ""
    if name.startswith(RULE_PREFIX) and name.endswith("]"):
        return name[len(RULE_PREFIX):-1]
    return None


# --------------------------------------------------------------------------- jaxprs, open and closed

# JAX >= 0.11: ``ClosedJaxpr`` is an alias of ``Jaxpr``, which carries its own
# consts; before, a ClosedJaxpr wraps an open Jaxpr and its consts.
CLOSED_IS_JAXPR: bool = ClosedJaxpr is Jaxpr


def is_jaxpr(x: Any) -> bool:
    """An open or closed jaxpr (what a higher-order primitive keeps in its params)."""
    return isinstance(x, (Jaxpr, ClosedJaxpr))


def jaxpr_parts(j: Any) -> tuple[Jaxpr, list[Any]]:
    """``(jaxpr, consts)``: the equations' holder and the values of its constvars."""
    if CLOSED_IS_JAXPR:
        return j, list(j.consts)
    if isinstance(j, ClosedJaxpr):
        return j.jaxpr, list(j.consts)
    return j, []


def replace_eqns(j: Any, eqns: Sequence[JaxprEqn]) -> Any:
    """``j`` (open or closed, same kind) with other equations; variables, consts and debug info kept."""
    if not CLOSED_IS_JAXPR and isinstance(j, ClosedJaxpr):
        return j.replace(jaxpr=j.jaxpr.replace(eqns=list(eqns)))
    return j.replace(eqns=list(eqns))


# Primitives whose sub-programs are kernels, not differentiable programs: not entered.
OPAQUE_PRIMITIVES = frozenset({"pallas_call", "custom_transpose_call"})


def is_opaque(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in OPAQUE_PRIMITIVES


# --------------------------------------------------------------------------- sub-jaxprs


def jaxpr_params(params: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Yields ``(key, value)`` for every param that holds jaxprs (or a tuple of them)."""
    for key, value in params.items():
        if isinstance(value, (Jaxpr, ClosedJaxpr)):
            yield key, value
        elif isinstance(value, tuple) and value and all(isinstance(v, (Jaxpr, ClosedJaxpr)) for v in value):
            yield key, value


def has_subjaxprs(eqn: JaxprEqn) -> bool:
    return any(True for _ in jaxpr_params(eqn.params))


def is_custom_derivative(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in CUSTOM_DERIVATIVE_PRIMITIVES


def is_shard_map(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name == "shard_map"


def body_context(eqn: JaxprEqn) -> contextlib.AbstractContextManager[Any]:
    """The context JAX traces ``eqn``'s sub-programs in (what tracing more code for them needs).

    A ``shard_map`` body is traced with its mesh axes in the axis environment,
    the manual abstract mesh, and its ``check_vma`` setting, so values there
    carry their varying manual axes; elsewhere, nothing.
    """
    if eqn.primitive.name != "shard_map":
        return contextlib.nullcontext()
    p = eqn.params
    axes = frozenset(p.get("newly_manual_axes", p.get("manual_axes", ())))  # "manual_axes" before jax 0.9
    stack = contextlib.ExitStack()
    stack.enter_context(_shard_map._extend_axis_env(p["mesh"], axes))
    stack.enter_context(jax.sharding.use_abstract_mesh(_shard_map._as_manual_mesh(p["mesh"], axes)))
    stack.enter_context(_jax_config._check_vma(p.get("check_vma", True)))
    return stack


def bind_shard_map(eqn: JaxprEqn, invals: Sequence[Any], body: Callable[..., Any]) -> list[Any]:
    """Re-binds a ``shard_map`` equation with ``body`` in place of its jaxpr.

    Goes through the public ``jax.shard_map`` so that JAX sets up the manual
    mesh and axis environment while ``body`` is traced.
    """
    p = eqn.params
    mapped = jax.shard_map(
        lambda *xs: tuple(body(*xs)),
        mesh=p["mesh"],
        in_specs=tuple(p["in_specs"]),
        out_specs=tuple(p["out_specs"]),
        check_vma=p.get("check_vma", True),
        axis_names=set(p.get("newly_manual_axes", p["mesh"].axis_names)),
    )
    return list(mapped(*invals))


def _fallback_trace_context() -> Any:  # pragma: no cover - a JAX without config.trace_context
    return (jax.config.jax_enable_x64, jax.config.jax_numpy_dtype_promotion,
            jax.config.jax_default_matmul_precision, jax.config.jax_numpy_rank_promotion)


try:
    from jax._src.config import trace_context as _jax_trace_context
except ImportError:  # pragma: no cover
    _jax_trace_context = _fallback_trace_context


def trace_context() -> Any:
    """Hashable snapshot of the JAX config that changes what tracing produces.

    The same key ``jax.jit`` caches on (x64, dtype promotion, matmul precision,
    PRNG implementation, the vmap axis environment, ...), so an overridden
    function re-traces exactly when a jitted one would. Called on every call of
    an overridden function: keep it cheap.
    """
    return _jax_trace_context()


def float0_zeros(shape: tuple[int, ...]) -> Any:
    import numpy as np

    return np.zeros(shape, dtype=jax.dtypes.float0)


def rule_registries_snapshot() -> dict[str, dict[Any, Any]]:
    """Copies of JAX's global differentiation rule dicts (to check nobody changed them)."""
    from jax._src.interpreters import ad, batching

    return {
        "primitive_jvps": dict(ad.primitive_jvps),
        "primitive_transposes": dict(ad.primitive_transposes),
        "primitive_batchers": dict(getattr(batching, "fancy_primitive_batchers", {})),
    }


def source_span(eqn: JaxprEqn) -> tuple[str, int, str, int, int] | None:
    """``(file, line, function, start column, end column)`` of the user code that created ``eqn``.

    The columns (Python 3.11+, else -1) tell apart two calls on one line, e.g.
    ``exp`` and ``log1p`` in ``jnp.log1p(jnp.exp(x))``; used by ``gk.audit`` to
    underline the call in its report.
    """
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    start = getattr(frame, "start_column", -1)
    end = getattr(frame, "end_column", -1) if getattr(frame, "end_line", frame.start_line) == frame.start_line else -1
    return frame.file_name, frame.start_line, frame.function_name, start, end


def library_callee(eqn: JaxprEqn) -> tuple[str, str] | None:
    """``(file, function)`` of the library function the user's line called to create ``eqn``.

    For a ``log`` made inside ``jax.nn.logsumexp`` this is ``(".../special.py",
    "logsumexp")``: ``gk.audit`` uses it to suggest the stable replacement of
    the function the user actually wrote. JAX's own plumbing (jit wrappers,
    tracing) is skipped. ``None`` when no user frame is known.
    """
    tb = eqn.source_info.traceback
    frames = list(tb.frames) if tb is not None else []
    is_user = getattr(_siu, "is_user_filename", None)
    if is_user is None:  # pragma: no cover - a JAX without it: no library attribution
        return None
    for i, fr in enumerate(frames):
        if is_user(fr.file_name):
            for inner in reversed(frames[:i]):
                if (os.path.basename(inner.file_name) not in _PLUMBING
                        and inner.function_name.rsplit(".", 1)[-1] not in _WRAPPERS):
                    return inner.file_name, inner.function_name
            return None
    return None


_WRAPPERS = frozenset({"wrapper", "wrapped", "inner", "memoized_fun", "cache_miss",
                       "reraise_with_filtered_traceback", "__call__"})


_PLUMBING = frozenset({
    "traceback_util.py", "api.py", "pjit.py", "api_util.py", "linear_util.py", "core.py", "partial_eval.py",
    "source_info_util.py", "dispatch.py", "custom_derivatives.py", "contextlib.py", "functools.py",
    "interpreters.py", "ad.py", "batching.py", "util.py", "config.py", "array_methods.py", "profiler.py",
})


# --------------------------------------------------------------------------- primitives by name (rule library)

_PRIMITIVES_BY_NAME: dict[str, Primitive] | None = None


def primitive_by_name(name: str) -> Primitive | None:
    """The JAX primitive called ``name`` (``"sqrt"``, ``"integer_pow"``), from ``jax.extend.core.primitives``.

    The rule library uses it to compute an op's default derivative (for
    ``scale_gradient`` / ``clip_gradient`` table rules); ``None`` if unknown.
    """
    global _PRIMITIVES_BY_NAME
    if _PRIMITIVES_BY_NAME is None:
        from jax.extend.core import primitives as _prims

        _PRIMITIVES_BY_NAME = {p.name: p for p in vars(_prims).values() if isinstance(p, Primitive)}
    return _PRIMITIVES_BY_NAME.get(name)


def bind_primitive(primitive: Primitive, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """``primitive.bind(*invals, **params)`` with equation params converted for ``bind``; a list of outputs."""
    subfuns, bparams = bind_params(primitive, dict(params))
    out = primitive.bind(*subfuns, *invals, **bparams)
    return list(out) if primitive.multiple_results else [out]


# --------------------------------------------------------------------------- reliability helpers


def aval_of(x: Any) -> Any:
    """The abstract value (shape, dtype, weak_type) of an array or tracer."""
    if hasattr(jax, "typeof"):  # jax >= 0.6
        return jax.typeof(x)
    return jax.core.get_aval(x)  # pragma: no cover - older JAX


def aval_key(x: Any) -> tuple[Any, ...]:
    """``(shape, dtype, weak_type)`` of an array or tracer, cheaply (on every overridden call)."""
    if isinstance(x, (np.ndarray, np.generic)):
        return (x.shape, x.dtype, False)
    weak = getattr(x, "weak_type", None)  # concrete jax.Array
    if weak is None:
        aval = aval_of(x)
        return (tuple(aval.shape), aval.dtype, getattr(aval, "weak_type", False))
    return (x.shape, x.dtype, weak)


def is_weakly_typed(x: Any) -> bool:
    """Whether ``x`` is a weakly typed JAX value (from a Python scalar): it has no dtype of its own."""
    if not isinstance(x, (jax.Array, Tracer)):
        return False
    return bool(getattr(aval_of(x), "weak_type", False))


# JAX's errors for Python control flow / conversions on a traced value.
CONCRETIZATION_ERRORS: tuple[type[BaseException], ...] = (
    jax.errors.ConcretizationTypeError,
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.TracerArrayConversionError,
)


def is_forward_mode_of_custom_vjp_error(e: BaseException) -> bool:
    """Whether ``e`` is JAX refusing forward mode (jvp) through a ``jax.custom_vjp`` function."""
    msg = str(e)
    return isinstance(e, TypeError) and "forward-mode" in msg and "custom_vjp" in msg


def add_note(e: BaseException, note: str) -> None:
    """Adds ``note`` to an exception's message, keeping its type (Python 3.11 notes; appended before)."""
    if hasattr(e, "add_note"):
        e.add_note(note)
    elif e.args and isinstance(e.args[0], str):  # pragma: no cover - Python 3.10
        e.args = (f"{e.args[0]}\n{note}", *e.args[1:])


# =========================================================================== gradkit's own primitive: safe_scale
#
# ``safe_scale(t, d)`` is ``t * d`` (or ``t / d``), exactly 0 where ``t == 0``:
# the masked product that lets the SAFE rules be JVP rules. A ``custom_vjp``
# cannot sit inside a tangent (JAX has no transpose rule for
# ``custom_vjp_call``), and ``jnp.where(t == 0, 0, t * d)`` is not linear in
# ``t`` as JAX sees it, so the mask needs a primitive with its own transpose
# rule. Registering rules for a primitive gradkit defines is extension: no
# rule of JAX's own primitives is touched.

from jax import lax as _lax  # noqa: E402
from jax._src import core as _core  # noqa: E402
from jax.interpreters import ad as _ad  # noqa: E402
from jax.interpreters import batching as _batching  # noqa: E402
from jax.interpreters import mlir as _mlir  # noqa: E402

from gradkit._src.errors import GradkitError as _GradkitError  # noqa: E402

safe_scale_p: Primitive = Primitive("gradkit_safe_scale")

#: The primitives gradkit defines (and registers rules for); nothing else is registered.
OWN_PRIMITIVES: frozenset[Primitive] = frozenset({safe_scale_p})


def safe_scale(t: Any, d: Any, *, divide: bool = False) -> Any:
    """``t * d`` (``t / d`` with ``divide``), exactly 0 where ``t == 0``; linear in ``t``.

    ``t`` and ``d`` must have the same shape and dtype. Where ``t`` is 0 the
    result is 0 whatever ``d`` is (``inf``, NaN), in value and at every order
    of differentiation; elsewhere it is the plain product, bit for bit.
    """
    t, d = match_varying([t, d])
    return safe_scale_p.bind(t, d, divide=bool(divide))


def _safe_scale_value(t: Any, d: Any, *, divide: bool) -> Any:
    zero = _lax.full_like(t, 0)
    return _lax.select(_lax.eq(t, zero), zero, _lax.div(t, d) if divide else _lax.mul(t, d))


def _safe_scale_abstract_eval(t: Any, d: Any, *, divide: bool) -> Any:
    if t.shape != d.shape or t.dtype != d.dtype:
        raise _GradkitError(f"internal: safe_scale needs operands of one shape and dtype, got {t.str_short()} "
                            f"and {d.str_short()}; please report this with the function that triggered it.")
    return t.update(weak_type=t.weak_type and d.weak_type)  # as lax's binary operations


def _safe_scale_jvp(primals: Sequence[Any], tangents: Sequence[Any], *, divide: bool) -> tuple[Any, Any]:
    t, d = primals
    dt, dd = tangents
    out = safe_scale(t, d, divide=divide)
    terms = []
    if type(dt) is not _ad.Zero:
        terms.append(safe_scale(dt, d, divide=divide))
    if type(dd) is not _ad.Zero:
        # d(t*d)/dd = t, d(t/d)/dd = -t/d^2: both 0 where t == 0, and the term is
        # selected away there, so an inf or NaN tangent of d never leaks through.
        coef = t if not divide else _lax.neg(safe_scale(safe_scale(t, d, divide=True), d, divide=True))
        zero = _lax.full_like(t, 0)
        terms.append(_lax.select(_lax.eq(t, zero), _lax.full_like(dd, 0), _lax.mul(coef, dd)))
    if not terms:
        return out, _ad.Zero.from_primal_value(out)
    return out, terms[0] if len(terms) == 1 else _lax.add(terms[0], terms[1])


def _safe_scale_transpose(ct: Any, t: Any, d: Any, *, divide: bool) -> list[Any]:
    if _ad.is_undefined_primal(d) or not _ad.is_undefined_primal(t):
        raise _GradkitError("internal: safe_scale is linear in its first operand only; please report this with "
                            "the function that triggered it.")
    if type(ct) is _ad.Zero:
        return [_ad.Zero(t.aval), None]
    return [safe_scale(ct, d, divide=divide), None]


def _safe_scale_batch(args: Sequence[Any], dims: Sequence[Any], *, divide: bool) -> tuple[Any, Any]:
    t, d = args
    bt, bd = dims
    if bt == bd:
        return safe_scale(t, d, divide=divide), bt
    size = t.shape[bt] if bt is not None else d.shape[bd]

    def front(x: Any, b: Any) -> Any:
        if b is None:
            return _lax.broadcast(x, (size,))
        return jax.numpy.moveaxis(x, b, 0)

    return safe_scale(front(t, bt), front(d, bd), divide=divide), 0


# Inside shard_map, operands of one operation must vary over the same manual axes; JAX's lax wrappers
# insert the casts (pvary) themselves, and a program re-played equation by equation must too.
_auto_vary = getattr(_core, "auto_insert_reshard", None) or getattr(_core, "standard_insert_pvary", None)


def match_varying(args: Sequence[Any]) -> list[Any]:
    """``args`` cast to vary over the same ``shard_map`` axes, as JAX's lax wrappers do (no-op elsewhere)."""
    if _auto_vary is None or len(args) < 2:
        return list(args)
    return list(_auto_vary(*args))


safe_scale_p.def_impl(_safe_scale_value)
safe_scale_p.def_abstract_eval(_safe_scale_abstract_eval)
_ad.primitive_jvps[safe_scale_p] = _safe_scale_jvp
_ad.primitive_transposes[safe_scale_p] = _safe_scale_transpose
_batching.primitive_batchers[safe_scale_p] = _safe_scale_batch
_mlir.register_lowering(safe_scale_p, _mlir.lower_fun(_safe_scale_value, multiple_results=False))
# --------------------------------------------------------------------------- control-flow layouts (audit's replay)
# How ``scan``, ``while`` and ``cond`` equations lay out their operands and
# sub-programs. Checked on jax 0.8.0, 0.10.2 and 0.12.0.1. The sub-programs are
# returned as stored (open or closed): split them with :func:`jaxpr_parts`.


class ScanLayout(NamedTuple):
    """A ``scan`` equation: operands ``consts + carry + xs``; outputs ``carry + ys``."""

    body: Any
    num_consts: int
    num_carry: int
    length: int
    reverse: bool


class WhileLayout(NamedTuple):
    """A ``while`` equation: operands ``cond_consts + body_consts + carry``; outputs ``carry``."""

    cond: Any
    body: Any
    cond_nconsts: int
    body_nconsts: int


class CondLayout(NamedTuple):
    """A ``cond`` equation: operands ``index + operands``; each branch maps operands to the outputs."""

    branches: tuple[Any, ...]


def scan_layout(eqn: JaxprEqn) -> ScanLayout:
    p = eqn.params
    if "ft_in" in p:  # jax 0.12: the operand groups are a FlatTree (consts, carry, xs)
        consts, carry, _ = p["ft_in"].unpack()
        num_consts, num_carry = len(consts), len(carry)
    else:  # jax <= 0.10
        num_consts, num_carry = p["num_consts"], p["num_carry"]
    return ScanLayout(p["jaxpr"], num_consts, num_carry, p["length"], p["reverse"])


def while_layout(eqn: JaxprEqn) -> WhileLayout:
    p = eqn.params
    return WhileLayout(p["cond_jaxpr"], p["body_jaxpr"], p["cond_nconsts"], p["body_nconsts"])


def cond_layout(eqn: JaxprEqn) -> CondLayout:
    return CondLayout(tuple(eqn.params["branches"]))


def call_equation(fn: Callable[..., Sequence[Any]], invars: Sequence[Any], outvars: Sequence[Any],
                  like: JaxprEqn) -> JaxprEqn:
    """One ``jit`` equation computing ``fn`` from ``invars`` into ``outvars``, to splice in place of ``like``.

    ``fn`` maps arrays of the invars' avals to a list of arrays (one per
    outvar); it is traced once, through the public ``jax.jit``, which keeps
    any constants it closes over inside the equation's own sub-program. The
    equation keeps ``like``'s source line.
    """
    structs = [aval_struct(v.aval) for v in invars]
    traced = jax.make_jaxpr(jax.jit(lambda *xs: list(fn(*xs))))(*structs)
    core, consts = jaxpr_parts(traced)
    if len(core.eqns) != 1 or consts:  # pragma: no cover - jax.jit always gives one closed call
        from gradkit._src.errors import GradkitError

        raise GradkitError("internal: tracing a jitted function did not give one self-contained equation; "
                           "please report this with the function that triggered it.")
    return core.eqns[0].replace(invars=list(invars), outvars=list(outvars), source_info=like.source_info)
# --------------------------------------------------------------------------- custom_gradient (closure conversion)
#
# Used by gradkit/_src/closure.py and custom_gradient.py only.


def detach_consts(closed: Any) -> tuple[Jaxpr, list[Any]]:
    """``(open jaxpr taking the consts as its leading inputs, the consts)``.

    Since jax 0.11 a jaxpr carries its consts: keeping the open one is what
    drops the references to them (tracers of the trace that made them).
    """
    from jax._src.interpreters import partial_eval as pe

    jaxpr, consts = jaxpr_parts(closed)
    return pe.convert_constvars_jaxpr(jaxpr), consts


def eval_open(jaxpr: Jaxpr, args: Sequence[Any]) -> list[Any]:
    """Evaluates an open jaxpr (no constvars) on ``args`` in the current trace."""
    return list(jex_core.jaxpr_as_fun(ClosedJaxpr(jaxpr, []))(*args))


def is_forward_mode_tracer(x: Any) -> bool:
    """Whether ``x`` carries a forward-mode (``jax.jvp``) tangent.

    Reverse mode traces with linearize tracers (``jax_use_direct_linearize``,
    the default since jax 0.5), or with JVP tracers whose tangents are
    partial-evaluation tracers (the older linearize): neither counts.
    """
    from jax._src.interpreters import ad
    from jax._src.interpreters import partial_eval as pe

    if not isinstance(x, ad.JVPTracer):
        return False
    tangent = x.tangent
    return not isinstance(tangent, (ad.Zero, pe.JaxprTracer))


# --------------------------------------------------------------------------- gk.guard (guard.py)

#: The logger JAX reports a failing host callback on (``jax/_src/callback.py``, before it re-raises):
#: gk.guard's raise mode filters out its own exception there, since the raise carries the report.
CALLBACK_LOGGER: str = "jax._src.callback"
