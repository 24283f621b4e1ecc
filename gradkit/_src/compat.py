"""Every access gradkit makes to JAX internals lives in this module.

A JAX upgrade that moves one of these names is a change to this file only.
Checked against jax 0.7.2 and 0.10.2 (the versions in CI).

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
from typing import Any

import jax
from jax._src import source_info_util as _siu
from jax._src import traceback_util as _tbu
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


def eqn_name(eqn: JaxprEqn) -> str:
    """The name a rule table matches: primitive, named op, or custom function."""
    prim = eqn.primitive.name
    if prim in ("jit", "pjit"):
        # A jitted function matches by its function name (``jax.nn.softplus``
        # is ``jit[name=softplus]``); gradkit named ops carry NAMED_OP_PREFIX.
        return eqn.params.get("name") or prim
    if prim in CUSTOM_DERIVATIVE_PRIMITIVES:
        fn_name = custom_function_name(eqn)
        return fn_name or prim
    return prim


def custom_function_name(eqn: JaxprEqn) -> str | None:
    closed = eqn.params.get("call_jaxpr") or eqn.params.get("fun_jaxpr")
    debug = getattr(getattr(closed, "jaxpr", closed), "debug_info", None)
    src = getattr(debug, "func_src_info", None) or ""
    return src.split(" ")[0] or None


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


def trace_context() -> Any:
    """Hashable snapshot of the JAX config that changes what tracing produces."""
    return (jax.config.jax_enable_x64, jax.config.jax_numpy_dtype_promotion,
            jax.config.jax_default_matmul_precision, jax.config.jax_numpy_rank_promotion)


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
