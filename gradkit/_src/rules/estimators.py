"""The gradient estimators behind :mod:`gradkit.estimators`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol, TypeVar

import jax
import jax.numpy as jnp
from jax.typing import ArrayLike

from gradkit._src.errors import GradkitError, describe

T = TypeVar("T")  # a pytree, returned with the same structure

Array = jax.Array


def _as_float(x: ArrayLike) -> Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        x = x.astype(jnp.result_type(float))
    return x


# --------------------------------------------------------------------------- straight-through


def straight_through(quantizer: Callable[..., ArrayLike]) -> Callable[..., Array]:
    """Makes ``quantizer`` a straight-through estimator: its value, the identity's derivative.

    ``straight_through(q)(x, *args, **kwargs)`` returns exactly
    ``q(x, *args, **kwargs)``; its derivative with respect to ``x`` is the
    identity, and ``args`` get no gradient (a codebook in vector
    quantization, a number of bits). ``q`` must return an array with ``x``'s
    shape (the dtype may differ; the tangent is cast).

    Built with ``jax.custom_jvp``, so ``grad``, ``jvp``, ``jacfwd`` and
    ``hessian`` all see the identity.

    Args:
      quantizer: ``q(x, *args, **kwargs) -> array`` of ``x``'s shape.

    Returns:
      The straight-through version of ``quantizer``.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gradkit import estimators as est
      >>> q4 = est.straight_through(lambda x, levels: jnp.round(x * levels) / levels)
      >>> float(q4(0.33, 4.0)), float(jax.grad(q4)(0.33, 4.0))
      (0.25, 1.0)
    """
    if not callable(quantizer):
        raise GradkitError(f"straight_through expects a function q(x, ...), got {describe(quantizer)}.")
    name = getattr(quantizer, "__name__", "quantizer")

    @functools.wraps(quantizer)
    def wrapper(x: ArrayLike, *args: object, **kwargs: object) -> Array:
        x = _as_float(x)

        @jax.custom_jvp
        def ste(x: Array, *args: object) -> Array:
            out = jnp.asarray(quantizer(x, *args, **kwargs))
            if out.shape != x.shape:
                raise GradkitError(
                    f"straight_through({name}): the quantizer returned shape {out.shape} for an input of shape "
                    f"{x.shape}; a straight-through estimator passes the gradient through unchanged, so the "
                    "shapes must match.")
            return out

        @ste.defjvp
        def ste_jvp(primals: tuple[Array, ...], tangents: tuple[Array, ...]) -> tuple[Array, Array]:
            out = ste(*primals)
            t = tangents[0]
            if jnp.issubdtype(out.dtype, jnp.inexact):
                t = t.astype(out.dtype)
            else:
                t = jnp.zeros(out.shape, jax.dtypes.float0)
            return out, t

        return ste(x, *args)

    return wrapper


class _Rounding(Protocol):
    def __call__(self, x: ArrayLike) -> Array: ...


def _ste(op: Callable[[Array], Array], name: str, summary: str, x: float, value: float,
         more: str = "") -> _Rounding:
    """The public straight-through function ``name``: ``op(x)`` forward, the identity's derivative.

    ``op`` is an elementwise rounding of a float array; the result is one
    ``jax.custom_jvp`` (so forward mode and higher orders see the identity)
    behind ``name(x)``, which first makes ``x`` a float array. Its docstring
    is ``summary``, then ``more`` (a paragraph, optional), then a runnable
    example: ``name(x) == value`` and its derivative at ``x`` is 1.
    """

    def forward(x: Array) -> Array:
        return op(x)

    forward.__name__ = forward.__qualname__ = f"_ste_identity_{name.removeprefix('ste_')}"  # the jaxpr's name
    identity_derivative = jax.custom_jvp(forward)
    identity_derivative.defjvp(lambda primals, tangents: (identity_derivative(*primals), tangents[0]))

    def ste(x: ArrayLike) -> Array:
        return identity_derivative(_as_float(x))

    ste.__name__ = ste.__qualname__ = name
    ste.__doc__ = f"""{summary}
{more}
    Examples:
      >>> import jax
      >>> from gradkit import estimators as est
      >>> float(est.{name}({x})), float(jax.grad(est.{name})({x}))
      ({value}, 1.0)
    """
    return ste


ste_round = _ste(jnp.round, "ste_round", "``jnp.round(x)`` (half to even) with the identity's derivative.", 2.5, 2.0)
ste_floor = _ste(jnp.floor, "ste_floor", "``jnp.floor(x)`` with the identity's derivative.", 1.7, 1.0)
ste_ceil = _ste(jnp.ceil, "ste_ceil", "``jnp.ceil(x)`` with the identity's derivative.", 1.2, 2.0)
ste_sign = _ste(jnp.sign, "ste_sign", "``jnp.sign(x)`` with the identity's derivative (binarized networks).", -0.3,
                -1.0, more="""
    The plain identity, not the "hard tanh" variant: compose with
    :func:`clip_gradient` or a mask to zero the gradient for ``|x| > 1``.
""")


# --------------------------------------------------------------------------- clip / scale / reverse


@jax.custom_vjp
def _clip(x: Array, lo: Array, hi: Array) -> Array:
    return x


def _clip_fwd(x: Array, lo: Array, hi: Array) -> tuple[Array, tuple[Array, Array]]:
    return x, (lo, hi)


def _clip_bwd(res: tuple[Array, Array], g: Array) -> tuple[Array, Array, Array]:
    lo, hi = res
    return jnp.clip(g, lo, hi).astype(g.dtype), jnp.zeros_like(lo), jnp.zeros_like(hi)


_clip.defvjp(_clip_fwd, _clip_bwd)


def clip_gradient(x: T, lo: ArrayLike | None = None, hi: ArrayLike | None = None) -> T:
    """Identity forward; the cotangent flowing back through ``x`` is clipped to ``[lo, hi]``.

    Elementwise, on every leaf of the pytree ``x``. ``None`` leaves a side
    open. ``lo``/``hi`` may be traced arrays (no recompilation when they
    change) and get no gradient. Reverse mode only (``jax.custom_vjp``):
    clipping is not linear, so it has no forward-mode meaning.

    Args:
      x: an array or pytree of arrays.
      lo: lower bound of the cotangent (or ``None``).
      hi: upper bound of the cotangent (or ``None``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gradkit import estimators as est
      >>> f = lambda x: jnp.sum(3.0 * est.clip_gradient(x, -1.0, 1.0))
      >>> jax.grad(f)(jnp.ones(2)).tolist()
      [1.0, 1.0]
    """
    if lo is None and hi is None:
        raise GradkitError("clip_gradient needs at least one of `lo` and `hi`; with neither it is the identity.")

    def one(leaf: ArrayLike) -> Array:
        leaf = _as_float(leaf)
        lo_ = jnp.asarray(-jnp.inf if lo is None else lo, leaf.dtype)
        hi_ = jnp.asarray(jnp.inf if hi is None else hi, leaf.dtype)
        return _clip(leaf, lo_, hi_)

    clipped: T = jax.tree_util.tree_map(one, x)
    return clipped


@jax.custom_jvp
def _scale(x: Array, s: Array) -> Array:
    return x


@_scale.defjvp
def _scale_jvp(primals: tuple[Array, Array], tangents: tuple[Array, Array]) -> tuple[Array, Array]:
    x, s = primals
    tx, _ = tangents
    return x, tx * jax.lax.stop_gradient(s)


def scale_gradient(x: T, scale: ArrayLike) -> T:
    """Identity forward; the gradient through ``x`` is multiplied by ``scale``.

    ``scale = 0`` is ``stop_gradient``; a traced ``scale`` (an array argument
    of the jitted function) can follow a schedule without recompiling.
    Built with ``jax.custom_jvp`` (the tangent is scaled), so it works in
    forward and reverse mode. ``scale`` itself gets no gradient. Works on
    pytrees.

    Examples:
      >>> import jax
      >>> from gradkit import estimators as est
      >>> float(jax.grad(lambda x: est.scale_gradient(x, 0.1) ** 2)(3.0))
      0.6000000238418579
    """

    def one(leaf: ArrayLike) -> Array:
        leaf = _as_float(leaf)
        return _scale(leaf, jnp.asarray(scale, leaf.dtype))

    scaled: T = jax.tree_util.tree_map(one, x)
    return scaled


def reverse_gradient(x: T, scale: ArrayLike = 1.0) -> T:
    """Identity forward; the gradient is multiplied by ``-scale`` (gradient reversal, DANN).

    The domain-adversarial layer of Ganin & Lempitsky (2015): the feature
    extractor is trained to *maximize* the domain classifier's loss. Pass
    ``scale`` as a traced array, e.g. ``dann_schedule(progress)``, to ramp it
    up during training without recompiling.

    Examples:
      >>> import jax
      >>> from gradkit import estimators as est
      >>> float(jax.grad(lambda x: 2.0 * est.reverse_gradient(x, 0.5))(1.0))
      -1.0
    """
    return scale_gradient(x, -jnp.asarray(scale))


def dann_schedule(progress: ArrayLike, gamma: float = 10.0) -> Array:
    """The DANN reversal scale ``2 / (1 + exp(-gamma p)) - 1``, from 0 at ``p = 0`` to ~1 at ``p = 1``.

    Examples:
      >>> from gradkit import estimators as est
      >>> round(float(est.dann_schedule(0.5)), 4)
      0.9866
    """
    p = _as_float(progress)
    return 2.0 * jax.nn.sigmoid(gamma * p) - 1.0


# --------------------------------------------------------------------------- tap


def tap(x: T, fn: Callable[..., None], *, ordered: bool = False) -> T:
    """Identity forward; in the backward pass, ``fn(cotangent)`` runs on the host.

    The inspection hook JAX lacks (PyTorch's ``register_hook``): ``fn``
    receives the cotangent of ``x`` (same pytree structure, as NumPy arrays)
    each time the gradient is computed, under ``jit`` and ``vmap`` too (under
    ``vmap`` it is called once per batch element or with the batch, as
    ``jax.debug.callback`` decides). The cotangent is passed on unchanged.
    Uses ``jax.debug.callback`` inside the backward of a ``jax.custom_vjp``.

    Args:
      x: an array or pytree of arrays.
      fn: called with the cotangent; its return value is ignored.
      ordered: keep the order of callbacks (``jax.debug.callback(ordered=...)``).

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> from gradkit import estimators as est
      >>> seen = []
      >>> f = lambda x: jnp.sum(3.0 * est.tap(x, lambda g: seen.append(g.tolist())))
      >>> _ = jax.grad(f)(jnp.ones(2)); jax.effects_barrier(); seen
      [[3.0, 3.0]]
    """
    if not callable(fn):
        raise GradkitError(f"tap expects a callable `fn(cotangent)`, got {describe(fn)}.")

    @jax.custom_vjp
    def ident(x: T) -> T:
        return x

    def fwd(x: T) -> tuple[T, None]:
        return x, None

    def bwd(_: None, g: T) -> tuple[T]:
        jax.debug.callback(fn, g, ordered=ordered)
        return (g,)

    ident.defvjp(fwd, bwd)
    out: T = ident(x)
    return out

