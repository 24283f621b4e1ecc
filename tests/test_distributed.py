"""Across processes: gk.override under JAX's multi-process runtime (jax.distributed).

Two CPU processes on 127.0.0.1 (a free port, gloo collectives) each hold half
the batch of a global array; a few SGD steps of `jit(value_and_grad(override(
loss, SAFE)))` run data-parallel. Both processes must end with the same
parameters as one process training on the whole batch.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import gradkit as gk

WORKERS = Path(__file__).parent / "workers"
sys.path.insert(0, str(WORKERS))
from problem import STEPS, batch, init_params, loss  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _single_process():
    x, y = batch()
    params = init_params()
    opt = optax.sgd(0.1)
    state = opt.init(params)
    values = []
    for _ in range(STEPS):
        value, g = jax.value_and_grad(gk.override(loss, gk.tables.SAFE))(params, x, y)
        updates, state = opt.update(g, state, params)
        params = optax.apply_updates(params, updates)
        values.append(float(value))
    return values, params


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_two_processes_train_like_one(tmp_path):
    assert not np.isfinite(np.asarray(jax.grad(loss)(init_params(), *batch())["w"])).all()  # plain: NaN
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([str(Path(gk.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    outs = [tmp_path / f"p{i}.json" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "distributed_train.py"), str(port), str(i), "2",
                               str(outs[i])], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail("the two processes did not finish in 240 s")
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-3000:]
    results = [json.loads(o.read_text()) for o in outs]
    values, params = _single_process()
    for r in results:
        assert r["processes"] == 2 and r["devices"] == 4
        np.testing.assert_allclose(r["values"], values, rtol=2e-6)
        for k, v in params.items():
            np.testing.assert_allclose(np.asarray(r["params"][k]), np.asarray(v), rtol=2e-6, atol=1e-7)
    assert np.isfinite(results[0]["values"]).all() and results[0]["values"][-1] < results[0]["values"][0]
