"""custom_gradient: reverse-mode step time of the default (forward mode too) against mode="vjp".

    python benchmarks/bench_custom_gradient.py [--quick]

The default mode serves reverse mode by transposing ``grad_fn`` twice (a
``jax.custom_jvp`` whose rule is ``grad_fn`` transposed); ``mode="vjp"``
calls ``grad_fn`` directly (``jax.custom_vjp``). Both compile to the same
work; each row is the ratio default / vjp of the compiled ``jit(grad)`` step
time, medians of interleaved repeats in one process.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import interleaved, row

import gradkit as gk


def _log1pexp(mode: str) -> Callable[[Any], Any]:
    @gk.custom_gradient(mode=mode)
    def log1pexp(x):
        e = jnp.exp(x)
        return jnp.log1p(e), lambda g: g * (1 - 1 / (1 + e))

    return log1pexp


def _dense(mode: str) -> Callable[[Any, Any], Any]:
    @gk.custom_gradient(mode=mode)
    def dense(w, x):
        h = jnp.tanh(x @ w)

        def grad(g):
            d = g * (1 - h * h)
            return x.T @ d, d @ w.T

        return h, grad

    return dense


def _row(name: str, ratio: float) -> dict[str, Any]:
    return row(name, 'mode="vjp"', ratio, 1.05)  # "no slower": within the noise of these shared machines


def rows(quick: bool = False) -> list[dict[str, Any]]:
    """The benchmark rows, in ``benchmarks/run.py``'s format."""
    repeats, inner = (5, 3) if quick else (31, 10)
    out = []

    n = 100_000 if quick else 1_000_000
    x = jnp.linspace(-50, 50, n, dtype=jnp.float32)
    steps = {m: jax.jit(jax.grad(lambda v, f=_log1pexp(m): jnp.sum(f(v)))) for m in ("both", "vjp")}
    np.testing.assert_allclose(steps["both"](x), steps["vjp"](x), rtol=1e-6)
    t = interleaved({m: (lambda s=s: s(x)) for m, s in steps.items()}, repeats, inner)
    out.append(_row(f"custom_gradient grad, elementwise {n:,}", t["both"] / t["vjp"]))

    batch, width, depth = (64, 128, 3) if quick else (256, 512, 4)
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.normal(size=(width, width)) / np.sqrt(width), jnp.float32) for _ in range(depth)]
    xb = jnp.asarray(rng.normal(size=(batch, width)), jnp.float32)

    def loss(layer: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
        def f(ws: Any, h: Any) -> Any:
            for w in ws:
                h = layer(w, h)
            return jnp.sum(h * h)
        return f

    steps = {m: jax.jit(jax.grad(loss(_dense(m)))) for m in ("both", "vjp")}
    for a, b in zip(steps["both"](ws, xb), steps["vjp"](ws, xb)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    t = interleaved({m: (lambda s=s: s(ws, xb)) for m, s in steps.items()}, repeats, inner)
    out.append(_row(f"custom_gradient grad, {depth}-layer MLP {batch}x{width}", t["both"] / t["vjp"]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    args = p.parse_args(argv)
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; ratio = default / mode='vjp' (jit(grad) step)")
    for r in rows(args.quick):
        print(f"{r['workload']:48} {r['ratio']:8.3f}  {'pass' if r['pass'] else 'MISS'} (<= {r['target']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
