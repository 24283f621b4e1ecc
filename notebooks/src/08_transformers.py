# %% [markdown]
# # 08 · Explaining a transformer: AttnLRP, CP-LRP, and how faithful a map is
#
# Gradients explain transformers badly: softmax attention, LayerNorm, GELU
# and the products `q·kᵀ` and `A·v` bend them far from what each input
# contributed. AttnLRP (Achtibat et al., ICML 2024) and CP-LRP (Ali et al.,
# ICML 2022) change how relevance passes those ops: a product of two
# input-dependent factors gives each half, an element-wise nonlinearity
# passes `f(x)/x` of it, LayerNorm's scale is held constant; CP-LRP also
# holds the attention weights constant. In gradkit they are the composites
# `gk.attribution.ATTN_LRP` and `CP_LRP` for `gk.attribution.lrp`, found by
# dataflow in the model's program: the model below is plain JAX, written as
# anyone would, and nothing in it is swapped or patched.
#
# Which map is better is measured, not eyeballed: `perturbation_curve` removes
# the tokens a map ranks most relevant first (and least relevant first) and
# follows the model's output.
#
# The task (nothing is downloaded): sequences of 12 tokens, ten filler words
# `w0`…`w9` with one, three or five `A`/`B` tokens among them, ending in `?`.
# The next token is whichever of `A` and `B` appeared more often. So we know
# what a good explanation looks like: the `A` and `B` tokens, with opposite
# signs.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import gradkit as gk

WORDS = [f"w{i}" for i in range(10)] + ["A", "B", "?"]
A, B, QUERY = 10, 11, 12
V, T, D, HEADS = len(WORDS), 12, 32, 2

def make_sequences(n, seed):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 10, (n, T))
    tokens[:, -1] = QUERY
    labels = np.zeros(n, int)
    for i in range(n):
        k = rng.choice([1, 3, 5])  # odd: no ties
        n_a = rng.integers(0, k + 1)
        where = rng.choice(T - 1, k, replace=False)
        tokens[i, where[:n_a]], tokens[i, where[n_a:]] = A, B
        labels[i] = A if 2 * n_a > k else B
    return jnp.asarray(tokens), jnp.asarray(labels)

tokens_train, next_train = make_sequences(4096, seed=0)
tokens_test, next_test = make_sequences(256, seed=1)
print(" ".join(WORDS[t] for t in tokens_test[0]), "→", WORDS[int(next_test[0])])

# %% [markdown]
# The model: a two-block decoder (pre-LayerNorm, causal two-head attention
# written with `einsum`, `softmax` and a `where` mask, a GELU MLP, residual
# adds), learned position embeddings, next-token logits at the last position.
# The function we explain takes the token embeddings `e`, shape [batch, 12, 32],
# so relevance lands on each token's embedding.

# %%
def layer_norm(x, p):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
    return (x - mu) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]

def attention(p, x, causal):
    b, t, d = x.shape
    q, k, v = (jnp.reshape(x @ p[w], (b, t, HEADS, d // HEADS)) for w in ("wq", "wk", "wv"))
    scores = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(d // HEADS)
    if causal:
        scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhts,bshd->bthd", weights, v).reshape(b, t, d) @ p["wo"]

def block(p, x, causal):
    x = x + attention(p["attn"], layer_norm(x, p["ln1"]), causal)
    return x + jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["w1"] + p["b1"]) @ p["w2"]

def decoder(p, e):  # e: token embeddings [batch, T, D] -> next-token logits [batch, V]
    x = e + p["pos"]
    for blk in p["blocks"]:
        x = block(blk, x, causal=True)
    return layer_norm(x[:, -1], p["ln"]) @ p["unembed"]

def init_blocks(keys, n):
    normal = lambda shape, scale: jax.random.normal(next(keys), shape) * scale
    ln = lambda: {"g": jnp.ones(D), "b": jnp.zeros(D)}
    return [{"ln1": ln(), "ln2": ln(), "attn": {w: normal((D, D), D ** -0.5) for w in ("wq", "wk", "wv", "wo")},
             "w1": normal((D, 4 * D), D ** -0.5), "b1": jnp.zeros(4 * D), "w2": normal((4 * D, D), (4 * D) ** -0.5)}
            for _ in range(n)]

def train(model, params, x, y, steps=150, batch=64):
    opt = optax.adam(3e-3)
    state = opt.init(params)

    @jax.jit
    def step(params, state, x, y):
        def loss(p):
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model(p, x), y))
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    for i in range(steps):
        rows = slice((i * batch) % len(x), (i * batch) % len(x) + batch)
        params, state, value = step(params, state, x[rows], y[rows])
    return params, float(value)

keys = iter(jax.random.split(jax.random.key(0), 64))
params = {"embed": jax.random.normal(next(keys), (V, D)), "pos": jax.random.normal(next(keys), (T, D)) * 0.1,
          "blocks": init_blocks(keys, 2), "ln": {"g": jnp.ones(D), "b": jnp.zeros(D)},
          "unembed": jax.random.normal(next(keys), (D, V)) * D ** -0.5}
language_model = lambda p, tokens: decoder(p, p["embed"][tokens])
params, loss = train(language_model, params, tokens_train, next_train)
accuracy = float(jnp.mean(jnp.argmax(language_model(params, tokens_test), -1) == next_test))
print(f"loss {loss:.4f}, test accuracy {accuracy:.3f}")

# %% [markdown]
# Four maps for the predicted next token (the default `target`), each one
# call under `jit`: AttnLRP, CP-LRP, gradient × input, and random numbers
# (the reference a map must beat). AttnLRP and CP-LRP are in LXT's gradient
# form: relevance is the input times a modified gradient, so it sums to about
# the explained logit (`check=True` also returns ΣR and the logit; the
# biases, LayerNorm's shifts and the position embeddings keep the rest). Each
# token's relevance is the sum over its embedding.

# %%
e = params["embed"][tokens_test]
f = lambda e: decoder(params, e)
methods = {
    "AttnLRP": lambda f, x: gk.attribution.lrp(f, x, gk.attribution.ATTN_LRP),
    "CP-LRP": lambda f, x: gk.attribution.lrp(f, x, gk.attribution.CP_LRP),
    "gradient × input": gk.attribution.gradient_x_input,
    "random": lambda f, x: jax.random.normal(jax.random.key(1), x.shape),
}
relevance = {name: jax.jit(lambda x, m=m: m(f, x))(e) for name, m in methods.items()}
per_token = {name: np.asarray(r.sum(-1)) for name, r in relevance.items()}

print("logit explained:", np.round(np.asarray(jnp.max(f(e[:6]), -1)), 2))
for name in ("AttnLRP", "CP-LRP"):
    print(f"{name + ' ΣR:':16}", np.round(np.asarray(relevance[name][:6].sum((1, 2))), 2))

# %% [markdown]
# CP-LRP's ΣR is within 10% of the logit, AttnLRP's about half to nine tenths
# of it: biases, LayerNorm's shifts and the position embeddings keep some
# relevance under both, and under AttnLRP also the softmax, whose rule passes
# its gradient (the bias term of its linearisation is not handed on to the
# scores), as in LXT; CP-LRP sends nothing through the scores.
#
# The heatmaps: one row per sequence, each token coloured by its relevance
# (red for the predicted token, blue against it; each row scaled to its own
# largest value).

# %%
def show_tokens(tokens, maps, predicted):
    fig, axes = plt.subplots(len(maps), 1, figsize=(9, 2.0 * len(maps)))
    for ax, (name, m) in zip(axes, maps.items()):
        m = m / np.abs(m).max(axis=1, keepdims=True)
        ax.imshow(m, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto")
        for (i, j), t in np.ndenumerate(np.asarray(tokens)):
            ax.text(j, i, WORDS[t], ha="center", va="center", fontsize=9,
                    fontweight="bold" if t in (A, B) else "normal")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xticks([])
        ax.set_yticks(range(len(tokens)), [f"→ {WORDS[p]}" for p in predicted])
    plt.tight_layout()
    plt.show()

shown = np.arange(5)
predicted = np.asarray(jnp.argmax(f(e[shown]), -1))
show_tokens(tokens_test[shown], {name: m[shown] for name, m in per_token.items()}, predicted)

# %% [markdown]
# The ground truth, in numbers: of each map's absolute relevance on the 11
# context tokens, the share on the `A` and `B` tokens (which are about 30% of
# them, what a random map gets); and the share of the whole map on the final
# `?`.

# %%
is_ab = np.isin(np.asarray(tokens_test), [A, B])[:, :-1]
for name, m in per_token.items():
    context = np.abs(m[:, :-1])
    on_ab = (context * is_ab).sum() / context.sum()
    on_query = np.abs(m[:, -1]).sum() / np.abs(m).sum()
    print(f"{name:17} on A/B tokens {on_ab:.2f}   on '?' {on_query:.2f}")

# %% [markdown]
# AttnLRP and CP-LRP put most of the context's relevance on the `A` and `B`
# tokens, with opposite signs: the tokens that voted for the prediction red,
# those that voted against it blue, the fillers near 0. Gradient × input
# spreads more over the fillers and gives about half of everything to the
# final `?`, and its signs on `A` and `B` do not follow the vote.
#
# ## Faithfulness: remove what the map calls relevant
#
# `gk.attribution.perturbation_curve(f, e, r, patch=(1, None), steps=12)` cuts
# `e` into units of one token's whole embedding (`patch` gives a block size
# per axis after the batch, `None` for a whole axis), ranks them by their
# summed relevance, and sets them to the baseline (zeros) most relevant first
# and least relevant first, one token per step here. It returns the target
# logit divided by the unperturbed one along both orders, and the area
# between the two curves per example: the larger, the more faithful; about 0
# for a random order. All 26 perturbed batches go through the model in one
# compiled `vmap`.

# %%
curves = {name: gk.attribution.perturbation_curve(f, e, r, patch=(1, None), steps=T)
          for name, r in relevance.items()}

fig, ax = plt.subplots(figsize=(7, 4))
for (name, c), colour in zip(curves.items(), ["C3", "C1", "C0", "gray"]):
    ax.plot(c.fractions, c.most_relevant_first.mean(0), color=colour, label=name)
    ax.plot(c.fractions, c.least_relevant_first.mean(0), color=colour, ls="--")
ax.set_title("most relevant first (solid), least relevant first (dashed); mean of 256 sequences", fontsize=9)
ax.set_xlabel("share of tokens removed")
ax.set_ylabel("target logit / unperturbed")
ax.legend(fontsize=8)
plt.show()
for name, c in curves.items():
    print(f"{name:17} area {float(c.area.mean()):6.3f} ± {float(c.area.std() / np.sqrt(len(c.area))):.3f}")

# %% [markdown]
# Removing the tokens AttnLRP or CP-LRP rank first takes the logit to a third
# of its value once a third of the tokens are gone (a sixth at half), while
# removing their least relevant tokens first leaves it almost whole until the
# last few: the area between the curves is about eight times gradient ×
# input's, whose order is barely better than random.
#
# ## A vision transformer
#
# The same blocks, unmasked, over patches: 16×16 images in noise with one
# bright 4×4 square, whose quadrant is the class. Each 4×4 patch of pixels is
# one token (a reshape and a dense layer), mean-pooled before the head. LXT
# explains vision transformers with CP-LRP; its relevance lands on pixels.

# %%
S, P = 16, 4
QUADRANTS = ["top left", "top right", "bottom left", "bottom right"]

def make_images(n, seed):
    rng = np.random.default_rng(seed)
    images = rng.normal(0.0, 0.3, (n, S, S, 1)).astype(np.float32)
    labels = rng.integers(0, 4, n)
    masks = np.zeros((n, S, S), bool)
    for i, c in enumerate(labels):
        r, q = rng.integers(0, 5, 2) + 8 * np.array([c // 2, c % 2])
        masks[i, r:r + 4, q:q + 4] = True
    images[masks] += 1.0
    return jnp.asarray(images), jnp.asarray(labels), masks

def vit(p, images):
    b = images.shape[0]
    patches = images.reshape(b, S // P, P, S // P, P, 1).transpose(0, 1, 3, 2, 4, 5).reshape(b, -1, P * P)
    x = patches @ p["patch"] + p["pos"]
    for blk in p["blocks"]:
        x = block(blk, x, causal=False)
    return layer_norm(jnp.mean(x, axis=1), p["ln"]) @ p["head"]

x_train, y_train, _ = make_images(4096, seed=0)
x_test, y_test, masks_test = make_images(256, seed=1)
keys = iter(jax.random.split(jax.random.key(2), 64))
vit_params = {"patch": jax.random.normal(next(keys), (P * P, D)) * 0.25,
              "pos": jax.random.normal(next(keys), ((S // P) ** 2, D)) * 0.1,
              "blocks": init_blocks(keys, 2), "ln": {"g": jnp.ones(D), "b": jnp.zeros(D)},
              "head": jax.random.normal(next(keys), (D, 4)) * D ** -0.5}
vit_params, loss = train(vit, vit_params, x_train, y_train, steps=250)
accuracy = float(jnp.mean(jnp.argmax(vit(vit_params, x_test), -1) == y_test))
print(f"loss {loss:.4f}, test accuracy {accuracy:.3f}")

# %% [markdown]
# CP-LRP against gradient × input and random, on one image of each class;
# then the share of each map's absolute relevance on the square (16 of 256
# pixels: 0.06 for a map spread evenly) and the faithfulness areas, removing
# the 16 patches of 4×4 pixels (`patch=(4, 4, None)`).

# %%
g = lambda x: vit(vit_params, x)
vit_methods = {name: methods[name] for name in ("CP-LRP", "gradient × input", "random")}
vit_relevance = {name: jax.jit(lambda x, m=m: m(g, x))(x_test) for name, m in vit_methods.items()}

shown = [int(np.flatnonzero(np.asarray(y_test) == c)[0]) for c in range(4)]
fig, axes = plt.subplots(4, len(vit_relevance) + 1, figsize=(8, 8))
for row, i in enumerate(shown):
    axes[row, 0].imshow(x_test[i, ..., 0], cmap="gray")
    axes[row, 0].set_ylabel(QUADRANTS[int(y_test[i])])
    for col, (name, r) in enumerate(vit_relevance.items(), start=1):
        a = np.asarray(r[i, ..., 0])
        axes[row, col].imshow(a, cmap="RdBu_r", vmin=-np.abs(a).max(), vmax=np.abs(a).max())
        axes[0, col].set_title(name, fontsize=10)
axes[0, 0].set_title("image", fontsize=10)
for ax in axes.flat:
    ax.set_xticks([])
    ax.set_yticks([])
plt.tight_layout()
plt.show()

for name, r in vit_relevance.items():
    a = np.abs(np.asarray(r[..., 0]))
    c = gk.attribution.perturbation_curve(g, x_test, r, patch=(P, P, None), steps=16)
    print(f"{name:17} on the square {(a * masks_test).sum() / a.sum():.2f}   area {float(c.area.mean()):.3f}")

# %% [markdown]
# Here the two are about equally faithful (areas near 0.11 against random's
# 0.03) and both trace the square's edges with both signs: on pixels, the
# relevance inside a patch follows the patch embedding's learned filter. A
# tiny ViT trained for seconds on a task this easy is not where the rules
# part ways; the decoder above is.
