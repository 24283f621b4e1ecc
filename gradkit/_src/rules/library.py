"""The rule library: named, parameterised rules that tables and configs refer to.

Two families of op-specific rules, one :class:`OpRule` record each (what it
fixes, how it is built, which ready table ships it):

* ``safe`` (one per singular primitive, :mod:`gradkit._src.rules.safe`): the
  primitive's own derivative, exactly 0 wherever the incoming (co)tangent is
  0, so ``0 * inf`` and ``0 * NaN`` never appear; elsewhere JAX's own
  arithmetic, so gradients that were finite are bit-identical.
* ``stable`` (:mod:`gradkit._src.rules.stable`): the derivative of a
  :mod:`gradkit.stable` function or a numerics kernel, for the primitives
  whose JAX derivative is inaccurate, the :mod:`gradkit.stable` named ops and
  the JAX functions they replace.

Both are JVP rules: forward mode, reverse mode (JAX transposes them) and every
higher order go through them.

And generic rules with parameters: ``straight_through``, ``zero``,
``clamped_log``, ``clamped_sqrt``, ``scale_gradient``, ``reverse_gradient``,
``clip_gradient``.

Every rule built here has ``key = ("gradkit", rule_name, sorted params)``, so
a table's fingerprint does not depend on the process.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import stable as st
from gradkit._src.compat import FUNCTION_PREFIX
from gradkit._src.core.rule import JvpRuleFn, OpView, Rule, Tangents
from gradkit._src.core.table import use_library
from gradkit._src.errors import GradkitError, near_misses
from gradkit._src.rules import broadened as broadened_rules
from gradkit._src.rules import safe as safe_rules
from gradkit._src.rules import stable as stable_rules
from gradkit._src.rules.stable import default_jvp, op_function
from gradkit._src.stable import numerics as _k

# =========================================================================== op rules: one record each

RuleFn = JvpRuleFn
# A library rule's parameter value (a config's number or string), and a rule's resolved parameters.
ParamValue = float | str | None
Params = Mapping[str, ParamValue]


def _number(v: ParamValue) -> float:
    """A number parameter's value (checked by :func:`_check_value`; the defaults are numbers)."""
    if isinstance(v, str) or v is None:
        raise GradkitError(f"internal: a number parameter is {v!r}.")
    return v


def _text(v: ParamValue) -> str:
    """A string parameter's value (checked by :func:`_check_value`)."""
    if not isinstance(v, str):
        raise GradkitError(f"internal: a string parameter is {v!r}.")
    return v


@dataclasses.dataclass(frozen=True)
class OpRule:
    """One op-specific rule of a family (``safe``, ``stable``).

    Attributes:
      op: the entry's name, what ``{rule = "safe", op = ...}`` refers to.
      doc: what the rule computes, one line (``gradkit rules`` shows it).
      build: makes the rule function ``fn(op, tangents)`` (a JVP rule).
      keys: the table keys the ready table ships it under (``"fn:softplus"``
        for JAX's function, the bare name for a primitive or a named op).
      table: the ready table in :mod:`gradkit.tables` that ships it, or ``None``
        (opt-in: build it by name).
    """

    op: str
    doc: str
    build: Callable[[], RuleFn]
    keys: tuple[str, ...]
    table: str | None


def _safe(op: str, doc: str, table: str | None = "SAFE") -> OpRule:
    """A singular primitive's SAFE rule: masked where dataflow finds its paths masked (core/masks.py)."""
    return OpRule(op, doc, functools.partial(safe_rules.safe_rule, op, True), (op,), table)


def _zero_cotangent(op: str, doc: str) -> OpRule:
    """The opt-in rule of earlier SAFE versions: the derivative 0 wherever the incoming (co)tangent is 0."""
    return OpRule(op, doc, functools.partial(safe_rules.safe_rule, op, False), (op,), None)


SAFE_FAMILY: dict[str, OpRule] = {r.op: r for r in [
    _safe("sqrt", "0.5/sqrt(x): inf at 0"),
    _safe("rsqrt", "-0.5 x^-1.5: inf at 0"),
    _safe("cbrt", "x^(-2/3)/3: inf at 0"),
    _safe("log", "1/x: inf at 0"),
    _safe("log1p", "1/(1+x): inf at -1"),
    _safe("acos", "-1/sqrt(1-x^2): inf at ±1"),
    _safe("asin", "1/sqrt(1-x^2): inf at ±1"),
    _safe("acosh", "1/sqrt(x^2-1): inf at 1"),
    _safe("atanh", "1/(1-x^2): inf at ±1"),
    _safe("lgamma", "digamma: poles at 0, -1, ..."),
    _safe("digamma", "trigamma: poles at 0, -1, ..."),
    _safe("erf_inv", "inf at ±1"),
    _safe("integer_pow", "y x^(y-1): inf at 0 for y < 0"),
    _safe("div", "1/y, x/y^2: inf at y = 0"),
    _safe("rem", "x/y: inf at y = 0"),
    _safe("atan2", "(y, -x)/(x^2+y^2): NaN at the origin"),
    _safe("pow", "y x^(y-1): inf/NaN at x = 0; x^y log x: NaN at x = 0"),
    # Opt-in, the answer of earlier SAFE versions: 0 wherever the incoming (co)tangent is 0, a value zero
    # included (a norm of a zero vector: 0, a subgradient). SAFE finds masks by dataflow instead; these
    # ops are where it looks (a selection, a product by a constant zero).
    _zero_cotangent("max", "a 0/1 mask (0.5 at ties): 0 where the incoming (co)tangent is 0"),
    _zero_cotangent("min", "a 0/1 mask (0.5 at ties): 0 where the incoming (co)tangent is 0"),
    _zero_cotangent("square", "2x: 0 where the incoming (co)tangent is 0 (a norm of a zero vector: 0)"),
    _zero_cotangent("reduce_max", "a 0/1 mask over the maximal elements: 0 where the (co)tangent is 0"),
    _zero_cotangent("reduce_min", "a 0/1 mask over the minimal elements: 0 where the (co)tangent is 0"),
    _safe("mul", "the other operand: a NaN/inf value (a fully masked softmax row) on a masked path"),
    # Opt-in (no ready table ships them): a fully masked softmax row (every score -inf) is NaN in the
    # forward pass; a loss that drops it with a `where` is finite, but its gradient multiplies the NaN
    # row by its zero cotangent in `exp` and in the matrix product with V:
    # gk.override(loss, gk.tables.SAFE | {"exp": "safe", "dot_general": "safe"}).
    OpRule("exp", "exp(x): 0 * NaN is 0 where the value is NaN (a fully masked softmax row); an overflow's "
           "0 * inf stays NaN", safe_rules.safe_exp_rule, ("exp",), None),
    OpRule("dot_general", "matmul/einsum: a row that is NaN/inf along the whole contraction (a fully masked "
           "softmax row) times a zero (co)tangent is 0", safe_rules.safe_dot_general_rule, ("dot_general",), None),
]}


def _body(fn: Callable[..., object]) -> Callable[..., object]:
    body: Callable[..., object] = getattr(fn, "__wrapped__", fn)  # a gk.op's undecorated function
    return body


def _stable(op: str, doc: str, fn: Callable[..., object], keywords: tuple[str, ...] = (), *,
            jax_function: bool = False, primitive: bool = False) -> OpRule:
    build = functools.partial(stable_rules.jvp_via, fn, keywords, label=f"gradkit.stable[{op}]")
    if primitive:
        return OpRule(op, doc, build, (op,), "STABLE")
    keys = (op, FUNCTION_PREFIX + op) if jax_function else (op,)
    return OpRule(op, doc, build, keys, "STABLE_FUNCTIONS")


# A user's own op of that name may take just (a,) or (x,): the optional inputs default to None.
_lse, _sm, _lsm = _body(st.logsumexp_op), _body(st.softmax_op), _body(st.log_softmax_op)

STABLE_FAMILY: dict[str, OpRule] = {r.op: r for r in [
    # Primitives whose JAX derivative cancels or overflows.
    _stable("logistic", "the lax.logistic primitive (jax.nn.sigmoid): d = e/(1 + e(2 + e)), e = e^-|x|, "
            "instead of s(1-s)", _k.sigmoid, primitive=True),
    _stable("tanh", "the tanh primitive: d = 4 sigmoid'(2x) instead of (1+t)(1-t)", _k.tanh, primitive=True),
    _stable("expm1", "the expm1 primitive: d = exp(x) instead of expm1(x) + 1", _k.expm1, primitive=True),
    # gradkit.stable named ops (for a user's gk.op of that name) and the JAX functions they replace.
    _stable("log1pexp", "gk.stable.log1pexp: d = sigmoid(x)", _body(st.log1pexp)),
    _stable("softplus", "jax.nn.softplus / gk.op('softplus'): d = sigmoid(x)", _body(st.log1pexp),
            jax_function=True),
    _stable("log_sigmoid", "jax.nn.log_sigmoid / gk.stable.log_sigmoid: d = sigmoid(-x)", _body(st.log_sigmoid),
            jax_function=True),
    _stable("sigmoid", "gk.stable.sigmoid: d = e/(1 + e(2 + e)), e = e^-|x|", _body(st.sigmoid)),
    _stable("silu", "jax.nn.silu / gk.stable.silu: accurate silu'", _body(st.silu), jax_function=True),
    _stable("logaddexp", "jnp.logaddexp / gk.stable.logaddexp: (sigmoid(x-y), sigmoid(y-x)), exact x - y",
            _body(st.logaddexp), jax_function=True),
    _stable("logsumexp", "gk.stable.logsumexp: softmax weights, finite for infinite maxima",
            lambda a, b=None, where=None, **kw: _lse(a, b, where, **kw), ("axis", "keepdims", "return_sign")),
    _stable("softmax", "gk.stable.softmax", lambda x, where=None, **kw: _sm(x, where, **kw), ("axis",)),
    _stable("log_softmax", "gk.stable.log_softmax", lambda x, where=None, **kw: _lsm(x, where, **kw), ("axis",)),
    _stable("xlogy", "jax.scipy.special.xlogy / gk.stable.xlogy: d/dy = 0 where x == 0", _body(st.xlogy),
            jax_function=True),
    _stable("xlog1py", "jax.scipy.special.xlog1py / gk.stable.xlog1py: d/dy = 0 where x == 0", _body(st.xlog1py),
            jax_function=True),
    _stable("log1mexp", "gk.stable.log1mexp: d = 1/expm1(x)", _body(st.log1mexp)),
    _stable("log_sub_exp", "gk.stable.log_sub_exp", _body(st.log_sub_exp)),
    _stable("softplus_inverse", "gk.stable.softplus_inverse", _body(st.softplus_inverse)),
    _stable("log_cosh", "gk.stable.log_cosh: d = tanh(x)", _body(st.log_cosh)),
    _stable("safe_sqrt", "gk.stable.safe_sqrt", _body(st.safe_sqrt)),
    _stable("safe_log", "gk.stable.safe_log", _body(st.safe_log_op), ("eps",)),
    _stable("safe_div", "gk.stable.safe_div", _body(st.safe_div)),
    _stable("safe_arctan2", "gk.stable.safe_arctan2", _body(st.safe_arctan2)),
    _stable("safe_pow", "gk.stable.safe_pow", _body(st.safe_pow)),
    _stable("safe_arccos", "gk.stable.safe_arccos", _body(st.safe_arccos)),
    _stable("safe_arcsin", "gk.stable.safe_arcsin", _body(st.safe_arcsin)),
    _stable("sinc", "jnp.sinc / gk.stable.sinc: exact at every order", _body(st.sinc), jax_function=True),
    _stable("hypot", "jnp.hypot / gk.stable.hypot", _body(st.hypot), jax_function=True),
    _stable("safe_norm", "gk.stable.safe_norm", _body(st.safe_norm_op), ("ord", "axis", "keepdims", "min_norm")),
    _stable("normalize", "gk.stable.normalize", _body(st.normalize_op), ("axis",)),
]}

FAMILIES: dict[str, dict[str, OpRule]] = {"safe": SAFE_FAMILY, "stable": STABLE_FAMILY}

# Degenerate eigh / svd: Lorentzian-broadened 1/gap factors (gradkit/_src/rules/broadened.py). Its own rule,
# `broadened`, with an `eps` parameter; the family records are what `op` may name.
BROADENED_FAMILY: dict[str, OpRule] = {r.op: r for r in [
    OpRule("eigh", "dV = V (F o V^T dA V), F_ij = broadened 1/(w_j - w_i): finite at repeated eigenvalues",
           functools.partial(broadened_rules.eigh_jvp, None, "gradkit.broadened[eigh]"), ("eigh",), "BROADENED"),
    OpRule("svd", "dU, dV with 1/(s_j - s_i) and 1/s broadened, 1/(s_j + s_i) exact: finite at repeated or "
           "zero singular values", functools.partial(broadened_rules.svd_jvp, None, "gradkit.broadened[svd]"), ("svd",),
           "BROADENED"),
]}
FAMILIES["broadened"] = BROADENED_FAMILY


def ready_table(family: str, table: str) -> dict[str, Rule]:
    """The entries of ready table ``table`` made of ``family``'s rules: ``{key: rule}``."""
    return {key: make_rule(family, key, {"op": r.op})
            for r in FAMILIES[family].values() if r.table == table for key in r.keys}


# =========================================================================== generic rules


def _first_input_rule(scale_fn: Callable[[OpView, jax.Array], jax.Array]) -> RuleFn:
    def rule(op: OpView, tangents: Tangents) -> jax.Array | None:
        t = tangents[0] if tangents else None
        if t is None:
            return None
        out = op.outputs[0]
        if np.shape(t) != np.shape(out):
            raise GradkitError(
                f"rule for op '{op.name}' at {op.source} passes the gradient of the op's first input straight "
                f"through, but the input has shape {np.shape(t)} and the output {np.shape(out)}. Use it on "
                "elementwise ops (round, floor, sign, a quantizer).")
        return scale_fn(op, t).astype(jnp.result_type(out))

    return rule


def _straight_through(params: Params, op_name: str) -> Rule:
    return Rule(_first_input_rule(lambda op, t: t), mode="jvp", name="gradkit.straight_through")


def _zero(params: Params, op_name: str) -> Rule:
    return Rule(lambda op, tangents: None, mode="jvp", name="gradkit.zero")


def _clamped(name: str, jvp: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[[Params, str], Rule]:
    """A JVP rule ``jvp(t, max(x, eps))``: the derivative evaluated at a clamped input."""

    def factory(params: Params, op_name: str) -> Rule:
        eps = params.get("eps")

        def rule(op: OpView, tangents: Tangents) -> jax.Array | None:
            x, t = op.inputs[0], tangents[0]
            if t is None:
                return None
            dtype = jnp.result_type(x)
            e = float(jnp.finfo(dtype).tiny) if eps is None else _number(eps)
            return jvp(t, jnp.maximum(x, jnp.asarray(e, dtype)))

        return Rule(rule, mode="jvp", name=f"gradkit.{name}")

    return factory


_clamped_log = _clamped("clamped_log", lambda t, x: t / x)
_clamped_sqrt = _clamped("clamped_sqrt", lambda t, x: t * (0.5 / jnp.sqrt(x)))


def _scale(params: Params, op_name: str, sign: float = 1.0, name: str = "scale_gradient") -> Rule:
    s = sign * _number(params["scale"])

    def rule(op: OpView, tangents: Tangents) -> object:
        out = default_jvp(op, tangents, f"gradkit.{name}")
        return jax.tree_util.tree_map(lambda v: v * jnp.asarray(s, jnp.result_type(v)), out)

    return Rule(rule, mode="jvp", name=f"gradkit.{name}")


def _reverse(params: Params, op_name: str) -> Rule:
    return _scale({"scale": params.get("scale", 1.0)}, op_name, -1.0, "reverse_gradient")


def _clip(params: Params, op_name: str) -> Rule:
    lo, hi = _number(params.get("lo", -math.inf)), _number(params.get("hi", math.inf))

    def rule(op: OpView, g: object) -> tuple[jax.Array | None, ...]:
        _, vjp = jax.vjp(op_function(op, "gradkit.clip_gradient"), *op.inputs)
        cts = vjp(g)
        return tuple(None if c is None or not jnp.issubdtype(c.dtype, jnp.inexact)
                     else jnp.clip(c, lo, hi).astype(c.dtype) for c in cts)

    return Rule(rule, mode="vjp", name="gradkit.clip_gradient")


def _family_factory(family: str) -> Callable[[Params, str], Rule]:
    def factory(params: Params, op_name: str) -> Rule:
        target = _text(params["op"])
        return Rule(FAMILIES[family][target].build(), mode="jvp", name=f"gradkit.{family}[{target}]")

    return factory


# =========================================================================== registry

class _Required:
    """The default of a required parameter."""


_REQUIRED = _Required()


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a library rule."""

    name: str
    kind: Literal["float", "str"]
    doc: str
    default: ParamValue | _Required = _REQUIRED
    check: Callable[[float], str | None] | None = None  # a number's check: returns an error message or None

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclasses.dataclass(frozen=True)
class LibraryRule:
    """A named rule that a table or a config can refer to."""

    name: str
    doc: str
    params: tuple[Param, ...]
    factory: Callable[[Params, str], Rule]
    op_dependent: bool = False  # its ``op`` parameter defaults to the table entry's name (less "fn:")

    def signature(self) -> str:
        parts = []
        for p in self.params:
            if self.op_dependent and p.name == "op":
                parts.append("op: str = <entry name>")
            elif p.required:
                parts.append(f"{p.name}: {p.kind}")
            elif p.default is None:
                parts.append(f"{p.name}: {p.kind} (optional)")
            else:
                parts.append(f"{p.name}: {p.kind} = {p.default!r}")
        return f"{self.name}({', '.join(parts)})"


def _positive(v: float) -> str | None:
    return None if 0 < v < math.inf else "must be a finite number > 0"


def _finite(v: float) -> str | None:
    return None if math.isfinite(v) else "must be finite"


LIBRARY: dict[str, LibraryRule] = {r.name: r for r in [
    LibraryRule("safe", "The primitive's own derivative, but 0 wherever the incoming (co)tangent is 0 "
                "(no 0*inf NaNs); all modes.",
                (Param("op", "str", "which safe rule to use", default=None),), _family_factory("safe"),
                op_dependent=True),
    LibraryRule("stable", "The stable derivative of a primitive, a gradkit.stable op or a JAX function it "
                "replaces; all modes.",
                (Param("op", "str", "which stable rule to use", default=None),), _family_factory("stable"),
                op_dependent=True),
    LibraryRule("straight_through", "Identity gradient: the op's first input gets the output's tangent.", (),
                _straight_through),
    LibraryRule("zero", "No gradient through the op (stop_gradient).", (), _zero),
    LibraryRule("clamped_log", "d log(x) = 1 / max(x, eps): finite at 0.",
                (Param("eps", "float", "the clamp (default: smallest normal number of the dtype)", default=None,
                       check=_positive),), _clamped_log),
    LibraryRule("clamped_sqrt", "d sqrt(x) = 0.5 / sqrt(max(x, eps)): finite at 0.",
                (Param("eps", "float", "the clamp (default: smallest normal number of the dtype)", default=None,
                       check=_positive),), _clamped_sqrt),
    LibraryRule("scale_gradient", "The op's own derivative times `scale` (primitives and jit-ed functions).",
                (Param("scale", "float", "the factor", check=_finite),), _scale),
    LibraryRule("reverse_gradient", "The op's own derivative times -`scale` (gradient reversal).",
                (Param("scale", "float", "the factor", default=1.0, check=_finite),), _reverse),
    LibraryRule("clip_gradient", "The op's own VJP, clipped elementwise to [lo, hi] (reverse mode only).",
                (Param("lo", "float", "lower bound", default=-math.inf),
                 Param("hi", "float", "upper bound", default=math.inf)), _clip),
]}


def _broadened(params: Params, op_name: str) -> Rule:
    target = _text(params["op"])
    label = f"gradkit.broadened[{target}]"
    eps = params.get("eps")
    return Rule(broadened_rules.BUILDERS[target](None if eps is None else _number(eps), label), mode="jvp",
                name=label)


LIBRARY["broadened"] = LibraryRule(
    "broadened", "eigh / svd derivatives with Lorentzian-broadened 1/gap factors, x/(x^2 + eps scale^2): finite "
    "at repeated eigenvalues or singular values; all modes.",
    (Param("op", "str", "which broadened rule to use (eigh, svd)", default=None),
     Param("eps", "float", "the broadening, relative to the spectrum's scale squared (default: 1e-12 in "
           "float64, 1e-9 in float32)", default=None, check=_positive)), _broadened, op_dependent=True)


def _check_value(rule: LibraryRule, p: Param, value: object, where: str) -> ParamValue:
    checked: ParamValue
    if p.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GradkitError(
                f"{where}: parameter `{p.name}` of rule '{rule.name}' must be a number, got {value!r} "
                f"({type(value).__name__}). {rule.signature()}: {p.doc}.")
        checked = number = float(value)
        if math.isnan(number):
            raise GradkitError(f"{where}: parameter `{p.name}` of rule '{rule.name}' is NaN. {rule.signature()}.")
    else:  # "str"
        if not isinstance(value, str):
            raise GradkitError(
                f"{where}: parameter `{p.name}` of rule '{rule.name}' must be a string, got {value!r}. "
                f"{rule.signature()}.")
        checked = value
    if p.check is not None:
        msg = p.check(_number(checked))  # the checks are of numbers
        if msg:
            raise GradkitError(f"{where}: parameter `{p.name}` of rule '{rule.name}' {msg}, got {checked!r}. "
                               f"{rule.signature()}: {p.doc}.")
    return checked


def rules_for(op_name: str, params: Mapping[str, object] | None = None) -> list[str]:
    """The library rules a table entry for ``op_name`` may name: what a misspelt rule name is matched against.

    A rule with a family (``safe``, ``stable``, ``broadened``) serves the ops
    its family covers: the entry's op (less ``fn:``), or the ``op`` parameter
    the entry gives; every other library rule serves any op. An entry that
    gives parameters names only a rule that has them.
    """
    params = params or {}
    target = params.get("op", op_name.removeprefix(FUNCTION_PREFIX))
    return [name for name, rule in LIBRARY.items()
            if (not rule.op_dependent or (isinstance(target, str) and target in FAMILIES[name]))
            and set(params) <= {p.name for p in rule.params}]


def make_rule(rule_name: str, op_name: str, params: Mapping[str, object] | None = None, *,
              where: str | None = None) -> Rule:
    """Builds library rule ``rule_name`` for table entry ``op_name`` with ``params``.

    Raises GradkitError, listing what is valid, for an unknown rule, an unknown
    or missing parameter, or a bad value. Nothing is imported or evaluated:
    names are looked up in a fixed registry.
    """
    where = where or f"table entry '{op_name}'"
    params = dict(params or {})
    if not isinstance(rule_name, str) or rule_name not in LIBRARY:
        close = near_misses(str(rule_name), rules_for(op_name, params)) if isinstance(rule_name, str) else []
        hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
        raise GradkitError(
            f"{where}: unknown rule {rule_name!r}{hint}. Valid rules: "
            + "; ".join(r.signature() for r in LIBRARY.values()) + ".")
    rule = LIBRARY[rule_name]
    known = {p.name: p for p in rule.params}
    unknown = sorted(set(params) - set(known))
    if unknown:
        valid = ", ".join(f"`{p}`" for p in known) or "none"
        raise GradkitError(
            f"{where}: rule '{rule_name}' has no parameter {', '.join(f'`{u}`' for u in unknown)}. "
            f"Valid parameters: {valid}. {rule.signature()}.")
    resolved: dict[str, ParamValue] = {}
    for p in rule.params:
        if p.name in params:
            resolved[p.name] = _check_value(rule, p, params[p.name], where)
        elif rule.op_dependent and p.name == "op":
            resolved["op"] = op_name.removeprefix(FUNCTION_PREFIX)
        elif p.required:
            raise GradkitError(
                f"{where}: rule '{rule_name}' needs parameter `{p.name}` ({p.doc}). {rule.signature()}.")
        elif p.default is not None and not isinstance(p.default, _Required):
            resolved[p.name] = p.default
    if rule_name == "clip_gradient" and _number(resolved["lo"]) > _number(resolved["hi"]):
        raise GradkitError(f"{where}: rule 'clip_gradient' needs lo <= hi, got lo={resolved['lo']}, "
                           f"hi={resolved['hi']}.")
    if rule.op_dependent:
        valid_ops = FAMILIES[rule_name]
        if resolved["op"] not in valid_ops:
            close = near_misses(_text(resolved["op"]), valid_ops)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise GradkitError(
                f"{where}: rule '{rule_name}' has no entry for op {resolved['op']!r}{hint}. "
                f"Ops it covers: {', '.join(sorted(valid_ops))}. To use one of them for another op, "
                f"write {{rule = \"{rule_name}\", op = \"<one of these>\"}}.")
    built = rule.factory(resolved, op_name)
    key = ("gradkit", rule_name, tuple(sorted(resolved.items(), key=lambda kv: kv[0])))  # one entry per name

    return dataclasses.replace(built, key=key)


use_library(LIBRARY, make_rule)
