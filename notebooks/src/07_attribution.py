# %% [markdown]
# # 07 · Explaining a model's output with `gk.attribution`
#
# Which pixels made the model say "vertical bar"? Attribution methods answer
# with a map shaped like the input. Guided Backprop and DeconvNet change only
# how each ReLU passes gradients backward, so in gradkit they are rule tables
# over `jax.nn.relu`: they apply to a model as it is, with no module swapped.
#
# We train a small CNN on a synthetic task (nothing is downloaded): 12×12
# images holding one of four shapes at a random place, in noise.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import gradkit as gk

SHAPES = ["horizontal bar", "vertical bar", "diagonal", "square"]

def make_images(n, seed):
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, 0.3, (n, 12, 12, 1)).astype(np.float32)
    masks = np.zeros((n, 12, 12), bool)
    labels = rng.integers(0, 4, n)
    for i, c in enumerate(labels):
        r, q = rng.integers(1, 7, 2)
        if c == 0:
            masks[i, r + 2, q:q + 5] = True
        elif c == 1:
            masks[i, r:r + 5, q + 2] = True
        elif c == 2:
            masks[i, np.arange(r, r + 5), np.arange(q, q + 5)] = True
        else:
            masks[i, r:r + 5, q:q + 5] = True
            masks[i, r + 1:r + 4, q + 1:q + 4] = False
    images[masks] += 1.0
    return jnp.asarray(images), jnp.asarray(labels), masks

x_train, y_train, _ = make_images(2048, seed=0)
x_test, y_test, masks_test = make_images(256, seed=1)

# %% [markdown]
# The model: two convolutions with `jax.nn.relu`, a max-pool and a dense head,
# in plain JAX (a Flax or Equinox model works the same way).

# %%
def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

def model(params, x):
    h = jax.nn.relu(conv(x, params["c1"]))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = jax.nn.relu(conv(h, params["c2"]))
    return h.reshape(h.shape[0], -1) @ params["head"]

keys = jax.random.split(jax.random.key(0), 3)
params = {"c1": jax.random.normal(keys[0], (3, 3, 1, 8)) * 0.5,
          "c2": jax.random.normal(keys[1], (3, 3, 8, 16)) * 0.2,
          "head": jax.random.normal(keys[2], (6 * 6 * 16, 4)) * 0.02}
opt = optax.adam(3e-3)
state = opt.init(params)

@jax.jit
def step(params, state, x, y):
    def loss(p):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(p, x), y))
    value, grads = jax.value_and_grad(loss)(params)
    updates, state = opt.update(grads, state, params)
    return optax.apply_updates(params, updates), state, value

for i in range(300):
    batch = slice((i * 64) % 2048, (i * 64) % 2048 + 64)
    params, state, value = step(params, state, x_train[batch], y_train[batch])
accuracy = float(jnp.mean(jnp.argmax(model(params, x_test), -1) == y_test))
print(f"loss {float(value):.3f}, test accuracy {accuracy:.2f}")

# %% [markdown]
# Six maps of the same images, each for the model's own top class (the
# default `target`; a class, one per row, or an output cotangent also work).
# The last two are Layer-wise Relevance Propagation (`gk.attribution.lrp`),
# which finds the model's conv and dense layers in its traced program and
# passes the output back layer by layer with Zennit's rules: `EPSILON_PLUS_FLAT`
# (flat for the first layer, z⁺ for convs, ε for dense) and
# `EPSILON_GAMMA_BOX` (z^B with the pixel range as the box for the first conv,
# γ for the others). Each call is one `jax.vjp` of the model; all six run
# under `jit`.

# %%
f = lambda x: model(params, x)
low, high = float(x_test.min()), float(x_test.max())  # the box of the z^B rule
methods = {
    "gradient": gk.attribution.gradient,
    "gradient × input": gk.attribution.gradient_x_input,
    "Guided Backprop": gk.attribution.guided_backprop,
    "DeconvNet": gk.attribution.deconvnet,
    "LRP ε-z⁺-flat": lambda f, x: gk.attribution.lrp(f, x, gk.attribution.EPSILON_PLUS_FLAT),
    "LRP ε-γ-box": lambda f, x: gk.attribution.lrp(f, x, gk.attribution.EPSILON_GAMMA_BOX(low, high)),
}
maps = {name: np.asarray(jax.jit(lambda x, m=m: m(f, x))(x_test))[..., 0] for name, m in methods.items()}

shown = [int(np.flatnonzero(np.asarray(y_test) == c)[0]) for c in range(4)]
fig, axes = plt.subplots(4, 7, figsize=(14, 8))
for row, i in enumerate(shown):
    axes[row, 0].imshow(np.asarray(x_test[i, ..., 0]), cmap="gray")
    axes[row, 0].set_ylabel(SHAPES[int(y_test[i])])
    for col, (name, m) in enumerate(maps.items(), start=1):
        a = m[i]
        axes[row, col].imshow(a, cmap="RdBu_r", vmin=-np.abs(a).max(), vmax=np.abs(a).max())
        if row == 0:
            axes[row, col].set_title(name)
axes[0, 0].set_title("image")
for ax in axes.flat:
    ax.set_xticks([])
    ax.set_yticks([])
plt.tight_layout()
plt.show()

# %% [markdown]
# How much of each map lies on the shape? The share of the map's absolute
# value on the shape's pixels, averaged over the test images. The shapes cover
# 5 to 16 of the 144 pixels, so a map spread evenly would score 0.03 to 0.11;
# here the input-weighted and the guided maps concentrate on the shape, the
# plain gradient and DeconvNet (which ignores where each ReLU was active) much
# less. Of the two LRP maps, the flat rule spreads the first layer's relevance
# evenly over each 3×3 window, blurring it off the shape; the box rule weighs
# it by the pixels' values and keeps more of it on the shape.

# %%
for name, m in maps.items():
    share = np.mean([np.abs(m[i])[masks_test[i]].sum() / np.abs(m[i]).sum() for i in range(len(m))])
    print(f"{name:18} {share:.2f}")

# %% [markdown]
# Guided Backprop is a rule table like any other, so it can be combined or
# inspected, and used with `gk.override` directly:

# %%
print(gk.attribution.GUIDED_BACKPROP)
guided_model = gk.override(f, gk.attribution.GUIDED_BACKPROP)
cot = jax.nn.one_hot(jnp.argmax(f(x_test[:2]), -1), 4)
g = jax.vjp(guided_model, x_test[:2])[1](cot)[0]
print(bool(jnp.allclose(g, gk.attribution.guided_backprop(f, x_test[:2]))))
