"""gradkit with the libraries people train with: optax, Equinox, Flax; and data-parallel runs.

Each model is trained a few steps through ``gk.override``; its gradients must
equal the same model written with a hand-made ``jax.custom_vjp`` activation.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import equinox as eqx
import flax.linen as nn
import optax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import gradkit as gk
from meshes import make_mesh, on_mesh_backend


@gk.op("log1pexp")
def log1pexp(x):
    return jnp.log1p(jnp.exp(x))


TABLE = gk.RuleTable({"log1pexp": gk.vjp_rule(lambda op, g: (g * jax.nn.sigmoid(op.inputs[0]),))})


@jax.custom_vjp
def log1pexp_hand(x):
    return jnp.log1p(jnp.exp(x))


log1pexp_hand.defvjp(lambda x: (jnp.log1p(jnp.exp(x)), x), lambda x, g: (g * jax.nn.sigmoid(x),))


def softplus(x):
    # A guarded softplus as people write it: finite forward, but the unselected
    # branch overflows for x > 88 and its gradient 0 * inf poisons the result.
    return jnp.where(x > 30.0, x, log1pexp(x))


def softplus_hand(x):
    return jnp.where(x > 30.0, x, log1pexp_hand(x))


def _data(n=64, d=8, seed=0):
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, d), jnp.float32) * 100.0  # large inputs: the naive gradient is NaN
    y = (x @ jax.random.normal(kw, (d,), jnp.float32) > 0).astype(jnp.float32)
    return x, y


def _assert_tree_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- Equinox


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_equinox_model_trains_with_override():
    class MLP(eqx.Module):
        layers: list
        act: object = eqx.field(static=True)

        def __init__(self, key, act):
            k1, k2 = jax.random.split(key)
            self.layers = [eqx.nn.Linear(8, 16, key=k1), eqx.nn.Linear(16, 1, key=k2)]
            self.act = act

        def __call__(self, x):
            return self.layers[1](self.act(self.layers[0](x)))[0]

    def loss(model, x, y):
        logits = jax.vmap(model)(x)
        return jnp.mean(softplus(logits) - y * logits)

    def loss_hand(model, x, y):
        logits = jax.vmap(model)(x)
        return jnp.mean(softplus_hand(logits) - y * logits)

    x, y = _data()
    model = MLP(jax.random.key(1), softplus)
    model_hand = MLP(jax.random.key(1), softplus_hand)
    naive = jax.tree_util.tree_leaves(eqx.filter_grad(loss)(model, x, y))
    assert not all(np.isfinite(v).all() for v in naive)  # the problem is real

    opt = optax.sgd(1e-2, momentum=0.9)
    fixed = gk.override(loss, TABLE)

    @eqx.filter_jit
    def step(model, state, x, y, loss_fn):
        l, g = eqx.filter_value_and_grad(loss_fn)(model, x, y)
        updates, state = opt.update(g, state, model)
        return eqx.apply_updates(model, updates), state, l, g

    state, state_hand = opt.init(eqx.filter(model, eqx.is_array)), opt.init(eqx.filter(model_hand, eqx.is_array))
    losses = []
    for _ in range(5):
        model, state, l, g = step(model, state, x, y, fixed)
        model_hand, state_hand, l_hand, g_hand = step(model_hand, state_hand, x, y, loss_hand)
        _assert_tree_close(eqx.filter(g, eqx.is_array), eqx.filter(g_hand, eqx.is_array))
        losses.append(float(l))
        assert np.isfinite(l)
    assert losses[-1] < losses[0]


# --------------------------------------------------------------------------- Flax


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_flax_linen_model_trains_with_override():
    class MLP(nn.Module):
        act: object

        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(self.act(nn.Dense(16)(x)))[..., 0]

    x, y = _data(seed=3)
    model, model_hand = MLP(softplus), MLP(softplus_hand)
    params = model.init(jax.random.key(0), x)

    def make_loss(m):
        def loss(params, x, y):
            logits = m.apply(params, x)
            return jnp.mean(m.act(logits) - y * logits)
        return loss

    fixed, hand = gk.override(make_loss(model), TABLE), make_loss(model_hand)
    opt = optax.sgd(1e-2)

    @jax.jit
    def step(params, state, x, y):
        l, g = jax.value_and_grad(fixed)(params, x, y)
        updates, state = opt.update(g, state)
        return optax.apply_updates(params, updates), state, l, g

    state = opt.init(params)
    first = None
    for _ in range(5):
        g_hand = jax.jit(jax.grad(hand))(params, x, y)
        params, state, l, g = step(params, state, x, y)
        _assert_tree_close(g, g_hand)
        assert all(np.isfinite(v).all() for v in jax.tree_util.tree_leaves(g))
        first = float(l) if first is None else first
    assert float(l) < first


# --------------------------------------------------------------------------- data parallel


def _mlp_loss(act):
    def loss(params, x, y):
        h = act(x @ params["w1"] + params["b1"][None, :])
        logits = h @ params["w2"]
        return jnp.mean(act(logits) - y * logits)
    return loss


def _params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (8, 16)) * 0.3, "b1": jnp.zeros(16), "w2": jax.random.normal(k2, (16,)) * 0.3}


def test_data_parallel_step_with_named_sharding_matches_single_device():
    mesh = make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    x, y = _data(n=64)
    params = _params()
    loss = gk.override(_mlp_loss(softplus), TABLE)
    opt = optax.sgd(1e-2, momentum=0.9)

    @jax.jit
    def step(params, state, x, y):
        l, g = jax.value_and_grad(loss)(params, x, y)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, l

    xs = jax.device_put(x, NamedSharding(mesh, P("batch")))
    ys = jax.device_put(y, NamedSharding(mesh, P("batch")))
    x, y, p_single = on_mesh_backend((x, y, params))  # the reference on the mesh's backend
    p_multi = jax.device_put(params, NamedSharding(mesh, P()))
    s_single, s_multi = opt.init(p_single), opt.init(p_multi)
    for _ in range(3):
        p_single, s_single, l_single = step(p_single, s_single, x, y)
        p_multi, s_multi, l_multi = step(p_multi, s_multi, xs, ys)
        np.testing.assert_allclose(l_multi, l_single, rtol=1e-5)
    _assert_tree_close(p_multi, p_single)
    assert len(xs.sharding.device_set) == 8


def test_shard_map_body_with_overridden_op_matches_single_device():
    mesh = make_mesh((8,), ("batch",), axis_types=(AxisType.Auto,))
    x, y = _data(n=64)
    params = _params(1)
    per_device = _mlp_loss(softplus)

    def sharded_loss(params, x, y):
        body = jax.shard_map(lambda p, x, y: jax.lax.pmean(per_device(p, x, y), "batch"), mesh=mesh,
                             in_specs=(P(), P("batch"), P("batch")), out_specs=P())
        return body(params, x, y)

    g_sharded = jax.jit(jax.grad(gk.override(sharded_loss, TABLE)))(params, x, y)
    g_single = jax.jit(jax.grad(_mlp_loss(softplus_hand)))(*on_mesh_backend((params, x, y)))
    _assert_tree_close(g_sharded, g_single)
    assert all(np.isfinite(v).all() for v in jax.tree_util.tree_leaves(g_sharded))
