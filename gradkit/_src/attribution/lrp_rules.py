"""LRP rules, as Zennit defines them: how one layer passes relevance from its output to its input.

Each rule is a :class:`LrpRule`: a frozen value whose ``relevance(layer, x, R)``
returns the input relevance from the layer's input ``x`` and its output
relevance ``R``, computed (as Zennit's ``BasicHook`` does) from the layer
re-evaluated with modified inputs and parameters: for modified ``(x', W', b')``
``z' = f(x'; W', b')`` and ``R_in = x' * J_f(W')^T (R / stabilize(z'))``, where
``stabilize(z) = z + eps * sign(z)`` with ``sign(0) = 1``. ``W+ = max(W, 0)``,
``W- = min(W, 0)`` and likewise for ``x`` and the bias ``b``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from gradkit._src.compat.layers import Layer
from gradkit._src.errors import GradkitError

__all__ = ["LrpRule", "alpha_beta", "epsilon", "flat", "gamma", "gradient_rule", "norm", "pass_through", "stabilize",
           "w_square", "zbox", "zplus"]

Relevance = Callable[[Layer, jax.Array, jax.Array], jax.Array]


@dataclass(frozen=True)
class LrpRule:
    """One LRP rule: its name, its parameters (for display), and ``relevance(layer, x, R) -> R_in``.

    ``needs_weight``: the rule modifies a weight, so it applies only to dense
    and conv layers. ``same_shape``: the rule passes ``R`` on as it is, so it
    applies only to layers whose input and output have one shape. ``forms``:
    the relevance forms (``Composite.form``) the rule works in; a rule of the
    ``"gradient"`` form computes a site's output with its modified derivative
    by ``site_rule(site, operands)``, and ``kinds`` names the kinds it fits
    there (empty: any).
    """

    name: str
    relevance: Relevance = field(repr=False, compare=False)
    params: tuple[tuple[str, Any], ...] = ()
    needs_weight: bool = False
    same_shape: bool = False
    plain: bool = False  # the layer keeps JAX's own derivative
    forms: tuple[str, ...] = ("relevance",)
    kinds: tuple[str, ...] = ()
    site_rule: Callable[[Any, list[Any]], Any] | None = field(default=None, repr=False, compare=False)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params)
        return f"{self.name}({args})"


def stabilize(z: jax.Array, eps: float) -> jax.Array:
    """Zennit's stabilizer: ``z + eps * sign(z)``, with ``sign(0) = 1`` (never 0 for ``eps > 0``)."""
    return z + eps * jnp.where(z >= 0, 1, -1).astype(z.dtype)


def _pullback(layer: Layer, x: jax.Array, w: jax.Array, c: jax.Array) -> jax.Array:
    """``J^T c`` of ``x -> layer.apply(x, w)`` (linear in x: the point does not matter)."""
    _, pb = jax.vjp(lambda v: layer.apply(v, w), x)
    (g,) = pb(c.astype(x.dtype))
    return g


def _constant_input(value: Any, x: jax.Array) -> jax.Array:
    """``value`` broadcast to ``x``'s shape and dtype, behind an optimization barrier.

    A layer evaluated at a constant input (ones, zbox's bounds) with constant
    parameters (a model's closed-over weights under ``jit``) is a constant
    expression: without the barrier XLA folds the whole convolution at compile
    time, which takes seconds and, in the XLA of jaxlib 0.8, gives a wrong value
    for a constant convolution followed by its bias add (jit then disagrees with
    eager). The barrier keeps the layer a computation.
    """
    return jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(value, x.dtype), x.shape))


def _ones_like(x: jax.Array) -> jax.Array:
    # Behind a barrier, as in _constant_input.
    return jax.lax.optimization_barrier(jnp.ones_like(x))


def _weight_bias(layer: Layer) -> tuple[jax.Array, jax.Array | None]:
    w = layer.params[0]
    b = layer.params[1] if len(layer.params) > 1 else None
    return w, b


def _z(layer: Layer, x: jax.Array, w: jax.Array, b: jax.Array | None) -> jax.Array:
    return layer.apply(x, w) if b is None else layer.apply(x, w, b)


def _pos(a: Any) -> Any:
    return None if a is None else jnp.maximum(a, 0)


def _neg(a: Any) -> Any:
    return None if a is None else jnp.minimum(a, 0)


def _check_eps(rule: str, name: str, value: float) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise GradkitError(f"attribution.{rule}: {name} must be a number, got {value!r}.") from None
    if not v >= 0:
        raise GradkitError(f"attribution.{rule}: {name} must be >= 0 (a stabilizer added with the sign of z), "
                           f"got {value!r}.")
    return v


WeightRelevance = Callable[[Layer, jax.Array, jax.Array, jax.Array, "jax.Array | None", float], jax.Array]


def _weight_rule(name: str, stabilizer: float, relevance: WeightRelevance, *params: tuple[str, Any]) -> LrpRule:
    """A rule that modifies the weight, for dense and conv layers, from ``relevance(layer, x, R, w, b, eps)``.

    ``w`` and ``b`` are the layer's weight and bias (``None`` without one),
    ``eps`` the stabilizer, checked here (``>= 0``). ``params`` are the rule's
    other parameters, shown before the stabilizer.
    """
    e = _check_eps(name, "stabilizer", stabilizer)

    def rel(layer: Layer, x: jax.Array, r: jax.Array) -> jax.Array:
        w, b = _weight_bias(layer)
        return relevance(layer, x, r, w, b, e)

    return LrpRule(name, rel, (*params, ("stabilizer", stabilizer)), needs_weight=True)


def _ratio(layer: Layer, r: jax.Array, e: float, x1: jax.Array, w1: jax.Array, b1: jax.Array | None,
           x2: jax.Array | None = None, w2: jax.Array | None = None) -> jax.Array:
    """``R / stabilize(x₁W₁ + b₁ + x₂W₂)``; without the ``x₂`` term (``None``: the input is non-negative, x⁻ = 0)."""
    z = _z(layer, x1, w1, b1)
    if x2 is not None:
        z = z + layer.apply(x2, w2)
    return r / stabilize(z, e)


def epsilon(eps: float = 1e-6) -> LrpRule:
    """LRP-ε (Zennit's ``Epsilon``): ``R_in = x * J^T (R / stabilize(z, eps))`` with ``z = xW + b``.

    ``eps=0`` is LRP-0 (kept finite where ``z = 0``: the stabilizer's sign of 0 is 1, so 0 is divided by 0 only
    there; prefer a tiny ``eps``). Applied to a layer without weights (a pooling) it is :func:`norm`.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.epsilon(0.01)
      epsilon(eps=0.01)
    """
    e = _check_eps("epsilon", "eps", eps)

    def rel(layer: Layer, x: jax.Array, r: jax.Array) -> jax.Array:
        z = layer.apply(x, *layer.params)
        c = r / stabilize(z, e)
        _, pb = jax.vjp(lambda v: layer.apply(v, *layer.params), x)
        return x * pb(c)[0]

    return LrpRule("epsilon", rel, (("eps", eps),))


def norm(stabilizer: float = 1e-6) -> LrpRule:
    """Zennit's ``Norm``: LRP-ε with a stabilizer only, for layers without weights (average pooling).

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.norm()
      norm(stabilizer=1e-06)
    """
    e = _check_eps("norm", "stabilizer", stabilizer)
    inner = epsilon(e).relevance
    return LrpRule("norm", inner, (("stabilizer", stabilizer),))


def zplus(stabilizer: float = 1e-6) -> LrpRule:
    """LRP-z⁺ (Zennit's ``ZPlus``: α=1, β=0): positive contributions only.

    ``z = x⁺W⁺ + b⁺ + x⁻W⁻``, ``R_in = x⁺ J(W⁺)^T c + x⁻ J(W⁻)^T c`` with ``c = R / stabilize(z)``.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.zplus()
      zplus(stabilizer=1e-06)
    """
    return _weight_rule("zplus", stabilizer, _zplus)


def _zplus(layer: Layer, x: jax.Array, r: jax.Array, w: jax.Array, b: jax.Array | None, e: float) -> jax.Array:
    wp, wn = _pos(w), _neg(w)
    if layer.nonnegative_input:  # x⁻ = 0: its terms are exactly 0
        return x * _pullback(layer, x, wp, _ratio(layer, r, e, x, wp, _pos(b)))
    xp, xn = _pos(x), _neg(x)
    c = _ratio(layer, r, e, xp, wp, _pos(b), xn, wn)
    return xp * _pullback(layer, x, wp, c) + xn * _pullback(layer, x, wn, c)


def alpha_beta(alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6) -> LrpRule:
    """LRP-αβ (Zennit's ``AlphaBeta``): positive contributions weighted by α, negative by β, ``α - β = 1``.

    ``z⁺ = x⁺W⁺ + b⁺ + x⁻W⁻``, ``z⁻ = x⁺W⁻ + b⁻ + x⁻W⁺``;
    ``R_in = α (x⁺ J(W⁺)^T c⁺ + x⁻ J(W⁻)^T c⁺) - β (x⁺ J(W⁻)^T c⁻ + x⁻ J(W⁺)^T c⁻)``,
    ``c^± = R / stabilize(z^±)``.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.alpha_beta(2, 1)
      alpha_beta(alpha=2, beta=1, stabilizer=1e-06)
    """
    _check_eps("alpha_beta", "stabilizer", stabilizer)  # a bad stabilizer is reported first
    a, bt = float(alpha), float(beta)
    if a < 0 or bt < 0 or a - bt != 1:
        raise GradkitError(f"attribution.alpha_beta: alpha and beta must be >= 0 with alpha - beta == 1 "
                           f"(e.g. alpha_beta(2, 1) or alpha_beta(1, 0)); got alpha={alpha!r}, beta={beta!r}.")

    def rel(layer: Layer, x: jax.Array, r: jax.Array, w: jax.Array, b: jax.Array | None, e: float) -> jax.Array:
        wp, wn = _pos(w), _neg(w)
        if layer.nonnegative_input:
            cp, cn = _ratio(layer, r, e, x, wp, _pos(b)), _ratio(layer, r, e, x, wn, _neg(b))
            return x * (a * _pullback(layer, x, wp, cp) - bt * _pullback(layer, x, wn, cn))
        xp, xn = _pos(x), _neg(x)
        cp, cn = _ratio(layer, r, e, xp, wp, _pos(b), xn, wn), _ratio(layer, r, e, xp, wn, _neg(b), xn, wp)
        return (a * (xp * _pullback(layer, x, wp, cp) + xn * _pullback(layer, x, wn, cp))
                - bt * (xp * _pullback(layer, x, wn, cn) + xn * _pullback(layer, x, wp, cn)))

    return _weight_rule("alpha_beta", stabilizer, rel, ("alpha", alpha), ("beta", beta))


def gamma(gamma: float = 0.25, stabilizer: float = 1e-6) -> LrpRule:
    """Generalized LRP-γ (Zennit's ``Gamma``): positive contributions favoured by ``γ``.

    ``W↑ = W + γW⁺``, ``W↓ = W + γW⁻`` (biases likewise). Where ``z = xW + b > 0``,
    ``c = R / stabilize(x⁺W↑ + b↑ + x⁻W↓)`` and ``R_in = x⁺ J(W↑)^T c + x⁻ J(W↓)^T c``;
    where ``z < 0``, ``c = R / stabilize(x⁺W↓ + b↓ + x⁻W↑)`` and ``R_in = x⁺ J(W↓)^T c + x⁻ J(W↑)^T c``.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.gamma(0.25)
      gamma(gamma=0.25, stabilizer=1e-06)
    """
    _check_eps("gamma", "stabilizer", stabilizer)  # a bad stabilizer is reported first
    g = _check_eps("gamma", "gamma", gamma)

    def up(p: Any) -> Any:
        return None if p is None else p + g * jnp.maximum(p, 0)

    def down(p: Any) -> Any:
        return None if p is None else p + g * jnp.minimum(p, 0)

    def rel(layer: Layer, x: jax.Array, r: jax.Array, w: jax.Array, b: jax.Array | None, e: float) -> jax.Array:
        wu, wd = up(w), down(w)
        z = _z(layer, x, w, b)
        rp, rn = jnp.where(z > 0, r, 0), jnp.where(z < 0, r, 0)
        if layer.nonnegative_input:
            cp, cn = _ratio(layer, rp, e, x, wu, up(b)), _ratio(layer, rn, e, x, wd, down(b))
            return x * (_pullback(layer, x, wu, cp) + _pullback(layer, x, wd, cn))
        xp, xn = _pos(x), _neg(x)
        cp, cn = _ratio(layer, rp, e, xp, wu, up(b), xn, wd), _ratio(layer, rn, e, xp, wd, down(b), xn, wu)
        return (xp * (_pullback(layer, x, wu, cp) + _pullback(layer, x, wd, cn))
                + xn * (_pullback(layer, x, wd, cp) + _pullback(layer, x, wu, cn)))

    return _weight_rule("gamma", stabilizer, rel, ("gamma", gamma))


def flat(stabilizer: float = 1e-6) -> LrpRule:
    """LRP-flat (Zennit's ``Flat``): relevance spread evenly over each output's receptive field.

    Inputs and weights all ones, bias zero: ``R_in = J(1)^T (R / stabilize(1·1))``.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.flat()
      flat(stabilizer=1e-06)
    """
    return _weight_rule("flat", stabilizer, _flat)


def _flat(layer: Layer, x: jax.Array, r: jax.Array, w: jax.Array, b: jax.Array | None, e: float) -> jax.Array:
    ones = jnp.ones_like(w)
    return _pullback(layer, x, ones, _ratio(layer, r, e, _ones_like(x), ones, None))


def w_square(stabilizer: float = 1e-6) -> LrpRule:
    """LRP-w² (Zennit's ``WSquare``): inputs ones, weights (and bias) squared.

    ``z = 1·W² + b²``, ``R_in = J(W²)^T (R / stabilize(z))``.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.w_square()
      w_square(stabilizer=1e-06)
    """
    return _weight_rule("w_square", stabilizer, _w_square)


def _w_square(layer: Layer, x: jax.Array, r: jax.Array, w: jax.Array, b: jax.Array | None, e: float) -> jax.Array:
    w2 = w * w
    return _pullback(layer, x, w2, _ratio(layer, r, e, _ones_like(x), w2, None if b is None else b * b))


def zbox(low: Any, high: Any, stabilizer: float = 1e-6) -> LrpRule:
    """LRP-z^B (Zennit's ``ZBox``) for inputs bounded by ``low <= x <= high`` (e.g. pixels).

    ``z = xW + b - (LW⁺ + b⁺) - (HW⁻ + b⁻)``, ``c = R / stabilize(z)``,
    ``R_in = x J(W)^T c - L J(W⁺)^T c - H J(W⁻)^T c``; ``low`` and ``high``
    broadcast against the layer's input (scalars, or per channel).

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.zbox(0.0, 1.0)
      zbox(low=0.0, high=1.0, stabilizer=1e-06)
    """
    def rel(layer: Layer, x: jax.Array, r: jax.Array, w: jax.Array, b: jax.Array | None, e: float) -> jax.Array:
        wp, wn = _pos(w), _neg(w)
        try:
            lo = _constant_input(low, x)
            hi = _constant_input(high, x)
        except ValueError:
            raise GradkitError(f"attribution.zbox: low and high must broadcast to the layer's input shape "
                               f"{x.shape}; got shapes {jnp.shape(low)} and {jnp.shape(high)} (give scalars, "
                               f"or arrays shaped like one input without its batch axis).") from None
        z = _z(layer, x, w, b) - _z(layer, lo, wp, _pos(b)) - _z(layer, hi, wn, _neg(b))
        c = r / stabilize(z, e)
        return x * _pullback(layer, x, w, c) - lo * _pullback(layer, x, wp, c) - hi * _pullback(layer, x, wn, c)

    return _weight_rule("zbox", stabilizer, rel, ("low", low), ("high", high))


def pass_through() -> LrpRule:
    """Zennit's ``Pass``: the layer passes its output relevance to its input unchanged (activations).

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.pass_through()
      pass_through()
    """
    return LrpRule("pass_through", lambda layer, x, r: r, same_shape=True)


def gradient_rule() -> LrpRule:
    """The layer keeps its plain gradient (what Zennit does for a layer no rule matches, e.g. max pooling).

    In the ``"gradient"`` form (``ATTN_LRP``) it fits every kind: the op
    keeps JAX's own derivative there (LRP-0 for a linear layer).

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.gradient_rule()
      gradient()
    """
    def rel(layer: Layer, x: jax.Array, r: jax.Array) -> jax.Array:
        _, pb = jax.vjp(lambda v: layer.apply(v, *layer.params), x)
        return pb(r)[0]

    return LrpRule("gradient", rel, plain=True, forms=("relevance", "gradient"),
                   site_rule=lambda site, operands: site.apply(*operands))
