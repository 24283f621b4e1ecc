"""Named ops: composite functions as one equation a table can target."""

import gc
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from gradkit._src.core import named


@gk.op("log1pexp")
def log1pexp(x):
    return jnp.log1p(jnp.exp(x))


SIGMOID_GRAD = gk.vjp_rule(lambda op, g: (g * jax.nn.sigmoid(op.inputs[0]),))
X = jnp.array([-100.0, -1.0, 0.0, 1.0, 100.0], jnp.float32)


def test_appears_as_one_equation():
    jaxpr = jax.make_jaxpr(lambda x: log1pexp(x) * 2.0)(X)
    assert [e.primitive.name for e in jaxpr.jaxpr.eqns] == ["jit", "mul"]
    assert jaxpr.jaxpr.eqns[0].params["name"].endswith(":log1pexp")


def test_unmatched_behaves_like_the_plain_function(maybe_jit):
    plain = lambda x: jnp.log1p(jnp.exp(x))
    np.testing.assert_array_equal(maybe_jit(log1pexp)(X), jax.jit(plain)(X))
    np.testing.assert_array_equal(maybe_jit(jax.vmap(jax.grad(log1pexp)))(X), jax.vmap(jax.grad(jax.jit(plain)))(X))


def test_table_overrides_its_gradient(maybe_jit):
    f = gk.override(lambda x: jnp.sum(log1pexp(x)), {"log1pexp": SIGMOID_GRAD})
    assert np.isnan(jax.grad(lambda x: jnp.sum(log1pexp(x)))(X)).any()
    g = maybe_jit(jax.grad(f))(X)
    np.testing.assert_allclose(g, jax.nn.sigmoid(X), rtol=1e-6)


def test_named_op_inside_scan_and_cond(maybe_jit):
    def fn(x):
        c, _ = lax.scan(lambda c, z: (c + log1pexp(z), None), jnp.zeros_like(x), jnp.stack([x, x]))
        return jnp.sum(lax.cond(True, log1pexp, jnp.exp, c))

    def ref(x):
        c = 2.0 * jax.nn.softplus(x)
        return jnp.sum(jax.nn.softplus(c))

    g = maybe_jit(jax.grad(gk.override(fn, {"log1pexp": SIGMOID_GRAD})))(X[1:4])
    np.testing.assert_allclose(g, jax.grad(ref)(X[1:4]), rtol=1e-5)


def test_pytree_arguments_kwargs_and_none_at_depth():
    @gk.op("affine")
    def affine(params, x, *, activation="tanh"):
        y = params["w"] * x + params["b"][0]
        return jnp.tanh(y) if activation == "tanh" else y

    seen = {}

    def rule(op, g):
        params, x = op.inputs
        seen["params"] = op.params
        seen["outputs"] = len(op.outputs)
        # Gradient only for w; None for b (a whole subtree) and for x.
        return ({"w": g * x * 10.0, "b": None}, None)

    params = {"w": jnp.float32(2.0), "b": (jnp.float32(1.0), jnp.float32(5.0))}
    f = gk.override(lambda p, x: affine(p, x, activation="id"), {"affine": gk.vjp_rule(rule)})
    gp, gx = jax.grad(f, argnums=(0, 1))(params, jnp.float32(3.0))
    assert dict(seen["params"]) == {"activation": "id"} and seen["outputs"] == 1
    assert float(gp["w"]) == 30.0
    assert float(gp["b"][0]) == 0.0 and float(gp["b"][1]) == 0.0 and float(gx) == 0.0


def test_tuple_outputs_and_jvp_rule():
    @gk.op("polar")
    def polar(x, y):
        return jnp.hypot(x, y), jnp.arctan2(y, x)

    def jvp(op, t):
        (x, y), (r, th) = op.inputs, op.outputs
        tx, ty = t
        return (tx * 2.0, ty * 3.0)

    f = gk.override(lambda x, y: polar(x, y), {"polar": gk.jvp_rule(jvp)})
    r, th = f(jnp.float32(3.0), jnp.float32(4.0))
    assert float(r) == 5.0
    jac = jax.jacfwd(lambda xy: jnp.stack(f(xy[0], xy[1])))(jnp.array([3.0, 4.0]))
    np.testing.assert_array_equal(jac, [[2.0, 0.0], [0.0, 3.0]])
    jac_rev = jax.jacrev(lambda xy: jnp.stack(f(xy[0], xy[1])))(jnp.array([3.0, 4.0]))
    np.testing.assert_array_equal(jac_rev, jac)


def test_static_positional_arguments_and_recompile_per_static():
    @gk.op("power")
    def power(x, n):
        return x ** n

    f = gk.override(lambda x: power(x, 3), {"power": gk.vjp_rule(lambda op, g: (g * op.inputs[1], None))})
    assert float(jax.grad(f)(jnp.float32(2.0))) == 3.0
    assert float(power(jnp.float32(2.0), 2)) == 4.0


def test_array_keyword_argument_is_a_clear_error():
    @gk.op("scaled")
    def scaled(x, *, s):
        return x * s

    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] named op 'scaled' got an array in keyword argument `s`"):
        scaled(jnp.ones(2), s=jnp.ones(2))


def test_bad_names():
    for bad in ["", " x", 3]:
        with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] gk.op"):
            gk.op(bad)
    with pytest.raises(gk.GradkitError, match="decorates a function"):
        gk.op("x")(3)


def test_static_keywords_key_signed_zero_and_nan():
    traces = []

    @gk.op("signed")
    def signed(x, *, s):
        traces.append(s)
        return x * math.copysign(1.0, s)

    x = jnp.array([1.0, -2.0])
    np.testing.assert_array_equal(signed(x, s=0.0), x)
    np.testing.assert_array_equal(signed(x, s=-0.0), -x)  # its own program, not the +0.0 one
    assert len(traces) == 2
    for _ in range(3):
        signed(x, s=float("nan"))
    assert len(traces) == 3  # every NaN hits one entry
    np.testing.assert_array_equal(jax.grad(lambda v: jnp.sum(signed(v, s=-0.0)))(x), [-1.0, -1.0])
    assert len(traces) == 3


def test_signature_rebuilds_arguments_and_outputs():
    @gk.op("affine2")
    def affine2(params, x, mode, *, scale=1.0):
        return {"y": params["w"] * x * scale, "mode": jnp.int32(len(mode))}

    params, x = {"w": jnp.float32(2.0)}, jnp.float32(3.0)
    jaxpr = jax.make_jaxpr(lambda p, v: affine2(p, v, "ab", scale=0.5))(params, x)
    eqn = jaxpr.jaxpr.eqns[0]
    sig = named.lookup(eqn.params["name"])
    assert sig.name == "affine2" and sig.kwargs == {"scale": 0.5}
    rebuilt = sig.args(["W", "X"])  # one value per jit input, statics in place
    assert rebuilt == ({"w": "W"}, "X", "ab")
    assert sig.outputs(["Y", "M"]) == {"mode": "Y", "y": "M"} or sig.outputs(["Y", "M"]) == {"y": "Y", "mode": "M"}
    assert len(eqn.invars) == 2 and len(eqn.outvars) == 2
    assert sig.dynamic(["W", "X", "ab"]) == ["W", "X"]


@pytest.mark.slow  # about 3 s on 2 cores: the slow set (CI runs it)
def test_registry_is_weak_and_bounded(monkeypatch):
    monkeypatch.setattr(named._RECENT, "maxsize", 8)  # the bound at work after 8 signatures, not 2048
    gc.collect()
    before = len(named._REGISTRY)
    x = jnp.ones(2)
    for i in range(3 * named._RECENT.maxsize):  # decorated on the fly, one signature each, then dropped
        f = gk.op("on_the_fly")(lambda v, *, k: v * k)
        f(x, k=float(i))
        g = gk.custom_gradient(lambda v, k: (v * k, lambda u: (u * k, None)))
        g(x, float(i))
    del f, g
    gc.collect()  # 48 signatures made; the recent 8 kept, and a few that JAX's own caches still hold
    assert len(named._REGISTRY) <= before + 2 * named._RECENT.maxsize
    jax.clear_caches()  # clears JAX's caches and gradkit's (the recent signatures included)
    gc.collect()
    assert len(named._REGISTRY) <= before + 2
    # A live function keeps its signatures registered, however many others come and go.
    live = gk.op("live")(lambda v, *, k: v * k)
    name = jax.make_jaxpr(lambda v: live(v, k=2.0))(x).jaxpr.eqns[0].params["name"]
    for i in range(40):
        gk.op("churn")(lambda v: v)(x + i)
    gc.collect()
    assert named.lookup(name) is not None and named.lookup(name).kwargs == {"k": 2.0}


def test_op_decorated_inside_the_overridden_function(maybe_jit):
    # The decorated function is dropped once the program is traced; the table still sees its signature.
    def loss(x):
        @gk.op("inner_op")
        def inner_op(v, tag, *, k):
            return v * k

        return jnp.sum(inner_op(x, "tag", k=2.0))

    seen = {}

    def rule(op, g):
        seen["inputs"], seen["params"] = op.inputs, dict(op.params)
        return (g * 10.0, None)

    f = gk.override(loss, {"inner_op": gk.vjp_rule(rule)})
    x = jnp.array([1.0, 2.0])
    np.testing.assert_array_equal(maybe_jit(jax.grad(f))(x), [10.0, 10.0])
    assert seen["inputs"][1] == "tag" and seen["params"] == {"k": 2.0}


@pytest.mark.parametrize("kind", ["vjp", "jvp"])
def test_rule_for_a_named_op_with_a_static_leaf_before_the_array(kind, maybe_jit):
    @gk.op("scaled")
    def scaled(mode, x):
        return jnp.sin(x) if mode == "sin" else jnp.cos(x)

    if kind == "vjp":
        rule = gk.vjp_rule(lambda op, g: (None, g * 10.0))
    else:
        rule = gk.jvp_rule(lambda op, t: (t[1] * 10.0) if t[0] is None else None)
    f = gk.override(lambda x: jnp.sum(scaled("sin", x)), {"scaled": rule})
    x = jnp.array([0.1, 0.7, 2.0])
    np.testing.assert_array_equal(maybe_jit(jax.grad(f))(x), np.full(3, 10.0, np.float32))
    if kind == "jvp":
        np.testing.assert_allclose(jax.jvp(f, (x,), (jnp.ones(3),))[1], 30.0)
