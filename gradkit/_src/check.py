"""``check_grads``: autodiff against float64 finite differences, element by element.

``check_grads`` reuses :func:`jax.test_util.check_grads` for its verdict (one
random direction per order and mode) and adds its own element-wise numbers:
for every differentiable input, order and mode, the derivative tensor from
autodiff is compared with central finite differences in float64, so a failure
names the worst element and both values.

The helpers at the top view a function as a map from one input leaf to its
flat floating-point output; :mod:`gradkit._src.compare` uses them too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.test_util
import numpy as np

from gradkit._src.args import Split, partition
from gradkit._src.describe import fmt, fmt_index, fn_name, is_float, leaf_names, one_line, relative_error, to_f64
from gradkit._src.errors import GradkitError
from gradkit._src.fd import NOT_JITTABLE, call_jit, differences, select_coords

__all__ = ["GradCheckReport", "GradCheckRow", "check_grads"]

_F64_TOL = 1e-5  # jax.test_util's default gradient tolerance for float64
_EPS = 1e-4  # jax.test_util's default finite-difference step


# --------------------------------------------------------------------------- a function of one input leaf


def flat_output(out: Any) -> jax.Array:
    """All inexact leaves of a function's output, raveled and concatenated."""
    leaves = [jnp.ravel(jnp.asarray(v)) for v in jax.tree_util.tree_leaves(out)
              if jnp.issubdtype(jnp.asarray(v).dtype, jnp.inexact)]
    if not leaves:
        raise GradkitError("the function has no floating-point output to differentiate.")
    if len(leaves) == 1:
        return leaves[0]
    dtype = jnp.result_type(*leaves)
    return jnp.concatenate([v.astype(dtype) for v in leaves])


def output_shape(fn: Callable[..., Any], args: Sequence[Any]) -> tuple[int, ...]:
    """The shape derivative labels use: the output's, if it is one array; else the flat concatenation's."""
    leaves = [v for v in jax.tree_util.tree_leaves(jax.eval_shape(fn, *args)) if jnp.issubdtype(v.dtype, jnp.inexact)]
    if len(leaves) == 1:
        return tuple(leaves[0].shape)
    return (int(sum(np.prod(v.shape, dtype=int) for v in leaves)),)


def float_inputs(fn: Any, args: Sequence[Any]) -> tuple[Split, list[Any], list[str]]:
    """``args`` split into floating-point leaves (differentiated) and the rest; a name per float leaf."""
    split, dyn = partition(tuple(args), dynamic=is_float)
    names = leaf_names(fn, args)
    return split, dyn, [names[i] for i in split.dyn_pos]


def partial_fn(fn: Callable[..., Any], split: Split, dyn: Sequence[Any], k: int) -> Callable[[Any], jax.Array]:
    """``x -> flat output of fn`` with every float leaf but the ``k``-th held at its value."""
    def h(x: Any) -> jax.Array:
        d = list(dyn)
        d[k] = x
        return flat_output(fn(*split.combine(d)))
    return h


def derivative_label(order: int, out_shape: tuple[int, ...], out_idx: int, in_shape: tuple[int, ...],
                     in_flat: Sequence[int], name: str) -> str:
    """``d out[i] / dx[j]``, ``d^2 out / dx[j] dx[k]``."""
    out = "out" + (fmt_index(np.unravel_index(out_idx, out_shape)) if out_shape else "")
    d = "d" if order == 1 else f"d^{order}"
    ins = " ".join(f"d{name}{fmt_index(np.unravel_index(j, in_shape)) if in_shape else ''}" for j in in_flat)
    return f"{d} {out} / {ins}"


# --------------------------------------------------------------------------- check_grads


@dataclasses.dataclass(frozen=True)
class GradCheckRow:
    """One (input, order, mode) of a :func:`check_grads` report.

    Attributes:
      input: the input's name (parameter name and pytree path).
      order: derivative order (1 = gradient/Jacobian, 2 = Hessian, …).
      mode: ``"fwd"`` (``jacfwd`` nested ``order`` times) or ``"rev"`` (``jacrev``).
      passed: every checked element within ``atol + rtol·|finite difference|``.
      max_abs_err: largest ``|autodiff − finite difference|``.
      max_rel_err: largest relative error, ``|autodiff − fd| / max(|fd|, atol)`` (the
        ``atol`` floor keeps it meaningful where the finite difference is 0).
      worst: the worst element (largest excess over the tolerance), as ``d^k out[i] / d x[j]…``.
      autodiff: the autodiff value at the worst element.
      numeric: the finite-difference value at the worst element.
      checked: how many input coordinates were probed; ``total`` how many there are.
      error: the exception message when the derivative could not be computed.
      max_rel_at: the element with the largest relative error.
    """

    input: str
    order: int
    mode: str
    passed: bool
    max_abs_err: float = 0.0
    max_rel_err: float = 0.0
    worst: str = ""
    autodiff: float = float("nan")
    numeric: float = float("nan")
    checked: int = 0
    total: int = 0
    error: str = ""
    max_rel_at: str = ""

    def __str__(self) -> str:
        head = f"{'ok  ' if self.passed else 'FAIL'} {self.input:<14} order {self.order} {self.mode}"
        if self.error:
            return f"{head}: {self.error}"
        sampled = f" ({self.checked} of {self.total} coordinates)" if self.checked < self.total else ""
        rel_at = f" at {self.max_rel_at}" if self.max_rel_at else ""
        return (f"{head}: max abs err {fmt(self.max_abs_err)}, max rel err {fmt(self.max_rel_err)}{rel_at}; "
                f"worst {self.worst}: autodiff {fmt(self.autodiff)} vs finite difference "
                f"{fmt(self.numeric)}{sampled}")


@dataclasses.dataclass(frozen=True)
class GradCheckReport:
    """Result of :func:`check_grads`; ``str(report)`` is a readable table.

    Attributes:
      function: the checked function's name.
      rows: one :class:`GradCheckRow` per (input, order, mode).
      jax_check: ``(mode, passed, message)`` from :func:`jax.test_util.check_grads`
        (a random-direction check of the whole function, up to ``order``).
      atol, rtol, eps: the tolerances and finite-difference step used (float64).
    """

    function: str
    rows: tuple[GradCheckRow, ...]
    jax_check: tuple[tuple[str, bool, str], ...]
    atol: float
    rtol: float
    eps: float

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows) and all(ok for _, ok, _ in self.jax_check)

    @property
    def failures(self) -> tuple[GradCheckRow, ...]:
        return tuple(r for r in self.rows if not r.passed)

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        lines = [f"check_grads({self.function}): {verdict} (float64 finite differences, eps={fmt(self.eps)}, "
                 f"atol={fmt(self.atol)}, rtol={fmt(self.rtol)})"]
        lines += ["  " + str(r) for r in self.rows]
        for mode, ok, msg in self.jax_check:
            lines.append(f"  jax.test_util.check_grads modes=({mode!r},): {'passed' if ok else 'FAILED: ' + msg}")
        return "\n".join(lines)

    def raise_if_failed(self) -> GradCheckReport:
        """Raises :class:`GradkitError` with the failing rows; returns the report otherwise."""
        if self.passed:
            return self
        bad = [str(r) for r in self.failures]
        bad += [f"jax.test_util.check_grads ({m}): {msg}" for m, ok, msg in self.jax_check if not ok]
        raise GradkitError(f"check_grads({self.function}) failed:\n  " + "\n  ".join(bad))


def _nested_jac(h: Callable[[Any], Any], mode: str, times: int) -> Callable[[Any], Any]:
    jac = jax.jacfwd if mode == "fwd" else jax.jacrev
    for _ in range(times):
        h = jac(h)
    return h


def _compare_arrays(ad: np.ndarray, fd: np.ndarray, atol: float, rtol: float
                    ) -> tuple[bool, float, float, int, int]:
    """(passed, max abs err, max rel err, flat index of the worst element, of the largest rel err)."""
    with np.errstate(invalid="ignore", over="ignore"):
        same = (ad == fd) | (np.isnan(ad) & np.isnan(fd))
        err = np.where(same, 0.0, np.abs(ad - fd))
        err = np.where(np.isnan(err), np.inf, err)
        excess = err - (atol + rtol * np.abs(fd))
    rel = relative_error(ad, fd, atol)
    excess = np.where(np.isnan(excess), np.inf, excess)
    passed = bool(np.all(excess <= 0)) and not bool(np.any(np.isnan(fd) & ~np.isnan(ad)))
    worst = int(np.argmax(err if passed else excess)) if excess.size else 0
    worst_rel = int(np.argmax(rel)) if rel.size else 0
    return passed, float(np.max(err, initial=0.0)), float(np.max(rel, initial=0.0)), worst, worst_rel


def check_grads(fn: Callable[..., Any], args: Sequence[Any], order: int = 2,
                modes: Sequence[str] = ("fwd", "rev"), *, atol: float | None = None,
                rtol: float | None = None, eps: float | None = None, max_coords: int = 64,
                raise_on_failure: bool = False) -> GradCheckReport:
    """Checks ``fn``'s derivatives against finite differences in float64; returns a report.

    The verdict of :func:`jax.test_util.check_grads` (one random direction, per
    mode) is kept, and each input, order and mode also gets element-wise
    numbers: ``jacfwd``/``jacrev`` nested ``order`` times against central
    differences of the order-below derivative, with the worst element named.
    Inputs are cast to float64 for the check (under ``jax.enable_x64``).

    Args:
      fn: a function of arrays (pytrees allowed) returning arrays.
      args: the point to check at, a tuple of arguments.
      order: check derivatives up to this order.
      modes: ``"fwd"`` and/or ``"rev"``.
      atol: absolute tolerance (default 1e-5, JAX's float64 gradient tolerance).
      rtol: relative tolerance (default 1e-5).
      eps: finite-difference step (default 1e-4, as JAX).
      max_coords: inputs with more elements are probed at this many sampled coordinates.
      raise_on_failure: raise :class:`GradkitError` instead of returning a failing report.

    Returns:
      A :class:`GradCheckReport`; ``report.passed``, ``report.raise_if_failed()``.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> r = gk.check_grads(lambda x: jnp.sum(jnp.sin(x) ** 2), (jnp.arange(3.0),), order=2)
      >>> r.passed, len(r.rows)
      (True, 4)
    """
    if not isinstance(args, (tuple, list)):
        raise GradkitError(f"check_grads expects args as a tuple of arguments, got {type(args).__name__}: "
                           "write check_grads(fn, (x,)).")
    bad_modes = [m for m in modes if m not in ("fwd", "rev")]
    if bad_modes or not modes:
        raise GradkitError(f"check_grads: modes must be 'fwd' and/or 'rev', got {tuple(modes)!r}.")
    if order < 1:
        raise GradkitError(f"check_grads: order must be at least 1, got {order}.")
    atol = _F64_TOL if atol is None else float(atol)
    rtol = _F64_TOL if rtol is None else float(rtol)
    eps = _EPS if eps is None else float(eps)
    rows: list[GradCheckRow] = []
    verdicts: list[tuple[str, bool, str]] = []
    with jax.enable_x64(True):
        split, dyn, names = float_inputs(fn, args)
        dyn = [jnp.asarray(to_f64(x)) for x in dyn]
        out_shape = output_shape(fn, split.combine(dyn))
        for k, (x, label) in enumerate(zip(dyn, names)):
            h0 = partial_fn(fn, split, dyn, k)
            coords = select_coords(x.size, max_coords)
            for mode in modes:
                for o in range(1, order + 1):
                    rows.append(_check_one(h0, x, mode, o, coords, out_shape, label, atol, rtol, eps))
        # integer inputs are held fixed (JAX's check cannot perturb them)
        float_fn = lambda *d: fn(*split.combine(d))
        for mode in modes:
            verdicts.append(_jax_verdict(float_fn, tuple(dyn), order, mode, atol, rtol, eps))
    report = GradCheckReport(fn_name(fn), tuple(rows), tuple(verdicts), atol, rtol, eps)
    if raise_on_failure:
        report.raise_if_failed()
    return report


def _jax_verdict(f: Callable[..., Any], args: tuple[Any, ...], order: int, mode: str, atol: float, rtol: float,
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


def _check_one(h0: Callable[[Any], Any], x: jax.Array, mode: str, k: int, coords: np.ndarray,
               out_shape: tuple[int, ...], label: str, atol: float, rtol: float, eps: float) -> GradCheckRow:
    total = int(x.size)
    try:
        lower = _nested_jac(h0, mode, k - 1)
        ad = np.asarray(call_jit(_nested_jac(h0, mode, k), x), dtype=np.float64)
        ad = ad.reshape(-1, total)[:, coords]  # (everything before the last input axis, coords)
        fd = differences(lower, x, coords, eps).central
    except Exception as e:
        return GradCheckRow(label, k, mode, False, error=f"{type(e).__name__}: {one_line(str(e), 1, 400)}",
                            checked=len(coords), total=total)
    passed, abs_err, rel_err, worst, worst_rel = _compare_arrays(ad, fd, atol, rtol)

    def name(flat: int) -> str:
        r, c = np.unravel_index(flat, ad.shape)
        # r enumerates (output element, earlier input axes…) in row-major order.
        out_size = max(1, int(np.prod(out_shape)))
        out_idx, rest = divmod(int(r), total ** (k - 1)) if k > 1 else (int(r), 0)
        earlier = list(np.unravel_index(rest, (total,) * (k - 1))) if k > 1 else []
        return derivative_label(k, out_shape, out_idx % out_size, tuple(x.shape),
                                [int(j) for j in earlier] + [int(coords[c])], label)

    r, c = np.unravel_index(worst, ad.shape)
    return GradCheckRow(label, k, mode, passed, abs_err, rel_err, name(worst), float(ad[r, c]), float(fd[r, c]),
                        len(coords), total, max_rel_at=name(worst_rel))
