"""SAFE's first-call cost: fewer masks for XLA to compile, the same gradients bit for bit.

* ``safe_scale`` lowers its masks as nested selects on the comparisons of its
  lax form: the same bits as the lax form, element for element, on every
  special value (signed zeros, subnormals, infinities, NaN).
* A product by a value the program computes from literals alone (the seed of
  a ``jax.grad`` inside the program: ``broadcast_in_dim 1.0``, ``0.5 * that``)
  is JAX's equation when that value is finite, nonzero and normal, like a
  product by a literal; an equation with no varying input has no layer. A
  constant that is 0, subnormal or not finite keeps the masked rule.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_rule_layers import _count  # equations of one primitive, at any depth

import gradkit as gk
from gradkit._src import compat
from gradkit._src.compat import primitive
from gradkit._src.core import splice

SAFE = gk.tables.SAFE


def _bits(x):
    x = np.asarray(x)
    return x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.dtype.itemsize])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("divide", [False, True])
def test_lowering_is_the_lax_form_bit_for_bit(dtype, divide):
    fi = jnp.finfo(dtype)
    vals = [0.0, -0.0, 1.0, -1.0, 2.5, -3.0, float(fi.tiny), -float(fi.tiny), float(fi.tiny) / 4,
            -float(fi.tiny) / 8, float(fi.max), -float(fi.max), np.inf, -np.inf, np.nan, -np.nan, 1e-3, 7.0]
    vals = np.array(vals, np.float64).astype(dtype)
    pairs = list(itertools.product(vals, vals))
    if divide:  # 0 / subnormal: XLA's CPU backend divides by it as by 0 but does not compare it equal to 0,
        # in this lowering as in the one before it (the same bits), unlike the lax form run op by op
        pairs = [(a, b) for a, b in pairs if not (b != 0 and abs(float(b)) < float(fi.tiny))]
    t, d = (np.array(x, dtype) for x in zip(*pairs))
    if divide:  # a subnormal t over the 1 the mask puts in (XLA's CPU backend compares a subnormal equal to 0):
        # whether the quotient keeps the subnormal or flushes it to 0 depends on the kernel XLA makes of the
        # program around it, not on the lowering (seen: the compiled lax form keeps it where this lowering
        # flushes it on jaxlib 0.8, the other way round on 0.10 and 0.12; an eager divide flushes it on some
        # CPUs). Both are the zero the mask means; every other pair is compared bit for bit.
        keep = ~((t != 0) & (np.abs(t.astype(np.float64)) < float(fi.tiny)))
        ts, ds = t[~keep], d[~keep]
        sub = np.asarray(jax.jit(lambda t, d: compat.safe_scale(t, d, divide=True))(ts, ds)).astype(np.float64)
        alt = np.asarray(jax.jit(lambda t, d: primitive._safe_scale_value(t, d, divide=True))(ts, ds))
        alt = alt.astype(np.float64)
        assert np.all((sub == alt) | (np.isnan(sub) & np.isnan(alt)) | (sub == 0) & (alt == ts.astype(np.float64))
                      | (sub == ts.astype(np.float64)) & (alt == 0)), (ts, ds, sub, alt)
        t, d = t[keep], d[keep]
    lowered = jax.jit(lambda t, d: compat.safe_scale(t, d, divide=divide))(t, d)
    # what the lowering replaces: the lax form, compiled by XLA in the same way
    compiled = jax.jit(lambda t, d: primitive._safe_scale_value(t, d, divide=divide))(t, d)
    _assert_same_bits(lowered, compiled)
    # the lax form, one operation at a time (no fusion, no simplification across them)
    t, d = jnp.asarray(t), jnp.asarray(d)
    with jax.disable_jit():
        zero = jnp.zeros_like(t)
        t_zero, d_zero = t == zero, d == zero
        finite = lambda x: ~((x - x) != zero)
        if divide:
            ref = t / jnp.where(t_zero & (d_zero | ~finite(d)), jnp.ones_like(d), d)
        else:
            ref = jnp.where(d_zero & ~finite(t), zero, t) * jnp.where(t_zero & ~finite(d), zero, d)
    _assert_same_bits(lowered, ref)


def _assert_same_bits(got, want):
    """Bit for bit, signs of zero included; a NaN times a NaN is a NaN whichever operand's payload it keeps."""
    got, want = np.asarray(got), np.asarray(want)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(np.where(both_nan, 0, _bits(got)), np.where(both_nan, 0, _bits(want)))


def test_lowering_keeps_jax_product_inside_a_fused_sum():
    # t * d + c fused by XLA (FMA contraction where it applies): the masked product fuses the same way
    key = jax.random.key(0)
    t, d, c = (jax.random.normal(k, (4096,), jnp.float32) for k in jax.random.split(key, 3))
    got = jax.jit(lambda t, d, c: compat.safe_scale(t, d) + c)(t, d, c)
    want = jax.jit(lambda t, d, c: t * d + c)(t, d, c)
    np.testing.assert_array_equal(_bits(got), _bits(want))


def _potential(q, x, y):
    resid = y - x @ q[:4]
    scale = jnp.exp(q[4])
    return jnp.sum(0.5 * (resid / scale) ** 2 + jnp.log(scale)) + 0.5 * jnp.sum(q ** 2)


def _energy(q, p, x, y):  # a leapfrog step: jax.grad inside, differentiated again (as HMC)
    p = p - 0.005 * jax.grad(_potential)(q, x, y)
    q = q + 0.01 * p
    return _potential(q, x, y) + 0.5 * jnp.sum(p ** 2)


def _hmc_args():
    x = jax.random.normal(jax.random.key(1), (12, 4), jnp.float32)
    y = x @ jnp.array([1.0, -1.0, 0.5, 0.0]) + 0.1
    q = jnp.array([0.3, -0.2, 0.1, 0.0, -0.5], jnp.float32)
    p = jax.random.normal(jax.random.key(2), (5,), jnp.float32)
    return q, p, x, y


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_products_by_a_grad_seed_keep_jax_equation():
    """A leapfrog step with jax.grad inside (HMC): no selection and no constant zero anywhere (the inner
    grad's seed is a constant, but not a zero), so no mask reaches any product: SAFE leaves JAX's own
    equations — no layer — and grad and hessian are those of the function under an empty table, bit for bit
    (which is jax.jit's; differentiating through that jit may move XLA's fusion by an ulp against the plain
    function on some JAX versions, hence the rounding bound there)."""
    q, p, x, y = _hmc_args()
    ours = gk.override(_energy, SAFE | gk.tables.STABLE)
    bare = gk.override(_energy, {})
    body = ours.rewritten_jaxpr(q, p, x, y)
    assert _count(getattr(body, "jaxpr", body), "custom_jvp_call") == 0
    for t in (jax.grad, jax.hessian):
        got = jax.jit(t(ours, argnums=(0, 1)))(q, p, x, y)
        want = jax.jit(t(bare, argnums=(0, 1)))(q, p, x, y)
        plain = jax.jit(t(_energy, argnums=(0, 1)))(q, p, x, y)
        for g, w, r in zip(*(jax.tree_util.tree_leaves(v) for v in (got, want, plain))):
            np.testing.assert_array_equal(_bits(g), _bits(w))
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("make_c,masked", [
    (lambda: jnp.full((3,), 0.0, jnp.float32), True),  # zero: a mask
    # subnormal: a value, not a mask (XLA on CPU may read it as 0 in the product: its 0 * inf stays)
    (lambda: jnp.full((3,), 1e-30, jnp.float32) * 1e-10, False),
    (lambda: jnp.full((3,), 1e30, jnp.float32) * 1e30, True),  # overflows to inf: the wheres drop it
    (lambda: jnp.full((3,), 3.0, jnp.float32) / 0.0, True),
])
def test_a_constant_that_can_mask_keeps_the_rule(make_c, masked):
    x = jnp.asarray([0.0, 1.0, 4.0], jnp.float32)

    def f(x):
        c = make_c()
        # sqrt's cotangent is inf at 0 (meets c == 0), and the where drops c * x (a zero cotangent meets inf)
        return jnp.sum(jnp.where(jnp.isfinite(c * x) & (c != 0), jnp.sqrt(x) * c, 0.0)) + jnp.sum(
            jnp.where(jnp.isfinite(c), c * x, 0.0)) + jnp.sum(jnp.sqrt(c * x) * 0.0)

    g = np.asarray(jax.jit(jax.grad(gk.override(f, SAFE)))(x))
    plain = np.asarray(jax.jit(jax.grad(f))(x))
    finite = np.isfinite(plain)
    np.testing.assert_array_equal(g[finite], plain[finite])  # where JAX is finite: JAX's answer
    if masked:  # every path through sqrt masked: 0, not JAX's NaN
        assert np.all(np.isfinite(g)), g
    jaxpr = jax.make_jaxpr(jax.grad(gk.override(f, SAFE)))(x).jaxpr
    assert _count(jaxpr, "gradkit_masked_scale") > 0


def test_masked_singularity_still_zero_with_constant_scales():
    # a constant-scaled singular op under a where: 0, not NaN, in every mode and at second order
    def f(x):
        c = jnp.full(x.shape, 0.5, jnp.float32) * 2.0  # computed from literals: JAX's mul
        return jnp.sum(jnp.where(x > 0, c * jnp.log(x), 0.0) + c * x)

    ours = gk.override(f, SAFE)
    x = jnp.asarray([0.0, 1.0, 2.0], jnp.float32)
    g = jax.jit(jax.grad(ours))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray([1.0, 2.0, 1.5], np.float32))
    jv = jax.jit(lambda x: jax.jvp(ours, (x,), (jnp.ones_like(x).at[0].set(0.0),))[1])(x)
    assert np.isfinite(np.asarray(jv))
    h = jax.jit(jax.hessian(ours))(x)
    assert np.all(np.isfinite(np.asarray(h)))
    np.testing.assert_array_equal(np.asarray(h)[0], np.zeros(3, np.float32))


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_programs_with_prng_keys_are_unchanged(impl):
    """Constant tracking reads every equation's output type: a typed PRNG key (``key<fry>``) is no NumPy dtype.

    Keys made, split, folded and used inside the program, and keys passed in, under SAFE | STABLE: the value and
    the gradient are plain JAX's, bit for bit (the Flax NNX dropout case that first broke).
    """
    def loss(x, key):
        k1, k2 = jax.random.split(jax.random.fold_in(key, 3))
        keep = jax.random.bernoulli(k1, 0.75, x.shape)
        noise = jax.random.normal(k2, x.shape, x.dtype) * 0.5
        inner = jax.random.key(7, impl=impl)  # a key made from a literal: a constant of the program
        shift = jax.random.uniform(inner, x.shape, x.dtype)
        return jnp.sum(jnp.where(keep, jnp.sqrt(x * x + 1.0) * noise, 0.0) / 0.75 + shift * x)

    x = jnp.linspace(-1.0, 2.0, 16, dtype=jnp.float32)
    key = jax.random.key(0, impl=impl)
    ours = gk.override(loss, gk.tables.SAFE | gk.tables.STABLE)
    v0, g0 = jax.jit(jax.value_and_grad(loss))(x, key)  # an overridden function runs compiled, as jax.jit's
    for wrap in (lambda f: f, jax.jit):
        v1, g1 = wrap(jax.value_and_grad(ours))(x, key)
        np.testing.assert_array_equal(np.asarray(v1), np.asarray(v0))
        np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))
