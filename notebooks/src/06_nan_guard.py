# %% [markdown]
# # 06 · A NaN at step 301: `gk.guard`
#
# A NaN that appears deep into a jitted training run is hard to chase:
# `jax_debug_nans` slows every step, `optax.apply_if_finite` skips the step
# without saying why, and `gk.audit` needs the step's exact inputs.
#
# `gk.guard(loss)` is a drop-in for `jax.value_and_grad(loss)` inside your
# jitted step. While the loss and the gradients are finite it returns exactly
# what `jax.value_and_grad` returns and adds one fused finiteness check. When
# the check fails, that step's inputs go to the host and `gk.audit` explains
# the NaN: the primitive, the source line, the elements and a fix.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import optax

import gradkit as gk

BATCH, FULL_BATCHES, CLASSES = 64, 300, 3

def data(key):
    n = BATCH * FULL_BATCHES + 40          # 300 full batches and a partial one
    x = jax.random.normal(key, (n, 2))
    labels = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, jax.nn.one_hot(labels, CLASSES)

def batches(x, y):
    """Batches of 64; the last one padded with zero rows and a mask, as many loaders do."""
    for start in range(0, x.shape[0], BATCH):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        pad = BATCH - xb.shape[0]
        mask = jnp.arange(BATCH) < BATCH - pad
        yield jnp.pad(xb, ((0, pad), (0, 0))), jnp.pad(yb, ((0, pad), (0, 0))), mask

def loss(params, x, labels, mask):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    p = jax.nn.softmax(h @ params["w2"] + params["b2"], axis=-1)
    p_label = jnp.sum(p * labels, axis=-1)                  # 0 on a padded row
    per_example = jnp.where(mask, -jnp.log(p_label), 0.0)   # masked out... in the forward pass
    return jnp.sum(per_example) / jnp.sum(mask)

def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (2, 16)) * 0.5, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, CLASSES)) * 0.5, "b2": jnp.zeros(CLASSES)}

# %% [markdown]
# ## Training, guarded
#
# The only changes to a usual training step: `gk.guard(loss)` where
# `jax.value_and_grad(loss)` was, and `@guarded.wrap` over `@jax.jit`, so
# that a bad step raises `gk.NonFiniteGradientError` and the reports number
# the steps. Steps 1 to 300 run at full speed; step 301 is the first padded
# batch.

# %%
def train(guarded, epochs=1):
    opt = optax.adam(1e-2)

    @guarded.wrap
    @jax.jit
    def step(params, state, x, labels, mask):
        value, grads = guarded(params, x, labels, mask)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    x, y = data(jax.random.key(1))
    params = init(jax.random.key(0))
    state = opt.init(params)
    history = []
    for _ in range(epochs):
        for xb, yb, mb in batches(x, y):
            params, state, value = step(params, state, xb, yb, mb)
            history.append(float(value))
    return params, history

guarded = gk.guard(loss)   # on_nonfinite="raise" (or "skip", "report")
try:
    train(guarded)
except gk.NonFiniteGradientError as e:
    print(e.reports[0])

# %% [markdown]
# The report's first line says where the NaN was born, and when: `log` at the
# `jnp.where` line, at step 301, for the 24 padded rows (`x = 0`: their probability of the all-zero label). The loss is finite (the `where` drops those
# rows), but the backward pass multiplies the zero cotangent by
# `∂log/∂x = inf`: `0 × inf = NaN`. The suggested fix, `gk.tables.SAFE`, was
# re-run by the audit and matches float64 finite differences. It needs no
# change to the loss.

# %%
fixed = gk.guard(gk.override(loss, gk.tables.SAFE))
params, history = train(fixed, epochs=2)
print(f"{len(history)} steps, reports: {len(fixed.reports)}, final loss {history[-1]:.4f}")

fig, ax = plt.subplots(figsize=(7, 3.5))
ax.plot(history)
for end in (300, 601):   # steps 301 and 602 (0-based)
    ax.axvline(end, color="gray", lw=0.8, ls="--")
ax.set_xlabel("step"); ax.set_ylabel("loss"); ax.set_yscale("log")
ax.set_title("with gk.tables.SAFE: the padded batches (dashed) train normally")
plt.tight_layout(); plt.show()
assert not fixed.reports and all(jnp.isfinite(jnp.asarray(history)))

# %% [markdown]
# ## `"skip"` mode, and what the guard costs
#
# With `on_nonfinite="skip"` the bad step's gradients come back as zeros, so
# the update is a no-op (as with `optax.apply_if_finite`), the report is kept
# and training goes on. On the finite path the guard adds one fused check;
# `benchmarks/bench_guard.py` measures it against `jax.value_and_grad` on an
# MLP training step (a row of `benchmarks/run.py`).

# %%
skipping = gk.guard(loss, on_nonfinite="skip")
params, history = train(skipping)
print(f"{len(history)} steps, {len(skipping.reports)} skipped and reported:")
print(skipping.reports[0].headline)   # where the NaN was born, which step, the loss
