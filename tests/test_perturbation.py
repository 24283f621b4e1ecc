"""gk.attribution.perturbation_curve: the faithfulness protocol against a loop-by-loop NumPy re-implementation,
known cases (a linear model, random orders), jit/eager, batched/per example, one program for all steps, errors."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit import GradkitError

curve = gk.attribution.perturbation_curve


def np_reference(f, x, r, steps, patch, baseline=0.0, target=None):
    """The protocol written out with loops in float64: units, their order, each perturbed example on its own."""
    x, r = np.asarray(x, np.float64), np.asarray(r, np.float64)
    base = np.broadcast_to(np.asarray(baseline, np.float64), x.shape)
    grid = [n // p for n, p in zip(x.shape[1:], patch)]
    units = list(itertools.product(*[range(g) for g in grid]))

    def where(u):
        return tuple(slice(i * p, (i + 1) * p) for i, p in zip(u, patch))

    out0 = f(x)
    t = out0.argmax(-1) if target is None else np.broadcast_to(target, out0.shape[:1])
    most, least = np.zeros((len(x), steps + 1)), np.zeros((len(x), steps + 1))
    for b in range(len(x)):
        unit_r = np.array([r[b][where(u)].sum() for u in units])
        for order, into in ((np.argsort(-unit_r, kind="stable"), most), (np.argsort(unit_r, kind="stable"), least)):
            for k in range(steps + 1):
                xp = x[b].copy()
                for u in order[:int(np.floor(k * len(units) / steps + 0.5))]:
                    xp[where(units[u])] = base[b][where(units[u])]
                into[b, k] = f(xp[None])[0, t[b]] / out0[b, t[b]]
    return most, least, (least - most).mean(-1)


def params(seed, d=4, h=8, c=3):
    rng = np.random.default_rng(seed)
    return {"w1": rng.normal(0, 0.7, (d, h)), "b1": rng.normal(0, 0.1, h), "q": rng.normal(0, 1.0, d),
            "w2": rng.normal(0, 0.7, (h, c)), "b2": np.array([5.0, 4.5, 4.0])[:c]}


def np_model(p, x):  # x [B, T, D]: a tanh layer, attention-like pooling over tokens, a head
    h = np.tanh(x @ p["w1"] + p["b1"])
    a = np.exp(x @ p["q"])
    a = a / a.sum(-1, keepdims=True)
    return np.einsum("bt,bth->bh", a, h) @ p["w2"] + p["b2"]


def jax_model(p, x):
    p = jax.tree.map(lambda v: jnp.asarray(v, jnp.float32), p)
    h = jnp.tanh(x @ p["w1"] + p["b1"][None, None])
    a = jax.nn.softmax(x @ p["q"], axis=-1)
    return jnp.einsum("bt,bth->bh", a, h) @ p["w2"] + p["b2"][None]


def data(seed, shape):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return jax.random.normal(k1, shape), jax.random.normal(k2, shape)


@pytest.mark.parametrize("patch,steps", [((1, 4), 5), ((1, 1), 7), ((2, 2), 1), ((6, 4), 3)])
def test_equals_the_numpy_protocol(patch, steps):
    p = params(0)
    x, r = data(1, (3, 6, 4))
    got = curve(lambda e: jax_model(p, e), x, r, steps=steps, patch=patch)
    most, least, area = np_reference(lambda e: np_model(p, e), x, r, steps, patch)
    np.testing.assert_allclose(got.most_relevant_first, most, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.least_relevant_first, least, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.area, area, rtol=1e-4, atol=1e-5)
    units = (6 // patch[0]) * (4 // patch[1])
    np.testing.assert_allclose(got.fractions, np.floor(np.arange(steps + 1) * units / steps + 0.5) / units)


def test_image_patches_baseline_array_and_targets():
    rng = np.random.default_rng(2)
    w = rng.normal(0, 1, (4 * 6 * 2, 3))
    np_f = lambda x: np.tanh(x.reshape(len(x), -1)) @ w
    f = lambda x: jnp.tanh(x.reshape(x.shape[0], -1)) @ jnp.asarray(w, jnp.float32)
    x, r = data(3, (2, 4, 6, 2))
    base = jnp.asarray(rng.normal(0, 1, (1, 4, 6, 2)), jnp.float32)  # broadcast over the batch
    target = np.array([2, 0])
    got = curve(f, x, r, steps=4, patch=(2, 3, None), baseline=base, target=jnp.asarray(target))
    most, least, area = np_reference(np_f, x, r, 4, (2, 3, 2), baseline=base, target=target)
    np.testing.assert_allclose(got.most_relevant_first, most, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.least_relevant_first, least, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got.area, area, rtol=1e-4, atol=1e-5)
    # one class for every row, and the same as an output cotangent (the output's dot product with it)
    one = curve(f, x, r, steps=4, patch=(2, 3, 2), baseline=base, target=1)
    cot = curve(f, x, r, steps=4, patch=(2, 3, 2), baseline=base, target=jax.nn.one_hot(jnp.array([1, 1]), 3))
    np.testing.assert_allclose(one.most_relevant_first, cot.most_relevant_first, rtol=1e-6)
    assert not np.allclose(one.most_relevant_first, got.most_relevant_first)


def test_linear_model_known_curves():
    """f(x) = x·w with baseline 0: the target output after removing units S is total − Σ_{i∈S} w_i x_i, so with
    relevance w·x the most-first curve is 1 − (sum of the k largest)/total, exactly."""
    rng = np.random.default_rng(4)
    w = np.abs(rng.normal(0, 1, (12, 2))) + 0.1
    x = np.abs(rng.normal(0, 1, (5, 12))) + 0.1
    f = lambda x: x @ jnp.asarray(w, jnp.float32)
    r = x * w[:, 0]
    c = curve(f, jnp.asarray(x, jnp.float32), jnp.asarray(r, jnp.float32), target=0, steps=12)
    desc = -np.sort(-r, axis=-1)
    total = r.sum(-1, keepdims=True)
    expected_most = 1 - np.concatenate([np.zeros((5, 1)), np.cumsum(desc, -1)], -1) / total
    expected_least = 1 - np.concatenate([np.zeros((5, 1)), np.cumsum(desc[:, ::-1], -1)], -1) / total
    np.testing.assert_allclose(c.most_relevant_first, expected_most, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c.least_relevant_first, expected_least, rtol=1e-5, atol=1e-6)
    most = np.asarray(c.most_relevant_first)
    assert np.all(np.diff(most, axis=-1) < 0)  # every contribution is positive: each removal lowers the output
    assert np.all(most <= np.asarray(c.least_relevant_first) + 1e-6)
    assert np.all(np.asarray(c.area) > 0.1)
    np.testing.assert_allclose(c.fractions, np.arange(13) / 12)
    np.testing.assert_allclose(most[:, -1], 0.0, atol=1e-6)  # everything replaced by 0: the output is 0


def test_random_order_has_area_about_zero_and_gradient_x_input_more():
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.normal(0, 0.3, (16, 2)), jnp.float32)
    f = lambda x: x @ w + 10.0  # a bias no removal touches: the outputs stay far from 0
    n = 400  # one seed per example
    x = jax.random.normal(jax.random.key(6), (n, 16)) + 0.5
    t = jnp.argmax(f(x), -1)
    random = curve(f, x, jax.random.normal(jax.random.key(7), x.shape), steps=8)
    area = np.asarray(random.area)
    assert abs(area.mean()) < 4 * area.std() / np.sqrt(n), (area.mean(), area.std())
    assert area.std() > 0.01  # the random orders do differ
    gxi = curve(f, x, gk.attribution.gradient_x_input(f, x), steps=8)
    # the k largest contributions outweigh the k smallest: never a negative area, and far above random's
    assert np.all(np.asarray(gxi.area) >= -1e-6)
    assert np.asarray(gxi.area).mean() > 20 * area.std() / np.sqrt(n), (np.asarray(gxi.area).mean(), area.std())
    np.testing.assert_array_equal(t, jnp.argmax(f(x), -1))


def test_jit_and_eager_agree_and_batched_equals_per_example():
    p = params(8)
    f = lambda e: jax_model(p, e)
    x, r = data(9, (3, 6, 4))
    eager = curve(f, x, r, steps=6, patch=(1, None))
    jitted = jax.jit(lambda x, r, t: curve(f, x, r, steps=6, patch=(1, None), target=t))(x, r, jnp.argmax(f(x), -1))
    for a, b in zip(eager, jitted):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for i in range(3):
        one = curve(f, x[i:i + 1], r[i:i + 1], steps=6, patch=(1, None))
        np.testing.assert_allclose(one.most_relevant_first, eager.most_relevant_first[i:i + 1], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(one.least_relevant_first, eager.least_relevant_first[i:i + 1], rtol=1e-5,
                                   atol=1e-6)
        np.testing.assert_allclose(one.area, eager.area[i:i + 1], rtol=1e-5, atol=1e-6)
    chunked = curve(f, x, r, steps=6, patch=(1, None), batch_size=5)
    for a, b in zip(eager, chunked):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_steps_are_one_program_not_a_loop():
    p = params(10)
    f = lambda e: jax_model(p, e)
    x, r = data(11, (2, 6, 4))

    def tanhs(steps):
        jaxpr = jax.make_jaxpr(lambda x, r: curve(f, x, r, steps=steps, patch=(1, None)))(x, r)
        return str(jaxpr).count(" tanh ")

    assert tanhs(2) == tanhs(12) == 2  # the model once at x, once vmapped over every perturbed batch


def test_model_objects_that_cannot_be_hashed():
    class Model:
        __hash__ = None  # e.g. a dataclass holding arrays

        def __init__(self, w):
            self.w = w

        def __call__(self, x):
            return x @ self.w

    w = jnp.asarray(np.random.default_rng(12).normal(0, 1, (6, 3)), jnp.float32)
    x, r = data(13, (2, 6))
    c = curve(Model(w), x, r, steps=3)
    d = curve(lambda x: x @ w, x, r, steps=3)
    np.testing.assert_allclose(c.area, d.area, rtol=1e-6)


@pytest.mark.parametrize("kwargs,relevance_shape,x_shape,message", [
    ({}, (2, 5), (2, 6), "relevance must be shaped like x"),
    ({"patch": (4,)}, (2, 6), (2, 6), "does not divide"),
    ({"patch": (0,)}, (2, 6), (2, 6), "does not divide"),
    ({"patch": (1, 2)}, (2, 6), (2, 6), "has 2 block sizes"),
    ({"patch": 2}, (2, 6), (2, 6), "patch must be a tuple"),
    ({"steps": 0}, (2, 6), (2, 6), "steps must be a whole number"),
    ({"steps": 2.5}, (2, 6), (2, 6), "steps must be a whole number"),
    ({"target": 7}, (2, 6), (2, 6), "outside the output's 3 classes"),
    ({"target": jnp.array([0, 1, 2])}, (2, 6), (2, 6), "target has shape"),
    ({"baseline": jnp.zeros((3, 6))}, (2, 6), (2, 6), "baseline must be a number or an array broadcastable"),
    ({"batch_size": 0}, (2, 6), (2, 6), "batch_size must be None"),
    ({}, (6,), (6,), "at least one axis after the batch axis"),
])
def test_errors(kwargs, relevance_shape, x_shape, message):
    w = jnp.ones((6, 3))
    with pytest.raises(GradkitError, match=r"^\[gradkit\] attribution\.perturbation_curve: .*" + message):
        curve(lambda x: x @ w, jnp.ones(x_shape), jnp.ones(relevance_shape), **kwargs)


def test_errors_for_the_model():
    x = jnp.ones((2, 6))
    with pytest.raises(GradkitError, match="expected the model as a function"):
        curve("model", x, x)
    with pytest.raises(GradkitError, match="batch first and the classes last"):
        curve(lambda x: x.sum(-1), x, x)
    with pytest.raises(GradkitError, match="floating-point batch"):
        curve(lambda x: x, jnp.ones((2, 6), jnp.int32), x)
