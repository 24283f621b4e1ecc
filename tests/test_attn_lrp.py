"""AttnLRP and CP-LRP (the gradient form of gk.attribution.lrp) against hand-written LXT-efficient references.

The models (``attn_models.py``) are plain JAX, written once with hooks at the places LXT 2.1's efficient mode
patches: with ``PLAIN`` hooks they are the unmodified model ``lrp`` explains by dataflow, with ``ATTN``/``CP``
hooks the hand-written LXT reference.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from attn_models import ATTN, CP, PLAIN, Cfg, Hooks, init, inputs, model, reference
from budget import pairwise

import gradkit as gk

ATTN_LRP = gk.attribution.ATTN_LRP
CP_LRP = gk.attribution.CP_LRP



@pytest.fixture(autouse=True)
def _broadcasting() -> Any:
    with jax.numpy_rank_promotion("allow"):  # the models add biases [n] to [T, n] as users write them
        yield


def _references(cfg: Cfg, params: Any, e: jax.Array, hooks: Hooks, target: int) -> tuple[jax.Array, jax.Array]:
    return reference(cfg, params, e, hooks, target), reference(cfg, params, e, PLAIN, target)


def compare(cfg: Cfg, seed: int, composite: Any, hooks: Hooks, *, jit: bool = False, rtol: float = 1e-5,
            atol: float = 1e-6, dtype: Any = jnp.float32, jit_references: bool | None = None) -> None:
    params = init(cfg, seed, dtype)
    e = inputs(cfg, seed, dtype=dtype)
    fn = lambda v: model(cfg, params, v, PLAIN)
    target = int(jnp.argmax(jax.jit(fn)(e)))
    run = lambda v: gk.attribution.lrp(fn, v, composite, target=target)
    r = (jax.jit(run) if jit else run)(e)  # eager: lrp runs the model's program operation by operation
    refs = lambda v: _references(cfg, params, v, hooks, target)
    ref, plain = (jax.jit(refs) if (jit if jit_references is None else jit_references) else refs)(e)
    r, ref, plain = (np.asarray(a).astype(np.float64) for a in (r, ref, plain))  # bfloat16 too
    scale = float(np.max(np.abs(ref)))
    np.testing.assert_allclose(r, ref, rtol=rtol, atol=atol * scale)
    np.testing.assert_allclose(r.sum(-1), ref.sum(-1), rtol=max(rtol, 1e-4), atol=10 * atol * scale)
    # the rules change the result: the reference is not the plain gradient × input
    assert float(np.max(np.abs(plain - ref))) > 1e-3 * scale


# --------------------------------------------------------------------------- tests


# Every pair of values of any two axes in some model (budget.pairwise: 16 models; 24 random ones missed 19 of
# the 233 pairs, grouped-query heads with 2 heads among them).
RANDOM_MODELS = pairwise(layout=["llama", "llama-gqa", "gpt2"], heads=[2, 4], ffn=[12, 20], layers=[1, 2],
                         attention=["einsum", "matmul", "inline", "dpa"], mask=["where", "add", "finfo"],
                         stack=["loop", "scan", "remat"], bias=[False, True], jit=[False, True])


def model_cfg(c: dict[str, Any]) -> Cfg:
    """The model of one ``RANDOM_MODELS`` entry: LLaMA with all or one key/value head (grouped), or GPT-2."""
    style = "gpt2" if c["layout"] == "gpt2" else "llama"
    return Cfg(d=8 * c["heads"], heads=c["heads"], kv_heads=1 if c["layout"] == "llama-gqa" else c["heads"],
               ffn=c["ffn"], layers=c["layers"], attention=c["attention"], mask=c["mask"], style=style,
               stack=c["stack"], bias=c["bias"])


def test_llama_block() -> None:
    compare(Cfg(layers=1), 0, ATTN_LRP, ATTN, jit=True)


@pytest.mark.slow
def test_gpt2_block() -> None:
    compare(Cfg(layers=1, style="gpt2", bias=True, kv_heads=4, attention="inline", mask="add"), 1, CP_LRP, CP,
            jit=True)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(len(RANDOM_MODELS)))
def test_random_models_match_the_hand_written_reference(seed: int) -> None:
    c = RANDOM_MODELS[seed]  # weights and inputs drawn from the seed; the references compiled whole
    compare(model_cfg(c), seed, ATTN_LRP, ATTN, jit=c["jit"], jit_references=True)
    compare(model_cfg(c), seed, CP_LRP, CP, jit=not c["jit"], jit_references=True)


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["einsum", "matmul", "inline", "dpa"])
@pytest.mark.parametrize("mask", ["where", "add", "finfo"])
def test_attention_forms_and_masks(attention: str, mask: str, maybe_jit: Any) -> None:
    compare(Cfg(layers=1, attention=attention, mask=mask), 2, ATTN_LRP, ATTN, jit=maybe_jit is jax.jit)
    compare(Cfg(layers=1, attention=attention, mask=mask), 2, CP_LRP, CP, jit=maybe_jit is jax.jit)


def test_scan_of_remat_blocks_with_grouped_query_heads() -> None:
    compare(Cfg(stack="remat", attention="dpa", kv_heads=1), 3, ATTN_LRP, ATTN, jit=True)


@pytest.mark.slow
def test_scan_eager_and_gpt2_scan() -> None:
    compare(Cfg(stack="scan", kv_heads=1), 3, ATTN_LRP, ATTN)
    compare(Cfg(style="gpt2", bias=True, kv_heads=4, attention="inline", mask="add", stack="scan"), 4, CP_LRP, CP,
            jit=True)


@pytest.mark.slow
def test_bfloat16() -> None:
    compare(Cfg(layers=1), 12, ATTN_LRP, ATTN, jit=True, rtol=2e-2, atol=2e-2, dtype=jnp.bfloat16)
    compare(Cfg(layers=1, style="gpt2", kv_heads=4), 13, CP_LRP, CP, jit=True, rtol=2e-2, atol=2e-2,
            dtype=jnp.bfloat16)


@pytest.mark.slow
def test_float64_matches_tighter(x64: Any) -> None:
    compare(Cfg(layers=1), 5, ATTN_LRP, ATTN, rtol=1e-10, atol=1e-12, dtype=jnp.float64)
    compare(Cfg(layers=1, style="gpt2", kv_heads=4), 6, CP_LRP, CP, rtol=1e-10, atol=1e-12, dtype=jnp.float64)


def test_cp_lrp_is_conservative_on_a_bias_free_llama() -> None:
    cfg = Cfg(layers=2)
    params = init(cfg, 7)
    e = inputs(cfg, 7)
    fn = lambda v: model(cfg, params, v, PLAIN)
    logits = jax.jit(fn)(e)
    r, report = jax.jit(lambda v: gk.attribution.lrp(fn, v, CP_LRP, check=True))(e)
    top = float(jnp.max(logits))
    assert abs(float(r.sum()) - top) <= 1e-4 * abs(top)
    assert abs(float(report.total_relevance) - float(r.sum())) <= 1e-6 * abs(top)
    assert float(report.seed) == 1.0 and abs(float(report.explained_output) - top) <= 1e-6 * abs(top)
    # AttnLRP is not: its softmax rule drops the linearisation's bias term (AttnLRP's Prop. 3.1)
    r_attn = jax.jit(lambda v: gk.attribution.lrp(fn, v, ATTN_LRP))(e)
    assert abs(float(r_attn.sum()) - top) > 1e-3 * abs(top)


def test_relevance_at_position_embeddings() -> None:
    cfg = Cfg(style="gpt2", bias=True, kv_heads=4, layers=1)
    params = init(cfg, 8)
    tok, pos = inputs(cfg, 8), 0.5 * inputs(cfg, 9)
    fn = lambda e: model(cfg, params, e, PLAIN)
    target = int(jnp.argmax(jax.jit(fn)((tok, pos))))
    r_tok, r_pos = jax.jit(lambda e: gk.attribution.lrp(fn, e, ATTN_LRP, target=target))((tok, pos))
    ref_tok, ref_pos = jax.jit(lambda e: reference(cfg, params, e, ATTN, target))((tok, pos))
    np.testing.assert_allclose(np.asarray(r_tok), np.asarray(ref_tok), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(r_pos), np.asarray(ref_pos), rtol=1e-5, atol=1e-6)
    assert float(jnp.max(jnp.abs(r_pos))) > 1e-3
    _, report = jax.jit(lambda e: gk.attribution.lrp(fn, e, ATTN_LRP, target=target, check=True))((tok, pos))
    np.testing.assert_allclose(float(report.total_relevance), float(r_tok.sum() + r_pos.sum()), rtol=1e-5)


@pytest.mark.slow
def test_batched_under_vmap() -> None:
    cfg = Cfg(layers=1)
    params = init(cfg, 10)
    es = jnp.stack([inputs(cfg, 10), inputs(cfg, 11)])
    fn = lambda v: model(cfg, params, v, PLAIN)
    rs = jax.vmap(lambda v: gk.attribution.lrp(fn, v, ATTN_LRP, target=3))(es)
    for e, r in zip(es, rs):
        np.testing.assert_allclose(np.asarray(r), np.asarray(reference(cfg, params, e, ATTN, 3)), rtol=1e-5,
                                   atol=1e-6)


def _identity_reference(f: Any, x: jax.Array, eps: float) -> jax.Array:
    return f(x) / (x + eps)  # ΣR = Σ f(x): the identity rule at one activation, seeded with 1 on a sum


@pytest.mark.parametrize("name,f", [
    ("silu", jax.nn.silu), ("x*sigmoid(x)", lambda x: x * jax.nn.sigmoid(x)),
    ("gelu_tanh", lambda x: jax.nn.gelu(x, approximate=True)),
    ("gelu_erf", lambda x: jax.nn.gelu(x, approximate=False)),
    ("tanh", jnp.tanh), ("relu", jax.nn.relu), ("softplus", jax.nn.softplus),
])
def test_activations_take_the_identity_rule(name: str, f: Any) -> None:
    x = jnp.array([-2.0, -0.5, 1e-3, 0.7, 3.0])
    w = jnp.array([[0.5], [-1.0], [2.0], [1.5], [0.25]])
    fn = lambda v: f(v * 1.5 + 0.1) @ w
    h = x * 1.5 + 0.1
    r = gk.attribution.lrp(fn, x, ATTN_LRP)
    want = x * 1.5 * w[:, 0] * f(h) / (h + 1e-10)
    np.testing.assert_allclose(np.asarray(r), np.asarray(want), rtol=1e-5, atol=1e-7)
    r6 = gk.attribution.lrp(fn, x, ATTN_LRP | {"activation": gk.attribution.identity(1e-2)})
    np.testing.assert_allclose(np.asarray(r6), np.asarray(x * 1.5 * w[:, 0] * f(h) / (h + 1e-2)), rtol=1e-5,
                               atol=1e-7)
    kept = gk.attribution.lrp(fn, x, ATTN_LRP | {"activation": gk.attribution.gradient_rule()})
    g = jax.grad(lambda v: fn(v)[0])(x)
    np.testing.assert_allclose(np.asarray(kept), np.asarray(x * g), rtol=1e-5, atol=1e-7)


def test_what_the_dataflow_finds() -> None:
    from gradkit._src import compat

    def kinds(fn: Any, x: Any) -> dict[str, int]:
        found: dict[str, int] = {}
        jax.make_jaxpr(lambda v: found.update(compat.run_gradient_form(fn, v, lambda s, ops: s.apply(*ops))[2]))(x)
        return found

    cfg = Cfg(layers=2)
    params = init(cfg, 0)
    e = inputs(cfg, 0)
    # per block: 2 RMSNorms, q·kᵀ, A·v, silu(gate)·up; plus the final RMSNorm. The softmax's exp is no activation.
    assert kinds(lambda v: model(cfg, params, v, PLAIN), e) == {"normalizer": 5, "product": 6, "activation": 2}
    # the same in bfloat16 (which NumPy does not count as floating point)
    bf16 = init(cfg, 0, jnp.bfloat16)
    assert kinds(lambda v: model(cfg, bf16, v, PLAIN), e.astype(jnp.bfloat16)) == {"normalizer": 5, "product": 6,
                                                                                   "activation": 2}
    gcfg = Cfg(style="gpt2", bias=True, kv_heads=4, layers=1, attention="inline")
    gparams = init(gcfg, 0)
    # the LayerNorm's centring is no normalizer; GELU's tanh form is one activation
    assert kinds(lambda v: model(gcfg, gparams, v, PLAIN), e) == {"normalizer": 3, "product": 2, "activation": 1}
    # a log-softmax's exp (a logsumexp) is no activation; a softmax with where= is a softmax (no normalizer)
    assert kinds(lambda v: jax.nn.log_softmax(v @ params["head"]), e) == {}
    mask = jnp.arange(cfg.d) % 3 > 0
    assert kinds(lambda v: jax.nn.softmax(v * 2.0, where=mask), e) == {}
    # a gated MLP whose gate and up come out of one matrix product: an activation and a product
    assert kinds(lambda v: jax.nn.gelu(v[:, :8]) * v[:, 8:], e) == {"activation": 1, "product": 1}


def test_rules_that_do_not_fit_the_form() -> None:
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*does not fit the 'gradient' form"):
        ATTN_LRP | {"dense": gk.attribution.epsilon(1e-6)}
    with pytest.raises(gk.GradkitError, match=r"for 'product' sites, not 'activation'"):
        ATTN_LRP | {"activation": gk.attribution.uniform()}
    with pytest.raises(gk.GradkitError, match=r"does not fit the 'relevance' form"):
        gk.attribution.EPSILON_PLUS | {"activation": gk.attribution.identity()}
    with pytest.raises(gk.GradkitError, match=r"stabilizer must be >= 0"):
        gk.attribution.identity(-1.0)
    assert gk.attribution.ATTN_LRP.form == gk.attribution.CP_LRP.form == "gradient"
    assert gk.attribution.FORMS == ("relevance", "gradient")
    assert (ATTN_LRP | {"activation": gk.attribution.identity(1e-6)})["activation"] == gk.attribution.identity(1e-6)


@pytest.mark.parametrize("branch", [0, 1])
def test_inside_cond_and_switch(branch: int) -> None:
    keys = jax.random.split(jax.random.key(20), 4)
    w1, w2, w3 = (jax.random.normal(k, (6, 6)) / 3 for k in keys[:3])
    x = jax.random.normal(keys[3], (6,))

    def body(v: jax.Array, hooks: Any) -> list[jax.Array]:
        gated = hooks.gate(hooks.act(jax.nn.silu, v @ w1), v @ w2) @ w3
        normed = v * hooks.norm(jax.lax.rsqrt(jnp.mean(v * v) + 1e-6))
        return [gated, normed @ w3]

    def fn(v: jax.Array, hooks: Any, index: Any) -> jax.Array:
        return jax.lax.switch(index, [lambda u: body(u, hooks)[0], lambda u: body(u, hooks)[1]], v)

    index = jnp.asarray(branch)  # a traced index: the runner must enter both branches
    r = jax.jit(lambda v, i: gk.attribution.lrp(lambda u: fn(u, PLAIN, i), v, ATTN_LRP, target=2))(x, index)
    g = jax.grad(lambda v: fn(v, ATTN, branch)[2])(x)
    np.testing.assert_allclose(np.asarray(r), np.asarray(x * g), rtol=1e-5, atol=1e-7)
    assert float(jnp.max(jnp.abs(x * jax.grad(lambda v: fn(v, PLAIN, branch)[2])(x) - r))) > 1e-4


def test_an_opaque_custom_vjp_on_the_path_is_named() -> None:
    @jax.custom_vjp
    def square_kernel(v: jax.Array) -> jax.Array:
        return v * v

    square_kernel.defvjp(lambda v: (v * v, v), lambda v, g: (2 * v * g,))
    fn = lambda v: square_kernel(v)[:1]
    x = jnp.array([1.5, -2.0])
    with pytest.warns(gk.GradkitWarning, match=r"keep their own derivative.*square_kernel at .*test_attn_lrp.py"):
        r = gk.attribution.lrp(fn, x, ATTN_LRP)
    np.testing.assert_allclose(np.asarray(r), [2 * 1.5 * 1.5, 0.0])  # its own gradient × input
    with pytest.raises(gk.GradkitError, match=r"strict=True makes this an error"):
        gk.attribution.lrp(fn, x, ATTN_LRP, strict=True)


@pytest.mark.parametrize("composite", ["ATTN_LRP", "EPSILON_PLUS"])
def test_a_model_returning_a_structure_is_an_error_in_both_forms(composite):
    w = jnp.eye(3)
    with pytest.raises(gk.GradkitError, match="must return one array"):
        gk.attribution.lrp(lambda v: (v @ w, v @ w), jnp.ones((2, 3)), getattr(gk.attribution, composite))
