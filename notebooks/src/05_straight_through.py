# %% [markdown]
# # 05 · Quantized training with `STRAIGHT_THROUGH`
#
# Rounding has a zero gradient almost everywhere, so a network with quantized
# weights does not learn under plain autodiff. `gk.tables.STRAIGHT_THROUGH`
# maps `round`, `floor`, `ceil` and `sign` to the identity gradient (the
# straight-through estimator) — without changing the model code.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import optax

import gradkit as gk

key = jax.random.key(0)
kx, k1, k2 = jax.random.split(key, 3)
x = jax.random.normal(kx, (512, 2))
y = (jnp.sin(2 * x[:, 0]) + x[:, 1] > 0).astype(jnp.float32)    # a curved boundary

def quantize(w, bits=3):
    scale = 2 ** (bits - 1)
    return jnp.clip(jnp.round(w * scale), -scale, scale - 1) / scale

def logits(params, x):
    h = jnp.tanh(x @ quantize(params["w1"]) + params["b1"])
    return (h @ quantize(params["w2"]))[:, 0] + params["b2"]

def loss(params, x, y):
    z = logits(params, x)
    return jnp.mean(gk.stable.log1pexp(z) - y * z)

def accuracy(params):
    return float(jnp.mean((logits(params, x) > 0) == (y > 0.5)))

def train(loss_fn, steps=400):
    params = {"w1": jax.random.normal(k1, (2, 32)) * 0.5, "b1": jnp.zeros(32),
              "w2": jax.random.normal(k2, (32, 1)) * 0.5, "b2": jnp.zeros(())}
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        g = jax.grad(loss_fn)(params, x, y)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    acc = []
    for i in range(steps):
        params, state = step(params, state)
        if i % 10 == 0:
            acc.append(accuracy(params))
    return acc

plain_acc = train(loss)
ste_acc = train(gk.override(loss, gk.tables.STRAIGHT_THROUGH))
print(f"plain autodiff: accuracy {plain_acc[0]:.2f} -> {plain_acc[-1]:.2f}")
print(f"straight-through: accuracy {ste_acc[0]:.2f} -> {ste_acc[-1]:.2f}")

# %%
steps = [10 * i for i in range(len(plain_acc))]
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(steps, plain_acc, label="plain autodiff (round has zero gradient)")
ax.plot(steps, ste_acc, label="gk.override(loss, STRAIGHT_THROUGH)")
ax.set_xlabel("step"); ax.set_ylabel("train accuracy"); ax.legend(); ax.set_title("3-bit weights")
plt.tight_layout(); plt.show()
assert ste_acc[-1] > plain_acc[-1]
