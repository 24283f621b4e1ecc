"""-inf-masked softmax with fully masked rows: the rule route, its verification by the audit, and where none exists.

A row whose scores are all -inf is NaN after softmax's max shift (-inf - -inf). A loss that drops the row
with a `where` is finite, and its true gradient is finite; JAX's is NaN (0 * NaN in exp's derivative and in
p @ v's transpose). `{"exp": "safe", "dot_general": "safe"}` (with SAFE's div) fixes it with no code change;
where the loss multiplies the NaN row by 0 the value itself is NaN, and the audit says no table can fix it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from budget import covering

import gradkit as gk

TABLE = gk.tables.SAFE | {"exp": "safe", "dot_general": "safe"}
MASK = np.array([[True, False, True, True], [False, False, False, False], [True, True, False, True]])
VALID = MASK.any(-1)


def where_masked(scores, v):
    s = jnp.where(MASK, scores, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(jnp.where(VALID[:, None], p @ v, 0.0) ** 2)


def bias_masked(scores, v):  # an additive -inf bias: the NaN reaches the scores too
    s = scores + jnp.where(MASK, 0.0, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.sum(jnp.where(VALID[:, None], jnp.einsum("qk,kd->qd", p, v), 0.0) ** 2)


def log_softmax_masked(scores, v):
    s = jnp.where(MASK, scores, -jnp.inf)
    lp = jax.nn.log_softmax(s, axis=-1)
    return jnp.sum(jnp.where(MASK, lp * (v[:, :1].T), 0.0))


def reference(fn):
    """The same loss with a finite mask value: where the row is dropped the gradient is the same function's."""
    def ref(scores, v):
        with jax.enable_x64(True):
            return jax.grad(lambda s, w: _finite(fn)(s, w), (0, 1))(scores.astype(np.float64), v.astype(np.float64))
    return ref


def _finite(fn):
    src = {where_masked: lambda s, v: jnp.sum(jnp.where(VALID[:, None], jax.nn.softmax(
               jnp.where(MASK, s, -1e300), axis=-1) @ v, 0.0) ** 2),
           bias_masked: lambda s, v: jnp.sum(jnp.where(VALID[:, None], jax.nn.softmax(
               s + jnp.where(MASK, 0.0, -1e300), axis=-1) @ v, 0.0) ** 2),
           log_softmax_masked: lambda s, v: jnp.sum(jnp.where(MASK, jax.nn.log_softmax(
               jnp.where(MASK, s, -1e300), axis=-1) * v[:, :1].T, 0.0))}
    return src[fn]


def _inputs(dtype):
    rng = np.random.RandomState(0)
    return jnp.asarray(rng.normal(size=(3, 4)), dtype), jnp.asarray(rng.normal(size=(4, 2)), dtype)


FNS = [where_masked, bias_masked, log_softmax_masked]


@pytest.mark.parametrize("fn,dtype,jit", covering(FNS, ["float32", "float64"], [False, True]))
def test_rule_route_matches_the_float64_reference_in_both_modes(fn, dtype, jit):
    with jax.enable_x64(dtype == "float64"):
        scores, v = _inputs(dtype)
        plain = jax.grad(fn, (0, 1))(scores, v)
        assert not all(bool(jnp.all(jnp.isfinite(g))) for g in plain)  # JAX's gradient is NaN here
        fixed = gk.override(fn, TABLE)
        rev = jax.grad(fixed, (0, 1))
        fwd = jax.jacfwd(fixed, (0, 1))
        if jit:
            rev, fwd = jax.jit(rev), jax.jit(fwd)
        g_rev, g_fwd = rev(scores, v), fwd(scores, v)
        ref = reference(fn)(scores, v)
        tol = 1e-5 if dtype == "float32" else 1e-12
        for a, b, r in zip(g_rev, g_fwd, ref):
            assert a.dtype == np.dtype(dtype)
            np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(r), rtol=tol, atol=tol)
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)  # reverse == forward
        # the value is the original function's, bit for bit
        assert np.array_equal(np.asarray(fixed(scores, v)), np.asarray(jax.jit(fn)(scores, v)))


def test_rule_changes_nothing_but_rounding_where_no_row_is_fully_masked():
    mask = jnp.asarray(MASK | np.eye(3, 4, dtype=bool))

    def f(scores, v):
        p = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
        return jnp.sum(jnp.tanh(p @ v))

    scores, v = _inputs("float32")
    ours = jax.jit(jax.grad(gk.override(f, TABLE), (0, 1)))(scores, v)
    theirs = jax.jit(jax.grad(f, (0, 1)))(scores, v)
    for a, b in zip(ours, theirs):  # XLA may fuse the rules' products differently: the last bit
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=4e-7, atol=0)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_batched_attention_einsum_with_heads():
    rng = np.random.RandomState(1)
    mask = rng.rand(2, 1, 5, 6) < 0.7
    mask[0, 0, 2, :] = False  # one fully masked query row
    valid = mask.any(-1, keepdims=True)

    def attn(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
        return jnp.sum(jnp.where(valid, jnp.einsum("bhqk,bhkd->bhqd", p, v), 0.0) ** 2)

    def ref(q, k, v):
        s = jnp.einsum("bhqd,bhkd->bhqk", q, k)
        p = jax.nn.softmax(jnp.where(mask, s, -1e30), axis=-1)
        return jnp.sum(jnp.where(valid, jnp.einsum("bhqk,bhkd->bhqd", p, v), 0.0) ** 2)

    q, k, v = (jnp.asarray(rng.normal(size=(2, 1, n, 3)), jnp.float32) for n in (5, 6, 6))
    assert not all(bool(jnp.all(jnp.isfinite(g))) for g in jax.grad(attn, (0, 1, 2))(q, k, v))
    ours = jax.grad(gk.override(attn, TABLE), (0, 1, 2))(q, k, v)
    for a, b in zip(ours, jax.grad(ref, (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fn", covering([where_masked, bias_masked]))
def test_audit_proposes_and_verifies_the_rule_route(fn):
    scores, v = _inputs("float32")
    r = gk.audit(fn, scores, v)
    (finding,) = r.findings
    assert finding.op == "sub" and finding.root.phase == "forward"
    fix = finding.fix
    assert fix.kind == "table" and fix.verified, str(r)
    assert '"dot_general": "safe"' in fix.expression
    assert any(a.name == "masked row" and "jnp.finfo(scores.dtype).min" in a.advice for a in finding.alternatives)
    # applying the reported expression, as a user would, gives a finite gradient
    tbl = gk.tables.SAFE if "SAFE" in fix.expression else gk.RuleTable({})
    for key in ("exp", "dot_general"):
        if f'"{key}": "safe"' in fix.expression:
            tbl = tbl | {key: "safe"}
    g = jax.grad(gk.override(fn, tbl), (0, 1))(scores, v)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in g)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_audit_says_no_table_fixes_a_nan_value():
    def multiplied_by_zero(scores, v):  # the masked row times 0: NaN * 0 is NaN, the loss itself is NaN
        p = jax.nn.softmax(jnp.where(MASK, scores, -jnp.inf), axis=-1)
        return jnp.sum((p @ v) * VALID[:, None].astype(np.float32))

    scores, v = _inputs("float32")
    assert np.isnan(float(multiplied_by_zero(scores, v)))
    r = gk.audit(multiplied_by_zero, scores, v)
    fix = r.findings[0].fix
    assert fix.kind == "none" and not fix.verified
    assert fix.advice.startswith("no rule table fixes this: the function's value is already NaN/inf")
    assert "Change the code:" in fix.advice and "jax.nn.softmax(scores, where=mask)" in fix.advice
    assert fix.verdict() == "the code change is not re-run: apply it and audit again"
    # every table route was re-run and none verified; none is offered as a fix
    assert all(not a.verified for a in r.findings[0].alternatives)
    # the advice is right: a finite mask value, rows dropped with where, gives a finite gradient
    fixed = lambda s, w: jnp.sum(jnp.where(VALID[:, None], jax.nn.softmax(
        jnp.where(MASK, s, jnp.finfo(s.dtype).min), axis=-1) @ w, 0.0))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.grad(fixed, (0, 1))(scores, v))
