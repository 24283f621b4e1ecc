"""Named ops: composite functions as one equation a table can target."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk


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
