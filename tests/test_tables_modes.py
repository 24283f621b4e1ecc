"""Every rule of every shipped table in every mode: grad, jvp, jacfwd, jacrev, hessian, eager and jit, vmap.

Each rule gets a function of a small vector ``v`` that uses the ruled op, at
three or more points, and (for SAFE) a ``jnp.where``-guarded version at points
where plain JAX's derivative is NaN. The reference is plain JAX's own
derivative of the same function (for STRAIGHT_THROUGH: of the same function
with the op replaced by the identity, which is what a straight-through
estimator differentiates):

* wherever the reference is finite, the overridden derivative equals it
  (SAFE replays JAX's own arithmetic; STABLE is more accurate, so a tolerance);
* wherever the reference is NaN in the guarded case, it is exactly 0;
* forward and reverse mode agree wherever both are finite.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from meshes import make_mesh
from gradkit import tables

pytestmark = pytest.mark.slow  # a long matrix: `pytest -m slow` (CI runs it)

SAFE, STABLE, STE = tables.SAFE, tables.STABLE, tables.STRAIGHT_THROUGH


@dataclasses.dataclass(frozen=True)
class Case:
    key: str  # the table entry under test
    table: Any
    fn: Callable[[jax.Array], jax.Array]  # of a vector v, scalar out
    points: tuple[tuple[float, ...], ...]
    ref: Callable[[jax.Array], jax.Array] | None = None  # plain-JAX twin (default: fn)
    masked: Callable[[jax.Array], jax.Array] | None = None  # guarded version
    masked_points: tuple[tuple[float, ...], ...] = ()
    rtol: float = 2e-6


def _u(op):  # a unary op of v[0]
    return lambda v: op(v[0])


def _b(op):  # a binary op of v[0], v[1]
    return lambda v: op(v[0], v[1])


def _where(cond, op):
    return lambda v: jnp.where(cond(v), op(v), 0.0)


def _safe(key, op, points, cond, masked_points, table=SAFE):
    return Case(key, table, op, points, masked=_where(cond, op), masked_points=masked_points)


def _i(n):
    return lambda x: lax.integer_pow(x, n)


SAFE_CASES = [
    _safe("sqrt", _u(jnp.sqrt), ((0.25,), (1.0,), (4.0,)), lambda v: v[0] > 0, ((0.0,), (-1.0,), (2.0,))),
    _safe("rsqrt", _u(lax.rsqrt), ((0.25,), (1.0,), (4.0,)), lambda v: v[0] > 0, ((0.0,), (-1.0,), (2.0,))),
    _safe("cbrt", _u(jnp.cbrt), ((-2.0,), (0.5,), (3.0,)), lambda v: v[0] != 0, ((0.0,), (2.0,), (-1.0,))),
    _safe("log", _u(jnp.log), ((0.25,), (1.0,), (4.0,)), lambda v: v[0] > 0, ((0.0,), (-1.0,), (2.0,))),
    _safe("log1p", _u(jnp.log1p), ((-0.5,), (0.0,), (3.0,)), lambda v: v[0] > -1, ((-1.0,), (-2.0,), (1.0,))),
    _safe("acos", _u(jnp.arccos), ((-0.5,), (0.1,), (0.7,)), lambda v: jnp.abs(v[0]) < 1,
          ((1.0,), (-1.0,), (2.0,), (0.3,))),
    _safe("asin", _u(jnp.arcsin), ((-0.5,), (0.1,), (0.7,)), lambda v: jnp.abs(v[0]) < 1,
          ((1.0,), (-1.0,), (2.0,), (0.3,))),
    _safe("acosh", _u(jnp.arccosh), ((1.5,), (2.0,), (5.0,)), lambda v: v[0] > 1, ((1.0,), (0.5,), (3.0,))),
    _safe("atanh", _u(jnp.arctanh), ((-0.5,), (0.1,), (0.7,)), lambda v: jnp.abs(v[0]) < 1,
          ((1.0,), (-1.0,), (0.3,))),
    _safe("lgamma", _u(lax.lgamma), ((0.5,), (1.5,), (3.0,)), lambda v: v[0] > 0, ((0.0,), (-1.0,), (2.5,))),
    _safe("digamma", _u(lax.digamma), ((0.5,), (1.5,), (3.0,)), lambda v: v[0] > 0, ((0.0,), (-2.0,), (2.5,))),
    _safe("erf_inv", _u(lax.erf_inv), ((-0.5,), (0.1,), (0.7,)), lambda v: jnp.abs(v[0]) < 1,
          ((1.0,), (-1.0,), (0.3,))),
    _safe("integer_pow", _u(_i(-3)), ((-2.0,), (0.5,), (3.0,)), lambda v: v[0] != 0, ((0.0,), (1.5,))),
    _safe("div", _b(lax.div), ((1.0, 2.0), (-3.0, 0.5), (0.0, 4.0)), lambda v: v[1] != 0,
          ((1.0, 0.0), (0.0, 0.0), (2.0, 3.0))),
    _safe("rem", _b(lax.rem), ((5.0, 3.0), (-2.5, 2.0), (1.0, 4.0)), lambda v: v[1] != 0,
          ((1.0, 0.0), (0.0, 0.0), (5.0, 3.0))),
    _safe("atan2", _b(lax.atan2), ((1.0, 2.0), (-1.0, 0.5), (0.3, -2.0)), lambda v: jnp.any(v != 0),
          ((0.0, 0.0), (1.0, 2.0))),
    _safe("pow", _b(lax.pow), ((2.0, 1.5), (0.5, 3.0), (3.0, -1.0)), lambda v: v[0] > 0,
          ((0.0, 0.5), (-1.0, 0.5), (0.0, 2.0), (2.0, 1.5))),
]
# Variants of the same entries: positive integer powers (the x ** 2 of every model), an integer
# exponent for pow, and mul, which a table opts into.
SAFE_VARIANTS = [
    Case("integer_pow", SAFE, _u(_i(2)), ((-2.0,), (0.0,), (3.0,))),
    Case("integer_pow", SAFE, _u(_i(3)), ((-2.0,), (0.0,), (3.0,))),
    Case("pow", SAFE, lambda v: lax.pow(v[0], jnp.int32(-2)), ((-2.0,), (0.5,), (3.0,)),
         masked=_where(lambda v: v[0] != 0, lambda v: lax.pow(v[0], jnp.int32(-2))),
         masked_points=((0.0,), (1.5,))),
    _safe("mul", lambda v: v[0] * jnp.log(v[1]), ((1.0, 2.0), (-3.0, 0.5), (0.0, 4.0)),
          lambda v: v[1] > 0, ((0.0, 0.0), (2.0, 0.0), (1.0, 3.0)), table=SAFE | {"mul": "safe"}),
]
STABLE_CASES = [
    Case("logistic", STABLE, _u(jax.nn.sigmoid), ((-3.0,), (0.5,), (4.0,)), rtol=2e-5),
    Case("tanh", STABLE, _u(jnp.tanh), ((-1.0,), (0.3,), (2.0,)), rtol=2e-5),
    Case("expm1", STABLE, _u(jnp.expm1), ((-2.0,), (0.1,), (3.0,)), rtol=2e-5),
]


def _ste(op):  # the textbook straight-through estimator, by JAX's own autodiff: op's value, identity's slope
    return lambda x: x + lax.stop_gradient(op(x) - x)


STE_CASES = [
    Case(name, STE, lambda v, op=op: op(v[0]) * v[0], ((-1.3,), (0.2,), (2.7,)),
         ref=lambda v, op=op: _ste(op)(v[0]) * v[0],
         masked=lambda v, op=op: jnp.where(v[0] > 0, op(v[0]), 0.0), masked_points=((-1.3,), (0.2,), (2.7,)))
    for name, op in [("round", jnp.round), ("floor", jnp.floor), ("ceil", jnp.ceil), ("sign", jnp.sign)]
]
STE_MASKED_REF = {name: (lambda v, op=op: jnp.where(v[0] > 0, _ste(op)(v[0]), 0.0))
                  for name, op in [("round", jnp.round), ("floor", jnp.floor), ("ceil", jnp.ceil),
                                   ("sign", jnp.sign)]}

CASES = SAFE_CASES + SAFE_VARIANTS + STABLE_CASES + STE_CASES
IDS = [f"{c.key}#{i}" for i, c in enumerate(CASES)]


def test_every_entry_of_the_primitive_tables_has_a_case():
    # SAFE's mask ops (max, min, square, reduce_max, reduce_min) have their mode tests in test_safe_modes.py
    masks = {"max", "min", "square", "reduce_max", "reduce_min"}
    assert {c.key for c in CASES} == (set(SAFE) - masks) | set(STABLE) | set(STE) | {"mul"}
    for c in CASES:  # each case uses its op: strict fails on a name that matches nothing
        gk.override(c.fn, {c.key: c.table[c.key]}, strict=True)(jnp.asarray(c.points[0]))


# --------------------------------------------------------------------------- transforms

TANGENT = (0.7, -1.3)


def _transforms(f: Callable[[jax.Array], jax.Array]) -> dict[str, Callable[[jax.Array], jax.Array]]:
    return {
        "grad": jax.grad(f),
        "jvp": lambda v: jax.jvp(f, (v,), (jnp.asarray(TANGENT[:v.shape[0]], v.dtype),))[1],
        "jacfwd": jax.jacfwd(f),
        "jacrev": jax.jacrev(f),
        "hessian": jax.hessian(f),  # forward over reverse
        "hessian_rev": jax.jacrev(jax.jacrev(f)),  # reverse over reverse
    }


NAMES = list(_transforms(lambda v: v[0]))


def _check(got, want, rtol, masked, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=rtol, atol=1e-6, err_msg=what)
    if masked:  # plain JAX's NaN of the guarded case is SAFE's 0
        np.testing.assert_array_equal(got[np.isnan(want)], 0.0, err_msg=what)


def _plain(f):
    # JAX's own pow rule mixes its integer exponent into the float result: it needs standard promotion.
    def call(*a):
        with jax.numpy_dtype_promotion("standard"):
            return f(*a)
    return call


def _as_jax(f, ref):
    """``f``; where it raises JAX's strict-promotion error, ``ref`` (plain JAX) must raise it too — an equation
    no mask reaches keeps JAX's own rule (pow's integer exponent needs standard promotion) — and then both
    run under standard promotion."""
    def call(*a):
        try:
            return f(*a)
        except jax.dtypes.TypePromotionError:
            with pytest.raises(jax.dtypes.TypePromotionError):
                ref(*a)
            with jax.numpy_dtype_promotion("standard"):
                return f(*a)
    return call


def _run(case: Case, fn, ref, points, masked, maybe_jit):
    raw = _transforms(gk.override(fn, case.table))
    ref_t = _transforms(ref)
    ours = {k: _as_jax(v, ref_t[k]) for k, v in raw.items()}
    plain = {k: _plain(v) for k, v in _transforms(ref).items()}
    pts = jnp.asarray(points, jnp.float32)
    for name in NAMES:
        for p in pts:
            want = plain[name](p)
            _check(maybe_jit(ours[name])(p), want, case.rtol, masked, f"{case.key} {name} at {p}")
        # vmap over the points: the same values
        batched = maybe_jit(jax.vmap(ours[name]))(pts)
        for b, p in zip(batched, pts):
            _check(b, plain[name](p), case.rtol, masked, f"{case.key} vmap({name}) at {p}")
    # forward and reverse agree wherever both are finite
    for p in pts:
        for fwd, rev in [("jacfwd", "jacrev"), ("hessian", "hessian_rev")]:
            a, b = np.asarray(maybe_jit(ours[fwd])(p)), np.asarray(maybe_jit(ours[rev])(p))
            both = np.isfinite(a) & np.isfinite(b)
            np.testing.assert_allclose(a[both], b[both], rtol=case.rtol, atol=1e-6, err_msg=f"{case.key} {fwd}")


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_rule_in_every_mode(case, maybe_jit):
    _run(case, case.fn, case.ref or case.fn, case.points, False, maybe_jit)


MASKED = [c for c in CASES if c.masked is not None]


@pytest.mark.parametrize("case", MASKED, ids=[f"{c.key}#{CASES.index(c)}" for c in MASKED])
def test_guarded_rule_in_every_mode(case, maybe_jit):
    ref = STE_MASKED_REF[case.key] if case.table is STE else case.masked
    if case.table is not STE:  # the problem exists: plain JAX's gradient is NaN at a guarded point
        g = _plain(jax.vmap(jax.grad(case.masked)))(jnp.asarray(case.masked_points, jnp.float32))
        assert bool(jnp.any(jnp.isnan(g))), case.key
    _run(case, case.masked, ref, case.masked_points, case.table is not STE, maybe_jit)


# --------------------------------------------------------------------------- SAFE inside shard_map


def test_safe_in_every_mode_inside_shard_map():
    from jax.sharding import AxisType, PartitionSpec as P

    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))

    def f(x):
        body = jax.shard_map(lambda z: jnp.where(z > 0, jnp.log(z), 0.0) + z ** 2 + jnp.sqrt(z ** 2 + 1.0) / (1 + z ** 2),
                             mesh=mesh, in_specs=P("d"), out_specs=P("d"))
        return jnp.sum(body(x))

    x = jnp.linspace(-1.0, 1.0, 16)  # 0 is not on the grid: plain JAX is finite, and so the reference
    g = gk.override(f, SAFE)
    for got, want in [(jax.grad(g)(x), jax.grad(f)(x)), (jax.jit(jax.grad(g))(x), jax.jit(jax.grad(f))(x)),
                      (jax.jvp(g, (x,), (x,))[1], jax.jvp(f, (x,), (x,))[1]),
                      (jax.jvp(jax.grad(g), (x,), (x,))[1], jax.jvp(jax.grad(f), (x,), (x,))[1])]:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6, atol=1e-6)
    x0 = x.at[0].set(0.0)  # the guarded log at 0: plain NaN, SAFE 0 there
    assert np.isnan(np.asarray(jax.grad(f)(x0))[0]) and float(jax.grad(g)(x0)[0]) == 0.0


# --------------------------------------------------------------------------- the safe_scale primitive


def test_safe_scale_primitive():
    from gradkit._src.compat import safe_scale

    t = jnp.array([0.0, -0.0, 1.5, -2.0, 3.0])
    d = jnp.array([jnp.inf, jnp.nan, 3.0, jnp.inf, jnp.nan])
    want = np.array([0.0, 0.0, 4.5, -np.inf, np.nan], np.float32)
    for fn in (safe_scale, jax.jit(safe_scale)):
        np.testing.assert_array_equal(np.asarray(fn(t, d)), want)
    np.testing.assert_array_equal(np.asarray(safe_scale(t, d, divide=True)),
                                  np.array([0.0, 0.0, 0.5, -0.0, np.nan], np.float32))
    # compiles to plain HLO: a compare, a select and a multiply
    hlo = jax.jit(safe_scale).lower(t, d).as_text()
    assert "select" in hlo and "multiply" in hlo and "custom" not in hlo and "call" not in hlo
    # bit for bit the product where t != 0
    r = jax.random.normal(jax.random.key(2), (2, 1000))
    np.testing.assert_array_equal(np.asarray(jax.jit(safe_scale)(r[0], r[1])), np.asarray(jax.jit(jnp.multiply)(r[0], r[1])))
    # linear in t: transpose is safe_scale(ct, d); jvp in d is 0 where t == 0 (even for an inf tangent)
    (ct,) = jax.linear_transpose(lambda u: safe_scale(u, d), t)(t)
    np.testing.assert_array_equal(np.asarray(ct), np.asarray(safe_scale(t, d)))
    _, dd = jax.jvp(lambda e: safe_scale(t, e), (d,), (jnp.full(5, jnp.inf),))
    np.testing.assert_array_equal(np.asarray(dd)[:2], [0.0, 0.0])
    g = jax.grad(lambda e: jnp.sum(safe_scale(t, e)))(jnp.array([jnp.inf, 1.0, 2.0, 3.0, 4.0]))
    np.testing.assert_array_equal(np.asarray(g), np.asarray(t))
    h = jax.grad(lambda e: jnp.sum(safe_scale(t, e, divide=True)))(jnp.array([0.0, 0.0, 2.0, 4.0, 1.0]))
    np.testing.assert_allclose(np.asarray(h), [0.0, 0.0, -1.5 / 4, 2.0 / 16, -3.0], rtol=1e-7)
    # batching: either operand, or both on different axes
    tb, db = jnp.stack([t, 2 * t]), jnp.stack([d, d])
    np.testing.assert_array_equal(np.asarray(jax.vmap(safe_scale, (0, None))(tb, d)),
                                  np.stack([safe_scale(t, d), safe_scale(2 * t, d)]))
    np.testing.assert_array_equal(np.asarray(jax.vmap(safe_scale, (None, 0))(t, db)), np.stack([want, want]))
    np.testing.assert_array_equal(np.asarray(jax.vmap(safe_scale, (0, 1))(tb, db.T)),
                                  np.stack([safe_scale(t, d), safe_scale(2 * t, d)]))


def test_tables_module_examples_run():
    import doctest

    results = doctest.testmod(tables, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.attempted >= 5 and results.failed == 0

