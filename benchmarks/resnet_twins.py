"""JAX twins of torchvision's ResNet (BasicBlocks) and VGG-BN: plain JAX, Flax linen and Equinox, from PyTorch weights.

Used by ``attribution_vs_zennit_resnet.py``; imports no PyTorch. Each builder
takes the model's ``state_dict`` as NumPy arrays (PyTorch's names and layouts:
conv OIHW, linear (out, in), BatchNorm ``weight``/``bias``/``running_mean``/
``running_var``) and returns the model as a function of an NCHW batch.

The ResNet layout is read from the names: a stem ``conv1``/``bn1`` (stride 2
for a 7x7 kernel, else 1), a 3x3 max-pool of stride 2, blocks
``layer{i}.{j}`` with ``conv1``/``bn1``/``conv2``/``bn2`` and, where the
block has a ``downsample.0``/``downsample.1`` shortcut, stride 2; a global
mean and ``fc``. So torchvision's ``resnet18`` and a tiny ResNet built from
its ``BasicBlock`` both fit. BatchNorm is in eval mode (running statistics,
eps 1e-5) in each spelling: written out, ``flax.linen.BatchNorm`` and
``equinox.nn.BatchNorm`` in inference mode.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Params = dict[str, np.ndarray]
JaxModel = Callable[[jax.Array], jax.Array]

BN_EPS = 1e-5
#: torchvision's VGG-16 feature configuration ("M": 2x2 max-pool).
VGG16: list[int | str] = [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"]


def resnet_blocks(p: Params) -> list[str]:
    """The block names ``layer{i}.{j}`` in execution order."""
    found = {(int(m[1]), int(m[2])) for k in p if (m := re.match(r"layer(\d+)\.(\d+)\.", k))}
    return [f"layer{i}.{j}" for i, j in sorted(found)]


def _stem_stride(p: Params) -> int:
    return 2 if p["conv1.weight"].shape[-1] == 7 else 1


def _block_stride(p: Params, name: str) -> int:
    return 2 if f"{name}.downsample.0.weight" in p else 1


def _bins(size: int, out: int) -> list[tuple[int, int]]:
    """PyTorch's adaptive pooling windows: [floor(i*size/out), ceil((i+1)*size/out))."""
    return [(i * size // out, -((-(i + 1) * size) // out)) for i in range(out)]


def adaptive_avg_pool(h: jax.Array, out: int, axes: tuple[int, int]) -> jax.Array:
    """``nn.AdaptiveAvgPool2d(out)`` as one ``jnp.mean`` per window and axis, concatenated.

    (``jnp.mean(..., keepdims=True)`` would be the shorter spelling; gradkit's LRP does not recognise it yet.)
    """
    for axis in axes:
        parts = [jnp.expand_dims(jnp.mean(jax.lax.slice_in_dim(h, a, b, axis=axis), axis=axis), axis)
                 for a, b in _bins(h.shape[axis], out)]
        h = jnp.concatenate(parts, axis=axis)
    return h


# --------------------------------------------------------------------------------------------------------------
# Plain JAX, NCHW, BatchNorm written out.
# --------------------------------------------------------------------------------------------------------------

def _conv(h: jax.Array, w: jax.Array, stride: int, pad: int, b: jax.Array | None = None) -> jax.Array:
    y = jax.lax.conv_general_dilated(h, w, (stride, stride), ((pad, pad), (pad, pad)),
                                     dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y if b is None else y + b[None, :, None, None]


def _bn(h: jax.Array, p: dict[str, jax.Array], name: str) -> jax.Array:
    def c(v: jax.Array) -> jax.Array:
        return v[None, :, None, None]

    scale = p[f"{name}.weight"] / jnp.sqrt(p[f"{name}.running_var"] + BN_EPS)
    return (h - c(p[f"{name}.running_mean"])) * c(scale) + c(p[f"{name}.bias"])


def _max_pool(h: jax.Array, k: int, s: int, pad: int) -> jax.Array:
    return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, k, k), (1, 1, s, s),
                                 ((0, 0), (0, 0), (pad, pad), (pad, pad)))


def jax_resnet(params: Params) -> JaxModel:
    """The ResNet in plain JAX on NCHW images (OIHW kernels as they are, ``jnp.mean`` global pooling)."""
    p = {k: jnp.asarray(v) for k, v in params.items()}
    k = p["conv1.weight"].shape[-1]

    def fn(x: jax.Array) -> jax.Array:
        h = jax.nn.relu(_bn(_conv(x, p["conv1.weight"], _stem_stride(params), k // 2), p, "bn1"))
        h = _max_pool(h, 3, 2, 1)
        for name in resnet_blocks(params):
            s = _block_stride(params, name)
            out = jax.nn.relu(_bn(_conv(h, p[f"{name}.conv1.weight"], s, 1), p, f"{name}.bn1"))
            out = _bn(_conv(out, p[f"{name}.conv2.weight"], 1, 1), p, f"{name}.bn2")
            if f"{name}.downsample.0.weight" in p:
                h = _bn(_conv(h, p[f"{name}.downsample.0.weight"], s, 0), p, f"{name}.downsample.1")
            h = jax.nn.relu(out + h)
        h = jnp.mean(h, axis=(2, 3))
        return h @ p["fc.weight"].T + p["fc.bias"]

    return fn


def _vgg_features(cfg: list[int | str]) -> list[tuple[int, int] | None]:
    """(conv index, BatchNorm index) in ``features`` per conv, ``None`` per max-pool."""
    out: list[tuple[int, int] | None] = []
    i = 0
    for v in cfg:
        if v == "M":
            out.append(None)
            i += 1
        else:
            out.append((i, i + 1))
            i += 3  # conv, BatchNorm, ReLU
    return out


def jax_vgg(params: Params, cfg: list[int | str] = VGG16) -> JaxModel:
    """torchvision's VGG-BN in plain JAX (NCHW); the adaptive 7x7 average pooling as per-window means."""
    p = {k: jnp.asarray(v) for k, v in params.items()}

    def fn(x: jax.Array) -> jax.Array:
        h = x
        for layer in _vgg_features(cfg):
            if layer is None:
                h = _max_pool(h, 2, 2, 0)
            else:
                c, b = layer
                h = jax.nn.relu(_bn(_conv(h, p[f"features.{c}.weight"], 1, 1, p[f"features.{c}.bias"]), p,
                                    f"features.{b}"))
        h = adaptive_avg_pool(h, 7, (2, 3)).reshape(h.shape[0], -1)
        h = jax.nn.relu(h @ p["classifier.0.weight"].T + p["classifier.0.bias"])
        h = jax.nn.relu(h @ p["classifier.3.weight"].T + p["classifier.3.bias"])
        return h @ p["classifier.6.weight"].T + p["classifier.6.bias"]

    return fn


# --------------------------------------------------------------------------------------------------------------
# Flax linen, NHWC.
# --------------------------------------------------------------------------------------------------------------

def _flax_vars(params: Params, convs: list[str], bns: list[str], denses: list[str]) -> dict[str, Any]:
    """Flax variables under the PyTorch names with '.' -> '_' (kernels HWIO and (in, out))."""
    ps: dict[str, Any] = {}
    stats: dict[str, Any] = {}
    for n in convs:
        ps[n.replace(".", "_")] = {"kernel": jnp.asarray(np.transpose(params[f"{n}.weight"], (2, 3, 1, 0)))}
        if f"{n}.bias" in params:
            ps[n.replace(".", "_")]["bias"] = jnp.asarray(params[f"{n}.bias"])
    for n in bns:
        ps[n.replace(".", "_")] = {"scale": jnp.asarray(params[f"{n}.weight"]),
                                   "bias": jnp.asarray(params[f"{n}.bias"])}
        stats[n.replace(".", "_")] = {"mean": jnp.asarray(params[f"{n}.running_mean"]),
                                      "var": jnp.asarray(params[f"{n}.running_var"])}
    for n in denses:
        ps[n.replace(".", "_")] = {"kernel": jnp.asarray(params[f"{n}.weight"].T),
                                   "bias": jnp.asarray(params[f"{n}.bias"])}
    return {"params": ps, "batch_stats": stats}


def flax_resnet(params: Params) -> JaxModel:
    """The ResNet as a Flax linen module (``nn.BatchNorm(use_running_average=True)``), a function of NCHW ``x``."""
    import flax.linen as fnn

    blocks = resnet_blocks(params)
    k = params["conv1.weight"].shape[-1]

    def conv(name: str, stride: int, pad: int) -> Any:
        o, _, kh, kw = params[f"{name}.weight"].shape
        return fnn.Conv(o, (kh, kw), (stride, stride), padding=pad, use_bias=False, name=name.replace(".", "_"))

    def bn(name: str) -> Any:
        return fnn.BatchNorm(use_running_average=True, epsilon=BN_EPS, name=name.replace(".", "_"))

    class ResNet(fnn.Module):
        @fnn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = fnn.relu(bn("bn1")(conv("conv1", _stem_stride(params), k // 2)(x)))
            h = fnn.max_pool(h, (3, 3), (2, 2), padding=((1, 1), (1, 1)))
            for name in blocks:
                s = _block_stride(params, name)
                out = fnn.relu(bn(f"{name}.bn1")(conv(f"{name}.conv1", s, 1)(h)))
                out = bn(f"{name}.bn2")(conv(f"{name}.conv2", 1, 1)(out))
                if f"{name}.downsample.0.weight" in params:
                    h = bn(f"{name}.downsample.1")(conv(f"{name}.downsample.0", s, 0)(h))
                h = fnn.relu(out + h)
            h = jnp.mean(h, axis=(1, 2))
            return fnn.Dense(params["fc.weight"].shape[0], name="fc")(h)

    convs = ["conv1"] + [f"{b}.{c}" for b in blocks for c in ("conv1", "conv2", "downsample.0")
                         if f"{b}.{c}.weight" in params]
    bns = ["bn1"] + [f"{b}.{c}" for b in blocks for c in ("bn1", "bn2", "downsample.1") if f"{b}.{c}.weight" in params]
    variables = _flax_vars(params, convs, bns, ["fc"])
    module = ResNet()
    return lambda x: module.apply(variables, jnp.transpose(x, (0, 2, 3, 1)))


def flax_vgg(params: Params, cfg: list[int | str] = VGG16) -> JaxModel:
    """VGG-BN as a Flax linen module on NHWC, a function of NCHW ``x``."""
    import flax.linen as fnn

    layers = _vgg_features(cfg)

    class VGG(fnn.Module):
        @fnn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = x
            for layer in layers:
                if layer is None:
                    h = fnn.max_pool(h, (2, 2), (2, 2))
                    continue
                c, b = layer
                o = params[f"features.{c}.weight"].shape[0]
                h = fnn.Conv(o, (3, 3), padding=1, name=f"features_{c}")(h)
                h = fnn.relu(fnn.BatchNorm(use_running_average=True, epsilon=BN_EPS, name=f"features_{b}")(h))
            h = adaptive_avg_pool(h, 7, (1, 2))
            h = jnp.transpose(h, (0, 3, 1, 2)).reshape(h.shape[0], -1)  # PyTorch's (C, H, W) flatten order
            for i in (0, 3):
                h = fnn.relu(fnn.Dense(params[f"classifier.{i}.weight"].shape[0], name=f"classifier_{i}")(h))
            return fnn.Dense(params["classifier.6.weight"].shape[0], name="classifier_6")(h)

    convs = [f"features.{c}" for layer in layers if layer is not None for c in layer[:1]]
    bns = [f"features.{layer[1]}" for layer in layers if layer is not None]
    variables = _flax_vars(params, convs, bns, ["classifier.0", "classifier.3", "classifier.6"])
    module = VGG()
    return lambda x: module.apply(variables, jnp.transpose(x, (0, 2, 3, 1)))


# --------------------------------------------------------------------------------------------------------------
# Equinox, one unbatched CHW image at a time (vmapped), eqx.nn.BatchNorm in inference mode.
# --------------------------------------------------------------------------------------------------------------

def _eqx_layers(params: Params) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], list[Any]]:
    import equinox as eqx

    key = jax.random.key(0)
    states: list[Any] = []  # (state index, (mean, var)) of each BatchNorm

    def conv(name: str, stride: int, pad: int) -> Any:
        w = params[f"{name}.weight"]
        o, i, kh, _ = w.shape
        has_b = f"{name}.bias" in params
        c = eqx.nn.Conv2d(i, o, kh, stride, pad, use_bias=has_b, key=key)
        c = eqx.tree_at(lambda m: m.weight, c, jnp.asarray(w))
        if has_b:
            c = eqx.tree_at(lambda m: m.bias, c, jnp.asarray(params[f"{name}.bias"]).reshape(o, 1, 1))
        return c

    def bn(name: str) -> Any:
        n = params[f"{name}.weight"].shape[0]
        b = eqx.nn.BatchNorm(n, "batch", eps=BN_EPS, mode="ema", inference=True)
        b = eqx.tree_at(lambda m: (m.weight, m.bias), b, (jnp.asarray(params[f"{name}.weight"]),
                                                          jnp.asarray(params[f"{name}.bias"])))
        states.append((b.ema_state_index, (jnp.asarray(params[f"{name}.running_mean"]),
                                           jnp.asarray(params[f"{name}.running_var"]))))
        return b

    def linear(name: str) -> Any:
        o, i = params[f"{name}.weight"].shape
        lin = eqx.nn.Linear(i, o, key=key)
        return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (jnp.asarray(params[f"{name}.weight"]),
                                                               jnp.asarray(params[f"{name}.bias"])))

    return conv, bn, linear, states


def _eqx_batched(model: Any, states: list[Any]) -> JaxModel:
    import equinox as eqx

    state = eqx.nn.State(model)
    for index, value in states:
        state = state.set(index, value)
    return lambda x: jax.vmap(lambda xi: model(xi, state), axis_name="batch")(x)


def eqx_resnet(params: Params) -> JaxModel:
    """The ResNet as an Equinox module (``eqx.nn.Conv2d``, ``eqx.nn.BatchNorm``, ``eqx.nn.MaxPool2d``)."""
    import equinox as eqx

    conv, bn, linear, states = _eqx_layers(params)
    k = params["conv1.weight"].shape[-1]

    class Block(eqx.Module):
        c1: Any
        b1: Any
        c2: Any
        b2: Any
        down: tuple[Any, Any] | None

        def __call__(self, x: jax.Array, state: Any) -> jax.Array:
            out = jax.nn.relu(self.b1(self.c1(x), state)[0])
            out = self.b2(self.c2(out), state)[0]
            if self.down is not None:
                x = self.down[1](self.down[0](x), state)[0]
            return jax.nn.relu(out + x)

    class ResNet(eqx.Module):
        stem: Any
        stem_bn: Any
        pool: Any
        blocks: list[Block]
        fc: Any

        def __call__(self, x: jax.Array, state: Any) -> jax.Array:
            h = self.pool(jax.nn.relu(self.stem_bn(self.stem(x), state)[0]))
            for block in self.blocks:
                h = block(h, state)
            return self.fc(jnp.mean(h, axis=(1, 2)))

    blocks = []
    for name in resnet_blocks(params):
        s = _block_stride(params, name)
        down = ((conv(f"{name}.downsample.0", s, 0), bn(f"{name}.downsample.1"))
                if f"{name}.downsample.0.weight" in params else None)
        blocks.append(Block(conv(f"{name}.conv1", s, 1), bn(f"{name}.bn1"), conv(f"{name}.conv2", 1, 1),
                            bn(f"{name}.bn2"), down))
    model = ResNet(conv("conv1", _stem_stride(params), k // 2), bn("bn1"), eqx.nn.MaxPool2d(3, 2, padding=1),
                   blocks, linear("fc"))
    return _eqx_batched(model, states)


def eqx_vgg(params: Params, cfg: list[int | str] = VGG16) -> JaxModel:
    """VGG-BN as an Equinox module."""
    import equinox as eqx

    conv, bn, linear, states = _eqx_layers(params)

    class VGG(eqx.Module):
        features: list[Any]
        classifier: list[Any]

        def __call__(self, x: jax.Array, state: Any) -> jax.Array:
            h = x
            for layer in self.features:
                h = layer(h) if isinstance(layer, eqx.nn.MaxPool2d) else jax.nn.relu(layer[1](layer[0](h), state)[0])
            h = adaptive_avg_pool(h, 7, (1, 2)).reshape(-1)
            h = jax.nn.relu(self.classifier[0](h))
            h = jax.nn.relu(self.classifier[1](h))
            return self.classifier[2](h)

    features: list[Any] = [eqx.nn.MaxPool2d(2, 2) if layer is None else
                           (conv(f"features.{layer[0]}", 1, 1), bn(f"features.{layer[1]}"))
                           for layer in _vgg_features(cfg)]
    model = VGG(features, [linear(f"classifier.{i}") for i in (0, 3, 6)])
    return _eqx_batched(model, states)


TWINS: dict[str, dict[str, Callable[[Params], JaxModel]]] = {
    "resnet": {"jax": jax_resnet, "flax": flax_resnet, "equinox": eqx_resnet},
    "vgg": {"jax": jax_vgg, "flax": flax_vgg, "equinox": eqx_vgg},
}
