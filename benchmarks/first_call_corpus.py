"""A corpus of real programs for the first-call benchmark (``benchmarks/first_call.py``).

Each entry builds a scalar loss and its arguments; the benchmark compares the
first ``jax.jit(jax.grad(loss))`` call (trace + lower + compile) of
``gk.override(loss, SAFE | STABLE)`` against the plain program. Flax, Equinox
and optax models use those libraries (installed with gradkit's test extras);
the diffrax, numpyro and jax-md patterns are written in plain JAX (those
packages are not dependencies): the same operations those libraries emit —
an RK4/Dopri5 step in a scan, a backsolve adjoint as a ``custom_vjp``,
log densities of the usual distributions, pairwise displacements and norms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Program(NamedTuple):
    name: str
    family: str  # flax, equinox, optax, diffrax-pattern, numpyro-pattern, jax-md-pattern, jax
    build: Callable[[], tuple[Callable[..., Any], tuple[Any, ...]]]  # -> (loss, args); grad w.r.t. args[0]


def _key(i: int) -> Any:
    return jax.random.key(i)


def _normal(i: int, shape: tuple[int, ...], scale: float = 1.0) -> Any:
    return jax.random.normal(_key(i), shape, jnp.float32) * scale


# --------------------------------------------------------------------------- flax (linen)


def _flax(module: Any, x: Any, loss_of: Callable[[Any, Any], Any], **init_kw: Any) -> tuple[Any, tuple[Any, ...]]:
    variables = module.init({"params": _key(0), "dropout": _key(1)}, x, **init_kw)
    params = variables["params"]
    rest = {k: v for k, v in variables.items() if k != "params"}

    def loss(params, x):
        out = module.apply({"params": params, **rest}, x, **init_kw)
        return loss_of(out, x)

    return loss, (params, x)


def flax_mlp() -> Any:
    import flax.linen as nn

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for w in (128, 128):
                x = nn.relu(nn.Dense(w)(x))
            return nn.Dense(10)(x)

    labels = jnp.arange(32) % 10
    return _flax(MLP(), _normal(2, (32, 64)),
                 lambda logits, _: -jnp.mean(jnp.take_along_axis(nn.log_softmax(logits), labels[:, None], 1)))


def flax_cnn() -> Any:
    import flax.linen as nn

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.relu(nn.Conv(16, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2))
            x = nn.relu(nn.Conv(32, (3, 3))(x))
            x = nn.avg_pool(x, (2, 2), (2, 2)).reshape(x.shape[0] // 1, -1)
            return nn.Dense(10)(x)

    return _flax(CNN(), _normal(3, (8, 16, 16, 1)), lambda logits, _: jnp.mean(nn.logsumexp(logits, -1) - logits[:, 0]))


def flax_transformer() -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.LayerNorm()(x)
            x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h)
            h = nn.LayerNorm()(x)
            return x + nn.Dense(64)(nn.gelu(nn.Dense(256)(h)))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for _ in range(2):
                x = Block()(x)
            return x

    return _flax(Model(), _normal(4, (2, 16, 64)), lambda y, _: jnp.mean(y ** 2))


def flax_lstm() -> Any:
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.RNN(nn.OptimizedLSTMCell(64))(x)

    return _flax(Model(), _normal(5, (4, 32, 16)), lambda y, _: jnp.mean(y[:, -1] ** 2))


def flax_gru() -> Any:
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(1)(nn.RNN(nn.GRUCell(48))(x)[:, -1])

    return _flax(Model(), _normal(6, (4, 32, 8)), lambda y, _: jnp.mean(nn.softplus(y)))


def flax_batchnorm_dropout() -> Any:
    import flax.linen as nn

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(128)(x)
            x = nn.BatchNorm(use_running_average=True)(x)
            x = nn.Dropout(0.1, deterministic=True)(nn.swish(x))
            return nn.Dense(1)(x)[:, 0]

    y = (jnp.arange(32) % 2).astype(jnp.float32)
    return _flax(Model(), _normal(7, (32, 20)),
                 lambda z, _: jnp.mean(jnp.maximum(z, 0) - z * y + jnp.log1p(jnp.exp(-jnp.abs(z)))))


def flax_vae() -> Any:
    import flax.linen as nn

    class VAE(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.relu(nn.Dense(128)(x))
            mu, logvar = nn.Dense(8)(h), nn.Dense(8)(h)
            z = mu + jnp.exp(0.5 * logvar) * jax.random.normal(_key(9), mu.shape)
            logits = nn.Dense(x.shape[-1])(nn.relu(nn.Dense(128)(z)))
            rec = jnp.sum(jnp.maximum(logits, 0) - logits * x + jnp.log1p(jnp.exp(-jnp.abs(logits))), -1)
            kl = -0.5 * jnp.sum(1 + logvar - mu ** 2 - jnp.exp(logvar), -1)
            return jnp.mean(rec + kl)

    x = (jax.random.uniform(_key(8), (32, 64)) > 0.5).astype(jnp.float32)
    return _flax(VAE(), x, lambda out, _: out)


def flax_gpt() -> Any:
    import flax.linen as nn

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, 32)(tokens)
            mask = nn.make_causal_mask(tokens)
            for _ in range(2):
                h = nn.LayerNorm()(x)
                x = x + nn.SelfAttention(num_heads=2)(h, mask=mask)
                x = x + nn.Dense(32)(nn.gelu(nn.Dense(128)(nn.LayerNorm()(x))))
            return nn.Dense(64)(x)

    tokens = jnp.arange(2 * 16).reshape(2, 16) % 64
    model = GPT()
    params = model.init(_key(0), tokens)["params"]

    def loss(params, tokens):
        logits = model.apply({"params": params}, tokens)
        logp = jax.nn.log_softmax(logits[:, :-1])
        return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], -1))

    return loss, (params, tokens)


def flax_nnx_mlp() -> Any:
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.l1, self.l2 = nnx.Linear(32, 64, rngs=rngs), nnx.Linear(64, 1, rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.tanh(self.l1(x)))[:, 0]

    graphdef, state = nnx.split(MLP(nnx.Rngs(0)))
    x, y = _normal(10, (64, 32)), _normal(11, (64,))

    def loss(state, x):
        return jnp.mean(optax_huber(nnx.merge(graphdef, state)(x) - y))

    return loss, (state, x)


# --------------------------------------------------------------------------- equinox


def _eqx(model: Any, loss_of: Callable[[Any], Any]) -> tuple[Any, tuple[Any, ...]]:
    import equinox as eqx

    params, static = eqx.partition(model, eqx.is_inexact_array)

    def loss(params, _):
        return loss_of(eqx.combine(params, static))

    return loss, (params, jnp.zeros(()))


def eqx_mlp() -> Any:
    import equinox as eqx

    x = _normal(12, (64, 16))
    model = eqx.nn.MLP(16, 1, 64, 3, activation=jax.nn.softplus, key=_key(13))
    return _eqx(model, lambda m: jnp.mean(jax.vmap(m)(x) ** 2))


def eqx_cnn() -> Any:
    import equinox as eqx

    x = _normal(14, (8, 1, 16, 16))
    layers = [eqx.nn.Conv2d(1, 8, 3, key=_key(15)), eqx.nn.Conv2d(8, 8, 3, key=_key(16))]

    def f(ls):
        def one(img):
            for layer in ls:
                img = jax.nn.relu(layer(img))
            return jnp.max(img)
        return jnp.mean(jax.vmap(one)(x))

    return _eqx(layers, f)


def eqx_gru_scan() -> Any:
    import equinox as eqx

    xs = _normal(17, (40, 8))
    cell = eqx.nn.GRUCell(8, 32, key=_key(18))

    def f(c):
        h, _ = jax.lax.scan(lambda h, x: (c(x, h), None), jnp.zeros(32), xs)
        return jnp.sum(jnp.tanh(h) ** 2)

    return _eqx(cell, f)


def eqx_attention() -> Any:
    import equinox as eqx

    x = _normal(19, (16, 32))
    model = (eqx.nn.LayerNorm(32), eqx.nn.MultiheadAttention(4, 32, key=_key(20)), eqx.nn.Linear(32, 32, key=_key(21)))

    def f(m):
        ln, att, lin = m
        h = jax.vmap(ln)(x)
        h = x + att(h, h, h)
        return jnp.mean(jax.vmap(lin)(jax.nn.gelu(h)) ** 2)

    return _eqx(model, f)


def eqx_neural_ode() -> Any:
    import equinox as eqx

    field = eqx.nn.MLP(4, 4, 32, 2, activation=jax.nn.tanh, key=_key(22))
    y0 = _normal(23, (4,))

    def f(fld):
        def step(y, _):  # RK4, as diffrax.Tsit5 / RK4 with a constant step
            dt = 0.05
            k1 = fld(y)
            k2 = fld(y + 0.5 * dt * k1)
            k3 = fld(y + 0.5 * dt * k2)
            k4 = fld(y + dt * k3)
            return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4), None
        y, _ = jax.lax.scan(step, y0, None, length=40)
        return jnp.sum(y ** 2)

    return _eqx(field, f)


# --------------------------------------------------------------------------- optax


def optax_huber(x: Any) -> Any:
    import optax

    return optax.huber_loss(x, delta=1.0)


def _mlp_params(sizes: tuple[int, ...], seed: int) -> list[dict[str, Any]]:
    return [{"w": _normal(seed + i, (a, b), 1 / np.sqrt(a)), "b": jnp.zeros(b)}
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))]


def _mlp(params: Any, x: Any, act: Callable[[Any], Any] = jax.nn.relu) -> Any:
    for layer in params[:-1]:
        x = act(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def optax_adam_step() -> Any:
    """A whole training step (value_and_grad + clip_by_global_norm + adamw update), as one program."""
    import optax

    params = _mlp_params((32, 128, 128, 10), 30)
    x, labels = _normal(31, (64, 32)), jnp.arange(64) % 10
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = opt.init(params)

    def loss(params, x):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(_mlp(params, x), labels))

    def step_loss(params, x):  # the loss after one optimizer step: grad inside, differentiated again
        g = jax.grad(loss)(params, x)
        updates, _ = opt.update(g, state, params)
        return loss(optax.apply_updates(params, updates), x)

    return step_loss, (params, x)


def optax_losses() -> Any:
    import optax

    params = _mlp_params((16, 64, 1), 32)
    x, y = _normal(33, (64, 16)), (jnp.arange(64) % 2).astype(jnp.float32)

    def loss(params, x):
        z = _mlp(params, x, jax.nn.silu)[:, 0]
        l2 = sum(optax.l2_loss(p).sum() for p in jax.tree_util.tree_leaves(params))
        return jnp.mean(optax.sigmoid_binary_cross_entropy(z, y)) + 1e-4 * l2

    return loss, (params, x)


def optax_cosine() -> Any:
    import optax

    params = _mlp_params((16, 64, 16), 34)
    x, t = _normal(35, (64, 16)), _normal(36, (64, 16))

    def loss(params, x):
        return jnp.mean(optax.cosine_distance(_mlp(params, x, jnp.tanh), t))

    return loss, (params, x)


# --------------------------------------------------------------------------- diffrax patterns (plain JAX)


def _field(params: Any, y: Any) -> Any:
    return jnp.tanh(y @ params["w1"]) @ params["w2"]


def _field_params(seed: int, d: int = 4, h: int = 32) -> dict[str, Any]:
    return {"w1": _normal(seed, (d, h), 0.5), "w2": _normal(seed + 1, (h, d), 0.5)}


def diffrax_rk4() -> Any:
    y0 = _normal(40, (8, 4))

    def loss(params, y0):
        def step(y, _):
            dt = 0.05
            k1 = _field(params, y)
            k2 = _field(params, y + 0.5 * dt * k1)
            k3 = _field(params, y + 0.5 * dt * k2)
            k4 = _field(params, y + dt * k3)
            return y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4), None
        y, _ = jax.lax.scan(step, y0, None, length=50)
        return jnp.mean(y ** 2)

    return loss, (_field_params(41), y0)


def diffrax_dopri5_adaptive() -> Any:
    """Dopri5 with an RMS error norm and a PI step-size controller (diffrax's default), a fixed step count."""
    y0 = _normal(42, (4,))
    a = [[1 / 5], [3 / 40, 9 / 40], [44 / 45, -56 / 15, 32 / 9],
         [19372 / 6561, -25360 / 2187, 64448 / 6561, -212 / 729],
         [9017 / 3168, -355 / 33, 46732 / 5247, 49 / 176, -5103 / 18656]]
    b = [35 / 384, 0, 500 / 1113, 125 / 192, -2187 / 6784, 11 / 84]
    e = [71 / 57600, 0, -71 / 16695, 71 / 1920, -17253 / 339200, 22 / 525]

    def loss(params, y0):
        def step(carry, _):
            y, dt = carry
            ks = [_field(params, y)]
            for row in a:
                ks.append(_field(params, y + dt * sum(c * k for c, k in zip(row, ks))))
            y_new = y + dt * sum(c * k for c, k in zip(b, ks))
            err = dt * sum(c * k for c, k in zip(e, ks))
            scale = 1e-6 + 1e-3 * jnp.maximum(jnp.abs(y), jnp.abs(y_new))
            norm = jnp.sqrt(jnp.mean((err / scale) ** 2))
            factor = jnp.clip(0.9 * norm ** (-1 / 5), 0.2, 10.0)
            accept = norm <= 1.0
            return (jnp.where(accept, y_new, y), dt * jax.lax.stop_gradient(factor)), None
        (y, _), _ = jax.lax.scan(step, (y0, jnp.float32(0.05)), None, length=30)
        return jnp.sum(y ** 2)

    return loss, (_field_params(43), y0)


def diffrax_backsolve() -> Any:
    """BacksolveAdjoint: a custom_vjp whose backward pass integrates the adjoint ODE backwards."""
    n, dt = 30, 0.05

    def euler(params, y):
        return jax.lax.fori_loop(0, n, lambda _, y: y + dt * _field(params, y), y)

    @jax.custom_vjp
    def solve(params, y0):
        return euler(params, y0)

    def fwd(params, y0):
        y1 = euler(params, y0)
        return y1, (params, y1)

    def bwd(res, g):
        params, y1 = res

        def back(_, carry):
            y, a, gp = carry
            f, vjp = jax.vjp(_field, params, y)
            dp, dy = vjp(a)
            return y - dt * f, a + dt * dy, jax.tree_util.tree_map(lambda u, v: u + dt * v, gp, dp)

        zero = jax.tree_util.tree_map(jnp.zeros_like, params)
        _, a0, gp = jax.lax.fori_loop(0, n, back, (y1, g, zero))
        return gp, a0

    solve.defvjp(fwd, bwd)
    y0 = _normal(44, (4,))

    def loss(params, y0):
        return jnp.sum(jnp.log1p(solve(params, y0) ** 2))

    return loss, (_field_params(45), y0)


def diffrax_sde() -> Any:
    """Euler-Maruyama with Brownian increments and a state-dependent diffusion."""
    y0 = _normal(46, (16,))
    dw = _normal(47, (60, 16), np.sqrt(0.01))

    def loss(params, y0):
        def step(y, w):
            drift = -params["theta"] * y + jnp.sin(y)
            sigma = jnp.sqrt(params["s"] ** 2 + 0.1 * y ** 2)
            return y + 0.01 * drift + sigma * w, None
        y, _ = jax.lax.scan(step, y0, dw)
        return jnp.mean(y ** 2)

    return loss, ({"theta": jnp.float32(0.5), "s": jnp.float32(0.3)}, y0)


# --------------------------------------------------------------------------- numpyro patterns (plain JAX)


def _normal_lp(x: Any, loc: Any, scale: Any) -> Any:
    return -0.5 * ((x - loc) / scale) ** 2 - jnp.log(scale) - 0.5 * np.log(2 * np.pi)


def _half_cauchy_lp(x: Any, scale: Any) -> Any:
    return np.log(2 / np.pi) - jnp.log(scale) - jnp.log1p((x / scale) ** 2)


def numpyro_eight_schools() -> Any:
    y = jnp.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
    sigma = jnp.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])

    def neg_log_density(z, _):  # non-centred, tau through exp (numpyro's unconstrained transform)
        mu, log_tau, theta_t = z["mu"], z["log_tau"], z["theta"]
        tau = jnp.exp(log_tau)
        theta = mu + tau * theta_t
        lp = _normal_lp(mu, 0.0, 5.0) + _half_cauchy_lp(tau, 5.0) + log_tau
        lp = lp + jnp.sum(_normal_lp(theta_t, 0.0, 1.0)) + jnp.sum(_normal_lp(y, theta, sigma))
        return -lp

    return neg_log_density, ({"mu": jnp.float32(1.0), "log_tau": jnp.float32(0.5), "theta": _normal(50, (8,))},
                             jnp.zeros(()))


def numpyro_logistic_regression() -> Any:
    x = _normal(51, (200, 10))
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype(jnp.float32)

    def neg_log_density(w, _):
        logits = x @ w
        ll = jnp.sum(y * jax.nn.log_sigmoid(logits) + (1 - y) * jax.nn.log_sigmoid(-logits))
        return -(ll + jnp.sum(_normal_lp(w, 0.0, 1.0)))

    return neg_log_density, (_normal(52, (10,), 0.1), jnp.zeros(()))


def numpyro_gmm() -> Any:
    x = _normal(53, (256,))

    def neg_log_density(z, _):
        w = jax.nn.softmax(z["logits"])
        comp = _normal_lp(x[:, None], z["locs"][None], jnp.exp(z["log_scales"])[None])
        return -jnp.sum(jax.scipy.special.logsumexp(comp + jnp.log(w)[None], axis=-1))

    return neg_log_density, ({"logits": jnp.zeros(3), "locs": jnp.array([-1.0, 0.0, 1.0]),
                              "log_scales": jnp.zeros(3)}, jnp.zeros(()))


def numpyro_poisson_hierarchical() -> Any:
    counts = jnp.asarray(np.random.default_rng(0).poisson(3.0, (8, 20)), jnp.float32)

    def neg_log_density(z, _):
        rate = jnp.exp(z["mu"] + jnp.exp(z["log_sd"]) * z["eta"])[:, None]
        ll = jnp.sum(counts * jnp.log(rate) - rate - jax.scipy.special.gammaln(counts + 1))
        prior = jnp.sum(_normal_lp(z["eta"], 0.0, 1.0)) + _normal_lp(z["mu"], 0.0, 2.0) + z["log_sd"]
        return -(ll + prior)

    return neg_log_density, ({"mu": jnp.float32(1.0), "log_sd": jnp.float32(-1.0), "eta": _normal(54, (8,))},
                             jnp.zeros(()))


def numpyro_hmc_energy() -> Any:
    """The Hamiltonian after a leapfrog trajectory (grad of the potential inside, differentiated again)."""
    x = _normal(55, (50, 4))
    y = x @ jnp.array([1.0, -1.0, 0.5, 0.0]) + 0.1

    def potential(q):
        resid = y - x @ q[:4]
        scale = jnp.exp(q[4])
        return jnp.sum(0.5 * (resid / scale) ** 2 + jnp.log(scale)) + 0.5 * jnp.sum(q ** 2)

    def energy(q0, p0):
        def leap(carry, _):
            q, p = carry
            p = p - 0.005 * jax.grad(potential)(q)
            q = q + 0.01 * p
            return (q, p - 0.005 * jax.grad(potential)(q)), None
        (q, p), _ = jax.lax.scan(leap, (q0, p0), None, length=10)
        return potential(q) + 0.5 * jnp.sum(p ** 2)

    return energy, (jnp.zeros(5), _normal(56, (5,)))


def numpyro_gp() -> Any:
    x = jnp.linspace(0.0, 5.0, 40)
    y = jnp.sin(x)

    def neg_marginal(z, _):
        amp, ls, noise = jnp.exp(z[0]), jnp.exp(z[1]), jnp.exp(z[2])
        d2 = (x[:, None] - x[None]) ** 2
        k = amp * jnp.exp(-0.5 * d2 / ls ** 2) + (noise + 1e-6) * jnp.eye(40)
        chol = jnp.linalg.cholesky(k)
        alpha = jax.scipy.linalg.cho_solve((chol, True), y)
        return 0.5 * y @ alpha + jnp.sum(jnp.log(jnp.diag(chol)))

    return neg_marginal, (jnp.zeros(3), jnp.zeros(()))


# --------------------------------------------------------------------------- jax-md patterns (plain JAX)


def _displacement(r: Any, box: float | None = None) -> Any:
    dr = r[:, None] - r[None]
    if box is not None:
        dr = dr - box * jnp.round(dr / box)  # periodic_displacement
    return dr


def jaxmd_lennard_jones() -> Any:
    r = jnp.stack(jnp.meshgrid(*[jnp.arange(4.0)] * 3), -1).reshape(-1, 3) * 1.2 + _normal(60, (64, 3), 0.05)

    def energy(r, _):
        d = jnp.linalg.norm(_displacement(r), axis=-1)  # 0 on the diagonal: sqrt' is inf there
        mask = 1.0 - jnp.eye(r.shape[0])
        inv = jnp.where(mask > 0, 1.0 / jnp.where(mask > 0, d, 1.0), 0.0)
        return 0.5 * jnp.sum(mask * 4.0 * (inv ** 12 - inv ** 6))

    return energy, (r, jnp.zeros(()))


def jaxmd_soft_sphere_periodic() -> Any:
    box = 6.0
    r = jax.random.uniform(_key(61), (64, 3)) * box

    def energy(r, _):
        d2 = jnp.sum(_displacement(r, box) ** 2, -1)
        d = jnp.sqrt(d2)  # the diagonal is 0: sqrt' is inf, masked below
        overlap = jnp.where(d < 1.0, 1.0 - d, 0.0)
        return 0.5 * jnp.sum(overlap ** 2.5 / 2.5)

    return energy, (r, jnp.zeros(()))


def jaxmd_morse_neighbors() -> Any:
    r = jax.random.uniform(_key(62), (48, 3)) * 5.0

    def energy(r, _):
        d = jnp.linalg.norm(_displacement(r) + jnp.eye(48)[..., None] * 0.0, axis=-1)
        nbr = (d < 2.5) & (d > 0)
        e = (1.0 - jnp.exp(-2.0 * (d - 1.1))) ** 2 - 1.0
        return 0.5 * jnp.sum(jnp.where(nbr, e, 0.0))

    return energy, (r, jnp.zeros(()))


def jaxmd_nbody_scan() -> Any:
    r0 = _normal(63, (16, 3), 2.0)
    v0 = _normal(64, (16, 3), 0.1)

    def final_energy(r0, v0):
        def force(r):
            dr = _displacement(r)
            d = jnp.sqrt(jnp.sum(dr ** 2, -1) + 0.01)
            return -jnp.sum(dr / d[..., None] ** 3, axis=1)

        def step(carry, _):
            r, v = carry
            v = v + 0.005 * force(r)
            r = r + 0.01 * v
            return (r, v + 0.005 * force(r)), None

        (r, v), _ = jax.lax.scan(step, (r0, v0), None, length=40)
        return jnp.sum(v ** 2) + jnp.sum(jnp.linalg.norm(r, axis=-1))

    return final_energy, (r0, v0)


def jaxmd_bond_angle() -> Any:
    r = _normal(65, (20, 3))
    bonds = jnp.stack([jnp.arange(19), jnp.arange(1, 20)], -1)

    def energy(r, _):
        b = r[bonds[:, 1]] - r[bonds[:, 0]]
        length = jnp.linalg.norm(b, axis=-1)
        u = b / length[:, None]
        cos = jnp.clip(jnp.sum(u[:-1] * u[1:], -1), -1.0, 1.0)
        theta = jnp.arccos(cos)  # arccos' is inf at cos = +-1 (a straight chain)
        return jnp.sum((length - 1.0) ** 2) + jnp.sum((theta - 1.9) ** 2)

    return energy, (r, jnp.zeros(()))


# --------------------------------------------------------------------------- plain JAX


def jax_mlp() -> Any:
    params = _mlp_params((64, 256, 256, 256, 1), 70)
    x = _normal(71, (128, 64))

    def loss(params, x):
        return jnp.mean(jax.nn.softplus(_mlp(params, x, jax.nn.gelu)))

    return loss, (params, x)


def jax_scanned_lstm() -> Any:
    h = 64
    p = {"wx": _normal(72, (16, 4 * h), 0.1), "wh": _normal(73, (h, 4 * h), 0.1), "b": jnp.zeros(4 * h)}
    xs = _normal(74, (50, 16))

    def loss(p, xs):
        def cell(c, x):
            hh, cc = c
            i, f, g, o = jnp.split(x @ p["wx"] + hh @ p["wh"] + p["b"], 4)
            cc = jax.nn.sigmoid(f) * cc + jax.nn.sigmoid(i) * jnp.tanh(g)
            hh = jax.nn.sigmoid(o) * jnp.tanh(cc)
            return (hh, cc), hh
        _, hs = jax.lax.scan(cell, (jnp.zeros(h), jnp.zeros(h)), xs)
        return jnp.mean(hs ** 2)

    return loss, (p, xs)


def jax_cond_vmap() -> Any:
    w = _normal(75, (32,))
    xs = _normal(76, (128, 32))

    def loss(w, xs):
        def one(x):
            return jax.lax.cond(jnp.sum(x) > 0, lambda x: jnp.sum(jnp.sqrt(jnp.abs(x * w) + 1.0)),
                                lambda x: jnp.sum(jnp.log1p(jnp.square(x * w))), x)
        return jnp.mean(jax.vmap(one)(xs))

    return loss, (w, xs)


def jax_transformer_block() -> Any:
    d, seq = 64, 32
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d), "w2": (4 * d, d)}
    params = [{n: _normal(77 + 10 * k + i, s, 1 / np.sqrt(s[0])) for i, (n, s) in enumerate(shapes.items())}
              for k in range(2)]

    def ln(x):
        mu = jnp.mean(x, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(jnp.mean((x - mu) ** 2, -1, keepdims=True) + 1e-5)

    def loss(params, x):
        for p in params:
            h = ln(x)
            s = (h @ p["wq"]) @ (h @ p["wk"]).T / np.sqrt(d)
            s = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), s, -jnp.inf)
            x = x + jax.nn.softmax(s, -1) @ (h @ p["wv"]) @ p["wo"]
            x = x + jax.nn.gelu(ln(x) @ p["w1"]) @ p["w2"]
        return jnp.mean(x ** 2)

    return loss, (params, _normal(99, (seq, d)))


def jax_while_newton() -> Any:
    """A fixed-point solve by fori_loop (Newton on x = cos(a x)), differentiated through the iterations."""
    def loss(a, _):
        def body(_, x):
            f = x - jnp.cos(a * x)
            return x - f / (1.0 + a * jnp.sin(a * x))
        return jnp.sum(jax.lax.fori_loop(0, 20, body, jnp.ones_like(a)) ** 2)

    return loss, (jnp.linspace(0.5, 1.5, 64), jnp.zeros(()))


CORPUS: list[Program] = [
    Program("flax linen MLP, log_softmax CE", "flax", flax_mlp),
    Program("flax linen CNN", "flax", flax_cnn),
    Program("flax linen transformer, 2 blocks", "flax", flax_transformer),
    Program("flax linen LSTM (nn.RNN)", "flax", flax_lstm),
    Program("flax linen GRU (nn.RNN)", "flax", flax_gru),
    Program("flax linen BatchNorm + Dropout", "flax", flax_batchnorm_dropout),
    Program("flax linen VAE", "flax", flax_vae),
    Program("flax linen GPT, causal mask", "flax", flax_gpt),
    Program("flax nnx MLP, huber", "flax", flax_nnx_mlp),
    Program("equinox MLP (softplus)", "equinox", eqx_mlp),
    Program("equinox CNN, vmap", "equinox", eqx_cnn),
    Program("equinox GRU scan", "equinox", eqx_gru_scan),
    Program("equinox attention block", "equinox", eqx_attention),
    Program("equinox neural ODE, RK4 scan", "equinox", eqx_neural_ode),
    Program("optax clip+adamw step, CE", "optax", optax_adam_step),
    Program("optax sigmoid BCE + l2", "optax", optax_losses),
    Program("optax cosine distance", "optax", optax_cosine),
    Program("diffrax-pattern RK4 neural ODE", "diffrax-pattern", diffrax_rk4),
    Program("diffrax-pattern Dopri5 + PI control", "diffrax-pattern", diffrax_dopri5_adaptive),
    Program("diffrax-pattern BacksolveAdjoint", "diffrax-pattern", diffrax_backsolve),
    Program("diffrax-pattern Euler-Maruyama SDE", "diffrax-pattern", diffrax_sde),
    Program("numpyro-pattern eight schools", "numpyro-pattern", numpyro_eight_schools),
    Program("numpyro-pattern logistic regression", "numpyro-pattern", numpyro_logistic_regression),
    Program("numpyro-pattern Gaussian mixture", "numpyro-pattern", numpyro_gmm),
    Program("numpyro-pattern hierarchical Poisson", "numpyro-pattern", numpyro_poisson_hierarchical),
    Program("numpyro-pattern HMC trajectory energy", "numpyro-pattern", numpyro_hmc_energy),
    Program("numpyro-pattern GP marginal likelihood", "numpyro-pattern", numpyro_gp),
    Program("jax-md-pattern Lennard-Jones (norm)", "jax-md-pattern", jaxmd_lennard_jones),
    Program("jax-md-pattern soft sphere, periodic", "jax-md-pattern", jaxmd_soft_sphere_periodic),
    Program("jax-md-pattern Morse, neighbour mask", "jax-md-pattern", jaxmd_morse_neighbors),
    Program("jax-md-pattern n-body leapfrog scan", "jax-md-pattern", jaxmd_nbody_scan),
    Program("jax-md-pattern bonds + angles (arccos)", "jax-md-pattern", jaxmd_bond_angle),
    Program("MLP 3x256, gelu/softplus", "jax", jax_mlp),
    Program("scanned LSTM", "jax", jax_scanned_lstm),
    Program("cond under vmap", "jax", jax_cond_vmap),
    Program("transformer, 2 blocks, causal softmax", "jax", jax_transformer_block),
    Program("fori_loop Newton solve", "jax", jax_while_newton),
]

#: The programs ``--quick`` runs (CI): small, and each a different kind (SAFE masks, STABLE kernels, scan).
QUICK = ("jax-md-pattern Lennard-Jones (norm)", "scanned LSTM", "cond under vmap")
