"""gk.tables.F32_BACKWARD / upcast_backward: float32 derivatives for bfloat16 programs, forward unchanged."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

F32 = gk.tables.F32_BACKWARD


def ce(logits, y):
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits, axis=-1) * y, axis=-1))


def confident_logits():
    logits = jnp.array([[9.0, 1.0, 0.0, -1.0], [0.5, 8.0, 1.0, 0.0]], jnp.bfloat16)
    y = jnp.array([[1.0, 0, 0, 0], [0, 1.0, 0, 0]], jnp.bfloat16)
    return logits, y


def f64_grad(fn, *args):
    with jax.enable_x64(True):
        return np.asarray(jax.grad(fn)(*[jnp.asarray(a, jnp.float64) for a in args]))


def test_cross_entropy_gradient_at_the_label_keeps_its_bits(maybe_jit):
    logits, y = confident_logits()
    ref = f64_grad(ce, logits, y)  # p ~ 0.9995 at the label: the gradient there is p - 1 ~ -5e-4
    plain = np.asarray(maybe_jit(jax.grad(ce))(logits, y), np.float64)
    ours = np.asarray(maybe_jit(jax.grad(gk.override(ce, F32)))(logits, y), np.float64)
    label = (np.arange(2), np.array([0, 1]))
    plain_err = np.abs(plain[label] - ref[label]) / np.abs(ref[label])
    ours_err = np.abs(ours[label] - ref[label]) / np.abs(ref[label])
    assert np.all(plain_err > 0.1)  # bf16 autodiff loses most of the bits there
    assert np.all(ours_err < 2 ** -7)  # one bf16 rounding of an accurate float32 value
    assert ours.dtype == np.float64 and jax.grad(gk.override(ce, F32))(logits, y).dtype == jnp.bfloat16


@pytest.mark.parametrize("name, fn, x", [
    ("tanh", jnp.tanh, [3.0, 0.5, -2.5, 0.0]),
    ("logistic", jax.nn.sigmoid, [6.0, 0.5, -3.0, 0.0]),
    ("exp", jnp.exp, [3.0, 0.5, -2.5, 0.0]),
    ("log", jnp.log, [3.0, 0.5, 1.5, 7.0]),
    ("rsqrt", jax.lax.rsqrt, [3.0, 0.5, 1.5, 7.0]),
])
def test_primitive_derivatives_match_float32(maybe_jit, name, fn, x):
    x16 = jnp.asarray(x, jnp.bfloat16)
    table = gk.tables.upcast_backward(name)
    f = lambda v: jnp.sum(fn(v))
    ours = maybe_jit(jax.grad(gk.override(f, table)))(x16)
    expected = jax.grad(f)(x16.astype(jnp.float32)).astype(jnp.bfloat16)  # f32 derivative, rounded once
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(expected, np.float32))
    assert name in F32


def test_forward_is_bit_identical(maybe_jit):
    logits, y = confident_logits()

    def model(w, x):
        h = jax.nn.standardize(x @ w, axis=-1) * jnp.tanh(x @ w)
        return ce(jnp.exp(h) - jax.nn.sigmoid(h), y) + jnp.sum(jax.lax.rsqrt(jnp.abs(h) + 1))

    w = jnp.linspace(-1, 1, 16, dtype=jnp.float32).reshape(4, 4).astype(jnp.bfloat16)
    plain, ours = maybe_jit(model), maybe_jit(gk.override(model, F32))
    assert np.asarray(plain(w, logits)).tobytes() == np.asarray(ours(w, logits)).tobytes()
    v1, _ = maybe_jit(jax.value_and_grad(model))(w, logits)
    v2, _ = maybe_jit(jax.value_and_grad(gk.override(model, F32)))(w, logits)
    assert np.asarray(v1).tobytes() == np.asarray(v2).tobytes()


def test_every_mode(maybe_jit):
    x = jnp.asarray([3.0, 0.5, 1.0], jnp.bfloat16)  # no cancellation between the two products' paths
    f = lambda v: jnp.sum(jnp.tanh(v) * jnp.exp(v * 0.5))
    g = gk.override(f, F32)
    ref_g = jax.grad(f)(x.astype(jnp.float32))
    np.testing.assert_allclose(np.asarray(maybe_jit(jax.grad(g))(x), np.float32), ref_g, rtol=2 ** -7)
    t = jnp.asarray([1.0, -1.0, 0.5], jnp.bfloat16)
    _, jt = maybe_jit(lambda x, t: jax.jvp(g, (x,), (t,)))(x, t)
    np.testing.assert_allclose(float(jt), float(ref_g @ t.astype(jnp.float32)), rtol=2 ** -6)
    np.testing.assert_allclose(np.asarray(maybe_jit(jax.jacfwd(g))(x), np.float32), ref_g, rtol=2 ** -7)
    h = np.asarray(maybe_jit(jax.hessian(g))(x), np.float32)
    ref_h = np.asarray(jax.hessian(f)(x.astype(jnp.float32)))
    np.testing.assert_allclose(h, ref_h, rtol=2 ** -5, atol=2 ** -6 * np.max(np.abs(ref_h)))


def test_log_softmax_jvp_and_hessian_against_float64(maybe_jit):
    logits, y = confident_logits()
    g = gk.override(lambda z: ce(z, y), F32)
    with jax.enable_x64(True):
        ref_h = np.asarray(jax.hessian(lambda z: ce(z, y.astype(jnp.float64)))(logits.astype(jnp.float64)))
    h = np.asarray(maybe_jit(jax.hessian(g))(logits), np.float64)
    assert np.max(np.abs(h - ref_h)) <= 2 ** -6 * np.max(np.abs(ref_h))


def test_float32_and_wider_inputs_are_unchanged(maybe_jit):
    x = jnp.asarray([3.0, 0.5], jnp.float32)
    f = lambda v: jnp.sum(jnp.tanh(v) + jnp.exp(v))
    a = maybe_jit(jax.grad(f))(x)
    b = maybe_jit(jax.grad(gk.override(f, F32)))(x)
    np.testing.assert_array_equal(a, b)


def test_float64_derivative(x64):
    x = jnp.asarray([3.0, 0.5], jnp.float32)
    f = lambda v: jnp.sum(jnp.tanh(v))
    g = jax.grad(gk.override(f, gk.tables.upcast_backward("tanh", dtype=jnp.float64)))(x)
    assert g.dtype == jnp.float32
    np.testing.assert_allclose(g, 1 - np.tanh(np.float64([3.0, 0.5])) ** 2, rtol=1e-7)


@pytest.mark.parametrize("args, kwargs, match", [
    ((), {}, "expected op names"),
    (("exp", " log"), {}, "expected op names"),
    (("exp",), {"dtype": jnp.bfloat16}, "dtype must be float32 or float64"),
    (("exp",), {"dtype": jnp.int32}, "dtype must be float32 or float64"),
])
def test_bad_arguments(args, kwargs, match):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] upcast_backward: " + match):
        gk.tables.upcast_backward(*args, **kwargs)


def test_a_named_op_is_a_gradkit_error():
    @gk.op("my_ce")
    def my_ce(z):
        return jnp.sum(jax.nn.log_softmax(z))

    f = gk.override(lambda z: my_ce(z), gk.tables.upcast_backward("my_ce"))
    with pytest.raises(gk.GradkitError, match=r"upcast_backward\[my_ce\].*neither \(a gk.op\?\)"):
        jax.grad(f)(jnp.ones(3, jnp.bfloat16))


def test_described_and_fingerprinted():
    assert F32.fingerprint == gk.tables.upcast_backward(*F32).fingerprint
    assert gk.tables.describe(F32)["fn:log_softmax"] == "gradkit.upcast_backward[fn:log_softmax]"


def test_under_vmap_reverse_and_forward(maybe_jit):
    logits, y = confident_logits()  # per-example cross-entropy, batched by vmap
    one = lambda z, t: -jnp.sum(jax.nn.log_softmax(z) * t)
    ours = gk.override(one, F32)
    with jax.enable_x64(True):
        ref = np.asarray(jax.vmap(jax.grad(one))(logits.astype(jnp.float64), y.astype(jnp.float64)))
    g = np.asarray(maybe_jit(jax.vmap(jax.grad(ours)))(logits, y), np.float64)
    plain = np.asarray(maybe_jit(jax.vmap(jax.grad(one)))(logits, y), np.float64)
    scale = np.max(np.abs(ref), axis=-1, keepdims=True)
    assert np.max(np.abs(g - ref) / scale) < 2 ** -7
    assert np.max(np.abs(plain - ref) / scale) > 10 * np.max(np.abs(g - ref) / scale)
    # forward mode under vmap: jvp along each example's own direction, and jacfwd
    t = jnp.asarray([[1.0, -1.0, 0.5, 0.0], [0.25, 1.0, -0.5, 1.0]], jnp.bfloat16)
    _, jt = maybe_jit(jax.vmap(lambda z, yy, tt: jax.jvp(lambda v: ours(v, yy), (z,), (tt,))))(logits, y, t)
    np.testing.assert_allclose(np.asarray(jt, np.float64), np.sum(ref * np.asarray(t, np.float64), -1),
                               rtol=2 ** -6)
    jf = np.asarray(maybe_jit(jax.vmap(jax.jacfwd(ours)))(logits, y), np.float64)
    assert np.max(np.abs(jf - ref) / scale) < 2 ** -7


def test_a_broadcast_bias_gradient_is_summed_in_float32(maybe_jit):
    # the cotangent of b in x + b[None] is a sum over the batch, here of terms that mostly cancel (as
    # p - y does): summed in bfloat16 it loses bits row by row
    w = jax.random.uniform(jax.random.key(0), (4096, 8), jnp.float32, -1.0, 1.0).astype(jnp.bfloat16)
    x = jnp.zeros((4096, 8), jnp.bfloat16)
    f = lambda b: jnp.sum((x + b[None, :]) * w)
    b = jnp.zeros(8, jnp.bfloat16)
    ref = np.sum(np.asarray(w, np.float64), axis=0)
    ours = np.asarray(maybe_jit(jax.grad(gk.override(f, F32)))(b), np.float64)
    plain = np.asarray(maybe_jit(jax.grad(f))(b), np.float64)
    err = lambda g: np.max(np.abs(g - ref) / np.abs(ref))
    assert err(ours) <= 2 ** -8  # one rounding of the float32 sum
    assert err(ours) <= err(plain)
    if jax.default_backend() == "cpu":  # XLA:CPU sums bfloat16 in bfloat16; XLA:GPU already in float32 (H200)
        assert err(plain) > 4 * err(ours)
