"""Jaxprs, equations, tracing and binding: what the dispatcher, the walker and the replay rely on."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax._src import api_util as _api_util
from jax._src import array as _array
from jax._src import config as _jax_config
from jax._src import linear_util as _lu
from jax._src import shard_map as _shard_map
from jax._src import util as _jax_util
from jax._src.config import trace_context as _jax_trace_context
from jax._src.interpreters import partial_eval as _pe
from jax._src.lax import lax as _lax_internal
from jax.extend import core as jex_core
from jax.interpreters import ad as _ad
from jax.interpreters import batching as _batching

from gradkit._src.errors import GradkitError as _GradkitError

Jaxpr = jex_core.Jaxpr
ClosedJaxpr = jex_core.ClosedJaxpr
Literal = jex_core.Literal
Primitive = jex_core.Primitive
JaxprEqn = jex_core.JaxprEqn
Var = jex_core.Var
# An equation's operand: a variable or a literal.
Atom = Var | Literal
AbstractValue = jax.core.AbstractValue
ShapedArray = jax.core.ShapedArray
Tracer = jax.core.Tracer
# A concrete jax.Array (never a tracer). Named, not made: building an array at
# import would initialize JAX's backend before the user's jax.config.update.
ArrayImpl: type = _array.ArrayImpl

JAX_VERSION: tuple[int, ...] = tuple(int(p) for p in jax.__version__.split(".")[:3] if p.isdigit())

# Primitives whose sub-jaxprs define their own derivative: gradkit does not
# rewrite inside them (the user's rule wins) unless the table names them.
CUSTOM_DERIVATIVE_PRIMITIVES = frozenset({"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"})
CUSTOM_VJP_PRIMITIVES = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})

# A jitted function whose name carries this prefix is a gradkit named op.
NAMED_OP_PREFIX = "gk:"




# --------------------------------------------------------------------------- tracing


_STRUCT_PARAMS = frozenset(inspect.signature(jax.ShapeDtypeStruct.__init__).parameters)


def struct_of(aval: Any, weak_type: bool | None = None, *, placement: bool = True) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct with an aval's whole type: shape, dtype, weak type, sharding, varying manual axes.

    Tracing at it (``make_jaxpr``, ``linear_transpose``, ``eval_shape``) gives
    values of the same type as the aval's: on an Explicit mesh or inside
    ``shard_map`` a struct of shape and dtype only would not fit where the
    aval's value goes. ``weak_type`` overrides the aval's weak type. (The
    varying axes are ``vma`` up to jax 0.11, ``manual_axis_type`` from 0.12.)
    ``placement=False`` leaves out sharding and varying axes: the key of a
    program that does not depend on where its values live (SAFE's replayed
    JVP of a primitive), shared by every placement.
    """
    weak = getattr(aval, "weak_type", False) if weak_type is None else weak_type
    if not placement:
        return jax.ShapeDtypeStruct(tuple(aval.shape), aval.dtype, weak_type=weak)
    kw: dict[str, Any] = {}
    sharding = getattr(aval, "sharding", None)
    if sharding is not None:
        kw["sharding"] = sharding
    if "manual_axis_type" in _STRUCT_PARAMS and getattr(aval, "mat", None) is not None:
        kw["manual_axis_type"] = aval.mat
    elif "vma" in _STRUCT_PARAMS and getattr(aval, "vma", None):
        kw["vma"] = aval.vma
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, weak_type=weak, **kw)


def struct_like(x: Any, weak_type: bool | None = None) -> jax.ShapeDtypeStruct:
    """:func:`struct_of` the type of an array or tracer ``x``."""
    return struct_of(jax.typeof(x), weak_type)


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
    # Under jax.disable_jit() a jit would trace fn inline (no equation to
    # splice into): gradkit's one trace keeps jit on; the program then runs
    # as disable_jit runs a bound jit equation.
    with jax.disable_jit(False):
        return jax.make_jaxpr(jax.jit(fn))(*args)


def staged(jitted: Any, stage: str, what: str) -> Callable[..., Any]:
    """``jitted.<stage>``: a ``jax.jit`` object's ``lower``, ``trace`` or ``eval_shape`` on this JAX.

    ``lower`` and ``eval_shape`` are old; ``trace`` (``jax.stages.Traced``)
    exists on every supported JAX (0.8 through 0.12). A JAX without one gets
    a ``[gradkit]`` error naming the version and the stage that does exist.
    """
    method = getattr(jitted, stage, None)
    if method is None:
        raise _GradkitError(
            f"{what}.{stage}: jax.jit functions of this JAX ({jax.__version__}) have no .{stage}, and an "
            f"overridden function offers what jax.jit offers. Use .lower(...) (its .compile(), .as_text()), or "
            "upgrade jax.")
    return method  # a jax.jit object's bound method


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



def eval_jaxpr(closed: ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
    return jex_core.jaxpr_as_fun(closed)(*args)



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



def is_custom_derivative(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in CUSTOM_DERIVATIVE_PRIMITIVES


def is_shard_map(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name == "shard_map"


def is_loop(eqn: JaxprEqn) -> bool:
    """A ``scan`` or ``while``: its body is traced once and runs for every iteration."""
    return eqn.primitive.name in ("scan", "while")


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






def trace_context() -> Any:
    """Hashable snapshot of the JAX config that changes what tracing produces.

    The same key ``jax.jit`` caches on (x64, dtype promotion, matmul precision,
    PRNG implementation, the vmap axis environment, ...), so an overridden
    function re-traces exactly when a jitted one would. Called on every call of
    an overridden function: keep it cheap.
    """
    return _jax_trace_context()


def float0_zeros(shape: tuple[int, ...]) -> Any:
    return np.zeros(shape, dtype=jax.dtypes.float0)


def rule_registries_snapshot() -> dict[str, dict[Any, Any]]:
    """Copies of JAX's global differentiation rule dicts (to check nobody changed them)."""
    return {
        "primitive_jvps": dict(_ad.primitive_jvps),
        "primitive_transposes": dict(_ad.primitive_transposes),
        "primitive_batchers": dict(getattr(_batching, "fancy_primitive_batchers", {})),
    }


# --------------------------------------------------------------------------- primitives by name (rule library)

_PRIMITIVES_BY_NAME: dict[str, Primitive] | None = None


def primitive_by_name(name: str) -> Primitive | None:
    """The JAX primitive called ``name`` (``"sqrt"``, ``"integer_pow"``), from ``jax.extend.core.primitives``.

    The rule library uses it to compute an op's default derivative (for
    ``scale_gradient`` / ``clip_gradient`` table rules); ``None`` if unknown.
    """
    global _PRIMITIVES_BY_NAME
    if _PRIMITIVES_BY_NAME is None:
        _PRIMITIVES_BY_NAME = {p.name: p for p in vars(jex_core.primitives).values() if isinstance(p, Primitive)}
    return _PRIMITIVES_BY_NAME.get(name)


def bind_primitive(primitive: Primitive, invals: Sequence[Any], params: dict[str, Any]) -> list[Any]:
    """``primitive.bind(*invals, **params)`` with equation params converted for ``bind``; a list of outputs."""
    subfuns, bparams = bind_params(primitive, dict(params))
    out = primitive.bind(*subfuns, *invals, **bparams)
    return list(out) if primitive.multiple_results else [out]


# --------------------------------------------------------------------------- reliability helpers


def aval_of(x: Any) -> Any:
    """The abstract value (shape, dtype, weak_type) of an array or tracer."""
    return jax.typeof(x)


def type_key(x: Any) -> Any:
    """The whole abstract type of an array argument, as ``jax.jit``'s trace cache keys it.

    ``jax.typeof``: shape, dtype, weak type, sharding (Explicit mesh axes),
    ``shard_map``'s varying manual axes, memory space — every field JAX adds
    to the array type later is in it too. A NumPy array has shape and dtype
    only (it is never weakly typed, sharded or varying).
    """
    if isinstance(x, (np.ndarray, np.generic)):
        return (x.shape, x.dtype)
    return jax.typeof(x)


def register_cache(cache: Any, for_what: str) -> bool:
    """Registers ``cache`` (``cache_clear``/``cache_info``/``cache_keys``) so ``jax.clear_caches()`` clears it.

    JAX's registry for its own caches (``jax._src.util.register_cache``); it
    holds the cache weakly. ``False`` where a JAX version has no such hook.
    """
    hook = getattr(_jax_util, "register_cache", None)
    if hook is None:  # pragma: no cover - every supported JAX has it (checked on 0.8.0 and 0.12)
        return False
    hook(cache, for_what)
    return True


def is_weakly_typed(x: Any) -> bool:
    """Whether ``x`` is a weakly typed JAX value (from a Python scalar): it has no dtype of its own."""
    if not isinstance(x, (jax.Array, Tracer)):
        return False
    return bool(getattr(aval_of(x), "weak_type", False))


def typed_like(value: Any, ref: Any) -> jax.Array:
    """``value`` (same shape and dtype as ``ref``) as an array of ``ref``'s whole type: weak type and placement.

    A value put in the place of an input (an audit sweep's probe) then keeps
    the compiled function's signature: a jitted function keys its cache on
    the weak type and the sharding, so a strong probe for a weakly typed
    input (``jnp.full(n, 1.0)``, a Python float) would trace and compile
    again per probe.
    """
    out = jax.numpy.asarray(value)
    if is_weakly_typed(ref) != is_weakly_typed(out):
        out = _lax_internal._convert_element_type(out, out.dtype, weak_type=is_weakly_typed(ref))
    sharding = getattr(ref, "sharding", None)
    if isinstance(ref, jax.Array) and sharding is not None and out.sharding != sharding:
        out = jax.device_put(out, sharding)
    return out


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
    outvar); constants it closes over stay inside the equation's own
    sub-program. The equation keeps ``like``'s source line and context.
    """
    traced = trace_avals(jax.jit(lambda *xs: list(fn(*xs))), [a.aval for a in invars])
    eqn = single_equation(traced)
    if eqn is None:  # pragma: no cover - jax.jit always gives one closed call
        raise _GradkitError("internal: tracing a jitted function did not give one self-contained equation; "
                            "please report this with the function that triggered it.")
    return eqn.replace(invars=list(invars), outvars=list(outvars), source_info=like.source_info, ctx=like.ctx)


# --------------------------------------------------------------------------- custom_gradient (closure conversion)
#
# Used by gradkit/_src/function_gradients/closure.py and custom_gradient.py only.


def detach_consts(closed: Any) -> tuple[Jaxpr, list[Any]]:
    """``(open jaxpr taking the consts as its leading inputs, the consts)``.

    Since jax 0.11 a jaxpr carries its consts: keeping the open one is what
    drops the references to them (tracers of the trace that made them).
    """
    jaxpr, consts = jaxpr_parts(closed)
    return _pe.convert_constvars_jaxpr(jaxpr), consts


def eval_open(jaxpr: Jaxpr, args: Sequence[Any]) -> list[Any]:
    """Evaluates an open jaxpr (no constvars) on ``args`` in the current trace."""
    return list(jex_core.jaxpr_as_fun(ClosedJaxpr(jaxpr, []))(*args))


def is_forward_mode_tracer(x: Any) -> bool:
    """Whether ``x`` carries a forward-mode (``jax.jvp``) tangent.

    Reverse mode traces with linearize tracers (``jax_use_direct_linearize``,
    the default since jax 0.5), or with JVP tracers whose tangents are
    partial-evaluation tracers (the older linearize): neither counts.
    """
    if not isinstance(x, _ad.JVPTracer):
        return False
    tangent = x.tangent
    return not isinstance(tangent, (_ad.Zero, _pe.JaxprTracer))
