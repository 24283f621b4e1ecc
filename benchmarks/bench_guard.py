"""gk.guard: the finite path's cost in a compiled training step, against plain ``jax.value_and_grad``.

    python benchmarks/bench_guard.py [--quick]

The step is ``benchmarks/run.py``'s MLP train step (SGD with momentum under
``jax.jit``), once with ``jax.value_and_grad`` and once with ``gk.guard`` in
each mode; every row is the ratio guard / plain of the step time, medians of
interleaved repeats in one process. The guard adds one fused finiteness check
of the loss and the gradients and a ``cond`` whose host callback never runs
while they are finite (checked here: no report is made).
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

from common import format_row, interleaved, mlp_problem, row

import gradkit as gk


def _mlp_loss(params: Any, x: Any, y: Any) -> Any:
    h = x
    for layer in params[:-1]:
        h = jax.nn.softplus(h @ layer["w"] + layer["b"][None, :])
    logits = (h @ params[-1]["w"] + params[-1]["b"][None, :])[:, 0]
    return jnp.mean(jax.nn.softplus(logits) - y * logits)


def _row(name: str, ratio: float, target: float | None = 1.02) -> dict[str, Any]:
    return row(name, "jax.value_and_grad", ratio, target)


def rows(quick: bool = False) -> list[dict[str, Any]]:
    """The benchmark rows, in ``benchmarks/run.py``'s format."""
    import optax

    batch, width, depth = (64, 128, 2) if quick else (256, 512, 4)
    params, x, y = mlp_problem(batch, width, depth)
    opt = optax.sgd(1e-3, momentum=0.9)

    def make_step(vg: Callable[..., Any]) -> Callable[..., Any]:
        @jax.jit
        def step(params: Any, state: Any) -> Any:
            loss, g = vg(params, x, y)
            updates, state = opt.update(g, state, params)
            return optax.apply_updates(params, updates), state, loss
        return step

    guards = {mode: gk.guard(_mlp_loss, on_nonfinite=mode) for mode in ("raise", "skip")}
    steps = {"plain": make_step(jax.value_and_grad(_mlp_loss)), **{m: make_step(g) for m, g in guards.items()}}
    state = opt.init(params)
    ref = steps["plain"](params, state)
    for mode in guards:  # finite: the same step, bit for bit
        out = steps[mode](params, state)
        for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(ref)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    t = interleaved({k: (lambda s=s: s(params, state)) for k, s in steps.items()},
                     7 if quick else 61, 3 if quick else 10)
    assert all(not g.reports for g in guards.values()), "a finite step reached the host"
    name = f"MLP train step {depth}x{width}, batch {batch}"
    out = [_row(f"gk.guard {name}", t["raise"] / t["plain"]),
           _row("  on_nonfinite='skip' (zeroing fused in)", t["skip"] / t["plain"])]

    # per-example gradients: the guard under vmap (the check is per example, the callback is not)
    b = 32 if quick else 128
    xs, ys = x[:b], y[:b]
    one = (lambda p, x, y: _mlp_loss(p, x[None], y[None]))
    per_plain = jax.jit(jax.vmap(jax.value_and_grad(one), in_axes=(None, 0, 0)))
    g = gk.guard(one)
    per_guard = jax.jit(jax.vmap(g, in_axes=(None, 0, 0)))
    t = interleaved({"plain": lambda: per_plain(params, xs, ys), "guard": lambda: per_guard(params, xs, ys)},
                     5 if quick else 31, 2 if quick else 5)
    assert not g.reports
    out.append(_row(f"  per-example grads, vmap over {b}", t["guard"] / t["plain"], None))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    args = p.parse_args(argv)
    print(f"gk.guard finite-path cost (jax {jax.__version__}, {jax.devices()[0].platform})")
    for r in rows(args.quick):
        print(format_row(r, 52))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
