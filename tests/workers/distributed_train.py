"""One process of the two-process training test (tests/test_distributed.py).

Usage: python distributed_train.py PORT PROCESS_ID NUM_PROCESSES OUT.json
Each process holds half the batch; the global batch is one array over every
process's devices; a few SGD steps run through gk.override(loss, SAFE).
"""

import json
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
port, pid, nproc, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import gradkit as gk  # noqa: E402

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from problem import STEPS, batch, init_params, loss  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
x_all, y_all = batch()
per = x_all.shape[0] // nproc
local = slice(pid * per, (pid + 1) * per)
data = NamedSharding(mesh, P("data"))
x = jax.make_array_from_process_local_data(data, x_all[local], x_all.shape)
y = jax.make_array_from_process_local_data(data, y_all[local], y_all.shape)
params = jax.device_put(init_params(), NamedSharding(mesh, P()))
opt = optax.sgd(0.1)
state = opt.init(params)
grad = gk.override(loss, gk.tables.SAFE)


@jax.jit
def step(params, state, x, y):
    value, g = jax.value_and_grad(grad)(params, x, y)
    updates, state = opt.update(g, state, params)
    return optax.apply_updates(params, updates), state, value


values = []
for _ in range(STEPS):
    params, state, value = step(params, state, x, y)
    values.append(float(value))
result = {"values": values, "params": {k: np.asarray(jax.device_get(v)).tolist() for k, v in params.items()},
          "devices": jax.device_count(), "processes": jax.process_count()}
with open(out, "w") as f:
    json.dump(result, f)
jax.distributed.shutdown()
