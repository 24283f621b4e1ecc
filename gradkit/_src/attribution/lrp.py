"""Layer-wise Relevance Propagation on unmodified models: :func:`lrp` and Zennit's composites.

A **composite** maps a layer kind to the :class:`~.lrp_rules.LrpRule` that
layer passes relevance back by. Kinds (found by dataflow, see
``compat/layers.py``): ``"dense"``, ``"conv"``, ``"avg_pool"``,
``"max_pool"``, ``"activation"``, ``"sum"`` (an add of two values that both
depend on the input: a residual connection), and two that name one layer:
``"first"`` (the first dense or conv layer, in program order) and
``"first_conv"`` (the first conv layer, when ``"first"`` did not take it).
:func:`lrp` traces the model once, then runs its program with each layer
wrapped in a ``jax.custom_vjp`` whose backward pass is its rule, and pulls
the one-hot (or given) output cotangent back to the input.

A composite also has a **relevance form** (:attr:`Composite.form`). Zennit's
composites use ``"relevance"``: the cotangent carried backward *is* the
relevance, so the one-hot seed gives ``ΣR ≈ 1`` (less what biases and
stabilizers absorb), and an op that keeps its gradient must not copy
relevance (a residual add would hand all of it to both branches: hence the
``"sum"`` kind). Structural ops (reshapes, the flatten, slices) keep their
gradient, as in Zennit.

The ``"gradient"`` form (:data:`ATTN_LRP`, :data:`CP_LRP`; ``attn_lrp.py``)
carries a modified gradient instead, and relevance is the input times it:
every op keeps its gradient except the sites that form's kinds name
(``"activation"``, ``"product"``, ``"normalizer"``).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from gradkit._src import compat
from gradkit._src.attribution import attn_lrp
from gradkit._src.attribution import lrp_rules as rules
from gradkit._src.attribution.attribution import _cotangent, as_function, nnx_trace_hint
from gradkit._src.attribution.lrp_rules import LrpRule
from gradkit._src.checks.describe import short_path
from gradkit._src.errors import GradkitError, GradkitWarning

__all__ = ["ATTN_LRP", "CP_LRP", "EPSILON_ALPHA2_BETA1", "EPSILON_ALPHA2_BETA1_FLAT", "EPSILON_GAMMA_BOX",
           "EPSILON_PLUS", "EPSILON_PLUS_FLAT", "FORMS", "KINDS", "STRUCTURAL_OPS", "Composite", "LrpReport", "lrp"]

#: the keys a composite may have.
KINDS: tuple[str, ...] = (*compat.LAYER_KINDS, "first", "first_conv", "product", "normalizer", "softmax")
#: the relevance forms a composite may have (``"relevance"``: the cotangent is the relevance, as in Zennit;
#: ``"gradient"``: the cotangent is a modified gradient and relevance is the input times it, as in LXT).
FORMS: tuple[str, ...] = ("relevance", "gradient")
#: the ops that move, copy or select values: on the relevance path they keep their gradient, and need no rule.
STRUCTURAL_OPS: frozenset[str] = compat.STRUCTURAL


class Composite(Mapping[str, LrpRule]):
    """An immutable mapping from layer kind to LRP rule; ``|`` merges (the right side wins).

    ``form`` is how relevance travels backward under this composite (one of
    :data:`FORMS`): ``"relevance"`` (Zennit's composites) carries the
    relevance itself as the cotangent, so the one-hot seed of ``target`` gives
    ``ΣR ≈ 1``; ``"gradient"`` (:data:`ATTN_LRP`, :data:`CP_LRP`) carries a
    modified gradient, relevance is the input times it, so ``ΣR ≈`` the
    target logit. A merge keeps the left side's form.

    Examples:
      >>> import gradkit as gk
      >>> c = gk.attribution.EPSILON_PLUS | {"dense": gk.attribution.epsilon(0.25)}
      >>> c["dense"], c["conv"], c.form
      (epsilon(eps=0.25), zplus(stabilizer=1e-06), 'relevance')
    """

    __slots__ = ("_rules", "form")

    def __init__(self, rules: Mapping[str, LrpRule] | None = None, /, *, form: str = "relevance",
                 **kw: LrpRule) -> None:
        if form not in FORMS:
            raise GradkitError(f"attribution.Composite: unknown relevance form {form!r}; the forms are "
                               f"{', '.join(map(repr, FORMS))}.")
        self.form: str = form
        merged = {**(rules or {}), **kw}
        for kind, rule in merged.items():
            if kind not in KINDS:
                raise GradkitError(f"attribution.Composite: unknown layer kind {kind!r}; the kinds are "
                                   f"{', '.join(map(repr, KINDS))}.")
            if not isinstance(rule, LrpRule):
                raise GradkitError(f"attribution.Composite: the rule for {kind!r} must be an LRP rule such as "
                                   f"gk.attribution.epsilon(1e-6), got {type(rule).__name__} {rule!r}.")
            _check_fits(kind, rule, form)
        self._rules: dict[str, LrpRule] = merged

    def __getitem__(self, kind: str) -> LrpRule:
        return self._rules[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def __or__(self, other: Mapping[str, LrpRule]) -> Composite:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Composite({**self._rules, **other}, form=self.form)

    def __ror__(self, other: Mapping[str, LrpRule]) -> Composite:
        if not isinstance(other, Mapping):
            return NotImplemented
        return Composite({**other, **self._rules}, form=getattr(other, "form", self.form))

    def __repr__(self) -> str:
        return "Composite({" + ", ".join(f"{k!r}: {v!r}" for k, v in self._rules.items()) + "})"

    def __hash__(self) -> int:  # a zbox's bounds may be arrays
        return hash((self.form, tuple(sorted((k, repr(v)) for k, v in self._rules.items()))))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, Mapping) and dict(self.items()) == dict(other.items())
                and getattr(other, "form", self.form) == self.form)


_GRADIENT_SUGGESTED = {"activation": "identity() or gradient_rule()", "product": "uniform(), hold_gate() or "
                       "gradient_rule()", "normalizer": "stop_gradient() or gradient_rule()"}


def _check_fits(kind: str, rule: LrpRule, form: str) -> None:
    if form not in rule.forms:
        other = "gradient" if form == "relevance" else "relevance"
        fix = (f"in that form the {kind!r} kind takes "
               f"{_GRADIENT_SUGGESTED.get(kind, 'gradient_rule()')}" if form == "gradient"
               else f"use it in a composite of form {other!r} such as gk.attribution.ATTN_LRP")
        raise GradkitError(f"attribution.Composite: the {rule!r} rule for {kind!r} does not fit the {form!r} "
                           f"form of this composite (it works in the {other!r} form); {fix}.")
    if form == "gradient" and rule.kinds and kind not in rule.kinds:
        raise GradkitError(f"attribution.Composite: the {rule!r} rule is for {' and '.join(map(repr, rule.kinds))} "
                           f"sites, not {kind!r}; in the gradient form {kind!r} takes "
                           f"{_GRADIENT_SUGGESTED.get(kind, 'gradient_rule()')}.")
    if form == "gradient" and kind not in attn_lrp.GRADIENT_KINDS and not rule.plain:
        raise GradkitError(f"attribution.Composite: the gradient form has no {kind!r} sites; its kinds are "
                           f"{', '.join(map(repr, attn_lrp.GRADIENT_KINDS))}.")


def _base(stabilizer: float) -> dict[str, LrpRule]:
    # Zennit's layer_map_base: activations pass relevance through, average pooling and the residual Sum (its
    # ResNetCanonizer) are Norm; max pooling has no rule there, so it keeps its gradient.
    return {"activation": rules.pass_through(), "avg_pool": rules.norm(stabilizer), "max_pool": rules.gradient_rule(),
            "sum": rules.norm(stabilizer)}


#: Zennit's ``EpsilonPlus``: z⁺ for conv layers, ε for dense layers.
EPSILON_PLUS: Composite = Composite(_base(1e-6) | {"conv": rules.zplus(1e-6), "dense": rules.epsilon(1e-6)})
#: Zennit's ``EpsilonPlusFlat``: :data:`EPSILON_PLUS` with the flat rule for the first (dense or conv) layer.
EPSILON_PLUS_FLAT: Composite = EPSILON_PLUS | {"first": rules.flat(1e-6)}
#: Zennit's ``EpsilonAlpha2Beta1``: α=2, β=1 for conv layers, ε for dense layers.
EPSILON_ALPHA2_BETA1: Composite = Composite(_base(1e-6) | {"conv": rules.alpha_beta(2, 1, 1e-6),
                                                            "dense": rules.epsilon(1e-6)})
#: Zennit's ``EpsilonAlpha2Beta1Flat``: :data:`EPSILON_ALPHA2_BETA1` with the flat rule for the first layer.
EPSILON_ALPHA2_BETA1_FLAT: Composite = EPSILON_ALPHA2_BETA1 | {"first": rules.flat(1e-6)}


def EPSILON_GAMMA_BOX(low: Any, high: Any, *, epsilon: float = 1e-6, gamma: float = 0.25,
                      stabilizer: float = 1e-6) -> Composite:
    """Zennit's ``EpsilonGammaBox``: z^B (``low <= x <= high``) for the first conv layer, γ for the other conv
    layers, ε for dense layers.

    Examples:
      >>> import gradkit as gk
      >>> gk.attribution.EPSILON_GAMMA_BOX(-1.0, 1.0)["first_conv"]
      zbox(low=-1.0, high=1.0, stabilizer=1e-06)
    """
    return Composite(_base(stabilizer) | {"conv": rules.gamma(gamma, stabilizer), "dense": rules.epsilon(epsilon),
                                          "first_conv": rules.zbox(low, high, stabilizer)})


_ATTN = {"activation": attn_lrp.identity(1e-10), "normalizer": attn_lrp.stop_gradient(),
         "softmax": rules.gradient_rule(), "dense": rules.gradient_rule(), "sum": rules.gradient_rule()}
#: AttnLRP (Achtibat et al. 2024) as LXT 2.1's efficient mode, in the ``"gradient"`` form: linear layers, residual
#: sums, softmax, masks and RoPE keep their gradient (ε = 0), a product of two input-dependent values is
#: :func:`~gradkit.attribution.uniform`, an activation :func:`~gradkit.attribution.identity` (ε = 1e-10), and the
#: statistic of a LayerNorm/RMSNorm constant (:func:`~gradkit.attribution.stop_gradient`).
ATTN_LRP: Composite = Composite(_ATTN | {"product": attn_lrp.uniform()}, form="gradient")
#: CP-LRP (Ali et al. 2022) as LXT 2.1's ``cp_LRP`` maps: :data:`ATTN_LRP` with the attention weights and a gated
#: MLP's activated gate constant (:func:`~gradkit.attribution.hold_gate`): relevance flows through ``v`` and ``up``.
CP_LRP: Composite = Composite(_ATTN | {"product": attn_lrp.hold_gate()}, form="gradient")

_SUGGESTED = {"dense": "epsilon(1e-6)", "conv": "zplus()", "avg_pool": "norm()", "activation": "pass_through()",
              "max_pool": "gradient_rule()", "sum": "norm()"}


def _rule_for(composite: Mapping[str, LrpRule], layer: compat.Layer, seen: dict[str, bool]) -> LrpRule:
    kind = layer.kind
    keys: list[str] = []
    if kind in ("dense", "conv"):
        if not seen["first"]:
            seen["first"] = True
            keys.append("first")
        if kind == "conv" and not seen["first_conv"]:
            if "first" not in keys or "first" not in composite:
                seen["first_conv"] = True
                keys.append("first_conv")
    keys.append(kind)
    for key in keys:
        if key in composite:
            return composite[key]
    where = f" at {layer.source}" if layer.source else ""
    raise GradkitError(
        f"attribution.lrp: the composite has no rule for {kind!r} layers, and the model has one ({layer.name}"
        f"{where}); add one, e.g. composite | {{{kind!r}: gk.attribution.{_SUGGESTED.get(kind, 'gradient_rule()')}}}.")


def _apply(rule: LrpRule, layer: compat.Layer, x: jax.Array) -> jax.Array:
    if rule.plain:
        return layer.apply(x, *layer.params)
    if rule.needs_weight and layer.kind not in ("dense", "conv"):
        raise GradkitError(f"attribution.lrp: the {rule.name} rule modifies weights, but {layer.kind!r} layers "
                           f"({layer.name}) have none; give that kind a rule such as gk.attribution.norm() or "
                           f"gk.attribution.gradient_rule().")
    params = layer.params

    @jax.custom_vjp
    def unit(v: jax.Array, *ps: Any) -> jax.Array:
        return layer.apply(v, *ps)

    def fwd(v: jax.Array, *ps: Any) -> tuple[jax.Array, tuple[Any, ...]]:
        return layer.apply(v, *ps), (v, ps)

    def bwd(res: tuple[Any, ...], r: jax.Array) -> tuple[Any, ...]:
        v, ps = res
        bound = compat.Layer(kind=layer.kind, name=layer.name, index=layer.index, params=ps, apply=layer.apply,
                             source=layer.source, nonnegative_input=layer.nonnegative_input)
        rin = rule.relevance(bound, v, r)
        if jnp.shape(rin) != jnp.shape(v):
            raise GradkitError(f"attribution.lrp: the {rule.name} rule passes relevance on unchanged, so it "
                               f"needs a layer whose input and output have one shape; {layer.kind!r} layer "
                               f"{layer.name} maps {jnp.shape(v)} to {jnp.shape(r)}.")
        return (rin.astype(v.dtype), *(jnp.zeros_like(p) for p in ps))

    unit.defvjp(fwd, bwd)
    return unit(x, *params)


class LrpReport(NamedTuple):
    """What :func:`lrp` with ``check=True`` reports, per example (arrays over the batch axis, or scalars).

    ``total_relevance``: ``ΣR`` over each example's input. ``seed``: the
    relevance the output started with (``Σ`` of the output cotangent: 1 for a
    class index); in the ``"relevance"`` form a conservative model gives
    ``total_relevance ≈ seed``, less what biases and stabilizers absorb.
    ``explained_output``: the explained output (the output times the
    cotangent, summed: the target logit).
    """

    total_relevance: jax.Array
    seed: jax.Array
    explained_output: jax.Array


def _per_example(a: jax.Array, batched: bool) -> jax.Array:
    return jnp.sum(a, axis=tuple(range(1, a.ndim))) if batched else jnp.sum(a)


def _nan_outside(cot: jax.Array, out: jax.Array, target: Any) -> jax.Array:
    """A traced class index outside the classes gives a NaN cotangent (so NaN maps), not a zero one."""
    if not isinstance(target, compat.Tracer) or not jnp.issubdtype(target.dtype, jnp.integer) or not out.shape:
        return cot
    t = jnp.asarray(target)
    bad = (t < 0) | (t >= out.shape[-1])
    return jnp.where(jnp.broadcast_to(bad[..., None], cot.shape), jnp.asarray(jnp.nan, cot.dtype), cot)


def _shown(where: str) -> str:
    """``file:line (function)`` as a reader sees it: a notebook cell, not its temporary file (``short_path``)."""
    m = re.fullmatch(r"(.+):(\d+) \((.*)\)", where)
    return f"{short_path(m[1])}:{m[2]} ({m[3]})" if m else where


def _report_unruled(unruled: list[tuple[str, str, str]], strict: bool) -> None:
    seen = list(dict.fromkeys((op, _shown(where), hint) for op, where, hint in unruled))
    lines = "; ".join(f"{op} at {where} ({hint})" for op, where, hint in seen[:8])
    more = f"; and {len(seen) - 8} more" if len(seen) > 8 else ""
    msg = (f"attribution.lrp: {len(seen)} op(s) on the relevance path have no LRP rule and keep their gradient, "
           f"which in the relevance form does not conserve relevance: {lines}{more}. Structural ops "
           f"(gk.attribution.STRUCTURAL_OPS) need none; the composite's kinds are {', '.join(KINDS)}.")
    if strict:
        raise GradkitError(msg + " (strict=True makes this an error.)")
    warnings.warn(f"[gradkit] {msg} Pass strict=True to make this an error.", GradkitWarning, stacklevel=3)


def lrp(fn: Callable[[jax.Array], jax.Array], x: Any, composite: Mapping[str, LrpRule], *,
        target: Any = None, canonize: bool = True, strict: bool = False,
        check: bool = False) -> Any:
    """Layer-wise Relevance Propagation: how much of the target output each input element is responsible for.

    ``fn`` is any model of ``x`` — plain JAX, Flax linen, Flax NNX, Equinox —
    unmodified: its dense and conv layers (the ``dot_general`` or
    ``conv_general_dilated`` with a weight that does not depend on ``x``, and
    the bias added to it), pooling (``reduce_window``, and a ``sum`` or
    ``mean`` whose input has no other use, with its division or product by a
    constant in either order), activations and residual sums (an ``add`` of
    two values that both depend on ``x``) are found in its traced program,
    also inside ``jit``, ``checkpoint``/``remat``, ``cond``/``switch`` and
    ``scan`` bodies, and each passes relevance back by the composite's rule
    for its kind. Runs under ``jit`` and ``vmap``. The result is not
    differentiable with respect to the model's parameters.

    **Relevance form.** Zennit's composites (all the shipped ones) use the
    ``"relevance"`` form: the cotangent carried backward is the relevance,
    the output starts with the one-hot of ``target``, so ``ΣR ≈ 1`` per
    example (less what biases and stabilizers absorb; see ``check``).

    **Gradient form** (:data:`ATTN_LRP`, :data:`CP_LRP`: AttnLRP and CP-LRP
    for transformers, as LXT's efficient mode): the cotangent carried
    backward is a modified gradient and the relevance is ``x`` times it, so
    ``ΣR ≈`` the target logit. Every op keeps its gradient except the sites
    found by dataflow: a product of two values that depend on ``x``
    (``"product"``: ``q·kᵀ``, ``A·v``, a gated MLP), an element-wise
    nonlinearity (``"activation"``, also written out as ``x*sigmoid(x)``) and
    the statistic of a LayerNorm or RMSNorm (``"normalizer"``). ``x`` may be
    a pytree of arrays (token and position embeddings); the relevance has its
    structure. ``canonize`` does not apply; a ``custom_jvp``/``custom_vjp``
    function on the relevance path (other than an activation and cuDNN's
    attention) keeps its own derivative, with a warning (``strict=True``: an
    error).

    **Canonization** (``canonize=True``, Zennit's canonizers, found by
    dataflow): a per-channel affine map with constant operands right after a
    dense or conv layer — BatchNorm in eval mode (Flax linen, NNX, Equinox,
    or written out) — is folded into the layer before its rule applies:
    ``W' = W·s``, ``b' = (b − μ)·s + β`` with ``s = γ/√(var + eps)``; every
    rule sees ``W'`` and ``b'``. A residual add is the ``"sum"`` kind (Norm,
    the proportional split, in every shipped composite; ``composite |
    {"sum": gradient_rule()}`` copies the relevance to both branches, as
    without a canonizer). A normalization with batch statistics (BatchNorm in
    training mode) is an error; one over features (LayerNorm) is left as it
    is and keeps its gradient.

    **No silent relevance.** An op on the relevance path that is neither a
    layer of some kind nor structural (:data:`STRUCTURAL_OPS`: reshape,
    transpose, squeeze, expand_dims, broadcast_in_dim, slice, dynamic_slice,
    gather, concatenate, pad with 0, rev, convert_element_type, copy,
    reduce_precision, optimization_barrier, sharding_constraint) keeps its
    gradient, with a :class:`~gradkit.GradkitWarning` naming it, its source
    line and why; ``strict=True`` makes that an error.

    Args:
      fn: the model as a function of its input, returning one array whose
        last axis holds the classes (or a scalar).
      x: the input, e.g. a batch of images; in the gradient form also a
        pytree of arrays.
      composite: a :class:`Composite` (e.g. :data:`ATTN_LRP` for a
        transformer) or any mapping from layer kind
        (``"dense"``, ``"conv"``, ``"avg_pool"``, ``"max_pool"``,
        ``"activation"``, ``"sum"``, ``"first"``, ``"first_conv"``) to rule,
        e.g. :data:`EPSILON_PLUS_FLAT` or ``EPSILON_PLUS | {"dense": epsilon(0.1)}``.
      target: which output to explain, as in :func:`gradient`: ``None`` for
        each row's largest output, a class index, one per row, or an output
        cotangent (the relevance the output starts with). A class index out
        of range is an error; under ``jit`` (where it cannot be checked) its
        rows' maps are NaN.
      canonize: fold BatchNorm-like affine maps into the layer before them.
      strict: make an op on the relevance path without a rule an error.
      check: also return an :class:`LrpReport` (``ΣR``, the seed and the
        explained output per example).

    Returns:
      The relevance, shaped like ``x``; with ``check=True``, ``(relevance, report)``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> w1 = jnp.array([[1.0, -1.0], [2.0, 1.0]]); w2 = jnp.array([[1.0], [1.0]])
      >>> f = lambda x: jax.nn.relu(x @ w1) @ w2
      >>> r = gk.attribution.lrp(f, jnp.array([1.0, 1.0]), gk.attribution.EPSILON_PLUS)
      >>> [round(v, 4) for v in r.tolist()]
      [0.3333, 0.6667]
      >>> r, report = gk.attribution.lrp(f, jnp.array([1.0, 1.0]), gk.attribution.EPSILON_PLUS, check=True)
      >>> round(float(report.total_relevance), 4), float(report.seed), float(report.explained_output)
      (1.0, 1.0, 3.0)
    """
    if not callable(fn):
        raise GradkitError(f"attribution.lrp: expected the model as a function of x, got {type(fn).__name__}; "
                           f"write e.g. lambda x: model.apply(params, x).")
    if not isinstance(composite, Mapping):
        raise GradkitError(f"attribution.lrp: composite must map layer kinds to rules (e.g. "
                           f"gk.attribution.EPSILON_PLUS), got {type(composite).__name__}.")
    composite = composite if isinstance(composite, Composite) else Composite(composite)
    try:
        return _lrp(fn, x, composite, target, bool(canonize), bool(strict), bool(check))
    except ValueError as e:
        hint = nnx_trace_hint("lrp", e)
        if hint is None:
            raise
        raise hint from e


def _lrp(fn: Callable[[jax.Array], jax.Array], x: Any, composite: Composite, target: Any, canonize: bool,
         strict: bool, check: bool) -> Any:
    if composite.form == "gradient":
        fn = as_function("lrp", fn, x)
        r, out, cot = attn_lrp.run_gradient_form(fn, x, composite, target, _nan_outside, bool(strict))
        if not check:
            return r
        leaf = jax.tree_util.tree_leaves(x)[0]
        batched = out.ndim >= 2 and jnp.ndim(leaf) >= 1 and jnp.shape(leaf)[0] == out.shape[0]
        parts = [_per_example(a, batched) for a in jax.tree_util.tree_leaves(r)]
        total = parts[0] + sum(parts[1:], jnp.zeros_like(parts[0]))
        return r, LrpReport(total, _per_example(cot, batched), _per_example(cot * out, batched))
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        raise GradkitError(f"attribution.lrp: x must be floating point to be differentiated, got {x.dtype}.")
    fn = as_function("lrp", fn, x)
    unruled: list[tuple[str, str, str]] = []

    def model(v: jax.Array) -> Any:
        seen = {"first": False, "first_conv": False}

        def handle(layer: compat.Layer, xin: jax.Array) -> jax.Array:
            return _apply(_rule_for(composite, layer, seen), layer, xin)

        outs, tree = compat.run_layers(fn, v, handle, canonize=bool(canonize), unruled=unruled)
        return attn_lrp.one_output(outs, tree)

    out, pullback = jax.vjp(model, x)
    if unruled:
        _report_unruled(unruled, strict)
    cot = _nan_outside(_cotangent("lrp", out, target), out, target)
    (r,) = pullback(cot)
    if not check:
        return r
    batched = out.ndim >= 2 and x.ndim >= 1 and x.shape[0] == out.shape[0]
    report = LrpReport(_per_example(r, batched), _per_example(cot, batched), _per_example(cot * out, batched))
    return r, report
