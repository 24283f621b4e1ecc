"""Trace and first-call cost of gk.override: ratios against plain JAX in the same process.

* trace + rewrite of 10k/100k-equation programs (10%, 20% and 100% of equations
  matched) against ``jax.make_jaxpr`` of the same function, and the growth exponent;
* 48 identical transformer blocks: replacement equations traced (they must not grow with depth);
* first call (trace + compile) of ``jit(grad)``: the overridden program against
  the same math written with hand-written ``jax.custom_vjp`` twins, on four
  workloads, median of fresh builds (``jax.clear_caches()`` before each).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from common import Row, once, row

import gradkit as gk

PASS_GRAD = gk.vjp_rule(lambda op, g: (g,), name="pass_grad")


def _chain(n: int, every: int) -> Callable[[Any], Any]:
    """``n`` equations, one ``sin`` every ``every`` (the op the table matches)."""
    def f(x):
        for i in range(n):
            x = jnp.sin(x) if i % every == 0 else x * 1.0001
        return x
    return f


def _trace_ratio(n: int, every: int, repeats: int) -> tuple[float, float]:
    """(median override trace+rewrite / median make_jaxpr, median override seconds), fresh functions each time."""
    x = jnp.ones(4, jnp.float32)
    base, ours = [], []
    for _ in range(repeats):
        base.append(once(lambda: jax.make_jaxpr(_chain(n, every))(x)))
        ours.append(once(lambda: gk.override(_chain(n, every), {"sin": PASS_GRAD}).rewritten_jaxpr(x)))
    return statistics.median(ours) / statistics.median(base), statistics.median(ours)


def rows_trace(quick: bool) -> list[Row]:
    rows = []
    sizes = [1000, 3000] if quick else [10_000, 100_000]
    for every, pct in ((10, "10%"), (5, "20%")):
        secs = []
        for n in sizes:
            ratio, s = _trace_ratio(n, every, 3 if (quick or n <= 10_000) else 1)
            secs.append(s)
            rows.append(row(f"trace+rewrite, {n} eqns, {pct} matched", "jax.make_jaxpr", ratio, 1.25))
        slope = float(np.polyfit(np.log(sizes), np.log(secs), 1)[0])
        rows.append(row(f"  growth exponent, {sizes[0]}..{sizes[-1]} eqns", "linear = 1.0", slope, 1.1, "exp"))
    n = 1000 if quick else 10_000
    rows.append(row(f"trace+rewrite, {n} eqns, every one matched", "jax.make_jaxpr",
                     _trace_ratio(n, 1, 3)[0], 1.6))
    return rows


# --------------------------------------------------------------------------- transformer


def _layer_norm(x, rsqrt):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, axis=-1, keepdims=True)
    return (x - mu) * rsqrt(var + 1e-5)


def _block(p, x, ops):
    tanh, exp, rsqrt = ops
    h = _layer_norm(x, rsqrt)
    q, k, v = h @ p["wq"], h @ p["wk"], h @ p["wv"]
    s = q @ k.T / np.sqrt(q.shape[-1])
    e = exp(s - jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True)))
    x = x + (e / jnp.sum(e, axis=-1, keepdims=True)) @ v @ p["wo"]
    h = _layer_norm(x, rsqrt) @ p["w1"]
    h = 0.5 * h * (1.0 + tanh(0.7978845608 * (h + 0.044715 * h ** 3)))
    return x + h @ p["w2"]


def _transformer_params(depth: int, d: int, seq: int) -> tuple[Any, Any]:
    keys = jax.random.split(jax.random.key(0), depth + 1)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
    params = [{n: jax.random.normal(jax.random.fold_in(k, i), s, jnp.float32) / np.sqrt(s[0])
               for i, (n, s) in enumerate(shapes.items())} for k in keys[:-1]]
    return params, jax.random.normal(keys[-1], (seq, d), jnp.float32)


def _transformer(ops):
    def loss(params, x):
        for p in params:
            x = _block(p, x, ops)
        return jnp.mean(x ** 2)
    return loss


def rows_transformer_replacements(quick: bool) -> list[Row]:
    counts = {}
    for depth in (1, 48):
        params, x = _transformer_params(depth, 16 if quick else 64, 8 if quick else 32)
        f = gk.override(_transformer((jnp.tanh, jnp.exp, jax.lax.rsqrt)), gk.tables.SAFE | gk.tables.STABLE)
        jax.eval_shape(jax.grad(f), params, x)  # traces and rewrites; the count needs no compile
        counts[depth] = f.cache_info()
    one, deep = counts[1], counts[48]
    assert deep.traces == 1 and deep.reuses > 0
    return [row(f"48 transformer blocks: replacements traced ({deep.replacements}, "
                 f"{deep.reuses} reused)", "1 block", deep.replacements / one.replacements, 1.0, "count")]


# --------------------------------------------------------------------------- first call vs hand-written twins

def _vjp_twin(prim_fn, deriv):
    """A hand-written jax.custom_vjp of one primitive: what a user writes without gradkit."""
    @jax.custom_vjp
    def f(x):
        return prim_fn(x)

    f.defvjp(lambda x: (prim_fn(x), x), lambda x, g: (g * deriv(x),))
    return f


def _deriv_rule(deriv):
    return gk.vjp_rule(lambda op, g: (g * deriv(op.inputs[0]),))


TANH_D = lambda x: 1.0 - jnp.tanh(x) ** 2
EXP_D = jnp.exp
RSQRT_D = lambda x: -0.5 * jax.lax.rsqrt(x) / x
TABLE = {"tanh": _deriv_rule(TANH_D), "exp": _deriv_rule(EXP_D), "rsqrt": _deriv_rule(RSQRT_D)}


def _twins():
    return (_vjp_twin(jnp.tanh, TANH_D), _vjp_twin(jnp.exp, EXP_D), _vjp_twin(jax.lax.rsqrt, RSQRT_D))


def _workloads(quick: bool) -> dict[str, tuple[Callable[[Any], Callable[..., Any]], tuple[Any, ...]]]:
    plain = (jnp.tanh, jnp.exp, jax.lax.rsqrt)

    def chain(ops):
        tanh, exp, _ = ops
        def f(x):
            for _ in range(100 if quick else 300):
                x = tanh(x) * 0.9 + exp(-x * x) * 0.1
            return jnp.sum(x)
        return f

    def mlp(ops):
        tanh = ops[0]
        def f(ws, x):
            for w in ws:
                x = tanh(x @ w)
            return jnp.mean(x ** 2)
        return f

    def rnn(ops):
        tanh = ops[0]
        def f(w, xs):
            h, _ = jax.lax.scan(lambda h, x: (tanh(h @ w + x), None), jnp.zeros(w.shape[0]), xs)
            return jnp.sum(h)
        return f

    d = 32 if quick else 256
    ws = [jax.random.normal(jax.random.key(i), (d, d)) / np.sqrt(d) for i in range(4)]
    w = jax.random.normal(jax.random.key(9), (d, d)) / np.sqrt(d)
    xs = jax.random.normal(jax.random.key(8), (50 if quick else 200, d))
    tparams, tx = _transformer_params(2, 16 if quick else 64, 8 if quick else 32)
    del plain
    return {
        "elementwise chain": (chain, (jnp.linspace(-1.0, 1.0, 256),)),
        "MLP 4 layers": (mlp, (ws, jax.random.normal(jax.random.key(7), (64, d)))),
        "scanned RNN": (rnn, (w, xs)),
        "2-layer transformer": (_transformer, (tparams, tx)),
    }


def rows_first_call(quick: bool) -> list[Row]:
    rows = []
    builds = 1 if quick else 7
    plain_ops = (jnp.tanh, jnp.exp, jax.lax.rsqrt)
    for name, (make, args) in _workloads(quick).items():
        ours_t, hand_t = [], []
        for _ in range(builds):  # interleaved fresh builds: each traces and compiles from nothing
            jax.clear_caches()
            ours_t.append(once(lambda: jax.jit(jax.grad(gk.override(make(plain_ops), TABLE)))(*args)))
            jax.clear_caches()
            hand_t.append(once(lambda: jax.jit(jax.grad(make(_twins())))(*args)))
        ours = jax.jit(jax.grad(gk.override(make(plain_ops), TABLE)))(*args)
        hand = jax.jit(jax.grad(make(_twins())))(*args)
        for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(hand)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6)
        rows.append(row(f"first call jit(grad), {name}", "hand custom_vjp twins",
                         statistics.median(ours_t) / statistics.median(hand_t), 1.10))
    return rows


ROWS = [rows_trace, rows_transformer_replacements, rows_first_call]
