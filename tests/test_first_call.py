"""First call: JAX's persistent compilation cache serves overridden functions across processes.

A second process with the same cache directory compiles nothing: every
compile request of the overridden programs (a VJP rule under ``jit(grad)``,
``SAFE | STABLE`` called eagerly and under an eager ``grad``) is a cache hit,
and the gradients are the first process's, bit for bit. So the program
gradkit builds is the same from one process to the next (no ids, addresses
or counters in it), and a restarted training job skips XLA compilation as
it does without gradkit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

CHILD = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np

    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    import gradkit as gk

    counts = {"requests": 0, "hits": 0}
    active = [False]

    def listener(event, *args, **kwargs):
        if active[0] and event == "/jax/compilation_cache/compile_requests_use_cache":
            counts["requests"] += 1
        elif active[0] and event == "/jax/compilation_cache/cache_hits":
            counts["hits"] += 1

    jax.monitoring.register_event_listener(listener)

    def loss(x):
        h = jnp.where(x > 0, jnp.sqrt(x), 0.0)
        return jnp.sum(h * jax.nn.sigmoid(x) + jnp.log1p(x * x))

    rule = gk.vjp_rule(lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),))
    by_rule = gk.override(loss, {"sqrt": rule})
    safe = gk.override(loss, gk.tables.SAFE | gk.tables.STABLE)
    x = jnp.linspace(-1.0, 2.0, 16, dtype=jnp.float32)
    jax.block_until_ready(x)

    active[0] = True
    out = [jax.jit(jax.grad(by_rule))(x), safe(x), jax.grad(safe)(x)]
    jax.block_until_ready(out)
    active[0] = False
    print(json.dumps({**counts, "values": [np.asarray(v).tobytes().hex() for v in out]}))
""")


def _run(cache_dir: str) -> dict:
    done = subprocess.run([sys.executable, "-c", CHILD, cache_dir], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_persistent_cache_serves_overridden_functions_across_processes(tmp_path):
    cache = str(tmp_path / "jax_cache")
    first = _run(cache)
    second = _run(cache)
    assert first["requests"] > 0 and first["hits"] == 0, first  # compiled, and written to the cache
    assert os.listdir(cache)
    assert second["requests"] == first["requests"], (first, second)  # the same programs asked for...
    assert second["hits"] == second["requests"], second  # ... and every one read back, none compiled
    assert second["values"] == first["values"]  # bit for bit
