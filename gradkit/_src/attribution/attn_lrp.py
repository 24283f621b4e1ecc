"""LRP's gradient form (AttnLRP, CP-LRP): rules that rescale the gradient, and the run that applies them.

In the **gradient form** the cotangent carried backward is a *modified
gradient* ``g``; relevance is ``x ⊙ g`` at the end (LXT's "efficient"
AttnLRP, Achtibat et al. 2024). A linear op's plain gradient is LRP-0 (its
bias absorbs ``b ⊙ g``); the rules below change the derivative only where
LRP differs from the gradient, at the sites ``compat/gform_scan.py`` finds by
dataflow:

* ``"activation"``: :func:`identity`, ``g_x = g_y · f(x) / (x + ε)``;
* ``"product"`` of two input-dependent values: :func:`uniform` (half the
  gradient to each, so half the relevance), or :func:`hold_gate` (CP-LRP: the
  operand out of a softmax or an activation is constant);
* ``"normalizer"``: :func:`stop_gradient` (the statistic of a LayerNorm or
  RMSNorm is constant in the backward pass).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from gradkit._src import compat
from gradkit._src.attribution.attribution import _cotangent
from gradkit._src.attribution.lrp_rules import LrpRule, _check_eps
from gradkit._src.errors import GradkitError, GradkitWarning

__all__ = ["GRADIENT_KINDS", "hold_gate", "identity", "run_gradient_form", "stop_gradient", "uniform"]

#: the kinds of the gradient form: rule sites found by dataflow, and kinds that only keep their gradient.
GRADIENT_KINDS: tuple[str, ...] = ("activation", "product", "normalizer", "softmax", "dense", "sum")


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scale_cotangent(y: jax.Array, factor: float) -> jax.Array:
    return y


def _scale_fwd(y: jax.Array, factor: float) -> tuple[jax.Array, None]:
    return y, None


def _scale_bwd(factor: float, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (g * jnp.asarray(factor, g.dtype),)


_scale_cotangent.defvjp(_scale_fwd, _scale_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _identity_rule(x: jax.Array, y: jax.Array, eps: float) -> jax.Array:
    return y


def _identity_fwd(x: jax.Array, y: jax.Array, eps: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    ratio = y / (x.astype(y.dtype) + jnp.asarray(eps, y.dtype))
    return y, (ratio, x)


def _identity_bwd(eps: float, res: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    ratio, x = res
    return (g * ratio).astype(x.dtype), jnp.zeros_like(g)


_identity_rule.defvjp(_identity_fwd, _identity_bwd)


def identity(stabilizer: float = 1e-10) -> LrpRule:
    """AttnLRP's identity rule for an element-wise nonlinearity ``y = f(x)``: ``R_x = R_y``.

    In the gradient form: ``g_x = g_y · f(x) / (x + stabilizer)``, the
    stabilizer *added* (not sign-aware) in the activation's dtype, as LXT
    does. For the ``"activation"`` kind of a gradient-form composite.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> gk.attribution.identity()
      identity(stabilizer=1e-10)
      >>> c = gk.attribution.ATTN_LRP | {"activation": gk.attribution.identity(1e-6)}
      >>> r = gk.attribution.lrp(lambda x: jnp.tanh(x).sum()[None], jnp.array([0.5, -2.0]), c)
      >>> [round(v, 4) for v in r.tolist()]
      [0.4621, -0.964]
    """
    e = _check_eps("identity", "stabilizer", stabilizer)

    def site(s: Any, ops: list[Any]) -> Any:
        (x,) = ops
        return _identity_rule(x, s.apply(jax.lax.stop_gradient(x)), e)

    return LrpRule("identity", _gradient_only("identity"), (("stabilizer", stabilizer),), forms=("gradient",),
                   kinds=("activation",), site_rule=site)


def uniform() -> LrpRule:
    """AttnLRP's uniform rule for a product of two input-dependent values: half the relevance to each.

    In the gradient form the plain gradient halved (``a ⊙ ∂(ab)/∂a ⊙ g/2 =
    R/2``); at ``softmax(q·kᵀ)·v`` this gives LXT's factors ¼, ¼ and ½ at q,
    k and v. For the ``"product"`` kind of a gradient-form composite.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> gk.attribution.uniform()
      uniform()
      >>> r = gk.attribution.lrp(lambda x: (x[0] * x[1])[None], jnp.array([2.0, 3.0]), gk.attribution.ATTN_LRP)
      >>> r.tolist()
      [3.0, 3.0]
    """
    def site(s: Any, ops: list[Any]) -> Any:
        if s.fused:  # softmax(q·kᵀ)·v in one kernel: both products' halves, at q, k (¼) and v (½)
            q, k, v, *rest = ops
            return s.apply(_scale_cotangent(q, 0.25), _scale_cotangent(k, 0.25), _scale_cotangent(v, 0.5), *rest)
        return _scale_cotangent(s.apply(*ops), 0.5)

    return LrpRule("uniform", _gradient_only("uniform"), forms=("gradient",), kinds=("product",), site_rule=site)


def hold_gate() -> LrpRule:
    """CP-LRP's product rule: an operand that comes out of a softmax or an activation is constant.

    At ``A·v`` with ``A = softmax(q·kᵀ)`` all relevance goes to ``v`` (none
    through q and k); at a gated MLP's ``act(gate)·up`` all of it goes to
    ``up``. A product with no such operand, or two, takes :func:`uniform`.
    For the ``"product"`` kind of a gradient-form composite.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> gk.attribution.hold_gate()
      hold_gate()
      >>> f = lambda x: (jax.nn.sigmoid(x[0]) * x[1])[None]
      >>> r = gk.attribution.lrp(f, jnp.array([0.0, 4.0]), gk.attribution.CP_LRP)
      >>> r.tolist()
      [0.0, 2.0]
    """
    def site(s: Any, ops: list[Any]) -> Any:
        if s.fused:  # softmax(q·kᵀ)·v in one kernel: the attention weights constant, so q and k
            q, k, *rest = ops
            return s.apply(jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), *rest)
        if sum(s.gates) != 1:
            return _scale_cotangent(s.apply(*ops), 0.5)
        return s.apply(*(jax.lax.stop_gradient(o) if g else o for o, g in zip(ops, s.gates)))

    return LrpRule("hold_gate", _gradient_only("hold_gate"), forms=("gradient",), kinds=("product",),
                   site_rule=site)


def stop_gradient() -> LrpRule:
    """AttnLRP's normalizer rule: the statistic a LayerNorm or RMSNorm divides by is constant in the backward.

    ``x · rsqrt(mean(x²) + eps)`` and ``(x − μ) / √(var + eps)`` pass
    relevance as if ``σ`` were a constant (the identity rule on ``x/σ``); the
    centring ``x − μ`` keeps its gradient. For the ``"normalizer"`` kind of a
    gradient-form composite.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> gk.attribution.stop_gradient()
      stop_gradient()
      >>> f = lambda x: (x / jnp.sqrt(jnp.mean(x * x)))[:1]
      >>> r = gk.attribution.lrp(f, jnp.array([3.0, 4.0]), gk.attribution.ATTN_LRP)
      >>> [round(v, 4) for v in r.tolist()]
      [0.8485, 0.0]
    """
    def site(s: Any, ops: list[Any]) -> Any:
        return s.apply(*(jax.lax.stop_gradient(o) if k == s.normalizer else o for k, o in enumerate(ops)))

    return LrpRule("stop_gradient", _gradient_only("stop_gradient"), forms=("gradient",), kinds=("normalizer",),
                   site_rule=site)


def _gradient_only(name: str) -> Callable[..., Any]:
    def rel(*_: Any) -> Any:
        raise GradkitError(f"attribution.lrp: the {name} rule is a gradient-form rule; use it in a composite of "
                           f"form 'gradient' (such as gk.attribution.ATTN_LRP).")

    return rel


def _report_opaque(opaque: list[tuple[str, str]], strict: bool) -> None:
    seen = list(dict.fromkeys(opaque))
    lines = "; ".join(f"{name} at {where}" for name, where in seen[:8])
    more = f"; and {len(seen) - 8} more" if len(seen) > 8 else ""
    msg = (f"attribution.lrp: {len(seen)} custom_jvp/custom_vjp function(s) on the relevance path keep their own "
           f"derivative, their insides unseen, so their products and nonlinearities take no rule: {lines}{more}. "
           f"Call their plain JAX version (e.g. jax.nn.dot_product_attention(..., implementation='xla')) to have "
           f"them explained.")
    if strict:
        raise GradkitError(msg + " (strict=True makes this an error.)")
    warnings.warn(f"[gradkit] {msg} Pass strict=True to make this an error.", GradkitWarning, stacklevel=4)


def one_output(outs: list[Any], tree: Any) -> Any:
    """The model's one output array (its logits); any other structure is a ``[gradkit]`` error."""
    if tree.num_leaves != 1 or tree.num_nodes != 1:
        raise GradkitError(f"attribution.lrp: the model must return one array (its outputs, e.g. logits), "
                           f"got a structure {tree}.")
    return outs[0]


def run_gradient_form(fn: Callable[[Any], Any], x: Any, composite: Mapping[str, LrpRule],
                      target: Any, nan_outside: Callable[[Any, Any, Any], Any],
                      strict: bool = False) -> tuple[Any, Any, Any]:
    """``(relevance shaped like x, the output, its cotangent)`` of the gradient form: ``x ⊙`` the modified VJP.

    A ``custom_jvp``/``custom_vjp`` function on the input's path (other than
    the activations and cuDNN's attention) keeps its own derivative, unseen:
    a :class:`~gradkit.GradkitWarning` names it (``strict=True``: an error).
    """
    leaves = jax.tree_util.tree_leaves(x)
    if not leaves:
        raise GradkitError("attribution.lrp: x has no arrays to attribute to.")
    for leaf in leaves:
        if not jnp.issubdtype(jnp.asarray(leaf).dtype, jnp.inexact):
            raise GradkitError(f"attribution.lrp: x must be floating point to be differentiated, got "
                               f"{jnp.asarray(leaf).dtype}.")
    x = jax.tree_util.tree_map(jnp.asarray, x)

    def handle(site: compat.GSite, ops: list[Any]) -> Any:
        rule = composite.get(site.kind)
        if rule is None or rule.site_rule is None:
            return site.apply(*ops)
        return rule.site_rule(site, ops)

    opaque: list[tuple[str, str]] = []

    def model(v: Any) -> Any:
        outs, tree, _ = compat.run_gradient_form(fn, v, handle, opaque)
        return one_output(outs, tree)

    out, pullback = jax.vjp(model, x)
    if opaque:
        _report_opaque(opaque, strict)
    cot = nan_outside(_cotangent("lrp", out, target), out, target)
    (g,) = pullback(cot)
    r = jax.tree_util.tree_map(lambda a, b: (a * b).astype(a.dtype), x, g)
    return r, out, cot
