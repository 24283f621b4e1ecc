"""Finite differences: the one helper ``check_grads``, ``compare`` and ``audit`` share.

:func:`differences` evaluates a function at ``x ± step`` along some flat
coordinates of ``x`` and returns the central differences, and on request
the one-sided ones, which tell a kink or a jump (left and right differ)
from a derivative. Callers run it under ``jax.enable_x64`` with float64
inputs.

Memory is bounded whatever the size of ``x``: :func:`evaluate` computes the
perturbed points in batches — one jitted ``vmap`` per batch, the point made
inside it from ``x``, an index and a step (:func:`along_coordinate`,
:func:`along_direction`) — holding at most ``BUDGET`` bytes of perturbed
copies of ``x`` at a time (a 1M-element float64 input: 8 copies), never one
copy per point.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

NOT_JITTABLE = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)

_R = TypeVar("_R")


class Rows(Protocol):
    """What :func:`evaluate` perturbs along: indexed by an array of rows, it gives one direction per row."""

    def __getitem__(self, rows: np.ndarray, /) -> object: ...


# evaluate's compiled batches, by (function, perturbation, number of extra arguments)
Compiled = dict[tuple[object, object, int], Callable[..., jax.Array]]

def call_jit(f: Callable[..., _R], *args: object) -> _R:
    """``jax.jit(f)(*args)``, or ``f(*args)`` for a function that needs concrete values."""
    try:
        return jax.jit(f)(*args)
    except NOT_JITTABLE:
        return f(*args)


BUDGET = 64 << 20  # bytes of perturbed copies of the input that one batched evaluation holds


def nbytes(x: object) -> int:
    """Bytes of the arrays of the pytree ``x`` (arrays or shapes: ``jax.ShapeDtypeStruct``)."""
    return sum(int(np.prod(np.shape(v), dtype=np.int64)) * np.dtype(getattr(v, "dtype", np.float64)).itemsize
               for v in jax.tree_util.tree_leaves(x))


def batch_size(x: object, points: int) -> int:
    """How many perturbed copies of ``x`` (an array or a pytree of them) one batch evaluates (at least 1, at
    most ``points``)."""
    return int(max(1, min(points, BUDGET // max(nbytes(x), 1))))


def along_coordinate(x: jax.Array, c: jax.Array, s: jax.Array) -> jax.Array:
    """``x`` with ``s`` added to its flat element ``c``."""
    return x.reshape(-1).at[c].add(s.astype(x.dtype)).reshape(x.shape)


def along_direction(x: jax.Array, v: jax.Array, s: jax.Array) -> jax.Array:
    """``x + s v`` (``v`` flat, of ``x``'s size)."""
    return x + (s * v).astype(x.dtype).reshape(x.shape)


def evaluate(h: Callable[..., ArrayLike], x: object, perturb: Callable[..., object],
             dirs: Rows, rows: np.ndarray, scales: np.ndarray, args: Sequence[object] = (),
             batch: int | None = None, cache: Compiled | None = None) -> np.ndarray:
    """``ravel(h(perturb(x, dirs[rows[k]], scales[k]), *args))`` for every ``k``: ``(len(scales), size of h(x))``.

    ``x`` is an array or a pytree of arrays (then ``perturb`` returns what
    ``h`` takes); ``dirs`` anything indexed by an array of rows, giving an
    array or a pytree of arrays with a leading axis (built a batch at a time
    by an object that does so). In batches of :func:`batch_size` points —
    counting a perturbed point's bytes (what ``perturb`` returns) and its
    row of ``dirs`` — or of ``batch`` points, each one jitted ``vmap`` (the
    last padded to the same size: one compilation, kept in ``cache`` for the
    next call with the same ``h``, ``perturb`` and batch shapes); ``x`` and
    ``args`` are passed in, not closed over, so no copy of them becomes a
    constant of the compiled program. A function that does not ``vmap`` is
    called once per point, jitted where it allows.
    """
    x = jax.tree_util.tree_map(jnp.asarray, x)
    m = len(scales)
    flat = lambda v, d, s, *a: jnp.ravel(h(perturb(v, d, s), *a))
    if m == 0:
        return np.zeros((0, int(np.prod(jax.eval_shape(lambda: h(x, *args)).shape, dtype=int))))
    at = lambda k: jax.tree_util.tree_map(jnp.asarray, dirs[rows[k]])
    if batch is None:
        one = at(np.arange(1))
        batch = batch_size((jax.eval_shape(perturb, x, jax.tree_util.tree_map(lambda v: v[0], one),
                                           jnp.asarray(scales[0])), one), m)
    c = int(batch)
    try:
        runs = {} if cache is None else cache
        key = (h, perturb, len(args))
        if key not in runs:
            runs[key] = jax.jit(jax.vmap(flat, in_axes=(None, 0, 0) + (None,) * len(args)))
        run = runs[key]
        out = []
        for i in range(0, m, c):
            idx = np.arange(i, i + c).clip(max=m - 1)
            vals = run(x, at(idx), jnp.asarray(scales[idx]), *args)
            out.append(np.asarray(vals, dtype=np.float64)[: min(c, m - i)])
        return np.concatenate(out)
    except Exception:  # a function that does not vmap or jit (a host callback, concrete values): point by point
        pass
    return np.stack([np.asarray(call_jit(flat, x, at(k), jnp.asarray(scales[k]), *args), dtype=np.float64)
                     for k in range(m)])


def select_coords(n: int, limit: int, must: Sequence[int] = ()) -> np.ndarray:
    """All ``n`` flat coordinates, or ``limit`` of them (seeded sample that keeps ``must``)."""
    if n <= limit:
        return np.arange(n)
    rng = np.random.RandomState(0)
    pick = set(int(m) for m in must[:limit])
    rest = [int(j) for j in rng.permutation(n) if int(j) not in pick]
    return np.array(sorted(list(pick) + rest[: limit - len(pick)]))


@dataclasses.dataclass(frozen=True)
class Differences:
    """Differences of ``h`` at ``x``, one column per probed coordinate: shape ``(size(h(x)), len(coords))``.

    Attributes:
      central: ``(h(x + s) − h(x − s)) / 2s`` (0 where both sides are equal, inf included).
      forward, backward: ``(h(x + s) − h(x)) / s`` and ``(h(x) − h(x − s)) / s``
        (``None`` unless asked for).
      finite: the function was finite at every point used.
      magnitude: ``max(|h(x + s)|, |h(x − s)|)``, what float64 rounding in the
        difference scales with (``check_grads`` widens its tolerance by it).
    """

    central: np.ndarray
    forward: np.ndarray | None
    backward: np.ndarray | None
    finite: np.ndarray
    magnitude: np.ndarray | None = None


def _diff(a: np.ndarray, b: np.ndarray, step: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):
        return np.where(a == b, 0.0, a - b) / step


def differences(h: Callable[[jax.Array], ArrayLike], x: ArrayLike, coords: np.ndarray, step: float | np.ndarray,
                one_sided: bool = False) -> Differences:
    """Finite differences of ``h`` at ``x`` along the flat coordinates ``coords``.

    Args:
      h: a function of one array (``x``'s shape) returning an array.
      x: the point.
      coords: flat indices into ``x`` to perturb, one at a time.
      step: the step, one for all coordinates or one per coordinate.
      one_sided: also evaluate ``h(x)`` and return the one-sided differences.

    Memory: at most :data:`BUDGET` bytes of perturbed copies of ``x`` at a time
    (:func:`evaluate`), and the values ``(2 len(coords), size of h(x))``.
    """
    x = jnp.asarray(x)
    m = len(coords)
    steps = np.broadcast_to(np.asarray(step, dtype=np.float64), (m,))
    coords = np.asarray(coords, dtype=np.int64)
    vals = evaluate(h, x, along_coordinate, coords, np.tile(np.arange(m), 2), np.concatenate([steps, -steps]))
    plus, minus = vals[:m], vals[m:2 * m]
    finite = np.isfinite(plus) & np.isfinite(minus)
    central = (_diff(plus, minus, 2 * steps[:, None])).T
    forward = backward = None
    if one_sided:
        f0 = np.asarray(call_jit(lambda v: jnp.ravel(h(v)), x), dtype=np.float64)[None, :]
        finite &= np.isfinite(f0)
        forward = _diff(plus, f0, steps[:, None]).T
        backward = _diff(f0, minus, steps[:, None]).T
    with np.errstate(invalid="ignore"):
        magnitude = np.fmax(np.abs(plus), np.abs(minus)).T
    return Differences(central, forward, backward, finite.T, magnitude)
