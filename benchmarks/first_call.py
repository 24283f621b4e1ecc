"""First call (trace + lower + compile) of ``jax.jit(jax.grad(...))``: gradkit against plain JAX, per program.

    python benchmarks/first_call.py [--quick] [--only NAME]

* The corpus (``first_call_corpus.py``: Flax, Equinox and optax models, and
  diffrax, numpyro and jax-md patterns in plain JAX): ``gk.override(loss,
  SAFE | STABLE)`` against the plain ``loss``. Per program, the ratio of the
  first call and the stage that dominates the difference (the stage with
  the largest extra time: trace, lower or compile), then the median and the
  largest ratio over the corpus.
* The issue-27 chain: 1,000 equations, 200 matched ``sqrt`` under a VJP rule,
  against the same program with hand-written ``jax.custom_vjp`` twins.
* SAFE's ``mul`` (masked where dataflow finds the path masked, like the
  singular primitives): the lowered module's size and the compile time of
  SAFE against SAFE without it (full run only).

Times are CPU seconds of this process (``time.process_time``), medians of
fresh builds (``jax.clear_caches()`` before each), gradkit and baseline
interleaved: on a shared machine the CPU time a stage costs is far steadier
than the wall time it waits.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import Row, row
from first_call_corpus import CORPUS, QUICK

import gradkit as gk

STAGES = ("trace", "lower", "compile")
MASK_OPS = ("mul",)  # SAFE's one non-singular primitive: a NaN/inf value on a masked path


def stages(make: Callable[[], Callable[..., Any]], args: tuple[Any, ...]) -> dict[str, float]:
    """CPU seconds of each stage of one fresh first call of ``jax.jit(make())``, and the lowered module's size."""
    jax.clear_caches()
    fn = jax.jit(make())
    t0 = time.process_time()
    traced = fn.trace(*args)
    t1 = time.process_time()
    lowered = traced.lower()
    t2 = time.process_time()
    lowered.compile()
    t3 = time.process_time()
    return {"trace": t1 - t0, "lower": t2 - t1, "compile": t3 - t2, "total": t3 - t0,
            "size": float(len(lowered.as_text()))}


def compare(makers: dict[str, Callable[[], Callable[..., Any]]], args: tuple[Any, ...],
            builds: int) -> dict[str, dict[str, float]]:
    """Median stages per maker, builds interleaved (after one warm-up build of each)."""
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in makers}
    for i in range(builds + 1):
        for k, make in makers.items():
            s = stages(make, args)
            if i:
                runs[k].append(s)
    return {k: {m: statistics.median(r[m] for r in rs) for m in (*STAGES, "total", "size")} for k, rs in runs.items()}


def dominant(ours: dict[str, float], base: dict[str, float]) -> str:
    """The stage with the largest extra time, and its own ratio."""
    stage = max(STAGES, key=lambda s: ours[s] - base[s])
    return f"{stage} {ours[stage] / max(base[stage], 1e-9):.2f}x"


def corpus_results(quick: bool, only: str | None = None) -> list[dict[str, Any]]:
    table = gk.tables.SAFE | gk.tables.STABLE
    results = []
    for prog in CORPUS:
        if (quick and prog.name not in QUICK) or (only and only.lower() not in prog.name.lower()):
            continue
        loss, args = prog.build()
        m = compare({"plain": lambda loss=loss: jax.grad(loss),
                     "gradkit": lambda loss=loss: jax.grad(gk.override(loss, table))},
                    args, 1 if quick else 5)
        ours, base = m["gradkit"], m["plain"]
        results.append({"name": prog.name, "family": prog.family, "ratio": ours["total"] / base["total"],
                        "dominant": dominant(ours, base), "plain_s": base["total"],
                        "size_ratio": ours["size"] / base["size"],
                        **{f"{s}_ratio": ours[s] / max(base[s], 1e-9) for s in STAGES}})
    return results


def rows_corpus(quick: bool) -> list[Row]:
    results = corpus_results(quick)
    rows = [row(f"first call, {r['name']} [{r['dominant']}]", "plain jit(grad)", r["ratio"], 1.5)
            for r in results]
    ratios = [r["ratio"] for r in results]
    rows.append(row(f"  first call, median of {len(ratios)} programs", "plain jit(grad)",
                    statistics.median(ratios), 1.15))
    rows.append(row(f"  first call, largest of {len(ratios)} programs", "plain jit(grad)", max(ratios), 1.5))
    return rows


def _sqrt_chain(sqrt: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def f(x):
        for i in range(1000):
            x = sqrt(x) if i % 5 == 0 else (x * 1.0001 if i % 2 else x + 0.5)
        return jnp.sum(x)
    return f


def _sqrt_twin() -> Callable[[Any], Any]:
    @jax.custom_vjp
    def sqrt(x):
        return jnp.sqrt(x)

    def fwd(x):
        y = jnp.sqrt(x)
        return y, y

    sqrt.defvjp(fwd, lambda y, g: (g * 0.5 / y,))
    return sqrt


def rows_chain(quick: bool) -> list[Row]:
    rule = gk.vjp_rule(lambda op, g: (g * 0.5 / op.outputs[0],), name="sqrt_vjp")
    x = jnp.linspace(1.0, 2.0, 256)
    m = compare({"twins": lambda: jax.grad(_sqrt_chain(_sqrt_twin())),
                 "gradkit": lambda: jax.grad(gk.override(_sqrt_chain(jnp.sqrt), {"sqrt": rule}))},
                (x,), 1 if quick else 7)
    ours, base = m["gradkit"], m["twins"]
    return [row(f"first call, 1,000-eqn chain, 200 sqrt VJP [{dominant(ours, base)}]", "hand custom_vjp twins",
                ours["total"] / base["total"], 1.10)]


def rows_mask_ops(quick: bool) -> list[Row]:
    """What SAFE's ``mul`` costs the first call: SAFE against SAFE without it, over the SAFE-heavy programs."""
    if quick:
        return []
    safe = gk.tables.SAFE
    without = gk.RuleTable({k: safe[k] for k in safe.names() if k not in MASK_OPS})
    sizes, compiles, totals = [], [], []
    for prog in CORPUS:
        if prog.family not in ("jax-md-pattern", "numpyro-pattern", "jax"):
            continue
        loss, args = prog.build()
        m = compare({"without": lambda loss=loss: jax.grad(gk.override(loss, without)),
                     "safe": lambda loss=loss: jax.grad(gk.override(loss, safe))}, args, 3)
        sizes.append(m["safe"]["size"] / m["without"]["size"])
        compiles.append(m["safe"]["compile"] / m["without"]["compile"])
        totals.append(m["safe"]["total"] / m["without"]["total"])
    label = f"SAFE's mul, median of {len(sizes)} programs"
    return [row(f"{label}: lowered module size", "SAFE without it", statistics.median(sizes), None, "size"),
            row(f"{label}: compile", "SAFE without it", statistics.median(compiles), None),
            row(f"{label}: first call", "SAFE without it", statistics.median(totals), None)]


ROWS = [rows_chain, rows_corpus, rows_mask_ops]


if __name__ == "__main__":
    import argparse

    from common import format_row

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", help="run the corpus programs whose name contains this (and print every stage)")
    a = p.parse_args()
    if a.only:
        for r in corpus_results(False, a.only):
            print(f"{r['name']:44} {r['ratio']:.2f}  " + " ".join(f"{s} {r[s + '_ratio']:.2f}" for s in STAGES)
                  + f"  size {r['size_ratio']:.2f}  plain {r['plain_s']:.2f}s")
    else:
        for make in ROWS:
            for r in make(a.quick):
                print(format_row(r, 64))
