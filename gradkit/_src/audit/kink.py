"""A fix's gradient at a kink: compared with the float64 gradients at nearby points (the Clarke subdifferential).

At a point where the function is not differentiable — a norm at 0, ``abs``
at 0, ``maximum(sqrt(x), c)`` at the edge of ``sqrt``'s domain — finite
differences are undefined (:mod:`gradkit._src.audit.verify` leaves such
elements out), yet a fix's gradient there can be right or wrong. For a
locally Lipschitz function the right answers are the points of the Clarke
subdifferential: the convex hull of the limits of gradients at nearby points.
:func:`nearby` estimates it, once per audited function, from the float64
gradients (``jax.value_and_grad`` of the float64 function; where that
gradient is not finite but the value is, float64 central differences) at
``x + h d`` for the elements ``S`` of the finding (at most
:data:`ELEMENTS` of them, taken jointly, the other elements held):

* ``d``: :data:`PAIRS` or ``|S| + 1`` pairs ``±u`` of random unit vectors,
  whichever is more (at least ``2|S| + 2`` directions);
* ``h``: each of :data:`STEPS` times ``max(1, |x_e|)`` per element;
* a point whose value is not finite is outside the function's domain: it and
  its direction are dropped.

Along each direction the gradient at the two steps agrees within
:data:`RAY_RTOL` (the pieces of a piecewise smooth function are cones at
the kink), or changes without growing (a smooth point where the gradient is
small: ``|x|^2`` at 0), where its limit along the ray is extrapolated
linearly to ``h = 0``; a gradient that grows as the step shrinks — a pole,
a square root or log singularity, where no generalized gradient exists —
leaves the point undecided (``None``: the elements stay left out, as
before).

:meth:`Nearby.judge` then decides a candidate ``c`` (the fix's gradient on
``S``): where the nearby gradients agree (every one within
:data:`AGREE_RTOL` of their largest norm from their mean) ``c`` must equal
their mean (within the dtype's ``rtol`` of the verification, relative to
``|mean| + floor``); where they differ, the point is a kink and ``c`` must
lie in their convex hull — the distance from ``c`` to the hull, found by
:func:`hull_distance` (a non-negative least-squares problem solved by
Lawson and Hanson's active-set method), at most :data:`HULL_RTOL` of the
largest nearby gradient's norm. A sample of the subdifferential is a part
of it: a candidate on its curved boundary may be rejected, never one
outside accepted beyond the tolerance.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src.audit.program import Program
from gradkit._src.checks.fd import Compiled, batch_size, evaluate

ELEMENTS = 16  # elements of a finding taken jointly at most
PAIRS = 24  # pairs of opposite random directions at least (|S| + 1 if more)
STEPS = (1e-6, 1e-4)  # distances to the nearby points, times max(1, |x_e|)
RAY_RTOL = 1e-2  # the gradients at the two steps of one direction agree within this (relative)
AGREE_RTOL = 1e-3  # nearby gradients this close to their mean (relative to the largest) are one gradient
HULL_RTOL = 1e-2  # a candidate this close to the hull (relative to the largest nearby gradient) is in it
_FD = 1e-3  # a fallback difference's step, relative to the point's distance from x


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What :meth:`Nearby.judge` found.

    Attributes:
      ok: the candidate is the nearby gradient (``kind == "gradient"``) or in their hull (``"subgradient"``).
      kind: ``"gradient"`` (the nearby gradients agree) or ``"subgradient"`` (they differ: a kink).
      elements: the elements judged; ``points`` the nearby gradients used.
      error: ``|c - mean| / max(|mean|, floor)`` or the distance to the hull over the largest nearby gradient.
    """

    ok: bool
    kind: str
    elements: int
    points: int
    error: float


@dataclasses.dataclass(frozen=True)
class Nearby:
    """The float64 gradients on ``elements`` (``(input, flat index)``) at the nearby points kept: ``(points, n)``."""

    elements: tuple[tuple[int, int], ...]
    grads: np.ndarray
    # the largest norm of the gradients measured at the nearby points (before any limit was extrapolated)
    measured: float = 0.0

    def judge(self, grads: Sequence[np.ndarray], rtol: float, floor: float) -> Verdict:
        """The candidate ``grads`` (one per input) on :attr:`elements`, against the nearby gradients."""
        c = np.array([float(np.real(np.asarray(grads[p]).reshape(-1)[i])) for p, i in self.elements])
        g = self.grads
        scale = float(np.max(np.linalg.norm(g, axis=1)))
        mean = g.mean(axis=0)
        n, m = len(self.elements), len(g)
        # one gradient: the nearby ones agree relative to their size, or to the size of those measured (a
        # smooth point where the gradient is 0, |x|^2 at 0: the limits are 0 up to rounding)
        if float(np.max(np.linalg.norm(g - mean, axis=1))) <= AGREE_RTOL * max(scale, self.measured) + 1e-300:
            with np.errstate(invalid="ignore", over="ignore"):
                err = float(np.linalg.norm(c - mean))
                room = max(float(np.linalg.norm(mean)), floor, np.finfo(np.float64).tiny)
            return Verdict(bool(err <= rtol * (float(np.linalg.norm(mean)) + floor)), "gradient", n, m,
                           _finite_or_inf(err / room))
        if not np.all(np.isfinite(c)):
            return Verdict(False, "subgradient", n, m, np.inf)
        dist = hull_distance(g / scale, c / scale)
        return Verdict(bool(dist <= HULL_RTOL), "subgradient", n, m, dist)


def _finite_or_inf(v: float) -> float:
    return v if np.isfinite(v) else float("inf")


# --------------------------------------------------------------------------- the convex hull


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """``argmin |a x - b|`` over ``x >= 0``: Lawson and Hanson's active-set method."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, bool)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(1.0, float(np.abs(b).max(initial=0.0)))
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)
        if passive.all() or float(np.max(np.where(passive, -np.inf, w))) <= tol:
            break
        passive[int(np.argmax(np.where(passive, -np.inf, w)))] = True
        for _ in range(3 * n + 10):  # drop the variables the unconstrained solution makes negative
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if np.all(z[passive] > 0):
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x


def hull_distance(points: np.ndarray, c: np.ndarray) -> float:
    """The distance from ``c`` to the convex hull of the rows of ``points``.

    ``min |sum_i l_i p_i - c|`` over ``l >= 0``, ``sum_i l_i = 1``: a non-negative least-squares problem
    with the sum constraint as a heavily weighted extra row (:func:`nnls`), its weights then normalized.
    """
    weight = 1e3 * max(1.0, float(np.abs(points).max(initial=0.0)), float(np.abs(c).max(initial=0.0)))
    a = np.vstack([points.T, np.full((1, len(points)), weight)])
    b = np.append(c, weight)
    lam = nnls(a, b)
    total = float(lam.sum())
    if total <= 0:
        return float(np.min(np.linalg.norm(points - c, axis=1)))
    return float(np.linalg.norm((lam / total) @ points - c))


# --------------------------------------------------------------------------- the nearby gradients


class _Offsets:
    """The perturbations of the group's inputs for rows of ``offsets`` (``(points, n)``, one per element)."""

    def __init__(self, shapes: Sequence[tuple[tuple[int, ...], np.dtype]], where: Sequence[tuple[int, int]],
                 offsets: np.ndarray) -> None:
        self.shapes, self.where, self.offsets = list(shapes), list(where), offsets

    def __getitem__(self, rows: np.ndarray) -> tuple[np.ndarray, ...]:
        rows = np.atleast_1d(np.asarray(rows))
        out = [np.zeros((len(rows), int(np.prod(s, dtype=np.int64))), dt) for s, dt in self.shapes]
        for j, (k, i) in enumerate(self.where):
            out[k][:, i] = self.offsets[rows, j]
        return tuple(o.reshape((len(rows),) + s) for o, (s, _) in zip(out, self.shapes))


def _perturb(xs: tuple[jax.Array, ...], deltas: tuple[jax.Array, ...], s: jax.Array) -> tuple[jax.Array, ...]:
    del s  # in the deltas
    return tuple(jnp.where(d != 0, x + d, x) for x, d in zip(xs, deltas))


def nearby(prog64: Program, dyn64: Sequence[jax.Array], elements: Sequence[tuple[int, int]],
           seed: int = 0) -> Nearby | None:
    """The float64 gradients on ``elements`` at points around ``dyn64`` (see the module docstring).

    Call under ``jax.enable_x64``. ``None``: no generalized gradient here (a gradient that grows as the
    step shrinks along some direction), no nearby point in the domain, or a complex input involved.
    """
    elements = tuple(elements)[:ELEMENTS]
    group = sorted({p for p, _ in elements})
    if not elements or any(jnp.iscomplexobj(dyn64[p]) for p in group):
        return None
    mine = tuple(dyn64[p] for p in group)
    held = [v for p, v in enumerate(dyn64) if p not in group]
    where = [(group.index(p), i) for p, i in elements]
    n = len(elements)
    x_s = np.array([float(np.asarray(mine[k]).reshape(-1)[i]) for k, i in where])
    rng = np.random.RandomState(seed)
    u = rng.normal(size=(max(PAIRS, n + 1), n))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    dirs = np.concatenate([u, -u])  # opposite pairs: both sides of every kink through x
    steps = np.array(STEPS)[:, None, None] * np.maximum(1.0, np.abs(x_s))  # (step, 1, n)
    offsets = (steps * dirs[None]).reshape(-1, n)  # rows: step-major, then direction

    def h(xs: tuple[jax.Array, ...], *rest: jax.Array) -> jax.Array:
        def total(xs: tuple[jax.Array, ...]) -> jax.Array:
            d = list(rest)
            for p, v in zip(group, xs):
                d.insert(p, v)
            return jnp.asarray(sum(jnp.sum(jnp.real(o).astype(jnp.float64)) for o in prog64.call(d)))
        v, g = jax.value_and_grad(total)(xs)
        return jnp.concatenate([jnp.reshape(v, (1,))] + [g[k].reshape(-1)[i][None] for k, i in where])

    shapes = [(tuple(x.shape), np.dtype(x.dtype)) for x in mine]
    runs: Compiled = {}
    batch = batch_size((mine, mine, mine), len(offsets))  # per point: a perturbed copy, its offset, its gradient

    def run(offs: np.ndarray) -> np.ndarray:
        return evaluate(h, mine, _perturb, _Offsets(shapes, where, offs), np.arange(len(offs)),
                        np.zeros(len(offs)), held, batch=batch, cache=runs)

    vals = run(offsets)
    value, grads = vals[:, 0], vals[:, 1:]
    ok = np.isfinite(value)
    redo = np.flatnonzero(ok & ~np.all(np.isfinite(grads), axis=1))
    if len(redo):  # JAX's gradient is not finite where the value is (a where's unused branch): differences
        grads[redo], usable = _differences(run, offsets[redo], value[redo], n)
        ok[redo] = usable
    keep = ok.reshape(len(STEPS), -1).all(axis=0)  # a direction whose points are all in the domain
    if not keep.any():
        return None
    g = grads.reshape(len(STEPS), -1, n)[:, keep]
    norms = np.linalg.norm(g, axis=2)
    with np.errstate(invalid="ignore", over="ignore"):
        spread = np.linalg.norm(g[0] - g[-1], axis=1)
        floor = 1e-12 * (1.0 + np.max(norms))
        same = spread <= RAY_RTOL * np.maximum(norms[0], norms[-1]) + floor
        # A gradient that grows as the step shrinks: a pole, a square root or log singularity — no
        # generalized gradient. One that changes but does not grow converges (a smooth point whose
        # gradient is small there: |x|^2 at 0): its limit along the ray, extrapolated linearly to h = 0.
        grows = norms[0] > (1.0 + RAY_RTOL) * norms[-1] + floor
        if not np.all(np.isfinite(norms)) or np.any(~same & grows):
            return None
    limit = np.where(same[:, None], g[0], g[0] + (g[0] - g[-1]) * (STEPS[0] / (STEPS[-1] - STEPS[0])))
    return Nearby(elements, np.concatenate([g.reshape(-1, n), limit]) if np.all(same) else limit,
                  float(np.max(norms)))


def _differences(run: object, points: np.ndarray, f0: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Float64 central differences on the ``n`` elements at each of ``points`` (offsets), and whether usable:
    the values finite, the one-sided differences and the central ones at ``s`` and ``s/2`` equal."""
    assert callable(run)
    s = _FD * np.abs(points).max(axis=1)  # per point, well inside its distance from x
    sides = np.array([1.0, -1.0, 0.5, -0.5])
    eye = np.eye(n)
    offs = (points[:, None, None, :] + (s[:, None, None, None] * sides[None, None, :, None]) * eye[None, :, None, :])
    v = run(offs.reshape(-1, n))[:, 0].reshape(len(points), n, 4)
    p, mi, p2, m2 = (v[..., k] for k in range(4))
    st = s[:, None]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        central, half = (p - mi) / (2 * st), (p2 - m2) / st
        right, left = (p - f0[:, None]) / st, (f0[:, None] - mi) / st
        tol = 1e-2 * np.abs(central) + 1e-13 * np.abs(f0[:, None]) / st + 1e-12  # float64 rounding of f / s
        good = np.isfinite(v).all(axis=2) & (np.abs(right - left) <= tol) & (np.abs(central - half) <= tol)
    return np.where(good, central, np.nan), good.all(axis=1)
