"""Gradient-based attribution as rule tables: which inputs a model's output depends on.

Each method is ``jax.vjp`` of the model at ``x`` with a one-hot (or given)
output cotangent, under a rule table that changes the ReLU's backward pass:

* :func:`gradient`: no table, the plain gradient (a saliency map);
* :func:`gradient_x_input`: the gradient times the input;
* :func:`guided_backprop` (:data:`GUIDED_BACKPROP`): a ReLU passes a
  cotangent only where its input was positive *and* the cotangent is
  positive (Springenberg et al. 2015);
* :func:`deconvnet` (:data:`DECONVNET`): a ReLU passes the positive part of
  the cotangent, whatever its input was (Zeiler and Fergus 2014).

The tables match ``fn:relu``, the ``jax.nn.relu`` function, which Flax's
``nn.relu`` and Equinox's default activation are, so they apply to unmodified
models; a ReLU written as ``jnp.maximum(x, 0)`` is a ``max`` and keeps its
gradient. Everything runs under ``jit`` and ``vmap``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.core.dispatch import override
from gradkit._src.core.rule import OpView, vjp_rule
from gradkit._src.core.table import RuleTable
from gradkit._src.errors import GradkitError

__all__ = ["DECONVNET", "GUIDED_BACKPROP", "deconvnet", "gradient", "gradient_x_input", "guided_backprop"]


def _guided_relu(op: OpView, g: jax.Array) -> tuple[jax.Array]:
    (x,) = op.inputs
    return (jnp.where((x > 0) & (g > 0), g, jnp.zeros_like(g)),)


def _deconvnet_relu(op: OpView, g: jax.Array) -> tuple[jax.Array]:
    return (jnp.where(g > 0, g, jnp.zeros_like(g)),)


#: ``jax.nn.relu``'s cotangent passes where the input and the cotangent are both positive.
GUIDED_BACKPROP: RuleTable = RuleTable({"fn:relu": vjp_rule(_guided_relu, name="guided_backprop")})

#: ``jax.nn.relu``'s cotangent is its own positive part, whatever the input.
DECONVNET: RuleTable = RuleTable({"fn:relu": vjp_rule(_deconvnet_relu, name="deconvnet")})


def _cotangent(method: str, out: jax.Array, target: ArrayLike | None) -> jax.Array:
    """The output cotangent ``target`` stands for: a one-hot of a class per row, or the array itself."""
    shape = tuple(np.shape(out))
    if not shape:
        if target is not None:
            raise GradkitError(f"attribution.{method}: the model's output is a scalar, so there is no class to "
                               f"choose; leave target=None (got {target!r}).")
        return jnp.ones_like(out)
    classes = shape[-1]
    if target is None:
        return jax.nn.one_hot(jnp.argmax(out, axis=-1), classes, dtype=out.dtype)
    t = jnp.asarray(target)
    if jnp.issubdtype(t.dtype, jnp.integer):
        if t.shape not in ((), shape[:-1]):
            raise GradkitError(
                f"attribution.{method}: target has shape {t.shape}; give one class index, or one per row of the "
                f"output (shape {shape[:-1]}), or an output cotangent of shape {shape}.")
        if not isinstance(t, compat.Tracer):
            bad = np.asarray(t)[(np.asarray(t) < 0) | (np.asarray(t) >= classes)]
            if bad.size:
                raise GradkitError(f"attribution.{method}: target class {int(bad.flat[0])} is outside the "
                                   f"output's {classes} classes (0 to {classes - 1}).")
        return jnp.broadcast_to(jax.nn.one_hot(t, classes, dtype=out.dtype), shape)
    if jnp.issubdtype(t.dtype, jnp.inexact) and t.shape == shape:
        return t.astype(out.dtype)
    raise GradkitError(
        f"attribution.{method}: target must be a class index, one per row of the output (integers of shape "
        f"{shape[:-1]}), or an output cotangent (floats of shape {shape}); got {t.dtype}{list(t.shape)}.")


def as_function(method: str, fn: Any, x: Any) -> Callable[[Any], Any]:
    """``fn`` as a function of ``x`` that any JAX trace can run.

    A Flax NNX module (``model(x)``) is split into its graph and state, and
    traced once at ``x`` with its state as an argument of the trace, as
    ``nnx.jit`` does: NNX's own transforms inside it (``nnx.scan`` over a
    stack of layers, ``nnx.vmap``, ``nnx.remat``) then run, where a plain JAX
    trace of a function closing over the module is refused by Flax ("Cannot
    extract graph node from different trace level"). Anything else callable
    is returned as it is.
    """
    if not callable(fn):
        raise GradkitError(f"attribution.{method}: expected the model as a function of x, got "
                           f"{type(fn).__name__}; write e.g. lambda x: model.apply(params, x).")
    nnx = sys.modules.get("flax.nnx")
    if nnx is None or not nnx.graph.is_graph_node(fn):
        return fn
    graphdef, state = nnx.split(fn)
    leaves, tree = jax.tree_util.tree_flatten(state)
    closed, shape = jax.make_jaxpr(
        lambda ls, v: nnx.merge(graphdef, jax.tree_util.tree_unflatten(tree, ls))(v), return_shape=True)(leaves, x)
    out_tree = jax.tree_util.tree_structure(shape)

    def pure(v: Any) -> Any:
        outs = compat.eval_jaxpr(closed, [*leaves, *jax.tree_util.tree_leaves(v)])
        return jax.tree_util.tree_unflatten(out_tree, outs)

    return pure


def nnx_trace_hint(method: str, e: BaseException) -> GradkitError | None:
    """A ``[gradkit]`` error for Flax's refusal to run an NNX transform over a module the function closes over."""
    if not isinstance(e, ValueError) or "different trace level" not in str(e):
        return None
    return GradkitError(
        f"attribution.{method}: the model closes over a Flax NNX module whose NNX transform (nnx.scan, nnx.vmap, "
        f"...) Flax runs only when the module enters the trace as an argument. Pass the module itself as the "
        f"model (gk.attribution.{method}(model, x, ...)); to explain a slice of its output (the last position's "
        f"logits), wrap it in a small nnx.Module whose __call__ returns that slice. ({e})".split("\n")[0])


def _attribute(method: str, fn: Callable[[jax.Array], jax.Array], x: ArrayLike, target: ArrayLike | None,
               table: RuleTable | None) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise GradkitError(f"attribution.{method}: x must be floating point to be differentiated, got {x.dtype}.")
    fn = as_function(method, fn, x)
    model = fn if table is None else override(fn, table)
    try:
        out, pullback = jax.vjp(model, x)
    except ValueError as e:
        hint = nnx_trace_hint(method, e)
        if hint is None:
            raise
        raise hint from e
    if not isinstance(out, jax.Array):
        raise GradkitError(f"attribution.{method}: the model must return one array (its outputs, e.g. logits), "
                           f"got {type(out).__name__}.")
    (g,) = pullback(_cotangent(method, out, target))
    return g


def gradient(fn: Callable[[jax.Array], jax.Array], x: ArrayLike, *,
             target: ArrayLike | None = None) -> jax.Array:
    """The gradient of the target output with respect to ``x`` (a saliency map).

    Args:
      fn: the model as a function of its input, returning one array whose
        last axis holds the classes (or a scalar).
      x: the input, e.g. a batch of images.
      target: which output to explain: ``None`` for each row's largest output,
        a class index, one class index per row (integers shaped like the
        output without its last axis), or an output cotangent (floats shaped
        like the output).

    Returns:
      An array shaped like ``x``.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> w = jnp.array([[1.0, -2.0], [3.0, 0.5]])
      >>> gk.attribution.gradient(lambda x: x @ w, jnp.array([1.0, 1.0]), target=1).tolist()
      [-2.0, 0.5]
    """
    return _attribute("gradient", fn, x, target, None)


def gradient_x_input(fn: Callable[[jax.Array], jax.Array], x: ArrayLike, *,
                     target: ArrayLike | None = None) -> jax.Array:
    """The gradient of the target output times ``x``, element by element.

    Arguments as :func:`gradient`.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> w = jnp.array([[1.0, -2.0], [3.0, 0.5]])
      >>> gk.attribution.gradient_x_input(lambda x: x @ w, jnp.array([2.0, 1.0]), target=1).tolist()
      [-4.0, 0.5]
    """
    x = jnp.asarray(x)
    return x * _attribute("gradient_x_input", fn, x, target, None)


def guided_backprop(fn: Callable[[jax.Array], jax.Array], x: ArrayLike, *,
                    target: ArrayLike | None = None) -> jax.Array:
    """Guided Backpropagation: each ReLU passes only positive cotangents, where its input was positive.

    ``fn`` is any model using ``jax.nn.relu`` (Flax ``nn.relu``, Equinox's
    default activation), unmodified. Arguments as :func:`gradient`.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> w1 = jnp.array([[1.0, -1.0], [1.0, 1.0]]); w2 = jnp.array([[1.0], [-1.0]])
      >>> f = lambda x: jax.nn.relu(x @ w1) @ w2
      >>> gk.attribution.gradient(f, jnp.array([1.0, 2.0])).tolist()
      [2.0, 0.0]
      >>> gk.attribution.guided_backprop(f, jnp.array([1.0, 2.0])).tolist()
      [1.0, 1.0]
    """
    return _attribute("guided_backprop", fn, x, target, GUIDED_BACKPROP)


def deconvnet(fn: Callable[[jax.Array], jax.Array], x: ArrayLike, *,
              target: ArrayLike | None = None) -> jax.Array:
    """DeconvNet: the gradient with every ReLU passing the positive part of its cotangent, whatever its input.

    Arguments as :func:`gradient`.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> w1 = jnp.array([[1.0, -1.0], [1.0, 1.0]]); w2 = jnp.array([[1.0], [1.0]])
      >>> f = lambda x: jax.nn.relu(x @ w1) @ w2
      >>> gk.attribution.deconvnet(f, jnp.array([1.0, -2.0])).tolist()
      [0.0, 2.0]
    """
    return _attribute("deconvnet", fn, x, target, DECONVNET)
