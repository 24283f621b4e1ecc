"""gk.attribution.lrp on ResNets: canonization (BatchNorm folded), the residual sum, every spelling of a layer.

* a plain-JAX ResNet (a stem, two BasicBlocks, one with a 1×1 downsample,
  BatchNorm written out, residual adds, global mean pooling), the same
  weights as a Flax linen module (blocks under ``nn.remat``) and as an
  Equinox model: equal heatmaps, and ``ΣR ≈ 1`` per image with ε rules on a
  bias-free model (BatchNorm without shift);
* folding against the model folded by hand (NumPy float64 formulas);
  ``canonize=False`` differs; the residual rule settable;
* every spelling of global and windowed average pooling gives one heatmap;
* layers inside ``jax.checkpoint``, nested ``jit``, ``cond``/``switch`` and
  ``scan`` bodies get their rules;
* sign tracking: a negative constant channel (``concatenate``, ``pad``)
  keeps the x⁻ terms of z⁺ (against NumPy);
* BatchNorm in training mode is an error; an op without a rule warns
  (``strict=True``: an error); LayerNorm runs;
* ``check=True``'s report, a class index out of range under ``jit``;
* a property test: random compositions of dense/conv/BatchNorm/pooling/
  residual/reshape layers against a NumPy float64 LRP written from the
  rules' formulas.
"""

import warnings

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

A = gk.attribution
EPS_BN = 1e-5
ALL_EPSILON = A.Composite({"dense": A.epsilon(1e-9), "conv": A.epsilon(1e-9), "activation": A.pass_through(),
                           "avg_pool": A.norm(1e-9), "sum": A.norm(1e-9), "max_pool": A.gradient_rule()})


def stab(z, e):
    return z + e * np.where(z >= 0, 1.0, -1.0)


def lrp(f, x, comp, **kw):
    """``A.lrp`` under ``jit``: one compile for the whole program (eager runs compile every op on its own)."""
    return jax.jit(lambda v: A.lrp(f, v, comp, **kw))(x)


def close(got, want, tol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(np.abs(want).max(), 1e-30)
    assert np.abs(got - want).max() <= tol * scale, (np.abs(got - want).max() / scale, tol)


# --------------------------------------------------------------------------------------------------------------
# One ResNet, three ways: plain JAX (NHWC), Flax linen (NHWC), Equinox (NCHW, vmapped).
# --------------------------------------------------------------------------------------------------------------

def make_params(seed, shift=True):
    rng = np.random.default_rng(seed)

    def w(*s):
        return (rng.normal(size=s) / np.sqrt(np.prod(s[:-1]))).astype(np.float32)

    def bn(c):
        g = rng.uniform(0.5, 1.5, c)
        v = rng.uniform(0.5, 2.0, c)
        m, b = (rng.normal(size=c) * 0.3, rng.normal(size=c) * 0.3) if shift else (np.zeros(c), np.zeros(c))
        return tuple(a.astype(np.float32) for a in (g, b, m, v))

    return {"w0": w(3, 3, 2, 4), "bn0": bn(4), "w1": w(3, 3, 4, 4), "bn1": bn(4), "w2": w(3, 3, 4, 4),
            "bn2": bn(4), "w3": w(3, 3, 4, 6), "bn3": bn(6), "w4": w(3, 3, 6, 6), "bn4": bn(6),
            "wd": w(1, 1, 4, 6), "bnd": bn(6), "fc": w(6, 3)}


P_SHIFT = make_params(0)
P_PLAIN = make_params(1, shift=False)
X = np.random.default_rng(2).normal(size=(2, 6, 6, 2)).astype(np.float32)


def conv(x, w):
    return jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))


def ch(a):
    """A per-channel vector, shaped to broadcast against NHWC (rank promotion is an error in the tests)."""
    return jnp.reshape(a, (1, 1, 1, -1))


def bn(z, p):
    g, b, m, v = (ch(a) for a in p)
    return (z - m) / jnp.sqrt(v + EPS_BN) * g + b


def stem(x, p):
    return jax.nn.relu(bn(conv(x, p["w0"]), p["bn0"]))


def block1(h, p):
    a = jax.nn.relu(bn(conv(h, p["w1"]), p["bn1"]))
    return jax.nn.relu(bn(conv(a, p["w2"]), p["bn2"]) + h)


def block2(h, p):
    a = jax.nn.relu(bn(conv(h, p["w3"]), p["bn3"]))
    return jax.nn.relu(bn(conv(a, p["w4"]), p["bn4"]) + bn(conv(h, p["wd"]), p["bnd"]))


def jax_resnet(p, wrap=lambda f: f):
    def f(x):
        h = wrap(block1)(stem(x, p), p)
        h = wrap(block2)(h, p)
        return jnp.mean(h, axis=(1, 2)) @ p["fc"]
    return f


def folded_resnet(p):
    """The same ResNet with each BatchNorm folded into its conv by hand (NumPy float64)."""
    q = {}
    for w, b in [("w0", "bn0"), ("w1", "bn1"), ("w2", "bn2"), ("w3", "bn3"), ("w4", "bn4"), ("wd", "bnd")]:
        g, beta, m, v = (np.float64(a) for a in p[b])
        s = g / np.sqrt(v + EPS_BN)
        q[w] = (np.float64(p[w]) * s).astype(np.float32)
        q[b] = ((0.0 - m) * s + beta).astype(np.float32).reshape(1, 1, 1, -1)

    def f(x):
        h = jax.nn.relu(conv(x, q["w0"]) + q["bn0"])
        a = jax.nn.relu(conv(h, q["w1"]) + q["bn1"])
        h = jax.nn.relu(conv(a, q["w2"]) + q["bn2"] + h)
        a = jax.nn.relu(conv(h, q["w3"]) + q["bn3"])
        h = jax.nn.relu(conv(a, q["w4"]) + q["bn4"] + (conv(h, q["wd"]) + q["bnd"]))
        return jnp.mean(h, axis=(1, 2)) @ p["fc"]
    return f


class LinenBlock(nn.Module):
    features: int
    down: bool

    @nn.compact
    def __call__(self, h):
        norm = lambda name: nn.BatchNorm(use_running_average=True, epsilon=EPS_BN, name=name)
        cv = lambda name, k=3: nn.Conv(self.features, (k, k), padding="SAME", use_bias=False, name=name)
        a = nn.relu(norm("bn_a")(cv("conv_a")(h)))
        skip = norm("bn_d")(cv("conv_d", 1)(h)) if self.down else h
        return nn.relu(norm("bn_b")(cv("conv_b")(a)) + skip)


class LinenResNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.BatchNorm(use_running_average=True, epsilon=EPS_BN, name="bn0")(
            nn.Conv(4, (3, 3), padding="SAME", use_bias=False, name="conv0")(x)))
        h = nn.remat(LinenBlock)(4, False, name="b1")(h)
        h = nn.remat(LinenBlock)(6, True, name="b2")(h)
        return nn.Dense(3, use_bias=False, name="fc")(jnp.mean(h, axis=(1, 2)))


def linen_resnet(p):
    def bnv(k):
        g, b, m, v = p[k]
        return {"scale": g, "bias": b}, {"mean": m, "var": v}

    params, stats = {}, {}
    params["conv0"] = {"kernel": p["w0"]}
    params["bn0"], stats["bn0"] = bnv("bn0")
    for blk, (wa, ba, wb, bb) in {"b1": ("w1", "bn1", "w2", "bn2"), "b2": ("w3", "bn3", "w4", "bn4")}.items():
        params[blk] = {"conv_a": {"kernel": p[wa]}, "conv_b": {"kernel": p[wb]}}
        stats[blk] = {}
        params[blk]["bn_a"], stats[blk]["bn_a"] = bnv(ba)
        params[blk]["bn_b"], stats[blk]["bn_b"] = bnv(bb)
    params["b2"]["conv_d"] = {"kernel": p["wd"]}
    params["b2"]["bn_d"], stats["b2"]["bn_d"] = bnv("bnd")
    params["fc"] = {"kernel": p["fc"]}
    model = LinenResNet()
    variables = {"params": params, "batch_stats": stats}
    return lambda x: model.apply(variables, x)


def eqx_resnet(p):
    key = jax.random.key(0)

    def cv(w):  # made abstractly (no random initialization to compile), then given the weights
        c = eqx.filter_eval_shape(eqx.nn.Conv2d, w.shape[2], w.shape[3], w.shape[0], padding=w.shape[0] // 2,
                                  use_bias=False, key=key)
        return eqx.tree_at(lambda m: m.weight, c, jnp.asarray(np.transpose(w, (3, 2, 0, 1))))

    def norm(k):
        g, b, m, v = p[k]
        layer, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(len(g), "batch", eps=EPS_BN, inference=True,
                                                                mode="ema")
        layer = eqx.tree_at(lambda m_: (m_.weight, m_.bias), layer, (jnp.asarray(g), jnp.asarray(b)))
        return layer, state.set(layer.ema_state_index, (jnp.asarray(m), jnp.asarray(v)))

    layers = {k: cv(p[k]) for k in ("w0", "w1", "w2", "w3", "w4", "wd")}
    norms = {k: norm(k) for k in ("bn0", "bn1", "bn2", "bn3", "bn4", "bnd")}
    fc = eqx.tree_at(lambda m: m.weight, eqx.filter_eval_shape(eqx.nn.Linear, 6, 3, use_bias=False, key=key),
                     jnp.asarray(p["fc"].T))

    def one(x):  # one image, CHW
        def cb(w, b, h):
            layer, state = norms[b]
            return layer(layers[w](h), state)[0]
        h = jax.nn.relu(cb("w0", "bn0", x))
        a = jax.nn.relu(cb("w1", "bn1", h))
        h = jax.nn.relu(cb("w2", "bn2", a) + h)
        a = jax.nn.relu(cb("w3", "bn3", h))
        h = jax.nn.relu(cb("w4", "bn4", a) + cb("wd", "bnd", h))
        return fc(jnp.mean(h, axis=(1, 2)))

    return jax.vmap(one, axis_name="batch")


def test_resnet_conserves_relevance_and_three_frameworks_agree():
    f = jax_resnet(P_PLAIN)
    r, report = lrp(f, X, ALL_EPSILON, check=True)
    np.testing.assert_allclose(np.asarray(report.total_relevance), 1.0, atol=2e-3)
    np.testing.assert_allclose(np.asarray(report.seed), 1.0)
    np.testing.assert_allclose(np.asarray(report.total_relevance), np.asarray(r).sum(axis=(1, 2, 3)), rtol=1e-5)
    logits = np.asarray(f(X))
    np.testing.assert_allclose(np.asarray(report.explained_output), logits.max(axis=1), rtol=1e-6)
    for comp in (A.EPSILON_PLUS,):
        want = lrp(jax_resnet(P_SHIFT), X, comp)
        close(lrp(linen_resnet(P_SHIFT), X, comp), want, 1e-5)
        got = lrp(eqx_resnet(P_SHIFT), jnp.transpose(X, (0, 3, 1, 2)), comp)
        close(jnp.transpose(got, (0, 2, 3, 1)), want, 1e-5)
    # without canonization (BatchNorm keeps its gradient: warned) ΣR is not conserved
    with pytest.warns(gk.GradkitWarning, match="sub at"):
        r0, rep0 = lrp(f, X, ALL_EPSILON, canonize=False, check=True)
    assert np.abs(np.asarray(rep0.total_relevance) - 1).max() > 1e-2


@pytest.mark.parametrize("comp", ["EPSILON_PLUS", pytest.param("EPSILON_GAMMA_BOX", marks=pytest.mark.slow),
                                  pytest.param("EPSILON_ALPHA2_BETA1_FLAT", marks=pytest.mark.slow)])
def test_folding_is_the_model_folded_by_hand(comp):
    c = A.EPSILON_GAMMA_BOX(-3.0, 3.0) if comp == "EPSILON_GAMMA_BOX" else getattr(A, comp)
    got = lrp(jax_resnet(P_SHIFT), X, c)
    close(got, lrp(folded_resnet(P_SHIFT), X, c), 1e-5)
    with pytest.warns(gk.GradkitWarning):
        unfolded = lrp(jax_resnet(P_SHIFT), X, c, canonize=False)
    assert np.abs(np.asarray(unfolded) - np.asarray(got)).max() > 1e-2 * np.abs(np.asarray(got)).max()


def test_residual_rule_is_settable():
    f = folded_resnet(P_SHIFT)
    split = lrp(f, X, ALL_EPSILON)
    copied = lrp(f, X, ALL_EPSILON | {"sum": A.gradient_rule()})
    s_split, s_copied = np.asarray(split).sum(axis=(1, 2, 3)), np.asarray(copied).sum(axis=(1, 2, 3))
    assert np.abs(s_copied - 1).min() > 0.1  # each add hands all of its relevance to both branches
    assert np.abs(s_split - 1).max() < np.abs(s_copied - 1).min()
    with pytest.raises(gk.GradkitError, match="'sum'"):
        lrp(f, X, {k: v for k, v in ALL_EPSILON.items() if k != "sum"})
    with pytest.raises(gk.GradkitError, match="modifies weights"):
        lrp(f, X, A.EPSILON_PLUS | {"sum": A.zplus()})



def test_bfloat16_residual_adds_are_sums():
    # bfloat16 is floating point (NumPy's issubdtype says it is not): its residual add is a "sum", not an op
    # without a rule that would copy relevance to both branches
    k1, k2, k3 = jax.random.split(jax.random.key(3), 3)
    w1, w2 = jax.random.normal(k1, (6, 6)), jax.random.normal(k2, (6, 3))
    x = jax.random.normal(k3, (4, 6))

    def model(dtype):
        a, b = w1.astype(dtype), w2.astype(dtype)
        return lambda v: (jax.nn.relu(v @ a) + v) @ b

    with warnings.catch_warnings():
        warnings.simplefilter("error", gk.GradkitWarning)
        r16 = lrp(model(jnp.bfloat16), x.astype(jnp.bfloat16), ALL_EPSILON, strict=True)
    r32 = lrp(model(jnp.float32), x, ALL_EPSILON)
    assert r16.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(r16, np.float32).sum(-1), np.asarray(r32).sum(-1), atol=0.05)
    np.testing.assert_allclose(np.asarray(r32).sum(-1), 1.0, atol=1e-3)  # conservative: no biases

# --------------------------------------------------------------------------------------------------------------
# Spellings of pooling; control flow.
# --------------------------------------------------------------------------------------------------------------

def _window_sum(h):
    return jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


GLOBAL = {
    "mean": lambda h: jnp.mean(h, axis=(1, 2)),
    "sum_div": lambda h: jnp.sum(h, axis=(1, 2)) / 9,
    "recip_mul": lambda h: (1 / 9) * jnp.sum(h, axis=(1, 2)),
    "mul_recip": lambda h: jnp.sum(h, axis=(1, 2)) * (1 / 9),
    "mean_keepdims": lambda h: jnp.mean(h, axis=(1, 2), keepdims=True)[:, 0, 0],
    "sum_keepdims_div": lambda h: (jnp.sum(h, axis=(1, 2), keepdims=True) / 9).reshape(h.shape[0], -1),
    "window": lambda h: (jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "VALID")
                         / 9).reshape(h.shape[0], -1),
}
WINDOW = {
    "quarter_mul": lambda h: 0.25 * _window_sum(h),
    "mul_quarter": lambda h: _window_sum(h) * 0.25,
    "div": lambda h: _window_sum(h) / 4,
}


def _pool_model(p, window, glob):
    def f(x):
        return GLOBAL[glob](WINDOW[window](stem(x, p))) @ p["fc"][:4]
    return f


def test_every_pooling_spelling_is_one_avg_pool():
    want = lrp(_pool_model(P_SHIFT, "div", "mean"), X, A.EPSILON_PLUS)
    plain = lrp(_pool_model(P_SHIFT, "div", "mean"), X, A.EPSILON_PLUS | {"avg_pool": A.gradient_rule()})
    assert np.abs(np.asarray(plain) - np.asarray(want)).max() > 0.1 * np.abs(np.asarray(want)).max()
    for window in WINDOW:
        for glob in GLOBAL:
            if window != "div" and glob != "mean":
                continue
            close(lrp(_pool_model(P_SHIFT, window, glob), X, A.EPSILON_PLUS), want, 1e-5)


def _one_block(p, wrap=lambda f: f):
    return lambda x: jnp.mean(wrap(block1)(stem(x, p), p), axis=(1, 2)) @ p["fc"][:4]


def test_layers_inside_remat_jit_cond_switch_and_scan():
    p = P_SHIFT
    want = lrp(_one_block(p), X, A.EPSILON_PLUS)
    def in_cond(blk):  # a switch whose taken branch is a cond whose taken branch is the block
        def f(h, p_):
            zeros = lambda v: jnp.zeros_like(blk(v, p_))
            taken = lambda v: jax.lax.cond(jnp.asarray(True), lambda u: blk(u, p_), zeros, v)
            return jax.lax.switch(jnp.asarray(1), [zeros, taken, zeros], h)
        return f

    wraps = {"checkpoint of jit": lambda blk: jax.checkpoint(jax.jit(blk)), "switch and cond": in_cond}
    for wrap in wraps.values():
        close(lrp(_one_block(p, wrap), X, A.EPSILON_PLUS), want, 1e-5)

    stacked = {k: np.stack([p[k], P_PLAIN[k]]) if k in ("w1", "w2") else p[k] for k in p}
    stacked["bn1"] = tuple(np.stack([a, b]) for a, b in zip(p["bn1"], P_PLAIN["bn1"]))
    stacked["bn2"] = tuple(np.stack([a, b]) for a, b in zip(p["bn2"], P_PLAIN["bn2"]))

    def scanned(x):
        def body(h, q):
            w1, w2, bn1, bn2 = q
            return block1(h, {"w1": w1, "w2": w2, "bn1": bn1, "bn2": bn2}), None
        h, _ = jax.lax.scan(body, stem(x, p), (stacked["w1"], stacked["w2"], stacked["bn1"], stacked["bn2"]))
        return jnp.mean(h, axis=(1, 2)) @ p["fc"][:4]

    def unrolled(x):
        h = block1(block1(stem(x, p), p), P_PLAIN | {"w1": P_PLAIN["w1"]})
        return jnp.mean(h, axis=(1, 2)) @ p["fc"][:4]

    close(lrp(scanned, X, A.EPSILON_PLUS), lrp(unrolled, X, A.EPSILON_PLUS), 1e-5)


# --------------------------------------------------------------------------------------------------------------
# Sign tracking, errors, warnings, the report, targets under jit.
# --------------------------------------------------------------------------------------------------------------

def np_zplus(x, w, r, e=1e-6, nonnegative=False):
    """z⁺ of ``z = x @ w`` by its formula; ``nonnegative`` drops the x⁻ terms (what a wrong sign flag does)."""
    wp, wn, xp, xn = np.maximum(w, 0), np.minimum(w, 0), np.maximum(x, 0), np.minimum(x, 0)
    if nonnegative:
        xp, xn = x, np.zeros_like(x)
    c = r / stab(xp @ wp + xn @ wn, e)
    return xp * (c @ wp.T) + xn * (c @ wn.T)


@pytest.mark.parametrize("spelling", ["concatenate", "pad"])
def test_a_negative_constant_channel_keeps_the_negative_terms(spelling, x64):
    rng = np.random.default_rng(5)
    w1, w2, x = rng.normal(size=(3, 4)), rng.normal(size=(5, 2)), rng.normal(size=(2, 3))

    def f(v):
        h = jax.nn.relu(v @ w1)
        if spelling == "concatenate":
            h = jnp.concatenate([h, jnp.full((h.shape[0], 1), -1.0)], axis=1)
        else:
            h = jnp.pad(h, ((0, 0), (0, 1)), constant_values=-1.0)
        return h @ w2

    comp = A.Composite({"dense": A.zplus(), "activation": A.pass_through()})
    h = np.maximum(x @ w1, 0)
    h2 = np.concatenate([h, -np.ones((2, 1))], axis=1)
    r_out = np.eye(2)[[0, 0]]
    if spelling == "pad":  # a pad with a constant other than 0 is not structural: warned
        with pytest.warns(gk.GradkitWarning, match=r"pad at .*test_lrp_resnet.py:\d+"):
            got = lrp(f, x, comp, target=0)
    else:
        got = lrp(f, x, comp, target=0)
    for nonneg, check in ((False, True), (True, False)):
        rh = np_zplus(h2, w2, r_out, nonnegative=nonneg)[:, :4]
        want = np_zplus(x, w1, rh)
        if check:
            close(got, want, 1e-9)
        else:  # the wrong flag would have given a visibly different map
            assert np.abs(np.asarray(got) - want).max() > 1e-2 * np.abs(want).max()


class TrainBN(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(nn.relu(nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))))


def test_batch_statistics_are_an_error():
    x = np.random.default_rng(3).normal(size=(4, 3)).astype(np.float32)
    m = TrainBN()
    v = m.init(jax.random.key(0), x)
    with pytest.raises(gk.GradkitError, match="training mode.*use_running_average=True"):
        lrp(lambda u: m.apply(v, u, mutable=["batch_stats"])[0], x, A.EPSILON_PLUS)
    w = np.ones((3, 3), np.float32)

    def plain(u):
        z = u @ w
        mu = jnp.mean(z, axis=0, keepdims=True)
        return (z - mu) / jnp.sqrt(jnp.mean((z - mu) ** 2, axis=0, keepdims=True) + 1e-5)

    with pytest.raises(gk.GradkitError, match="over the batch axis"):
        lrp(plain, x, A.EPSILON_PLUS)
    bn_, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(3, "batch", inference=False, mode="ema")
    with pytest.raises(gk.GradkitError, match="training mode.*inference_mode"):  # a psum over the vmapped axis
        A.lrp(jax.vmap(lambda u: bn_(u @ w, state)[0], axis_name="batch"), x, A.EPSILON_PLUS)


def test_an_op_without_a_rule_warns_and_strict_is_an_error():
    rng = np.random.default_rng(4)
    w1, w2 = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 2)).astype(np.float32)
    x = rng.normal(size=(2, 3)).astype(np.float32)
    f = lambda v: jnp.sin(v @ w1) @ w2
    with pytest.warns(gk.GradkitWarning, match=r"sin at .*test_lrp_resnet.py:\d+"):
        lrp(f, x, A.EPSILON_PLUS)
    with pytest.raises(gk.GradkitError, match="sin at .*strict=True"):
        lrp(f, x, A.EPSILON_PLUS, strict=True)
    # structural ops do not warn (warnings are errors here)
    g = lambda v: jnp.transpose(jax.nn.relu(v @ w1).reshape(2, 2, 2), (0, 2, 1)).reshape(2, 4)[:, ::-1] @ w2
    assert np.isfinite(np.asarray(lrp(g, x, A.EPSILON_PLUS, strict=True))).all()
    # LayerNorm is not BatchNorm: left as it is (it keeps its gradient, warned), and nothing breaks
    ln = nn.LayerNorm()
    lv = ln.init(jax.random.key(0), x @ w1)
    h = lambda v: jax.nn.relu(ln.apply(lv, v @ w1)) @ w2
    with pytest.warns(gk.GradkitWarning):
        r = lrp(h, x, A.EPSILON_PLUS)
    assert np.isfinite(np.asarray(r)).all()
    # per example (LRP under vmap) its reduction is over all of an example's axes: not batch statistics
    with pytest.warns(gk.GradkitWarning):
        rv = jax.vmap(lambda v: A.lrp(h, v, A.EPSILON_PLUS))(x)
    close(rv, r, 1e-5)


def test_target_out_of_range_under_jit_is_nan_and_eager_is_jit():
    rng = np.random.default_rng(6)
    w1, w2 = rng.normal(size=(3, 4)).astype(np.float32), rng.normal(size=(4, 3)).astype(np.float32)
    g, beta, mu, var = (np.float32(a) for a in (1.5, 0.2, -0.3, 2.0))
    f = lambda v: jax.nn.relu((v @ w1 - mu) / jnp.sqrt(var + EPS_BN) * g + beta) @ w2
    x = rng.normal(size=(2, 3)).astype(np.float32)
    with pytest.raises(gk.GradkitError, match="outside"):
        A.lrp(f, x, A.EPSILON_PLUS, target=np.array([0, 3]))
    r = jax.jit(lambda v, t: A.lrp(f, v, A.EPSILON_PLUS, target=t))(x, jnp.array([1, 3]))
    assert np.isnan(np.asarray(r[1])).all() and np.isfinite(np.asarray(r[0])).all()
    eager = A.lrp(f, x, A.EPSILON_PLUS, target=1)
    close(r[0], eager[0], 1e-6)
    # the folded layer is the layer folded by hand
    s = g / np.sqrt(var + EPS_BN)
    close(eager, A.lrp(lambda v: jax.nn.relu(v @ (w1 * s) + (beta - mu * s)) @ w2, x, A.EPSILON_PLUS, target=1),
          1e-5)


# --------------------------------------------------------------------------------------------------------------
# Property test: random compositions against a NumPy float64 LRP written from the rules' formulas.
# A network is a list of steps on flat per-example vectors; every linear step is a matrix (conv and pooling
# too), BatchNorm is folded by Zennit's formula in the reference and written out in the model.
# --------------------------------------------------------------------------------------------------------------

def conv1d_matrix(w, length):
    """w (O, C, 3) -> the (C*L, O*L) matrix of a stride-1 'same' NCL convolution of one example."""
    o_n, c_n, _ = w.shape
    m = np.zeros((c_n * length, o_n * length))
    for o in range(o_n):
        for c in range(c_n):
            for lo in range(length):
                for k in range(3):
                    li = lo + k - 1
                    if 0 <= li < length:
                        m[c * length + li, o * length + lo] = w[o, c, k]
    return m


def random_net(seed):
    """Random steps and the input width. Steps: ("linear", kind, M, b, jax_fn) with BatchNorm folded into (M, b),
    ("relu",), ("reshape",), ("res", steps) (a residual branch)."""
    rng = np.random.default_rng(seed)
    length, chans = 4, int(rng.integers(1, 3))
    width = width_in = chans * length
    steps = []

    def bn_params(n):
        return rng.uniform(0.5, 1.5, n), rng.normal(size=n) * 0.3, rng.normal(size=n) * 0.3, rng.uniform(0.5, 2, n)

    def dense(n_in, n_out, with_bn):
        w = rng.normal(size=(n_in, n_out)) / np.sqrt(n_in)
        b = rng.normal(size=n_out) * 0.1 if rng.random() < 0.5 else None
        m_, bias = w, np.zeros(n_out) if b is None else b
        bnp = bn_params(n_out) if with_bn else None
        if bnp is not None:
            g, beta, mu, var = bnp
            s = g / np.sqrt(var + EPS_BN)
            m_, bias = w * s, (bias - mu) * s + beta

        def fn(h):
            z = h @ w if b is None else h @ w + b[None]
            if bnp is not None:
                g_, beta_, mu_, var_ = (a[None] for a in bnp)
                z = (z - mu_) / jnp.sqrt(var_ + EPS_BN) * g_ + beta_
            return z
        return ("linear", "dense", m_, bias, fn)

    def conv(c_in, c_out):
        w = rng.normal(size=(c_out, c_in, 3)) / np.sqrt(3 * c_in)
        g, beta, mu, var = bn_params(c_out)
        s = g / np.sqrt(var + EPS_BN)
        m_ = conv1d_matrix(w * s[:, None, None], length)
        bias = np.repeat((0 - mu) * s + beta, length)

        def fn(h, length=length):
            z = jax.lax.conv_general_dilated(h.reshape(h.shape[0], c_in, length), w, (1,), "SAME",
                                             dimension_numbers=("NCH", "OIH", "NCH"))
            z = (z - mu[None, :, None]) * jax.lax.rsqrt(var[None, :, None] + EPS_BN) * g[None, :, None]
            return (z + beta[None, :, None]).reshape(h.shape[0], c_out * length)
        return ("linear", "conv", m_, bias, fn)

    for _ in range(int(rng.integers(2, 5))):
        choice = rng.choice(["dense", "conv", "res", "pool", "reshape"])
        if choice == "dense":
            n_out = chans * length
            steps += [dense(width, n_out, rng.random() < 0.7), ("relu",)]
        elif choice == "conv":
            c_out = int(rng.integers(1, 3))
            steps += [conv(chans, c_out), ("relu",)]
            chans = c_out
        elif choice == "res":
            steps.append(("res", [dense(width, width, True), ("relu",), dense(width, width, rng.random() < 0.5)]))
        elif choice == "pool" and width % 2 == 0 and length % 2 == 0:
            pool = np.zeros((width, width // 2))
            for i in range(width // 2):
                pool[2 * i:2 * i + 2, i] = 0.5
            steps.append(("linear", "pool", pool, np.zeros(width // 2),
                          lambda h: jnp.mean(h.reshape(h.shape[0], -1, 2), axis=2)))
            length //= 2
        else:
            steps.append(("reshape",))
        width = chans * length
    steps.append(dense(width, 3, False))
    return steps, width_in


def jax_net(steps):
    def run(h, steps_):
        for st in steps_:
            if st[0] == "linear":
                h = st[4](h)
            elif st[0] == "relu":
                h = jax.nn.relu(h)
            elif st[0] == "reshape":
                h = jnp.transpose(h.reshape(h.shape[0], -1, 1), (0, 2, 1)).reshape(h.shape[0], -1)
            else:
                h = h + run(h, st[1])
        return h
    return lambda x: run(x, steps)


def np_lrp(steps, x, r_out, rules):
    def forward(h, steps_):
        acts = []
        for st in steps_:
            acts.append(h)
            if st[0] == "linear":
                h = h @ st[2] + st[3]
            elif st[0] == "relu":
                h = np.maximum(h, 0)
            elif st[0] == "res":
                h = h + forward(h, st[1])[0]
        return h, acts

    def backward(steps_, acts, r):
        for st, h in zip(reversed(steps_), reversed(acts)):
            if st[0] == "linear":
                m, b = st[2], st[3]
                if rules[st[1]] == "zplus":
                    mp, mn = np.maximum(m, 0), np.minimum(m, 0)
                    hp, hn = np.maximum(h, 0), np.minimum(h, 0)
                    c = r / stab(hp @ mp + np.maximum(b, 0) + hn @ mn, 1e-6)
                    r = hp * (c @ mp.T) + hn * (c @ mn.T)
                else:  # epsilon (and Norm for pooling), stabilizer 1e-6
                    r = h * ((r / stab(h @ m + b, 1e-6)) @ m.T)
            elif st[0] == "res":
                branch_out, branch_acts = forward(h, st[1])
                total = stab(h + branch_out, 1e-6)
                r = h * r / total + backward(st[1], branch_acts, branch_out * r / total)
        return r

    _, acts = forward(x, steps)
    return backward(steps, acts, r_out)


COMPOSITES_NP = {"EPSILON_PLUS": {"dense": "epsilon", "conv": "zplus", "pool": "norm"},
                 "ZPLUS_DENSE": {"dense": "zplus", "conv": "zplus", "pool": "norm"}}


def _check_random_net(seed):
    steps, width = random_net(seed)
    x = np.random.default_rng(1000 + seed).normal(size=(2, width))
    f = jax_net(steps)
    out = np.asarray(f(x))
    t = out.argmax(axis=1)
    for name, rules in COMPOSITES_NP.items():
        comp = A.EPSILON_PLUS if name == "EPSILON_PLUS" else A.EPSILON_PLUS | {"dense": A.zplus()}
        got, report = lrp(f, x, comp, check=True)
        want = np_lrp(steps, x, np.eye(3)[t], rules)
        close(got, want, 1e-7)
        np.testing.assert_allclose(np.asarray(report.total_relevance), want.sum(axis=1), rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("seed", range(3))
def test_random_networks_are_their_rules(seed, x64):
    _check_random_net(seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(3, 40))
def test_random_networks_are_their_rules_many(seed, x64):
    _check_random_net(seed)


def test_nnx_batchnorm_in_eval_is_folded():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self):
            rngs = nnx.Rngs(0)
            self.l1, self.bn, self.l2 = nnx.Linear(3, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs), nnx.Linear(4, 2,
                                                                                                         rngs=rngs)

        def __call__(self, x):
            return self.l2(nnx.relu(self.bn(self.l1(x))))

    net = Net()
    rng = np.random.default_rng(7)
    g, beta, mu, var = (rng.uniform(0.5, 1.5, 4), rng.normal(size=4), rng.normal(size=4), rng.uniform(0.5, 2, 4))
    for var_, val in ((net.bn.scale, g), (net.bn.bias, beta), (net.bn.mean, mu), (net.bn.var, var)):
        var_[...] = jnp.asarray(val, jnp.float32)
    net.eval()
    x = rng.normal(size=(2, 3)).astype(np.float32)
    s = g / np.sqrt(var + net.bn.epsilon)
    w1, b1 = np.asarray(net.l1.kernel[...], np.float64), np.asarray(net.l1.bias[...], np.float64)
    w1f, b1f = (w1 * s).astype(np.float32), ((b1 - mu) * s + beta).astype(np.float32)
    w2, b2 = np.asarray(net.l2.kernel[...]), np.asarray(net.l2.bias[...])
    by_hand = lambda v: jax.nn.relu(v @ w1f + b1f[None]) @ w2 + b2[None]
    close(lrp(lambda v: net(v), x, A.EPSILON_PLUS_FLAT), lrp(by_hand, x, A.EPSILON_PLUS_FLAT), 1e-5)


class _ScanBlock(nn.Module):
    @nn.compact
    def __call__(self, h, _):
        a = nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(4, use_bias=False)(h)))
        return nn.relu(nn.BatchNorm(use_running_average=True)(nn.Dense(4, use_bias=False)(a)) + h), None


class _ScanNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Dense(4)(x)
        stack = nn.scan(_ScanBlock, variable_axes={"params": 0, "batch_stats": 0}, split_rngs={"params": True},
                        length=3)
        h, _ = stack()(h, None)
        return nn.Dense(2)(h)


@pytest.mark.slow
def test_a_flax_scan_stack_is_its_unrolled_blocks():
    m = _ScanNet()
    x = np.random.default_rng(0).normal(size=(2, 3)).astype(np.float32)
    v = m.init(jax.random.key(0), x)
    rng = np.random.default_rng(3)
    stats = jax.tree_util.tree_map_with_path(
        lambda p, a: jnp.asarray(rng.uniform(0.5, 1.5, a.shape) if "var" in str(p) else 0.1 * rng.normal(size=a.shape),
                                 jnp.float32), v["batch_stats"])
    p, s = v["params"], stats

    def unrolled(u):
        h = u @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"][None]
        key = next(k for k in p if k.startswith("Scan"))
        sc, ss = p[key], s[key]
        for i in range(3):
            def bn_(z, k, i=i):
                return ((z - ss[k]["mean"][i][None]) * jax.lax.rsqrt(ss[k]["var"][i][None] + 1e-5)
                        * sc[k]["scale"][i][None] + sc[k]["bias"][i][None])
            a = jax.nn.relu(bn_(h @ sc["Dense_0"]["kernel"][i], "BatchNorm_0"))
            h = jax.nn.relu(bn_(a @ sc["Dense_1"]["kernel"][i], "BatchNorm_1") + h)
        return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"][None]

    f = lambda u: m.apply({"params": p, "batch_stats": s}, u)
    close(f(x), unrolled(x), 1e-6)
    close(A.lrp(f, x, A.EPSILON_PLUS, strict=True), A.lrp(unrolled, x, A.EPSILON_PLUS, strict=True), 1e-5)
