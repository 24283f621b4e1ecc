"""Memory of gradkit's caches: many distinct static values through one function, against ``jax.jit``.

    python benchmarks/bench_cache_memory.py [--quick]

Each side runs in a fresh process (so neither inherits the other's heap):
one function called with N distinct static values (each a new trace and a
new compiled program, eagerly and under ``jax.grad``), the growth of the
resident set measured from after a warm-up call. The row is the ratio
gradkit / ``jax.jit(f, static_argnums=1)``: gradkit's caches (bounded LRUs, see
``gradkit/_src/core/cache.py``) should hold no more than JAX's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import row

_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp
import gradkit as gk

def rss_mb():
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")

def fn(x, k):
    return jnp.sum(jnp.sqrt(x * x + k) * k)

kind, n = sys.argv[1], int(sys.argv[2])
f = gk.override(fn, gk.tables.SAFE) if kind == "gradkit" else jax.jit(fn, static_argnums=1)
g = jax.grad(f)
x = jnp.linspace(0.0, 1.0, 256, dtype=jnp.float32)
f(x, -1.0); g(x, -1.0)
before = rss_mb()
for i in range(n):
    k = 1.0 + i / 7.0
    f(x, k).block_until_ready(); g(x, k).block_until_ready()
print(json.dumps({"growth_mb": rss_mb() - before}))
"""


def _growth(kind: str, n: int) -> float:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    out = subprocess.run([sys.executable, "-c", _CHILD, kind, str(n)], capture_output=True, text=True, env=env,
                         check=True, timeout=3600)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"])


def rows(quick: bool) -> list[dict[str, Any]]:
    n = 40 if quick else 2000
    ours, plain = _growth("gradkit", n), _growth("jit", n)
    r = row(f"RSS growth, {n} static values (value + grad)", "jax.jit(static)", ours / max(plain, 1.0), 1.10)
    r["detail"] = {"gradkit_mb": round(ours, 1), "jax_jit_mb": round(plain, 1), "calls": n}
    return [r]


if __name__ == "__main__":
    from common import format_row

    for r in rows("--quick" in sys.argv):
        print(format_row(r), r["detail"])
