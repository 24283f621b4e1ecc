"""gk.attribution.lrp's ATTN_LRP and CP_LRP against LXT 2.1 (efficient AttnLRP / CP-LRP) on tiny LLaMA, GPT-2, ViT.

A reference comparison for issue 37, not part of CI and not a test. It needs
PyTorch, transformers 4.52 and LXT 2.1 next to JAX, so it runs from a
separate virtual environment (kept outside the repository), e.g., from the
repository's root::

    python3.13 -m venv ../venv-zennit
    ../venv-zennit/bin/pip install torch==2.14.1 torchvision==0.29.1 "lxt==2.1" "transformers==4.52.4"
    # JAX, Flax from the project's environment, gradkit from the checkout:
    PYTHONPATH=.:$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))") \\
        ../venv-zennit/bin/python benchmarks/attribution_vs_lxt.py [--write PATH] [--perf] [--out PATH]

(lxt 2.1 needs transformers 4.52.x: with transformers 5, ``import
lxt.efficient`` fails. LXT's ``monkey_patch`` rebinds classes and module
functions for the whole process and has no undo, so every LXT run here is a
fresh subprocess of this script, and plain PyTorch gradients come from a
process that never patches.)

What it does:

1. Builds the tiny models with seeded random weights: ``LlamaForCausalLM``
   (2 layers, hidden 64, 2 heads, MLP 128, vocab 128), the same with
   grouped-query heads (4 heads, 2 key/value heads), ``GPT2LMHeadModel``
   (2 layers, n_embd 64, 2 heads) and torchvision's ``VisionTransformer``
   (image 32, patch 8, 2 layers, hidden 64, 2 heads, MLP 128, 10 classes);
   matrices ×10 (the ViT's ×3), biases (and the ViT's positions and class
   token) 0.1·N(0, 1), norm scales 1 + 0.1·N(0, 1), so that the relevances are
   not trivial; every weight rounded to a grid of a power-of-two step, 15
   levels for matrices and 255 for vectors (exact float32 values that the
   stored reference keeps as int8 and a scale, so it stays small).
   Inputs: token ids ``[[1, 17, 42, 7, 99, 3, 55, 23], [5, 88, 13, 64, 2, 120, 31, 9]]`` (their
   input embeddings) and 2 random 3×32×32 images.
2. Explains the largest logit at the last position of each sequence (the top
   class of each image) with LXT's efficient AttnLRP (``attnLRP`` maps) and
   CP-LRP (``cp_LRP`` maps; torchvision's ViT has only that one): relevance =
   input × modified gradient, seed 1 at the logit. For GPT-2 also the
   relevance at the position embeddings.
3. Checks its own footing first: the JAX twins (``transformer_twins.py``)
   reproduce PyTorch's logits, and a hand-written JAX re-implementation of
   LXT's rules (``custom_vjp`` at q, k, v, the identity ratio, stop-gradient
   norms: the twins' ``LXT_ATTN_LRP`` / ``LXT_CP_LRP``) reproduces LXT's
   relevances within rtol 1e-4 / atol 1e-6.
4. Compares ``gk.attribution.lrp(twin, emb, ATTN_LRP / CP_LRP, target=idx)``
   with LXT: max |Δ| elementwise and per token, ΣR / logit for both (where
   gradkit has the composites).
5. ``--write PATH`` instead stores the weights, inputs, targets, logits and
   LXT's relevances in one small ``.npz`` (``tests/data/lrp_lxt_tiny.npz``,
   read by ``tests/test_lrp_vs_lxt.py`` without PyTorch).
6. ``--perf``: a LLaMA of 4 layers, hidden 256 (3.7 M parameters) at
   sequence 128 and 1024, batch 1 and 4: one jitted ATTN_LRP explanation
   against one jitted ``jax.grad`` of the same model (interleaved, min of
   repeats) and their compiled temporary memory; LXT efficient AttnLRP
   against the plain PyTorch input gradient at 1 and 2 threads.

Prints Markdown tables and writes JSON to ``--out`` (default
``benchmarks/results_attribution_vs_lxt.json``, gitignored).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
DEFAULT_OUT = os.path.join(HERE, "results_attribution_vs_lxt.json")
REFERENCE = os.path.join(os.path.dirname(HERE), "tests", "data", "lrp_lxt_tiny.npz")
IDS = np.array([[1, 17, 42, 7, 99, 3, 55, 23], [5, 88, 13, 64, 2, 120, 31, 9]], np.int64)
MODELS = ("llama", "llama_gqa", "gpt2", "vit")
#: the LXT maps each model has (torchvision's ViT: cp_LRP only).
METHODS = {"llama": ("attnlrp", "cp"), "llama_gqa": ("attnlrp", "cp"), "gpt2": ("attnlrp", "cp"), "vit": ("cp",)}
HEADS = {"llama": (2, 2), "llama_gqa": (4, 2), "gpt2": (2, 2), "vit": (2, 2)}
RTOL, ATOL, TOKEN_TOL = 1e-4, 1e-6, 1e-3


# --------------------------------------------------------------------------------------------------------------
# PyTorch side (imported lazily: the LXT subprocesses patch transformers' classes).
# --------------------------------------------------------------------------------------------------------------

def torch_model(kind: str, seed: int = 0, perf: dict[str, int] | None = None) -> Any:
    """The tiny model, seeded random weights, matrices x10, norm scales 1 + 0.1 N, weights on a grid, eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if kind.startswith("llama"):
        heads, kv = HEADS.get(kind, (4, 4))
        size = perf or {"layers": 2, "hidden": 64, "mlp": 128, "vocab": 128}
        cfg = transformers.LlamaConfig(
            vocab_size=size["vocab"], hidden_size=size["hidden"], intermediate_size=size["mlp"],
            num_hidden_layers=size["layers"], num_attention_heads=heads, num_key_value_heads=kv,
            max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
            attn_implementation="eager")
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                      attn_implementation="eager")
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        from torchvision.models.vision_transformer import VisionTransformer
        model = VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2, hidden_dim=64,
                                  mlp_dim=128, num_classes=10)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2 and "pos" not in name and "class_token" not in name:
                p.mul_(10.0 if kind != "vit" else 3.0)
            elif p.ndim == 1 and ("norm" in name or "ln" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias") or "pos" in name or "class_token" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            if name == "heads.head.weight":  # torchvision initialises the head with zeros
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            levels = 127.0 if p.ndim == 1 else 7.0  # matrices on a 4-bit grid: a small stored file
            scale = 2.0 ** np.ceil(np.log2(float(p.abs().max()) / levels))
            p.copy_(torch.round(p / scale) * scale)
            p.requires_grad_(False)
    return model.float().eval()


def state(model: Any) -> dict[str, np.ndarray]:
    """The parameters as NumPy arrays (buffers such as GPT-2's causal mask left out)."""
    return {k: v.detach().numpy().copy() for k, v in model.named_parameters(remove_duplicate=False)}


def load_state(model: Any, params: dict[str, np.ndarray]) -> None:
    import torch

    with torch.no_grad():
        for k, p in model.named_parameters():
            p.copy_(torch.from_numpy(params[k]))


def torch_inputs(kind: str, model: Any) -> np.ndarray:
    """Input embeddings of :data:`IDS` (LLaMA, GPT-2) or 2 random images (ViT)."""
    import torch

    if kind == "vit":
        # on a grid of 1/32 (exact in float32, stored as int8)
        return np.clip(np.round(np.random.default_rng(0).standard_normal((2, 3, 32, 32)) * 32), -127, 127
                       ).astype(np.float32) / 32
    with torch.no_grad():
        return model.get_input_embeddings()(torch.from_numpy(IDS)).numpy().copy()


def torch_explain(kind: str, model: Any, x: np.ndarray, target: np.ndarray | None) -> dict[str, np.ndarray]:
    """``x * grad`` of the explained logits' sum (a patched model: LXT's relevance), the logits, the targets;
    GPT-2: also the relevance at the position embeddings."""
    import torch

    inp = torch.from_numpy(x).clone().requires_grad_(True)
    out: dict[str, np.ndarray] = {}
    if kind == "vit":
        logits = model(inp)
        last = logits
    else:
        kw: dict[str, Any] = {"inputs_embeds": inp, "use_cache": False}
        pos_store: list[Any] = []
        if kind == "gpt2":
            b, t = x.shape[:2]
            kw["position_ids"] = torch.arange(t)[None, :].expand(b, t)
            def leaf(module: Any, args: Any, output: Any) -> Any:  # the position embeddings as a leaf
                pos_store.append(output.detach().requires_grad_(True))
                return pos_store[-1]

            hook = model.transformer.wpe.register_forward_hook(leaf)
        logits = model(**kw).logits
        if kind == "gpt2":
            hook.remove()
        last = logits[:, -1, :]
    idx = last.argmax(-1) if target is None else torch.from_numpy(target)
    if target is not None:
        assert torch.equal(last.argmax(-1), idx), "the patched model explains another class"
    chosen = last[torch.arange(last.shape[0]), idx]
    chosen.sum().backward()
    out["relevance"] = (inp * inp.grad).detach().numpy().copy()
    if kind not in ("vit",) and pos_store:
        out["relevance_positions"] = (pos_store[0] * pos_store[0].grad).detach().numpy().copy()
        out["positions"] = pos_store[0].detach().numpy().copy()
    out["logits"] = last.detach().numpy().copy()
    out["target"] = idx.numpy().astype(np.int32)
    out["logit"] = chosen.detach().numpy().copy()
    return out


def lxt_patch(kind: str, method: str) -> None:
    """LXT's monkey patches for ``kind`` and ``method`` (for this whole process, no undo)."""
    from lxt.efficient import monkey_patch

    if kind == "vit":
        from lxt.efficient.models.vit_torch import cp_LRP
        from torchvision.models import vision_transformer

        monkey_patch(vision_transformer, cp_LRP)
        return
    if kind.startswith("llama"):
        from lxt.efficient.models import llama as maps
        from transformers.models.llama import modeling_llama as module
    else:
        from lxt.efficient.models import gpt2 as maps  # type: ignore[no-redef]
        from transformers.models.gpt2 import modeling_gpt2 as module  # type: ignore[no-redef]
    monkey_patch(module, maps.attnLRP if method == "attnlrp" else maps.cp_LRP)


def child(args: argparse.Namespace) -> int:
    """The LXT subprocess: patch, load the weights, explain, write the result."""
    with np.load(args.child_in) as f:
        data = dict(f)
    kind, method = args.child
    lxt_patch(kind, method)
    model = torch_model(kind)
    load_state(model, {k.removeprefix("param/"): v for k, v in data.items() if k.startswith("param/")})
    res = torch_explain(kind, model, data["x"], data["target"])
    np.savez(args.child_out, **res)
    return 0


def run_lxt(kind: str, method: str, params: dict[str, np.ndarray], x: np.ndarray, target: np.ndarray
            ) -> dict[str, np.ndarray]:
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        np.savez(src, x=x, target=target, **{f"param/{k}": v for k, v in params.items()})
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", kind, method,
                        "--child-in", src, "--child-out", dst], check=True)
        with np.load(dst) as f:
            return dict(f)


def reference(kinds: tuple[str, ...] = MODELS) -> dict[str, dict[str, Any]]:
    """Per model: weights, inputs, the plain PyTorch logits and input gradient, and LXT's relevances."""
    out: dict[str, dict[str, Any]] = {}
    for kind in kinds:
        model = torch_model(kind)
        params = state(model)
        x = torch_inputs(kind, model)
        plain = torch_explain(kind, model, x, None)  # this process never patches
        entry: dict[str, Any] = {"params": params, "x": x, "plain": plain, "target": plain["target"]}
        for method in METHODS[kind]:
            entry[method] = run_lxt(kind, method, params, x, plain["target"])
        out[kind] = entry
    return out


# --------------------------------------------------------------------------------------------------------------
# JAX side.
# --------------------------------------------------------------------------------------------------------------

def twin(kind: str, params: dict[str, np.ndarray], rules: Any = None, split_positions: bool = False) -> Any:
    """The plain-JAX twin of ``kind`` as a function of its input, returning the explained logits (the last
    position's for the language models)."""
    import transformer_twins as tt

    rules = rules or tt.PLAIN
    heads, kv = HEADS.get(kind, (4, 4))
    if kind == "vit":
        return tt.vit(params, heads, rules=rules)
    if kind.startswith("llama"):
        fn = tt.llama(params, heads, kv, rules=rules)
    else:
        fn = tt.gpt2(params, heads, split_positions=split_positions, rules=rules)
    return lambda e: fn(e)[:, -1, :]


def lxt_form(fn: Any, x: Any, target: np.ndarray) -> Any:
    """``x * grad`` of the explained logits' sum, ``fn`` built with the hand-written LXT rules."""
    import jax
    import jax.numpy as jnp

    def score(v: Any) -> jax.Array:
        out = fn(v)
        return jnp.sum(jnp.take_along_axis(out, jnp.asarray(target)[:, None], axis=-1))

    g = jax.grad(score)(x)
    return jax.tree_util.tree_map(lambda a, b: np.asarray(a * b), x, g)


def compare(ours: np.ndarray, ref: np.ndarray, token_axes: tuple[int, ...]) -> dict[str, Any]:
    ours64, ref64 = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    tok_o, tok_r = ours64.sum(axis=token_axes), ref64.sum(axis=token_axes)
    return {"max_abs": float(np.max(np.abs(ours64 - ref64))), "max_ref": float(np.max(np.abs(ref64))),
            "allclose": bool(np.allclose(ours, ref, rtol=RTOL, atol=ATOL)),
            "token_max_abs": float(np.max(np.abs(tok_o - tok_r))),
            "sum_ours": [float(v) for v in ours64.reshape(ours64.shape[0], -1).sum(1)],
            "sum_ref": [float(v) for v in ref64.reshape(ref64.shape[0], -1).sum(1)]}


def agreement(refs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    import jax
    import jax.numpy as jnp
    import transformer_twins as tt

    import gradkit as gk

    composites = {m: getattr(gk.attribution, n, None) for m, n in (("attnlrp", "ATTN_LRP"), ("cp", "CP_LRP"))}
    rules = {"attnlrp": tt.LXT_ATTN_LRP, "cp": tt.LXT_CP_LRP}
    rows: list[dict[str, Any]] = []
    for kind, e in refs.items():
        params, x, target = e["params"], e["x"], e["target"]
        axes = (1,) if kind == "vit" else (2,)  # per pixel (summed over channels) / per token
        logits = np.asarray(jax.jit(twin(kind, params))(jnp.asarray(x)))
        rows.append({"model": kind, "what": "twin logits vs PyTorch", "max_abs": float(np.max(np.abs(
            logits - e["plain"]["logits"]))), "max_ref": float(np.max(np.abs(e["plain"]["logits"])))})
        for method in METHODS[kind]:
            lxt = e[method]
            logit = [float(v) for v in lxt["logit"]]
            ref_form = lxt_form(twin(kind, params, rules[method]), jnp.asarray(x), target)
            rows.append({"model": kind, "method": method, "what": "JAX LXT-form vs LXT", "logit": logit,
                         **compare(ref_form, lxt["relevance"], axes)})
            comp = composites[method]
            if comp is None:
                continue
            fn = twin(kind, params)
            try:
                ours = np.asarray(jax.jit(lambda v, t, comp=comp, fn=fn: gk.attribution.lrp(fn, v, comp, target=t))(
                    jnp.asarray(x), jnp.asarray(target)))
            except Exception as exc:  # a row, not a crash: the rest of the table still tells
                rows.append({"model": kind, "method": method, "what": "gradkit vs LXT",
                             "error": f"{type(exc).__name__}: {exc}"[:400]})
                continue
            rows.append({"model": kind, "method": method, "what": "gradkit vs LXT", "logit": logit,
                         **compare(ours, lxt["relevance"], axes)})
            if kind == "gpt2":  # relevance at (token embeddings, position embeddings), as LXT reads both
                split = twin(kind, params, split_positions=True)
                pos = jnp.broadcast_to(jnp.asarray(params["transformer.wpe.weight"][: x.shape[1]]), x.shape)
                r_tok, r_pos = jax.jit(lambda xs, t, comp=comp, fn=split: gk.attribution.lrp(fn, xs, comp, target=t))(
                    (jnp.asarray(x), pos), jnp.asarray(target))
                rows.append({"model": kind, "method": method, "what": "gradkit vs LXT, (tokens, positions): tokens",
                             "logit": logit, **compare(np.asarray(r_tok), lxt["relevance"], axes)})
                rows.append({"model": kind, "method": method, "what": "gradkit vs LXT, (tokens, positions): positions",
                             "logit": logit, **compare(np.asarray(r_pos), lxt["relevance_positions"], axes)})
        grad_x = e["plain"]["relevance"]
        if "attnlrp" in METHODS[kind]:
            rows.append({"model": kind, "method": "attnlrp", "what": "control: PyTorch gradient × input vs LXT",
                         "logit": [float(v) for v in e["plain"]["logit"]], **compare(grad_x, e["attnlrp"]["relevance"],
                                                                                   axes)})
    return rows


def write(path: str, refs: dict[str, dict[str, Any]]) -> None:
    data: dict[str, np.ndarray] = {"ids": IDS.astype(np.int32)}
    for kind, e in refs.items():
        for k, v in e["params"].items():
            if k in ("model.embed_tokens.weight", "transformer.wte.weight"):
                continue  # the inputs are the embeddings themselves
            if k == "transformer.wpe.weight":
                v = v[: IDS.shape[1]]
            scale = 2.0 ** np.ceil(np.log2(float(np.max(np.abs(v))) / 127.0))
            q = np.round(v / scale)
            assert np.array_equal(q * scale, v) and np.max(np.abs(q)) <= 127, k
            data[f"{kind}/int8/{k}"] = q.astype(np.int8)
            data[f"{kind}/scale/{k}"] = np.float32(scale)
        if kind == "vit":
            assert np.array_equal(np.round(e["x"] * 32) / 32, e["x"])
            data[f"{kind}/x_int8_over_32"] = np.round(e["x"] * 32).astype(np.int8)
        else:
            data[f"{kind}/x"] = e["x"].astype(np.float32)
        data[f"{kind}/target"] = e["target"].astype(np.int32)
        data[f"{kind}/logits"] = e["plain"]["logits"].astype(np.float32)
        for method in METHODS[kind]:
            r = e[method]
            data[f"{kind}/{method}/relevance"] = r["relevance"].astype(np.float32)
            data[f"{kind}/{method}/logit"] = r["logit"].astype(np.float32)
            if "relevance_positions" in r:
                data[f"{kind}/{method}/relevance_positions"] = r["relevance_positions"].astype(np.float32)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    np.savez_compressed(path, **data)
    print(f"wrote {path} ({os.path.getsize(path)} bytes, {len(data)} arrays)")


# --------------------------------------------------------------------------------------------------------------
# Performance.
# --------------------------------------------------------------------------------------------------------------

PERF_SIZE = {"layers": 4, "hidden": 256, "mlp": 688, "vocab": 1024}
PERF_SHAPES = ((1, 128), (4, 128), (1, 1024), (4, 1024))


def perf_torch_child(args: argparse.Namespace) -> int:
    """Seconds of one explanation in PyTorch (``plain`` input gradient, or LXT ``attnlrp``) per shape and thread
    count: min over repeats. One process per method: LXT patches for good."""
    import torch

    method = args.perf_child
    if method == "attnlrp":
        lxt_patch("llama", "attnlrp")
    model = torch_model("llama_perf", perf=PERF_SIZE)
    rows = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for b, t in PERF_SHAPES:
            ids = torch.from_numpy(np.random.default_rng(0).integers(0, PERF_SIZE["vocab"], (b, t)))
            emb0 = model.get_input_embeddings()(ids).detach()

            def once(emb0: Any = emb0) -> float:
                t0 = time.perf_counter()
                emb = emb0.clone().requires_grad_(True)
                last = model(inputs_embeds=emb, use_cache=False).logits[:, -1, :]
                last.max(-1).values.sum().backward()
                _ = (emb * emb.grad).sum(-1)
                return time.perf_counter() - t0

            once()
            times = [once() for _ in range(args.repeats)]
            rows.append({"method": method, "threads": threads, "batch": b, "seq": t, "min_s": min(times)})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    with open(args.child_out, "w") as f:
        json.dump(rows, f)
    return 0


def perf_jax(repeats: int) -> list[dict[str, Any]]:
    """One jitted ATTN_LRP explanation (and the hand-written LXT form) against one jitted ``jax.grad``."""
    import jax
    import jax.numpy as jnp
    import transformer_twins as tt
    from common import samples

    import gradkit as gk

    model = torch_model("llama_perf", perf=PERF_SIZE)
    params = state(model)
    plain = tt.llama(params, 4, 4)
    form = tt.llama(params, 4, 4, rules=tt.LXT_ATTN_LRP)
    rows = []
    for b, t in PERF_SHAPES:
        rng = np.random.default_rng(0)
        x = jnp.asarray(params["model.embed_tokens.weight"][rng.integers(0, PERF_SIZE["vocab"], (b, t))])
        target = jnp.argmax(plain(x)[:, -1, :], -1)

        def grad_fn(v: jax.Array, fn: Any = plain, target: jax.Array = target) -> jax.Array:
            return v * jax.grad(lambda u: jnp.sum(jnp.take_along_axis(fn(u)[:, -1, :], target[:, None], -1)))(v)

        fns = {"jax.grad": jax.jit(grad_fn),
               "LXT form (JAX)": jax.jit(lambda v, grad_fn=grad_fn: grad_fn(v, form))}
        if hasattr(gk.attribution, "ATTN_LRP"):
            fns["gradkit ATTN_LRP"] = jax.jit(lambda v, target=target: gk.attribution.lrp(
                lambda u: plain(u)[:, -1, :], v, gk.attribution.ATTN_LRP, target=target))
        memory = {}
        for k, f in fns.items():
            try:
                memory[k] = int(f.lower(x).compile().memory_analysis().temp_size_in_bytes)
            except Exception:  # some backends have no memory analysis
                memory[k] = None
        times = samples({k: (lambda f=f, x=x: f(x)) for k, f in fns.items()}, repeats, 1, warmup=1)
        for k in fns:
            rows.append({"method": k, "batch": b, "seq": t, "min_s": min(times[k]), "temp_bytes": memory[k]})
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def perf(repeats: int) -> dict[str, Any]:
    torch_rows: list[dict[str, Any]] = []
    for method in ("plain", "attnlrp"):
        with tempfile.TemporaryDirectory() as tmp:
            dst = os.path.join(tmp, "perf.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--perf-child", method, "--child-out", dst,
                            "--repeats", str(repeats)], check=True)
            with open(dst) as f:
                torch_rows += json.load(f)
    return {"jax": perf_jax(repeats), "torch": torch_rows, "load_average_1min": os.getloadavg()[0],
            "size": PERF_SIZE}


# --------------------------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    from common import environment as versions
    return versions("jax", "jaxlib", "torch", "torchvision", "transformers", "lxt")


def markdown(rows: list[dict[str, Any]], perf_result: dict[str, Any] | None) -> str:
    lines = ["| model | method | comparison | max \\|Δ\\| | max \\|ref\\| | allclose | per token max \\|Δ\\| "
             "| ΣR ours / logit | ΣR ref / logit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('method', '')} | {r['what']} | error: {r['error']} ||||||")
            continue
        if "logit" not in r:
            lines.append(f"| {r['model']} | | {r['what']} | {r['max_abs']:.2e} | {r['max_ref']:.3g} | | | | |")
            continue

        def ratio(s: list[float], logit: list[float] = r["logit"]) -> str:
            return " ".join(f"{a / b:.4f}" for a, b in zip(s, logit))

        lines.append(f"| {r['model']} | {r['method']} | {r['what']} | {r['max_abs']:.2e} | {r['max_ref']:.3g} | "
                     f"{'yes' if r['allclose'] else 'no'} | {r['token_max_abs']:.2e} | {ratio(r['sum_ours'])} | "
                     f"{ratio(r['sum_ref'])} |")
    if perf_result:
        lines += ["", f"Performance (LLaMA {perf_result['size']}, load average "
                      f"{perf_result['load_average_1min']:.1f}): min seconds, temporary memory", "",
                  "| batch × seq | method | ms | / jax.grad | temp MB |", "|---|---|---|---|---|"]
        jrows = perf_result["jax"]
        for b, t in PERF_SHAPES:
            base = next(r for r in jrows if r["method"] == "jax.grad" and (r["batch"], r["seq"]) == (b, t))
            for r in (r for r in jrows if (r["batch"], r["seq"]) == (b, t)):
                mem = "" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
                if r["temp_bytes"] is not None and base["temp_bytes"]:
                    mem += f" ({r['temp_bytes'] / base['temp_bytes']:.2f}×)"
                lines.append(f"| {b} × {t} | {r['method']} | {r['min_s'] * 1e3:.0f} | "
                             f"{r['min_s'] / base['min_s']:.2f} | {mem} |")
            for r in (r for r in perf_result["torch"] if (r["batch"], r["seq"]) == (b, t)):
                plain = next(p for p in perf_result["torch"] if p["method"] == "plain"
                             and (p["batch"], p["seq"], p["threads"]) == (b, t, r["threads"]))
                lines.append(f"| {b} × {t} | torch {r['method']} ({r['threads']} thr) | {r['min_s'] * 1e3:.0f} | "
                             f"{r['min_s'] / plain['min_s']:.2f} (of torch plain) | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where to write the JSON results")
    parser.add_argument("--write", nargs="?", const=REFERENCE, default=None, metavar="PATH",
                        help="write the stored reference for tests/test_lrp_vs_lxt.py and stop")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--perf", action="store_true", help="also time the 4-layer LLaMA")
    parser.add_argument("--perf-only", action="store_true", help="only time the 4-layer LLaMA")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--perf-child", help=argparse.SUPPRESS)
    parser.add_argument("--child-in", help=argparse.SUPPRESS)
    parser.add_argument("--child-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)
    if args.perf_child:
        return perf_torch_child(args)
    if args.perf_only:
        perf_result = perf(args.repeats)
        print(markdown([], perf_result))
        from common import write_json

        return write_json(args.out, {"environment": environment(), "rows": [], "perf": perf_result})
    refs = reference(tuple(args.models))
    if args.write:
        write(args.write, refs)
        return 0
    rows = agreement(refs)
    perf_result = perf(args.repeats) if args.perf else None
    print(markdown(rows, perf_result))
    from common import write_json

    return write_json(args.out, {"environment": environment(), "rows": rows, "perf": perf_result})


if __name__ == "__main__":
    sys.exit(main())
