# %% [markdown]
# # 03 · Training: a NaN gradient found by `audit`, fixed by a table
#
# A small heteroscedastic regression: the model predicts a mean and a scale
# for each target, and the loss is a Gaussian negative log-likelihood over a
# padded batch. Padding rows have `sigma = 0` and are masked out with
# `jnp.where` — a forward pass that is perfectly finite, and a gradient that is
# NaN on the first step.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import optax

import gradkit as gk

key = jax.random.key(0)
kx, kn, kw = jax.random.split(key, 3)
n, pad = 192, 64
x = jax.random.uniform(kx, (n, 1), minval=-3, maxval=3)
y = jnp.sin(x[:, 0]) * 2 + jax.random.normal(kn, (n,)) * (0.1 + 0.3 * jnp.abs(x[:, 0]))
x = jnp.concatenate([x, jnp.zeros((pad, 1))])   # padding rows
y = jnp.concatenate([y, jnp.zeros(pad)])
valid = jnp.arange(n + pad) < n

def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (1, 32)), "b1": jnp.zeros(32),
            "w2": jax.random.normal(k2, (32, 2)) * 0.1, "b2": jnp.zeros(2)}

def loss(params, x, y, valid):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    out = h @ params["w2"] + params["b2"]
    mu = out[:, 0]
    sigma = (jax.nn.softplus(out[:, 1]) + 1e-3) * valid                 # padding rows: sigma = 0
    z = (y - mu) / jnp.where(valid, sigma, 1.0)
    nll = jnp.where(valid, jnp.log(sigma) + 0.5 * z ** 2, 0.0)          # log(0) only where masked
    return jnp.sum(nll) / jnp.sum(valid)

params = init(kw)
print("loss:", loss(params, x, y, valid))
print("any NaN in the gradient:", any(jnp.isnan(g).any() for g in jax.tree_util.tree_leaves(jax.grad(loss)(params, x, y, valid))))

# %% [markdown]
# ## Where is the NaN born?

# %%
report = gk.audit(lambda p: loss(p, x, y, valid), params)
print(report)

# %% [markdown]
# ## Train both: plain and with `gk.tables.SAFE | gk.tables.STABLE`

# %%
def train(loss_fn, steps=300):
    opt = optax.adam(3e-3)
    p, state = init(kw), None
    state = opt.init(p)

    @jax.jit
    def step(p, state):
        l, g = jax.value_and_grad(loss_fn)(p, x, y, valid)
        updates, state = opt.update(g, state, p)
        return optax.apply_updates(p, updates), state, l

    losses = []
    for _ in range(steps):
        p, state, l = step(p, state)
        losses.append(float(l))
    return p, losses

_, plain_losses = train(loss)
fixed_params, fixed_losses = train(gk.override(loss, gk.tables.SAFE | gk.tables.STABLE))
print("plain: first", plain_losses[0], "last", plain_losses[-1])
print("fixed: first", fixed_losses[0], "last", fixed_losses[-1])

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(plain_losses, "o-", label="plain JAX", lw=3, markevery=[0])
first_nan = next(i for i, l in enumerate(plain_losses) if l != l)
ax.annotate(f"plain JAX: loss is NaN from step {first_nan} on", (first_nan, plain_losses[0]),
            xytext=(40, plain_losses[0] * 0.9), arrowprops={"arrowstyle": "->"})
ax.plot(fixed_losses, label="gk.override(loss, SAFE | STABLE)")
ax.set_xlabel("step"); ax.set_ylabel("NLL"); ax.legend(); ax.set_title("loss curves")
plt.tight_layout(); plt.show()
assert fixed_losses[-1] < fixed_losses[0] and all(jnp.isfinite(jnp.array(fixed_losses)))
