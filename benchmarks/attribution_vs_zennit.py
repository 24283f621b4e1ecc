"""gk.attribution against the PyTorch references (Zennit, Captum): same CNN, same weights, same heatmaps?

A reference comparison for issue 28, not part of CI and not a test. It needs
PyTorch, Zennit and Captum next to JAX, so it runs from a separate virtual
environment (kept outside the repository), e.g., from the repository's root::

    python -m venv ../venv-torch   # with the project's environment active: the same Python
    ../venv-torch/bin/pip install torch zennit captum
    # JAX and gradkit's dependencies from the project's environment, gradkit from the checkout:
    PYTHONPATH=.:$(python -c "import sysconfig; print(sysconfig.get_path('purelib'))") \
        ../venv-torch/bin/python benchmarks/attribution_vs_zennit.py [--quick] [--out PATH]

What it does:

1. Builds a small VGG-style CNN in PyTorch (3x32x32 input; conv3x3 3->16, 16->16,
   max-pool 2; conv 16->32, 32->32, average-pool 2; linear 2048->64, 64->10;
   ReLU after every layer but the last; all with biases), seeded random weights,
   float32, and the same network in plain JAX (``jax.lax.conv_general_dilated``
   in NCHW/OIHW, ``jax.nn.relu``) and, where Flax is importable, as a Flax
   linen module (NHWC), all with the PyTorch weights copied over.
2. For 32 random images, explains each row's top class and a fixed class with
   every method of ``gk.attribution`` and its references (Captum's Saliency
   (abs=False), InputXGradient, GuidedBackprop, Deconvolution; Zennit's
   Gradient attributor, alone and with its GuidedBackprop composite, and with a
   DeconvNet composite where Zennit has one; every LRP composite of
   ``gk.attribution.lrp`` against Zennit's composite of the same name, the
   ZBox bounds of ``EpsilonGammaBox`` at +-3), and reports
   ``max |gradkit - reference| / max |reference|`` per method and reference.
   The issue's goal is agreement within 1e-5 of the heatmap's maximum.
3. Times one batch of Guided Backprop and of LRP (``EPSILON_PLUS_FLAT``) under
   ``jax.jit`` against plain ``jax.grad`` of the same model (same process) and
   against Zennit's (Guided Backprop, ``EpsilonPlusFlat``) and Captum's
   Guided Backprop in PyTorch on the CPU: medians over interleaved
   repeats, and their ratios; one table per PyTorch thread count
   (``--torch-threads``, default the core count and 1: on a loaded machine
   PyTorch's OpenMP threads at the core count can be many times slower than
   one thread, so both are shown, with the load average).
4. Prints Markdown tables and writes JSON to ``--out``
   (default ``benchmarks/results_attribution_vs_zennit.json``, gitignored).

New methods (LRP composites, say) go into :data:`METHODS`: a name, gradkit's
callable, and the reference callables that compute the same heatmap.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import environment as versions
from common import samples, write_json

import gradkit as gk

try:
    import flax.linen as fnn
except ImportError:  # Flax is optional: the plain JAX model is always compared.
    fnn = None

try:
    import captum.attr as captum_attr
except ImportError:
    captum_attr = None

try:
    import zennit.attribution as zennit_attribution
    import zennit.composites as zennit_composites
except ImportError:
    zennit_attribution = None
    zennit_composites = None

jax.config.update("jax_enable_x64", False)
warnings.filterwarnings("ignore", message="Setting backward hooks on ReLU activations")  # Captum, once per call

BATCH = 32
CLASSES = 10
FIXED_CLASS = 0  # never the top class of this batch: explains a losing output too
GOAL = 1e-5
DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results_attribution_vs_zennit.json")

Params = dict[str, np.ndarray]
JaxModel = Callable[[jax.Array], jax.Array]
#: gradkit's side of a method: (model as a function of x, x, integer targets per row) -> heatmap.
GradkitMethod = Callable[[JaxModel, jax.Array, jax.Array], jax.Array]
#: a reference: (PyTorch model, x, integer targets per row) -> heatmap as a NumPy array.
ReferenceMethod = Callable[[nn.Module, torch.Tensor, torch.Tensor], np.ndarray]


# --------------------------------------------------------------------------------------------------------------
# The network, three times: PyTorch, plain JAX (NCHW), Flax linen (NHWC).
# --------------------------------------------------------------------------------------------------------------

def torch_model(seed: int = 0) -> nn.Sequential:
    """The VGG-style CNN in PyTorch, seeded weights, float32; separate (not in-place) ``nn.ReLU`` modules."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AvgPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 8 * 8, 64), nn.ReLU(),
        nn.Linear(64, CLASSES),
    )
    with torch.no_grad():  # He-normal weights and small random biases: logits that differ from image to image
        for layer in model:
            if isinstance(layer, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
                assert layer.bias is not None
                nn.init.uniform_(layer.bias, -0.1, 0.1)
    return model.float().eval()


def torch_params(model: nn.Sequential) -> Params:
    """The PyTorch weights as NumPy arrays in PyTorch's layouts (conv OIHW, linear (out, in))."""
    names = {0: "conv1", 2: "conv2", 5: "conv3", 7: "conv4", 11: "fc1", 13: "fc2"}
    out: Params = {}
    for i, name in names.items():
        layer = model[i]
        assert isinstance(layer, (nn.Conv2d, nn.Linear))
        out[f"{name}.w"] = layer.weight.detach().numpy().copy()
        assert layer.bias is not None
        out[f"{name}.b"] = layer.bias.detach().numpy().copy()
    return out


def _conv_nchw(h: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(h, w, (1, 1), ((1, 1), (1, 1)), dimension_numbers=("NCHW", "OIHW", "NCHW"))
    return y + b[None, :, None, None]


def jax_cnn(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    """The same CNN in plain JAX on NCHW images, with PyTorch's weights as they are (OIHW kernels)."""
    h = jax.nn.relu(_conv_nchw(x, params["conv1.w"], params["conv1.b"]))
    h = jax.nn.relu(_conv_nchw(h, params["conv2.w"], params["conv2.b"]))
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 1, 2, 2), (1, 1, 2, 2), "VALID")
    h = jax.nn.relu(_conv_nchw(h, params["conv3.w"], params["conv3.b"]))
    h = jax.nn.relu(_conv_nchw(h, params["conv4.w"], params["conv4.b"]))
    h = jax.lax.reduce_window(h, 0.0, jax.lax.add, (1, 1, 2, 2), (1, 1, 2, 2), "VALID") / 4.0
    h = h.reshape(h.shape[0], -1)  # NCHW flattened in PyTorch's order
    h = jax.nn.relu(h @ params["fc1.w"].T + params["fc1.b"])
    return h @ params["fc2.w"].T + params["fc2.b"]


def flax_model(params: Params) -> JaxModel | None:
    """The same CNN as a Flax linen module on NHWC images (``None`` without Flax), as a function of NCHW ``x``."""
    if fnn is None:
        return None

    class CNN(fnn.Module):
        @fnn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            h = fnn.relu(fnn.Conv(16, (3, 3), padding=1, name="conv1")(x))
            h = fnn.relu(fnn.Conv(16, (3, 3), padding=1, name="conv2")(h))
            h = fnn.max_pool(h, (2, 2), (2, 2))
            h = fnn.relu(fnn.Conv(32, (3, 3), padding=1, name="conv3")(h))
            h = fnn.relu(fnn.Conv(32, (3, 3), padding=1, name="conv4")(h))
            h = fnn.avg_pool(h, (2, 2), (2, 2))
            h = jnp.transpose(h, (0, 3, 1, 2)).reshape(h.shape[0], -1)  # flatten in PyTorch's (C, H, W) order
            h = fnn.relu(fnn.Dense(64, name="fc1")(h))
            return fnn.Dense(CLASSES, name="fc2")(h)

    variables: dict[str, Any] = {"params": {}}
    for name in ("conv1", "conv2", "conv3", "conv4"):
        variables["params"][name] = {"kernel": jnp.asarray(np.transpose(params[f"{name}.w"], (2, 3, 1, 0))),
                                     "bias": jnp.asarray(params[f"{name}.b"])}
    for name in ("fc1", "fc2"):
        variables["params"][name] = {"kernel": jnp.asarray(params[f"{name}.w"].T),
                                     "bias": jnp.asarray(params[f"{name}.b"])}
    module = CNN()

    def fn(x_nchw: jax.Array) -> jax.Array:
        return module.apply(variables, jnp.transpose(x_nchw, (0, 2, 3, 1)))

    return fn


# --------------------------------------------------------------------------------------------------------------
# Methods: gradkit's callable and its references.
# --------------------------------------------------------------------------------------------------------------

def _one_hot(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(target, out.shape[-1]).to(out.dtype)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy().copy()


def captum(cls_name: str, **kwargs: Any) -> ReferenceMethod | None:
    """Captum's ``captum.attr.<cls_name>`` with per-row targets (``None`` without Captum)."""
    if captum_attr is None:
        return None
    cls = getattr(captum_attr, cls_name)

    def ref(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> np.ndarray:
        # A fresh input each call: Captum's GuidedBackprop/Deconvolution hook a ReLU that reads the model's input
        # with a tensor hook on that input, which they never remove; reusing the tensor reapplies a stale hook.
        inp = x.clone().requires_grad_(True)
        return _np(cls(model).attribute(inp, target=target, **kwargs))

    ref.__name__ = f"captum.{cls_name}" + ("(abs=False)" if kwargs.get("abs") is False else "")
    return ref


def zennit_composite(name: str | None) -> Any:
    """``zennit.composites.<name>``'s class, or ``None`` where Zennit has none of that name."""
    if zennit_composites is None or name is None:
        return None
    return getattr(zennit_composites, name, None)


def zennit(composite: str | None, times_input: bool = False) -> ReferenceMethod | None:
    """Zennit's ``Gradient`` attributor, plain or under ``zennit.composites.<composite>`` (``None`` if missing)."""
    if zennit_attribution is None:
        return None
    cls = zennit_composite(composite)
    if composite is not None and cls is None:
        return None

    def ref(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> np.ndarray:
        comp = None if cls is None else cls()
        inp = x.clone().requires_grad_(True)
        with zennit_attribution.Gradient(model=model, composite=comp) as attributor:
            _, relevance = attributor(inp, lambda out: _one_hot(out, target))
        rel = _np(relevance)
        return rel * _np(x) if times_input else rel

    ref.__name__ = "zennit.Gradient" + ("" if composite is None else f"+{composite}") + (" x input" if times_input
                                                                                         else "")
    return ref


def _gk(method: Callable[..., jax.Array]) -> GradkitMethod:
    def run(fn: JaxModel, x: jax.Array, target: jax.Array) -> jax.Array:
        return method(fn, x, target=target)

    run.__name__ = f"gk.attribution.{method.__name__}"
    return run


def _present(*refs: ReferenceMethod | None) -> list[ReferenceMethod]:
    return [r for r in refs if r is not None]


def zennit_lrp(composite: str, **kwargs: Any) -> ReferenceMethod | None:
    """Zennit's ``Gradient`` attributor under the LRP composite ``zennit.composites.<composite>(**kwargs)``."""
    cls = zennit_composite(composite)
    if zennit_attribution is None or cls is None:
        return None

    def ref(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> np.ndarray:
        inp = x.clone().requires_grad_(True)
        with zennit_attribution.Gradient(model=model, composite=cls(**kwargs)) as attributor:
            _, relevance = attributor(inp, lambda out: _one_hot(out, target))
        return _np(relevance)

    ref.__name__ = f"zennit.{composite}"
    return ref


def _gk_lrp(composite: Any, name: str) -> GradkitMethod:
    def run(fn: JaxModel, x: jax.Array, target: jax.Array) -> jax.Array:
        return gk.attribution.lrp(fn, x, composite, target=target)

    run.__name__ = f"gk.attribution.lrp({name})"
    return run


#: The input box of EpsilonGammaBox: the batch is standard normal, so +-3 holds nearly all of it.
BOX = (-3.0, 3.0)

#: name -> (gradkit's callable, the references it should agree with).
METHODS: dict[str, tuple[GradkitMethod, list[ReferenceMethod]]] = {
    "gradient": (_gk(gk.attribution.gradient),
                 _present(captum("Saliency", abs=False), zennit(None))),
    "gradient_x_input": (_gk(gk.attribution.gradient_x_input),
                         _present(captum("InputXGradient"), zennit(None, times_input=True))),
    "guided_backprop": (_gk(gk.attribution.guided_backprop),
                        _present(captum("GuidedBackprop"), zennit("GuidedBackprop"))),
    "deconvnet": (_gk(gk.attribution.deconvnet),
                  _present(captum("Deconvolution"), zennit("DeconvNet"))),
    "lrp EPSILON_PLUS": (_gk_lrp(gk.attribution.EPSILON_PLUS, "EPSILON_PLUS"), _present(zennit_lrp("EpsilonPlus"))),
    "lrp EPSILON_PLUS_FLAT": (_gk_lrp(gk.attribution.EPSILON_PLUS_FLAT, "EPSILON_PLUS_FLAT"),
                              _present(zennit_lrp("EpsilonPlusFlat"))),
    "lrp EPSILON_ALPHA2_BETA1": (_gk_lrp(gk.attribution.EPSILON_ALPHA2_BETA1, "EPSILON_ALPHA2_BETA1"),
                                 _present(zennit_lrp("EpsilonAlpha2Beta1"))),
    "lrp EPSILON_ALPHA2_BETA1_FLAT": (_gk_lrp(gk.attribution.EPSILON_ALPHA2_BETA1_FLAT, "EPSILON_ALPHA2_BETA1_FLAT"),
                                      _present(zennit_lrp("EpsilonAlpha2Beta1Flat"))),
    "lrp EPSILON_GAMMA_BOX": (_gk_lrp(gk.attribution.EPSILON_GAMMA_BOX(*BOX), "EPSILON_GAMMA_BOX"),
                              _present(zennit_lrp("EpsilonGammaBox", low=BOX[0], high=BOX[1]))),
}


def rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    """``max |ours - ref| / max |ref|`` (the absolute difference where the reference is all zeros)."""
    scale = float(np.max(np.abs(ref)))
    diff = float(np.max(np.abs(np.asarray(ours, np.float64) - np.asarray(ref, np.float64))))
    return diff / scale if scale > 0 else diff


# --------------------------------------------------------------------------------------------------------------
# Agreement.
# --------------------------------------------------------------------------------------------------------------

@dataclass
class Problem:
    """The three models, the batch and its targets."""

    torch: nn.Sequential
    models: dict[str, JaxModel]
    x: np.ndarray
    targets: dict[str, np.ndarray]


def problem(seed: int = 0) -> Problem:
    """The PyTorch model, its JAX and Flax copies, 32 images and the two kinds of target."""
    model = torch_model(seed)
    params = torch_params(model)
    jparams = {k: jnp.asarray(v) for k, v in params.items()}
    models: dict[str, JaxModel] = {"jax": lambda v: jax_cnn(jparams, v)}
    flax_fn = flax_model(params)
    if flax_fn is not None:
        models["flax"] = flax_fn
    x = np.random.default_rng(seed).standard_normal((BATCH, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        logits = _np(model(torch.from_numpy(x)))
    return Problem(model, models, x, {"top": np.argmax(logits, axis=-1), f"class {FIXED_CLASS}":
                                      np.full((BATCH,), FIXED_CLASS, dtype=np.int64)})


def agreement(p: Problem) -> list[dict[str, Any]]:
    """One row per (method, target, JAX model, reference): the max difference relative to the reference's max."""
    rows: list[dict[str, Any]] = []
    ours_top: dict[str, np.ndarray] = {}
    refs_top: dict[str, dict[str, np.ndarray]] = {}
    xt = torch.from_numpy(p.x)
    xj = jnp.asarray(p.x)
    with torch.no_grad():
        logits_t = _np(p.torch(xt))
    for model_name, fn in p.models.items():
        rows.append({"method": "forward (logits)", "target": "-", "model": model_name, "reference": "torch",
                     "rel_diff": rel_diff(np.asarray(fn(xj)), logits_t), "max_abs_ref": float(np.abs(logits_t).max())})
    for method, (ours, refs) in METHODS.items():
        for target_name, target in p.targets.items():
            tt = torch.from_numpy(target)
            ref_maps = {ref.__name__: ref(p.torch, xt, tt) for ref in refs}
            if target_name == "top":
                refs_top[method] = ref_maps
            tj = jnp.asarray(target, jnp.int32)
            for model_name, fn in p.models.items():
                ours_map = np.asarray(jax.jit(lambda v, t, fn=fn, ours=ours: ours(fn, v, t))(xj, tj))
                if target_name == "top" and model_name == "jax":
                    ours_top[method] = ours_map
                for ref_name, ref_map in ref_maps.items():
                    rows.append({"method": method, "target": target_name, "model": model_name, "reference": ref_name,
                                 "rel_diff": rel_diff(ours_map, ref_map),
                                 "max_abs_ref": float(np.abs(ref_map).max())})
            # The references against each other, for scale: how far apart are two PyTorch implementations?
            names = list(ref_maps)
            for a, b in zip(names, names[1:]):
                rows.append({"method": method, "target": target_name, "model": a, "reference": b,
                             "rel_diff": rel_diff(ref_maps[a], ref_maps[b]),
                             "max_abs_ref": float(np.abs(ref_maps[b]).max())})
    # A control: each method against the other methods' references must be far apart, or the table proves nothing.
    for method, ours_map in ours_top.items():
        others = [(rel_diff(ours_map, m), f"{other}: {name}") for other, maps in refs_top.items() if other != method
                  for name, m in maps.items()]
        if others:
            closest, name = min(others)
            rows.append({"method": method, "target": "top", "model": "jax", "reference": f"control, closest other "
                         f"method ({name})", "rel_diff": closest, "max_abs_ref": None, "control": True})
    # gradkit's default target (None: each row's top class) against the explicit top classes.
    fn = p.models["jax"]
    default = np.asarray(gk.attribution.guided_backprop(fn, xj))
    explicit = np.asarray(gk.attribution.guided_backprop(fn, xj, target=jnp.asarray(p.targets["top"], jnp.int32)))
    rows.append({"method": "guided_backprop", "target": "top (target=None)", "model": "jax",
                 "reference": "gradkit, explicit top classes", "rel_diff": rel_diff(default, explicit),
                 "max_abs_ref": float(np.abs(explicit).max())})
    return rows


# --------------------------------------------------------------------------------------------------------------
# Timing.
# --------------------------------------------------------------------------------------------------------------

def interleaved(fns: dict[str, Callable[[], Any]], repeats: int, inner: int) -> dict[str, dict[str, float]]:
    """Median (and min, max) seconds per call of each fn, alternating between them to share the machine's noise."""
    times = samples(fns, repeats, inner, warmup=2)  # warm-up: compile, allocate
    return {k: {"median_s": statistics.median(v), "min_s": min(v), "max_s": max(v)} for k, v in times.items()}


def timing(p: Problem, repeats: int, inner: int, threads: int) -> dict[str, Any]:
    """Seconds per batch: gradkit's Guided Backprop (jit), ``jax.grad`` (jit), PyTorch autograd, Zennit, Captum.

    PyTorch runs on ``threads`` intra-op threads; JAX's CPU backend keeps its own thread pool.
    """
    xj = jnp.asarray(p.x)
    target = p.targets["top"]
    tj = jnp.asarray(target, jnp.int32)
    tt = torch.from_numpy(target)
    xt = torch.from_numpy(p.x)
    fn = p.models["jax"]
    guided = jax.jit(lambda v: gk.attribution.guided_backprop(fn, v, target=tj))
    lrp = jax.jit(lambda v: gk.attribution.lrp(fn, v, gk.attribution.EPSILON_PLUS_FLAT, target=tj))
    plain = jax.jit(jax.grad(lambda v: jnp.sum(fn(v) * jax.nn.one_hot(tj, CLASSES))))

    def torch_grad() -> torch.Tensor:
        inp = xt.clone().requires_grad_(True)
        out = p.torch(inp)
        (g,) = torch.autograd.grad(out, inp, _one_hot(out, tt))
        return g

    fns: dict[str, Callable[[], Any]] = {
        "gradkit guided_backprop (jit)": lambda: guided(xj),
        "jax.grad (jit)": lambda: plain(xj),
        "gradkit lrp EPSILON_PLUS_FLAT (jit)": lambda: lrp(xj),
        "torch autograd gradient": torch_grad,
    }
    zref = zennit("GuidedBackprop")
    if zref is not None:
        fns["zennit GuidedBackprop"] = lambda: zref(p.torch, xt, tt)
    cref = captum("GuidedBackprop")
    if cref is not None:
        fns["captum GuidedBackprop"] = lambda: cref(p.torch, xt, tt)
    lref = zennit_lrp("EpsilonPlusFlat")
    if lref is not None:
        fns["zennit EpsilonPlusFlat"] = lambda: lref(p.torch, xt, tt)
    torch.set_num_threads(threads)
    t = interleaved(fns, repeats, inner)
    ours = t["gradkit guided_backprop (jit)"]["median_s"]
    ratios = {f"gradkit guided_backprop / {k}": ours / v["median_s"] for k, v in t.items()
              if not k.startswith(("gradkit", "zennit EpsilonPlusFlat"))}
    ours_lrp = t["gradkit lrp EPSILON_PLUS_FLAT (jit)"]["median_s"]
    ratios |= {f"gradkit lrp EPSILON_PLUS_FLAT / {k}": ours_lrp / t[k]["median_s"]
               for k in ("jax.grad (jit)", "zennit EpsilonPlusFlat") if k in t}
    return {"torch_threads": threads, "load_average_1min": os.getloadavg()[0], "seconds": t, "ratios": ratios,
            "repeats": repeats, "inner": inner}


# --------------------------------------------------------------------------------------------------------------
# Report.
# --------------------------------------------------------------------------------------------------------------

def environment() -> dict[str, Any]:
    """Versions, threads and machine, for the JSON and the table's caption."""
    return versions("jax", "jaxlib", "flax", "torch", "zennit", "captum", "gradkit")


def markdown(rows: list[dict[str, Any]], timings: list[dict[str, Any]], env: dict[str, Any]) -> str:
    """The agreement table (one line per method/target/model/reference) and the timing table."""
    lines = [f"Environment: {', '.join(f'{k} {v}' for k, v in env.items())}", "",
             f"Agreement, float32, {BATCH} images 3x32x32: max |gradkit - reference| / max |reference| "
             f"(goal <= {GOAL:g})", "",
             "| method | target | gradkit model | reference | rel. diff | max abs ref | <= goal |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "yes" if r["rel_diff"] <= GOAL else "**NO**"
        if r.get("control"):
            ok = "(control: should be NO)" if r["rel_diff"] <= GOAL else "no, as it should"
        scale = "-" if r["max_abs_ref"] is None else f"{r['max_abs_ref']:.3g}"
        lines.append(f"| {r['method']} | {r['target']} | {r['model']} | {r['reference']} | {r['rel_diff']:.2e} "
                     f"| {scale} | {ok} |")
    for t in timings:
        lines += ["", f"Timing, one batch of {BATCH} images, median of {t['repeats']} repeats x {t['inner']} calls "
                      f"({env['machine']}, load average {t['load_average_1min']:.1f}, torch threads "
                      f"{t['torch_threads']}, JAX {env['jax_backend']})", "",
                  "| what | median ms | min ms | max ms |", "|---|---|---|---|"]
        for k, v in t["seconds"].items():
            lines.append(f"| {k} | {v['median_s'] * 1e3:.2f} | {v['min_s'] * 1e3:.2f} | {v['max_s'] * 1e3:.2f} |")
        lines += ["", "| ratio | value |", "|---|---|"]
        lines += [f"| {k} | {v:.3f} |" for k, v in t["ratios"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="where to write the JSON results")
    parser.add_argument("--quick", action="store_true", help="few timing repeats (a smoke run)")
    parser.add_argument("--no-timing", action="store_true", help="agreement only")
    parser.add_argument("--repeats", type=int, default=None, help="timing repeats (default 11, --quick 3)")
    parser.add_argument("--torch-threads", type=int, nargs="+", default=[os.cpu_count() or 1, 1],
                        help="PyTorch thread counts to time, one timing table each (default: the core count, and 1)")
    args = parser.parse_args(argv)
    missing = [name for name, mod in (("captum", captum_attr), ("zennit", zennit_attribution)) if mod is None]
    if missing:
        print(f"note: {', '.join(missing)} not importable; their references are skipped", file=sys.stderr)
    env = environment()
    p = problem()
    rows = agreement(p)
    timings: list[dict[str, Any]] = []
    if not args.no_timing:
        repeats = args.repeats or (3 if args.quick else 11)
        for threads in dict.fromkeys(args.torch_threads):
            timings.append(timing(p, repeats, 1 if args.quick else 3, threads))
    print(markdown(rows, timings, env))
    worst = {m: max((r["rel_diff"] for r in rows if r["method"] == m and r["model"] in p.models
                     and not r.get("control")), default=None) for m in METHODS}
    result = {"environment": env, "goal": GOAL, "batch": BATCH, "fixed_class": FIXED_CLASS, "agreement": rows,
              "worst_rel_diff": worst, "timing": timings}
    return write_json(args.out, result)


if __name__ == "__main__":
    sys.exit(main())
