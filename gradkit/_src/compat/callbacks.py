"""Host callbacks: what gk.guard needs from JAX's callback machinery.

* :data:`CALLBACK_LOGGER` — the logger JAX reports a failing callback on.
* :data:`CALLBACK_ERRORS` — what JAX raises in place of a callback's exception.
* :func:`kept_callback` — ``jax.pure_callback`` that XLA keeps even when
  nothing reads its result. ``gk.guard`` must not put an operation between
  the gradients and whatever reads them: XLA:CPU contracts a multiply and an
  add of one fused loop into a fused multiply-add, and which pair it
  contracts depends on the code around it, so even an identity ``select`` in
  an optimizer update's loop changes its last bits. The guard's results
  therefore depend on its check only through ``select(ok, x, x)``, which
  keeps JAX from dropping the check (JAX removes an equation nothing reads
  unless it has an effect, and a JAX effect costs every call of the step
  about 0.2-0.5 ms of dispatch) and which XLA folds to ``x``. What keeps XLA
  from dropping the callback is its custom call's ``has_side_effect`` flag:
  this primitive is ``pure_callback_p`` in every respect (its abstract
  evaluation and implementation are JAX's) except that flag in its lowering.
  It has no differentiation or batching rules: gk.guard passes it only
  values with zero tangents, inside a ``custom_vmap`` function.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax._src import callback as _cb
from jax._src import core as _core
from jax._src import dispatch as _dispatch
from jax._src.interpreters import mlir as _mlir
from jax._src.lib.mlir import ir as _ir
from jax.core import ShapedArray
from jax.extend.core import Primitive
from jax.typing import ArrayLike

__all__ = ["CALLBACK_ERRORS", "CALLBACK_LOGGER", "kept_callback", "kept_callback_p"]

#: The logger JAX reports a failing host callback on (``jax/_src/callback.py``, before it re-raises):
#: gk.guard's raise mode filters out its own exception there, since the raise carries the report.
CALLBACK_LOGGER: str = "jax._src.callback"

#: What JAX raises in place of an exception a host callback raised inside a compiled program: XLA's
#: runtime keeps only the text (``INTERNAL: CpuCallback error calling callback:``, the callback's
#: traceback, then ``Type: message``), so the type is JAX's own: ``jax.errors.JaxRuntimeError`` from
#: JAX's Python dispatch path (a program's first call) or at the first use of the results on an
#: accelerator, ``ValueError`` from its C++ fast path (later calls). No hook changes that type at a
#: ``jax.jit`` call (JAX issue 26102); gk.guard converts it back where a call passes gradkit's code.
CALLBACK_ERRORS: tuple[type[Exception], ...] = (jax.errors.JaxRuntimeError, ValueError)

#: ``pure_callback_p`` lowered as a side-effecting custom call (see the module docstring).
kept_callback_p = Primitive("gradkit_kept_callback")
kept_callback_p.multiple_results = True
kept_callback_p.def_impl(functools.partial(_dispatch.apply_primitive, kept_callback_p))
kept_callback_p.def_abstract_eval(_cb.pure_callback_abstract_eval)
_dispatch.prim_requires_devices_during_lowering.add(kept_callback_p)

# jax 0.10+ asks whether the custom call returns a token (default True); 0.8 never does.
_RETURNS_TOKEN = "returns_token" in inspect.signature(_cb.emit_python_callback).parameters


def _lowering(ctx: _mlir.LoweringRuleContext, *args: _ir.Value, callback: _cb._FlatCallback,
              sharding: jax.sharding.Sharding | None,
              **params: Any) -> Sequence[_mlir.IrValues]:  # pure_callback_p's params, which differ per JAX version
    def host(*flat: np.ndarray) -> tuple[ArrayLike, ...]:
        return tuple(_cb.pure_callback_impl(*flat, callback=callback, sharding=None, **params))

    op_sharding = _cb._callback_op_sharding(ctx.module_context.axis_context, sharding, ctx.avals_out)
    extra = {"returns_token": False} if _RETURNS_TOKEN else {}
    # JAX types avals abstractly; a callback's operands and results are arrays
    avals_in, avals_out = (cast(Sequence[ShapedArray], a) for a in (ctx.avals_in, ctx.avals_out))
    result, _, _ = _cb.emit_python_callback(ctx, host, None, list(args), avals_in, avals_out,
                                            has_side_effect=True, sharding=op_sharding, **extra)
    return result


_mlir.register_lowering(kept_callback_p, _lowering)


def kept_callback(fn: Callable[..., ArrayLike], result: jax.ShapeDtypeStruct, *args: ArrayLike) -> jax.Array:
    """``jax.pure_callback(fn, result, *args)`` whose call XLA never removes.

    ``fn`` receives the arguments as arrays on the host and returns one array
    of ``result``'s shape and dtype. Not differentiable and not batched: pass
    values without tangents, and call it where no ``vmap`` batches its arguments.
    """
    flat, in_tree = jax.tree_util.tree_flatten((args, {}))

    def one(*a: np.ndarray, **kw: object) -> tuple[ArrayLike]:
        return (fn(*a, **kw),)

    avals = (_core.ShapedArray(result.shape, result.dtype),)
    out: Sequence[jax.Array] = kept_callback_p.bind(
*flat, callback=_cb._FlatCallback(one, in_tree),
                                              result_avals=avals, sharding=None, vmap_method=None)
    return out[0]
