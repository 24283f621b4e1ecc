"""gk.guard: the finite path's cost in a compiled training step, against plain ``jax.value_and_grad``;
the memory a run of bad steps leaves behind.

    python benchmarks/bench_guard.py [--quick]

The step is ``benchmarks/run.py``'s MLP train step (SGD with momentum under
``jax.jit``), once with ``jax.value_and_grad`` and once with ``gk.guard`` in
each mode; every row is the ratio guard / plain of the step time, medians of
interleaved repeats in one process. The guard adds one fused finiteness check
of the loss and the gradients and a ``cond`` whose host callback never runs
while they are finite (checked here: no report is made).

The memory rows (not timed, a fresh process each): a jitted SGD step of a
guarded 1M-parameter model (65,536 with ``--quick``), ``on_nonfinite="skip"``,
runs 40 finite steps, then 40 bad ones (a zero row in the batch: NaN born at a
``log``), then reads ``.reports``. The guard audits its first ``max_reports``
(4) bad calls and only counts the rest; the first row is the resident memory
(RSS) after that, above the RSS after the finite steps (target: under 200 MB);
the second the highest RSS reached on the way, above the same point (no
target: it is one audit's working memory, mostly the finite-difference check of
its suggested fix); the third how long reading ``.reports`` waited (seconds).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import interleaved, mlp_problem, parser, report, row

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
    return out + memory_rows(quick)


MEMORY_TARGET_MB = 200.0
BAD_STEPS = 40


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _log_loss(w: Any, x: Any) -> Any:
    h = x @ w
    return jnp.mean(jnp.where(h > 0, jnp.log(h), 0.0))  # d log at h == 0 is inf: 0 * inf = NaN


def measure_memory(width: int, steps: int = BAD_STEPS) -> dict[str, Any]:
    """In this process: RSS after ``steps`` finite, then ``steps`` bad guarded steps (``width**2`` parameters)."""
    g = gk.guard(_log_loss, on_nonfinite="skip")

    @jax.jit
    def step(w: Any, x: Any) -> Any:
        loss, grad = g(w, x)
        return w - 1e-3 * grad, loss

    w = jax.random.uniform(jax.random.key(0), (width, width)) + 0.1
    x = jax.random.uniform(jax.random.key(1), (16, width))
    bad = x.at[0].set(0.0)

    def run(batch: Any, n: int) -> Any:
        v = w
        for _ in range(n):
            v, loss = step(v, batch)
            float(loss)
        return v

    run(x, 3)  # compiled, and the allocator warm
    gc.collect()
    start = _rss_mb()
    run(x, steps)
    gc.collect()
    finite = _rss_mb()
    run(bad, steps)
    t0 = time.perf_counter()
    reports = g.reports
    wait = time.perf_counter() - t0
    gc.collect()
    after = _rss_mb()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux
    audits = sum(1 + r.repeats for r in reports)
    assert g.bad_calls == steps and audits == g.max_reports, (g.bad_calls, audits)
    return {"params": width * width, "finite_growth_mb": finite - start, "bad_growth_mb": after - finite,
            "peak_above_finite_mb": peak - finite, "reports_wait_s": wait, "reports": len(reports),
            "audits": audits, "bad_calls": g.bad_calls}


def memory_rows(quick: bool = False) -> list[dict[str, Any]]:
    """The memory rows, each measured in a fresh process (RSS is per process)."""
    width = 256 if quick else 1000
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", str(width)],
                         capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"the memory measurement failed:\n{out.stderr[-4000:]}")
    m = json.loads(out.stdout.strip().splitlines()[-1])
    name = f"gk.guard {BAD_STEPS} bad steps ({m['params']:,} params)"
    base = f"{BAD_STEPS} finite steps"
    return [row(f"{name}: MB kept", base, m["bad_growth_mb"], MEMORY_TARGET_MB, fmt="MB"),
            row(f"  peak RSS MB (one audit at a time; {m['audits']} audits)", base, m["peak_above_finite_mb"], None,
                fmt="MB"),
            row("  reading .reports waited (s)", "-", m["reports_wait_s"], None, fmt="s")]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--memory-child", type=int, metavar="WIDTH", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.memory_child:
        print(json.dumps(measure_memory(args.memory_child)))
        return 0
    return report("gk.guard finite-path cost and bad-step memory", rows(args.quick), 52)


if __name__ == "__main__":
    raise SystemExit(main())
