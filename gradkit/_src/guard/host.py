"""The device side of ``gk.guard``: the finiteness check, and the host callback that runs only for bad calls.

The check is one fused ``any(~isfinite(x))`` per leaf (see :func:`all_finite`).

The callback sits in the false branch of a ``lax.cond`` on the check, so a
finite call transfers nothing; the guard's results depend on it only as far
as JAX can see (:func:`depend`), never in the program XLA compiles. Under
``vmap`` a ``cond`` with a batched predicate becomes a ``select`` that runs
both branches; the reporter is
therefore a ``jax.custom_batching.custom_vmap`` function whose batching rule
reduces the batched flags to one unbatched ``all(ok)`` and re-enters itself
with the batch axis in front (once per ``vmap`` level), so the callback runs
once, with the whole batch and the per-element flags, only when some element
is bad.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradkit._src import compat

# The host function: ``host(levels, ok, *leaves)`` with numpy arrays. ``levels`` (static) lists, per
# vmap level from the innermost out, which leaves are batched there; the batched leaves and ``ok`` carry
# one leading axis per level, outermost first. It returns the exception the step is to fail with, or
# None: the callback raises it once its own references to the leaves are gone, so that the traceback
# an exception keeps holds none of the step's inputs.
Host = Callable[..., BaseException | None]
# Per vmap level (innermost first), which leaves are batched there.
Levels: TypeAlias = tuple[tuple[bool, ...], ...]


def all_finite(leaves: Sequence[ArrayLike]) -> jax.Array:
    """One boolean scalar: every element of every inexact leaf is finite.

    ``any(~isfinite(x))`` per leaf, an OR reduction that XLA fuses with the
    test into one read of the leaf. Not ``max(|x|)``: XLA:CPU's vectorized
    max reductions can drop a NaN (measured on arrays of 4,097 elements and
    more); and not ``sum(|x| * 0)``, which is exact but about three times the
    cost in a training step.
    """
    bad = [jnp.any(~jnp.isfinite(x)) for x in leaves
           if jnp.issubdtype(jnp.result_type(x), jnp.inexact) and np.size(x)]
    if not bad:
        return jnp.bool_(True)
    return ~(bad[0] if len(bad) == 1 else jnp.any(jnp.stack(bad)))


def _reporter(host: Host, levels: Levels) -> Callable[..., jax.Array]:
    """``report(ok, *leaves) -> ok``: calls ``host`` iff some flag in ``ok`` is False."""

    def on_host(ok: np.ndarray, *leaves: np.ndarray) -> np.ndarray:
        # Copies are made by the host function: the callback's arrays may alias device buffers.
        flags = np.asarray(ok, dtype=bool)
        error = host(levels, ok, *leaves)
        del ok, leaves
        if error is not None:
            raise error
        return flags

    def call_host(ok: jax.Array, *leaves: jax.Array) -> jax.Array:
        # No JAX effect (an io_callback's costs every call of the step 0.2-0.5 ms of dispatch): a pure
        # callback, whose flag every result depends on for JAX, that XLA keeps by its side-effect flag
        # (compat.kept_callback), since XLA folds the dependence away (see depend).
        flag = compat.kept_callback(on_host, jax.ShapeDtypeStruct(np.shape(ok), jnp.bool_), ok, *leaves)
        return ok & flag  # (the same flags) typed as ok: inside shard_map ok varies over the mesh, flag does not

    @jax.custom_batching.custom_vmap
    def report(ok: jax.Array, *leaves: jax.Array) -> jax.Array:
        return lax.cond(jnp.all(ok), lambda o, *a: o, call_host, ok, *leaves)

    @report.def_vmap
    def _batched(axis_size: int, in_batched: Sequence[bool], ok: jax.Array, *leaves: jax.Array,
                 ) -> tuple[jax.Array, bool]:
        ok_batched, leaf_batched = in_batched[0], tuple(bool(b) for b in in_batched[1:])
        if not ok_batched:
            ok = jnp.broadcast_to(ok, (axis_size, *np.shape(ok)))
        # Re-entering a custom_vmap function: an enclosing vmap level batches it with this same rule.
        return _reporter(host, (*levels, leaf_batched))(ok, *leaves), True

    return report


def report_if_bad(host: Host, ok: jax.Array, leaves: Sequence[ArrayLike]) -> jax.Array:
    """Calls ``host(levels, ok, *leaves)`` on the host when ``ok`` is False; returns ``ok``.

    The step fails with the exception ``host`` returns, if any.

    Use the result (see :func:`depend`): the callback has no JAX effect, so
    JAX drops it when nothing reads its flag (XLA keeps it, see
    :func:`gradkit._src.compat.kept_callback`).
    """
    return _reporter(host, ())(ok, *leaves)


def depend(ok: jax.Array, x: ArrayLike, zero: bool = False) -> jax.Array:
    """``x`` for JAX's dead-code elimination a result of the flag ``ok``; zeros where ``ok`` is False if ``zero``.

    Without ``zero`` it is ``select(ok, x, x)``: JAX keeps the check and the
    callback behind ``ok`` as long as ``x`` is used, and XLA folds the select
    to ``x`` itself, so whatever reads ``x`` compiles exactly as it does
    without the guard (bit for bit, an optimizer update fused with it
    included). The callback survives that fold by its side-effect flag
    (:func:`gradkit._src.compat.kept_callback`). With ``zero`` (the skip
    mode) the select stays in the program, inside the loop XLA fuses around
    it: the values are ``x`` wherever ``ok`` holds, but a fused update's
    multiply-adds may be contracted differently (last bits).
    """
    return jnp.where(ok, x, jnp.zeros_like(x) if zero else x)


def bad_indices(ok: np.ndarray) -> list[tuple[int, ...]]:
    """Where ``ok`` is False: the bad elements' batch indices, outermost ``vmap`` level first.

    ``[()]`` for a bad call that is not batched, ``[]`` when every flag is True.
    Only the flags are read: nothing is copied.
    """
    flags = np.asarray(ok, bool)
    if not flags.ndim:
        return [] if bool(flags) else [()]
    return [tuple(int(i) for i in index) for index in zip(*np.nonzero(~flags))]


def bad_elements(levels: Levels, indices: Sequence[tuple[int, ...]],
                 leaves: Sequence[np.ndarray]) -> list[list[np.ndarray]]:
    """Host copies of the leaves of the batch elements at ``indices`` (see :func:`bad_indices`), and no others.

    A leaf has a leading axis for each ``vmap`` level where it is batched
    (``levels``, innermost first); an element's leaf is that leaf indexed at
    those levels. The copies own their memory: the callback's arrays may alias
    device buffers, and copying only the elements to audit keeps the rest of
    the batch off the host.
    """
    out = []
    outer_first = levels[::-1]
    for index in indices:
        element = []
        for k, leaf in enumerate(leaves):
            x = leaf
            for i, batched in zip(index, outer_first):
                if batched[k]:
                    x = x[i]
            element.append(np.array(x, copy=True))
        out.append(element)
    return out
