"""``compare``: a custom gradient next to a reference, and why they differ.

``compare`` puts a custom gradient next to a reference (the autodiff of a plain
implementation, or finite differences) and says, with numbers, why they differ:
an approximation inside the rule, a branch that is wrong on one side, a dtype
or precision mismatch between forward and backward, an ignored term.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from gradkit._src.checks.describe import fmt, fn_name, relative_error, to_f64
from gradkit._src.checks.fd import call_jit, differences
from gradkit._src.checks.leaf_fn import derivative_label, float_inputs, output_shape, partial_fn
from gradkit._src.core.args import Split
from gradkit._src.errors import GradkitError

__all__ = ["Comparison", "InputComparison", "compare"]


@dataclasses.dataclass(frozen=True)
class InputComparison:
    """How one input's custom gradient compares with the reference.

    Attributes:
      input: the input's name.
      dtype: dtype of the input; ``custom_dtype`` / ``reference_dtype`` of the gradients.
      max_abs_err, max_rel_err, max_ulp_err: over all Jacobian elements; ULPs are
        counted in the custom gradient's dtype.
      worst: the worst element (``d out[i] / d x[j]``), ``worst_input`` the input value
        there, ``worst_custom`` / ``worst_reference`` both derivatives.
      mismatched: elements whose error exceeds ``tolerance``; ``size`` the number of elements.
      causes: the likely causes, each a sentence with numbers.
      jacobians: for small inputs, rows ``(element, input value, custom, reference)``.
    """

    input: str
    dtype: str
    custom_dtype: str
    reference_dtype: str
    max_abs_err: float
    max_rel_err: float
    max_ulp_err: float
    worst: str
    worst_input: float
    worst_custom: float
    worst_reference: float
    mismatched: int
    size: int
    tolerance: float
    causes: tuple[str, ...]
    jacobians: tuple[tuple[str, float, float, float], ...] = ()

    @property
    def agrees(self) -> bool:
        return self.mismatched == 0 and self.custom_dtype == self.reference_dtype

    def __str__(self) -> str:
        head = (f"{self.input} ({self.dtype}): " + ("agrees" if self.agrees else
                f"DIFFERS on {self.mismatched} of {self.size} elements"))
        lines = [head,
                 f"  max abs err {fmt(self.max_abs_err)}, max rel err {fmt(self.max_rel_err)}, "
                 f"max {fmt(self.max_ulp_err)} ULP ({self.custom_dtype})",
                 f"  worst {self.worst} at {self.input}={fmt(self.worst_input)}: custom "
                 f"{fmt(self.worst_custom)}, reference {fmt(self.worst_reference)}"]
        lines += [f"  cause: {c}" for c in self.causes]
        if self.jacobians:
            lines.append(f"  {'element':<22}{'input':>12}{'custom':>14}{'reference':>14}{'diff':>12}")
            for el, xv, cv, rv in self.jacobians:
                lines.append(f"  {el:<22}{fmt(xv):>12}{fmt(cv):>14}{fmt(rv):>14}{fmt(cv - rv):>12}")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """Result of :func:`compare`: one :class:`InputComparison` per differentiable input."""

    function: str
    reference: str
    mode: str
    inputs: tuple[InputComparison, ...]

    @property
    def agrees(self) -> bool:
        return all(c.agrees for c in self.inputs)

    def __getitem__(self, name: str) -> InputComparison:
        for c in self.inputs:
            if c.input == name:
                return c
        raise KeyError(f"no input named {name!r}; inputs: {', '.join(c.input for c in self.inputs)}")

    def __str__(self) -> str:
        head = (f"compare({self.function} vs {self.reference}, {self.mode} mode): "
                + ("gradients agree" if self.agrees else "gradients DIFFER"))
        return "\n".join([head] + ["  " + str(c).replace("\n", "\n  ") for c in self.inputs])

    def raise_if_differs(self) -> Comparison:
        if self.agrees:
            return self
        raise GradkitError(str(self))


class _Point(NamedTuple):
    """Where a comparison is made: the arguments (split) and which float leaf varies."""

    split: Split
    dyn: list[ArrayLike]
    k: int

    def fn_of_leaf(self, fn: Callable[..., object]) -> Callable[[jax.Array], jax.Array]:
        return partial_fn(fn, self.split, self.dyn, self.k)

    @property
    def x(self) -> jax.Array:
        return jnp.asarray(self.dyn[self.k])


def _jacobian(fn: Callable[..., object], at: _Point, mode: str) -> np.ndarray:
    h = at.fn_of_leaf(fn)
    x = at.x
    if mode == "rev" and jax.eval_shape(h, x).shape == (1,):
        # jax.grad, as users call it: it keeps the dtype a custom rule returns (jacrev would cast it)
        return np.asarray(call_jit(jax.grad(lambda v: h(v)[0]), x))[None]
    return np.asarray(call_jit((jax.jacfwd if mode == "fwd" else jax.jacrev)(h), x))


def _ulp(ref: np.ndarray, dtype: np.dtype) -> np.ndarray:
    finfo_dtype = dtype if np.issubdtype(dtype, np.floating) and np.dtype(dtype).itemsize >= 4 else np.float32
    with np.errstate(over="ignore", invalid="ignore"):
        spacing = np.spacing(np.abs(ref).astype(finfo_dtype)).astype(np.float64)
    return np.maximum(spacing, float(np.finfo(finfo_dtype).smallest_subnormal))


def compare(fn: Callable[..., object], reference: Callable[..., object] | str, args: Sequence[object], *,
            mode: str = "rev", rtol: float | None = None, eps: float = 1e-6,
            max_side_by_side: int = 64) -> Comparison:
    """Compares ``fn``'s (custom) gradient with a reference, input by input, and explains the gap.

    For each floating-point input: the max absolute, relative and ULP error,
    the worst element with the input value and both derivatives there, the
    full Jacobians side by side when they have at most ``max_side_by_side``
    elements, and the likely cause: an approximation inside the rule (with the
    step a finite difference would need to give this error), a branch that is
    wrong on one side, a dtype or precision mismatch between forward and
    backward, an ignored term (zeros, or a constant factor).

    Args:
      fn: the function with the custom gradient (``gk.override``, ``jax.custom_vjp``…).
      reference: a plain implementation of the same function (its autodiff is the
        reference), or ``"fd"`` for float64 central finite differences of ``fn``.
      args: the point to compare at, a tuple of arguments.
      mode: ``"rev"`` (``jacrev``) or ``"fwd"`` (``jacfwd``).
      rtol: an element mismatches when its error exceeds ``rtol·max|reference|``
        (default: 64 ULPs of the gradient dtype; 1e-6 against ``"fd"`` in float64, 1e-4 in float32).
      eps: finite-difference step for ``reference="fd"``.
      max_side_by_side: largest Jacobian printed in full.

    Returns:
      A :class:`Comparison`; ``str()`` it, or read ``.inputs[i].causes``.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> fd_rule = gk.vjp_rule(lambda op, g: g * (jnp.sin(op.inputs[0] + 1e-3) - op.outputs[0]) / 1e-3)
      >>> f = gk.override(lambda x: jnp.sum(jnp.sin(x)), {"sin": fd_rule})
      >>> c = gk.compare(f, lambda x: jnp.sum(jnp.sin(x)), (jnp.linspace(0.0, 3.0, 8),))
      >>> c.agrees, "finite difference" in c.inputs[0].causes[0]
      (False, True)
    """
    if mode not in ("fwd", "rev"):
        raise GradkitError(f"compare: mode must be 'fwd' or 'rev', got {mode!r}.")
    if not isinstance(args, (tuple, list)):
        raise GradkitError(f"compare expects args as a tuple of arguments, got {type(args).__name__}: "
                           "write compare(fn, reference, (x,)).")
    use_fd = isinstance(reference, str)
    if use_fd and reference not in ("fd", "finite_differences"):
        raise GradkitError(f"compare: reference must be a function or 'fd', got {reference!r}.")
    split, dyn, names = float_inputs(fn, args)
    out_shape = output_shape(fn, args)
    results = []
    for k, label in enumerate(names):
        at = _Point(split, dyn, k)
        custom = _jacobian(fn, at, mode)
        if use_fd:
            with jax.enable_x64(True):
                at64 = _Point(split, [to_f64(v) for v in dyn], k)
                ref = differences(at64.fn_of_leaf(fn), at64.x, np.arange(at.x.size), eps).central
                ref = ref.reshape(custom.shape)
        else:
            assert callable(reference)
            ref = _jacobian(reference, at, mode)
        results.append(_compare_input(label, at, custom, ref, use_fd, rtol, max_side_by_side,
                                      None if isinstance(reference, str) else reference, out_shape))
    ref_label = "float64 finite differences" if use_fd else f"autodiff of {fn_name(reference)}"
    return Comparison(fn_name(fn), ref_label, mode, tuple(results))


def _compare_input(label: str, at: _Point, custom: np.ndarray, ref: np.ndarray, use_fd: bool,
                   rtol: float | None, max_side_by_side: int, reference: Callable[..., object] | None,
                   out_shape: tuple[int, ...]) -> InputComparison:
    x = at.x
    c_dtype, r_dtype = custom.dtype, ref.dtype
    c64, r64 = custom.astype(np.float64), np.asarray(ref, dtype=np.float64)
    x_np = np.asarray(x, dtype=np.float64)
    n_in = x.size
    with np.errstate(invalid="ignore", over="ignore"):
        same = (c64 == r64) | (np.isnan(c64) & np.isnan(r64))
        err = np.where(same, 0.0, np.abs(c64 - r64))
        err = np.where(np.isnan(err), np.inf, err)
        ulps = err / _ulp(r64, c_dtype)
    rel = relative_error(c64, r64, 0.0)
    scale = float(np.max(np.abs(r64[np.isfinite(r64)]), initial=0.0)) or 1.0
    if rtol is None:
        if use_fd:
            rtol = 1e-6 if c_dtype == np.float64 else 1e-4
        else:
            rtol = 64 * float(np.finfo(c_dtype if np.issubdtype(c_dtype, np.floating) else np.float32).eps)
    tol = rtol * scale
    bad = err > tol
    flat_err = err.reshape(-1)
    worst = int(np.argmax(flat_err)) if flat_err.size else 0
    out_i, in_j = divmod(worst, n_in)
    worst_label = derivative_label(1, out_shape, out_i, tuple(x.shape), [in_j], label)
    c_flat, r_flat = c64.reshape(-1), r64.reshape(-1)
    x_flat = x_np.reshape(-1)
    causes = _diagnose(label, x_flat, c64.reshape(-1, n_in), r64.reshape(-1, n_in), bad.reshape(-1, n_in),
                       rel.reshape(-1, n_in), c_dtype, r_dtype, np.dtype(x.dtype), reference, at)
    side: tuple[tuple[str, float, float, float], ...] = ()
    if c64.size <= max_side_by_side:
        side = tuple((derivative_label(1, out_shape, k // n_in, tuple(x.shape), [k % n_in], label).split(" / ")[-1]
                      if not out_shape else derivative_label(1, out_shape, k // n_in, tuple(x.shape),
                                                              [k % n_in], label),
                      float(x_flat[k % n_in]), float(c_flat[k]), float(r_flat[k])) for k in range(c64.size))
    return InputComparison(
        input=label, dtype=str(x.dtype), custom_dtype=str(c_dtype), reference_dtype=str(r_dtype),
        max_abs_err=float(np.max(err, initial=0.0)), max_rel_err=float(np.max(rel, initial=0.0)),
        max_ulp_err=float(np.max(ulps, initial=0.0)), worst=worst_label, worst_input=float(x_flat[in_j]),
        worst_custom=float(c_flat[worst]), worst_reference=float(r_flat[worst]), mismatched=int(np.sum(bad)),
        size=int(c64.size), tolerance=tol, causes=tuple(causes), jacobians=side)


def _diagnose(label: str, x: np.ndarray, c: np.ndarray, r: np.ndarray, bad: np.ndarray, rel: np.ndarray,
              c_dtype: np.dtype, r_dtype: np.dtype, x_dtype: np.dtype, reference: Callable[..., object] | None,
              at: _Point) -> list[str]:
    """Sentences naming the likely cause of the difference, with numbers."""
    causes: list[str] = []
    n_bad, n = int(bad.sum()), bad.size
    if c_dtype != x_dtype:
        causes.append(
            f"dtype mismatch: the custom gradient is {c_dtype} but {label} is {x_dtype} (the reference gradient is "
            f"{r_dtype}); the backward pass computes in a different precision than the forward pass and "
            f"JAX passed the {c_dtype} cotangent through unchanged. Cast the rule's result to {x_dtype}.")
    if n_bad == 0:
        if not causes:
            ulp_max = float(np.max(rel)) / float(np.finfo(c_dtype).eps) if np.issubdtype(c_dtype, np.floating) else 0
            causes.append(f"no discrepancy beyond rounding (max rel err {fmt(np.max(rel, initial=0))}, "
                          f"≈{fmt(ulp_max)} machine epsilons of {c_dtype}).")
        return causes
    finite_c, finite_r = np.isfinite(c), np.isfinite(r)
    if np.any(~finite_c & finite_r):
        k = int(np.sum(~finite_c & finite_r))
        causes.append(f"the custom gradient is non-finite on {k} of {n} elements where the reference is finite "
                      f"(run gk.audit on the function to see where it is born).")
    # Precision: a float64 forward whose backward ran in float32.
    if c_dtype == np.float64 and x_dtype == np.float64:
        fits32 = _representable(c, np.float32)
        if fits32 >= 0.999 * n and _representable(r, np.float32) < 0.5 * n:
            eps32 = float(np.finfo(np.float32).eps)
            causes.append(
                f"precision mismatch: all {n} custom values are exactly representable in float32 while the "
                f"float64 reference values are not, and the relative errors (max {fmt(np.max(rel))}, median "
                f"{fmt(np.median(rel))}) are at float32 rounding level (eps {fmt(eps32)}): the rule computes "
                f"in float32 for a float64 forward. Compute it in {x_dtype}.")
            return causes
    zero_c = (c == 0) & (r != 0) & bad
    if zero_c.sum() > 0 and zero_c.sum() >= 0.5 * n_bad:
        causes.append(
            f"ignored term: the custom gradient is exactly 0 on {int(zero_c.sum())} of {n} elements where the "
            f"reference is not (max |reference| there {fmt(np.max(np.abs(r[zero_c])))}): the rule drops an "
            f"input or a term (a None cotangent, a stop_gradient).")
        return causes
    off = np.eye(*c.shape) == 0  # off the diagonal
    elementwise = c.shape[0] == 1 or (c.shape[0] == c.shape[1] and np.all(c[off] == 0) and np.all(r[off] == 0))
    nonzero = (r != 0) | (c != 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = c[nonzero] / r[nonzero]
    if (ratio.size and not np.any(bad & ~nonzero) and np.all(np.isfinite(ratio)) and int(nonzero.sum()) == n_bad
            and np.ptp(ratio) <= 1e-3 * max(1.0, abs(float(np.mean(ratio))))):
        causes.append(f"constant factor: the custom gradient is {fmt(np.mean(ratio))} × the reference on every "
                      f"nonzero element ({n_bad} of {n}): a missing or extra scale in the rule.")
        return causes
    med = float(np.median(rel[bad]))
    fit = _fit_approximation(reference, at, c, r) if elementwise and med < 0.05 else ""
    where_ = f"{n_bad} of {n} elements" if n_bad < n else f"all {n} elements"
    approx = (f"approximation: small, smooth errors on {where_} (median rel err {fmt(med)}, max "
              f"{fmt(np.max(rel))}), the signature of an approximate rule such as a finite difference")
    if fit:
        causes.append(f"{approx}; {fit}.")
        return causes
    if elementwise:
        bad_in = bad.any(axis=0)
        branch = _branch_cause(label, x, bad_in, c, r, rel) if 0 < int(bad_in.sum()) < bad_in.size else ""
        if branch:
            causes.append(branch)
            return causes
    if med < 0.05:
        causes.append(approx + ".")
        return causes
    diff = (c - r)[bad]
    causes.append(
        f"wrong formula: large errors on {n_bad} of {n} elements (median rel err {fmt(med)}; reference − custom "
        f"ranges over [{fmt(np.min(-diff))}, {fmt(np.max(-diff))}]): the rule misses a term (product or chain "
        f"rule) or differentiates a different function.")
    return causes


def _representable(v: np.ndarray, dtype: DTypeLike) -> int:
    with np.errstate(over="ignore", invalid="ignore"):
        return int(np.sum(v.astype(dtype).astype(np.float64) == v))


def _branch_cause(label: str, x: np.ndarray, bad_in: np.ndarray, c: np.ndarray, r: np.ndarray,
                  rel: np.ndarray) -> str:
    """A sentence when the wrong elements are cleanly one side of a threshold; "" otherwise."""
    xb, xg = x[bad_in], x[~bad_in]
    k, n = int(bad_in.sum()), bad_in.size
    if np.all(xb == 0) and np.all(xg != 0):
        side = f"only at {label} == 0"
    elif np.all(xb < 0) and np.all(xg >= 0):
        side = f"exactly where {label} < 0"
    elif np.all(xb > 0) and np.all(xg <= 0):
        side = f"exactly where {label} > 0"
    elif np.all(xb <= 0) and np.all(xg > 0):
        side = f"exactly where {label} <= 0"
    elif np.all(xb >= 0) and np.all(xg < 0):
        side = f"exactly where {label} >= 0"
    else:
        lo, hi = float(np.min(xb)), float(np.max(xb))
        good_err = float(np.max(rel[:, ~bad_in], initial=0.0))
        if np.any((xg >= lo) & (xg <= hi)) or float(np.min(rel[:, bad_in].max(axis=0))) < 1e3 * good_err:
            return ""  # no clean split between right and wrong elements
        side = f"for {label} in [{fmt(lo)}, {fmt(hi)}] (right outside it)"
    cols = np.flatnonzero(bad_in)
    j = int(cols[np.argmax(rel[:, cols].max(axis=0))])
    row = int(np.argmax(rel[:, j]))
    return (f"branch: the gradient is wrong {side} ({k} of {n} elements; right on the other {n - k}); e.g. at "
            f"{label}={fmt(x[j])} custom {fmt(c[row, j])} vs reference {fmt(r[row, j])}. A branch of the rule "
            f"(a where/cond/sign) is wrong on one side.")


def _fit_approximation(reference: Callable[..., object] | None, at: _Point, c: np.ndarray, r: np.ndarray) -> str:
    """Fits err ≈ (h/2)·f'' (forward difference) or (h²/6)·f''' (central); returns the best, if good."""
    if reference is None or c.shape[0] != 1 and c.shape[0] != c.shape[1]:
        return ""
    x = at.x
    h = at.fn_of_leaf(reference)
    try:
        if c.shape[0] == 1:  # scalar output: derivatives of the gradient, element by element
            g = lambda v: jax.grad(lambda u: h(u)[0])(v)
        else:  # element-wise function: the Jacobian's diagonal
            g = lambda v: jax.jvp(h, (v,), (jnp.ones_like(v),))[1].reshape(v.shape)
        d2 = np.asarray(jax.jvp(g, (x,), (jnp.ones_like(x),))[1], dtype=np.float64).reshape(-1)
        d3 = np.asarray(jax.jvp(lambda v: jax.jvp(g, (v,), (jnp.ones_like(v),))[1], (x,),
                                (jnp.ones_like(x),))[1], dtype=np.float64).reshape(-1)
    except Exception:
        return ""
    err = (c - r).reshape(-1) if c.shape[0] == 1 else np.diag(c - r)
    best = ""
    best_r2 = 0.9
    for name, basis, to_h in (("a forward difference", d2, lambda a: abs(2 * a)),
                              ("a central difference", d3, lambda a: math.sqrt(abs(6 * a)))):
        denom = float(np.dot(basis, basis))
        if denom == 0 or not np.all(np.isfinite(basis)):
            continue
        a = float(np.dot(basis, err)) / denom
        resid = err - a * basis
        total = float(np.dot(err - err.mean(), err - err.mean())) or float(np.dot(err, err))
        r2 = 1 - float(np.dot(resid, resid)) / total if total else 0.0
        if r2 > best_r2:
            best_r2 = r2
            formula = "h/2·f''(x)" if "forward" in name else "h²/6·f'''(x)"
            best = (f"the error fits {name} with step h ≈ {fmt(to_h(a))} (custom − reference ≈ {formula}, "
                    f"R² = {r2:.3f})")
    return best
