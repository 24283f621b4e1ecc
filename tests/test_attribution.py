"""gk.attribution against independent implementations.

* an MLP whose backward pass is written out in NumPy, float64, for every
  method (the ReLU rules by their definitions);
* unmodified Flax linen and Equinox models against the same models built with
  a hand-written ``jax.custom_vjp`` ReLU (the peer libraries' way: swap the
  activation module);
* the ``target`` forms, ``vmap`` over a batch, and bad input.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

RNG = np.random.default_rng(0)
W = [RNG.normal(size=(6, 8)) / 2, RNG.normal(size=(8, 8)) / 2, RNG.normal(size=(8, 4)) / 2]
B = [RNG.normal(size=8) / 4, RNG.normal(size=8) / 4, RNG.normal(size=4) / 4]
X = RNG.normal(size=(5, 6))


def mlp(x):
    def affine(h, w, b):
        b = jnp.asarray(b, jnp.float32)
        return h @ jnp.asarray(w, jnp.float32) + jnp.broadcast_to(b, h.shape[:-1] + b.shape)

    h = x
    for w, b in zip(W[:-1], B[:-1]):
        h = jax.nn.relu(affine(h, w, b))
    return affine(h, W[-1], B[-1])


def numpy_attribution(x, cot, relu_backward):
    """The MLP's backward pass in float64 with ``relu_backward(z, g)`` at each ReLU."""
    zs, h = [], x
    for w, b in zip(W[:-1], B[:-1]):
        z = h @ w + b
        zs.append(z)
        h = np.maximum(z, 0)
    g = cot @ W[-1].T
    for w, z in zip(reversed(W[:-1]), reversed(zs)):
        g = relu_backward(z, g) @ w.T
    return g


RULES = {
    "gradient": lambda z, g: g * (z > 0),
    "guided_backprop": lambda z, g: g * (z > 0) * (g > 0),
    "deconvnet": lambda z, g: g * (g > 0),
}


@pytest.mark.parametrize("method", sorted(RULES))
def test_each_method_is_its_definition_on_an_mlp(method, maybe_jit):
    target = np.array([0, 3, 1, 2, 3])
    got = maybe_jit(lambda x, t: getattr(gk.attribution, method)(mlp, x, target=t))(jnp.asarray(X, jnp.float32),
                                                                                      jnp.asarray(target))
    want = numpy_attribution(X, np.eye(4)[target], RULES[method])
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=1e-5 * scale, rtol=0)
    assert method == "gradient" or not np.allclose(want, numpy_attribution(X, np.eye(4)[target], RULES["gradient"]))


def test_gradient_x_input_and_gradient_are_jax_grad(maybe_jit):
    x = jnp.asarray(X[0], jnp.float32)
    ref = jax.grad(lambda v: mlp(v)[2])(x)
    np.testing.assert_array_equal(maybe_jit(lambda v: gk.attribution.gradient(mlp, v, target=2))(x), ref)
    np.testing.assert_array_equal(maybe_jit(lambda v: gk.attribution.gradient_x_input(mlp, v, target=2))(x), x * ref)


@jax.custom_vjp
def guided_relu(x):
    return jnp.maximum(x, 0.0)


guided_relu.defvjp(lambda x: (jnp.maximum(x, 0.0), x), lambda x, g: (jnp.where((x > 0) & (g > 0), g, 0.0),))


@jax.custom_vjp
def deconv_relu(x):
    return jnp.maximum(x, 0.0)


deconv_relu.defvjp(lambda x: (jnp.maximum(x, 0.0), x), lambda x, g: (jnp.where(g > 0, g, 0.0),))

SWAPPED = {"guided_backprop": guided_relu, "deconvnet": deconv_relu}


class CNN(nn.Module):
    act: object = nn.relu

    @nn.compact
    def __call__(self, x):
        x = self.act(nn.Conv(8, (3, 3))(x))
        x = nn.max_pool(x, (2, 2), (2, 2))
        x = self.act(nn.Conv(8, (3, 3))(x))
        n, h, w, c = x.shape  # 2x2 average pooling (flax's avg_pool divides by an int: strict promotion)
        x = jnp.mean(x.reshape(n, h // 2, 2, w // 2, 2, c), axis=(2, 4))
        x = self.act(nn.Dense(16)(x.reshape(x.shape[0], -1)))
        return nn.Dense(10)(x)


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@pytest.mark.parametrize("method", sorted(SWAPPED))
def test_unmodified_flax_cnn_equals_the_model_with_its_relu_swapped(method):
    x = jax.random.normal(jax.random.key(1), (4, 12, 12, 3))
    params = CNN().init(jax.random.key(0), x)
    target = jnp.array([1, 7, 3, 0])
    ours = jax.jit(lambda x: getattr(gk.attribution, method)(lambda v: CNN().apply(params, v), x, target=target))(x)
    ref = jax.grad(lambda v: jnp.sum(CNN(act=SWAPPED[method]).apply(params, v) * jax.nn.one_hot(target, 10)))(x)
    np.testing.assert_allclose(ours, ref, atol=1e-6 * float(jnp.max(jnp.abs(ref))), rtol=0)
    plain = gk.attribution.gradient(lambda v: CNN().apply(params, v), x, target=target)
    assert not np.allclose(ours, plain)  # the rule changed something


@pytest.mark.parametrize("method", sorted(SWAPPED))
def test_unmodified_equinox_mlp_equals_the_model_with_its_relu_swapped(method):
    model = eqx.nn.MLP(6, 4, 16, 2, key=jax.random.key(2))  # jax.nn.relu by default
    swapped = eqx.nn.MLP(6, 4, 16, 2, activation=SWAPPED[method], key=jax.random.key(2))
    x = jnp.asarray(X, jnp.float32)
    ours = getattr(gk.attribution, method)(jax.vmap(model), x, target=jnp.array([0, 1, 2, 3, 0]))
    ref = jax.grad(lambda v: jnp.sum(jax.vmap(swapped)(v) * jax.nn.one_hot(jnp.array([0, 1, 2, 3, 0]), 4)))(x)
    np.testing.assert_allclose(ours, ref, atol=1e-6, rtol=1e-6)


def test_target_forms_agree_and_vmap_is_the_batched_call():
    x = jnp.asarray(X, jnp.float32)
    out = mlp(x)
    rows = jnp.argmax(out, axis=-1)
    gb = gk.attribution.guided_backprop
    default = gb(mlp, x)
    np.testing.assert_array_equal(default, gb(mlp, x, target=rows))
    np.testing.assert_array_equal(default, gb(mlp, x, target=jax.nn.one_hot(rows, 4)))
    one = gb(mlp, x, target=2)
    np.testing.assert_array_equal(one, gb(mlp, x, target=jnp.full(5, 2)))
    per_row = jax.vmap(lambda xi, ti: gb(mlp, xi, target=ti))(x, rows)
    np.testing.assert_allclose(per_row, default, atol=1e-6, rtol=0)
    assert gb(mlp, x, target=2).shape == x.shape and gb(mlp, x).dtype == jnp.float32


@pytest.mark.parametrize("target, match", [
    (4, r"target class 4 is outside the output's 4 classes"),
    (jnp.array([0, 1]), r"target has shape \(2,\); give one class index, or one per row of the output \(shape \(5,\)\)"),
    (jnp.ones((5, 3)), r"target must be a class index, one per row .*got float32\[5, 3\]"),
])
def test_bad_targets_are_gradkit_errors(target, match):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] attribution\.guided_backprop: " + match):
        gk.attribution.guided_backprop(mlp, jnp.asarray(X, jnp.float32), target=target)


def test_bad_models_and_inputs_are_gradkit_errors():
    with pytest.raises(gk.GradkitError, match=r"attribution\.gradient: x must be floating point"):
        gk.attribution.gradient(mlp, jnp.ones((2, 6), jnp.int32))
    with pytest.raises(gk.GradkitError, match=r"attribution\.deconvnet: the model must return one array"):
        gk.attribution.deconvnet(lambda v: (mlp(v), v), jnp.asarray(X, jnp.float32))
    with pytest.raises(gk.GradkitError, match=r"attribution\.gradient: expected the model as a function"):
        gk.attribution.gradient(3, jnp.ones(2))
