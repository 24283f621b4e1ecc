"""gk.attribution.lrp on a ResNet (BatchNorm, residual adds, max- and mean-pooling) against Zennit, without PyTorch.

``tests/data/lrp_zennit_tiny_resnet.npz`` holds a tiny ResNet built from
torchvision's ``BasicBlock`` (stem conv3x3 3->8 + BatchNorm + ReLU + 3x3
max-pool of stride 2; ``BasicBlock(8, 8)``; ``BasicBlock(8, 16, stride 2)``
with a conv1x1 + BatchNorm shortcut; global average pooling; fc 16->5), its
weights under PyTorch's names and layouts, with random BatchNorm statistics,
4 images 3x16x16, the explained classes, the logits, and Zennit 1.0.0's
relevances with ``ResNetCanonizer`` (BatchNorm folded into the conv before
it; the residual add split in proportion to its two inputs) for three
composites, written by ``benchmarks/attribution_vs_zennit_resnet.py
--make-reference``. Here the same network is written in plain JAX
(BatchNorm written out, ``jnp.mean`` pooling), Flax linen and Equinox, and
gradkit's relevances must agree with Zennit's within 1e-4 of the map's
maximum.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

DATA = Path(__file__).parent / "data" / "lrp_zennit_tiny_resnet.npz"
EPS = 1e-5  # PyTorch's BatchNorm eps
TOL = 1e-4
COMPOSITES = {
    "EPSILON_PLUS_FLAT": gk.attribution.EPSILON_PLUS_FLAT,
    "EPSILON_ALPHA2_BETA1": gk.attribution.EPSILON_ALPHA2_BETA1,
    "EPSILON_GAMMA_BOX": gk.attribution.EPSILON_GAMMA_BOX(-3.0, 3.0),
}
BLOCKS = (("layer1.0", 1), ("layer2.0", 2))  # (name, stride); a stride-2 block has the conv1x1+BN shortcut

Model = Callable[[jax.Array], jax.Array]


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA) as f:
        return dict(f)


def _params(ref: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {k.removeprefix("param/"): jnp.asarray(v) for k, v in ref.items() if k.startswith("param/")}


def plain_twin(ref: dict[str, np.ndarray]) -> Model:
    """NCHW, OIHW kernels as stored, BatchNorm in eval mode written out."""
    p = _params(ref)

    def conv(h: jax.Array, name: str, stride: int, pad: int) -> jax.Array:
        return jax.lax.conv_general_dilated(h, p[f"{name}.weight"], (stride, stride), ((pad, pad), (pad, pad)),
                                           dimension_numbers=("NCHW", "OIHW", "NCHW"))

    def bn(h: jax.Array, name: str) -> jax.Array:
        def c(v: jax.Array) -> jax.Array:
            return v[None, :, None, None]

        return ((h - c(p[f"{name}.running_mean"])) / c(jnp.sqrt(p[f"{name}.running_var"] + EPS))
                * c(p[f"{name}.weight"]) + c(p[f"{name}.bias"]))

    def fn(x: jax.Array) -> jax.Array:
        h = jax.nn.relu(bn(conv(x, "conv1", 1, 1), "bn1"))
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, 3, 3), (1, 1, 2, 2),
                                  ((0, 0), (0, 0), (1, 1), (1, 1)))
        for name, s in BLOCKS:
            out = jax.nn.relu(bn(conv(h, f"{name}.conv1", s, 1), f"{name}.bn1"))
            out = bn(conv(out, f"{name}.conv2", 1, 1), f"{name}.bn2")
            if s == 2:
                h = bn(conv(h, f"{name}.downsample.0", s, 0), f"{name}.downsample.1")
            h = jax.nn.relu(out + h)
        return jnp.mean(h, axis=(2, 3)) @ p["fc.weight"].T + p["fc.bias"][None, :]

    return fn


def flax_twin(ref: dict[str, np.ndarray]) -> Model:
    """Flax linen on NHWC: ``nn.Conv``, ``nn.BatchNorm(use_running_average=True)``, ``nn.max_pool``."""
    nn = pytest.importorskip("flax.linen")
    p = _params(ref)

    def conv(name: str, stride: int, pad: int) -> nn.Conv:
        o, _, k, _ = p[f"{name}.weight"].shape
        return nn.Conv(o, (k, k), stride, padding=pad, use_bias=False, name=name.replace(".", "_"))

    def bn(name: str) -> nn.BatchNorm:
        return nn.BatchNorm(use_running_average=True, epsilon=EPS, name=name.replace(".", "_"))

    class ResNet(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = nn.relu(bn("bn1")(conv("conv1", 1, 1)(x)))
            h = nn.max_pool(h, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
            for name, s in BLOCKS:
                out = nn.relu(bn(f"{name}.bn1")(conv(f"{name}.conv1", s, 1)(h)))
                out = bn(f"{name}.bn2")(conv(f"{name}.conv2", 1, 1)(out))
                if s == 2:
                    h = bn(f"{name}.downsample.1")(conv(f"{name}.downsample.0", s, 0)(h))
                h = nn.relu(out + h)
            return nn.Dense(5, name="fc")(jnp.mean(h, axis=(1, 2)))

    params: dict[str, dict[str, jax.Array]] = {"fc": {"kernel": p["fc.weight"].T, "bias": p["fc.bias"]}}
    stats: dict[str, dict[str, jax.Array]] = {}
    for key, v in p.items():
        layer, _, leaf = key.rpartition(".")
        flax_name = layer.replace(".", "_")
        if leaf == "weight" and v.ndim == 4:
            params[flax_name] = {"kernel": jnp.transpose(v, (2, 3, 1, 0))}
        elif layer != "fc" and leaf in ("weight", "bias"):
            params.setdefault(flax_name, {})["scale" if leaf == "weight" else "bias"] = v
        elif leaf in ("running_mean", "running_var"):
            stats.setdefault(flax_name, {})["mean" if leaf == "running_mean" else "var"] = v
    variables = {"params": params, "batch_stats": stats}
    return lambda x: ResNet().apply(variables, jnp.transpose(x, (0, 2, 3, 1)))


def equinox_twin(ref: dict[str, np.ndarray]) -> Model:
    """Equinox on one CHW image (vmapped): ``eqx.nn.Conv2d``, ``eqx.nn.BatchNorm`` in inference mode."""
    eqx = pytest.importorskip("equinox")
    p = _params(ref)
    key = jax.random.key(0)
    stats = []

    def conv(name: str, stride: int, pad: int) -> eqx.nn.Conv2d:
        o, i, k, _ = p[f"{name}.weight"].shape
        c = eqx.nn.Conv2d(i, o, k, stride, pad, use_bias=False, key=key)
        return eqx.tree_at(lambda m: m.weight, c, p[f"{name}.weight"])

    def bn(name: str) -> eqx.nn.BatchNorm:
        b = eqx.nn.BatchNorm(p[f"{name}.weight"].shape[0], "batch", eps=EPS, mode="ema", inference=True)
        stats.append((b.ema_state_index, (p[f"{name}.running_mean"], p[f"{name}.running_var"])))
        return eqx.tree_at(lambda m: (m.weight, m.bias), b, (p[f"{name}.weight"], p[f"{name}.bias"]))

    layers = {"conv1": conv("conv1", 1, 1), "bn1": bn("bn1")}
    for name, s in BLOCKS:
        layers |= {f"{name}.conv1": conv(f"{name}.conv1", s, 1), f"{name}.bn1": bn(f"{name}.bn1"),
                   f"{name}.conv2": conv(f"{name}.conv2", 1, 1), f"{name}.bn2": bn(f"{name}.bn2")}
        if s == 2:
            layers |= {f"{name}.down": conv(f"{name}.downsample.0", s, 0), f"{name}.dbn": bn(f"{name}.downsample.1")}
    lin = eqx.nn.Linear(16, 5, key=key)
    layers["fc"] = eqx.tree_at(lambda m: (m.weight, m.bias), lin, (p["fc.weight"], p["fc.bias"]))
    pool = eqx.nn.MaxPool2d(3, 2, padding=1)
    state = eqx.nn.State(layers)
    for index, value in stats:
        state = state.set(index, value)

    def one(x: jax.Array) -> jax.Array:
        def bn_(name: str, h: jax.Array) -> jax.Array:
            return layers[name](h, state)[0]

        h = pool(jax.nn.relu(bn_("bn1", layers["conv1"](x))))
        for name, s in BLOCKS:
            out = jax.nn.relu(bn_(f"{name}.bn1", layers[f"{name}.conv1"](h)))
            out = bn_(f"{name}.bn2", layers[f"{name}.conv2"](out))
            if s == 2:
                h = bn_(f"{name}.dbn", layers[f"{name}.down"](h))
            h = jax.nn.relu(out + h)
        return layers["fc"](jnp.mean(h, axis=(1, 2)))

    return jax.vmap(one, axis_name="batch")


TWINS = {"plain": plain_twin, "flax": flax_twin, "equinox": equinox_twin}


def _rel(ours: jax.Array, theirs: np.ndarray) -> float:
    return float(np.max(np.abs(np.asarray(ours, np.float64) - theirs)) / np.max(np.abs(theirs)))


@pytest.mark.parametrize("twin", ["plain", pytest.param("flax", marks=pytest.mark.slow),
                                  pytest.param("equinox", marks=pytest.mark.slow)])
def test_twins_reproduce_the_stored_logits(ref: dict[str, np.ndarray], twin: str) -> None:
    # The twins read the stored weights as PyTorch computed with them, or nothing below means anything.
    assert _rel(jax.jit(TWINS[twin](ref))(jnp.asarray(ref["x"])), ref["logits"]) < 1e-5


def test_the_stored_maps_tell_the_composites_apart(ref: dict[str, np.ndarray]) -> None:
    # The tolerance separates: Zennit's composites differ from each other by far more than it, and their ΣR per
    # image is ≈ 1 (the one-hot seed, less what biases and ε absorb), not the 14-46 of unfolded BatchNorm.
    maps = [ref[f"relevance/{name}"] for name in COMPOSITES]
    for i, a in enumerate(maps):
        for b in maps[i + 1:]:
            assert _rel(a, b) > 100 * TOL
    for name in COMPOSITES:
        np.testing.assert_allclose(ref[f"sum/{name}"], ref[f"relevance/{name}"].sum(axis=(1, 2, 3)), rtol=1e-4)
        assert np.all((ref[f"sum/{name}"] > 0.25) & (ref[f"sum/{name}"] < 2.0))


@pytest.mark.parametrize(("name", "jit"), [(name, True) for name in COMPOSITES]
                         + [pytest.param("EPSILON_PLUS_FLAT", False, marks=pytest.mark.slow)],
                         ids=[*COMPOSITES, "EPSILON_PLUS_FLAT-eager"])
def test_lrp_on_a_resnet_equals_zennit_with_resnet_canonizer(ref: dict[str, np.ndarray], name: str,
                                                             jit: bool) -> None:
    fn = plain_twin(ref)
    x, target = jnp.asarray(ref["x"]), jnp.asarray(ref["target"])

    def explain(v: jax.Array, t: jax.Array) -> jax.Array:
        return gk.attribution.lrp(fn, v, COMPOSITES[name], target=t)

    r = (jax.jit(explain) if jit else explain)(x, target)
    assert r.shape == x.shape
    assert _rel(r, ref[f"relevance/{name}"]) <= TOL
    scale = float(np.max(np.abs(ref[f"sum/{name}"])))
    np.testing.assert_allclose(np.asarray(r, np.float64).sum(axis=(1, 2, 3)), ref[f"sum/{name}"],
                               atol=TOL * scale * 10)


@pytest.mark.slow
@pytest.mark.parametrize("twin", ["flax", "equinox"])
def test_flax_and_equinox_resnets_equal_zennit_too(ref: dict[str, np.ndarray], twin: str) -> None:
    # BatchNorm as the libraries write it (linen's and Equinox's modules in inference mode) folds like the
    # written-out one.
    fn = TWINS[twin](ref)
    name = "EPSILON_PLUS_FLAT"
    r = jax.jit(lambda v, t: gk.attribution.lrp(fn, v, COMPOSITES[name], target=t))(
        jnp.asarray(ref["x"]), jnp.asarray(ref["target"]))
    assert _rel(r, ref[f"relevance/{name}"]) <= TOL


def test_without_folding_the_reference_is_far(ref: dict[str, np.ndarray]) -> None:
    # The control: with canonize=False, BatchNorm passes relevance through unfolded, and the stored maps must
    # catch it (ΣR far from Zennit's too).
    fn = plain_twin(ref)
    name = "EPSILON_PLUS_FLAT"
    with pytest.warns(gk.GradkitWarning, match="no LRP rule"):  # the unfolded BatchNorm's ops are named
        r = jax.jit(lambda v, t: gk.attribution.lrp(fn, v, COMPOSITES[name], target=t, canonize=False))(
            jnp.asarray(ref["x"]), jnp.asarray(ref["target"]))
    assert _rel(r, ref[f"relevance/{name}"]) > 100 * TOL
