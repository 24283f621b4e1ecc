"""A function viewed as a map from one input leaf to its flat floating-point output.

``check_grads`` (:mod:`gradkit._src.checks.check`) and ``compare``
(:mod:`gradkit._src.checks.compare`) both differentiate a function one input
leaf at a time, the others held at their values, and name a derivative's
element the same way (``d out[i] / dx[j]``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.checks.describe import fmt_index, is_float, leaf_names
from gradkit._src.core.args import Split, partition
from gradkit._src.errors import GradkitError

__all__ = ["derivative_label", "flat_output", "float_inputs", "output_shape", "partial_fn"]


def flat_output(out: object) -> jax.Array:
    """All inexact leaves of a function's output, raveled and concatenated."""
    leaves = [jnp.ravel(jnp.asarray(v)) for v in jax.tree_util.tree_leaves(out)
              if jnp.issubdtype(jnp.asarray(v).dtype, jnp.inexact)]
    if not leaves:
        raise GradkitError("the function has no floating-point output to differentiate.")
    if len(leaves) == 1:
        return leaves[0]
    dtype = jnp.result_type(*leaves)
    return jnp.concatenate([v.astype(dtype) for v in leaves])


def output_shape(fn: Callable[..., object], args: Sequence[object]) -> tuple[int, ...]:
    """The shape derivative labels use: the output's, if it is one array; else the flat concatenation's."""
    leaves = [v for v in jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)) if jnp.issubdtype(v.dtype, jnp.inexact)]
    if len(leaves) == 1:
        return tuple(leaves[0].shape)
    return (int(sum(np.prod(v.shape, dtype=int) for v in leaves)),)


def float_inputs(fn: Callable[..., object], args: Sequence[object]) -> tuple[Split, list[ArrayLike], list[str]]:
    """``args`` split into floating-point leaves (differentiated) and the rest; a name per float leaf."""
    split, dyn = partition(tuple(args), dynamic=is_float)
    names = leaf_names(fn, args)
    return split, dyn, [names[i] for i in split.dyn_pos]


def partial_fn(fn: Callable[..., object], split: Split, dyn: Sequence[ArrayLike],
               k: int) -> Callable[[jax.Array], jax.Array]:
    """``x -> flat output of fn`` with every float leaf but the ``k``-th held at its value."""
    def h(x: jax.Array) -> jax.Array:
        d = list(dyn)
        d[k] = x
        return flat_output(fn(*split.combine(d)))
    return h


def derivative_label(order: int, out_shape: tuple[int, ...], out_idx: int, in_shape: tuple[int, ...],
                     in_flat: Sequence[int], name: str) -> str:
    """``d out[i] / dx[j]``, ``d^2 out / dx[j] dx[k]``."""
    out = "out" + (fmt_index(np.unravel_index(out_idx, out_shape)) if out_shape else "")
    d = "d" if order == 1 else f"d^{order}"
    ins = " ".join(f"d{name}{fmt_index(np.unravel_index(j, in_shape)) if in_shape else ''}" for j in in_flat)
    return f"{d} {out} / {ins}"
