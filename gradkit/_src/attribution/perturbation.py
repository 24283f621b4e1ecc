"""Faithfulness of an attribution, measured: the perturbation curves of :func:`perturbation_curve`.

An attribution map is faithful when the inputs it calls relevant are the ones
the model's output depends on. The protocol (Samek et al. 2017; Achtibat et
al. 2024 use it for AttnLRP): cut the input into units (a token's embedding,
a patch of pixels), rank the units by their summed relevance, and replace them
by a baseline in that order, most relevant first and least relevant first,
recording the model's output for the explained class along the way. A faithful
map makes the first curve fall fast and the second slowly; the area between
them is the score (0 for a random order, on average).

Every perturbed input of every step is made at once: the steps are a ``vmap``
(or a ``lax.map`` in chunks of ``batch_size``) over the model, inside one
``jit``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.attribution.attribution import _cotangent
from gradkit._src.errors import GradkitError, describe

__all__ = ["PerturbationCurve", "perturbation_curve"]

_METHOD = "perturbation_curve"


class PerturbationCurve(NamedTuple):
    """What :func:`perturbation_curve` returns; ``S = steps + 1`` points, ``B`` examples.

    Attributes:
      fractions: float[S], the share of the units replaced at each point
        (``round(k · units / steps) / units`` for ``k = 0 … steps``: 0 first, 1 last).
      most_relevant_first: float[B, S], the target output with the most
        relevant units replaced, divided by the unperturbed target output (1 at 0).
      least_relevant_first: float[B, S], the same, least relevant units first.
      area: float[B], the mean over the points of ``least_relevant_first −
        most_relevant_first``: the larger, the more faithful the map (about 0
        for a random order).
    """

    fractions: jax.Array
    most_relevant_first: jax.Array
    least_relevant_first: jax.Array
    area: jax.Array


def _patch_sizes(shape: tuple[int, ...], patch: Sequence[int | None] | None) -> tuple[int, ...]:
    """The block size per non-batch axis; ``None`` (all of it) for a whole axis."""
    rest = shape[1:]
    if patch is None:
        return (1,) * len(rest)
    if isinstance(patch, int) or not isinstance(patch, Sequence):
        raise GradkitError(f"attribution.{_METHOD}: patch must be a tuple of block sizes, one per axis of x after "
                           f"the batch axis ({len(rest)} for x of shape {shape}), got {patch!r}; e.g. "
                           f"patch=(1, {rest[-1]}) for x of shape (batch, tokens, {rest[-1]}) makes each token's "
                           f"vector one unit.")
    if len(patch) != len(rest):
        raise GradkitError(f"attribution.{_METHOD}: patch {tuple(patch)} has {len(patch)} block sizes, but x of "
                           f"shape {shape} has {len(rest)} axes after the batch axis; give one per axis (None for a "
                           f"whole axis).")
    sizes = []
    for axis, (n, p) in enumerate(zip(rest, patch), start=1):
        p = n if p is None else p
        if not isinstance(p, (int, np.integer)) or isinstance(p, bool) or p < 1 or n % p:
            raise GradkitError(f"attribution.{_METHOD}: patch {tuple(patch)} does not divide x's shape {shape}: "
                               f"axis {axis} has {n} entries, not a whole number of blocks of {p!r}. Choose "
                               f"block sizes that divide each axis (None for a whole axis).")
        sizes.append(int(p))
    return tuple(sizes)


def _unit_relevance(relevance: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """Relevance summed over each block: float[B, units], the units in row-major order of the block grid."""
    b, rest = relevance.shape[0], relevance.shape[1:]
    split = [b]
    for n, p in zip(rest, sizes):
        split += [n // p, p]
    blocks = relevance.reshape(split).sum(axis=tuple(range(2, 2 * len(rest) + 1, 2)))
    return blocks.reshape(b, -1)


def _expand(mask: jax.Array, shape: tuple[int, ...], sizes: tuple[int, ...]) -> jax.Array:
    """A per-unit mask [..., B, units] made a per-element mask [..., *shape]."""
    lead = mask.shape[:-2]
    grid = tuple(n // p for n, p in zip(shape[1:], sizes))
    m = mask.reshape(lead + (shape[0],) + grid)
    for k, p in enumerate(sizes):
        m = jnp.repeat(m, p, axis=len(lead) + 1 + k) if p > 1 else m
    return m


def _counts(units: int, steps: int) -> np.ndarray:
    """How many units are replaced at each of the ``steps + 1`` points (round half up)."""
    return np.floor(np.arange(steps + 1) * units / steps + 0.5).astype(np.int32)


def _score(fn: Callable[[jax.Array], jax.Array], x: jax.Array, cot: jax.Array) -> jax.Array:
    out = fn(x)
    return jnp.sum((out * cot).reshape(out.shape[0], -1), axis=-1)


def _curve(fn: Callable[[jax.Array], jax.Array], sizes: tuple[int, ...], steps: int, batch_size: int | None,
           x: jax.Array, relevance: jax.Array, baseline: jax.Array,
           target: jax.Array | None) -> PerturbationCurve:
    out = fn(x)
    cot = jax.lax.stop_gradient(_cotangent(_METHOD, out, target))
    reference = jnp.sum((out * cot).reshape(out.shape[0], -1), axis=-1)
    r = _unit_relevance(relevance, sizes)
    units = r.shape[1]
    counts = jnp.asarray(_counts(units, steps))
    # rank[b, u]: the place of unit u in each order (stable sorts: ties go in the units' order)
    most = jnp.argsort(jnp.argsort(-r, axis=-1, stable=True), axis=-1, stable=True)
    least = jnp.argsort(jnp.argsort(r, axis=-1, stable=True), axis=-1, stable=True)
    rank = jnp.stack([most, least])  # [2, B, U]
    replaced = rank[None] < counts[:, None, None, None]  # [S, 2, B, U]
    masks = _expand(replaced, x.shape, sizes)  # [S, 2, *x.shape]
    if batch_size is None:
        score = jax.vmap(jax.vmap(lambda m: _score(fn, jnp.where(m, baseline, x), cot)))(masks)
    else:
        flat = masks.reshape((-1,) + x.shape)
        score = jax.lax.map(lambda m: _score(fn, jnp.where(m, baseline, x), cot), flat, batch_size=batch_size)
        score = score.reshape(masks.shape[:2] + score.shape[1:])
    curves = jnp.moveaxis(score / reference[None, None], 0, -1)  # [2, B, S]
    fractions = jnp.asarray(_counts(units, steps) / units, dtype=curves.dtype)
    return PerturbationCurve(fractions, curves[0], curves[1], jnp.mean(curves[1] - curves[0], axis=-1))


_curve_jit = jax.jit(_curve, static_argnums=(0, 1, 2, 3))


def perturbation_curve(fn: Callable[[jax.Array], jax.Array], x: ArrayLike, relevance: ArrayLike, *,
                       target: ArrayLike | None = None, baseline: ArrayLike = 0.0, steps: int = 10,
                       patch: Sequence[int | None] | None = None,
                       batch_size: int | None = None) -> PerturbationCurve:
    """How fast the model's output falls as the inputs an attribution ranks highest are removed.

    The faithfulness protocol of Samek et al. (2017), as Achtibat et al.
    (2024) report it for AttnLRP: ``x``'s axes after the batch axis are cut
    into units (blocks of ``patch``), the units ranked by their summed
    ``relevance``, and replaced by ``baseline`` most relevant first and least
    relevant first, a fraction ``k / steps`` of them at step ``k = 0 …
    steps``. At each step the model's target output is divided by its
    unperturbed value. All ``2 (steps + 1)`` perturbed batches go through the
    model in one compiled program (a ``vmap`` over the steps).

    Args:
      fn: the model as a function of a batch ``x``, returning an array whose
        first axis is the batch and last axis the classes (e.g. next-token
        logits ``lambda e: model(e)[:, -1, :]``). It is called on batches
        shaped like ``x`` (under ``vmap``).
      x: the inputs, float[B, ...] (e.g. token embeddings [B, T, D] or images
        [B, H, W, C]).
      relevance: the attribution to test, shaped like ``x`` (e.g. from
        :func:`gradient_x_input` or :func:`lrp`; random numbers give the
        random-order reference).
      target: which output to follow, as in :func:`gradient`: ``None`` for each
        row's largest output at the unperturbed ``x`` (kept fixed as the inputs
        are removed), a class index, one per row, or an output cotangent (the
        output is then its dot product with the cotangent).
      baseline: what replaces a removed input: a number (0 by default) or an
        array broadcastable to ``x`` (e.g. a mean embedding or blurred image).
      steps: how many equal fractions the units are removed in (≥ 1); the
        curves have ``steps + 1`` points, from nothing removed to everything.
      patch: the block size per axis after the batch axis (``None`` inside it
        for a whole axis): ``(1, D)`` or ``(1, None)`` makes each token's
        embedding in [B, T, D] one unit, ``(8, 8, None)`` each 8×8 patch of
        pixels in [B, H, W, C]. ``None`` (the default): each element a unit.
      batch_size: ``None`` (default) runs all steps at once; a number runs them
        in chunks of that many perturbed batches (``lax.map``), to save memory.

    Returns:
      A :class:`PerturbationCurve`: ``fractions`` [S], ``most_relevant_first``
      and ``least_relevant_first`` [B, S], ``area`` [B] (the mean of their
      difference; larger is more faithful).

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> w = jnp.array([[4.0], [2.0], [1.0], [1.0]])
      >>> f = lambda x: x @ w
      >>> x = jnp.ones((1, 4))
      >>> c = gk.attribution.perturbation_curve(f, x, x * w.T, steps=4)  # gradient × input
      >>> c.fractions.tolist()
      [0.0, 0.25, 0.5, 0.75, 1.0]
      >>> c.most_relevant_first.tolist(), c.least_relevant_first.tolist()
      ([[1.0, 0.5, 0.25, 0.125, 0.0]], [[1.0, 0.875, 0.75, 0.5, 0.0]])
      >>> c.area.tolist()
      [0.25]
    """
    if not callable(fn):
        raise GradkitError(f"attribution.{_METHOD}: expected the model as a function of x, got "
                           f"{type(fn).__name__}; write e.g. lambda x: model.apply(params, x).")
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim < 2:
        raise GradkitError(f"attribution.{_METHOD}: x must be a floating-point batch with at least one axis after "
                           f"the batch axis, got {describe(x)}; for one example write x[None].")
    relevance = jnp.asarray(relevance)
    if relevance.shape != x.shape:
        raise GradkitError(f"attribution.{_METHOD}: relevance must be shaped like x {x.shape}, got "
                           f"{describe(relevance)}; for a map summed over an axis (per token), broadcast it back "
                           f"(jnp.broadcast_to(r[..., None], x.shape)).")
    if not jnp.issubdtype(relevance.dtype, jnp.floating):
        if not jnp.issubdtype(relevance.dtype, jnp.integer) and relevance.dtype != jnp.bool_:
            raise GradkitError(f"attribution.{_METHOD}: relevance must be real numbers, got {describe(relevance)}.")
        relevance = relevance.astype(x.dtype)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise GradkitError(f"attribution.{_METHOD}: steps must be a whole number ≥ 1 (how many equal fractions "
                           f"the units are removed in), got {steps!r}.")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer))
                                   or batch_size < 1):
        raise GradkitError(f"attribution.{_METHOD}: batch_size must be None or a whole number ≥ 1, got "
                           f"{batch_size!r}.")
    sizes = _patch_sizes(x.shape, patch)
    base = jnp.asarray(baseline)
    try:
        np.broadcast_shapes(base.shape, x.shape)
        bad = np.broadcast_shapes(base.shape, x.shape) != x.shape
    except ValueError:
        bad = True
    if bad:
        raise GradkitError(f"attribution.{_METHOD}: baseline must be a number or an array broadcastable to x "
                           f"{x.shape}, got {describe(base)}.")
    base = jnp.broadcast_to(base.astype(x.dtype), x.shape)
    out = jax.eval_shape(fn, x)
    if not isinstance(out, jax.ShapeDtypeStruct) or len(out.shape) < 2 or out.shape[0] != x.shape[0]:
        raise GradkitError(f"attribution.{_METHOD}: the model must return one array with the batch first and "
                           f"the classes last (batch {x.shape[0]}), got "
                           f"{getattr(out, 'shape', type(out).__name__)}.")
    if target is not None:  # checked here, where the class indices are still known; the curve sees a tracer
        _cotangent(_METHOD, jnp.zeros(out.shape, out.dtype), target)
        target = jnp.asarray(target)
    static = (fn, sizes, int(steps), None if batch_size is None else int(batch_size))
    try:
        hash(fn)
    except TypeError:  # a model object that cannot be a jit cache key: compiled for this call only
        return jax.jit(functools.partial(_curve, *static))(x, relevance, base, target)
    return _curve_jit(*static, x, relevance, base, target)
