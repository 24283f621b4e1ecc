"""Is a fixed gradient right? Float64 finite differences of the original function, in bounded memory; and the value.

A :class:`Reference` holds the audited function's central differences in
float64 at the audited point, computed once and compared with each fix's
gradient (:meth:`Reference.compare`; :func:`fd_check` for one gradient). Each
perturbed point is ``x + s u`` for one differentiated input ``x``, the others
held, with ``u`` one coordinate — every coordinate of an input of at most
``_COORDS`` elements, ``_COORDS`` of one up to ``_MANY``, ``_LARGE_COORDS``
of a larger one, its non-finite gradient elements first — or, for the rest
of the inputs too large to take whole, a random direction (``±max(1, |x_i|)``
per element), whose directional derivative ``g · u`` is compared with the
differences of ``t -> f(x + t u)``: a sound check of every element at once.

The inputs are evaluated in groups (:func:`_groups`): the small ones together
— a point then copies all of them, the large inputs passed in unbatched —
and each large one alone, so that a model's 100 bias and kernel leaves cost
one compilation, not 100, and a bias's points never copy a large kernel. The
points are evaluated in batches whose perturbed copies (and their
perturbations) take at most :data:`gradkit._src.checks.fd.BUDGET` bytes
(:func:`gradkit._src.checks.fd.evaluate`): checking a 1M-parameter model holds a few
copies of its parameters, never hundreds.

A difference is used only where it is one: the function finite at every
point, the one-sided differences equal (no kink, no jump) and the central
differences at ``s`` and ``s/2`` equal (no pole between them). An element
whose difference is unusable at the usual step ``1e-6 max(1, |x|)`` and whose
value is much smaller than that step is tried again at ``1e-3 |x|`` (``x =
1e-8`` next to a singularity at 0). Where the differences stay undefined at
elements of the finding (a kink: a norm at 0), :meth:`Reference.nearby`
and ``gradkit._src.audit.kink`` decide from the float64 gradients at
nearby points instead (``FDResult.kink``).

:func:`value_check` says whether the forward value is unchanged by a fix.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.audit import kink as kink_ref
from gradkit._src.audit.program import Program
from gradkit._src.checks import fd
from gradkit._src.checks.describe import fmt, one_line, to_f64
from gradkit._src.checks.fd import batch_size, call_jit, evaluate, nbytes, select_coords

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
      kink: where finite differences were undefined at elements of the finding, the verdict of the
        generalized-gradient reference there (``gradkit._src.audit.kink``; those elements then are not
        counted in ``excluded``); ``None``: not used, or undecided (a pole).
    """

    matches: bool | None
    max_rel_err: float | None
    compared: int = 0
    directions: int = 0
    excluded: int = 0
    note: str = ""
    kink: kink_ref.Verdict | None = None


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


_GROUP = 1 << 19  # bytes: inputs evaluated together up to this size (one compilation), a larger one alone


def _groups(dyn: Sequence[jax.Array]) -> list[list[int]]:
    """The inputs, smallest first, in groups of at most :data:`_GROUP` bytes (a larger input alone).

    The inputs of a group are perturbed in one compiled function, each point carrying a copy of all of
    them: a model's many small leaves (biases, small kernels) cost one compilation, and a point of a
    bias does not copy a large kernel, nor recompute what depends only on it.
    """
    order = sorted(range(len(dyn)), key=lambda p: (nbytes(dyn[p]), p))
    out: list[list[int]] = []
    size = 0
    for p in order:
        b = nbytes(dyn[p])
        if out and size + b <= _GROUP:
            out[-1].append(p)
            size += b
        else:
            out.append([p])
            size = b
    return [sorted(g) for g in out]


class _Deltas:
    """The perturbations of all inputs, built a batch of points at a time: ``[rows]`` gives one array per
    input, ``(len(rows), *its shape)``.

    Point ``k`` adds ``steps[k]`` to flat element ``index[k]`` of input ``pos[k]`` or, where ``direction[k]``
    is not ``None``, ``steps[k]`` times that flat direction of input ``pos[k]``; ``pos[k] = -1``: none.
    Built on the host: the compiled function then only adds (:func:`_add`), where finding the element
    inside it (a scatter, or an iota compared with an index, per input) made compiling a 100-input
    model several times slower.
    """

    def __init__(self, dyn: Sequence[jax.Array], pos: np.ndarray, index: np.ndarray, steps: np.ndarray,
                 directions: Sequence[np.ndarray | None] = ()) -> None:
        self.shapes = [(tuple(x.shape), np.dtype(x.dtype)) for x in dyn]
        self.pos, self.index, self.steps = pos, index, steps
        self.directions = list(directions)

    def __getitem__(self, rows: ArrayLike) -> tuple[np.ndarray, ...]:
        one = np.ndim(rows) == 0
        rows = np.atleast_1d(np.asarray(rows))
        out = [np.zeros((len(rows), int(np.prod(shape, dtype=np.int64))), dtype) for shape, dtype in self.shapes]
        for b, k in enumerate(rows):
            p = int(self.pos[k])
            if p < 0:
                continue
            v = self.directions[p] if p < len(self.directions) else None
            if v is None:
                out[p][b, int(self.index[k])] = self.steps[k]
            else:
                out[p][b] = self.steps[k] * v[int(self.index[k])]
        res = tuple(o.reshape((len(rows),) + shape) for o, (shape, _) in zip(out, self.shapes))
        return tuple(r[0] for r in res) if one else res


def _add(xs: tuple[jax.Array, ...], deltas: tuple[jax.Array, ...], s: jax.Array) -> tuple[jax.Array, ...]:
    """``xs`` plus ``deltas``, the elements not perturbed exactly as they are (no ``-0.0 + 0.0``)."""
    del s  # in the deltas
    return tuple(jnp.where(d != 0, x + d, x) for x, d in zip(xs, deltas))


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
        self._nearby: kink_ref.Nearby | None = None
        self._near_done = False

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
        """The differences along each input, computed at the first call (:meth:`_group`: one compilation per
        group of inputs, one group for all inputs of a small model)."""
        if self._diffs is None:
            with jax.enable_x64(True):
                prog64 = self.prog.cast(to_f64)
                dyn64 = [jnp.asarray(v) for v in prog64.dyn]
                found: dict[int, _Diffs] = {}
                for group in _groups(dyn64):
                    found.update(self._group(prog64, dyn64, group))
                self._diffs = [found[pos] for pos in range(len(dyn64))]
        return self._diffs

    def _group(self, prog64: Program, dyn64: list[jax.Array], group: list[int]) -> dict[int, _Diffs]:
        """The differences along each input of ``group``, the others held, from all its points evaluated
        together: a perturbed copy of every input of the group per point, the rest passed in unbatched.

        A point adds a step to one element (or a direction) of one input of the group
        (:class:`_Deltas`); the coordinates of all its inputs are one batched evaluation, the random
        directions of its large inputs a second with the same compiled function. One compilation per
        input cost a model of 100 parameter leaves 100 of them.
        """
        def total(mine: tuple[jax.Array, ...], *held: jax.Array) -> jax.Array:  # the others passed in
            d = list(held)
            for p, v in zip(group, mine):
                d.insert(p, v)
            return jnp.asarray(sum(jnp.sum(jnp.real(o).astype(jnp.float64)) for o in prog64.call(d)))

        mine = tuple(dyn64[p] for p in group)
        held = [v for p, v in enumerate(dyn64) if p not in group]
        xs = [np.asarray(x).reshape(-1) for x in mine]
        keeps = [[int(i) for i in (self.must[p] if p < len(self.must) else ())] for p in group]
        cs, alls, smalls = [], [], []
        for xf, keep in zip(xs, keeps):
            n = xf.size
            c = select_coords(n, _COORDS if n <= _MANY else _LARGE_COORDS, keep).astype(np.int64)
            ax = np.abs(xf[c])
            steps = _STEP * np.maximum(1.0, ax)
            small = np.flatnonzero((ax > 0) & (1e-3 * ax < steps))  # also tried at 1e-3 |x|: next to a singularity
            cs.append(c)
            smalls.append(small)
            alls.append(np.concatenate([steps, 1e-3 * ax[small]]))
        # the points: per input, 4 per step (_SIDES) of every coordinate; then one at x itself (input -1)
        leaf = np.concatenate([np.full(4 * len(st), i) for i, st in enumerate(alls)] + [np.array([-1])])
        index = np.concatenate([np.repeat(np.concatenate([c, c[small]]), 4) for c, small in zip(cs, smalls)]
                               + [np.array([0])]).astype(np.int64)
        scales = np.append(np.concatenate([(st[:, None] * _SIDES).reshape(-1) for st in alls]), 0.0)
        batch = batch_size((mine, mine), len(scales))  # a perturbed copy of the group, and its perturbation
        runs: fd.Compiled = {}  # one compilation for the coordinates and the directions
        vals = evaluate(total, mine, _add, _Deltas(mine, leaf, index, scales), np.arange(len(scales)), scales,
                        held, batch=batch, cache=runs)[:, 0]
        f0 = float(vals[-1])
        out: list[_Diffs] = []
        start = 0
        for i, (c, small, all_s) in enumerate(zip(cs, smalls, alls)):
            these = vals[start:start + 4 * len(all_s)].reshape(-1, 4)
            start += 4 * len(all_s)
            central, usable = _central(these, all_s, f0)
            central, usable, again, again_ok = central[:len(c)], usable[:len(c)], central[len(c):], usable[len(c):]
            better = ~usable[small] & again_ok  # unusable at the usual step, a derivative at the small one
            central[small[better]], usable[small[better]] = again[better], True
            out.append(_Diffs(c, central, usable, np.zeros((0, xs[i].size)), np.zeros(0), np.zeros(0, bool)))
        large = [i for i, xf in enumerate(xs) if len(cs[i]) < xf.size]
        if large:  # the rest of a large input: random directions, skipping the known singular elements
            vs: dict[int, np.ndarray] = {}
            for i in large:
                n, d = xs[i].size, out[i]
                skip = np.zeros(n, bool)
                skip[d.coords[~d.usable]] = True
                skip[np.asarray(keeps[i], dtype=np.int64)] = True
                rng = np.random.RandomState(group[i])
                vs[i] = np.where(skip, 0.0, rng.choice([-1.0, 1.0], (_DIRECTIONS, n)) * np.maximum(1.0, np.abs(xs[i])))
            leaf = np.repeat(np.array(large, dtype=np.int64), 4 * _DIRECTIONS)
            index = np.tile(np.repeat(np.arange(_DIRECTIONS), 4), len(large))
            scales = np.tile(_STEP * _SIDES, len(large) * _DIRECTIONS)
            deltas = _Deltas(mine, leaf, index, scales, [vs.get(i) for i in range(len(xs))])
            dvals = evaluate(total, mine, _add, deltas, np.arange(len(scales)), scales, held, batch=batch,
                             cache=runs)[:, 0].reshape(len(large), -1)
            for k, i in enumerate(large):
                dc, du = _central(dvals[k].reshape(-1, 4), np.full(_DIRECTIONS, _STEP), f0)
                out[i] = dataclasses.replace(out[i], dirs=vs[i], dir_central=dc, dir_usable=du)
        return dict(zip(group, out))

    def compare(self, grads: Sequence[np.ndarray]) -> FDResult:
        """``grads`` (one per input) against the differences, where they are defined.

        An element ``g`` of reference ``r`` matches where ``|g - r| <= rtol (|r| + floor)``, ``rtol`` from
        ``g``'s dtype (:data:`GRAD_RTOL`) and ``floor`` a tenth of the scale of the whole reference
        gradient (its largest element over all inputs, as ``allclose``'s ``atol`` next to its ``rtol``):
        an input whose gradient is exactly 0 (a bias in a translation-invariant loss) then takes
        float32 rounding for what it is, not for an error. A direction ``v`` likewise, with ``|v|·|g| +
        |g·v|`` for ``|r|`` and ``floor |v|_1``. The relative error reported is ``|g - r| / max(|r|,
        floor)``.
        """
        try:
            diffs = self.differences()
        except Exception as e:  # the function does not run in float64: no comparison, and the report says why
            return FDResult(None, None, note=f"finite differences in float64 failed: {type(e).__name__}: "
                                             f"{one_line(str(e))}")
        floor = 0.1 * _scale(diffs)
        ok, worst = True, 0.0
        compared = directions = excluded = 0
        for d, g in zip(diffs, grads):
            gf = np.real(np.asarray(g)).astype(np.float64).reshape(-1)
            rtol = GRAD_RTOL.get(np.dtype(np.asarray(g).dtype), 2e-3)
            if d.usable.any():
                cd, gu = d.central[d.usable], gf[d.coords[d.usable]]
                with np.errstate(invalid="ignore", over="ignore"):
                    err = np.abs(gu - cd)
                    ok &= bool(np.all(err <= rtol * (np.abs(cd) + floor)))
                    worst = max(worst, _worst(err / np.maximum(np.abs(cd), max(floor, _TINY))))
            for k in np.flatnonzero(d.dir_usable):
                fdv = float(d.dir_central[k])
                with np.errstate(invalid="ignore", over="ignore"):
                    mag = float(np.abs(d.dirs[k]) @ np.abs(gf)) + abs(fdv)
                    err1 = abs(float(d.dirs[k] @ gf) - fdv)
                    room = floor * float(np.abs(d.dirs[k]).sum())
                ok &= bool(err1 <= rtol * (mag + room))
                worst = max(worst, _worst(np.array([err1 / max(mag, room, _TINY)])))
            compared += int(d.usable.sum())
            directions += int(d.dir_usable.sum())
            excluded += int((~d.usable).sum()) + int((~d.dir_usable).sum())
        verdict = None
        if ok and excluded:  # elements where differences are undefined: a kink's generalized gradient
            near = self.nearby()
            if near is not None:
                rtol = max(GRAD_RTOL.get(np.dtype(np.asarray(g).dtype), 2e-3) for g in grads)
                verdict = near.judge(grads, rtol, floor)
                ok, excluded = verdict.ok, excluded - verdict.elements
                worst = max(worst, verdict.error) if verdict.kind == "gradient" else worst
        if compared == 0 and directions == 0 and verdict is None:
            return FDResult(None, None, 0, 0, excluded, "no element where finite differences are defined")
        return FDResult(ok, worst, compared, directions, excluded, kink=verdict)

    def nearby(self) -> kink_ref.Nearby | None:
        """The float64 gradients near the point on the elements where the differences are undefined (the
        non-finite gradient elements first, at most :data:`kink_ref.ELEMENTS`), computed once; ``None``
        where there is no generalized gradient (:func:`kink_ref.nearby`)."""
        if not self._near_done:
            self._near_done = True
            diffs = self.differences()
            first: list[tuple[int, int]] = []
            rest: list[tuple[int, int]] = []
            for p, d in enumerate(diffs):
                must = set(self.must[p]) if p < len(self.must) else set()
                for i in d.coords[~d.usable]:
                    (first if int(i) in must else rest).append((p, int(i)))
            try:
                with jax.enable_x64(True):
                    p64 = self.prog.cast(to_f64)
                    self._nearby = kink_ref.nearby(p64, [jnp.asarray(v) for v in p64.dyn], (first + rest))
            except Exception:  # the gradient does not run in float64: the elements stay left out
                self._nearby = None
        return self._nearby


_TINY = float(np.finfo(np.float64).tiny)


def _scale(diffs: Sequence[_Diffs]) -> float:
    """The scale of the reference gradient over all inputs: its largest element compared, and for a
    direction ``v`` the least largest element its derivative allows, ``|r · v| / |v|_1``."""
    scale = 0.0
    for d in diffs:
        scale = max(scale, float(np.max(np.abs(d.central[d.usable]), initial=0.0)))
        for k in np.flatnonzero(d.dir_usable):
            l1 = float(np.abs(d.dirs[k]).sum())
            if l1 > 0:
                scale = max(scale, abs(float(d.dir_central[k])) / l1)
    return scale


def _worst(rel: np.ndarray) -> float:
    """The largest relative error, NaN (a non-finite gradient element) as inf."""
    return float(np.max(np.where(np.isnan(rel), np.inf, rel), initial=0.0))


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


def _real64(x: ArrayLike) -> np.ndarray:
    a = np.asarray(x)
    return np.abs(a).astype(np.float64) if a.dtype.kind == "c" else a.astype(np.float64)
