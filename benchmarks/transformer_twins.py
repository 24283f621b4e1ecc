"""JAX twins of Hugging Face's LLaMA and GPT-2 and of torchvision's VisionTransformer, from PyTorch weights.

Used by ``attribution_vs_lxt.py`` and ``tests/test_lrp_vs_lxt.py``; imports no
PyTorch. Each builder takes the model's ``state_dict`` as NumPy arrays under
its PyTorch names and layouts (``nn.Linear`` weights ``(out, in)``, GPT-2's
``Conv1D`` weights ``(in, out)``) and returns the model as a function:

* :func:`llama`: input embeddings ``(B, T, D)`` -> logits ``(B, T, vocab)``.
  RMSNorm written inline (``x * rsqrt(mean x^2 + eps) * w``), RoPE with
  ``rotate_half``, grouped-query heads by ``jnp.repeat``, scores with
  ``jnp.einsum``, the causal mask with ``jnp.where``, ``jax.nn.softmax`` in
  float32, a SiLU-gated MLP (``jax.nn.silu``).
* :func:`gpt2`: input embeddings -> logits, the learned positions added
  inside; with ``split_positions=True`` it instead takes the pair
  ``(token_embeddings, position_embeddings)``, both ``(B, T, D)`` (relevance
  at the positions, an LXT option). LayerNorm written out (biased variance,
  eps inside the square root), ``Conv1D`` as ``x @ W + b``, scores with
  ``@``, GELU's tanh form written inline (or ``jax.nn.gelu(approximate=True)``
  with ``gelu="jax"``).
* :func:`vit`: NCHW images -> class logits, torchvision's
  ``VisionTransformer`` (patch convolution, class token, learned positions,
  pre-norm blocks with ``nn.MultiheadAttention``'s packed ``in_proj``, exact
  GELU, the head on the class token).

The forwards are plain JAX as people write them (broadcasts spelled out:
the project's tests run with ``jax_numpy_rank_promotion='raise'``). The only extra is ``rules``:
an object with four methods called at the points where LXT 2.1's efficient
mode changes the backward (:data:`PLAIN` returns its inputs unchanged, so the
traced program is the unmodified model). ``attribution_vs_lxt.py`` and the
test pass :data:`LXT_ATTN_LRP` / :data:`LXT_CP_LRP`, a hand-written
re-implementation of LXT's efficient rules (``custom_vjp`` dividing the
gradient by 4, 4, 2 at q, k, v, the identity ratio ``f(x)/(x + 1e-10)``,
``stop_gradient`` on the normalisers), as an independent reference: with it,
``x * jax.grad`` must equal LXT's relevance on the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, Any]
Model = Callable[[Any], jax.Array]


# --------------------------------------------------------------------------------------------------------------
# Where LXT changes the backward: the identity (plain model), AttnLRP and CP-LRP as LXT 2.1 efficient does them.
# --------------------------------------------------------------------------------------------------------------

class PlainRules:
    """The unmodified model: every hook returns what the plain forward computes."""

    def norm(self, s: jax.Array) -> jax.Array:
        """The normaliser of a LayerNorm / RMSNorm (``1/sigma`` or ``rsqrt(mean x^2 + eps)``)."""
        return s

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v as they enter the attention (after RoPE, before the grouped-query repeat)."""
        return q, k, v

    def act(self, f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        """An element-wise activation ``f(x)``."""
        return f(x)

    def gated(self, f: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array) -> jax.Array:
        """A gated MLP's ``f(gate) * up``."""
        return self.act(f, gate) * up


@jax.custom_vjp
def _divide_gradient(x: jax.Array, factor: float) -> jax.Array:
    return x


def _divide_fwd(x: jax.Array, factor: float) -> tuple[jax.Array, float]:
    return x, factor


def _divide_bwd(factor: float, g: jax.Array) -> tuple[jax.Array, None]:
    return g / factor, None


_divide_gradient.defvjp(_divide_fwd, _divide_bwd)


def _identity_rule(f: Callable[[jax.Array], jax.Array], x: jax.Array, eps: float = 1e-10) -> jax.Array:
    """``f(x)`` whose backward multiplies by ``f(x) / (x + eps)`` (LXT's ``identity_rule_implicit``)."""

    @jax.custom_vjp
    def g(x: jax.Array) -> jax.Array:
        return f(x)

    def fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        y = f(x)
        return y, y / (x + eps)

    def bwd(ratio: jax.Array, ct: jax.Array) -> tuple[jax.Array]:
        return (ct * ratio,)

    g.defvjp(fwd, bwd)
    return g(x)


class LxtAttnLrp(PlainRules):
    """LXT 2.1 efficient AttnLRP: q, k, v gradients / 4, 4, 2; identity rule; gate * up gradient / 2."""

    def norm(self, s: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(s)

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return _divide_gradient(q, 4.0), _divide_gradient(k, 4.0), _divide_gradient(v, 2.0)

    def act(self, f: Callable[[jax.Array], jax.Array], x: jax.Array) -> jax.Array:
        return _identity_rule(f, x)

    def gated(self, f: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array) -> jax.Array:
        return _divide_gradient(self.act(f, gate) * up, 2.0)


class LxtCpLrp(LxtAttnLrp):
    """LXT 2.1 efficient CP-LRP: q and k constant; a gated MLP's gate constant (``f(stop_gradient(gate)) * up``)."""

    def attention(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return jax.lax.stop_gradient(q), jax.lax.stop_gradient(k), v

    def gated(self, f: Callable[[jax.Array], jax.Array], gate: jax.Array, up: jax.Array) -> jax.Array:
        return f(jax.lax.stop_gradient(gate)) * up


PLAIN = PlainRules()
LXT_ATTN_LRP = LxtAttnLrp()
LXT_CP_LRP = LxtCpLrp()


def _arrays(p: Params) -> dict[str, jax.Array]:
    return {k: jnp.asarray(v, jnp.float32) for k, v in p.items()}


def _layers(p: Params, prefix: str) -> int:
    return len({k[len(prefix):].split(".")[0] for k in p if k.startswith(prefix)})


# --------------------------------------------------------------------------------------------------------------
# LLaMA (transformers' LlamaForCausalLM, eager attention).
# --------------------------------------------------------------------------------------------------------------

def llama(p: Params, heads: int, kv_heads: int | None = None, eps: float = 1e-6, theta: float = 10000.0,
          rules: PlainRules = PLAIN) -> Model:
    """LlamaForCausalLM as a function of the input embeddings ``(B, T, D)``; returns logits ``(B, T, vocab)``."""
    w = _arrays(p)
    n_layers = _layers(p, "model.layers.")
    kv_heads = kv_heads or heads

    def rms_norm(x: jax.Array, weight: jax.Array) -> jax.Array:
        return weight[None, None, :] * (x * rules.norm(jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)))

    def rotate_half(x: jax.Array) -> jax.Array:
        half = x.shape[-1] // 2
        return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)

    def attention(x: jax.Array, i: int) -> jax.Array:
        b, t, d = x.shape
        hd = d // heads
        pre = f"model.layers.{i}.self_attn."
        q = (x @ w[pre + "q_proj.weight"].T).reshape(b, t, heads, hd)
        k = (x @ w[pre + "k_proj.weight"].T).reshape(b, t, kv_heads, hd)
        v = (x @ w[pre + "v_proj.weight"].T).reshape(b, t, kv_heads, hd)
        inv_freq = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float32) / hd)
        angles = np.arange(t, dtype=np.float32)[:, None] * inv_freq[None, :]
        angles = np.concatenate([angles, angles], axis=-1)
        cos, sin = jnp.asarray(np.cos(angles))[None, :, None, :], jnp.asarray(np.sin(angles))[None, :, None, :]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        q, k, v = rules.attention(q, k, v)
        k = jnp.repeat(k, heads // kv_heads, axis=2)
        v = jnp.repeat(v, heads // kv_heads, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        attn = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(q.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        return out @ w[pre + "o_proj.weight"].T

    def mlp(x: jax.Array, i: int) -> jax.Array:
        pre = f"model.layers.{i}.mlp."
        gate = x @ w[pre + "gate_proj.weight"].T
        up = x @ w[pre + "up_proj.weight"].T
        return rules.gated(jax.nn.silu, gate, up) @ w[pre + "down_proj.weight"].T

    def fn(emb: jax.Array) -> jax.Array:
        h = emb
        for i in range(n_layers):
            h = h + attention(rms_norm(h, w[f"model.layers.{i}.input_layernorm.weight"]), i)
            h = h + mlp(rms_norm(h, w[f"model.layers.{i}.post_attention_layernorm.weight"]), i)
        return rms_norm(h, w["model.norm.weight"]) @ w["lm_head.weight"].T

    return fn


# --------------------------------------------------------------------------------------------------------------
# GPT-2 (transformers' GPT2LMHeadModel, eager attention).
# --------------------------------------------------------------------------------------------------------------

def _layer_norm(rules: PlainRules, x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mean) ** 2, axis=-1, keepdims=True)
    return (x - mean) / rules.norm(jnp.sqrt(var + eps)) * weight[None, None, :] + bias[None, None, :]


def gelu_tanh(x: jax.Array) -> jax.Array:
    """GELU's tanh form, written out as GPT-2's ``NewGELUActivation``."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gpt2(p: Params, heads: int, eps: float = 1e-5, gelu: str = "inline", split_positions: bool = False,
         rules: PlainRules = PLAIN) -> Model:
    """GPT2LMHeadModel as a function of the input embeddings ``(B, T, D)`` (or, with ``split_positions``, of
    ``(token_embeddings, position_embeddings)``); returns logits ``(B, T, vocab)``."""
    w = _arrays(p)
    n_layers = _layers(p, "transformer.h.")
    act = gelu_tanh if gelu == "inline" else (lambda x: jax.nn.gelu(x, approximate=True))

    def attention(x: jax.Array, i: int) -> jax.Array:
        b, t, d = x.shape
        hd = d // heads
        pre = f"transformer.h.{i}.attn."
        qkv = x @ w[pre + "c_attn.weight"] + w[pre + "c_attn.bias"][None, None, :]
        q, k, v = (a.reshape(b, t, heads, hd).transpose(0, 2, 1, 3) for a in jnp.split(qkv, 3, axis=-1))
        q, k, v = rules.attention(q, k, v)
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(hd)
        causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
        scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        out = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return out @ w[pre + "c_proj.weight"] + w[pre + "c_proj.bias"][None, None, :]

    def mlp(x: jax.Array, i: int) -> jax.Array:
        pre = f"transformer.h.{i}.mlp."
        hidden = rules.act(act, x @ w[pre + "c_fc.weight"] + w[pre + "c_fc.bias"][None, None, :])
        return hidden @ w[pre + "c_proj.weight"] + w[pre + "c_proj.bias"][None, None, :]

    def ln(x: jax.Array, name: str) -> jax.Array:
        return _layer_norm(rules, x, w[name + ".weight"], w[name + ".bias"], eps)

    def body(h: jax.Array) -> jax.Array:
        for i in range(n_layers):
            h = h + attention(ln(h, f"transformer.h.{i}.ln_1"), i)
            h = h + mlp(ln(h, f"transformer.h.{i}.ln_2"), i)
        return ln(h, "transformer.ln_f") @ w["lm_head.weight"].T

    if split_positions:
        return lambda xs: body(xs[0] + xs[1])
    return lambda emb: body(emb + w["transformer.wpe.weight"][None, : emb.shape[1]])


# --------------------------------------------------------------------------------------------------------------
# ViT (torchvision's VisionTransformer).
# --------------------------------------------------------------------------------------------------------------

def vit(p: Params, heads: int, eps: float = 1e-6, rules: PlainRules = PLAIN) -> Model:
    """torchvision's VisionTransformer as a function of NCHW images; returns class logits ``(B, classes)``."""
    w = _arrays(p)
    n_layers = _layers(p, "encoder.layers.encoder_layer_")
    patch = w["conv_proj.weight"].shape[-1]

    def ln(x: jax.Array, name: str) -> jax.Array:
        return _layer_norm(rules, x, w[name + ".weight"], w[name + ".bias"], eps)

    def attention(x: jax.Array, pre: str) -> jax.Array:
        b, t, d = x.shape
        hd = d // heads
        wq, wk, wv = jnp.split(w[pre + "in_proj_weight"], 3, axis=0)
        bq, bk, bv = jnp.split(w[pre + "in_proj_bias"], 3)
        q, k, v = ((x @ m.T + c[None, None, :]).reshape(b, t, heads, hd) for m, c in ((wq, bq), (wk, bk), (wv, bv)))
        q, k, v = rules.attention(q, k, v)
        attn = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
        return out @ w[pre + "out_proj.weight"].T + w[pre + "out_proj.bias"][None, None, :]

    def fn(img: jax.Array) -> jax.Array:
        x = jax.lax.conv_general_dilated(img, w["conv_proj.weight"], (patch, patch), "VALID",
                                         dimension_numbers=("NCHW", "OIHW", "NCHW"))
        x = x + w["conv_proj.bias"][None, :, None, None]
        b, d = x.shape[:2]
        x = x.reshape(b, d, -1).transpose(0, 2, 1)
        x = jnp.concatenate([jnp.broadcast_to(w["class_token"], (b, 1, d)), x], axis=1)
        x = x + w["encoder.pos_embedding"]
        for i in range(n_layers):
            pre = f"encoder.layers.encoder_layer_{i}."
            x = x + attention(ln(x, pre + "ln_1"), pre + "self_attention.")
            y = ln(x, pre + "ln_2")
            y = rules.act(lambda a: jax.nn.gelu(a, approximate=False), y @ w[pre + "mlp.0.weight"].T
                          + w[pre + "mlp.0.bias"][None, None, :])
            x = x + y @ w[pre + "mlp.3.weight"].T + w[pre + "mlp.3.bias"][None, None, :]
        x = ln(x, "encoder.ln")
        return x[:, 0] @ w["heads.head.weight"].T + w["heads.head.bias"][None, :]

    return fn


def random_llama(key: jax.Array, layers: int, hidden: int, mlp: int, vocab: int, heads: int,
                 kv_heads: int | None = None) -> dict[str, np.ndarray]:
    """Random LLaMA weights under Hugging Face's names (normal, std 1/sqrt(fan-in); norm scales 1): for timing."""
    kv_heads = kv_heads or heads
    hd = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        pre = f"model.layers.{i}."
        shapes |= {pre + "input_layernorm.weight": (hidden,), pre + "post_attention_layernorm.weight": (hidden,),
                   pre + "self_attn.q_proj.weight": (hidden, hidden),
                   pre + "self_attn.k_proj.weight": (kv_heads * hd, hidden),
                   pre + "self_attn.v_proj.weight": (kv_heads * hd, hidden),
                   pre + "self_attn.o_proj.weight": (hidden, hidden),
                   pre + "mlp.gate_proj.weight": (mlp, hidden), pre + "mlp.up_proj.weight": (mlp, hidden),
                   pre + "mlp.down_proj.weight": (hidden, mlp)}
    out = {}
    for k, (name, shape) in zip(jax.random.split(key, len(shapes)), shapes.items()):
        out[name] = (np.ones(shape, np.float32) if len(shape) == 1 else
                     np.asarray(jax.random.normal(k, shape, jnp.float32)) / np.sqrt(shape[-1]))
    return out
