"""A NaN in step 301 of a jitted training run: caught by ``gk.guard``, explained, fixed.

    python examples/nan_guard.py

A small classifier trains on batches of 64 from a data loader that pads the
last, partial batch of the epoch with empty rows (all-zero labels, masked
out). The loss masks the padding with ``jnp.where``, so the loss stays finite,
but ``log`` of the padded rows' zero probability makes the gradient NaN: the
"where trap". Steps 1 to 300 are fine; step 301 is the first padded batch.

``gk.guard`` replaces ``jax.value_and_grad`` inside the jitted step, and the
step is called through ``guarded.wrap``. It costs one fused finiteness check
per step; when the check fails it audits exactly that step's inputs and
raises ``gk.NonFiniteGradientError`` with the report: the primitive, the
source line, the step, the elements and a fix, re-run and checked against
finite differences.
The fix (``gk.tables.SAFE``, no change to the loss) is applied and training
runs to the end.
"""

import jax
import jax.numpy as jnp
import optax

import gradkit as gk

BATCH, FULL_BATCHES, CLASSES = 64, 300, 3


def data(key):
    """One epoch's worth of examples: 300 full batches and a partial one of 40."""
    n = BATCH * FULL_BATCHES + 40
    x = jax.random.normal(key, (n, 2))
    labels = (x[:, 0] > 0).astype(jnp.int32) + (x[:, 1] > 0).astype(jnp.int32)
    return x, jax.nn.one_hot(labels, CLASSES)


def batches(x, y):
    """Batches of 64; the last one padded with zero rows and a mask (a common loader)."""
    for start in range(0, x.shape[0], BATCH):
        xb, yb = x[start:start + BATCH], y[start:start + BATCH]
        pad = BATCH - xb.shape[0]
        mask = jnp.arange(BATCH) < BATCH - pad
        yield jnp.pad(xb, ((0, pad), (0, 0))), jnp.pad(yb, ((0, pad), (0, 0))), mask


def loss(params, x, labels, mask):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    p = jax.nn.softmax(h @ params["w2"] + params["b2"], axis=-1)
    p_label = jnp.sum(p * labels, axis=-1)  # 0 on a padded row: its labels are all zero
    per_example = jnp.where(mask, -jnp.log(p_label), 0.0)  # masked, but log(0)'s derivative is still inf
    return jnp.sum(per_example) / jnp.sum(mask)


def init(key):
    k1, k2 = jax.random.split(key)
    return {"w1": jax.random.normal(k1, (2, 16)) * 0.5, "b1": jnp.zeros(16),
            "w2": jax.random.normal(k2, (16, CLASSES)) * 0.5, "b2": jnp.zeros(CLASSES)}


def train(guarded, epochs=1):
    """Trains with ``guarded`` (a ``gk.guard``) in the jitted step; returns (params, steps run, last loss)."""
    opt = optax.adam(1e-2)

    @guarded.wrap  # a bad step raises gk.NonFiniteGradientError; the reports number the steps
    @jax.jit
    def step(params, state, x, labels, mask):
        value, grads = guarded(params, x, labels, mask)  # where jax.value_and_grad(loss) was
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    x, y = data(jax.random.key(1))
    params = init(jax.random.key(0))
    state = opt.init(params)
    n, value = 0, float("nan")
    for _ in range(epochs):
        for xb, yb, mb in batches(x, y):
            n += 1
            params, state, value = step(params, state, xb, yb, mb)
            value = float(value)
    return params, n, value


def accuracy(params):
    x, y = data(jax.random.key(2))
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return float(jnp.mean(jnp.argmax(h @ params["w2"] + params["b2"], -1) == jnp.argmax(y, -1)))


def main():
    print("1. plain autodiff, the step guarded with gk.guard(loss)")
    guarded = gk.guard(loss)
    try:
        train(guarded)
        raise SystemExit("expected the padded batch to break the gradient")
    except gk.NonFiniteGradientError as e:
        report = e.reports[0]
        print(report)
    finding = report.audit.findings[0]
    assert finding.op == "log" and finding.root.elements, "the report names log and the rows"
    assert report.call == FULL_BATCHES + 1, "the first padded batch"

    print("\n2. the suggested fix, no change to the loss: gk.override(loss, gk.tables.SAFE)")
    fixed = gk.guard(gk.override(loss, gk.tables.SAFE))
    params, steps, value = train(fixed, epochs=2)
    assert not fixed.reports
    print(f"   {steps} steps, no non-finite gradient; final loss {value:.4f}, accuracy {accuracy(params):.3f}")


if __name__ == "__main__":
    main()
