"""ATTN_LRP and CP_LRP on the attention modules of Flax NNX, Flax linen and Equinox, unmodified.

Each reference takes the module's own projections (linear maps keep their gradient under both composites) and
writes the attention core by hand with LXT's hooks on q, k and v (see ``test_attn_lrp.py``); the explained
model is the module itself followed by a readout of the last position.
"""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_models import ATTN, CP, PLAIN, Cfg, Hooks, block, init, inputs, model, reference, rms_norm
from flax import linen, nnx

import gradkit as gk

T, D, H = 5, 16, 4
HD = D // H


@pytest.fixture(autouse=True)
def _broadcasting() -> Any:
    with jax.numpy_rank_promotion("allow"):  # the libraries broadcast biases implicitly
        yield


def _core(q: jax.Array, k: jax.Array, v: jax.Array, hooks: Hooks) -> jax.Array:
    """Causal softmax attention on [T, H, hd] by hand, with LXT's hooks on q, k, v."""
    q, k, v = hooks.qkv(q, k, v)
    s = jnp.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
    causal = jnp.tril(jnp.ones((T, T), bool))[None]
    a = jax.nn.softmax(jnp.where(causal, s, jnp.finfo(s.dtype).min), axis=-1)
    return jnp.einsum("hqk,khd->qhd", a, v)


def _check(fn: Any, ref: Any, x: jax.Array, composite: Any, hooks: Hooks) -> None:
    target = int(jnp.argmax(jax.jit(lambda v: fn(v, PLAIN))(x)))
    r = jax.jit(lambda v: gk.attribution.lrp(lambda u: fn(u, PLAIN), v, composite, target=target))(x)

    @jax.jit
    def refs(v: jax.Array) -> Any:
        g = jax.grad(lambda u: ref(u, hooks)[target])(v)
        plain = jax.grad(lambda u: ref(u, PLAIN)[target])(v)
        return ref(v, PLAIN), fn(v, PLAIN), g, plain

    out_ref, out, g, plain = refs(x)
    np.testing.assert_allclose(np.asarray(out_ref), np.asarray(out), rtol=1e-5, atol=1e-6)
    scale = float(jnp.max(jnp.abs(x * g)))
    np.testing.assert_allclose(np.asarray(r), np.asarray(x * g), rtol=1e-5, atol=1e-6 * scale)
    plain = x * plain
    assert float(jnp.max(jnp.abs(plain - x * g))) > 1e-3 * scale


# AttnLRP in the default set, CP-LRP with the long matrices
CASES = [("attn", gk.attribution.ATTN_LRP, ATTN),
         pytest.param("cp", gk.attribution.CP_LRP, CP, marks=pytest.mark.slow)]


def _readout(seed: int) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (D, 7)) / math.sqrt(D)


@pytest.mark.parametrize("name,composite,hooks", CASES)
def test_nnx_multi_head_attention(name: str, composite: Any, hooks: Hooks) -> None:
    mha = nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=D, out_features=D, decode=False,
                                 rngs=nnx.Rngs(0))
    w = _readout(1)
    mask = nnx.make_causal_mask(jnp.ones((T,)))

    def fn(x: jax.Array, hooks: Hooks) -> jax.Array:
        return (mha(x, mask=mask) @ w)[-1]

    def ref(x: jax.Array, hooks: Hooks) -> jax.Array:
        o = _core(mha.query(x), mha.key(x), mha.value(x), hooks)
        return (mha.out(o) @ w)[-1]

    _check(fn, ref, jax.random.normal(jax.random.key(2), (T, D)), composite, hooks)


@pytest.mark.parametrize("name,composite,hooks", CASES)
def test_linen_multi_head_dot_product_attention(name: str, composite: Any, hooks: Hooks) -> None:
    mod = linen.MultiHeadDotProductAttention(num_heads=H, qkv_features=D, out_features=D)
    x0 = jax.random.normal(jax.random.key(3), (T, D))
    mask = linen.make_causal_mask(jnp.ones((T,)))
    params = mod.init(jax.random.key(4), x0, mask=mask)["params"]
    w = _readout(5)

    def fn(x: jax.Array, hooks: Hooks) -> jax.Array:
        return (mod.apply({"params": params}, x, mask=mask) @ w)[-1]

    def proj(name: str, x: jax.Array) -> jax.Array:
        return jnp.einsum("td,dhk->thk", x, params[name]["kernel"]) + params[name]["bias"]

    def ref(x: jax.Array, hooks: Hooks) -> jax.Array:
        o = _core(proj("query", x), proj("key", x), proj("value", x), hooks)
        out = jnp.einsum("thk,hkd->td", o, params["out"]["kernel"]) + params["out"]["bias"]
        return (out @ w)[-1]

    _check(fn, ref, x0, composite, hooks)


@pytest.mark.parametrize("name,composite,hooks", CASES)
def test_equinox_multihead_attention(name: str, composite: Any, hooks: Hooks) -> None:
    mha = eqx.nn.MultiheadAttention(num_heads=H, query_size=D, use_query_bias=True, use_key_bias=True,
                                    use_value_bias=True, use_output_bias=True, key=jax.random.key(6))
    w = _readout(7)
    mask = jnp.tril(jnp.ones((T, T), bool))

    def fn(x: jax.Array, hooks: Hooks) -> jax.Array:
        return (mha(x, x, x, mask=mask) @ w)[-1]

    def lin(layer: Any, x: jax.Array) -> jax.Array:
        return x @ layer.weight.T + layer.bias

    def ref(x: jax.Array, hooks: Hooks) -> jax.Array:
        q, k, v = (lin(p, x).reshape(T, H, HD) for p in (mha.query_proj, mha.key_proj, mha.value_proj))
        o = _core(q, k, v, hooks).reshape(T, D)
        return (lin(mha.output_proj, o) @ w)[-1]

    _check(fn, ref, jax.random.normal(jax.random.key(8), (T, D)), composite, hooks)


@jax.custom_vjp
def _dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Stands in for cuDNN's fused kernel (the ``custom_vjp`` of that name in ``jax.nn.dot_product_attention``)."""
    return _core(q, k, v, PLAIN)


def _kernel_fwd(q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, Any]:
    return jax.vjp(lambda *a: _core(*a, PLAIN), q, k, v)


_dot_product_attention.defvjp(_kernel_fwd, lambda pullback, g: pullback(g))


@pytest.mark.parametrize("name,composite,hooks", [("attn", gk.attribution.ATTN_LRP, ATTN),
                                                  ("cp", gk.attribution.CP_LRP, CP)])
def test_an_opaque_attention_kernel_gets_the_factors_at_its_call(name: str, composite: Any, hooks: Hooks) -> None:
    wq, wk, wv = (jax.random.normal(jax.random.key(i), (D, D)) / math.sqrt(D) for i in (10, 11, 12))
    w = _readout(13)

    def split(x: jax.Array, m: jax.Array) -> jax.Array:
        return (x @ m).reshape(T, H, HD)

    def fn(x: jax.Array, hooks: Hooks) -> jax.Array:
        return (_dot_product_attention(split(x, wq), split(x, wk), split(x, wv)).reshape(T, D) @ w)[-1]

    def ref(x: jax.Array, hooks: Hooks) -> jax.Array:
        return (_core(split(x, wq), split(x, wk), split(x, wv), hooks).reshape(T, D) @ w)[-1]

    _check(fn, ref, jax.random.normal(jax.random.key(14), (T, D)), composite, hooks)


@pytest.mark.slow
def test_blocks_stacked_with_linen_scan_and_remat() -> None:
    """linen ``nn.scan`` over ``nn.remat`` blocks (whose parameters are the plain model's) against the reference."""
    cfg = Cfg(layers=2, attention="dpa", kv_heads=1)
    params = init(cfg, 15)
    stacked = jax.tree.map(lambda *a: jnp.stack(a), *params["layers"])

    class Block(linen.Module):
        @linen.compact
        def __call__(self, h: jax.Array, _: Any) -> tuple[jax.Array, None]:
            p = {k: self.param(k, lambda key, v=v: v[0]) for k, v in stacked.items()}
            return block(cfg, p, h, PLAIN), None

    Stack = linen.scan(linen.remat(Block), variable_axes={"params": 0}, split_rngs={"params": True},
                       length=cfg.layers)
    e = inputs(cfg, 15)
    variables = {"params": stacked}

    def fn(v: jax.Array) -> jax.Array:
        h, _ = Stack().apply(variables, v, None)
        h = rms_norm(h, params["nf"], PLAIN)
        return (h @ params["head"])[-1]

    ref_cfg = cfg._replace(stack="scan")
    np.testing.assert_allclose(np.asarray(jax.jit(fn)(e)), np.asarray(jax.jit(
        lambda v: model(ref_cfg, params, v, PLAIN))(e)), rtol=1e-5, atol=1e-6)
    target = 2
    r = jax.jit(lambda v: gk.attribution.lrp(fn, v, gk.attribution.ATTN_LRP, target=target))(e)
    ref = jax.jit(lambda v: reference(ref_cfg, params, v, ATTN, target))(e)
    np.testing.assert_allclose(np.asarray(r), np.asarray(ref), rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(ref))))


def _kinds(fn: Any, x: jax.Array) -> dict[str, int]:
    from gradkit._src import compat

    found: dict[str, int] = {}
    jax.make_jaxpr(lambda v: found.update(compat.run_gradient_form(fn, v, lambda s, ops: s.apply(*ops))[2]))(x)
    return found


def _norms() -> tuple[jax.Array, dict[str, Any], dict[str, jax.Array]]:
    x = jax.random.normal(jax.random.key(16), (T, D))
    ln, rms = linen.LayerNorm(), linen.RMSNorm()
    p_ln, p_rms = ln.init(jax.random.key(17), x), rms.init(jax.random.key(17), x)
    e_ln, e_rms = eqx.nn.LayerNorm(D), eqx.nn.RMSNorm(D)
    n_ln, n_rms = nnx.LayerNorm(D, rngs=nnx.Rngs(0)), nnx.RMSNorm(D, rngs=nnx.Rngs(0))
    norms = {
        "linen.LayerNorm": lambda v: ln.apply(p_ln, v), "linen.RMSNorm": lambda v: rms.apply(p_rms, v),
        "nnx.LayerNorm": lambda v: n_ln(v), "nnx.RMSNorm": lambda v: n_rms(v),
        "eqx.nn.LayerNorm": lambda v: jax.vmap(e_ln)(v), "eqx.nn.RMSNorm": lambda v: jax.vmap(e_rms)(v),
        "jnp.var": lambda v: (v - v.mean(-1, keepdims=True)) / jnp.sqrt(v.var(-1, keepdims=True) + 1e-5),
    }
    biases = {"linen.LayerNorm": p_ln["params"]["bias"], "nnx.LayerNorm": n_ln.bias[...],
              "eqx.nn.LayerNorm": e_ln.bias}
    return x, norms, biases


def test_the_norms_of_each_framework_are_one_normalizer() -> None:
    x, norms, _ = _norms()
    for name, f in norms.items():
        assert _kinds(f, x) == {"normalizer": 1}, name


@pytest.mark.slow
def test_the_norms_pass_relevance_by_the_identity_rule() -> None:
    # σ constant: Σ over features of x ⊙ g is the explained output less the norm's bias
    x, norms, biases = _norms()
    for name, f in norms.items():
        r = gk.attribution.lrp(lambda v, f=f: f(v)[-1], x, gk.attribution.ATTN_LRP, target=3)
        y = f(x)[-1]
        bias = biases.get(name, jnp.zeros((D,)))
        np.testing.assert_allclose(float(r.sum()), float(y[3] - bias[3]), rtol=1e-5, atol=1e-6, err_msg=name)


# --------------------------------------------------------------------------------------------------------------
# A Flax NNX model with NNX's own transforms inside (nnx.vmap-made blocks, nnx.scan over them): passed as the
# module itself, its state enters the trace as an argument (as nnx.jit does), so Flax runs the transforms.
# --------------------------------------------------------------------------------------------------------------

class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.up = nnx.Linear(D, 2 * D, rngs=rngs)
        self.gate = nnx.Linear(D, 2 * D, rngs=rngs)
        self.down = nnx.Linear(2 * D, D, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:
        return h + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class _ScannedNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(r: nnx.Rngs) -> _Block:
            return _Block(r)

        self.blocks = make(rngs)
        self.head = nnx.Linear(D, 6, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(h: jax.Array, blk: _Block) -> jax.Array:
            return blk(h)

        return self.head(body(x, self.blocks))


def _scanned_by_hand(params: Any) -> Any:
    """The same network as a plain function of its parameters: lax.scan over the stacked block weights."""
    def dense(p: Any, h: jax.Array) -> jax.Array:
        return h @ p["kernel"] + p["bias"]

    def body(h: jax.Array, b: Any) -> tuple[jax.Array, None]:
        return h + dense(b["down"], jax.nn.silu(dense(b["gate"], h)) * dense(b["up"], h)), None

    return lambda x: dense(params["head"], jax.lax.scan(body, x, params["blocks"])[0])


@pytest.mark.parametrize("name", ["attn", "cp"])
def test_an_nnx_module_with_nnx_scan_is_explained_as_itself(name: str) -> None:
    net = _ScannedNet(nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, D))
    plain = _scanned_by_hand(nnx.to_pure_dict(nnx.state(net)))
    np.testing.assert_allclose(net(x), plain(x), rtol=1e-5, atol=1e-6)
    composite = gk.attribution.ATTN_LRP if name == "attn" else gk.attribution.CP_LRP
    got = jax.jit(lambda v: gk.attribution.lrp(net, v, composite))(x)
    np.testing.assert_allclose(got, gk.attribution.lrp(plain, x, composite), rtol=1e-5, atol=1e-6)
    # the relevance form and the gradient methods take the module too
    np.testing.assert_allclose(gk.attribution.gradient(net, x), gk.attribution.gradient(plain, x), rtol=1e-5,
                               atol=1e-6)
    with pytest.raises(gk.GradkitError, match=r"Pass the module itself"):
        gk.attribution.lrp(lambda v: net(v), x, composite)
    assert float(jnp.max(jnp.abs(got - gk.attribution.gradient_x_input(plain, x)))) > 1e-3  # the rules bite
