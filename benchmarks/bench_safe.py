"""SAFE's reverse-mode cost on a training step: ``gk.override(loss, SAFE | STABLE)`` against plain JAX.

    python benchmarks/bench_safe.py [--quick]

A ReLU MLP (``max``), a masked squared error (``mul`` by a 0/1 mask, ``square``)
and a norm penalty (``sqrt`` of a sum of squares): every op SAFE now wraps
appears, many times. Two rows, each a ratio against the same step written in
plain JAX, measured in the same process: the compiled step's time
(``jax.jit`` of value_and_grad plus an SGD update), and its first call
(trace + compile).
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import block, interleaved, mlp_problem, row

import gradkit as gk


def loss(params: Any, x: Any, y: Any) -> Any:
    h = x
    for layer in params[:-1]:
        h = jnp.maximum(h @ layer["w"] + layer["b"][None, :], 0.0)
    pred = (h @ params[-1]["w"] + params[-1]["b"][None, :])[:, 0]
    mask = (y > 0).astype(pred.dtype)
    penalty = sum(jnp.sqrt(jnp.sum(jnp.square(layer["w"]))) for layer in params)
    return jnp.mean(jnp.square(pred - y) * mask) + 1e-4 * penalty


def _step(fn: Any) -> Any:
    @jax.jit
    def step(params: Any, x: Any, y: Any) -> Any:
        value, grads = jax.value_and_grad(fn)(params, x, y)
        return jax.tree_util.tree_map(lambda p, g: p - 1e-3 * g, params, grads), value
    return step


def rows(quick: bool) -> list[dict[str, Any]]:
    batch, width, depth = (64, 128, 2) if quick else (256, 512, 4)
    params, x, y = mlp_problem(batch, width, depth)
    table = gk.tables.SAFE | gk.tables.STABLE
    makers = {"plain": lambda: loss, "safe": lambda: gk.override(loss, table)}
    first: dict[str, list[float]] = {k: [] for k in makers}
    for _ in range(2 if quick else 4):  # fresh builds, alternating, after a warm-up of each
        for name, make in makers.items():
            jax.clear_caches()
            step = _step(make())
            t0 = time.perf_counter()
            block(step(params, x, y))
            first[name].append(time.perf_counter() - t0)
    steps = {name: _step(make()) for name, make in makers.items()}
    t = interleaved({k: (lambda s=s: s(params, x, y)) for k, s in steps.items()}, 5 if quick else 31,
                    3 if quick else 10)
    label = f"MLP step {depth}x{width} (relu, masked MSE, norm), SAFE|STABLE"
    return [row(label, "plain JAX", t["safe"] / t["plain"], 1.05),
            row("  first call (trace + compile) of the same", "plain JAX",
                statistics.median(first["safe"][1:]) / statistics.median(first["plain"][1:]), None)]


if __name__ == "__main__":
    from common import format_row

    for r in rows("--quick" in sys.argv):
        print(format_row(r))
