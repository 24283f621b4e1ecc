"""Is a fixed gradient right? Float64 finite differences of the original function, in bounded memory; and the value.

A :class:`Reference` holds the audited function's central differences in
float64 at the audited point, computed once and compared with each fix's
gradient (:meth:`Reference.compare`; :func:`fd_check` for one gradient). Each
differentiated input ``x`` is perturbed in turn, the others held (a model's
small bias vector then costs little next to its weights); each perturbed
point is ``x + s u`` with ``u`` one coordinate — every coordinate
of an input of at most ``_COORDS`` elements, ``_COORDS`` of one up to
``_MANY``, ``_LARGE_COORDS`` of a larger one, its non-finite gradient
elements first — or, for the rest of the inputs too large to take whole, a
random direction (``±max(1, |x_i|)`` per element), whose directional
derivative ``g · u`` is compared with the differences of ``t -> f(x + t u)``:
a sound check of every element at once. The points are evaluated in batches
whose perturbed copies take at most :data:`gradkit._src.fd.BUDGET` bytes
(:func:`gradkit._src.fd.evaluate`): checking a 1M-parameter model holds a few
copies of its parameters, never hundreds.

A difference is used only where it is one: the function finite at every
point, the one-sided differences equal (no kink, no jump) and the central
differences at ``s`` and ``s/2`` equal (no pole between them). An element
whose difference is unusable at the usual step ``1e-6 max(1, |x|)`` and whose
value is much smaller than that step is tried again at ``1e-3 |x|`` (``x =
1e-8`` next to a singularity at 0).

:func:`value_check` says whether the forward value is unchanged by a fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src.audit_program import Program
from gradkit._src.describe import fmt, one_line, to_f64
from gradkit._src.fd import along_coordinate, along_direction, call_jit, evaluate, select_coords

_COORDS = 256  # coordinates compared one by one: all of an input this small
_MANY = 16384  # above this size, only _LARGE_COORDS coordinates (the non-finite elements first) …
_LARGE_COORDS = 32  # … and random directions cover the rest (any input above _COORDS has directions)
_DIRECTIONS = 4
_STEP = 1e-6

GRAD_RTOL = {np.dtype(np.float64): 1e-5, np.dtype(np.float32): 2e-3, np.dtype(np.float16): 1e-2,
             np.dtype(jnp.bfloat16): 1e-1}
VALUE_RTOL = {np.dtype(np.float64): 1e-12, np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2,
              np.dtype(jnp.bfloat16): 1e-2}


@dataclasses.dataclass(frozen=True)
class FDResult:
    """What :func:`fd_check` found.

    Attributes:
      matches: the gradient equals the differences wherever they are defined (``None``: nothing compared).
      max_rel_err: the largest relative error there.
      compared: elements compared one by one; ``directions``: random directions compared.
      excluded: elements and directions left out (the differences undefined: a kink, a jump, a pole, a
        non-finite value).
      note: why nothing was compared.
    """

    matches: bool | None
    max_rel_err: float | None
    compared: int = 0
    directions: int = 0
    excluded: int = 0
    note: str = ""


@dataclasses.dataclass(frozen=True)
class _Diffs:
    """Float64 differences of the function along one input (the others held).

    ``coords``: flat indices into the input; ``dirs``: random directions over
    the rest of an input too large to take coordinate by coordinate.
    """

    coords: np.ndarray
    central: np.ndarray
    usable: np.ndarray
    dirs: np.ndarray
    dir_central: np.ndarray
    dir_usable: np.ndarray


_SIDES = np.array([1.0, -1.0, 0.5, -0.5])  # the points per direction: x ± s u, x ± s u / 2


def _central(vals: np.ndarray, steps: np.ndarray, f0: float) -> tuple[np.ndarray, np.ndarray]:
    """From ``h`` at ``_SIDES`` per row: the central difference, and whether it is usable.

    Usable: every value finite, the one-sided differences equal (no kink, no jump) and the central
    differences at ``s`` and ``s/2`` equal (no pole).
    """
    p, mi, p2, m2 = vals.T
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        central = np.where(p == mi, 0.0, p - mi) / (2 * steps)
        half = np.where(p2 == m2, 0.0, p2 - m2) / steps
        right = (p - f0) / steps
        left = (f0 - mi) / steps
        finite = np.isfinite(vals).all(axis=1) & bool(np.isfinite(f0))
        scale = np.max(np.abs(np.where(finite, central, 0.0)), initial=0.0)
        tol = 1e-2 * (np.abs(central) + 1e-3 * scale) + 1e-12
        usable = finite & (np.abs(right - left) <= tol) & (np.abs(central - half) <= tol)
    return np.where(usable, central, np.nan), usable


def _exact(perturb: Callable[[jax.Array, Any, Any], jax.Array]) -> Callable[[jax.Array, Any, Any], jax.Array]:
    """``perturb``, and ``x`` itself for a zero step (no ``-0.0 + 0.0``)."""
    return lambda x, d, s: jnp.where(s == 0, x, perturb(x, d, s))


class Reference:
    """The audited function in float64 at the audited point: its values and finite differences, computed once.

    Every fix is compared with the same differences (they belong to the
    original function), so they are computed at the first comparison and
    kept. ``must[i]``: flat elements of input ``i`` compared one by one
    whatever its size (where the original gradient was non-finite).
    """

    def __init__(self, prog: Program, must: Sequence[Sequence[int]] = ()) -> None:
        self.prog = prog
        self.must = [list(m) for m in must]
        self._diffs: list[_Diffs] | None = None
        self._values: list[np.ndarray] | None = None
        self._valued = False

    def values(self) -> list[np.ndarray] | None:
        """The function's outputs in float64 (``None`` where it does not run in float64)."""
        if not self._valued:
            self._valued = True
            try:
                with jax.enable_x64(True):
                    p64 = self.prog.cast(to_f64)
                    self._values = [np.asarray(o, dtype=np.float64) for o in call_jit(p64.flat(), *p64.dyn)]
            except Exception:  # the value check then has the original values only
                self._values = None
        return self._values

    def differences(self) -> list[_Diffs]:
        """The differences along each input (computed at the first call: one batched evaluation per input,
        a second for the directions of a large one)."""
        if self._diffs is None:
            with jax.enable_x64(True):
                prog64 = self.prog.cast(to_f64)
                dyn64 = [jnp.asarray(v) for v in prog64.dyn]
                self._diffs = [self._along(prog64, dyn64, pos) for pos in range(len(dyn64))]
        return self._diffs

    def _along(self, prog64: Program, dyn64: list[jax.Array], pos: int) -> _Diffs:
        def total(v: jax.Array, *held: jax.Array) -> jax.Array:  # the other inputs passed in, not constants
            d = list(held)
            d.insert(pos, v)
            return jnp.asarray(sum(jnp.sum(jnp.real(o).astype(jnp.float64)) for o in prog64.call(d)))

        x = dyn64[pos]
        held = dyn64[:pos] + dyn64[pos + 1:]
        n = int(x.size)
        xf = np.asarray(x).reshape(-1)
        keep = [int(i) for i in (self.must[pos] if pos < len(self.must) else ())]
        c = select_coords(n, _COORDS if n <= _MANY else _LARGE_COORDS, keep).astype(np.int64)
        ax = np.abs(xf[c])
        steps = _STEP * np.maximum(1.0, ax)
        small = np.flatnonzero((ax > 0) & (1e-3 * ax < steps))  # also tried at 1e-3 |x|: next to a singularity
        all_s = np.concatenate([steps, 1e-3 * ax[small]])
        rows = np.append(np.repeat(np.arange(len(all_s)), 4), len(all_s))  # and one point at x itself
        vals = evaluate(total, x, _exact(along_coordinate), np.append(np.concatenate([c, c[small]]), 0), rows,
                        np.append((all_s[:, None] * _SIDES).reshape(-1), 0.0), held)[:, 0]
        f0 = float(vals[-1])
        central, usable = _central(vals[:-1].reshape(-1, 4), all_s, f0)
        central, usable, again, again_ok = central[:len(c)], usable[:len(c)], central[len(c):], usable[len(c):]
        better = ~usable[small] & again_ok  # unusable at the usual step, a derivative at the small one
        central[small[better]], usable[small[better]] = again[better], True
        vs, dc, du = np.zeros((0, n)), np.zeros(0), np.zeros(0, bool)
        if len(c) < n:  # the rest of a large input: random directions, skipping the known singular elements
            skip = np.zeros(n, bool)
            skip[c[~usable]] = True
            skip[np.asarray(keep, dtype=np.int64)] = True
            rng = np.random.RandomState(pos)
            vs = np.where(skip, 0.0, rng.choice([-1.0, 1.0], (_DIRECTIONS, n)) * np.maximum(1.0, np.abs(xf)))
            dvals = evaluate(total, x, along_direction, vs, np.repeat(np.arange(_DIRECTIONS), 4),
                             (np.full((_DIRECTIONS, 1), _STEP) * _SIDES).reshape(-1), held)[:, 0]
            dc, du = _central(dvals.reshape(-1, 4), np.full(_DIRECTIONS, _STEP), f0)
        return _Diffs(c, central, usable, vs, dc, du)

    def compare(self, grads: Sequence[np.ndarray]) -> FDResult:
        """``grads`` (one per input) against the differences, where they are defined."""
        try:
            diffs = self.differences()
        except Exception as e:  # the function does not run in float64: no comparison, and the report says why
            return FDResult(None, None, note=f"finite differences in float64 failed: {type(e).__name__}: "
                                             f"{one_line(str(e))}")
        ok, worst = True, 0.0
        compared = directions = excluded = 0
        for d, g in zip(diffs, grads):
            gf = np.real(np.asarray(g)).astype(np.float64).reshape(-1)
            rtol = GRAD_RTOL.get(np.dtype(np.asarray(g).dtype), 2e-3)
            if d.usable.any():
                cd, gu = d.central[d.usable], gf[d.coords[d.usable]]
                atol = 0.1 * rtol * float(np.max(np.abs(cd)))
                ok &= bool(np.all(np.abs(gu - cd) <= atol + rtol * np.abs(cd)))
                worst = max(worst, float(np.max(np.abs(gu - cd) / (np.abs(cd) + atol / rtol + 1e-300))))
            for k in np.flatnonzero(d.dir_usable):
                fdv = float(d.dir_central[k])
                mag = float(np.abs(d.dirs[k]) @ np.abs(gf)) + abs(fdv)
                err = abs(float(d.dirs[k] @ gf) - fdv)
                ok &= err <= rtol * mag
                worst = max(worst, err / (mag + 1e-300))
            compared += int(d.usable.sum())
            directions += int(d.dir_usable.sum())
            excluded += int((~d.usable).sum()) + int((~d.dir_usable).sum())
        if compared == 0 and directions == 0:
            return FDResult(None, None, 0, 0, excluded, "no element where finite differences are defined")
        return FDResult(ok, worst, compared, directions, excluded)


def fd_check(prog: Program, grads: Sequence[np.ndarray], must: Sequence[Sequence[int]] = ()) -> FDResult:
    """Compares ``grads`` (of ``prog``'s inputs) with float64 central differences of ``prog``'s function.

    ``must[i]``: flat elements of input ``i`` to compare one by one whatever its size (where the
    original gradient was non-finite). Memory: at most ``fd.BUDGET`` bytes of perturbed float64
    copies per batch, whatever the inputs' size. To compare several gradients with the same
    differences, keep a :class:`Reference`.
    """
    return Reference(prog, must).compare(grads)


def value_check(before: Sequence[np.ndarray], after: Sequence[np.ndarray],
                reference: Callable[[], Sequence[np.ndarray] | None] | None = None) -> tuple[bool, str]:
    """``(same function, what the fix did to the forward value)``.

    Unchanged: equal within a few ULP (``VALUE_RTOL``) wherever it was finite. A
    value that was non-finite and is finite now is reported, not held against
    the fix; a finite value that changed more is accepted only if it is no
    farther from the float64 value (the naive formula cancelled there):
    ``reference()`` gives the float64 values, asked for only then.
    """
    worst, changed, farther, now_finite, now_bad, kinds = 0.0, False, False, 0, 0, set()
    for k, (b, a) in enumerate(zip(before, after)):
        b64, a64 = _real64(b), _real64(a)
        if b64.shape != a64.shape:
            return False, f"forward value changed shape ({b64.shape} -> {a64.shape})"
        fb, fa = np.isfinite(b64), np.isfinite(a64)
        now_finite += int((~fb & fa).sum())
        kinds |= {fmt(v) for v in np.unique(b64[~fb & fa])}
        now_bad += int((fb & ~fa).sum())
        both = fb & fa
        if not both.any():
            continue
        rtol = VALUE_RTOL.get(np.dtype(np.asarray(b).dtype), 1e-5)
        with np.errstate(invalid="ignore", over="ignore"):
            rel = np.abs(a64 - b64)[both] / np.maximum(np.abs(b64[both]), np.finfo(np.float64).tiny)
        worst = max(worst, float(np.max(rel)))
        if float(np.max(rel)) <= rtol:
            continue
        changed = True
        refs = reference() if reference is not None else None
        ref = _real64(refs[k]) if refs is not None and k < len(refs) else None
        if ref is None or ref.shape != b64.shape:
            farther = True
            continue
        with np.errstate(invalid="ignore", over="ignore"):
            err_b, err_a = np.abs(b64 - ref)[both], np.abs(a64 - ref)[both]
        farther |= bool(np.any(err_a > err_b + rtol * np.abs(ref[both])))
    if now_bad:
        return False, f"forward value non-finite now at {now_bad} element(s) where it was finite"
    if farther:
        text = f"forward value changed (max rel diff {fmt(worst)}), farther from the float64 value"
    elif changed:
        text = f"forward value changed by up to {fmt(worst)} (relative), no farther from the float64 value"
    else:
        text = "forward value unchanged" + (" where it was finite" if now_finite else "")
    if now_finite:
        text += f"; finite now at {now_finite} element(s) where it was {' or '.join(sorted(kinds))}"
    return not farther, text


def _real64(x: Any) -> np.ndarray:
    a = np.asarray(x)
    return np.abs(a).astype(np.float64) if a.dtype.kind == "c" else a.astype(np.float64)
