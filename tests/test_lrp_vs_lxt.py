"""gk.attribution.lrp's ATTN_LRP and CP_LRP on unmodified transformers against LXT 2.1, without PyTorch.

``tests/data/lrp_lxt_tiny.npz`` holds tiny seeded-random models (Hugging
Face's ``LlamaForCausalLM``, 2 layers, hidden 64, with 2 heads and with
grouped-query heads (4 heads, 2 key/value heads); ``GPT2LMHeadModel``, 2
layers, n_embd 64; torchvision's ``VisionTransformer``, image 32, patch 8,
2 layers, hidden 64), their weights under PyTorch's names (as int8 and a
power-of-two scale: the exact float32 values the models ran with), the input
embeddings of two 8-token sequences (two images for the ViT), the explained
classes (the largest logit at the last position), PyTorch's logits, and LXT
2.1's relevances at the inputs, efficient mode, ``attnLRP`` and ``cp_LRP``
maps (the ViT: ``cp_LRP`` only); for GPT-2 also the relevance at the position
embeddings. ``benchmarks/attribution_vs_lxt.py --write`` made it.

The models here are the plain-JAX twins of ``benchmarks/transformer_twins.py``
(``jnp.einsum``/``@``, ``jax.nn.softmax``, ``jnp.where`` causal masks, inline
RMSNorm, LayerNorm and GELU-tanh). Three independent checks: the twins give
PyTorch's logits; a hand-written JAX re-implementation of LXT's rules
(``custom_vjp`` at q, k, v, the identity ratio, stop-gradient norms) gives
LXT's relevances, so the stored data and the twins are right whatever gradkit
does; and gradkit's composites, which see only the unmodified model, give
them too (elementwise rtol 1e-4 / atol 1e-6 in float32, per token 1e-3).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk


def _twins() -> ModuleType:
    """``benchmarks/transformer_twins.py`` (benchmarks/ is no package), loaded from its file: putting its folder on
    ``sys.path`` would let its ``common.py`` and ``run.py`` shadow other modules for the rest of the session."""
    path = Path(__file__).parents[1] / "benchmarks" / "transformer_twins.py"
    spec = importlib.util.spec_from_file_location("transformer_twins", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("transformer_twins", module)
    spec.loader.exec_module(module)
    return module


tt = _twins()

DATA = Path(__file__).parent / "data" / "lrp_lxt_tiny.npz"
RTOL, ATOL, TOKEN_TOL = 1e-4, 1e-6, 1e-3
HEADS = {"llama": (2, 2), "llama_gqa": (4, 2), "gpt2": (2, 2), "vit": (2, 2)}
CASES = [("llama", "attnlrp"), ("llama", "cp"), ("llama_gqa", "attnlrp"), ("llama_gqa", "cp"),
         ("gpt2", "attnlrp"), ("gpt2", "cp"), ("vit", "cp")]


def cases(default: set[tuple[str, str]]) -> list[Any]:
    """:data:`CASES`, those not in ``default`` marked slow (the default set stays within its time budget)."""
    return [pytest.param(*c, id="-".join(c), marks=() if c in default else pytest.mark.slow) for c in CASES]
COMPOSITES = {"attnlrp": "ATTN_LRP", "cp": "CP_LRP"}
LXT_RULES = {"attnlrp": tt.LXT_ATTN_LRP, "cp": tt.LXT_CP_LRP}


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA) as f:
        return dict(f)


def params(ref: dict[str, np.ndarray], kind: str) -> dict[str, np.ndarray]:
    pre = f"{kind}/int8/"
    return {k[len(pre):]: v.astype(np.float32) * ref[f"{kind}/scale/{k[len(pre):]}"]
            for k, v in ref.items() if k.startswith(pre)}


def inputs(ref: dict[str, np.ndarray], kind: str) -> jax.Array:
    if kind == "vit":
        return jnp.asarray(ref["vit/x_int8_over_32"].astype(np.float32) / 32)
    return jnp.asarray(ref[f"{kind}/x"])


def model(ref: dict[str, np.ndarray], kind: str, rules: tt.PlainRules = tt.PLAIN, **kw: Any
          ) -> Callable[[Any], jax.Array]:
    """The twin returning the explained logits (the last position's for the language models)."""
    p, (heads, kv) = params(ref, kind), HEADS[kind]
    if kind == "vit":
        return tt.vit(p, heads, rules=rules)
    fn = tt.llama(p, heads, kv, rules=rules) if kind.startswith("llama") else tt.gpt2(p, heads, rules=rules, **kw)
    return lambda e: fn(e)[:, -1, :]


def token_sums(r: Any, kind: str) -> np.ndarray:
    """Per token (language models: summed over the hidden axis) or per pixel (ViT: summed over channels)."""
    return np.asarray(r, np.float64).sum(axis=1 if kind == "vit" else 2)


def assert_like_lxt(ours: Any, theirs: np.ndarray, kind: str) -> None:
    ours = np.asarray(ours)
    assert ours.shape == theirs.shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(token_sums(ours, kind), token_sums(theirs, kind), rtol=0, atol=TOKEN_TOL)
    n = theirs.shape[0]
    np.testing.assert_allclose(ours.reshape(n, -1).sum(1, dtype=np.float64),
                               theirs.reshape(n, -1).sum(1, dtype=np.float64), rtol=1e-4, atol=1e-5)


def lxt_form(fn: Callable[[Any], jax.Array], x: Any, target: np.ndarray) -> Any:
    """``x * grad`` of the explained logits' sum: with LXT's rules written into the model, LXT's relevance."""
    def score(v: Any) -> jax.Array:
        return jnp.sum(jnp.take_along_axis(fn(v), jnp.asarray(target)[:, None], axis=-1))

    return jax.tree_util.tree_map(jnp.multiply, x, jax.grad(score)(x))


@pytest.mark.parametrize("kind", [pytest.param(k, marks=() if k == "llama_gqa" else pytest.mark.slow)
                                  for k in HEADS])
def test_twins_reproduce_the_stored_logits(ref: dict[str, np.ndarray], kind: str) -> None:
    # The twins read the stored weights as PyTorch computed with them, or nothing below means anything.
    logits = np.asarray(jax.jit(model(ref, kind))(inputs(ref, kind)))
    np.testing.assert_allclose(logits, ref[f"{kind}/logits"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(np.argmax(logits, -1), ref[f"{kind}/target"])


@pytest.mark.parametrize(("kind", "method"), cases({("llama_gqa", "attnlrp")}))
def test_the_lxt_rules_written_in_jax_reproduce_lxt(ref: dict[str, np.ndarray], kind: str, method: str) -> None:
    # The stored relevances are LXT's efficient rules on these weights, independent of gradkit.
    r = jax.jit(lambda v: lxt_form(model(ref, kind, LXT_RULES[method]), v, ref[f"{kind}/target"]))(inputs(ref, kind))
    assert_like_lxt(r, ref[f"{kind}/{method}/relevance"], kind)


def test_the_stored_maps_tell_the_methods_apart(ref: dict[str, np.ndarray]) -> None:
    # The tolerances separate: AttnLRP and CP-LRP differ by far more than them, the map is not trivially zero,
    # and LLaMA (no biases) is conservative under CP-LRP (ΣR = the logit), not under AttnLRP (the softmax's
    # bias term absorbs relevance), as LXT's authors report.
    for kind in ("llama", "llama_gqa", "gpt2"):
        a, c = ref[f"{kind}/attnlrp/relevance"], ref[f"{kind}/cp/relevance"]
        assert np.max(np.abs(token_sums(a, kind) - token_sums(c, kind))) > 100 * TOKEN_TOL
        assert np.max(np.abs(a)) > 0.1
    for kind in ("llama", "llama_gqa"):
        logit = ref[f"{kind}/cp/logit"].astype(np.float64)
        np.testing.assert_allclose(ref[f"{kind}/cp/relevance"].sum(axis=(1, 2), dtype=np.float64), logit, rtol=1e-5)
        sums = ref[f"{kind}/attnlrp/relevance"].sum(axis=(1, 2), dtype=np.float64)
        assert np.all(np.abs(sums / logit - 1) > 0.2)


@pytest.mark.parametrize(("kind", "method"), cases({("llama_gqa", "attnlrp"), ("gpt2", "attnlrp"),
                                                    ("vit", "cp")}))
def test_lrp_equals_lxt(ref: dict[str, np.ndarray], kind: str, method: str) -> None:
    fn = model(ref, kind)
    composite = getattr(gk.attribution, COMPOSITES[method])
    r = jax.jit(lambda v, t: gk.attribution.lrp(fn, v, composite, target=t))(
        inputs(ref, kind), jnp.asarray(ref[f"{kind}/target"]))
    assert_like_lxt(r, ref[f"{kind}/{method}/relevance"], kind)


@pytest.mark.slow
def test_lrp_equals_lxt_without_jit_and_one_sequence_at_a_time(ref: dict[str, np.ndarray]) -> None:
    # Eagerly, and per sequence: the batch's rows are independent explanations.
    fn = model(ref, "llama")
    x, target = inputs(ref, "llama"), ref["llama/target"]
    for i in range(x.shape[0]):
        r = gk.attribution.lrp(fn, x[i:i + 1], gk.attribution.ATTN_LRP, target=jnp.asarray(target[i:i + 1]))
        assert_like_lxt(r, ref["llama/attnlrp/relevance"][i:i + 1], "llama")


@pytest.mark.parametrize("method", ["cp", pytest.param("attnlrp", marks=pytest.mark.slow)])
def test_relevance_at_the_position_embeddings_as_lxt(ref: dict[str, np.ndarray], method: str) -> None:
    # GPT-2 explained with respect to (token embeddings, position embeddings): both parts as LXT reads them.
    p = params(ref, "gpt2")
    fn = tt.gpt2(p, 2, split_positions=True)
    x = inputs(ref, "gpt2")
    pos = jnp.broadcast_to(jnp.asarray(p["transformer.wpe.weight"][: x.shape[1]]), x.shape)
    composite = getattr(gk.attribution, COMPOSITES[method])
    r_tok, r_pos = jax.jit(lambda xs, t: gk.attribution.lrp(lambda v: fn(v)[:, -1, :], xs, composite, target=t))(
        (x, pos), jnp.asarray(ref["gpt2/target"]))
    assert_like_lxt(r_tok, ref[f"gpt2/{method}/relevance"], "gpt2")
    assert_like_lxt(r_pos, ref[f"gpt2/{method}/relevance_positions"], "gpt2")


@pytest.mark.slow
def test_gpt2_with_jax_gelu_equals_lxt_too(ref: dict[str, np.ndarray]) -> None:
    # GELU's tanh form as jax.nn.gelu(approximate=True) rather than written out: the same identity rule.
    fn = model(ref, "gpt2", gelu="jax")
    r = jax.jit(lambda v, t: gk.attribution.lrp(fn, v, gk.attribution.ATTN_LRP, target=t))(
        inputs(ref, "gpt2"), jnp.asarray(ref["gpt2/target"]))
    assert_like_lxt(r, ref["gpt2/attnlrp/relevance"], "gpt2")


@pytest.mark.parametrize("kind", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])
def test_gradient_times_input_is_far_from_lxt(ref: dict[str, np.ndarray], kind: str) -> None:
    # The control: the plain gradient (no rules) must fail the comparison by far.
    fn = model(ref, kind)
    r = jax.jit(lambda v: lxt_form(fn, v, ref[f"{kind}/target"]))(inputs(ref, kind))
    theirs = ref[f"{kind}/attnlrp/relevance"]
    assert not np.allclose(np.asarray(r), theirs, rtol=RTOL, atol=ATOL)
    assert np.max(np.abs(token_sums(r, kind) - token_sums(theirs, kind))) > 100 * TOKEN_TOL
