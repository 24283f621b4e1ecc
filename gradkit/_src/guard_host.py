"""The device side of ``gk.guard``: the finiteness check, and the host callback that runs only for bad calls.

The check is one fused ``sum(|x| * 0)`` per leaf (see :func:`all_finite`).

The callback sits in the false branch of a ``lax.cond`` on the check, so a
finite call transfers nothing. Under ``vmap`` a ``cond`` with a batched
predicate becomes a ``select`` that runs both branches; the reporter is
therefore a ``jax.custom_batching.custom_vmap`` function whose batching rule
reduces the batched flags to one unbatched ``all(ok)`` and re-enters itself
with the batch axis in front (once per ``vmap`` level), so the callback runs
once, with the whole batch and the per-element flags, only when some element
is bad.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import io_callback

# The host function: ``host(levels, ok, *leaves)`` with numpy arrays. ``levels`` (static) lists, per
# vmap level from the innermost out, which leaves are batched there; the batched leaves and ``ok`` carry
# one leading axis per level, outermost first.
Host = Callable[..., None]


def all_finite(leaves: Sequence[Any]) -> Any:
    """One boolean scalar: every element of every inexact leaf is finite.

    ``sum(|x| * 0)`` per leaf, one fused read: 0 while every element is
    finite, NaN as soon as one is not (``inf * 0`` and NaN propagate through
    a sum of zeros, which cannot overflow). ``abs`` keeps XLA from moving the
    ``* 0`` into a ``dot`` that produced ``x`` and rewriting the sum of the
    ``dot`` as a ``dot`` of sums, which would miss an element that overflowed.
    """
    zeros = []
    for x in leaves:
        dtype = jnp.result_type(x)
        if jnp.issubdtype(dtype, jnp.inexact) and np.size(x):
            a = jnp.abs(x)
            acc = jnp.float64 if jnp.finfo(dtype).bits > 32 else jnp.float32
            zeros.append(jnp.sum(a * jnp.zeros((), a.dtype), dtype=acc).astype(jnp.float32))
    if not zeros:
        return jnp.bool_(True)
    return jnp.isfinite(zeros[0] if len(zeros) == 1 else jnp.sum(jnp.stack(zeros)))


def _reporter(host: Host, levels: tuple[tuple[bool, ...], ...]) -> Callable[..., Any]:
    """``report(ok, *leaves) -> ok``: calls ``host`` iff some flag in ``ok`` is False."""

    def call_host(ok: Any, *leaves: Any) -> None:
        # Copies are made on the host: the callback's arrays may alias device buffers.
        io_callback(functools.partial(host, levels), None, ok, *leaves, ordered=False)

    @jax.custom_batching.custom_vmap
    def report(ok: Any, *leaves: Any) -> Any:
        lax.cond(jnp.all(ok), lambda *a: None, call_host, ok, *leaves)
        return ok

    @report.def_vmap
    def _batched(axis_size: int, in_batched: Sequence[bool], ok: Any, *leaves: Any) -> tuple[Any, bool]:
        ok_batched, leaf_batched = in_batched[0], tuple(bool(b) for b in in_batched[1:])
        if not ok_batched:
            ok = jnp.broadcast_to(ok, (axis_size, *np.shape(ok)))
        # Re-entering a custom_vmap function: an enclosing vmap level batches it with this same rule.
        return _reporter(host, (*levels, leaf_batched))(ok, *leaves), True

    return report


def report_if_bad(host: Host, ok: Any, leaves: Sequence[Any]) -> Any:
    """Calls ``host(levels, ok, *leaves)`` on the host when ``ok`` is False; returns ``ok``."""
    return _reporter(host, ())(ok, *leaves)


def bad_elements(levels: tuple[tuple[bool, ...], ...], ok: np.ndarray, leaves: Sequence[np.ndarray]
                 ) -> list[tuple[tuple[int, ...], list[np.ndarray]]]:
    """The bad elements of a (possibly vmapped) call: ``(batch index, that element's leaves)``.

    ``ok`` has one axis per vmap level, outermost first; a leaf has a leading
    axis for each level where it is batched.
    """
    out = []
    outer_first = levels[::-1]
    for index in zip(*np.nonzero(~np.asarray(ok, bool))) if np.ndim(ok) else ([()] if not bool(ok) else []):
        index = tuple(int(i) for i in index)
        element = []
        for k, leaf in enumerate(leaves):
            x = leaf
            for i, batched in zip(index, outer_first):
                if batched[k]:
                    x = x[i]
            element.append(np.array(x, copy=True))
        out.append((index, element))
    return out
