"""The training problem shared by the two-process test and its single-process reference."""

import jax.numpy as jnp
import numpy as np

STEPS = 4


def batch():
    rng = np.random.RandomState(0)
    x = rng.uniform(-1.0, 1.0, (16, 4)).astype(np.float32)
    x[3] = 0.0  # a padded row: sqrt(0) under a where, whose plain gradient is NaN
    y = (x @ np.array([0.5, -1.0, 2.0, 0.25], np.float32)).astype(np.float32)
    return x, y


def init_params():
    return {"w": jnp.full((4,), 0.1, jnp.float32), "b": jnp.zeros((), jnp.float32)}


def loss(params, x, y):
    pred = x @ params["w"] + params["b"]
    r = pred * pred * jnp.sum(x * x, axis=1)  # 0 at the padded row
    reg = jnp.where(r > 0, jnp.sqrt(r), 0.0)  # its plain gradient there is 0 * inf = NaN; SAFE's is 0
    return jnp.mean((pred - y) ** 2 + 0.01 * reg)
