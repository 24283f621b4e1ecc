"""A small Flax linen classifier whose gradient is NaN, for ``gradkit audit`` from a terminal.

An attention block masks the scores of padding tokens with ``-inf`` before
``jax.nn.softmax`` (the most common way to write an attention mask), and the
loss masks padded examples out. Both are correct in the forward pass; but a
padded example has no token left to attend to, so its softmax row is
``softmax([-inf, …, -inf])`` = NaN, and the ``jnp.where`` that drops it from
the loss does not stop the NaN from reaching the parameters' gradient
(``0 × NaN`` is NaN in the backward pass). Audit it, with the parameters built
by ``make_inputs``::

    gradkit audit examples/flax_attention.py:loss --args-from examples/flax_attention.py:make_inputs

``make_inputs(key)`` returns the tuple of ``loss``'s inputs — the parameters
(a pytree) first — from a ``jax.random.key`` that ``gradkit audit`` makes from
``--seed``. Needs ``flax`` (``pip install flax``).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

BATCH, TOKENS, IN_FEATURES = 4, 6, 8
LENGTHS = (6, 4, 2, 0)  # tokens per example; the last example is all padding (a short final batch)


class MaskedSelfAttention(nn.Module):
    """Single-head self-attention; padding tokens are masked out as keys with -inf."""

    features: int

    @nn.compact
    def __call__(self, x, token_mask):
        q = nn.Dense(self.features, name="query")(x)
        k = nn.Dense(self.features, name="key")(x)
        v = nn.Dense(self.features, name="value")(x)
        scores = jnp.einsum("btf,bsf->bts", q, k) / jnp.sqrt(self.features).astype(x.dtype)
        scores = jnp.where(token_mask[:, None, :], scores, -jnp.inf)  # padding keys: -inf
        weights = jax.nn.softmax(scores, axis=-1)  # an example with no valid key: a row of NaN
        return nn.Dense(self.features, name="out")(jnp.einsum("bts,bsf->btf", weights, v))


class Classifier(nn.Module):
    """Embed, one pre-norm attention block, mean over the valid tokens, a linear head."""

    features: int = 16
    classes: int = 3

    @nn.compact
    def __call__(self, x, token_mask):
        h = nn.Dense(self.features, name="embed")(x)
        h = h + MaskedSelfAttention(self.features, name="attention")(nn.LayerNorm(name="norm")(h), token_mask)
        m = token_mask[..., None].astype(h.dtype)
        pooled = jnp.sum(h * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        return nn.Dense(self.classes, name="head")(pooled)


MODEL = Classifier()


def loss(params, x, token_mask, labels):
    """Mean cross-entropy over the examples that have at least one token; padded examples are masked out."""
    logits = MODEL.apply(params, x, token_mask)
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=-1)[:, 0]
    valid = jnp.any(token_mask, axis=-1)
    return jnp.sum(jnp.where(valid, nll, 0.0)) / jnp.maximum(jnp.sum(valid), 1)


def make_inputs(key):
    """``loss``'s inputs: (params, x, token_mask, labels), from one PRNG key (``gradkit audit --seed``)."""
    k_x, k_labels, k_init = jax.random.split(key, 3)
    x = jax.random.normal(k_x, (BATCH, TOKENS, IN_FEATURES), jnp.float32)
    token_mask = jnp.arange(TOKENS)[None, :] < jnp.array(LENGTHS)[:, None]
    labels = jax.random.randint(k_labels, (BATCH,), 0, MODEL.classes)
    params = MODEL.init(k_init, x, token_mask)
    return params, x, token_mask, labels


if __name__ == "__main__":
    import gradkit as gk

    print(gk.audit(loss, *make_inputs(jax.random.key(0))))
