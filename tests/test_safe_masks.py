"""SAFE's meaning: a masked path contributes nothing; everything else is JAX's derivative, bit for bit.

Class tests over random programs (hypothesis), in float32 and float64:

* **no mask, JAX's bits**: programs of singular and smooth ops with no selection and no constant zero,
  at any point: every mode (grad, jacfwd, jacrev, hessian) is plain JAX's, bit for bit, and the rewritten
  program has no layer at all;
* **a masked path is 0**: the same programs behind a mask (``where``'s unused side, ``maximum``'s, a
  product by a constant 0/1 mask, a contraction with a constant zero), at points where the masked side
  is singular: the masked elements are exactly 0 in every mode and in all four second-order compositions,
  and the unmasked ones are plain JAX's;
* **never a plausible wrong number**: removable singularities (a smooth zero times an infinite
  derivative, composed with sqrt/log/pow/trig): SAFE is non-finite there, as JAX is, or the true limit.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from budget import covering
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import gradkit as gk

NIGHTLY = os.environ.get("GRADKIT_NIGHTLY", "") not in ("", "0")
SETTINGS = dict(deadline=None, database=None, derandomize=not NIGHTLY, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
SAFE = gk.tables.SAFE
N = 3

UNARY = {
    "sqrt": jnp.sqrt, "log": jnp.log, "rsqrt": jax.lax.rsqrt, "recip": lambda v: 1.0 / v,
    "pow_half": lambda v: jnp.power(v, 0.5), "arcsin": jnp.arcsin, "sin": jnp.sin, "exp": jnp.exp,
    "square": lambda v: v * v, "cbrt": jnp.cbrt,
}


def programs(depth: int):
    leaf = st.just(("x",))
    if depth == 0:
        return leaf
    sub = st.deferred(lambda: programs(depth - 1))
    return st.one_of(leaf, st.tuples(st.sampled_from(sorted(UNARY)), sub), st.tuples(st.just("add"), sub, sub),
                     st.tuples(st.just("mul"), sub, sub))


def build(prog):
    def ev(p, x):
        if p[0] == "x":
            return x
        if p[0] == "add":
            return ev(p[1], x) + ev(p[2], x)
        if p[0] == "mul":
            return ev(p[1], x) * ev(p[2], x)
        return UNARY[p[0]](ev(p[1], x))
    return lambda x: jnp.sum(ev(prog, x))


MODES = {
    "grad": jax.grad, "jacfwd": jax.jacfwd, "jacrev": jax.jacrev, "hessian": jax.hessian,
}


def _bits(a):
    return np.asarray(a).tobytes()


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@settings(max_examples=4, **SETTINGS)
@given(prog=programs(3), vals=st.lists(st.sampled_from([0.0, 0.25, 1.0, -0.5, 2.0]), min_size=N, max_size=N))
def test_no_mask_is_jax_bit_for_bit(dtype, prog, vals):
    with jax.enable_x64(dtype == "float64"):
        f = build(prog)
        x = jnp.asarray(vals, dtype)
        ours = gk.override(f, SAFE)
        assert "custom_jvp_call" not in str(ours.rewritten_jaxpr(x))  # no layer: JAX's own equations
        for name, mode in MODES.items():
            assert _bits(jax.jit(mode(ours))(x)) == _bits(jax.jit(mode(f))(x)), name


MASKS = {
    # (masked program of g, the masked elements for x) — g is the singular part, masked where x <= 0
    "where": (lambda g, x: jnp.where(x > 0, g(x), 0.0), lambda x: x <= 0),
    "where_both_sides": (lambda g, x: jnp.where(x > 0, g(jnp.where(x > 0, x, 0.0)), 0.0), lambda x: x <= 0),
    "maximum": (lambda g, x: jnp.maximum(jnp.where(x > 0, g(x), -1e30), 1.0), lambda x: x <= 0),
    "bool_mask": (lambda g, x: g(x) * (x > 0).astype(x.dtype), lambda x: x <= 0),
    "upstream": (lambda g, x: jnp.where(x > 0, g(jnp.where(x > 0, x, 1.0)), 0.0), lambda x: x <= 0),
}


# a covering half of mask x dtype (every mask, every dtype); the long version below runs all of it
@pytest.mark.parametrize("mask,dtype", covering(sorted(MASKS), ["float32", "float64"]))
@settings(max_examples=2, **SETTINGS)
@given(prog=programs(2), vals=st.lists(st.sampled_from([0.0, -1.0, 0.5, 2.0]), min_size=N, max_size=N))
def test_a_masked_path_is_zero_in_every_mode(dtype, mask, prog, vals):
    guard, masked = MASKS[mask]
    with jax.enable_x64(dtype == "float64"):
        inner = build(("sqrt", prog))  # singular at 0, NaN below: the masked side
        g = lambda v: jax.vmap(lambda e: inner(e[None]))(v)
        f = lambda x: jnp.sum(guard(g, x))
        x = jnp.asarray(vals, dtype)
        ours = gk.override(f, SAFE)
        # a NaN value is not a mask's business: only programs whose value is finite
        assume(bool(np.isfinite(jax.jit(f)(x))))
        dead = np.asarray(masked(np.asarray(vals)))
        firsts = {n: np.asarray(jax.jit(MODES[n](ours))(x)) for n in ("grad", "jacfwd", "jacrev")}
        plain = np.asarray(jax.jit(jax.grad(f))(x))
        live = ~dead
        # reverse mode (one scalar output): masked elements 0, live ones JAX's (the same operations on the
        # same operands; XLA may fuse a masked equation's products differently by an ulp: JAX 0.8)
        eps = float(np.finfo(np.dtype(dtype)).eps)
        for name in ("grad", "jacrev"):
            assert np.all(firsts[name][dead] == 0), (name, firsts[name])
            np.testing.assert_array_equal(np.isfinite(firsts[name][live]), np.isfinite(plain[live]))
            fin = np.isfinite(plain[live])
            np.testing.assert_allclose(firsts[name][live][fin], plain[live][fin], rtol=4 * eps, atol=0,
                                       err_msg=name)
        # forward mode: one-hot seeds meet a live infinite derivative as 0 * inf in every column (JAX's
        # answer); where the gradient is finite, forward mode is the same answer
        grad_finite = bool(np.all(np.isfinite(firsts["grad"])))
        assert grad_finite == bool(np.all(np.isfinite(firsts["jacfwd"]))), firsts
        if grad_finite:
            scale = float(np.max(np.abs(firsts["grad"]), initial=1.0))
            np.testing.assert_allclose(firsts["jacfwd"], firsts["grad"], rtol=1e-6, atol=1e-12 * scale)
            hs = [np.asarray(jax.jit(h)(x)) for h in (jax.hessian(ours), jax.jacfwd(jax.jacrev(ours)),
                                                      jax.jacrev(jax.jacfwd(ours)), jax.jacrev(jax.jacrev(ours)))]
            fin = [bool(np.all(np.isfinite(h))) for h in hs]
            assert len(set(fin)) == 1, hs
            for h in hs:
                assert np.all(h[dead] == 0) and np.all(h[:, dead] == 0), h
            if fin[0]:
                for h in hs[1:]:
                    np.testing.assert_allclose(h, hs[0], rtol=1e-5, atol=1e-6)


SMOOTH_ZEROS = {"x": lambda x: x, "x2": lambda x: x * x, "sin": jnp.sin, "sqrt_sq": lambda x: jnp.sqrt(x) ** 2}
STEEP = {"sqrt": jnp.sqrt, "log": jnp.log, "pow_half": lambda x: jnp.power(x, 0.5), "arcsin1m": lambda x: jnp.arcsin(
    1.0 - x), "cbrt": jnp.cbrt}


@pytest.mark.parametrize("zero", sorted(SMOOTH_ZEROS))
@pytest.mark.parametrize("steep", sorted(STEEP))
def test_never_a_plausible_wrong_number(zero, steep):
    """A smooth zero times (or composed with) an infinite derivative at 0: SAFE's gradient there is
    non-finite, as JAX's is, or the true one-sided limit (float64 differences)."""
    z, s = SMOOTH_ZEROS[zero], STEEP[steep]
    for f in (lambda x: jnp.sum(z(x) * s(x)), lambda x: jnp.sum(s(z(x)) * z(x))):
        x = jnp.zeros(1)
        got = np.asarray(jax.grad(gk.override(f, SAFE))(x))
        plain = np.asarray(jax.grad(f)(x))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(plain))
        if np.all(np.isfinite(got)):
            with jax.enable_x64(True):
                h = 1e-9
                one_sided = (float(f(jnp.full(1, h, jnp.float64))) - float(f(jnp.zeros(1, jnp.float64)))) / h
            assert got[0] == pytest.approx(one_sided, rel=1e-3, abs=1e-3), (got, one_sided)


# --------------------------------------------------------------------------- the long versions (CI's slow set)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@settings(max_examples=30, **SETTINGS)
@given(prog=programs(4), vals=st.lists(st.sampled_from([0.0, 0.25, 1.0, -0.5, 2.0, -1.0, 4.0]), min_size=N,
                                       max_size=N))
def test_no_mask_is_jax_bit_for_bit_long(dtype, prog, vals):
    test_no_mask_is_jax_bit_for_bit.hypothesis.inner_test(dtype, prog, vals)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("mask", sorted(MASKS))
@settings(max_examples=12, **SETTINGS)
@given(prog=programs(3), vals=st.lists(st.sampled_from([0.0, -1.0, 0.5, 2.0, 1.0, -0.25]), min_size=N, max_size=N))
def test_a_masked_path_is_zero_in_every_mode_long(dtype, mask, prog, vals):
    test_a_masked_path_is_zero_in_every_mode.hypothesis.inner_test(dtype, mask, prog, vals)
