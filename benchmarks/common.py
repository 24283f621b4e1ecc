"""What every benchmark module shares (run.py and benchmarks/bench_*.py): timing, table rows, the MLP problem."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Row = dict[str, Any]


def block(x: Any) -> Any:
    """``x`` once every array in it is computed."""
    return jax.tree_util.tree_map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, x)


def samples(fns: dict[str, Callable[[], Any]], repeats: int, inner: int = 1, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each fn, one sample per repeat, alternating between them to share the noise.

    Each fn first runs ``warmup`` times (compile, allocate); a sample is the
    mean of ``inner`` calls, their results computed.
    """
    for f in fns.values():
        for _ in range(warmup):
            block(f())
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(inner):
                out = f()
            block(out)
            times[k].append((time.perf_counter() - t0) / inner)
    return times


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, inner: int = 1) -> dict[str, float]:
    """Median seconds per call of each fn (:func:`samples`)."""
    return {k: statistics.median(v) for k, v in samples(fns, repeats, inner).items()}


def once(f: Callable[[], Any]) -> float:
    """Seconds of one call of ``f``, its results computed."""
    t0 = time.perf_counter()
    block(f())
    return time.perf_counter() - t0


def row(name: str, baseline: str, ratio: float, target: float | None, fmt: str = "ratio") -> Row:
    """One row of the table: a ratio (gradkit / baseline) and whether it meets its target (``None``: none)."""
    ok = None if target is None else bool(ratio <= target)
    return {"workload": name, "baseline": baseline, "ratio": float(ratio), "target": target, "pass": ok, "fmt": fmt}


def format_row(r: Row, width: int = 48) -> str:
    """One printed line of the table: workload, baseline, ratio, target and verdict."""
    target = "" if r["target"] is None else f"<= {r['target']:.2f}"
    verdict = "" if r["pass"] is None else ("pass" if r["pass"] else "MISS")
    return f"{r['workload']:{width}} {r['baseline']:20} {r['ratio']:8.3f} {target:>8}  {verdict}"


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's command line: its module docstring as the help, and ``--quick``."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats")
    return p


def report(title: str, rows: list[Row], width: int) -> int:
    """Prints ``title`` with the JAX version and platform, then the table; 0, for ``main`` to return."""
    print(f"{title} (jax {jax.__version__}, {jax.devices()[0].platform})")
    for r in rows:
        print(format_row(r, width))
    return 0


def mlp_problem(batch: int, width: int, depth: int) -> tuple[Any, Any, Any]:
    """Parameters of a ``depth``-layer MLP of ``width`` units on 32 features, a batch and its 0/1 labels."""
    keys = jax.random.split(jax.random.key(0), depth + 2)
    dims = [32] + [width] * depth + [1]
    params = [{"w": jax.random.normal(k, (a, b), jnp.float32) / np.sqrt(a), "b": jnp.zeros((b,), jnp.float32)}
              for k, a, b in zip(keys, dims[:-1], dims[1:])]
    x = jax.random.normal(keys[-1], (batch, 32), jnp.float32)
    y = (x[:, 0] > 0).astype(jnp.float32)
    return params, x, y


def write_json(path: str, result: dict[str, Any]) -> int:
    """Writes a reference comparison's ``result`` to ``path`` (its folder made if needed), says so; exit code 0."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {path}")
    return 0


def environment(*dists: str) -> dict[str, Any]:
    """Python, the machine, JAX's backend and the installed version of each distribution in ``dists`` (None
    where one is not installed), for a reference comparison's JSON and its table's caption."""
    import importlib.metadata
    import platform

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"python": platform.python_version(),
            "machine": f"{platform.machine()}, {os.cpu_count()} cores ({platform.processor() or 'cpu'})",
            "jax_backend": jax.default_backend(), **{d: version(d) for d in dists}}
