"""gk.guard inside a jitted training step with the optimizer update fused in: the same trajectory, bit for bit.

XLA:CPU contracts a multiply and an add of one fused loop into a fused
multiply-add, and which pair it contracts depends on the code around them: an
operation the guard put between the gradients and the update (even an
identity ``select``) changed Adam's parameters in the last bits (up to 7.5e-9
after one step). In ``"raise"`` and ``"report"`` modes the guard's results
reach the update untouched (``select(ok, g, g)``, which XLA folds), so the
step compiles to the unguarded step plus the check: the same bits, step after
step. ``"skip"`` must zero the gradients of a bad step, so its ``select``
stays in the update's loop: the gradients are still ``jax.value_and_grad``'s,
but the fused update may round differently in the last bits (measured here).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from budget import covering

optax = pytest.importorskip("optax")


def make_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (6, 16), jnp.float32) / 3, "b1": jnp.zeros(16, jnp.float32),
            "w2": jax.random.normal(k2, (16, 4), jnp.float32) / 4}


def batch(n, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, 6), jnp.float32)
    y = jax.nn.one_hot(jax.random.randint(ky, (n,), 0, 4), 4, dtype=jnp.float32)
    return x, y


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * y, axis=-1))


def decayed_loss(params, x, y):
    """Weight decay in the loss: each gradient ends in an add that XLA fuses into the update's loop."""
    h = jax.nn.gelu(jax.nn.relu(x @ params["w1"] + params["b1"][None, :]) * 1.7)
    z = jax.nn.log_softmax(h @ params["w2"])
    return -jnp.mean(jnp.sum(z * y, -1)) + 1e-3 * sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(params))


OPTIMIZERS = {"adam": lambda: optax.adam(1e-3), "adamw": lambda: optax.adamw(1e-2),
              "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9)}


def trajectories(loss, opt, mode, n, steps=5):
    """Parameters, optimizer state and loss of each step, guarded and unguarded, update fused in one jit."""
    def make(vg):
        @jax.jit
        def step(params, state, x, y):
            value, grads = vg(params, x, y)
            updates, state = opt.update(grads, state, params)
            return optax.apply_updates(params, updates), state, value
        return step

    x, y = batch(n, seed=n)
    out = []
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int32 and float32
        for vg in (gk.guard(loss, on_nonfinite=mode), jax.value_and_grad(loss)):
            step, params, state, run = make(vg), make_params(n), opt.init(make_params(n)), []
            for _ in range(steps):
                params, state, value = step(params, state, x, y)
                run.append(jax.tree_util.tree_leaves((params, state, value)))
            out.append(run)
    return out


# a covering half in the default set (every value of every axis), all 24 in the slow set
@pytest.mark.parametrize("n,loss,opt,mode", covering([8, 64], [mlp_loss, decayed_loss], sorted(OPTIMIZERS),
                                                     ["raise", "report"]))
def test_fused_update_is_bit_for_bit_the_unguarded_step(loss, opt, mode, n):
    guarded, plain = trajectories(loss, OPTIMIZERS[opt](), mode, n)
    for step, (a, b) in enumerate(zip(guarded, plain)):
        for u, v in zip(a, b):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=f"step {step}")


@pytest.mark.parametrize("opt", sorted(OPTIMIZERS))
@pytest.mark.parametrize("loss", [mlp_loss, decayed_loss], ids=["mlp", "decayed"])
def test_skip_mode_fused_update_differs_at_most_in_the_last_bits(loss, opt):
    guarded, plain = trajectories(loss, OPTIMIZERS[opt](), "skip", 64)
    for a, b in zip(guarded, plain):
        for u, v in zip(a, b):
            u, v = np.asarray(u), np.asarray(v)
            if u.dtype == np.float32:  # measured over 5 steps: at most 6e-8 apart (102 ulps of an element near 0)
                np.testing.assert_allclose(u, v, rtol=1e-6, atol=1e-7)
            else:
                np.testing.assert_array_equal(u, v)


def test_the_check_runs_when_only_the_gradients_are_used():
    """Nothing reads the guard's flag once XLA folds select(ok, g, g): the callback must survive on its own."""
    def loss(w, x):
        return jnp.sum(jnp.where(w * x > 0, jnp.log(w * x), 0.0))

    w, x = jnp.ones(3), jnp.array([1.0, 0.0, 2.0])
    g = gk.guard(loss, on_nonfinite="report")
    jax.jit(lambda w, x: g(w, x)[1] * 2.0)(w, x).block_until_ready()
    assert g.bad_calls == 1 and g.reports[0].audit.findings[0].op == "log"
    g = gk.guard(loss, on_nonfinite="raise")
    with pytest.raises(g.step_errors, match="log"):
        jax.jit(lambda w, x: g(w, x)[1])(w, x).block_until_ready()
    g = gk.guard(loss, on_nonfinite="report")
    jax.jit(lambda w, x: g(w, x)[0])(w, x).block_until_ready()  # only the loss
    assert g.bad_calls == 1


def test_differentiating_through_the_guard_is_value_and_grads_derivative():
    def loss(w, x):
        return jnp.sum(jnp.sin(w * x) ** 2)

    w, x = jnp.array([0.3, -1.2, 2.0]), jnp.array([1.0, 0.5, -2.0])
    g = gk.guard(loss)
    ours = jax.jit(jax.jacfwd(lambda w: g(w, x)[1]))(w)
    ref = jax.jit(jax.jacfwd(lambda w: jax.grad(loss)(w, x)))(w)
    np.testing.assert_array_equal(ours, ref)
    ours = jax.jit(jax.grad(lambda w: jnp.sum(g(w, x)[1] ** 2)))(w)
    ref = jax.jit(jax.grad(lambda w: jnp.sum(jax.grad(loss)(w, x) ** 2)))(w)
    np.testing.assert_array_equal(ours, ref)
