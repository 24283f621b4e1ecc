"""What ``check_grads`` returns: its rows, its report and the text of both; the default tolerances it states.

A row is one (input, order, mode) with its worst element; the report holds
the rows and the random-direction verdicts, prints one line per order and
mode when everything passed and every row otherwise, and raises with the
failing rows on request.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gradkit._src.checks.describe import fmt
from gradkit._src.errors import GradkitError

__all__ = ["GradCheckReport", "GradCheckRow", "default_tolerance", "least_precise"]

_F64_TOL = 1e-5  # jax.test_util's default gradient tolerance for float64


# --------------------------------------------------------------------------- tolerances


def default_tolerance(dtype: DTypeLike) -> float:
    """The default ``atol`` and ``rtol`` for a derivative computed in ``dtype``: ``max(1e-5, sqrt(eps))``.

    float64 keeps JAX's 1e-5; float32 gets 3.45e-4, float16 0.031, bfloat16 0.088:
    half the dtype's digits, well above the rounding of a chain of operations and
    well below the error of a wrong rule.
    """
    return max(_F64_TOL, math.sqrt(float(jnp.finfo(dtype).eps)))


def _tolerance_rule(dtype: str) -> str:
    return "JAX's float64 gradient tolerance" if default_tolerance(dtype) == _F64_TOL else f"sqrt(eps({dtype}))"


def least_precise(dtypes: Sequence[DTypeLike]) -> np.dtype:
    """The floating-point dtype with the largest epsilon among ``dtypes`` (float64 if there is none)."""
    inexact = [np.dtype(d) for d in dtypes if jnp.issubdtype(d, jnp.inexact)]
    return max(inexact, key=lambda d: float(jnp.finfo(d).eps)) if inexact else np.dtype(np.float64)


# --------------------------------------------------------------------------- rows and the report


@dataclasses.dataclass(frozen=True)
class GradCheckRow:
    """One (input, order, mode) of a :func:`check_grads` report.

    Attributes:
      input: the input's name (parameter name and pytree path).
      order: derivative order (1 = gradient/Jacobian, 2 = Hessian, …).
      mode: ``"fwd"`` (``jacfwd`` nested ``order`` times) or ``"rev"`` (``jacrev``).
      passed: every checked element within ``atol + rtol·|finite difference|`` (plus the
        finite difference's own float64 rounding), and no non-finite derivative where
        the finite difference is finite.
      max_abs_err: largest ``|autodiff − finite difference|``.
      max_rel_err: largest relative error, ``|autodiff − fd| / max(|fd|, atol)`` (the
        ``atol`` floor keeps it meaningful where the finite difference is 0).
      worst: the worst element (largest excess over the tolerance; the first non-finite
        one if any), as ``d^k out[i] / d x[j]…``.
      autodiff: the autodiff value at the worst element.
      numeric: the finite-difference value at the worst element.
      checked: how many input coordinates were probed; ``total`` how many there are.
      error: the exception message when the derivative could not be computed.
      max_rel_at: the element with the largest relative error.
      dtype: the dtype the derivative was checked at (the least precise of the input's,
        the output's and the derivative's); ``atol``, ``rtol`` the tolerances used.
      nonfinite: elements whose autodiff is NaN or inf where the finite difference is finite.
      unresolved: elements where the function's value swamps the float64 finite
        difference (``64·eps64·|f| / step`` above the tolerance), so they are only
        checked to ``±noise``, the largest such rounding error.
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
    dtype: str = ""
    atol: float = float("nan")
    rtol: float = float("nan")
    nonfinite: int = 0
    elements: int = 0
    unresolved: int = 0
    noise: float = 0.0

    def __str__(self) -> str:
        dtype = f" ({self.dtype})" if self.dtype else ""
        head = f"{'ok  ' if self.passed else 'FAIL'} {self.input:<14} order {self.order} {self.mode}{dtype}"
        if self.error:
            return f"{head}: {self.error}"
        sampled = f" ({self.checked} of {self.total} coordinates)" if self.checked < self.total else ""
        if self.nonfinite:
            return (f"{head}: autodiff is not finite at {self.nonfinite} of {self.elements} elements where the "
                    f"float64 finite difference is finite; first {self.worst}: autodiff {fmt(self.autodiff)} vs "
                    f"finite difference {fmt(self.numeric)}{sampled}")
        rel_at = f" at {self.max_rel_at}" if self.max_rel_at else ""
        unresolved = (f"; {self.unresolved} of {self.elements} elements only checked to ±{fmt(self.noise)} (the "
                      f"function's value swamps the float64 finite difference there)" if self.unresolved else "")
        return (f"{head}: max abs err {fmt(self.max_abs_err)}, max rel err {fmt(self.max_rel_err)}{rel_at}; "
                f"worst {self.worst}: autodiff {fmt(self.autodiff)} vs finite difference "
                f"{fmt(self.numeric)}{sampled}{unresolved}")


@dataclasses.dataclass(frozen=True)
class GradCheckReport:
    """Result of :func:`check_grads`; ``str(report)`` is a readable table.

    Attributes:
      function: the checked function's name.
      rows: one :class:`GradCheckRow` per (input, order, mode).
      jax_check: ``(mode, passed, message)`` per mode, from the random-direction check
        (every input at once, orders 1 to ``order``): autodiff at the inputs' dtypes
        against float64 finite differences along the direction; with ``upcast=True``,
        :func:`jax.test_util.check_grads` in float64.
      atol, rtol: the tolerances of the least precise dtype checked (each row has its own);
        ``eps`` the finite-difference step (float64; ``max(eps, |x|·2^-30)`` per coordinate).
      upcast: the derivatives were evaluated in float64 too (``check_grads(..., upcast=True)``),
        not at the inputs' dtypes.
      tolerances: ``(dtype, atol, rtol)`` for every dtype the rows were checked at.
    """

    function: str
    rows: tuple[GradCheckRow, ...]
    jax_check: tuple[tuple[str, bool, str], ...]
    atol: float
    rtol: float
    eps: float
    upcast: bool = False
    tolerances: tuple[tuple[str, float, float], ...] = ()

    @property
    def passed(self) -> bool:
        return all(r.passed for r in self.rows) and all(ok for _, ok, _ in self.jax_check)

    @property
    def failures(self) -> tuple[GradCheckRow, ...]:
        return tuple(r for r in self.rows if not r.passed)

    def __bool__(self) -> bool:
        return self.passed

    def _direction_label(self, mode: str) -> str:
        if self.upcast:
            return f"jax.test_util.check_grads modes=({mode!r},)"
        return f"random direction through every input ({mode})"

    def __str__(self) -> str:
        verdict = "passed" if self.passed else "FAILED"
        tols = "; ".join(
            (f"{d}: atol=rtol={fmt(a)} ({_tolerance_rule(d)})" if a == r == default_tolerance(d)
             else f"{d}: atol={fmt(a)}, rtol={fmt(r)}") for d, a, r in self.tolerances)
        if self.upcast:
            how = "upcast=True: autodiff and finite differences both in float64, not at the inputs' dtypes"
        else:
            how = "autodiff at the inputs' dtypes under jax.jit vs float64 finite differences"
        lines = [f"check_grads({self.function}): {verdict} ({how}, eps={fmt(self.eps)}; "
                 f"tolerance {tols or f'atol={fmt(self.atol)}, rtol={fmt(self.rtol)}'})"]
        if self.passed:  # one line per (order, mode); every row, on failure
            lines += ["  " + _summary(rows) for rows in _by_order_mode(self.rows)]
        else:
            lines += ["  " + str(r) for r in self.rows]
        for mode, ok, msg in self.jax_check:
            lines.append(f"  {self._direction_label(mode)}: {'passed' if ok else 'FAILED: ' + msg}")
        return "\n".join(lines)

    def raise_if_failed(self) -> GradCheckReport:
        """Raises :class:`GradkitError` with the failing rows; returns the report otherwise."""
        if self.passed:
            return self
        bad = [str(r) for r in self.failures]
        bad += [f"{self._direction_label(m)}: {msg}" for m, ok, msg in self.jax_check if not ok]
        raise GradkitError(f"check_grads({self.function}) failed:\n  " + "\n  ".join(bad))


def _by_order_mode(rows: Sequence[GradCheckRow]) -> list[list[GradCheckRow]]:
    groups: dict[tuple[int, str], list[GradCheckRow]] = {}
    for r in rows:
        groups.setdefault((r.order, r.mode), []).append(r)
    return [groups[k] for k in sorted(groups, key=lambda k: (k[0], k[1]))]


def _summary(rows: Sequence[GradCheckRow]) -> str:
    """Passed rows of one order and mode in one line: how many inputs, and the largest error where."""
    worst = max(rows, key=lambda r: r.max_rel_err)
    at = worst.max_rel_at or worst.input
    sampled = sum(r.checked < r.total for r in rows)
    sampled_text = f", {sampled} sampled at {max(r.checked for r in rows)} coordinates" if sampled else ""
    unresolved = sum(r.unresolved for r in rows)
    unresolved_text = (f"; {unresolved} elements only checked to the float64 finite difference's rounding"
                       if unresolved else "")
    dtypes = sorted({r.dtype for r in rows if r.dtype})
    return (f"ok   order {rows[0].order} {rows[0].mode}: {len(rows)} input(s){sampled_text}"
            f"{' (' + ', '.join(dtypes) + ')' if dtypes else ''}; max rel err {fmt(worst.max_rel_err)} "
            f"({at}){unresolved_text}")
