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
import textwrap
import warnings

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

def show_maps(images, labels, maps, notes=None, figsize=(14, 8)):
    """One row per image: the image, then each method's map (red positive, blue negative, each to its own max)."""
    fig, axes = plt.subplots(len(images), len(maps) + 1, figsize=figsize)
    for row, (image, label) in enumerate(zip(images, labels)):
        axes[row, 0].imshow(image, cmap="gray")
        axes[row, 0].set_ylabel(label)
        for col, (name, m) in enumerate(maps.items(), start=1):
            a = m[row]
            axes[row, col].imshow(a, cmap="RdBu_r", vmin=-np.abs(a).max(), vmax=np.abs(a).max())
            if notes is not None:
                axes[row, col].set_xlabel(notes[name][row])
            if row == 0:
                axes[row, col].set_title(name)
    axes[0, 0].set_title("image")
    for ax in axes.flat:
        ax.set_xticks([])
        ax.set_yticks([])
    plt.tight_layout()
    plt.show()


shown = [int(np.flatnonzero(np.asarray(y_test) == c)[0]) for c in range(4)]
show_maps([np.asarray(x_test[i, ..., 0]) for i in shown], [SHAPES[int(y_test[i])] for i in shown],
          {name: m[shown] for name, m in maps.items()})

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

# %% [markdown]
# ## A ResNet: BatchNorm and residual adds
#
# The models people explain are mostly ResNets, and two of their parts need
# care in LRP. Here is a small one in plain JAX: a stem convolution, two
# BasicBlocks (the second with a strided 1×1 shortcut), each convolution
# followed by BatchNorm in eval mode, global mean pooling and a dense head
# over four classes. Its weights are random and its BatchNorm running
# statistics randomised, standing in for trained ones; `lrp` is handed the model
# as it is, with nothing rewritten. The inputs are the four shapes shown above,
# padded to 16×16 and copied into three channels.

# %%
def conv2d(x, w, stride=1):
    return jax.lax.conv_general_dilated(x, w, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

def batchnorm(x, bn, eps=1e-5):  # eval mode: the running statistics
    return (x - bn["mean"]) / jnp.sqrt(bn["var"] + eps) * bn["scale"] + bn["bias"]

def basic_block(p, x, stride=1):
    h = jax.nn.relu(batchnorm(conv2d(x, p["w1"], stride), p["bn1"]))
    h = batchnorm(conv2d(h, p["w2"]), p["bn2"])
    shortcut = batchnorm(conv2d(x, p["wd"], stride), p["bnd"]) if "wd" in p else x
    return jax.nn.relu(h + shortcut)  # the residual add

def resnet(p, x):
    h = jax.nn.relu(batchnorm(conv2d(x, p["stem"]), p["bn"]))
    h = basic_block(p["block1"], h)
    h = basic_block(p["block2"], h, stride=2)
    return jnp.mean(h, axis=(1, 2)) @ p["head"]  # global mean pooling, then the head

rng = np.random.default_rng(0)
def conv_weight(k, c_in, c_out):
    return jnp.asarray(rng.normal(0.0, np.sqrt(2 / (k * k * c_in)), (k, k, c_in, c_out)), jnp.float32)
def bn_stats(c):
    return {name: jnp.asarray(v, jnp.float32) for name, v in
            [("scale", rng.uniform(0.5, 1.5, c)), ("bias", rng.normal(0.0, 0.1, c)),
             ("mean", rng.normal(0.0, 0.1, c)), ("var", rng.uniform(0.5, 1.5, c))]}
res_params = {
    "stem": conv_weight(3, 3, 8), "bn": bn_stats(8),
    "block1": {"w1": conv_weight(3, 8, 8), "bn1": bn_stats(8), "w2": conv_weight(3, 8, 8), "bn2": bn_stats(8)},
    "block2": {"w1": conv_weight(3, 8, 16), "bn1": bn_stats(16), "w2": conv_weight(3, 16, 16), "bn2": bn_stats(16),
               "wd": conv_weight(1, 8, 16), "bnd": bn_stats(16)},
    "head": jnp.asarray(rng.normal(0.0, 1.0, (16, 4)), jnp.float32),
}
x_res = jnp.repeat(jnp.pad(x_test[jnp.asarray(shown)], ((0, 0), (2, 2), (2, 2), (0, 0))), 3, axis=-1)
f_res = lambda x: resnet(res_params, x)
print(x_res.shape, "→", f_res(x_res).shape)

# %% [markdown]
# `lrp` canonizes by default (`canonize=True`, what Zennit's
# `ResNetCanonizer` does): it finds each BatchNorm by dataflow — a
# per-channel affine map with constant operands right after a conv — and
# folds it into that conv (`W' = W·γ/√(var+ε)`, `b' = (b − μ)·γ/√(var+ε) + β`),
# so the conv's rule sees one layer; and it gives each residual add the
# `"sum"` rule, Zennit's Norm, which splits the relevance between the two
# branches in proportion to their contributions. We compare it with
# `canonize=False` (BatchNorm left as it is), with a composite whose residual
# adds keep their gradient (`{"sum": gk.attribution.gradient_rule()}`), and
# with both (LRP with no canonizer at all). `check=True` also returns a report
# with ΣR per image: the relevance starts as 1 on the top class.

# %%
composite = gk.attribution.EPSILON_PLUS_FLAT
sum_keeps_gradient = composite | {"sum": gk.attribution.gradient_rule()}
variants = {
    "canonized": dict(composite=composite),
    "BatchNorm unfolded": dict(composite=composite, canonize=False),
    "adds keep gradient": dict(composite=sum_keeps_gradient),
    "no canonizer": dict(composite=sum_keeps_gradient, canonize=False),
}
res_maps, res_sums, warned = {}, {}, {}
for name, kw in variants.items():
    kw = dict(kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r, report = gk.attribution.lrp(f_res, x_res, kw.pop("composite"), check=True, **kw)
    res_maps[name], res_sums[name] = np.asarray(r).sum(-1), np.asarray(report.total_relevance)
    warned.update(dict.fromkeys(str(w.message) for w in caught))
print("explained output (top logit):", np.round(np.asarray(report.explained_output), 2))
for name, s in res_sums.items():
    print(f"ΣR {name:20}", np.round(s, 3))
for message in warned:  # canonize=False: BatchNorm's ops are on the relevance path, without a rule
    print("\nwarning:", textwrap.fill(message, 110))

# %% [markdown]
# Only the canonized ΣR is close to 1. Left unfolded, BatchNorm is a
# per-channel shift and scale after the conv whose ops have no rule, so they
# keep their gradient (and `lrp` warns, naming them): the relevance is
# multiplied by `γ/√(var+ε)` channel by channel, compounded over the five
# BatchNorms on the longest path, and the shifts absorb none of it. A
# residual add that keeps its gradient hands the whole relevance to both
# branches, so each add roughly doubles ΣR (two adds here: about 4×).
# The canonized ΣR falls short of 1 only by what the biases (here the folded
# BatchNorm shifts) and the stabilizers absorb. To see that, give BatchNorm
# shifts that fold to a zero bias (`β = μ·γ/√(var+ε)`): the canonized ΣR is
# then within 0.002 of 1, and with adds keeping their gradient about 4 (2²).

# %%
def zero_folded_bias(p):
    if "mean" in p:
        return p | {"bias": p["mean"] * p["scale"] / jnp.sqrt(p["var"] + 1e-5)}
    return {k: zero_folded_bias(v) if isinstance(v, dict) else v for k, v in p.items()}

f_unbiased = lambda x: resnet(zero_folded_bias(res_params), x)
for name, c in [("canonized", composite), ("adds keep gradient", sum_keeps_gradient)]:
    _, report = gk.attribution.lrp(f_unbiased, x_res, c, check=True)
    print(f"ΣR {name:20}", np.round(np.asarray(report.total_relevance), 3))

# %% [markdown]
# The maps side by side (summed over the three colour channels), each scaled
# to its own largest value, with ΣR under each. The weights are random, so no
# map is "right" about the shapes; what canonization changes is how the
# relevance is shared out. An unfolded BatchNorm reweights the channels, and an
# add that keeps its gradient counts the shortcut in full beside the
# convolutions, so besides growing in total the maps change shape: printed
# below the figure, the largest difference from the canonized map, as a share
# of its maximum, averaged over the four images.

# %%
show_maps([np.asarray(x_res[row, ..., 0]) for row in range(4)], [SHAPES[int(y_test[i])] for i in shown], res_maps,
          notes={name: [f"ΣR = {v:.2f}" for v in res_sums[name]] for name in res_maps}, figsize=(11, 9))

def scaled(a):
    return a / np.abs(a).max(axis=(1, 2), keepdims=True)

for name in list(res_maps)[1:]:
    gap = np.abs(scaled(res_maps[name]) - scaled(res_maps["canonized"])).max(axis=(1, 2)).mean()
    print(f"{name:20} differs from the canonized map by up to {gap:.2f} of its maximum")
