"""Accuracy of gradients: gradkit.stable vs the JAX equivalent vs the naive formula.

For every elementwise function in :mod:`gradkit.stable` this measures the
error of the *gradient*, in ULPs of the target dtype, against mpmath at 50
digits, over a sweep of the whole dtype range:

* a log-spaced sweep of both signs from the smallest normal number to the
  largest finite one (12,000 points; ``--quick``: 1,500),
* a linear sweep over [-50, 50] (4,000; ``--quick``: 500),
* edge values: ±0, ±1e-30, ±1e-8, ±1, ±log(eps) (±15.9 / ±36.0), ±88.7,
  ±709.8, ±1e4, ±inf and the function's own thresholds and hard spots (the
  zeros of silu' and sinc', log 2 for log1mexp), each with the floats next
  to it.

The error at a point is ``|computed - exact| / ulp(exact)``, where ``exact``
is the mpmath derivative at the (exactly representable) input and
``ulp(exact)`` the spacing of the dtype at ``exact`` rounded to the dtype; a
correctly rounded result scores ≤ 0.5. XLA:CPU flushes subnormal numbers to
zero, so a reference below the smallest normal number counts as 0.
Points where the true derivative is infinite, undefined, or overflows the
dtype are left out of the ULP columns; "non-finite" counts gradients that are
inf/NaN where the true derivative is finite. "worse" counts the points where
gradkit's error exceeds both 1 ULP and the JAX equivalent's error.

Gradients are computed as ``jax.jit(jax.vmap(jax.grad(f)))``; float64 runs
with ``jax_enable_x64``. Binary functions are measured along 1-D slices
(the other argument fixed), one row per partial derivative.

Run ``python benchmarks/accuracy.py`` (a few minutes) or ``--quick`` (CI
smoke, under a minute); ``--markdown`` prints a Markdown table.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import mpmath as mp  # noqa: E402
import numpy as np  # noqa: E402

from gradkit import stable as st  # noqa: E402


mp.mp.dps = 50

Ref = Callable[[mp.mpf], "mp.mpf | None"]


@dataclasses.dataclass
class Row:
    name: str
    gradkit: Callable
    ref: Ref                      # exact derivative at a finite point (None: undefined/infinite)
    jax_fn: Callable | None = None
    naive: Callable | None = None
    jax_name: str = "—"
    naive_name: str = "—"
    domain: Callable[[np.ndarray], np.ndarray] | None = None   # where the row is measured
    limits: tuple[float | None, float | None] = (None, None)    # derivative at -inf, +inf
    edges: tuple[float, ...] = ()


def _seed_rule():
    """The seed prototype's hand-derived softplus rule: d/dx = 1 - 1/(1 + e^x)."""
    @jax.custom_jvp
    def f(x):
        return jnp.logaddexp(x, 0.0)

    @f.defjvp
    def jvp(p, t):
        (x,), (tx,) = p, t
        return f(x), tx * (1 - 1 / (1 + jnp.exp(x)))

    return f


def _sig(x):
    return 1 / (1 + mp.exp(-x))


def _sinc_prime(x):
    if x == 0:
        return mp.mpf(0)
    # (cos(pi x) - sinc(x)) / x cancels like x^2: add the digits it loses.
    extra = max(0, int(-2 * mp.log10(abs(x)))) + 10
    with mp.workdps(mp.mp.dps + extra):
        return +((mp.cospi(x) - mp.sinpi(x) / (mp.pi * x)) / x)


# The first zeros of sinc' (tan(pi x) = pi x), where its closed form cancels completely.
SINC_PRIME_ZEROS = (1.4302966531242028, 2.459024032956761, 3.4708897243470197, 4.477408583432515,
                    5.481536650607196, 18.494522097925103)


def _pos(x):
    return x > 0


def _unit_open(x):
    return np.abs(x) < 1


def rows() -> list[Row]:
    c = 1.5
    R = Row
    return [
        R("log1pexp", st.log1pexp, _sig, jax.nn.softplus, lambda x: jnp.log(1 + jnp.exp(x)),
          "jax.nn.softplus", "log(1+exp(x))", limits=(0.0, 1.0)),
        R("log1pexp [seed rule]", st.log1pexp, _sig, None, _seed_rule(), "—", "1-1/(1+e^x)",
          limits=(0.0, 1.0)),
        R("log_sigmoid", st.log_sigmoid, lambda x: _sig(-x), jax.nn.log_sigmoid,
          lambda x: jnp.log(1 / (1 + jnp.exp(-x))), "jax.nn.log_sigmoid", "log(1/(1+exp(-x)))",
          limits=(1.0, 0.0)),
        R("sigmoid", st.sigmoid, lambda x: _sig(x) * _sig(-x), jax.nn.sigmoid,
          lambda x: 1 / (1 + jnp.exp(-x)), "jax.nn.sigmoid", "1/(1+exp(-x))", limits=(0.0, 0.0)),
        R("silu", st.silu, lambda x: _sig(x) + x * _sig(x) * _sig(-x), jax.nn.silu,
          lambda x: x / (1 + jnp.exp(-x)), "jax.nn.silu", "x/(1+exp(-x))", limits=(0.0, 1.0),
          edges=(-1.2784645, -1.27846454276107, -1.28, -1.27)),
        R("log1mexp", st.log1mexp, lambda x: 1 / mp.expm1(x), None,
          lambda x: jnp.log(1 - jnp.exp(-x)), "—", "log(1-exp(-x))", domain=_pos, limits=(None, 0.0),
          edges=(math.log(2.0),)),
        R("softplus_inverse", st.softplus_inverse, lambda x: -1 / mp.expm1(-x), None,
          lambda x: jnp.log(jnp.exp(x) - 1), "—", "log(exp(x)-1)", domain=_pos, limits=(None, 1.0)),
        R("log_cosh", st.log_cosh, mp.tanh, None, lambda x: jnp.log(jnp.cosh(x)), "—", "log(cosh(x))",
          limits=(-1.0, 1.0)),
        R("safe_sqrt", st.safe_sqrt, lambda x: 1 / (2 * mp.sqrt(x)), jnp.sqrt, None, "jnp.sqrt",
          domain=_pos, limits=(None, 0.0)),
        R("safe_log", st.safe_log, lambda x: 1 / x, jnp.log, None, "jnp.log", domain=_pos,
          limits=(None, 0.0)),
        R("safe_arccos", st.safe_arccos, lambda x: -1 / mp.sqrt(1 - x * x), jnp.arccos, None,
          "jnp.arccos", domain=_unit_open, edges=(0.9999999, -0.9999999, 0.99999994, -0.99999994)),
        R("safe_arcsin", st.safe_arcsin, lambda x: 1 / mp.sqrt(1 - x * x), jnp.arcsin, None,
          "jnp.arcsin", domain=_unit_open, edges=(0.9999999, -0.9999999, 0.99999994, -0.99999994)),
        R("sinc", st.sinc, _sinc_prime,
          jnp.sinc, lambda x: jnp.sin(jnp.pi * x) / (jnp.pi * x), "jnp.sinc", "sin(πx)/(πx)",
          limits=(0.0, 0.0), edges=(0.5, 1.0, 1.5, 2.0, 1e6 + 0.5, *SINC_PRIME_ZEROS)),
        R(f"logaddexp(x, {c}) ∂x", lambda x: st.logaddexp(x, c), lambda x: _sig(x - c),
          lambda x: jnp.logaddexp(x, c), lambda x: jnp.log(jnp.exp(x) + jnp.exp(c)),
          "jnp.logaddexp", "log(e^x+e^y)", limits=(0.0, 1.0)),
        R(f"logaddexp({c}, y) ∂y", lambda x: st.logaddexp(c, x), lambda x: _sig(x - c),
          lambda x: jnp.logaddexp(c, x), lambda x: jnp.log(jnp.exp(c) + jnp.exp(x)),
          "jnp.logaddexp", "log(e^x+e^y)", limits=(0.0, 1.0)),
        R(f"xlogy({c}, y) ∂x", lambda y: _partial_x(st.xlogy, c, y), lambda y: mp.log(y),
          lambda y: _partial_x(jax.scipy.special.xlogy, c, y), lambda y: _partial_x(lambda a, b: a * jnp.log(b), c, y),
          "jsp.special.xlogy", "x*log(y)", domain=_pos, limits=(None, None)),
        R(f"xlogy({c}, y) ∂y", lambda y: st.xlogy(c, y), lambda y: c / y,
          lambda y: jax.scipy.special.xlogy(c, y), lambda y: c * jnp.log(y), "jsp.special.xlogy", "x*log(y)",
          domain=_pos, limits=(None, 0.0)),
        R(f"xlog1py({c}, y) ∂x", lambda y: _partial_x(st.xlog1py, c, y), lambda y: mp.log1p(y),
          lambda y: _partial_x(jax.scipy.special.xlog1py, c, y),
          lambda y: _partial_x(lambda a, b: a * jnp.log1p(b), c, y), "jsp.special.xlog1py", "x*log1p(y)",
          domain=lambda y: y > -1, limits=(None, None)),
        R(f"xlog1py({c}, y) ∂y", lambda y: st.xlog1py(c, y), lambda y: c / (1 + y),
          lambda y: jax.scipy.special.xlog1py(c, y), lambda y: c * jnp.log1p(y), "jsp.special.xlog1py",
          "x*log1p(y)", domain=lambda y: y > -1, limits=(None, 0.0)),
        R("log_sub_exp(x, 0) ∂x", lambda x: st.log_sub_exp(x, 0.0), lambda x: -1 / mp.expm1(-x), None,
          lambda x: jnp.log(jnp.exp(x) - 1.0), "—", "log(e^x-e^y)", domain=_pos, limits=(None, 1.0)),
        R("log_sub_exp(x, 0) ∂y", lambda x: st.log_sub_exp(0.0, -x), lambda x: 1 / mp.expm1(x), None,
          lambda x: jnp.log(1.0 - jnp.exp(-x)), "—", "log(e^x-e^y)", domain=_pos, limits=(None, 0.0)),
        R("hypot(x, 1) ∂x", lambda x: st.hypot(x, 1.0), lambda x: x / mp.sqrt(x * x + 1),
          lambda x: jnp.hypot(x, 1.0), lambda x: jnp.sqrt(x * x + 1.0), "jnp.hypot", "sqrt(x²+y²)",
          limits=(-1.0, 1.0)),
        R("hypot(1, y) ∂y", lambda x: st.hypot(1.0, x), lambda x: x / mp.sqrt(x * x + 1),
          lambda x: jnp.hypot(1.0, x), lambda x: jnp.sqrt(1.0 + x * x), "jnp.hypot", "sqrt(x²+y²)",
          limits=(-1.0, 1.0)),
        R("hypot(x, x) ∂x", lambda x: _partial_x(st.hypot, x, x), lambda x: mp.sign(x) / mp.sqrt(2),
          lambda x: _partial_x(jnp.hypot, x, x), lambda x: _partial_x(lambda a, b: jnp.sqrt(a * a + b * b), x, x),
          "jnp.hypot", "sqrt(x²+y²)", domain=lambda x: x != 0, limits=(-math.sqrt(0.5), math.sqrt(0.5))),
        R(f"safe_div({c}, y) ∂y", lambda y: st.safe_div(c, y), lambda y: -c / (y * y),
          lambda y: jnp.divide(c, y), None, "jnp.divide", domain=lambda y: y != 0, limits=(0.0, 0.0)),
        R(f"safe_arctan2(y, {c}) ∂y", lambda y: st.safe_arctan2(y, c), lambda y: c / (y * y + c * c),
          lambda y: jnp.arctan2(y, c), None, "jnp.arctan2", limits=(0.0, 0.0)),
        R(f"safe_arctan2({c}, x) ∂x", lambda x: st.safe_arctan2(c, x), lambda x: -c / (x * x + c * c),
          lambda x: jnp.arctan2(c, x), None, "jnp.arctan2", limits=(0.0, 0.0)),
        R("safe_pow(x, 2.5) ∂x", lambda x: st.safe_pow(x, 2.5), lambda x: mp.mpf(2.5) * x ** mp.mpf(1.5),
          lambda x: jnp.power(x, 2.5), None, "jnp.power", domain=_pos, limits=(None, None)),
        R("safe_pow(1.5, y) ∂y", lambda y: st.safe_pow(c, y), lambda y: mp.power(c, y) * mp.log(c),
          lambda y: jnp.power(c, y), None, "jnp.power", limits=(0.0, None)),
    ]


def _partial_x(f, x, y):
    """f(x, y) as a function of y whose derivative in y is ∂f/∂x at (x, y).

    Used for rows that sweep ``y`` but report the partial in ``x``: the
    derivative of ``f(stop_gradient(x) + z(y), stop_gradient(y))`` where
    ``z(y) = 0`` with derivative 1 (finite at ``y = ±inf`` too).
    """
    return f(jax.lax.stop_gradient(x) + _zero_with_unit_derivative(y), jax.lax.stop_gradient(y))


@jax.custom_jvp
def _zero_with_unit_derivative(y):
    return jnp.zeros_like(y)


@_zero_with_unit_derivative.defjvp
def _zero_jvp(p, t):
    return jnp.zeros_like(p[0]), t[0]


# --------------------------------------------------------------------------- sweep


def sweep(dtype: type, n_log: int, n_lin: int, extra: tuple[float, ...]) -> np.ndarray:
    fi = np.finfo(dtype)
    mags = np.logspace(np.log10(float(fi.tiny)), np.log10(float(fi.max)), n_log // 2)
    mags = np.clip(mags, float(fi.tiny), float(fi.max)).astype(dtype)
    mags = np.where(mags < fi.tiny, fi.tiny, mags)
    lin = np.linspace(-50, 50, n_lin).astype(dtype)
    eps_log = float(np.log(fi.eps))
    edges = [0.0, 1e-30, 1e-8, 1.0, eps_log, eps_log - 1, eps_log + 1, 88.7, 88.72284, 709.78, 1e4,
             float(fi.max), float(fi.tiny), np.inf, *extra]
    edges = np.array([s * e for e in edges for s in (1.0, -1.0)], np.float64)
    with np.errstate(over="ignore"):
        edges = edges.astype(dtype)
    near = [edges]
    for e in np.array([s * v for v in extra for s in (1.0, -1.0)], np.float64).astype(dtype):
        lo = hi = e
        for _ in range(2):  # the floats next to each hard spot
            lo, hi = np.nextafter(lo, dtype(-np.inf)), np.nextafter(hi, dtype(np.inf))
            near.append(np.array([lo, hi], dtype))
    xs = np.concatenate([-mags, mags, lin, *near]).astype(dtype)
    xs = xs[~np.isnan(xs)]
    return np.unique(xs)


def reference(row: Row, xs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo) float64 double-double of the exact derivative; NaN where undefined."""
    hi = np.full(len(xs), np.nan)
    lo = np.zeros(len(xs))
    for i, v in enumerate(xs.astype(np.float64)):
        if np.isinf(v):
            lim = row.limits[1 if v > 0 else 0]
            if lim is not None:
                hi[i] = lim
            continue
        try:
            r = row.ref(mp.mpf(float(v)))
        except (ValueError, ZeroDivisionError):
            continue
        if r is None:
            continue
        r = mp.mpf(r) if not isinstance(r, mp.mpf) else r
        if not mp.isfinite(r):
            continue
        with np.errstate(over="ignore"):
            h = float(r) if abs(r) < mp.mpf("1.7976931348623157e308") else math.copysign(math.inf, float(mp.sign(r)))
        hi[i] = h
        if math.isfinite(h):
            lo[i] = float(r - mp.mpf(h))
    return hi, lo


def ulp_error(a: np.ndarray, hi: np.ndarray, lo: np.ndarray, dtype: type) -> np.ndarray:
    fi = np.finfo(dtype)
    tiny = float(fi.tiny)
    a = a.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        rd = hi.astype(dtype).astype(np.float64)
        flushed = np.abs(rd) < tiny
        hi = np.where(flushed, 0.0, hi)
        lo = np.where(flushed, 0.0, lo)
        a = np.where(np.abs(a) < tiny, 0.0, a)
        ulp = np.spacing(np.maximum(np.abs(rd), tiny).astype(dtype)).astype(np.float64)
        err = np.abs((a - hi) - lo) / ulp
    return np.where(np.isinf(a) & (a == hi), 0.0, err)


@dataclasses.dataclass
class Stat:
    max: float
    p99: float
    nonfinite: int
    argmax: float


def grads(fn: Callable, xs: np.ndarray) -> np.ndarray:
    g = jax.jit(jax.vmap(jax.grad(fn)))(jnp.asarray(xs))
    return np.asarray(g)


def measure(fn: Callable | None, xs, hi, lo, dtype, ok) -> tuple[Stat | None, np.ndarray | None]:
    if fn is None:
        return None, None
    a = grads(fn, xs)
    with np.errstate(over="ignore"):
        ref_finite = np.isfinite(hi.astype(dtype))
    use = ok & ref_finite
    err = ulp_error(a, hi, lo, dtype)
    nonfinite = int(np.sum(use & ~np.isfinite(a)))
    e = np.where(use, err, np.nan)
    fe = e[use & np.isfinite(a)]
    if fe.size == 0:
        return Stat(float("nan"), float("nan"), nonfinite, float("nan")), e
    i = int(np.nanargmax(np.where(use & np.isfinite(a), e, -1)))
    return Stat(float(np.max(fe)), float(np.percentile(fe, 99)), nonfinite, float(xs[i])), e


def fmt(v: float) -> str:
    if v != v:
        return "—"
    if v >= 1e5:
        return f"{v:.1e}"
    if v >= 100:
        return f"{v:.0f}"
    return f"{v:.2f}"


def run(quick: bool, dtypes: list[str], only: list[str] | None, markdown: bool) -> int:
    n_log, n_lin = (1500, 500) if quick else (12000, 4000)
    header = ["function", "dtype", "points", "gradkit max", "p99", "JAX max", "p99", "naive max", "p99",
              "non-finite gk/JAX/naive", "worse", "gradkit max at"]
    out_rows = []
    t0 = time.time()
    missed = []
    for dname in dtypes:
        dtype = np.dtype(dname).type
        for row in rows():
            if only and not any(o in row.name for o in only):
                continue
            xs = sweep(dtype, n_log, n_lin, row.edges)
            if row.domain is not None:
                xs = xs[row.domain(xs.astype(np.float64)) | np.isinf(xs)]
            hi, lo = reference(row, xs)
            ok = ~np.isnan(hi)
            g, eg = measure(row.gradkit, xs, hi, lo, dtype, ok)
            j, ej = measure(row.jax_fn, xs, hi, lo, dtype, ok)
            nv, _ = measure(row.naive, xs, hi, lo, dtype, ok)
            worse = "—"
            if ej is not None and eg is not None:
                both = ~np.isnan(eg)
                ej_ = np.where(np.isnan(ej), np.inf, ej)
                worse = str(int(np.sum(both & (eg > 1.0) & (eg > ej_))))
            nf = "/".join("—" if s is None else str(s.nonfinite) for s in (g, j, nv))
            out_rows.append([
                row.name, dname, str(int(ok.sum())),
                fmt(g.max), fmt(g.p99),
                fmt(j.max) if j else "—", fmt(j.p99) if j else "—",
                fmt(nv.max) if nv else "—", fmt(nv.p99) if nv else "—",
                nf, worse, f"{g.argmax:.6g}"])
            if "seed" not in row.name and (g.max > 2.0 or g.nonfinite):
                missed.append(f"{row.name} ({dname})")
    widths = [max(len(r[i]) for r in [header, *out_rows]) for i in range(len(header))]
    if markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "|".join("---" for _ in header) + "|")
        for r in out_rows:
            print("| " + " | ".join(r) + " |")
    else:
        line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
        print(line)
        print("-" * len(line))
        for r in out_rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)))
    print(f"\nULP errors of the gradient vs mpmath ({mp.mp.dps} digits); {'quick' if quick else 'full'} sweep; "
          f"{jax.devices()[0].platform}; {time.time() - t0:.0f} s.")
    if missed:
        print("rows above 2 ULP or with non-finite gradients: " + ", ".join(missed))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer points (CI smoke)")
    p.add_argument("--dtype", choices=["float32", "float64", "both"], default="both")
    p.add_argument("--only", default=None, help="comma-separated substrings of row names")
    p.add_argument("--markdown", action="store_true", help="print a Markdown table")
    args = p.parse_args(argv)
    dtypes = ["float32", "float64"] if args.dtype == "both" else [args.dtype]
    only = args.only.split(",") if args.only else None
    return run(args.quick, dtypes, only, args.markdown)


if __name__ == "__main__":
    sys.exit(main())
