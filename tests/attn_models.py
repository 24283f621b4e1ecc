"""Plain-JAX transformer blocks for the AttnLRP tests, with hooks where LXT 2.1's efficient mode patches.

Run with ``PLAIN`` hooks a model is the unmodified one that ``lrp(..., ATTN_LRP)`` must explain by dataflow;
with ``ATTN`` or ``CP`` hooks it is the hand-written reference: ``custom_vjp`` dividing the gradient by 4, 4 and
2 at q, k and v (after RoPE, before the grouped-query repeat), the identity ratio ``f(x)/(x + 1e-10)`` at the
activation, the gated product's gradient halved, ``stop_gradient`` on the norm's ``rsqrt``/σ (CP: q and k, and
the activated gate, held constant). The reference's relevance is ``x ⊙ grad``. The models add biases of shape
``[n]`` to ``[T, n]``: run them under ``jax.numpy_rank_promotion("allow")``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# --------------------------------------------------------------------------- reference helpers (LXT by hand)


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def divide_gradient(x: jax.Array, factor: float) -> jax.Array:
    return x


divide_gradient.defvjp(lambda x, f: (x, None), lambda f, _, g: (g / f,))


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def identity_rule(fn: Any, x: jax.Array) -> jax.Array:
    return fn(x)


def _id_fwd(fn: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    y = fn(x)
    return y, y / (x + jnp.asarray(1e-10, x.dtype))


identity_rule.defvjp(_id_fwd, lambda fn, ratio, g: (g * ratio,))


class Hooks(NamedTuple):
    qkv: Any  # (q, k, v) -> (q, k, v)
    act: Any  # (fn, x) -> fn(x)
    gate: Any  # (act_out, up) -> product
    norm: Any  # statistic -> statistic


PLAIN = Hooks(lambda q, k, v: (q, k, v), lambda fn, x: fn(x), lambda a, u: a * u, lambda s: s)
ATTN = Hooks(lambda q, k, v: (divide_gradient(q, 4.0), divide_gradient(k, 4.0), divide_gradient(v, 2.0)),
             identity_rule, lambda a, u: divide_gradient(a * u, 2.0), jax.lax.stop_gradient)
CP = Hooks(lambda q, k, v: (jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), v),
           identity_rule, lambda a, u: jax.lax.stop_gradient(a) * u, jax.lax.stop_gradient)


# --------------------------------------------------------------------------- the models


class Cfg(NamedTuple):
    d: int = 16
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 24
    vocab: int = 11
    layers: int = 2
    attention: str = "einsum"  # einsum | matmul | inline | dpa
    mask: str = "where"  # where | add | finfo
    style: str = "llama"  # llama | gpt2
    stack: str = "loop"  # loop | scan | remat
    bias: bool = False


def init(cfg: Cfg, seed: int, dtype: Any = jnp.float32) -> dict[str, Any]:
    keys = iter(jax.random.split(jax.random.key(seed), 64))
    hd = cfg.d // cfg.heads

    def w(*shape: int, scale: float = 1.0) -> jax.Array:
        return (jax.random.normal(next(keys), shape, dtype) * scale / math.sqrt(shape[0])).astype(dtype)

    def b(n: int) -> jax.Array:
        return (0.1 * jax.random.normal(next(keys), (n,), dtype)) if cfg.bias else jnp.zeros((n,), dtype)

    def layer() -> dict[str, Any]:
        return {"n1": 1.0 + 0.1 * jax.random.normal(next(keys), (cfg.d,), dtype), "n1b": b(cfg.d),
                "wq": w(cfg.d, cfg.heads * hd), "bq": b(cfg.heads * hd),
                "wk": w(cfg.d, cfg.kv_heads * hd), "bk": b(cfg.kv_heads * hd),
                "wv": w(cfg.d, cfg.kv_heads * hd), "bv": b(cfg.kv_heads * hd),
                "wo": w(cfg.heads * hd, cfg.d), "bo": b(cfg.d),
                "n2": 1.0 + 0.1 * jax.random.normal(next(keys), (cfg.d,), dtype), "n2b": b(cfg.d),
                "wg": w(cfg.d, cfg.ffn), "wu": w(cfg.d, cfg.ffn), "bu": b(cfg.ffn), "wd": w(cfg.ffn, cfg.d),
                "bd": b(cfg.d)}

    layers = [layer() for _ in range(cfg.layers)]
    return {"layers": layers, "nf": jnp.ones((cfg.d,), dtype), "nfb": b(cfg.d), "head": w(cfg.d, cfg.vocab)}


def rms_norm(x: jax.Array, w: jax.Array, hooks: Hooks) -> jax.Array:
    h = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)
    return w * (h * hooks.norm(r)).astype(x.dtype)


def layer_norm(x: jax.Array, w: jax.Array, b: jax.Array, hooks: Hooks) -> jax.Array:
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    return (x - mu) / hooks.norm(jnp.sqrt(var + 1e-5)) * w + b


def rope(x: jax.Array) -> jax.Array:  # x: [T, H, hd]
    t, _, hd = x.shape
    freq = 1.0 / (10000.0 ** (np.arange(0, hd, 2) / hd))
    ang = np.arange(t)[:, None] * freq[None, :]
    cos = jnp.asarray(np.concatenate([np.cos(ang)] * 2, -1)[:, None, :], x.dtype)
    sin = jnp.asarray(np.concatenate([np.sin(ang)] * 2, -1)[:, None, :], x.dtype)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos + jnp.concatenate([-x2, x1], axis=-1) * sin


def _softmax_inline(s: jax.Array) -> jax.Array:
    e = jnp.exp(s - jnp.max(s, axis=-1, keepdims=True))
    return e / jnp.sum(e, axis=-1, keepdims=True)


def attention(cfg: Cfg, p: dict[str, Any], x: jax.Array, hooks: Hooks) -> jax.Array:
    t = x.shape[0]
    hd = cfg.d // cfg.heads
    q = (x @ p["wq"] + p["bq"]).reshape(t, cfg.heads, hd)
    k = (x @ p["wk"] + p["bk"]).reshape(t, cfg.kv_heads, hd)
    v = (x @ p["wv"] + p["bv"]).reshape(t, cfg.kv_heads, hd)
    if cfg.style == "llama":
        q, k = rope(q), rope(k)
    q, k, v = hooks.qkv(q, k, v)
    if cfg.attention == "dpa":
        o = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True, implementation="xla")[0]
        return o.reshape(t, cfg.d) @ p["wo"] + p["bo"]
    rep = cfg.heads // cfg.kv_heads
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    scale = jnp.asarray(1.0 / math.sqrt(hd), x.dtype)
    if cfg.attention == "matmul":
        s = (q.transpose(1, 0, 2) @ k.transpose(1, 2, 0)) * scale
    else:
        s = jnp.einsum("thd,shd->hts", q, k) * scale
    causal = jnp.tril(jnp.ones((t, t), bool))[None]
    if cfg.mask == "where":
        s = jnp.where(causal, s, jnp.finfo(s.dtype).min)
    elif cfg.mask == "add":
        s = s + jnp.where(causal, 0.0, -1e9).astype(s.dtype)
    else:
        s = s + jnp.where(causal, 0.0, jnp.finfo(s.dtype).min).astype(s.dtype)
    a = _softmax_inline(s) if cfg.attention == "inline" else jax.nn.softmax(s, axis=-1)
    if cfg.attention == "matmul":
        o = (a @ v.transpose(1, 0, 2)).transpose(1, 0, 2)
    else:
        o = jnp.einsum("hts,shd->thd", a, v)
    return o.reshape(t, cfg.d) @ p["wo"] + p["bo"]


def block(cfg: Cfg, p: dict[str, Any], h: jax.Array, hooks: Hooks) -> jax.Array:
    if cfg.style == "llama":
        h = h + attention(cfg, p, rms_norm(h, p["n1"], hooks), hooks)
        x = rms_norm(h, p["n2"], hooks)
        m = hooks.gate(hooks.act(jax.nn.silu, x @ p["wg"]), x @ p["wu"] + p["bu"])
    else:
        h = h + attention(cfg, p, layer_norm(h, p["n1"], p["n1b"], hooks), hooks)
        x = layer_norm(h, p["n2"], p["n2b"], hooks)
        m = hooks.act(partial(jax.nn.gelu, approximate=True), x @ p["wu"] + p["bu"])
    return h + m @ p["wd"] + p["bd"]


def model(cfg: Cfg, params: dict[str, Any], e: Any, hooks: Hooks) -> jax.Array:
    """Next-token logits at the last position; ``e`` is the input embeddings [T, D] (or ``(tokens, positions)``)."""
    h = e[0] + e[1] if isinstance(e, tuple) else e
    layers = params["layers"]
    if cfg.stack == "loop":
        for p in layers:
            h = block(cfg, p, h, hooks)
    else:
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *layers)
        step = (lambda c, p: (block(cfg, p, c, hooks), None))
        if cfg.stack == "remat":
            step = jax.checkpoint(step)
        h, _ = jax.lax.scan(step, h, stacked)
    h = rms_norm(h, params["nf"], hooks) if cfg.style == "llama" else layer_norm(h, params["nf"], params["nfb"], hooks)
    return (h @ params["head"])[-1]


def reference(cfg: Cfg, params: dict[str, Any], e: Any, hooks: Hooks, target: int) -> Any:
    g = jax.grad(lambda v: model(cfg, params, v, hooks)[target])(e)
    return jax.tree.map(lambda a, b: a * b, e, g)


def inputs(cfg: Cfg, seed: int, t: int = 6, dtype: Any = jnp.float32) -> jax.Array:
    return jax.random.normal(jax.random.key(seed + 1000), (t, cfg.d), dtype)
