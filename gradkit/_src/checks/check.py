"""``check_grads``: autodiff at the inputs' dtypes against float64 finite differences, element by element.

The derivative under test is computed as the user runs it: at the dtypes of
the given inputs (float32 stays float32, bfloat16 stays bfloat16), under
``jax.jit``. Only the reference goes to float64: central finite differences of
the function (order 1) or of its float64 derivative one order below (order 2,
...). For every differentiable input, order and mode the derivative tensor is
compared element by element, so a failure names the worst element and both
values; a non-finite derivative where the reference is finite always fails.
Tolerances follow the least precise dtype involved (``max(1e-5, sqrt(eps))``).
A random direction through every input at once covers the coordinates the
element-wise rows sample out. ``upcast=True`` restores the float64-only check
(both sides in float64, verdict from :func:`jax.test_util.check_grads`).

The function is viewed one input leaf at a time (:mod:`gradkit._src.checks.leaf_fn`,
shared with ``compare``); the rows and the report are
:mod:`gradkit._src.checks.grad_report`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np
from jax.typing import DTypeLike

from gradkit._src.checks.describe import fmt, fn_name, one_line, relative_error, to_f64
from gradkit._src.checks.fd import NOT_JITTABLE, call_jit, differences, select_coords
from gradkit._src.checks.grad_report import GradCheckReport, GradCheckRow, default_tolerance, least_precise
from gradkit._src.checks.leaf_fn import derivative_label, flat_output, float_inputs, output_shape, partial_fn
from gradkit._src.core.args import Split
from gradkit._src.errors import GradkitError

__all__ = ["GradCheckReport", "GradCheckRow", "check_grads"]

_EPS = 1e-4  # jax.test_util's default finite-difference step
_REL_STEP = 2.0 ** -30  # the step is max(eps, |x|·2^-30): x ± 1e-4 is x itself in float64 once |x| > 1e12
_FD_ULPS = 64  # float64 roundings of |f| allowed for in a finite difference: 64·eps64·|f| / step
_EPS64 = float(np.finfo(np.float64).eps)


# --------------------------------------------------------------------------- steps


def fd_steps(x64: np.ndarray, eps: float) -> np.ndarray:
    """One finite-difference step per flat coordinate: ``max(eps, |x|·2^-30)``.

    ``eps`` where ``|x| ≤ eps·2^30`` (about 1e5 for the default 1e-4); beyond,
    the step grows with ``|x|`` so that ``x ± step`` stays distinct from ``x``
    in float64 (it is not, from ``|x|`` ≈ 1e12 on, for a step of 1e-4).
    """
    with np.errstate(over="ignore", invalid="ignore"):
        steps = np.maximum(eps, np.abs(np.ravel(x64).astype(np.float64)) * _REL_STEP)
    return np.where(np.isfinite(steps), steps, eps)


def _fd_noise(magnitude: np.ndarray | None, step: np.ndarray | float) -> np.ndarray | float:
    """The float64 rounding error of a central difference: ``64·eps64·|f| / step`` (0 where ``|f|`` is not finite)."""
    if magnitude is None:
        return 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        return np.where(np.isfinite(magnitude), _FD_ULPS * _EPS64 * magnitude / step, 0.0)


_LEVELS = 16  # halvings of the step tried where a difference disagrees: down to step/65536


def _refine(ad: np.ndarray, fd: np.ndarray, noise: np.ndarray | float, atol: float, rtol: float,
            at_scale: Callable[[float, np.ndarray], tuple[np.ndarray, np.ndarray]],
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(fd, noise, refined)``: the step's truncation error taken out where ``ad`` and ``fd`` disagree.

    A central difference with step ``h`` is off from the derivative by about ``h²·f⁽³⁾/6``: near a
    singularity (a norm at ``|x| = 1e-3``, a reciprocal close to 0) that exceeds the tolerance while the
    derivative is right. For each column holding a disagreeing element, ``at_scale(s, cols)`` gives the
    differences ``D_k`` of those columns and their float64 rounding at step ``s·h``, ``s = 2^-k``;
    Richardson's ``R_k = (4·D_k − D_(k−1)) / 3`` (error ``O(h⁴)``) replaces an element's difference at the
    first ``k`` where it agrees with ``R_(k−1)`` to within the tolerance (its noise: ``1.5×`` the rounding at
    that step plus ``|R_k − R_(k−1)|``), tried only while that rounding is within the tolerance. An element
    whose estimates never settle (a kink or a singularity within the step) keeps its step-``h`` difference.
    A difference that is not finite (``log`` at ``x < h``: the step left the domain) is refined the same way.
    Nothing is chosen by whether autodiff then agrees: a wrong derivative stays wrong. ``refined`` marks
    the elements replaced.
    """
    noise = np.array(np.broadcast_to(np.asarray(noise, dtype=np.float64), np.shape(fd)))
    with np.errstate(invalid="ignore", over="ignore"):  # (a difference that is not finite: the step left the domain)
        pending = np.isfinite(ad) & ~(np.abs(ad - fd) <= atol + rtol * np.abs(fd) + noise)
    cols = np.flatnonzero(pending.any(axis=0))
    refined = np.zeros(np.shape(fd), dtype=bool)
    if not len(cols):
        return fd, noise, refined
    fd = np.array(fd, dtype=np.float64)
    pending = pending[:, cols]
    d_prev, r_prev = fd[:, cols], None
    for k in range(1, _LEVELS + 1):
        d, rounding = at_scale(2.0 ** -k, cols)
        with np.errstate(invalid="ignore", over="ignore"):
            r = (4 * d - d_prev) / 3
            allowed = atol + rtol * np.abs(r)
            if r_prev is not None:
                spread = np.abs(r - r_prev)
                settled = pending & np.isfinite(r) & (spread <= allowed) & (1.5 * rounding <= allowed)
                rows, at = np.nonzero(settled)
                fd[rows, cols[at]] = r[rows, at]
                noise[rows, cols[at]] = 1.5 * rounding[rows, at] + spread[rows, at]
                refined[rows, cols[at]] = True
                pending &= ~settled
            pending &= ~(1.5 * rounding > allowed)  # below this step, float64 rounding swamps the derivative
        if not pending.any():
            break
        d_prev, r_prev = d, r
    return fd, noise, refined


# --------------------------------------------------------------------------- check_grads


def _nested_jac(h: Callable[[jax.Array], jax.Array], mode: str, times: int) -> Callable[[jax.Array], jax.Array]:
    jac = jax.jacfwd if mode == "fwd" else jax.jacrev
    for _ in range(times):
        h = jac(h)
    return h


@dataclasses.dataclass(frozen=True)
class _Comparison:
    passed: bool
    max_abs_err: float
    max_rel_err: float
    worst: int  # flat index of the worst element: the first non-finite one, else the largest excess
    worst_rel: int  # flat index of the largest relative error
    nonfinite: int
    unresolved: int
    noise: float


def _compare_arrays(ad: np.ndarray, fd: np.ndarray, atol: float, rtol: float,
                    noise: np.ndarray | float = 0.0) -> _Comparison:
    """Element-wise ``|ad − fd| ≤ atol + rtol·|fd| + noise``; a non-finite ``ad`` where ``fd`` is finite fails."""
    noise = np.broadcast_to(np.asarray(noise, dtype=np.float64), np.shape(fd))
    with np.errstate(invalid="ignore", over="ignore"):
        same = (ad == fd) | (np.isnan(ad) & np.isnan(fd))
        err = np.where(same, 0.0, np.abs(ad - fd))
        err = np.where(np.isnan(err), np.inf, err)
        allowed = atol + rtol * np.abs(fd)
        excess = err - (allowed + noise)
        unresolved = np.isfinite(fd) & np.isfinite(ad) & (noise > allowed)
    rel = relative_error(ad, fd, atol)
    excess = np.where(np.isnan(excess), np.inf, excess)
    nonfinite = ~np.isfinite(ad) & np.isfinite(fd)
    passed = bool(np.all(excess <= 0)) and not bool(np.any(np.isnan(fd) & ~np.isnan(ad)))
    if nonfinite.any():
        worst = int(np.flatnonzero(nonfinite)[0])
    else:
        worst = int(np.argmax(err if passed else excess)) if excess.size else 0
    worst_rel = int(np.argmax(rel)) if rel.size else 0
    return _Comparison(passed, float(np.max(err, initial=0.0)), float(np.max(rel, initial=0.0)), worst, worst_rel,
                       int(nonfinite.sum()), int(unresolved.sum()),
                       float(np.max(np.where(unresolved, noise, 0.0), initial=0.0)))


def check_grads(fn: Callable[..., object], args: Sequence[object], order: int = 1,
                modes: Sequence[str] = ("fwd", "rev"), *, atol: float | None = None,
                rtol: float | None = None, eps: float | None = None, max_coords: int = 64,
                raise_on_failure: bool = False, upcast: bool = False,
                matmul_precision: str | None = "float32") -> GradCheckReport:
    """Checks ``fn``'s derivatives, at the dtypes it runs at, against float64 finite differences.

    Each input, order (1 by default) and mode gets element-wise numbers: ``jacfwd``/``jacrev``
    nested ``order`` times, evaluated under ``jax.jit`` at the dtypes of
    ``args`` (float32 stays float32), against central differences in float64
    of the function (order 1) or of its float64 derivative one order below,
    with the worst element named. A derivative that is NaN or inf where the
    finite difference is finite fails, naming the element. A random direction
    through every input at once (orders 1 to ``order``, per mode) covers the
    coordinates that ``max_coords`` samples out.

    Tolerances follow the least precise dtype in the computation (input, output,
    derivative): ``max(1e-5, sqrt(eps(dtype)))`` for both ``atol`` and ``rtol``,
    so 1e-5 for float64, 3.45e-4 for float32, 0.031 for float16, 0.088 for
    bfloat16; the report states them. The finite difference's own float64
    rounding (``64·eps64·|f| / step``) is added, and elements where it exceeds
    the tolerance are counted in the report as only checked to that precision.
    Where an element disagrees, the difference is taken again at half the step,
    a quarter, … (down to step/65536) and Richardson-extrapolated; the first
    estimate that agrees with the one before it within the tolerance replaces
    it. So a right derivative a few steps from a singularity or a kink (a norm
    at ``|x| = 1e-3``, ``log`` at ``x = 1e-6``, where the step's truncation error
    or the domain's edge spoils the difference) passes, and a wrong one fails;
    where the estimates never settle, the step's own difference decides.

    Args:
      fn: a function of arrays (pytrees allowed) returning arrays.
      args: the point to check at, a tuple of arguments.
      order: check derivatives up to this order (default 1, the gradient/Jacobian, as
        PyTorch's ``gradcheck``; ``jax.test_util.check_grads`` has no default). ``order=2``
        also checks every input's Hessian by ``jacfwd``/``jacrev`` of the Jacobian against
        finite differences of the float64 gradient, and takes about 3-4 times as long as
        order 1 (a 67-parameter MLP with its batch: 21 s against 71 s on two busy CPU
        cores); ask for it where second derivatives matter (``hessian``, a rule used
        under ``jax.jacfwd(jax.grad(...))``).
      modes: ``"fwd"`` and/or ``"rev"``.
      atol: absolute tolerance (default: by dtype, as above).
      rtol: relative tolerance (default: by dtype, as above).
      eps: finite-difference step (default 1e-4, as JAX; per coordinate it is
        ``max(eps, |x|·2^-30)``, so that ``x ± step`` differs from ``x`` in float64).
      max_coords: inputs with more elements are probed at this many sampled coordinates.
      raise_on_failure: raise :class:`GradkitError` instead of returning a failing report.
      upcast: evaluate the derivatives in float64 too (the inputs are cast, under
        ``jax.enable_x64``), with the float64 tolerance and the verdict of
        :func:`jax.test_util.check_grads`: it checks the math of the float64
        program, not what the function computes at the inputs' dtypes.
      matmul_precision: the precision of matrix products while checking (JAX's
        ``jax_default_matmul_precision``). The default, ``"float32"``, checks
        float32 products at full float32: on a GPU JAX's default is TF32 (10-bit
        mantissa, about 1e-3 relative), on a TPU bfloat16 passes, and either
        rounding exceeds the float32 tolerance with no derivative wrong. ``None``
        checks under your own configuration (pass ``atol``/``rtol`` to match it).
        On the CPU every setting computes float32 products in full.

    Returns:
      A :class:`GradCheckReport`; ``report.passed``, ``report.raise_if_failed()``.
      ``str(report)``: one line per order and mode when every row passed, every row otherwise.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> r = gk.check_grads(lambda x: jnp.sum(jnp.sin(x) ** 2), (jnp.arange(3.0),), order=2)
      >>> r.passed, len(r.rows), r.rows[0].dtype
      (True, 4, 'float32')
      >>> softplus = lambda x: jnp.sum(jnp.log1p(jnp.exp(x)))   # exp overflows in float32 at x = 200
      >>> r = gk.check_grads(softplus, (jnp.array([1.0, 200.0]),), order=1, modes=("rev",))
      >>> r.passed, r.rows[0].worst, r.rows[0].autodiff
      (False, 'd out / dx[1]', nan)
    """
    if not isinstance(args, (tuple, list)):
        raise GradkitError(f"check_grads expects args as a tuple of arguments, got {type(args).__name__}: "
                           "write check_grads(fn, (x,)).")
    modes = tuple(modes) if not isinstance(modes, str) else (modes,)
    bad_modes = [m for m in modes if m not in ("fwd", "rev")]
    if bad_modes or not modes:
        raise GradkitError(f"check_grads: modes must be 'fwd' and/or 'rev', got {tuple(modes)!r}.")
    if isinstance(order, bool) or not isinstance(order, int) or order < 1:
        raise GradkitError(f"check_grads: order must be at least 1 (an integer), got {order!r}.")
    if not isinstance(upcast, bool):
        raise GradkitError(f"check_grads: upcast must be True or False, got {upcast!r}.")
    if not isinstance(max_coords, int) or max_coords < 1:
        raise GradkitError(f"check_grads: max_coords must be a positive integer, got {max_coords!r}.")
    for name, value in (("atol", atol), ("rtol", rtol), ("eps", eps)):
        try:
            ok = value is None or (float(value) >= 0 and math.isfinite(float(value)))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise GradkitError(f"check_grads: {name} must be a finite number ≥ 0, got {value!r}.")
    eps = _EPS if eps is None else float(eps)
    if eps == 0:
        raise GradkitError("check_grads: eps, the finite-difference step, must be positive, got 0.")
    if matmul_precision is not None and matmul_precision not in _MATMUL_PRECISIONS:
        raise GradkitError(f"check_grads: matmul_precision must be one of {', '.join(_MATMUL_PRECISIONS)} or None "
                           f"(your own jax_default_matmul_precision), got {matmul_precision!r}.")
    precision = (jax.default_matmul_precision(matmul_precision) if matmul_precision is not None
                 else contextlib.nullcontext())
    with precision:
        report = _check_grads(fn, args, order, modes, atol, rtol, eps, max_coords, upcast)
    if raise_on_failure:
        report.raise_if_failed()
    return report


#: The names ``jax.default_matmul_precision`` takes.
_MATMUL_PRECISIONS = ("bfloat16", "tensorfloat32", "float32", "default", "high", "highest")


def _check_grads(fn: Callable[..., object], args: Sequence[object], order: int, modes: tuple[str, ...],
                 atol: float | None, rtol: float | None, eps: float, max_coords: int,
                 upcast: bool) -> GradCheckReport:
    """check_grads after its arguments are checked, under the chosen matmul precision."""

    split, dyn, names = float_inputs(fn, args)
    if not dyn:
        raise GradkitError(f"check_grads({fn_name(fn)}): no floating-point input to differentiate "
                           "(integer and other non-float arguments are held fixed).")
    with jax.enable_x64(True):
        dyn64 = [jnp.asarray(to_f64(x)) for x in dyn]
        x64_np = [np.asarray(x) for x in dyn64]
    # where the derivative under test runs: the caller's own config, or float64 with upcast=True
    at_test: Callable[[], contextlib.AbstractContextManager[object]] = (
        (lambda: jax.enable_x64(True)) if upcast else contextlib.nullcontext)
    with at_test():
        dyn_t = dyn64 if upcast else [jnp.asarray(x) for x in dyn]
        out_shape = output_shape(fn, split.combine(dyn_t))
        out_dtypes = [v.dtype for v in jax.tree_util.tree_leaves(jax.eval_shape(fn, *split.combine(dyn_t)))
                      if jnp.issubdtype(v.dtype, jnp.inexact)]
    steps = [fd_steps(x, eps) for x in x64_np]

    def tolerance(dtype: np.dtype) -> tuple[float, float]:
        return (default_tolerance(dtype) if atol is None else float(atol),
                default_tolerance(dtype) if rtol is None else float(rtol))

    rows: list[GradCheckRow] = []
    for k, label in enumerate(names):
        h_t = partial_fn(fn, split, dyn_t, k)
        h64 = partial_fn(fn, split, dyn64, k)
        coords = select_coords(int(np.size(x64_np[k])), max_coords)
        for mode in modes:
            for o in range(1, order + 1):
                rows.append(_check_one(h_t, dyn_t[k], h64, dyn64[k], at_test, mode, o, coords, steps[k],
                                       out_shape, out_dtypes, label, tolerance))
    verdicts: list[tuple[str, bool, str]] = []
    all_dtype = least_precise([x.dtype for x in dyn_t] + out_dtypes)
    d_atol, d_rtol = tolerance(all_dtype)
    for mode in modes:
        if upcast:
            with jax.enable_x64(True):
                # integer inputs are held fixed (JAX's check cannot perturb them)
                float_fn = lambda *d: fn(*split.combine(d))
                verdicts.append(_jax_verdict(float_fn, tuple(dyn64), order, mode, d_atol, d_rtol, eps))
        else:
            verdicts.append(_directional(fn, split, dyn_t, dyn64, steps, order, mode, d_atol, d_rtol, eps,
                                         all_dtype))
    tols: dict[str, tuple[float, float]] = {}
    for r in rows:
        if r.dtype:
            tols.setdefault(r.dtype, (r.atol, r.rtol))
    if not tols:
        tols[str(all_dtype)] = (d_atol, d_rtol)
    loosest = max(tols.values())
    return GradCheckReport(fn_name(fn), tuple(rows), tuple(verdicts), loosest[0], loosest[1], eps, upcast,
                           tuple((d, a, r) for d, (a, r) in tols.items()))


def _jax_verdict(f: Callable[..., object], args: tuple[jax.Array, ...], order: int, mode: str, atol: float, rtol: float,
                 eps: float) -> tuple[str, bool, str]:
    """``(mode, passed, message)`` from :func:`jax.test_util.check_grads` (jitted when the function allows)."""
    for g in (jax.jit(f), f):
        try:
            jax.test_util.check_grads(g, args, order, modes=(mode,), atol=atol, rtol=rtol, eps=eps)
            return mode, True, ""
        except NOT_JITTABLE:
            continue
        except AssertionError as e:
            return mode, False, one_line(str(e), 3, 400)
        except Exception as e:  # e.g. forward mode through a custom_vjp
            return mode, False, f"{type(e).__name__}: {one_line(str(e), 3, 400)}"
    return mode, False, "the function could not be evaluated"


def _check_one(h_t: Callable[[jax.Array], jax.Array], x_t: jax.Array, h64: Callable[[jax.Array], jax.Array],
               x64: jax.Array, at_test: Callable[[], contextlib.AbstractContextManager[object]], mode: str, k: int,
               coords: np.ndarray,
               steps: np.ndarray, out_shape: tuple[int, ...], out_dtypes: Sequence[DTypeLike], label: str,
               tolerance: Callable[[np.dtype], tuple[float, float]]) -> GradCheckRow:
    """One row: the order-``k`` derivative at ``x_t``'s dtype, jitted, vs float64 differences of order ``k − 1``."""
    total = int(np.size(x64))
    try:
        with at_test():
            ad_array = call_jit(_nested_jac(h_t, mode, k), x_t)
        ad_dtype = ad_array.dtype
        ad = np.asarray(ad_array, dtype=np.float64).reshape(-1, total)[:, coords]  # (everything before, coords)
    except Exception as e:
        return GradCheckRow(label, k, mode, False, error=f"{type(e).__name__}: {one_line(str(e), 1, 400)}",
                            checked=len(coords), total=total, dtype=str(x_t.dtype))
    dtype = least_precise([x_t.dtype, ad_dtype, *out_dtypes])
    atol, rtol = tolerance(dtype)
    step = steps[coords]
    try:
        with jax.enable_x64(True):
            d = differences(_nested_jac(h64, mode, k - 1), x64, coords, step)
    except Exception as e:
        return GradCheckRow(label, k, mode, False, checked=len(coords), total=total, dtype=str(dtype), atol=atol,
                            rtol=rtol, error=f"the float64 finite-difference reference failed: {type(e).__name__}: "
                                             f"{one_line(str(e), 1, 400)}")
    # the step float64 actually took ((x + s) − (x − s) need not be 2s once |x| is large)
    xc = np.ravel(np.asarray(x64))[coords]
    taken = (xc + step) - (xc - step)
    fd = d.central * (2 * step / taken)[None, :]

    def at_scale(s: float, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        st, xs = step[cols] * s, xc[cols]
        with jax.enable_x64(True):
            ds = differences(_nested_jac(h64, mode, k - 1), x64, coords[cols], st)
        rounding = np.broadcast_to(_fd_noise(ds.magnitude, st[None, :]), ds.central.shape)
        return ds.central * (2 * st / ((xs + st) - (xs - st)))[None, :], rounding

    fd, noise, _ = _refine(ad, fd, _fd_noise(d.magnitude, step[None, :]), atol, rtol, at_scale)
    c = _compare_arrays(ad, fd, atol, rtol, noise)

    def name(flat: int) -> str:
        r, col = np.unravel_index(flat, ad.shape)
        # r enumerates (output element, earlier input axes…) in row-major order.
        out_size = max(1, int(np.prod(out_shape)))
        out_idx, rest = divmod(int(r), total ** (k - 1)) if k > 1 else (int(r), 0)
        earlier = list(np.unravel_index(rest, (total,) * (k - 1))) if k > 1 else []
        return derivative_label(k, out_shape, out_idx % out_size, tuple(np.shape(x64)),
                                [int(j) for j in earlier] + [int(coords[col])], label)

    r, col = np.unravel_index(c.worst, ad.shape)
    return GradCheckRow(label, k, mode, c.passed, c.max_abs_err, c.max_rel_err, name(c.worst), float(ad[r, col]),
                        float(fd[r, col]), len(coords), total, max_rel_at=name(c.worst_rel), dtype=str(dtype),
                        atol=atol, rtol=rtol, nonfinite=c.nonfinite, elements=int(ad.size),
                        unresolved=c.unresolved, noise=c.noise)


# --------------------------------------------------------------------------- one random direction, every input


def _levels(f: Callable[..., jax.Array], leaves: Sequence[jax.Array], order: int, mode: str,
            dtype_of: Callable[[jax.Array], DTypeLike]) -> list[Callable[..., jax.Array]]:
    """``[F_1 = f, F_2, …, F_order]``: ``F_k+1(x) = jvp(F_k, x, t_k)`` (fwd) or ``vjp(F_k, x)(u_k)`` (rev).

    ``t_k``, ``u_k`` are fixed standard-normal draws (seeded by ``k``), cast by
    ``dtype_of`` to the dtypes of the point, so the float64 reference and the
    function at its own dtypes are the same chain of derivatives.
    """
    fs = [f]
    for k in range(1, order):
        prev = fs[-1]
        rng = np.random.RandomState(1000 + k)
        if mode == "fwd":
            t = tuple(jnp.asarray(rng.standard_normal(np.shape(x)), dtype_of(x)) for x in leaves)
            fs.append(lambda *d, prev=prev, t=t: jax.jvp(prev, d, t)[1])
        else:
            out = jax.eval_shape(prev, *leaves)
            u = jnp.asarray(rng.standard_normal(out.shape), out.dtype)
            fs.append(lambda *d, prev=prev, u=u: flat_output(jax.vjp(prev, *d)[1](u)))
    return fs


def _directional(fn: Callable[..., object], split: Split, dyn_t: Sequence[jax.Array], dyn64: Sequence[jax.Array],
                 steps: Sequence[np.ndarray], order: int, mode: str, atol: float, rtol: float, eps: float,
                 dtype: np.dtype) -> tuple[str, bool, str]:
    """``(mode, passed, message)``: one random direction through every float input, orders 1 to ``order``.

    Per order ``k``: ``jvp`` (fwd) or ``vjp`` (rev, as ``<v, J t>``) of ``F_k`` at
    the inputs' dtypes under ``jax.jit``, against the float64 central difference
    of ``F_k`` along ``t`` (``t_j`` ∝ the coordinate's step, so large inputs move
    enough to register).
    """
    rng = np.random.RandomState(0)
    shapes = [np.shape(x) for x in dyn64]
    t = [rng.standard_normal(s) * (st.reshape(s) / eps) for s, st in zip(shapes, steps)]
    f = lambda *d: flat_output(fn(*split.combine(list(d))))
    try:
        fs_t = _levels(f, dyn_t, order, mode, lambda x: x.dtype)
        with jax.enable_x64(True):
            fs64 = _levels(f, dyn64, order, mode, lambda x: jnp.float64)
    except Exception as e:
        return mode, False, f"{type(e).__name__}: {one_line(str(e), 1, 400)}"
    for k in range(1, order + 1):
        F_t, F64 = fs_t[k - 1], fs64[k - 1]
        try:
            if mode == "fwd":
                tangent = tuple(jnp.asarray(v, x.dtype) for v, x in zip(t, dyn_t))
                ad = np.asarray(call_jit(lambda *d, F=F_t, tg=tangent: jax.jvp(F, d, tg)[1], *dyn_t),
                                dtype=np.float64)
            else:
                out = jax.eval_shape(F_t, *dyn_t)
                v = np.random.RandomState(2000 + k).standard_normal(out.shape)
                cot = jnp.asarray(v, out.dtype)
                grads = call_jit(lambda *d, F=F_t, c=cot: jax.vjp(F, *d)[1](c), *dyn_t)
                terms = np.concatenate([np.ravel(np.asarray(g, dtype=np.float64) * tj) for g, tj in zip(grads, t)])
        except Exception as e:
            return mode, False, f"order {k}: {type(e).__name__}: {one_line(str(e), 1, 400)}"
        # the element-wise tolerance carried along the direction: atol per element of the derivative
        # becomes atol·|t| (·|v| in reverse mode), rtol·|J| becomes rtol·|J t| (or |t·(Jᵀv)|)
        size = float(np.sqrt(sum(np.sum(tj * tj) for tj in t)))
        weights, spread = np.ones(1), 0.0
        if mode == "rev":
            ad = np.atleast_1d(np.sum(terms))
            size *= float(np.linalg.norm(v))
            weights, spread = v.ravel(), float(np.linalg.norm(terms))  # |t·(Jᵀv)| term by term

        def reference(s: float, F64: Callable[..., jax.Array] = F64,
                      weights: np.ndarray = weights) -> tuple[np.ndarray, np.ndarray]:
            """The float64 central difference along ``t`` with step ``s·eps``, and its rounding."""
            h = s * eps
            with jax.enable_x64(True):
                plus = np.asarray(call_jit(F64, *[x + h * tj for x, tj in zip(dyn64, t)]), dtype=np.float64)
                minus = np.asarray(call_jit(F64, *[x - h * tj for x, tj in zip(dyn64, t)]), dtype=np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                ref = np.where(plus == minus, 0.0, plus - minus) / (2 * h)
                noise = _fd_noise(np.fmax(np.abs(plus), np.abs(minus)), h)
                if mode == "rev":
                    ref = np.atleast_1d(np.sum(weights * ref))
                    noise = np.atleast_1d(np.sum(np.abs(weights) * noise))
            return np.ravel(ref), np.ravel(noise)

        def cancellation(ref: np.ndarray, spread: float = spread) -> np.ndarray | float:
            """Reverse mode: ``rtol·(|t·(Jᵀv)| term by term − |<v, J t>|)``, what cancellation in the sum costs."""
            return rtol * np.maximum(0.0, spread - np.abs(ref)) if mode == "rev" else 0.0

        try:
            ref, noise = reference(1.0)
            def column(s: float, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
                r, n = reference(s)
                return r.reshape(-1, 1), n.reshape(-1, 1)

            ref2, noise2, refined = _refine(ad.reshape(-1, 1), ref.reshape(-1, 1),
                                            (noise + cancellation(ref)).reshape(-1, 1), atol * size, rtol, column)
        except Exception as e:
            return mode, False, (f"order {k}: the float64 finite-difference reference failed: "
                                 f"{type(e).__name__}: {one_line(str(e), 1, 400)}")
        ref = ref2.ravel()  # a refined element's noise is its rounding and spread: add the cancellation
        noise = np.where(refined.ravel(), noise2.ravel() + cancellation(ref), noise2.ravel())
        c = _compare_arrays(ad, ref, atol * size, rtol, noise)
        if not c.passed:
            where = "<v, J t>" if mode == "rev" else f"element {c.worst}"
            a, b = float(ad[c.worst]), float(ref[c.worst])
            if c.nonfinite:
                return mode, False, (f"order {k}, {where}: autodiff {fmt(a)} ({dtype}) where the float64 finite "
                                     f"difference is finite ({fmt(b)})")
            if not math.isfinite(b):
                return mode, False, (f"order {k}, {where}: autodiff {fmt(a)} vs float64 finite difference {fmt(b)} "
                                     "(the function is not finite a step away)")
            allowed = atol * size + rtol * abs(b) + float(np.ravel(noise)[c.worst])
            return mode, False, (f"order {k}, {where}: autodiff {fmt(a)} vs finite difference {fmt(b)} "
                                 f"(|err| {fmt(abs(a - b))} > {fmt(allowed)} allowed at {dtype})")
    return mode, True, ""
