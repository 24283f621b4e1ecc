"""gradkit benchmark runner: ratios against a baseline measured in the same process.

    python benchmarks/run.py            # full run, prints a table, writes benchmarks/results.json
    python benchmarks/run.py --quick    # small sizes, few repeats (CI keeps the suite from rotting)

Every row is a ratio (gradkit / baseline), never an absolute time: these
machines are shared and noisy. Timings are medians of interleaved repeats.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import format_row, interleaved, mlp_problem, row

import gradkit as gk
from gradkit._src import compat

# --------------------------------------------------------------------------- workloads

IDENT = gk.vjp_rule(lambda op, g: (g * jax.nn.sigmoid(op.inputs[0]),), name="sigmoid_grad")


@gk.op("log1pexp")
def log1pexp(x):
    return jnp.log1p(jnp.exp(x))


@jax.custom_vjp
def log1pexp_hand(x):
    return jnp.log1p(jnp.exp(x))


log1pexp_hand.defvjp(lambda x: (jnp.log1p(jnp.exp(x)), x), lambda x, g: (g * jax.nn.sigmoid(x),))


def row_elementwise(quick: bool) -> list[dict[str, Any]]:
    n = 100_000 if quick else 1_000_000
    x = jnp.linspace(-50, 50, n, dtype=jnp.float32)
    ours = jax.jit(jax.grad(gk.override(lambda x: jnp.sum(log1pexp(x)), {"log1pexp": IDENT})))
    hand = jax.jit(jax.grad(lambda x: jnp.sum(log1pexp_hand(x))))
    np.testing.assert_allclose(ours(x), hand(x), rtol=1e-6)
    t = interleaved({"ours": lambda: ours(x), "hand": lambda: hand(x)}, 5 if quick else 41, 3 if quick else 10)
    ops_ours = _hlo_ops(ours, x)
    ops_hand = _hlo_ops(hand, x)
    return [
        row(f"elementwise log1pexp grad, {n:.0e} f32", "hand custom_vjp", t["ours"] / t["hand"], 1.03),
        row("  optimized HLO op count", "hand custom_vjp", ops_ours / ops_hand, 1.0, fmt="ops"),
    ]


def _hlo_ops(jitted: Any, *args: Any) -> int:
    text = jitted.lower(*args).compile().as_text()
    return sum(1 for line in text.splitlines() if " = " in line and not line.lstrip().startswith(("ROOT tuple", "//")))


def row_scan(quick: bool) -> list[dict[str, Any]]:
    steps = 50 if quick else 200
    w = jnp.eye(64, dtype=jnp.float32) * 0.5
    xs = jnp.ones((steps, 64), jnp.float32) * 0.1

    def model(act):
        def f(h0):
            h, _ = jax.lax.scan(lambda h, x: (act(h @ w + x), None), h0, xs)
            return jnp.sum(h)
        return f

    ours = jax.jit(jax.grad(gk.override(model(log1pexp), {"log1pexp": IDENT})))
    hand = jax.jit(jax.grad(model(log1pexp_hand)))
    h0 = jnp.zeros(64, jnp.float32)
    np.testing.assert_allclose(ours(h0), hand(h0), rtol=1e-5)
    t = interleaved({"ours": lambda: ours(h0), "hand": lambda: hand(h0)}, 5 if quick else 41, 3 if quick else 10)
    return [row(f"scanned RNN grad, {steps} steps", "hand custom_vjp", t["ours"] / t["hand"], 1.03)]


def row_vmapped(quick: bool) -> list[dict[str, Any]]:
    b = 64 if quick else 256
    x = jax.random.normal(jax.random.key(0), (b, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (128,), jnp.float32)

    def loss(act):
        return lambda w, x: jnp.sum(act(x * w))

    ours = jax.jit(jax.vmap(jax.grad(gk.override(loss(log1pexp), {"log1pexp": IDENT})), in_axes=(None, 0)))
    hand = jax.jit(jax.vmap(jax.grad(loss(log1pexp_hand)), in_axes=(None, 0)))
    np.testing.assert_allclose(ours(w, x), hand(w, x), rtol=1e-5)
    t = interleaved({"ours": lambda: ours(w, x), "hand": lambda: hand(w, x)}, 5 if quick else 41, 3 if quick else 10)
    return [row(f"per-example grads, vmap over {b}", "hand custom_vjp", t["ours"] / t["hand"], 1.03)]


def _chain(n: int) -> Callable[[Any], Any]:
    def f(x):
        for i in range(n):
            x = jnp.sin(x) if i % 10 == 0 else x * 1.0001
        return x
    return f


def row_table_size(quick: bool) -> list[dict[str, Any]]:
    rule = gk.vjp_rule(lambda op, g: (g,))
    small = gk.RuleTable({f"no_op_{i}": rule for i in range(10)} | {"sin": rule})
    big = gk.RuleTable({f"no_op_{i}": rule for i in range(10_000)} | {"sin": rule})
    n = 500 if quick else 3000
    x = jnp.ones(4, jnp.float32)
    t = interleaved({"big": lambda: gk.override(_chain(n), big).rewritten_jaxpr(x),
                     "small": lambda: gk.override(_chain(n), small).rewritten_jaxpr(x)}, 3 if quick else 9)
    none = gk.RuleTable({f"no_op_{i}": rule for i in range(10_000)})
    t0 = interleaved({"none": lambda: jax.make_jaxpr(gk.override(_chain(n), none))(x),
                      "empty": lambda: jax.make_jaxpr(gk.override(_chain(n), {}))(x)}, 3 if quick else 9)
    return [row("trace with 10,000-rule table", "10-rule table", t["big"] / t["small"], 1.05),
            row("trace, 10,000 rules matching nothing", "empty table", t0["none"] / t0["empty"], 1.05)]


def row_eager_calls(quick: bool) -> list[dict[str, Any]]:
    x = jnp.linspace(-3, 3, 1000, dtype=jnp.float32)
    fn = lambda x: jnp.sum(log1pexp(x) * 2.0)
    calls = []

    def counted(x):
        calls.append(1)
        return fn(x)

    ours = gk.override(counted, {"log1pexp": IDENT})
    plain = jax.jit(fn)
    t = interleaved({"ours": lambda: ours(x), "plain": lambda: plain(x)}, 7 if quick else 41, 20 if quick else 200)
    assert len(calls) == 1, "override re-traced on a repeated call"
    return [row("repeated eager call (traces: 1)", "jax.jit(f)", t["ours"] / t["plain"], 1.05)]


def _mlp_loss(act: Callable[[Any], Any]) -> Callable[..., Any]:
    def loss(params, x, y):
        h = x
        for layer in params[:-1]:
            h = act(h @ layer["w"] + layer["b"][None, :])
        logits = (h @ params[-1]["w"] + params[-1]["b"][None, :])[:, 0]
        return jnp.mean(act(logits) - y * logits)
    return loss


def row_mlp(quick: bool) -> list[dict[str, Any]]:
    import optax

    batch, width, depth = (64, 128, 2) if quick else (256, 512, 4)
    params, x, y = mlp_problem(batch, width, depth)
    opt = optax.sgd(1e-3, momentum=0.9)

    def make_step(loss):
        @jax.jit
        def step(params, state):
            l, g = jax.value_and_grad(loss)(params, x, y)
            updates, state = opt.update(g, state, params)
            return optax.apply_updates(params, updates), state, l
        return step

    table = gk.tables.SAFE | gk.tables.STABLE | gk.RuleTable({"log1pexp": IDENT})
    ours = make_step(gk.override(_mlp_loss(log1pexp), table))
    hand = make_step(_mlp_loss(log1pexp_hand))
    state = opt.init(params)
    np.testing.assert_allclose(ours(params, state)[2], hand(params, state)[2], rtol=1e-5)
    t = interleaved({"ours": lambda: ours(params, state), "hand": lambda: hand(params, state)},
                    5 if quick else 31, 3 if quick else 10)
    rows = [row(f"MLP train step {depth}x{width}, batch {batch}", "hand custom_vjp", t["ours"] / t["hand"], 1.03)]
    rows.extend(_torchrow(quick, params, x, y, t["ours"]))
    return rows


def _torchrow(quick: bool, params: Any, x: Any, y: Any, ours_s: float) -> list[dict[str, Any]]:
    try:
        import torch
    except ImportError:
        return []  # PyTorch not installed: the row is left out
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    # PyTorch on the device JAX runs on: CUDA when JAX's default backend is a GPU.
    device = "cuda" if jax.devices()[0].platform == "gpu" and torch.cuda.is_available() else "cpu"

    class Log1pExp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.log1p(torch.exp(x))

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * torch.sigmoid(x)

    tp = [{k: torch.tensor(np.asarray(v), device=device, requires_grad=True) for k, v in layer.items()}
          for layer in params]
    tx, ty = torch.tensor(np.asarray(x), device=device), torch.tensor(np.asarray(y), device=device)
    opt = torch.optim.SGD([t for layer in tp for t in layer.values()], lr=1e-3, momentum=0.9)

    def step():
        opt.zero_grad()
        h = tx
        for layer in tp[:-1]:
            h = Log1pExp.apply(h @ layer["w"] + layer["b"])
        logits = (h @ tp[-1]["w"] + tp[-1]["b"])[:, 0]
        loss = torch.mean(Log1pExp.apply(logits) - ty * logits)
        loss.backward()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()  # the timer waits for the GPU, as block_until_ready does for JAX
        return loss

    t = interleaved({"torch": step}, 5 if quick else 31, 3 if quick else 10)
    return [row(f"  same step, PyTorch {torch.__version__} autograd.Function", f"PyTorch ({device.upper()})",
                 ours_s / t["torch"], None)]


def row_stable(quick: bool) -> list[dict[str, Any]]:
    """value_and_grad of each stable function vs the naive formula and JAX's own, under jit."""
    n = 100_000 if quick else 1_000_000
    x = jnp.linspace(-20.0, 20.0, n, dtype=jnp.float32)
    pos = jnp.linspace(1e-3, 20.0, n, dtype=jnp.float32)
    s = gk.stable
    cases = [  # name, gradkit, naive, JAX equivalent (or None), input
        ("log1pexp", s.log1pexp, lambda x: jnp.log1p(jnp.exp(x)), jax.nn.softplus, x),
        ("sigmoid", s.sigmoid, lambda x: 1 / (1 + jnp.exp(-x)), jax.nn.sigmoid, x),
        ("log_sigmoid", s.log_sigmoid, lambda x: -jnp.log1p(jnp.exp(-x)), jax.nn.log_sigmoid, x),
        ("silu", s.silu, lambda x: x / (1 + jnp.exp(-x)), jax.nn.silu, x),
        ("log_cosh", s.log_cosh, lambda x: jnp.log(jnp.cosh(x)), None, x),
        ("softplus_inverse", s.softplus_inverse, lambda x: jnp.log(jnp.expm1(x)), None, pos),
        ("log1mexp", s.log1mexp, lambda x: jnp.log(-jnp.expm1(-x)), None, pos),
        ("safe_sqrt", s.safe_sqrt, jnp.sqrt, None, pos),
        ("sinc", s.sinc, lambda x: jnp.sin(jnp.pi * x) / (jnp.pi * x), jnp.sinc, pos),
    ]
    rows = []
    for name, ours_f, naive_f, jax_f, inp in cases:
        vg = {k: jax.jit(jax.value_and_grad(lambda v, f=f: jnp.sum(f(v))))
              for k, f in (("ours", ours_f), ("naive", naive_f), ("jax", jax_f)) if f is not None}
        t = interleaved({k: (lambda f=f: f(inp)) for k, f in vg.items()}, 5 if quick else 21, 3 if quick else 10)
        rows.append(row(f"stable.{name} value_and_grad", "naive formula", t["ours"] / t["naive"], 1.1))
        if "jax" in t:
            rows.append(row(f"stable.{name} value_and_grad", "JAX equivalent", t["ours"] / t["jax"], 1.1))
    return rows


def row_stable_floor(quick: bool) -> list[dict[str, Any]]:
    """The least a 2-ULP silu or softplus_inverse can cost on this backend, vs the naive formula.

    Each floor keeps the naive value and makes only the part of the
    derivative accurate that no 2-ULP derivative can do without: for silu,
    ``exp`` from gradkit's kernel in the naive derivative (which stays off by
    up to 1e7 ULP next to its zero); for softplus_inverse, gradkit's own
    derivative. Where a floor is above 1.1, so is every 2-ULP version.
    """
    from gradkit._src.stable import numerics as _k

    n = 100_000 if quick else 1_000_000
    x = jnp.linspace(-20.0, 20.0, n, dtype=jnp.float32)
    pos = jnp.linspace(1e-3, 20.0, n, dtype=jnp.float32)

    def with_slope(value: Callable[..., Any], slope: Callable[..., Any]) -> Callable[..., Any]:
        f = jax.custom_jvp(value)
        f.defjvp(lambda p, t: (f(p[0]), t[0] * slope(p[0])))
        return f

    def silu_slope(v: jax.Array) -> jax.Array:
        k, m, c = _k.exp_parts(-jnp.minimum(jnp.abs(v), 80.0))
        e = (m + c) * _k.pow2(k, v.dtype)
        return jnp.where(v < 0, e * (1.0 + v + e), 1.0 + e * (1.0 + v)) / ((1.0 + e) * (1.0 + e))

    def silu_naive(v: jax.Array) -> jax.Array:
        return v / (1 + jnp.exp(-v))

    def spi_naive(v: jax.Array) -> jax.Array:
        return jnp.log(jnp.expm1(v))

    cases = [("silu", with_slope(silu_naive, silu_slope), silu_naive, x),
             ("softplus_inverse", with_slope(spi_naive, lambda v: -_k.expm1_recip(-v)), spi_naive, pos)]
    rows = []
    for name, floor_f, naive_f, inp in cases:
        vg = {k: jax.jit(jax.value_and_grad(lambda v, f=f: jnp.sum(f(v))))
              for k, f in (("floor", floor_f), ("naive", naive_f))}
        t = interleaved({k: (lambda f=f, a=inp: f(a)) for k, f in vg.items()}, 5 if quick else 21, 3 if quick else 10)
        rows.append(row(f"stable.{name} floor at 2 ULP, value_and_grad", "naive formula", t["floor"] / t["naive"],
                        None))
    return rows


def _extra_rows() -> list[Callable[[bool], list[dict[str, Any]]]]:
    """Rows kept in their own modules (benchmarks/*.py), in the same format."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_attribution
    import bench_cache_memory
    import bench_custom_gradient
    import bench_f32_backward
    import bench_guard
    import bench_safe
    import first_call
    import trace_cost

    return [*trace_cost.ROWS, *first_call.ROWS, bench_custom_gradient.rows, bench_guard.rows, bench_f32_backward.rows,
            bench_cache_memory.rows, bench_safe.rows, bench_attribution.rows]


ROWS = [row_elementwise, row_mlp, row_scan, row_vmapped, row_stable, row_stable_floor, row_table_size, row_eager_calls,
        *_extra_rows()]


def _workload_name(make: Callable[..., Any]) -> str:
    module = make.__module__
    return make.__name__ if module == "__main__" else f"{module}.{make.__name__}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats (CI smoke run)")
    p.add_argument("--json", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.json"))
    p.add_argument("--only", action="append", default=[], metavar="NAME",
                   help="run only the workloads whose function name contains NAME (repeatable), e.g. "
                        "--only mlp --only bench_safe; --list shows the names")
    p.add_argument("--list", action="store_true", help="print the workload names and exit")
    args = p.parse_args(argv)
    makers = [(_workload_name(make), make) for make in ROWS]
    if args.list:
        print("\n".join(name for name, _ in makers))
        return 0
    if args.only:
        chosen = [(name, make) for o in args.only for name, make in makers if o in name]  # in --only's order
        makers = [m for i, m in enumerate(chosen) if m not in chosen[:i]]
        if not makers:
            p.error(f"--only {args.only} matches no workload; --list shows the names")
    print(f"gradkit benchmarks (jax {jax.__version__}, {jax.devices()[0].platform}, "
          f"{'quick' if args.quick else 'full'}; ratios = gradkit / baseline, same process)")
    print(f"{'workload':48} {'baseline':18} {'ratio':>8} {'target':>8}  result", flush=True)
    rows: list[dict[str, Any]] = []
    for _, make in makers:
        made = make(args.quick)
        rows.extend(made)
        for r in made:  # as each workload ends, so a run stopped early still shows what it measured
            print(format_row(r), flush=True)
    with open(args.json, "w") as fh:
        json.dump({"jax": jax.__version__, "platform": jax.devices()[0].platform, "quick": args.quick,
                   "jax_version_tuple": compat.JAX_VERSION, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
