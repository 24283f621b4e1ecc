"""gk.attribution.lrp against an independent NumPy float64 implementation of each rule's formula.

* every rule on an MLP and on a small conv net (conv, ReLU, max pool, average
  pool, dense; biases), each layer written as its matrix in NumPy, and the
  rules' formulas written out on those matrices;
* conservation where a rule promises it;
* every composite on the plain-JAX CNN (against NumPy), the same CNN as an
  unmodified Flax linen module (NHWC), Flax NNX module and Equinox CNN (vmapped; its AvgPool2d puts layout ops
  between the window sum and the division), an unmodified Equinox MLP;
* jit, vmap, the target forms, bad composites.
"""

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from budget import covering

A = gk.attribution
RNG = np.random.default_rng(0)


def stab(z, e):
    return z + e * np.where(z >= 0, 1.0, -1.0)


# --------------------------------------------------------------------------------------------------------------
# The reference: a network as a list of NumPy layers on flat single examples; LRP written out on matrices.
# --------------------------------------------------------------------------------------------------------------

def np_rule(name, **p):
    """R_in of a linear layer z = x @ M(W) + b (M: the weight -> matrix map), by the rule's formula."""
    e = p.get("eps", p.get("stabilizer", 1e-6))

    def rule(x, M, w, b, r):
        pos, neg = (lambda a: np.maximum(a, 0)), (lambda a: np.minimum(a, 0))
        xp, xn = pos(x), neg(x)
        if name == "epsilon":
            return x * ((r / stab(x @ M(w) + b, e)) @ M(w).T)
        if name == "zplus":
            c = r / stab(xp @ M(pos(w)) + pos(b) + xn @ M(neg(w)), e)
            return xp * (c @ M(pos(w)).T) + xn * (c @ M(neg(w)).T)
        if name == "alpha_beta":
            a, bt = p["alpha"], p["beta"]
            cp = r / stab(xp @ M(pos(w)) + pos(b) + xn @ M(neg(w)), e)
            cn = r / stab(xp @ M(neg(w)) + neg(b) + xn @ M(pos(w)), e)
            return (a * (xp * (cp @ M(pos(w)).T) + xn * (cp @ M(neg(w)).T))
                    - bt * (xp * (cn @ M(neg(w)).T) + xn * (cn @ M(pos(w)).T)))
        if name == "gamma":
            g = p["gamma"]
            wu, wd, bu, bd = w + g * pos(w), w + g * neg(w), b + g * pos(b), b + g * neg(b)
            z = x @ M(w) + b
            cp = np.where(z > 0, r, 0) / stab(xp @ M(wu) + bu + xn @ M(wd), e)
            cn = np.where(z < 0, r, 0) / stab(xp @ M(wd) + bd + xn @ M(wu), e)
            return (xp * (cp @ M(wu).T) + xn * (cp @ M(wd).T)) + (xp * (cn @ M(wd).T) + xn * (cn @ M(wu).T))
        if name == "flat":
            m = M(np.ones_like(w))
            return (r / stab(np.ones_like(x) @ m, e)) @ m.T
        if name == "w_square":
            m = M(w * w)
            return (r / stab(np.ones_like(x) @ m + b * b, e)) @ m.T
        if name == "zbox":
            lo, hi = np.full_like(x, p["low"]), np.full_like(x, p["high"])
            z = x @ M(w) + b - (lo @ M(pos(w)) + pos(b)) - (hi @ M(neg(w)) + neg(b))
            c = r / stab(z, e)
            return x * (c @ M(w).T) - lo * (c @ M(pos(w)).T) - hi * (c @ M(neg(w)).T)
        raise AssertionError(name)

    return rule


def conv_matrix(shape, pad=1):
    """w (O, C, kh, kw) -> the (C*H*W, O*H*W) matrix of a stride-1 'same' NCHW convolution, for one image."""
    c_in, h, wd = shape
    memo = {}

    def M(w):
        key = w.tobytes()
        if key not in memo:
            memo[key] = build(w)
        return memo[key]

    def build(w):
        o, c, kh, kw = w.shape
        m = np.zeros((c_in * h * wd, o * h * wd))
        for oo in range(o):
            for i in range(h):
                for j in range(wd):
                    for cc in range(c):
                        for a in range(kh):
                            for b in range(kw):
                                ii, jj = i + a - pad, j + b - pad
                                if 0 <= ii < h and 0 <= jj < wd:
                                    m[(cc * h + ii) * wd + jj, (oo * h + i) * wd + j] += w[oo, cc, a, b]
        return m

    return M


def pool_matrix(c, h, w, x=None):
    """The (C*H*W, C*H/2*W/2) matrix of 2x2 average pooling, or of max pooling at x (its argmax per window)."""
    m = np.zeros((c * h * w, c * (h // 2) * (w // 2)))
    for cc in range(c):
        for i in range(h // 2):
            for j in range(w // 2):
                out = (cc * (h // 2) + i) * (w // 2) + j
                ins = [(cc * h + 2 * i + a) * w + 2 * j + b for a in range(2) for b in range(2)]
                if x is None:
                    m[ins, out] = 0.25
                else:
                    m[ins[int(np.argmax(x[ins]))], out] = 1.0
    return m


def np_lrp(layers, x, cot, rules):
    """LRP of a NumPy network on one flat example; ``rules[i]`` for the i-th linear layer; ε=1e-6 Norm pooling."""
    acts, h = [], x
    for layer in layers:
        acts.append(h)
        kind = layer[0]
        if kind == "lin":
            _, M, w, b = layer
            h = h @ M(w) + b
        elif kind == "relu":
            h = np.maximum(h, 0)
        elif kind == "act":
            h = layer[1](h)
        elif kind == "avg":
            h = h @ layer[1]
        elif kind == "max":
            h = h @ layer[1](h)
    r, n_lin = cot, sum(1 for la in layers if la[0] == "lin")
    for layer, a in zip(reversed(layers), reversed(acts)):
        kind = layer[0]
        if kind == "lin":
            n_lin -= 1
            _, M, w, b = layer
            r = rules[n_lin](a, M, w, b, r)
        elif kind == "avg":
            r = a * ((r / stab(a @ layer[1], 1e-6)) @ layer[1].T)
        elif kind == "max":
            r = r @ layer[1](a).T
    return r


# --------------------------------------------------------------------------------------------------------------
# The models.
# --------------------------------------------------------------------------------------------------------------

MW = [RNG.normal(size=(6, 8)) / 2, RNG.normal(size=(8, 8)) / 2, RNG.normal(size=(8, 4)) / 2]
MB = [RNG.normal(size=8) / 4, RNG.normal(size=8) / 4, RNG.normal(size=4) / 4]
MX = RNG.normal(size=(3, 6))


def mlp(x, ws=MW, bs=MB):
    h = x
    for i, (w, b) in enumerate(zip(ws, bs)):
        h = h @ jnp.asarray(w, x.dtype) + jnp.asarray(b, x.dtype)[None]
        if i < len(ws) - 1:
            h = jax.nn.relu(h)
    return h


def np_mlp(ws=MW, bs=MB):
    layers = []
    for i, (w, b) in enumerate(zip(ws, bs)):
        layers.append(("lin", lambda w: w, w, b))
        if i < len(ws) - 1:
            layers.append(("relu",))
    return layers


# CNN on NCHW 2x8x8: conv 2->3 (+b), relu, max pool 2, conv 3->4 (+b), relu, avg pool 2, flatten, dense 16->5 (+b),
# relu, dense 5->3 (+b).
CW = {"c1": RNG.normal(size=(3, 2, 3, 3)) / 2, "b1": RNG.normal(size=3) / 4,
      "c2": RNG.normal(size=(4, 3, 3, 3)) / 2, "b2": RNG.normal(size=4) / 4,
      "d1": RNG.normal(size=(16, 5)) / 2, "e1": RNG.normal(size=5) / 4,
      "d2": RNG.normal(size=(5, 3)) / 2, "e2": RNG.normal(size=3) / 4}
CX = RNG.normal(size=(2, 2, 8, 8))


def jax_cnn(x):
    p = {k: jnp.asarray(v, x.dtype) for k, v in CW.items()}

    def conv(h, w, b):
        y = jax.lax.conv_general_dilated(h, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
        return y + b[None, :, None, None]

    h = jax.nn.relu(conv(x, p["c1"], p["b1"]))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    h = jax.nn.relu(conv(h, p["c2"], p["b2"]))
    h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4.0
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ p["d1"] + p["e1"][None])
    return h @ p["d2"] + p["e2"][None]


def np_cnn():
    return [("lin", conv_matrix((2, 8, 8)), CW["c1"], np.repeat(CW["b1"], 64)), ("relu",),
            ("max", lambda h: pool_matrix(3, 8, 8, h)),
            ("lin", conv_matrix((3, 4, 4)), CW["c2"], np.repeat(CW["b2"], 16)), ("relu",),
            ("avg", pool_matrix(4, 4, 4)),
            ("lin", lambda w: w, CW["d1"], CW["e1"]), ("relu",),
            ("lin", lambda w: w, CW["d2"], CW["e2"])]


def reference(layers, x, cot, rules):
    return np.stack([np_lrp(layers, xi.reshape(-1), ci, rules).reshape(xi.shape) for xi, ci in zip(x, cot)])


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol * max(np.abs(want).max(), 1e-30))


RULES = {
    "epsilon": (lambda: A.epsilon(0.01), np_rule("epsilon", eps=0.01)),
    "zplus": (lambda: A.zplus(), np_rule("zplus")),
    "alpha_beta": (lambda: A.alpha_beta(2, 1), np_rule("alpha_beta", alpha=2.0, beta=1.0)),
    "alpha_beta_3_2": (lambda: A.alpha_beta(3, 2, 1e-3), np_rule("alpha_beta", alpha=3.0, beta=2.0, stabilizer=1e-3)),
    "gamma": (lambda: A.gamma(0.25), np_rule("gamma", gamma=0.25)),
    "flat": (lambda: A.flat(), np_rule("flat")),
    "w_square": (lambda: A.w_square(), np_rule("w_square")),
    "zbox": (lambda: A.zbox(-2.0, 2.5), np_rule("zbox", low=-2.0, high=2.5)),
}


def one_hot(t, n):
    return np.eye(n)[t]


@pytest.mark.parametrize("rule", sorted(RULES))
def test_each_rule_is_its_formula_on_an_mlp(rule, x64):
    ours, ref = RULES[rule]
    comp = A.Composite({"dense": ours(), "activation": A.pass_through()})
    t = np.array([0, 3, 1])
    got = jax.jit(lambda x: A.lrp(mlp, x, comp, target=jnp.asarray(t)))(jnp.asarray(MX))
    close(got, reference(np_mlp(), MX, one_hot(t, 4), [ref] * 3), 1e-9)


def test_eager_is_jit(x64):
    comp = A.EPSILON_PLUS_FLAT
    x = jnp.asarray(MX)
    close(A.lrp(mlp, x, comp, target=1), jax.jit(lambda v: A.lrp(mlp, v, comp, target=1))(x), 1e-12)


# every rule on the MLP (below) in the default set, half of them on the CNN; the slow set runs all on both
@pytest.mark.parametrize("rule", covering(sorted(RULES)))
def test_each_rule_is_its_formula_on_a_cnn(rule, x64):
    ours, ref = RULES[rule]
    comp = A.EPSILON_PLUS | {"conv": ours(), "dense": ours()}
    t = np.array([2, 0])
    got = jax.jit(lambda x: A.lrp(jax_cnn, x, comp, target=jnp.asarray(t)))(jnp.asarray(CX))
    close(got, reference(np_cnn(), CX, one_hot(t, 3), [ref] * 4), 1e-8)


COMPOSITES = {
    "EPSILON_PLUS": (A.EPSILON_PLUS, lambda: [np_rule("zplus")] * 2 + [np_rule("epsilon", eps=1e-6)] * 2),
    "EPSILON_PLUS_FLAT": (A.EPSILON_PLUS_FLAT,
                          lambda: [np_rule("flat"), np_rule("zplus")] + [np_rule("epsilon", eps=1e-6)] * 2),
    "EPSILON_ALPHA2_BETA1": (A.EPSILON_ALPHA2_BETA1, lambda: [np_rule("alpha_beta", alpha=2.0, beta=1.0)] * 2
                             + [np_rule("epsilon", eps=1e-6)] * 2),
    "EPSILON_ALPHA2_BETA1_FLAT": (A.EPSILON_ALPHA2_BETA1_FLAT, lambda: [np_rule("flat"), np_rule(
        "alpha_beta", alpha=2.0, beta=1.0)] + [np_rule("epsilon", eps=1e-6)] * 2),
    "EPSILON_GAMMA_BOX": (A.EPSILON_GAMMA_BOX(-3.0, 3.0), lambda: [np_rule("zbox", low=-3.0, high=3.0), np_rule(
        "gamma", gamma=0.25)] + [np_rule("epsilon", eps=1e-6)] * 2),
}


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_each_composite_on_a_plain_jax_cnn_is_its_rules(name, x64):
    comp, rules = COMPOSITES[name]
    t = np.array([1, 2])
    got = jax.jit(lambda x: A.lrp(jax_cnn, x, comp, target=jnp.asarray(t)))(jnp.asarray(CX))
    close(got, reference(np_cnn(), CX, one_hot(t, 3), rules()), 1e-8)


class FlaxCNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Conv(3, (3, 3), padding=1, name="c1")(x))
        h = nn.max_pool(h, (2, 2), (2, 2))
        h = nn.relu(nn.Conv(4, (3, 3), padding=1, name="c2")(h))
        h = nn.avg_pool(h, (2, 2), (2, 2))
        h = jnp.transpose(h, (0, 3, 1, 2)).reshape(h.shape[0], -1)  # flatten in NCHW order, as jax_cnn does
        h = nn.relu(nn.Dense(5, name="d1")(h))
        return nn.Dense(3, name="d2")(h)


def flax_cnn(x_nchw):
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    v = {"params": {"c1": {"kernel": f32(CW["c1"].transpose(2, 3, 1, 0)), "bias": f32(CW["b1"])},
                    "c2": {"kernel": f32(CW["c2"].transpose(2, 3, 1, 0)), "bias": f32(CW["b2"])},
                    "d1": {"kernel": f32(CW["d1"]), "bias": f32(CW["e1"])},
                    "d2": {"kernel": f32(CW["d2"]), "bias": f32(CW["e2"])}}}
    return FlaxCNN().apply(v, jnp.transpose(x_nchw, (0, 2, 3, 1)))


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_each_composite_on_an_unmodified_flax_cnn(name):
    comp, rules = COMPOSITES[name]
    t = np.array([0, 2])
    with jax.numpy_dtype_promotion("standard"):  # Flax's avg_pool divides by an int
        got = jax.jit(lambda x: A.lrp(flax_cnn, x, comp, target=jnp.asarray(t)))(jnp.asarray(CX, jnp.float32))
    close(got, reference(np_cnn(), CX, one_hot(t, 3), rules()), 2e-5)




def _nnx_cnn():
    """The Flax CNN as a Flax NNX module with the same weights (NNX records no module path: dataflow finds it)."""
    from flax import nnx

    f32 = lambda a: jnp.asarray(a, jnp.float32)

    def conv(w, b):
        layer = nnx.Conv(w.shape[1], w.shape[0], w.shape[2:], padding=1, rngs=nnx.Rngs(0))
        layer.kernel[...], layer.bias[...] = f32(w.transpose(2, 3, 1, 0)), f32(b)
        return layer

    def dense(w, b):
        layer = nnx.Linear(*w.shape, rngs=nnx.Rngs(0))
        layer.kernel[...], layer.bias[...] = f32(w), f32(b)
        return layer

    class NnxCNN(nnx.Module):
        def __init__(self):
            self.c1, self.c2 = conv(CW["c1"], CW["b1"]), conv(CW["c2"], CW["b2"])
            self.d1, self.d2 = dense(CW["d1"], CW["e1"]), dense(CW["d2"], CW["e2"])

        def __call__(self, x_nchw):
            h = nn.relu(self.c1(jnp.transpose(x_nchw, (0, 2, 3, 1))))
            h = nn.max_pool(h, (2, 2), (2, 2))
            h = nn.relu(self.c2(h))
            h = nn.avg_pool(h, (2, 2), (2, 2))
            h = jnp.transpose(h, (0, 3, 1, 2)).reshape(h.shape[0], -1)
            return self.d2(nn.relu(self.d1(h)))

    return NnxCNN()


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_each_composite_on_an_unmodified_nnx_cnn(name):
    comp, rules = COMPOSITES[name]
    model = _nnx_cnn()
    t = np.array([0, 2])
    with jax.numpy_dtype_promotion("standard"):  # Flax's avg_pool divides by an int
        got = jax.jit(lambda x: A.lrp(model, x, comp, target=jnp.asarray(t)))(jnp.asarray(CX, jnp.float32))
    close(got, reference(np_cnn(), CX, one_hot(t, 3), rules()), 2e-5)


def _eqx_cnn(avg_pool="eqx"):
    """The CNN as unmodified Equinox layers on one CHW image (jax.vmap over the batch), with CW's weights.

    ``avg_pool="eqx"``: ``eqx.nn.AvgPool2d``; ``"lax"``: the same pooling written as ``reduce_window(add) / 4``.
    """
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    key = jax.random.key(0)

    class EqxCNN(eqx.Module):
        c1: eqx.nn.Conv2d
        c2: eqx.nn.Conv2d
        d1: eqx.nn.Linear
        d2: eqx.nn.Linear
        max_pool: eqx.nn.MaxPool2d
        avg_pool: eqx.nn.AvgPool2d

        def __init__(self):
            self.c1, self.c2 = eqx.nn.Conv2d(2, 3, 3, padding=1, key=key), eqx.nn.Conv2d(3, 4, 3, padding=1, key=key)
            self.d1, self.d2 = eqx.nn.Linear(16, 5, key=key), eqx.nn.Linear(5, 3, key=key)
            self.max_pool, self.avg_pool = eqx.nn.MaxPool2d(2, 2), eqx.nn.AvgPool2d(2, 2)

        def __call__(self, x_chw):
            h = self.max_pool(jax.nn.relu(self.c1(x_chw)))
            h = jax.nn.relu(self.c2(h))
            if avg_pool == "eqx":
                h = self.avg_pool(h)
            else:
                h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2), (1, 2, 2), "VALID") / 4.0
            return self.d2(jax.nn.relu(self.d1(h.reshape(-1))))  # CHW flatten: jax_cnn's NCHW order

    model = EqxCNN()
    # Equinox's conv weight is OIHW like CW's, its bias (O, 1, 1); its Linear weight is (out, in).
    where = lambda m: (m.c1.weight, m.c1.bias, m.c2.weight, m.c2.bias, m.d1.weight, m.d1.bias, m.d2.weight, m.d2.bias)
    return eqx.tree_at(where, model, (f32(CW["c1"]), f32(CW["b1"][:, None, None]), f32(CW["c2"]),
                                      f32(CW["b2"][:, None, None]), f32(CW["d1"].T), f32(CW["e1"]),
                                      f32(CW["d2"].T), f32(CW["e2"])))


# eqx.nn.AvgPool2d traces as reduce_window_sum -> squeeze -> transpose -> div 4: the pooling layer is all of it
# (it was once the sum alone, and every relevance below it came out 1/4 of Zennit's).
@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@pytest.mark.parametrize("avg_pool", ["eqx", "lax"])
@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_each_composite_on_an_unmodified_equinox_cnn(name, avg_pool):
    comp, rules = COMPOSITES[name]
    model = _eqx_cnn(avg_pool)
    x = jnp.asarray(CX, jnp.float32)
    np.testing.assert_allclose(np.asarray(jax.vmap(model)(x)), np.asarray(jax_cnn(jnp.asarray(CX)), np.float32),
                               rtol=1e-5, atol=1e-5)  # the same network
    t = np.array([1, 0])
    got = jax.jit(lambda x: A.lrp(jax.vmap(model), x, comp, target=jnp.asarray(t)))(x)
    close(got, reference(np_cnn(), CX, one_hot(t, 3), rules()), 2e-5)


def test_composites_on_an_unmodified_equinox_mlp():
    model = eqx.nn.MLP(6, 4, 8, 2, key=jax.random.key(1))  # jax.nn.relu, biases; weights (out, in)
    ws = [np.asarray(la.weight, np.float64).T for la in model.layers]
    bs = [np.asarray(la.bias, np.float64) for la in model.layers]
    t = np.array([3, 0, 1])
    x = jnp.asarray(MX, jnp.float32)
    eps = np_rule("epsilon", eps=1e-6)
    # EPSILON_GAMMA_BOX's box is for the first conv layer: an MLP has none, so its first layer is epsilon's.
    for name, first in (("EPSILON_PLUS", eps), ("EPSILON_PLUS_FLAT", np_rule("flat")), ("EPSILON_GAMMA_BOX", eps)):
        comp = COMPOSITES[name][0]
        got = jax.jit(lambda x, comp=comp: A.lrp(jax.vmap(model), x, comp, target=jnp.asarray(t)))(x)
        close(got, reference(np_mlp(ws, bs), MX, one_hot(t, 4), [first, eps, eps]), 2e-5)
        if name == "EPSILON_PLUS_FLAT":  # one example at a time, no vmap inside the model (W @ x): the same layers
            one = jax.jit(jax.vmap(lambda x, t, comp=comp: A.lrp(model, x, comp, target=t)))(x, jnp.asarray(t))
            close(one, got, 1e-6)


def test_conservation_where_the_rules_promise_it(x64):
    """The input relevance sums to the output relevance (the target logit) where each rule's denominator is the
    full sum of the contributions: z+ with positive weights and inputs, epsilon -> 0 without biases, alpha-beta
    where every output has positive and negative contributions."""
    zero = [np.zeros_like(b) for b in MB]
    x = jnp.asarray(np.abs(MX) + 0.1)
    t = jnp.array([0, 1, 2])
    pw = [np.abs(w) for w in MW]
    mixed = np.abs(RNG.normal(size=(6, 4))) * np.array([[1.0], [-1.0], [1.0], [-1.0], [1.0], [-1.0]])
    for f, rule in ((lambda v: mlp(v, pw, zero), A.zplus(1e-12)), (lambda v: mlp(v, MW, zero), A.epsilon(1e-12)),
                    (lambda v: v @ jnp.asarray(mixed), A.alpha_beta(2, 1, 1e-12))):
        logits = f(x)
        cot = jax.nn.one_hot(t, 4, dtype=x.dtype) * logits  # the output relevance: the target logit
        r = jax.jit(lambda v, c, f=f, rule=rule: A.lrp(f, v, {"dense": rule, "activation": A.pass_through()},
                                                       target=c))(x, cot)
        want = jnp.take_along_axis(logits, t[:, None], axis=1)[:, 0]
        np.testing.assert_allclose(np.asarray(r.sum(axis=1)), np.asarray(want), rtol=1e-8)


def test_lrp0_without_bias_is_gradient_x_input_times_one(x64):
    zero = [np.zeros_like(b) for b in MB]
    f = lambda x: mlp(x, MW, zero)
    x = jnp.asarray(MX)
    t = jnp.array([0, 1, 2])
    # LRP-0 with relevance starting at the logit z_t is gradient x input scaled: R_in = x * grad(z_t) for ReLU nets
    logits = f(x)
    cot = jax.nn.one_hot(t, 4, dtype=x.dtype) * logits
    r = A.lrp(f, x, {"dense": A.epsilon(1e-12), "activation": A.pass_through()}, target=cot)
    np.testing.assert_allclose(np.asarray(r), np.asarray(A.gradient_x_input(f, x, target=t)), rtol=1e-6, atol=1e-9)


def test_target_forms_and_vmap():
    x = jnp.asarray(CX, jnp.float32)

    @jax.jit
    def all_forms(x):
        lrp = lambda **kw: A.lrp(jax_cnn, x, A.EPSILON_PLUS_FLAT, **kw)
        per_row = jax.vmap(lambda xi: A.lrp(lambda v: jax_cnn(v[None])[0], xi, A.EPSILON_PLUS_FLAT))(x)
        return (lrp(), lrp(target=jnp.argmax(jax_cnn(x), axis=-1)), lrp(target=0), lrp(target=jnp.array([0, 0])),
                lrp(target=jax.nn.one_hot(jnp.array([0, 0]), 3)), per_row)

    default, top, one, ones, cot, per_row = all_forms(x)
    close(default, top, 0)
    close(one, ones, 0)
    close(cot, one, 0)
    close(per_row, default, 1e-6)
    assert not np.allclose(np.asarray(one), np.asarray(default))  # the top classes are not all 0


def test_bad_composites_are_gradkit_errors():
    x = jnp.asarray(CX, jnp.float32)
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*no rule for 'max_pool'.*add one.*gradient_rule"):
        A.lrp(jax_cnn, x, {"conv": A.zplus(), "dense": A.epsilon(), "activation": A.pass_through(),
                           "avg_pool": A.norm()})
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*unknown layer kind 'linear'"):
        A.lrp(jax_cnn, x, {"linear": A.epsilon()})
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*must be an LRP rule"):
        A.EPSILON_PLUS | {"dense": 0.1}
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*zplus rule modifies weights.*'avg_pool'"):
        A.lrp(jax_cnn, x, A.EPSILON_PLUS | {"avg_pool": A.zplus()})
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*pass_through.*one shape"):
        A.lrp(jax_cnn, x, A.EPSILON_PLUS | {"dense": A.pass_through()})
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*composite must map"):
        A.lrp(jax_cnn, x, A.epsilon())
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*alpha - beta == 1"):
        A.alpha_beta(1, 1)
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*eps must be >= 0"):
        A.epsilon(-1.0)
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*one array"):
        A.lrp(lambda v: (jax_cnn(v), v), x, A.EPSILON_PLUS)
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*floating point"):
        A.lrp(jax_cnn, np.ones((1, 2, 8, 8), np.int32), A.EPSILON_PLUS)
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\].*outside the output's 3 classes"):
        A.lrp(jax_cnn, x, A.EPSILON_PLUS, target=5)


def test_composites_are_data():
    c = A.EPSILON_PLUS_FLAT | {"dense": A.epsilon(0.5)}
    assert c["dense"] == A.epsilon(0.5) and c["first"] == A.flat() and c["conv"] == A.zplus()
    assert dict(A.EPSILON_PLUS)["activation"] == A.pass_through()
    assert set(A.EPSILON_PLUS_FLAT) <= set(A.KINDS)
    assert "zbox" in repr(A.EPSILON_GAMMA_BOX(0.0, 1.0))


def test_layers_are_found_by_dataflow_in_any_spelling(x64):
    """A layer inside a jitted helper, W @ x with the bias first, ReLU as jnp.maximum: the same layers."""
    @jax.jit
    def dense(h, w, b):
        return jnp.asarray(b, h.dtype)[None] + jnp.einsum("ij,bi->bj", jnp.asarray(w, h.dtype), h)

    def spelled(x):
        h = jnp.maximum(dense(x, MW[0], MB[0]), 0.0)
        h = jnp.maximum((jnp.asarray(MW[1].T) @ h.T).T + jnp.asarray(MB[1])[None], 0.0)
        return dense(h, MW[2], MB[2])

    x = jnp.asarray(MX)
    for comp in (A.EPSILON_PLUS_FLAT, {"dense": A.gamma(0.5), "activation": A.pass_through()}):
        close(A.lrp(spelled, x, comp, target=2), A.lrp(mlp, x, comp, target=2), 1e-12)
    # a tanh network: the activation passes relevance through, so only the dense rules act
    tanh_net = lambda x: jnp.tanh(x @ jnp.asarray(MW[0]) + jnp.asarray(MB[0])[None]) @ jnp.asarray(MW[1])
    got = A.lrp(tanh_net, x, {"dense": A.epsilon(0.01), "activation": A.pass_through()}, target=0)
    h = np.tanh(MX @ MW[0] + MB[0])
    r1 = np_rule("epsilon", eps=0.01)(h, lambda w: w, MW[1], np.zeros(8), one_hot(np.zeros(3, int), 8))
    want = np_rule("epsilon", eps=0.01)(MX, lambda w: w, MW[0], MB[0], r1)
    close(got, want, 1e-9)


_erf = np.vectorize(__import__("math").erf)
ACTIVATIONS = {  # the model's activation, and NumPy's
    "silu": (jax.nn.silu, lambda h: h / (1 + np.exp(-h))),
    "gelu_tanh": (jax.nn.gelu, lambda h: 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))),
    "gelu_erf": (lambda h: jax.nn.gelu(h, approximate=False), lambda h: 0.5 * h * (1 + _erf(h / np.sqrt(2)))),
    "tanh": (jnp.tanh, np.tanh),
}


@pytest.mark.parametrize("act", sorted(ACTIVATIONS))
def test_plain_function_activations_pass_relevance_through(act, x64):
    """An MLP with silu / gelu (JAX inlines gelu: no jit or custom_jvp names it) / tanh between its layers: under
    every composite the activation passes relevance through (Zennit's Pass), so only the dense rules act."""
    f, np_f = ACTIVATIONS[act]

    def net(x):
        h = x
        for i, (w, b) in enumerate(zip(MW, MB)):
            h = h @ jnp.asarray(w) + jnp.asarray(b)[None]
            if i < len(MW) - 1:
                h = f(h)
        return h

    layers = []
    for i, (w, b) in enumerate(zip(MW, MB)):
        layers.append(("lin", lambda w: w, w, b))
        if i < len(MW) - 1:
            layers.append(("act", np_f))
    x, t = jnp.asarray(MX), np.array([2, 0, 3])
    eps = np_rule("epsilon", eps=1e-6)
    for comp, rules in ((A.EPSILON_PLUS_FLAT, [np_rule("flat"), eps, eps]),
                        ({"dense": A.gamma(0.25), "activation": A.pass_through()}, [np_rule("gamma", gamma=0.25)] * 3)):
        got = jax.jit(lambda x, comp=comp: A.lrp(net, x, comp, target=jnp.asarray(t)))(x)
        close(got, reference(layers, MX, one_hot(t, 4), rules), 1e-9)
        # and inside a jitted helper, on one example at a time (vmap outside lrp)
        one = jax.vmap(lambda v, ti, comp=comp: A.lrp(jax.jit(lambda u: net(u[None])[0]), v, comp, target=ti))(
            x, jnp.asarray(t))
        close(one, got, 1e-9)


def test_the_no_rule_warning_names_a_notebook_cell_not_its_temporary_file(monkeypatch):
    """In Jupyter each cell is compiled into a temporary file; the warning names the cell (as IPython's own
    tracebacks do), so a saved notebook shows no machine path. IPython's shell is stood in for by its interface:
    ``get_ipython().compile.format_code_name(file)`` gives ``("Cell", "In[N]")`` for a cell's file."""
    import sys
    import types

    here = __file__
    shell = types.SimpleNamespace(compile=types.SimpleNamespace(
        format_code_name=lambda path: ("Cell", "In[7]") if path == here else None))
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    rng = np.random.default_rng(5)
    w1, w2 = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    f = lambda v: jnp.sin(v @ w1) @ w2
    with pytest.warns(gk.GradkitWarning, match=rf"sin at cell In\[7\]:{f.__code__.co_firstlineno} \(") as caught:
        A.lrp(f, rng.normal(size=(2, 3)).astype(np.float32), A.EPSILON_PLUS)
    assert here not in str(caught[0].message)
