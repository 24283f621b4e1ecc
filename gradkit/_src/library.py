"""The rule library: named, parameterised rules that tables and configs refer to.

Three families:

* ``safe`` rules (one per singular primitive): the primitive's own VJP, but
  exactly 0 wherever the incoming cotangent is 0, computed at a safe point so
  ``0 * inf`` and ``0 * NaN`` never appear. Where the cotangent is nonzero the
  formula is JAX's own, operation for operation, so gradients that were
  finite are bit-identical.
* ``stable`` rules (one per :mod:`gradkit.stable` op, plus JAX functions and
  primitives whose derivative is inaccurate): the stable derivative, as a JVP
  rule, so forward mode and higher orders work through it.
* generic rules with parameters: ``straight_through``, ``zero``,
  ``clamped_log``, ``clamped_sqrt``, ``scale_gradient``, ``reverse_gradient``,
  ``clip_gradient``.

Every rule built here has ``key = ("gradkit", rule_name, sorted params)``, so
a table's fingerprint does not depend on the process.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradkit._src import compat
from gradkit._src import numerics as _k
from gradkit._src.errors import GradkitError, near_misses
from gradkit._src.rule import OpView, Rule

# =========================================================================== safe (VJP)


def _unbroadcast(ct: Any, like: Any) -> Any:
    """Sums ``ct`` down to ``like``'s shape (for rank-0 operands of binary primitives)."""
    shape = np.shape(like)
    if np.shape(ct) == shape:
        return ct
    extra = len(np.shape(ct)) - len(shape)
    ct = jnp.sum(ct, axis=tuple(range(extra))) if extra > 0 else ct
    axes = tuple(i for i, (a, b) in enumerate(zip(np.shape(ct), shape)) if b == 1 and a != 1)
    return jnp.sum(ct, axis=axes, keepdims=True) if axes else ct


def _guard(z: jax.Array, x: jax.Array, value: float = 1.0) -> jax.Array:
    """``x`` where the cotangent is nonzero, ``value`` (a harmless point) where it is 0."""
    return jnp.where(z, jnp.asarray(value, x.dtype), x)


def _mask(z: jax.Array, ct: jax.Array) -> jax.Array:
    return jnp.where(z, jnp.zeros((), ct.dtype), ct)


def _const(x: jax.Array, v: float) -> jax.Array:
    return jnp.asarray(v, dtype=x.dtype)


def _safe_unary(prim_name: str, deriv: Callable[[OpView, jax.Array, jax.Array, jax.Array], jax.Array]):
    """A VJP rule ``ct = g * deriv(...)`` evaluated at a guarded point, 0 where ``g == 0``."""

    def rule(op: OpView, g: jax.Array) -> tuple[jax.Array]:
        (x,) = op.inputs
        z = g == 0
        gs, xs = _guard(z, g), _guard(z, x)
        # The output is recomputed from the guarded input (not guarded itself), so
        # the formula has the same shape as JAX's and XLA simplifies it the same
        # way (e.g. 0.5 / sqrt(x) -> 0.5 * rsqrt(x) under jit).
        if op.name == prim_name:  # the primitive itself: same params (accuracy, ...)
            ans = compat.bind_primitive(compat.primitive_by_name(prim_name), (xs,), dict(op.params))[0]
        else:  # the rule retargeted to another op (a named op wrapping the primitive)
            ans = getattr(lax, prim_name)(xs)
        return (_mask(z, deriv(op, gs, xs, ans)),)

    return rule


def _sqrt(op, g, x, ans):
    return g * (_const(x, 0.5) / ans)


def _rsqrt(op, g, x, ans):
    return g * (_const(x, -0.5) * (ans / x))


def _cbrt(op, g, x, ans):
    return g * (_const(x, 1 / 3) * lax.integer_pow(ans, -2))


def _log(op, g, x, ans):
    return g / x


def _log1p(op, g, x, ans):
    return g / (x + _const(x, 1))


def _acos(op, g, x, ans):
    return g * lax.neg(lax.rsqrt(_const(x, 1) - lax.square(x)))


def _asin(op, g, x, ans):
    return g * lax.rsqrt(_const(x, 1) - lax.square(x))


def _acosh(op, g, x, ans):
    return g * lax.rsqrt(lax.square(x) - _const(x, 1))


def _atanh(op, g, x, ans):
    return (lax.integer_pow(_const(x, 1) + x, -1) * g) / (_const(x, 1) - x)


def _lgamma(op, g, x, ans):
    return g * lax.digamma(x)


def _digamma(op, g, x, ans):
    return g * lax.polygamma(_const(x, 1), x)


def _erf_inv(op, g, x, ans):
    return (_const(x, math.sqrt(math.pi) / 2.0) * g) * lax.exp(lax.square(ans))


def _safe_integer_pow(op: OpView, g: jax.Array) -> tuple[jax.Array]:
    (x,) = op.inputs
    y = op.params["y"]
    if y == 0:
        return (jnp.zeros_like(x),)
    if y == 1:
        return (g,)
    if y == 2:
        return (g * (_const(x, 2) * x),)
    if y > 0:
        return (g * (_const(x, y) * lax.integer_pow(x, y - 1)),)
    z = g == 0
    xs = _guard(z, x)
    return (_mask(z, _guard(z, g) * (_const(x, y) * lax.integer_pow(xs, y - 1))),)


def _safe_mul(op: OpView, g: Any) -> tuple[Any, Any]:
    x, y = op.inputs
    if g is None or not jnp.issubdtype(jnp.result_type(g), jnp.inexact):
        return None, None
    z = g == 0
    gs, xs, ys = _guard(z, g), _guard(z, x), _guard(z, y)
    return _unbroadcast(_mask(z, gs * ys), x), _unbroadcast(_mask(z, xs * gs), y)


def _safe_div(op: OpView, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, y = op.inputs
    z = g == 0
    gs, xs, ys = _guard(z, g), _guard(z, x), _guard(z, y)
    ct_x = _mask(z, gs / ys)
    ct_y = _mask(z, lax.neg((gs * lax.integer_pow(ys, -2)) * xs))
    return _unbroadcast(ct_x, x), _unbroadcast(ct_y, y)


def _safe_rem(op: OpView, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, y = op.inputs
    z = g == 0
    gs, xs, ys = _guard(z, g), _guard(z, x), _guard(z, y)
    q = xs / ys
    ct_y = _mask(z, lax.neg(gs * (lax.sign(q) * lax.floor(lax.abs(q)))))
    return _unbroadcast(g, x), _unbroadcast(ct_y, y)


def _safe_atan2(op: OpView, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, y = op.inputs  # lax.atan2(x, y) = atan(x / y)
    z = g == 0
    gs, xs, ys = _guard(z, g), _guard(z, x), _guard(z, y)
    den = lax.square(xs) + lax.square(ys)
    ct_x = _mask(z, gs * (ys / den))
    ct_y = _mask(z, gs * (lax.neg(xs) / den))
    return _unbroadcast(ct_x, x), _unbroadcast(ct_y, y)


def _safe_pow(op: OpView, g: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, y = op.inputs
    ans = op.outputs[0]
    z = g == 0
    gs, xs, anss = _guard(z, g), _guard(z, x), _guard(z, ans)
    rdt = ans.dtype
    yf = jnp.asarray(y).astype(rdt)
    xf = xs.astype(rdt)
    if jnp.issubdtype(jnp.asarray(y).dtype, jnp.integer):
        if xf.shape != yf.shape:
            shape = jnp.broadcast_shapes(xf.shape, yf.shape)
            xf, yf = jnp.broadcast_to(xf, shape), jnp.broadcast_to(yf, shape)
        # JAX's formula: select(y == 0, 0, replace_zero(y) * x^(y - 1))
        jac = jnp.where(yf == 0, jnp.zeros_like(yf),
                        jnp.where(yf == 0, jnp.ones_like(yf), yf) * lax.pow(xf, yf - jnp.ones_like(yf)))
        ct_y = None
    else:
        jac = yf * lax.pow(xf, yf - jnp.ones_like(yf))
        log_x = lax.log(jnp.where(xf == 0, jnp.ones_like(xf), xf))
        ct_y = _unbroadcast(_mask(z, gs * (log_x * anss)), y).astype(jnp.asarray(y).dtype)
    ct_x = _unbroadcast(_mask(z, gs * jac), x)
    return ct_x, ct_y


#: primitive name -> VJP rule function.
SAFE_RULES: dict[str, Callable[[OpView, Any], Any]] = {
    "sqrt": _safe_unary("sqrt", _sqrt),
    "rsqrt": _safe_unary("rsqrt", _rsqrt),
    "cbrt": _safe_unary("cbrt", _cbrt),
    "log": _safe_unary("log", _log),
    "log1p": _safe_unary("log1p", _log1p),
    "acos": _safe_unary("acos", _acos),
    "asin": _safe_unary("asin", _asin),
    "acosh": _safe_unary("acosh", _acosh),
    "atanh": _safe_unary("atanh", _atanh),
    "lgamma": _safe_unary("lgamma", _lgamma),
    "digamma": _safe_unary("digamma", _digamma),
    "erf_inv": _safe_unary("erf_inv", _erf_inv),
    "integer_pow": _safe_integer_pow,
    "mul": _safe_mul,
    "div": _safe_div,
    "rem": _safe_rem,
    "atan2": _safe_atan2,
    "pow": _safe_pow,
}

SAFE_DOCS: dict[str, str] = {
    "sqrt": "0.5/sqrt(x): inf at 0", "rsqrt": "-0.5 x^-1.5: inf at 0", "cbrt": "x^(-2/3)/3: inf at 0",
    "log": "1/x: inf at 0", "log1p": "1/(1+x): inf at -1",
    "mul": "the other operand: x * log(x) is 0 * -inf at 0",
    "acos": "-1/sqrt(1-x^2): inf at ±1", "asin": "1/sqrt(1-x^2): inf at ±1",
    "acosh": "1/sqrt(x^2-1): inf at 1", "atanh": "1/(1-x^2): inf at ±1",
    "lgamma": "digamma: poles at 0, -1, ...", "digamma": "trigamma: poles at 0, -1, ...",
    "erf_inv": "inf at ±1", "integer_pow": "y x^(y-1): inf at 0 for y < 0", "div": "1/y, x/y^2: inf at y = 0",
    "rem": "x/y: inf at y = 0", "atan2": "(y, -x)/(x^2+y^2): NaN at the origin",
    "pow": "y x^(y-1): inf/NaN at x = 0; x^y log x: NaN at x = 0",
}


# =========================================================================== stable (JVP)


def _is_foreign_jit(op: OpView) -> bool:
    """A ``jax.jit``-ed function matched by name (not a gradkit named op): its params are jit's."""
    return isinstance(op.params.get("jaxpr"), compat.ClosedJaxpr)


def op_function(op: OpView, rule_name: str) -> Callable[..., Any]:
    """The matched op as a function of its inputs, to get its own (JAX) derivative.

    Available for primitives and ``jax.jit``-ed functions matched by name.
    """
    params = dict(op.params)
    if _is_foreign_jit(op):
        closed = params["jaxpr"]

        def fun(*xs):
            out = compat.eval_jaxpr(closed, xs)
            return out[0] if len(out) == 1 else tuple(out)

        return fun
    prim = compat.primitive_by_name(op.name)
    if prim is None:
        raise GradkitError(
            f"rule {rule_name} for op '{op.name}' at {op.source} needs the op's own derivative, which gradkit "
            "can rebuild only for JAX primitives and jax.jit-ed functions matched by name. For a gk.op or a "
            "custom_jvp function, write the rule with gk.jvp_rule / gk.vjp_rule, or wrap the call site with "
            "gradkit.estimators.scale_gradient / clip_gradient instead.")

    def fun(*xs):
        out = compat.bind_primitive(prim, xs, params)
        return out[0] if len(out) == 1 else tuple(out)

    return fun


def _zeros_for(x: Any) -> Any:
    if jnp.issubdtype(jnp.result_type(x), jnp.inexact):
        return jnp.zeros(np.shape(x), jnp.result_type(x))
    return np.zeros(np.shape(x), jax.dtypes.float0)


def default_jvp(op: OpView, tangents: tuple[Any, ...], rule_name: str) -> Any:
    """``jax.jvp`` of the op's own function (see :func:`op_function`)."""
    primals = tuple(op.inputs)
    ts = tuple(_zeros_for(p) if t is None else t for p, t in zip(primals, tangents))
    _, t_out = jax.jvp(op_function(op, rule_name), primals, ts)
    return t_out


def _jvp_via(body: Callable[..., Any], keywords: tuple[str, ...] = ()):
    """A JVP rule that differentiates ``body(*op.inputs, **params)``, a stable function with a custom_jvp.

    Only float inputs are differentiated (``None`` and boolean/integer inputs
    are held fixed); only ``keywords`` are read from ``op.params`` (a foreign
    op's params are not the body's). A ``jax.jit``-ed function matched by
    name whose signature the body cannot know (``jax.nn.log_softmax``'s
    ``axis``) keeps its own derivative.
    """

    def rule(op: OpView, tangents: tuple[Any, ...]) -> Any:
        if keywords and _is_foreign_jit(op):
            return default_jvp(op, tangents, "gradkit.stable")
        inputs = list(op.inputs)
        idx = [i for i, x in enumerate(inputs)
               if x is not None and jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
        kw = {k: op.params[k] for k in keywords if k in op.params}

        def f(*xs):
            args = list(inputs)
            for i, x in zip(idx, xs):
                args[i] = x
            return body(*args, **kw)

        primals = tuple(jnp.asarray(inputs[i]) for i in idx)
        ts = tuple(jnp.zeros_like(p) if i >= len(tangents) or tangents[i] is None else
                   jnp.asarray(tangents[i]).astype(p.dtype) for i, p in zip(idx, primals))
        _, t_out = jax.jvp(f, primals, ts)
        return t_out

    return rule


def _stable_rules() -> dict[str, Callable[[OpView, Any], Any]]:
    from gradkit import stable as st

    def body(fn: Any) -> Callable[..., Any]:
        return getattr(fn, "__wrapped__", fn)  # a gk.op's undecorated function

    rules: dict[str, Callable[[OpView, Any], Any]] = {}
    for name, fn in {
        "log1pexp": st.log1pexp, "softplus": st.log1pexp, "log_sigmoid": st.log_sigmoid, "sigmoid": st.sigmoid,
        "silu": st.silu, "log1mexp": st.log1mexp, "softplus_inverse": st.softplus_inverse,
        "log_cosh": st.log_cosh, "safe_sqrt": st.safe_sqrt, "safe_arccos": st.safe_arccos,
        "safe_arcsin": st.safe_arcsin, "sinc": st.sinc, "logaddexp": st.logaddexp, "xlogy": st.xlogy,
        "xlog1py": st.xlog1py, "log_sub_exp": st.log_sub_exp, "safe_div": st.safe_div,
        "safe_arctan2": st.safe_arctan2, "safe_pow": st.safe_pow, "hypot": st.hypot,
    }.items():
        rules[name] = _jvp_via(body(fn))
    for name, fn in {"logistic": _k.sigmoid, "tanh": _k.tanh, "expm1": _k.expm1}.items():
        rules[name] = _jvp_via(fn)
    # A user's own op of that name may take just (a,) or (x,): the optional inputs default to None.
    lse, sm, lsm = body(st._logsumexp_op), body(st._softmax_op), body(st._log_softmax_op)
    rules["logsumexp"] = _jvp_via(lambda a, b=None, where=None, **kw: lse(a, b, where, **kw),
                                  ("axis", "keepdims", "return_sign"))
    rules["softmax"] = _jvp_via(lambda x, where=None, **kw: sm(x, where, **kw), ("axis",))
    rules["log_softmax"] = _jvp_via(lambda x, where=None, **kw: lsm(x, where, **kw), ("axis",))
    rules["safe_norm"] = _jvp_via(body(st._safe_norm_op), ("ord", "axis", "keepdims", "min_norm"))
    rules["normalize"] = _jvp_via(body(st._normalize_op), ("axis",))
    rules["safe_log"] = _jvp_via(body(st._safe_log_op), ("eps",))
    return rules


STABLE_DOCS: dict[str, str] = {
    "log1pexp": "gk.stable.log1pexp: d = sigmoid(x)",
    "softplus": "jax.nn.softplus / gk.op('softplus'): d = sigmoid(x)",
    "log_sigmoid": "jax.nn.log_sigmoid / gk.stable.log_sigmoid: d = sigmoid(-x)",
    "sigmoid": "gk.stable.sigmoid: d = e/(1 + e(2 + e)), e = e^-|x|",
    "logistic": "the lax.logistic primitive (jax.nn.sigmoid): d = e/(1 + e(2 + e)), e = e^-|x|, instead of s(1-s)",
    "silu": "jax.nn.silu / gk.stable.silu: accurate silu'",
    "tanh": "the tanh primitive: d = 4 sigmoid'(2x) instead of (1+t)(1-t)",
    "expm1": "the expm1 primitive: d = exp(x) instead of expm1(x) + 1",
    "logaddexp": "jnp.logaddexp / gk.stable.logaddexp: (sigmoid(x-y), sigmoid(y-x)), exact x - y",
    "logsumexp": "gk.stable.logsumexp: softmax weights, finite for infinite maxima",
    "softmax": "gk.stable.softmax", "log_softmax": "gk.stable.log_softmax",
    "xlogy": "jax.scipy.special.xlogy / gk.stable.xlogy: d/dy = 0 where x == 0",
    "xlog1py": "jax.scipy.special.xlog1py / gk.stable.xlog1py: d/dy = 0 where x == 0",
    "log1mexp": "gk.stable.log1mexp: d = 1/expm1(x)", "log_sub_exp": "gk.stable.log_sub_exp",
    "softplus_inverse": "gk.stable.softplus_inverse", "log_cosh": "gk.stable.log_cosh: d = tanh(x)",
    "safe_sqrt": "gk.stable.safe_sqrt", "safe_log": "gk.stable.safe_log", "safe_div": "gk.stable.safe_div",
    "safe_arctan2": "gk.stable.safe_arctan2", "safe_pow": "gk.stable.safe_pow",
    "safe_arccos": "gk.stable.safe_arccos", "safe_arcsin": "gk.stable.safe_arcsin",
    "sinc": "jnp.sinc / gk.stable.sinc: exact at every order", "hypot": "jnp.hypot / gk.stable.hypot",
    "safe_norm": "gk.stable.safe_norm", "normalize": "gk.stable.normalize",
}

_STABLE_RULES: dict[str, Callable[[OpView, Any], Any]] | None = None


def stable_rules() -> dict[str, Callable[[OpView, Any], Any]]:
    global _STABLE_RULES
    if _STABLE_RULES is None:
        _STABLE_RULES = _stable_rules()
    return _STABLE_RULES


# =========================================================================== generic rules


def _first_input_rule(scale_fn: Callable[[OpView, Any], Any]):
    def rule(op: OpView, tangents: tuple[Any, ...]) -> Any:
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


def _straight_through(params: Mapping[str, Any], op_name: str) -> Rule:
    return Rule(_first_input_rule(lambda op, t: t), mode="jvp", name="gradkit.straight_through")


def _zero(params: Mapping[str, Any], op_name: str) -> Rule:
    return Rule(lambda op, tangents: None, mode="jvp", name="gradkit.zero")


def _clamped(name: str, jvp: Callable[[Any, jax.Array], Any]) -> Callable[[Mapping[str, Any], str], Rule]:
    """A JVP rule ``jvp(t, max(x, eps))``: the derivative evaluated at a clamped input."""

    def factory(params: Mapping[str, Any], op_name: str) -> Rule:
        eps = params.get("eps")

        def rule(op: OpView, tangents):
            x, t = op.inputs[0], tangents[0]
            if t is None:
                return None
            dtype = jnp.result_type(x)
            e = float(jnp.finfo(dtype).tiny) if eps is None else eps
            return jvp(t, jnp.maximum(x, jnp.asarray(e, dtype)))

        return Rule(rule, mode="jvp", name=f"gradkit.{name}")

    return factory


_clamped_log = _clamped("clamped_log", lambda t, x: t / x)
_clamped_sqrt = _clamped("clamped_sqrt", lambda t, x: t * (0.5 / jnp.sqrt(x)))


def _scale(params: Mapping[str, Any], op_name: str, sign: float = 1.0, name: str = "scale_gradient") -> Rule:
    s = sign * params["scale"]

    def rule(op: OpView, tangents):
        out = default_jvp(op, tangents, f"gradkit.{name}")
        return jax.tree_util.tree_map(lambda v: v * jnp.asarray(s, jnp.result_type(v)), out)

    return Rule(rule, mode="jvp", name=f"gradkit.{name}")


def _reverse(params: Mapping[str, Any], op_name: str) -> Rule:
    return _scale({"scale": params.get("scale", 1.0)}, op_name, -1.0, "reverse_gradient")


def _clip(params: Mapping[str, Any], op_name: str) -> Rule:
    lo, hi = params.get("lo", -math.inf), params.get("hi", math.inf)

    def rule(op: OpView, g):
        _, vjp = jax.vjp(op_function(op, "gradkit.clip_gradient"), *op.inputs)
        cts = vjp(g)
        return tuple(None if c is None or not jnp.issubdtype(c.dtype, jnp.inexact)
                     else jnp.clip(c, lo, hi).astype(c.dtype) for c in cts)

    return Rule(rule, mode="vjp", name="gradkit.clip_gradient")


def _safe_factory(params: Mapping[str, Any], op_name: str) -> Rule:
    target = params["op"]
    return Rule(SAFE_RULES[target], mode="vjp", name=f"gradkit.safe[{target}]")


def _stable_factory(params: Mapping[str, Any], op_name: str) -> Rule:
    target = params["op"]
    return Rule(stable_rules()[target], mode="jvp", name=f"gradkit.stable[{target}]")


# =========================================================================== registry

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter of a library rule."""

    name: str
    kind: str  # "float" | "str"
    doc: str
    default: Any = _REQUIRED
    check: Callable[[Any], str | None] | None = None  # returns an error message or None

    @property
    def required(self) -> bool:
        return self.default is _REQUIRED


@dataclasses.dataclass(frozen=True)
class LibraryRule:
    """A named rule that a table or a config can refer to."""

    name: str
    doc: str
    params: tuple[Param, ...]
    factory: Callable[[Mapping[str, Any], str], Rule]
    op_dependent: bool = False  # its ``op`` parameter defaults to the table entry's name

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
    LibraryRule("safe", "The primitive's own VJP, but 0 wherever the incoming cotangent is 0 (no 0*inf NaNs).",
                (Param("op", "str", "which SAFE entry to use", default=None),), _safe_factory, op_dependent=True),
    LibraryRule("stable", "The stable derivative of a gradkit.stable op (or a JAX function it replaces).",
                (Param("op", "str", "which STABLE entry to use", default=None),), _stable_factory,
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


def _check_value(rule: LibraryRule, p: Param, value: Any, where: str) -> Any:
    if p.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise GradkitError(
                f"{where}: parameter `{p.name}` of rule '{rule.name}' must be a number, got {value!r} "
                f"({type(value).__name__}). {rule.signature()}: {p.doc}.")
        value = float(value)
        if math.isnan(value):
            raise GradkitError(f"{where}: parameter `{p.name}` of rule '{rule.name}' is NaN. {rule.signature()}.")
    elif p.kind == "str":
        if not isinstance(value, str):
            raise GradkitError(
                f"{where}: parameter `{p.name}` of rule '{rule.name}' must be a string, got {value!r}. "
                f"{rule.signature()}.")
    if p.check is not None:
        msg = p.check(value)
        if msg:
            raise GradkitError(f"{where}: parameter `{p.name}` of rule '{rule.name}' {msg}, got {value!r}. "
                               f"{rule.signature()}: {p.doc}.")
    return value


def make_rule(rule_name: str, op_name: str, params: Mapping[str, Any] | None = None, *,
              where: str | None = None) -> Rule:
    """Builds library rule ``rule_name`` for table entry ``op_name`` with ``params``.

    Raises GradkitError, listing what is valid, for an unknown rule, an unknown
    or missing parameter, or a bad value. Nothing is imported or evaluated:
    names are looked up in a fixed registry.
    """
    where = where or f"table entry '{op_name}'"
    params = dict(params or {})
    if not isinstance(rule_name, str) or rule_name not in LIBRARY:
        close = near_misses(str(rule_name), LIBRARY) if isinstance(rule_name, str) else []
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
    resolved: dict[str, Any] = {}
    for p in rule.params:
        if p.name in params:
            resolved[p.name] = _check_value(rule, p, params[p.name], where)
        elif rule.op_dependent and p.name == "op":
            resolved["op"] = op_name
        elif p.required:
            raise GradkitError(
                f"{where}: rule '{rule_name}' needs parameter `{p.name}` ({p.doc}). {rule.signature()}.")
        elif p.default is not None:
            resolved[p.name] = p.default
    if rule_name == "clip_gradient" and resolved["lo"] > resolved["hi"]:
        raise GradkitError(f"{where}: rule 'clip_gradient' needs lo <= hi, got lo={resolved['lo']}, "
                           f"hi={resolved['hi']}.")
    if rule.op_dependent:
        valid_ops = SAFE_RULES if rule_name == "safe" else STABLE_DOCS
        if resolved["op"] not in valid_ops:
            close = near_misses(resolved["op"], valid_ops)
            hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
            raise GradkitError(
                f"{where}: rule '{rule_name}' has no entry for op {resolved['op']!r}{hint}. "
                f"Ops it covers: {', '.join(sorted(valid_ops))}. To use one of them for another op, "
                f"write {{rule = \"{rule_name}\", op = \"<one of these>\"}}.")
    built = rule.factory(resolved, op_name)
    key = ("gradkit", rule_name, tuple(sorted(resolved.items())))
    return dataclasses.replace(built, key=key)
