"""gk.attribution.lrp against Zennit with its canonizers on ResNet-18 and VGG-16-BN: same weights, same heatmaps?

A reference comparison for issue 36, not part of CI and not a test. It needs
PyTorch, torchvision and Zennit next to JAX, so it runs from a separate
virtual environment (kept outside the repository), e.g., from the
repository's root::

    python3.13 -m venv ../venv-zennit   # Python >= 3.11.11: Zennit 1.0.0 (older Pythons get 0.5.1)
    ../venv-zennit/bin/pip install torch==2.14.1 torchvision==0.29.1 zennit==1.0.0 jax flax equinox
    PYTHONPATH=. ../venv-zennit/bin/python benchmarks/attribution_vs_zennit_resnet.py [--quick] [--out PATH]

(PyPI's torch for Python 3.13 is the CUDA build, and PyPI's torchvision
imports beside it; beside a CPU-only torch it does not. JAX, Flax and Equinox
may instead come from the project's environment through ``PYTHONPATH``, as
in ``attribution_vs_zennit.py``.)

What it does:

1. Builds torchvision's ``resnet18`` (batch 8 at 3x224x224) and
   ``vgg16_bn`` (batch 8 at 3x64x64), seeded random weights, every
   BatchNorm's running mean and variance, scale and shift randomised, eval
   mode, float32; and the same networks with the same weights in plain JAX
   (NCHW convolutions, BatchNorm written out, ``jnp.mean`` global pooling),
   Flax linen (``nn.BatchNorm(use_running_average=True)``) and Equinox
   (``eqx.nn.BatchNorm`` in inference mode), from ``resnet_twins.py``.
2. Explains each image's top class with every LRP composite of
   ``gk.attribution`` and Zennit's composite of the same name with
   ``ResNetCanonizer`` / ``VGGCanonizer`` (BatchNorm folded into the conv
   before it, the residual add as a ``Sum`` with the Norm rule), and reports
   ``max |gradkit - zennit| / max |zennit|`` per composite, model and twin
   (goal <= 1e-4), with ΣR per image beside Zennit's. A control row: gradkit
   with ``canonize=False`` (where ``lrp`` has that option) against Zennit.
   With ``--float64``, both libraries again in float64 (plain-JAX twin), and
   Zennit's float32 maps against its float64 ones: float32's own error on
   the same network, the scale against which to read the float32 rows.
3. Times one batch under ``jax.jit``: each composite against plain
   ``jax.grad`` of the same model (same process) and against Zennit's
   composite in PyTorch at 1 thread and at the core count (medians of
   interleaved repeats) — measured rows, not gates.
4. Prints Markdown tables and writes JSON to ``--out`` (default
   ``benchmarks/results_attribution_vs_zennit_resnet.json``, gitignored).

Memory: every jitted function keeps its model's weights (VGG-16's are
0.55 GB) as constants, so the whole run, three twins of both models, holds
over 10 GB. On a 24 GB machine shared with others, run one model at a time
(``--models resnet``, then ``--models vgg``), and time with ``--twins jax``.

``--make-reference`` instead writes ``tests/data/lrp_zennit_tiny_resnet.npz``:
a tiny ResNet built from torchvision's ``BasicBlock`` (8 and 16 channels,
4 images 3x16x16), its weights, the images, the targets, the logits and
Zennit's relevances (with ``ResNetCanonizer``) for three composites, which
``tests/test_lrp_vs_zennit.py`` compares against without PyTorch.
"""

from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torchvision
import zennit.attribution as zattr
import zennit.composites as zcomp
import zennit.torchvision as ztv
from torch import nn
from torchvision.models.resnet import BasicBlock

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import resnet_twins as twins
from common import environment as versions
from common import samples, write_json

import gradkit as gk

jax.config.update("jax_enable_x64", False)

GOAL = 1e-4
BOX = (-3.0, 3.0)  # EpsilonGammaBox's bounds: the images are standard normal
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_OUT = os.path.join(HERE, "results_attribution_vs_zennit_resnet.json")
REFERENCE = os.path.join(os.path.dirname(HERE), "tests", "data", "lrp_zennit_tiny_resnet.npz")

#: gradkit's composite name -> (gradkit's composite, Zennit's class name, its keyword arguments).
COMPOSITES: dict[str, tuple[Any, str, dict[str, Any]]] = {
    "EPSILON_PLUS": (gk.attribution.EPSILON_PLUS, "EpsilonPlus", {}),
    "EPSILON_PLUS_FLAT": (gk.attribution.EPSILON_PLUS_FLAT, "EpsilonPlusFlat", {}),
    "EPSILON_ALPHA2_BETA1": (gk.attribution.EPSILON_ALPHA2_BETA1, "EpsilonAlpha2Beta1", {}),
    "EPSILON_ALPHA2_BETA1_FLAT": (gk.attribution.EPSILON_ALPHA2_BETA1_FLAT, "EpsilonAlpha2Beta1Flat", {}),
    "EPSILON_GAMMA_BOX": (gk.attribution.EPSILON_GAMMA_BOX(*BOX), "EpsilonGammaBox", {"low": BOX[0], "high": BOX[1]}),
}
#: the composites stored for the test (one of each rule family).
REFERENCE_COMPOSITES = ("EPSILON_PLUS_FLAT", "EPSILON_ALPHA2_BETA1", "EPSILON_GAMMA_BOX")
CANONIZERS = {"resnet": ztv.ResNetCanonizer, "vgg": ztv.VGGCanonizer}
HAS_CANONIZE = "canonize" in inspect.signature(gk.attribution.lrp).parameters


# --------------------------------------------------------------------------------------------------------------
# The PyTorch models.
# --------------------------------------------------------------------------------------------------------------

def randomize_batch_norm(model: nn.Module, seed: int) -> None:
    """Random running statistics, scale and shift for every BatchNorm (fresh ones would be the identity)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                n = m.num_features
                m.running_mean.copy_(0.2 * torch.randn(n, generator=g))
                m.running_var.copy_(0.5 + 1.5 * torch.rand(n, generator=g))
                m.weight.copy_(0.5 + torch.rand(n, generator=g))
                m.bias.copy_(0.1 * torch.randn(n, generator=g))


def torch_model(kind: str, seed: int = 0) -> nn.Module:
    """torchvision's ``resnet18`` or ``vgg16_bn``, seeded random weights, randomised BatchNorm, eval mode."""
    torch.manual_seed(seed)
    model = torchvision.models.resnet18() if kind == "resnet" else torchvision.models.vgg16_bn()
    randomize_batch_norm(model, seed + 1)
    return model.float().eval()


class TinyResNet(nn.Module):
    """torchvision's ResNet layout with tiny widths: stem conv3x3 3->8, BN, ReLU, max-pool 3/2;
    ``BasicBlock(8, 8)``; ``BasicBlock(8, 16, stride 2)`` with a conv1x1+BN shortcut; global mean; fc 16->classes."""

    def __init__(self, classes: int = 5) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = nn.Sequential(BasicBlock(8, 8))
        down = nn.Sequential(nn.Conv2d(8, 16, 1, 2, bias=False), nn.BatchNorm2d(16))
        self.layer2 = nn.Sequential(BasicBlock(8, 16, 2, down))
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, classes)
        with torch.no_grad():  # He-normal weights as torchvision's ResNet (PyTorch's default is far smaller)
            for m in self.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            nn.init.uniform_(self.fc.bias, -0.1, 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        h = self.layer2(self.layer1(h))
        return self.fc(torch.flatten(self.avgpool(h), 1))


def state(model: nn.Module) -> dict[str, np.ndarray]:
    """The model's ``state_dict`` as NumPy arrays (without BatchNorm's batch counters)."""
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()
            if not k.endswith("num_batches_tracked")}


def zennit_lrp(model: nn.Module, kind: str, composite: str, x: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Zennit's composite with the model's canonizer, seeded with the one-hot of ``target``."""
    name, kwargs = COMPOSITES[composite][1:]
    comp = getattr(zcomp, name)(canonizers=[CANONIZERS[kind]()], **kwargs)
    inp = torch.from_numpy(x).clone().requires_grad_(True)
    with zattr.Gradient(model=model, composite=comp) as attributor:
        out, rel = attributor(inp, lambda o: nn.functional.one_hot(torch.from_numpy(target), o.shape[-1]).to(o.dtype))
    return rel.detach().numpy().copy()


def rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    """``max |ours - ref| / max |ref|``."""
    return float(np.max(np.abs(np.asarray(ours, np.float64) - ref))) / float(np.max(np.abs(ref)))


def per_image_sum(r: np.ndarray) -> list[float]:
    return [float(v) for v in np.asarray(r, np.float64).reshape(r.shape[0], -1).sum(axis=1)]


# --------------------------------------------------------------------------------------------------------------
# Agreement and timing.
# --------------------------------------------------------------------------------------------------------------

def gk_lrp(fn: twins.JaxModel, composite: Any, **kw: Any) -> Callable[[jax.Array, jax.Array], jax.Array]:
    return jax.jit(lambda v, t: gk.attribution.lrp(fn, v, composite, target=t, **kw))


def agreement(kind: str, model: nn.Module, jax_models: dict[str, twins.JaxModel], x: np.ndarray,
              target: np.ndarray, composites: list[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of the agreement table, and of the ΣR table (gradkit's plain-JAX twin beside Zennit)."""
    rows: list[dict[str, Any]] = []
    sums: list[dict[str, Any]] = []
    xj, tj = jnp.asarray(x), jnp.asarray(target, jnp.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).numpy()
    for twin, fn in jax_models.items():
        rows.append({"model": kind, "composite": "forward (logits)", "twin": twin,
                     "rel_diff": rel_diff(np.asarray(jax.jit(fn)(xj)), logits),
                     "max_abs_ref": float(abs(logits).max())})
    refs = {}
    for name in composites:
        ref = refs[name] = zennit_lrp(model, kind, name, x, target)
        for twin, fn in jax_models.items():
            try:
                ours = np.asarray(gk_lrp(fn, COMPOSITES[name][0])(xj, tj))
            except Exception as e:
                rows.append({"model": kind, "composite": name, "twin": twin, "rel_diff": float("nan"),
                             "max_abs_ref": float(abs(ref).max()), "error": f"{type(e).__name__}: {e}"[:300]})
                continue
            rows.append({"model": kind, "composite": name, "twin": twin, "rel_diff": rel_diff(ours, ref),
                         "max_abs_ref": float(abs(ref).max())})
            if twin == "jax":
                sums.append({"model": kind, "composite": name, "gradkit": per_image_sum(ours),
                             "zennit": per_image_sum(ref)})
    if HAS_CANONIZE:  # the control: without folding, gradkit must be far from Zennit
        name = "EPSILON_PLUS_FLAT" if "EPSILON_PLUS_FLAT" in refs else next(iter(refs))
        with warnings.catch_warnings():  # its warning names the unfolded BatchNorm's ops: expected here
            warnings.simplefilter("ignore", gk.GradkitWarning)
            ours = np.asarray(gk_lrp(jax_models["jax"], COMPOSITES[name][0], canonize=False)(xj, tj))
        rows.append({"model": kind, "composite": f"{name}, canonize=False (control)", "twin": "jax",
                     "rel_diff": rel_diff(ours, refs[name]), "max_abs_ref": float(abs(refs[name]).max()),
                     "control": True})
        sums.append({"model": kind, "composite": f"{name}, canonize=False", "gradkit": per_image_sum(ours),
                     "zennit": per_image_sum(refs[name])})
    return rows, sums


def float64_rows(kind: str, x: np.ndarray, target: np.ndarray, composites: list[str]) -> list[dict[str, Any]]:
    """Float32 rounding or a different rule? Both libraries in float64 (a fresh model: Zennit's canonizers leave
    instance attributes on a model that ``.to(float64)`` does not convert), and Zennit float32 against float64."""
    rows: list[dict[str, Any]] = []
    model32 = torch_model(kind)
    model64 = torch_model(kind).double()
    jax.config.update("jax_enable_x64", True)
    try:
        fn = twins.TWINS[kind]["jax"](state(model64))
        x64 = x.astype(np.float64)
        for name in composites:
            ref64 = zennit_lrp(model64, kind, name, x64, target)
            ref32 = zennit_lrp(model32, kind, name, x, target)
            ours64 = np.asarray(gk_lrp(fn, COMPOSITES[name][0])(jnp.asarray(x64), jnp.asarray(target, jnp.int32)))
            assert ours64.dtype == np.float64 and ref64.dtype == np.float64
            scale = float(abs(ref64).max())
            rows += [{"model": kind, "composite": name, "twin": "jax, float64 (vs Zennit float64)",
                      "rel_diff": rel_diff(ours64, ref64), "max_abs_ref": scale},
                     {"model": kind, "composite": name, "twin": "(Zennit float32 vs Zennit float64)",
                      "rel_diff": rel_diff(ref32, ref64), "max_abs_ref": scale, "scale_row": True}]
    finally:
        jax.config.update("jax_enable_x64", False)
    return rows


def timing(kind: str, model: nn.Module, fn: twins.JaxModel, x: np.ndarray, target: np.ndarray,
           composites: list[str], repeats: int, threads: int) -> dict[str, Any]:
    """Seconds per batch: each composite (jit) against ``jax.grad`` (jit) and Zennit at ``threads`` threads."""
    xj, tj = jnp.asarray(x), jnp.asarray(target, jnp.int32)
    classes = int(np.asarray(fn(xj[:1])).shape[-1])
    plain = jax.jit(jax.grad(lambda v: jnp.sum(fn(v) * jax.nn.one_hot(tj, classes))))
    fns: dict[str, Callable[[], Any]] = {"jax.grad (jit)": lambda: plain(xj)}
    for name in composites:
        f = gk_lrp(fn, COMPOSITES[name][0])
        fns[f"gradkit {name} (jit)"] = lambda f=f: f(xj, tj)
        fns[f"zennit {COMPOSITES[name][1]}"] = lambda name=name: zennit_lrp(model, kind, name, x, target)
    torch.set_num_threads(threads)
    times = samples(fns, repeats, 1, warmup=1)
    t = {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in times.items()}
    grad = t["jax.grad (jit)"]["median_s"]
    ratios = {}
    for name in composites:
        ours = t[f"gradkit {name} (jit)"]["median_s"]
        zennit = t[f"zennit {COMPOSITES[name][1]}"]["median_s"]
        ratios[name] = {"over_jax_grad": ours / grad, "over_zennit": ours / zennit}
    return {"model": kind, "torch_threads": threads, "load_average_1min": os.getloadavg()[0], "repeats": repeats,
            "seconds": t, "ratios": ratios}


# --------------------------------------------------------------------------------------------------------------
# The stored reference for tests/test_lrp_vs_zennit.py.
# --------------------------------------------------------------------------------------------------------------

def make_reference(path: str, seed: int = 0) -> None:
    """The tiny ResNet's weights, 4 images, targets, logits, Zennit's relevances and ΣR per image, as ``.npz``."""
    torch.manual_seed(seed)
    model = TinyResNet()
    randomize_batch_norm(model, seed + 1)
    model = model.float().eval()
    params = state(model)  # before Zennit: after a canonizer's use, the state_dict holds the folded weights
    x = np.random.default_rng(seed).standard_normal((4, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        logits = model(torch.from_numpy(x)).numpy()
    target = np.argmax(logits, axis=-1).astype(np.int32)
    target[0] = (target[0] + 1) % logits.shape[-1]  # one losing class too
    data = {f"param/{k}": v for k, v in params.items()}
    data |= {"x": x, "target": target, "logits": logits}
    for name in REFERENCE_COMPOSITES:
        rel = zennit_lrp(model, "resnet", name, x, target.astype(np.int64))
        data[f"relevance/{name}"] = rel
        data[f"sum/{name}"] = rel.reshape(rel.shape[0], -1).sum(axis=1)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    np.savez_compressed(path, **data)
    print(f"wrote {path} ({os.path.getsize(path)} bytes): " + ", ".join(f"{k} {v.shape}" for k, v in data.items()
                                                                       if not k.startswith("param/")))
    # the plain-JAX twin must reproduce the logits, or the stored weights are read wrongly
    print("twin logits rel. diff:", rel_diff(np.asarray(twins.jax_resnet(params)(jnp.asarray(x))), logits))


# --------------------------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    return versions("jax", "jaxlib", "flax", "equinox", "torch", "torchvision", "zennit")


def markdown(rows: list[dict[str, Any]], sums: list[dict[str, Any]], timings: list[dict[str, Any]],
             env: dict[str, Any], shapes: dict[str, str]) -> str:
    lines = [f"Environment: {', '.join(f'{k} {v}' for k, v in env.items())}", "",
             "Agreement, float32 (" + "; ".join(f"{k}: {v}" for k, v in shapes.items()) + "), top class: "
             f"max \\|gradkit − zennit\\| / max \\|zennit\\| (goal ≤ {GOAL:g})", "",
             "| model | composite | gradkit twin | rel. diff | max \\|zennit\\| | ≤ goal |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["rel_diff"] <= GOAL else ("error: " + r["error"] if "error" in r else "**NO**")
        if r.get("scale_row"):
            ok = "(float32's own error, for scale)"
        if r.get("control"):
            ok = "(control: should be NO)" if r["rel_diff"] <= GOAL else "no, as it should"
        lines.append(f"| {r['model']} | {r['composite']} | {r['twin']} | {r['rel_diff']:.2e} | "
                     f"{r['max_abs_ref']:.3g} | {ok} |")
    lines += ["", "ΣR per image (gradkit, plain-JAX twin / Zennit)", "",
              "| model | composite | ΣR gradkit | ΣR zennit |", "|---|---|---|---|"]
    for s in sums:
        lines.append(f"| {s['model']} | {s['composite']} | {' '.join(f'{v:.3f}' for v in s['gradkit'])} "
                     f"| {' '.join(f'{v:.3f}' for v in s['zennit'])} |")
    for t in timings:
        lines += ["", f"Timing, {t['model']} ({shapes[t['model']]}), median of {t['repeats']} interleaved repeats "
                      f"({env['machine']}, load average {t['load_average_1min']:.1f}, torch threads "
                      f"{t['torch_threads']}, JAX {env['jax_backend']})", "",
                  "| composite | gradkit (jit) ms | jax.grad (jit) ms | zennit ms | gradkit / jax.grad "
                  "| gradkit / zennit |",
                  "|---|---|---|---|---|---|"]
        grad = t["seconds"]["jax.grad (jit)"]["median_s"]
        for name, r in t["ratios"].items():
            ours = t["seconds"][f"gradkit {name} (jit)"]["median_s"]
            z = t["seconds"][f"zennit {COMPOSITES[name][1]}"]["median_s"]
            lines.append(f"| {name} | {ours * 1e3:.0f} | {grad * 1e3:.0f} | {z * 1e3:.0f} | "
                         f"{r['over_jax_grad']:.2f} | {r['over_zennit']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="2 images at 3x64x64, 2 composites, 2 repeats")
    parser.add_argument("--models", nargs="+", choices=("resnet", "vgg"), default=["resnet", "vgg"])
    parser.add_argument("--twins", nargs="+", choices=("jax", "flax", "equinox"), default=["jax", "flax", "equinox"])
    parser.add_argument("--composites", nargs="+", choices=list(COMPOSITES), default=None,
                        help="the composites to compare (default all; --quick two)")
    parser.add_argument("--no-timing", action="store_true", help="agreement only")
    parser.add_argument("--float64", action="store_true",
                        help="also both libraries in float64 (plain-JAX twin), and Zennit float32 against float64")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default 5, --quick 2)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[os.cpu_count() or 1, 1],
                        help="PyTorch thread counts to time, one timing table each (default: the core count, and 1)")
    parser.add_argument("--make-reference", nargs="?", const=REFERENCE, default=None, metavar="PATH",
                        help="write the tiny ResNet's reference for tests/test_lrp_vs_zennit.py and stop")
    args = parser.parse_args(argv)
    if args.make_reference:
        make_reference(args.make_reference)
        return 0
    env = environment()
    batch = 2 if args.quick else 8
    sizes = {"resnet": 64 if args.quick else 224, "vgg": 64}
    composites = args.composites or (["EPSILON_PLUS_FLAT", "EPSILON_GAMMA_BOX"] if args.quick else list(COMPOSITES))
    shapes = {k: f"batch {batch} at 3x{sizes[k]}x{sizes[k]}" for k in args.models}
    rows: list[dict[str, Any]] = []
    sums: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    for kind in args.models:
        model = torch_model(kind)
        params = state(model)
        jax_models = {t: twins.TWINS[kind][t](params) for t in args.twins}
        x = np.random.default_rng(0).standard_normal((batch, 3, sizes[kind], sizes[kind])).astype(np.float32)
        with torch.no_grad():
            target = np.argmax(model(torch.from_numpy(x)).numpy(), axis=-1)
        r, s = agreement(kind, model, jax_models, x, target, composites)
        if args.float64:
            r += float64_rows(kind, x, target, composites)
        rows += r
        sums += s
        print(markdown(r, s, [], env, shapes), flush=True)
        if not args.no_timing:
            for threads in dict.fromkeys(args.torch_threads):
                timings.append(timing(kind, model, jax_models["jax"], x, target, composites,
                                      args.repeats or (2 if args.quick else 5), threads))
                print(markdown([], [], timings[-1:], env, shapes).split("\n", 1)[1], flush=True)
        del model, params, jax_models
    print("\n\n" + markdown(rows, sums, timings, env, shapes))
    kept = [r for r in rows if not r.get("scale_row") and not r.get("control")]
    worst = {f"{r['model']} {r['composite']}": max(q["rel_diff"] for q in kept if q["model"] == r["model"]
                                                   and q["composite"] == r["composite"]) for r in kept}
    result = {"environment": env, "goal": GOAL, "shapes": shapes, "agreement": rows, "sums": sums,
              "worst_rel_diff": worst, "timing": timings}
    return write_json(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
