"""gk.tables.F32_BACKWARD: gradient accuracy and step time of bfloat16 models, against plain bf16 autodiff.

    python benchmarks/bench_f32_backward.py [--quick] [--ablation]

Two bfloat16 models: a softmax classifier (``x @ W + b``, cross-entropy via
``jax.nn.log_softmax``) and a pre-norm transformer block (layer norm written
with ``rsqrt``, one attention head with ``jax.nn.softmax``, a tanh-GELU MLP,
a cross-entropy head). Error rows: the gradient's max relative error against
the float64 gradient of the same parameters (per leaf ``max|g - g64| /
max|g64|``, the worst leaf), with the table / plain (``<= 0.1`` is the target:
the table's error is at least 10x lower). Time rows: ``jit(value_and_grad)``
step time with the table / plain, medians of interleaved repeats.

Both models are in the regime the table is for: confident predictions (the
label's probability near 1). What the table cannot remove is the forward
pass's own rounding (it is bit-identical by design): the bf16 logits are
rounded by up to 1/32 of a unit near 10, which moves ``1 - p`` by a few
percent. That floor, not the backward pass, bounds the measured gain: a row
per model upcasts *every* op of the backward pass and gets the same error.
``--ablation`` prints the error with each rule alone (how the entries of
F32_BACKWARD were chosen).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import interleaved, parser, report, row

import gradkit as gk

# --------------------------------------------------------------------------- models


def classifier_problem(n: int, d: int, k: int, seed: int = 0) -> tuple[Any, Any]:
    """A well-trained classifier's regime: most examples confidently right (p ~ 1 at the label)."""
    kw, kx, kl = jax.random.split(jax.random.key(seed), 3)
    labels = jax.random.randint(kl, (n,), 0, k)
    w = jax.random.normal(kw, (d, k), jnp.float32)
    x = jax.random.normal(kx, (n, d), jnp.float32) * 0.1 + w.T[labels] / np.sqrt(d)
    params = {"w": w * 12.0 / np.sqrt(d), "b": jnp.zeros(k, jnp.float32)}  # label logit ~ 12 above the rest
    return params, (x, jax.nn.one_hot(labels, k, dtype=jnp.float32))


def classifier_loss(params: Any, batch: Any) -> Any:
    x, y = batch
    logits = x @ params["w"] + params["b"][None, :]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits, axis=-1) * y, axis=-1))


def layer_norm(x: Any, scale: Any) -> Any:
    # jax.nn.standardize: (x - mean) * rsqrt(var + eps), a jitted function the table matches whole
    return jax.nn.standardize(x, axis=-1, epsilon=1e-5) * scale[None, :]


def block_problem(n: int, d: int, vocab: int, seed: int = 0) -> tuple[Any, Any]:
    ks = jax.random.split(jax.random.key(seed), 9)
    s = 1 / np.sqrt(d)
    params = {"ln1": jnp.ones(d), "ln2": jnp.ones(d), "q": jax.random.normal(ks[0], (d, d)) * s,
              "k": jax.random.normal(ks[1], (d, d)) * s, "v": jax.random.normal(ks[2], (d, d)) * s,
              "o": jax.random.normal(ks[3], (d, d)) * s, "up": jax.random.normal(ks[4], (d, 4 * d)) * s,
              "down": jax.random.normal(ks[5], (4 * d, d)) * s / 2,
              "head": jax.random.normal(ks[6], (d, vocab)) * 4 * s}
    labels = jax.random.randint(ks[7], (n,), 0, vocab)
    direction = params["head"].T[labels] / jnp.linalg.norm(params["head"], axis=0)[labels, None]
    x = jax.random.normal(ks[8], (n, d)) * 0.3 + 6.0 * direction
    return params, (x, jax.nn.one_hot(labels, vocab, dtype=jnp.float32))


def block_loss(params: Any, batch: Any) -> Any:
    x, y = batch
    h = layer_norm(x, params["ln1"])
    q, k, v = h @ params["q"], h @ params["k"], h @ params["v"]
    att = jax.nn.softmax((q @ k.T) / jnp.asarray(np.sqrt(q.shape[-1]), q.dtype), axis=-1)
    x = x + (att @ v) @ params["o"]
    h = layer_norm(x, params["ln2"])
    x = x + jax.nn.gelu(h @ params["up"], approximate=True) @ params["down"]
    logits = layer_norm(x, params["ln1"]) @ params["head"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits, axis=-1) * y, axis=-1))


def _cast(tree: Any, dtype: Any) -> Any:
    return jax.tree_util.tree_map(lambda a: a.astype(dtype), tree)


def max_rel_error(g: Any, ref: Any) -> float:
    """The worst leaf's ``max|g - ref| / max|ref|``."""
    errs = []
    for a, r in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(ref)):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        errs.append(np.max(np.abs(a - r)) / np.max(np.abs(r)))
    return float(max(errs))


def reference_grad(loss: Callable[..., Any], params: Any, batch: Any) -> Any:
    """float64 gradient at the bf16 parameters and inputs (the same values, exactly representable)."""
    with jax.enable_x64(True):
        p64 = _cast(_cast(params, jnp.bfloat16), jnp.float64)
        b64 = _cast(_cast(batch, jnp.bfloat16), jnp.float64)
        return jax.device_get(jax.jit(jax.grad(loss))(p64, b64))


def measure(name: str, loss: Callable[..., Any], params: Any, batch: Any, tables: dict[str, Any], quick: bool,
            timing: bool = True) -> dict[str, tuple[float, float | None]]:
    """``{table name: (max rel error, step time ratio vs plain)}``."""
    p16, b16 = _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16)
    ref = reference_grad(loss, params, batch)
    steps = {"plain": jax.jit(jax.value_and_grad(loss))}
    steps |= {k: jax.jit(jax.value_and_grad(gk.override(loss, t))) for k, t in tables.items()}
    out_plain = steps["plain"](p16, b16)
    res = {}
    for k, s in steps.items():
        v, g = s(p16, b16)
        assert np.asarray(v).tobytes() == np.asarray(out_plain[0]).tobytes(), f"{name}/{k}: forward changed"
        res[k] = max_rel_error(g, ref)
    times: dict[str, float] = {}
    if timing:
        times = interleaved({k: (lambda s=s: s(p16, b16)) for k, s in steps.items()},
                             5 if quick else 31, 3 if quick else 10)
    return {k: (e, times[k] / times["plain"] if times else None) for k, e in res.items()}


def rows(quick: bool = False) -> list[dict[str, Any]]:
    """The benchmark rows, in ``benchmarks/run.py``'s format (error rows: table error / plain error)."""
    out = []
    cls = classifier_problem(*((256, 64, 10) if quick else (1024, 256, 100)))
    blk = block_problem(*((32, 32, 50) if quick else (128, 128, 500)))
    problems = [("bf16 softmax classifier", classifier_loss, *cls), ("bf16 transformer block", block_loss, *blk)]
    for name, loss, params, batch in problems:
        r = measure(name, loss, params, batch, {"f32": gk.tables.F32_BACKWARD}, quick)
        (e0, _), (e1, t1) = r["plain"], r["f32"]
        out.append(row(f"F32_BACKWARD {name}: grad error vs float64 ({e1:.2g} vs {e0:.2g})", "plain bf16 autodiff",
                        e1 / e0, 0.1, fmt="err"))
        out.append(row(f"F32_BACKWARD {name}: step time", "plain bf16 autodiff", t1, 1.15))
        floor = measure(name, loss, params, batch, {"every": every_op_f32()}, quick, timing=False)["every"][0]
        out.append(row(f"  every backward op in float32 instead ({floor:.2g}): the floor with this forward",
                       "plain bf16 autodiff", floor / e0, None, fmt="err"))
    return out


# Every primitive and jitted function the two models' backward passes use: with all of them upcast, what
# is left of the error is the bf16 forward's own rounding, which a backward-only table cannot change.
_EVERY_OP = ("fn:log_softmax", "fn:standardize", "broadcast_in_dim", "dot_general", "div", "reduce_sum", "mul",
             "sub", "add", "exp", "log", "rsqrt", "tanh", "reduce_max", "neg", "integer_pow", "max", "square",
             "pow", "sqrt", "logistic", "convert_element_type", "transpose", "reshape")


def every_op_f32() -> Any:
    """``upcast_backward`` of every op the benchmark models use."""
    return gk.tables.upcast_backward(*_EVERY_OP)


def ablation(quick: bool = False) -> None:
    """Which entries matter: the error with each group of rules alone."""
    up = gk.tables.upcast_backward
    groups = {
        "fn:log_softmax": up("fn:log_softmax"),
        "exp": up("exp"), "log": up("log"), "rsqrt": up("rsqrt"), "div": up("div"), "tanh": up("tanh"),
        "exp+div": up("exp", "div"), "fn:standardize": up("fn:standardize"),
        "fns": up("fn:log_softmax", "fn:standardize"),
        "fns+bcast": up("fn:log_softmax", "fn:standardize", "broadcast_in_dim"),
        "fns+bcast+dot": up("fn:log_softmax", "fn:standardize", "broadcast_in_dim", "dot_general"),
        "add": up("add"), "mul": up("mul"), "fns+add": up("fn:log_softmax", "fn:standardize", "add"),
        "all": gk.tables.F32_BACKWARD | up("broadcast_in_dim", "dot_general", "div", "reduce_sum", "mul", "sub"),
        "F32_BACKWARD": gk.tables.F32_BACKWARD,
    }
    problems = [("classifier", classifier_loss, *classifier_problem(256, 64, 10)),
                ("block", block_loss, *block_problem(32, 32, 50))]
    for name, loss, params, batch in problems:
        r = measure(name, loss, params, batch, groups, quick, timing=False)
        print(name, {k: f"{e:.3g}" for k, (e, _) in r.items()})
        p16, b16 = _cast(params, jnp.bfloat16), _cast(batch, jnp.bfloat16)
        if name == "classifier":
            logits = b16[0] @ p16["w"]
            p_label = jnp.sum(jax.nn.softmax(logits.astype(jnp.float32)) * b16[1], -1)
            print("  mean p at the label:", float(jnp.mean(p_label)))


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--ablation", action="store_true", help="the error with each rule alone")
    args = p.parse_args(argv)
    if args.ablation:
        ablation(args.quick)
        return 0
    return report("F32_BACKWARD", rows(args.quick), 64)


if __name__ == "__main__":
    raise SystemExit(main())
