"""``audit(..., sweep=True)``: inputs of every kind that break a gradient that is finite where audited.

Every input is probed by its kind, differentiated or held:

* floating-point and complex: 0, -1, ±1e30, ±100, ±1e-30, 1, ±1e4 (where its
  dtype holds them), everywhere and in its first element only;
* bool (a mask): all False, all True, the first row along the last axis all
  False / all True (a fully masked query row of an attention mask), the first
  row along the leading axis all False / all True (a fully masked key or
  example), and one True per row along the last axis;
* integer (indices, segment ids, lengths): every element 0, every element the
  observed maximum, every element -1 (signed dtypes: the last element, for an
  index), every element equal to the first (one index repeated: the other
  segments empty), and the first element at the dtype's max and min — a probe
  the function rejects (raises on) is recorded as rejected, not as a finding;
* not varied, and said so with the reason: PRNG keys, Python values (static
  to the trace: another value is another program), empty arrays, and inputs
  the probe budget did not reach.

At most :data:`BUDGET` (64) probes in all: each input's probes are in order
of use (masks' all-False rows before all-True, 0 before 1e30), and the inputs
take turns, one probe each per round, so every input is varied before any
gets its tenth probe. Each probe is one compiled gradient (held inputs are
passed in as arguments, so one compilation serves every probe of a shape; a
function that needs a held input's value at trace time is re-traced per
probe). The probes whose gradient is non-finite are reported, the first few
located (the op and line where the NaN is born).

The result is a :class:`Sweep`: the tuple of breaking :class:`Probe` s that
``AuditReport.sweep`` holds, with ``inputs``, one :class:`SweepInput` per
input saying what was probed (``summary()``: ``mask: 7 patterns (all False,
all True, …)``) or why it was not varied (``not_varied``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.program import Program
from gradkit._src.audit.report import Finding, Probe
from gradkit._src.checks.describe import fmt_index, one_line

__all__ = ["BUDGET", "Sweep", "SweepInput", "sweep"]

#: The most probes one sweep runs, over all inputs together.
BUDGET = 64

# most telling first: a budget cut keeps 0 and the overflows
_EDGE = [("0", 0.0), ("-1", -1.0), ("1e30", 1e30), ("-1e30", -1e30), ("100", 100.0), ("-100", -100.0),
         ("1e-30", 1e-30), ("-1e-30", -1e-30), ("1", 1.0), ("1e4", 1e4), ("-1e4", -1e4)]
_LOCATED = 8  # probes located with a replay; the rest are listed

Locate = Callable[[Program], tuple[Finding, ...]]


@dataclasses.dataclass(frozen=True)
class SweepInput:
    """What the sweep did with one input.

    Attributes:
      input: the input's name (``mask``, ``params['w']``).
      kind: ``"float"``, ``"complex"``, ``"bool"``, ``"int"``, ``"key"`` (a PRNG key) or ``"static"``
        (a Python value).
      probes: the short label of each probe run (``"0"``, ``"all False"``, ``"row [0,:] all False"``).
      broken: how many of them gave a non-finite gradient.
      rejected: probes the function raised on (``"x[0] = 2147483647: IndexError: …"``): not findings.
      skipped: probes planned but left out for the budget.
      not_varied: why the input was not varied at all (``""`` when it was).
    """

    input: str
    kind: str
    probes: tuple[str, ...] = ()
    broken: int = 0
    rejected: tuple[str, ...] = ()
    skipped: int = 0
    not_varied: str = ""

    @property
    def varied(self) -> bool:
        return bool(self.probes)

    def summary(self) -> str:
        """``x: 22 probes (0, -1, ±1e30, …; all elements and x[0])``, ``key: not varied: a PRNG key``."""
        if not self.varied:
            why = self.not_varied or "every probe was rejected by the function"
            return f"{self.input}: not varied: {why}"
        if self.kind in ("float", "complex"):
            values = list(dict.fromkeys(p.split(" ")[0] for p in self.probes))
            shown = _pm(values)
            where = "all elements" + (" and one" if any(p.endswith("(one element)") for p in self.probes) else "")
            text = f"{len(self.probes)} probes ({', '.join(shown)}; {where})"
        else:
            noun = "patterns" if self.kind == "bool" else "probes"
            text = f"{len(self.probes)} {noun} ({', '.join(self.probes)})"
        extra = []
        if self.broken:
            extra.append(f"{self.broken} break the gradient")
        if self.skipped:
            extra.append(f"{self.skipped} more left out for the budget of {BUDGET}")
        if self.rejected:
            extra.append(f"{len(self.rejected)} rejected by the function ({self.rejected[0]})")
        return f"{self.input}: {text}" + (f"; {'; '.join(extra)}" if extra else "")


def _pm(values: Sequence[str]) -> list[str]:
    """``["1e30", "-1e30", "0"]`` -> ``["±1e30", "0"]``."""
    out: list[str] = []
    for v in values:
        if v.startswith("-") and v[1:] in values:
            continue
        out.append(f"±{v}" if "-" + v in values else v)
    return out


class Sweep(tuple[Probe, ...]):
    """The probes that broke the gradient (a tuple of :class:`Probe`), and ``inputs``: what was probed per input.

    ``complete``: every input was varied. ``lines()``: one line per input
    (:meth:`SweepInput.summary`), for a report.
    """

    inputs: tuple[SweepInput, ...]
    budget: int

    def __new__(cls, probes: Iterable[Probe] = (), inputs: Sequence[SweepInput] = (),
                budget: int = BUDGET) -> Sweep:
        self = super().__new__(cls, probes)
        self.inputs = tuple(inputs)
        self.budget = budget
        return self

    @property
    def complete(self) -> bool:
        """Every input was varied (an "ok" may speak for all of them)."""
        return all(i.varied for i in self.inputs)

    @property
    def not_varied(self) -> tuple[SweepInput, ...]:
        return tuple(i for i in self.inputs if not i.varied)

    def lines(self) -> list[str]:
        return [i.summary() for i in self.inputs]


# --------------------------------------------------------------------------- the probes


@dataclasses.dataclass(frozen=True)
class _Plan:
    leaf: int  # position among all leaves
    label: str  # the probe as the report lists it: "mask[0,:] all False (a row along the last axis)"
    short: str  # its label in the input's summary: "row [0,:] all False"
    value: np.ndarray
    may_reject: bool = False


def _kind(x: object) -> tuple[str, str]:
    """``(kind, why not varied)`` of a leaf."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return "static", f"a Python {type(x).__name__} (static: another value traces another program)"
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return "key", "a PRNG key (its values are random bits, not an edge case)"
    if np.size(x) == 0:
        kind = "bool" if dtype == np.bool_ else "int" if jnp.issubdtype(dtype, jnp.integer) else "float"
        return kind, "empty (no element to vary)"
    if dtype == np.bool_:
        return "bool", ""
    if jnp.issubdtype(dtype, jnp.integer):
        return "int", ""
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return "complex", ""
    if jnp.issubdtype(dtype, jnp.floating):
        return "float", ""
    return "static", f"dtype {dtype} is not probed"


def _float_plans(i: int, name: str, x: np.ndarray) -> list[_Plan]:
    plans = []
    finfo = jnp.finfo(x.dtype)
    for label, v in _EDGE:
        if float(finfo.max) < abs(v):
            continue
        everywhere = " (all elements)" if x.size > 1 else ""
        plans.append(_Plan(i, f"{name} = {label}{everywhere}", f"{label} (all elements)", np.full(x.shape, v, x.dtype)))
        if x.size > 1:
            one = x.copy()
            one.reshape(-1)[0] = v
            plans.append(_Plan(i, f"{name}{fmt_index((0,) * x.ndim)} = {label} (one element)", f"{label} (one element)",
                               one))
    return plans


def _row(ndim: int, axis: int) -> str:
    """``[0,:]`` for the first row along ``axis`` (the other indices 0)."""
    return "[" + ",".join(":" if k == axis else "0" for k in range(ndim)) + "]"


def _bool_plans(i: int, name: str, x: np.ndarray) -> list[_Plan]:
    out: list[tuple[str, str, np.ndarray]] = [("all False", "", np.zeros_like(x)), ("all True", "", np.ones_like(x))]
    if x.ndim >= 1 and x.size > x.shape[-1]:  # more than one row along the last axis
        idx = (0,) * (x.ndim - 1)
        for v in (False, True):
            y = x.copy()
            y[idx] = v
            out.append((f"row {_row(x.ndim, x.ndim - 1)} all {v}", " (a row along the last axis; the rest as audited)",
                        y))
    if x.ndim >= 2:  # a row along the leading axis: a whole key / example
        idx2 = (slice(None),) + (0,) * (x.ndim - 1)
        for v in (False, True):
            y = x.copy()
            y[idx2] = v
            out.append((f"row {_row(x.ndim, 0)} all {v}", " (a row along the leading axis; the rest as audited)", y))
    if x.ndim >= 1 and x.shape[-1] > 1:
        y = np.zeros_like(x)
        y[..., 0] = True
        out.append(("one True per row" if x.ndim > 1 else "one True", " (the first along the last axis)", y))
    out.sort(key=lambda t: "True" in t[0] and not t[0].startswith("one"))  # the all-False patterns first
    plans: list[_Plan] = []
    for short, why, y in out:
        if any(np.array_equal(y, p.value) for p in plans):
            continue
        where = short.removeprefix("row ")
        label = f"{name}{where}" if short.startswith("row ") else f"{name} {short}"
        plans.append(_Plan(i, label + why, short, y))
    return plans


def _int_plans(i: int, name: str, x: np.ndarray) -> list[_Plan]:
    info = np.iinfo(x.dtype)
    hi, first = int(x.max()), int(x.reshape(-1)[0])
    signed = info.min < 0
    cands: list[tuple[str, str, np.ndarray, bool]] = [("all 0", " (every index 0: the other segments empty)",
                                                       np.zeros_like(x), False)]
    if hi != 0:
        cands.append((f"all {hi}", " (every element the observed maximum)", np.full_like(x, hi), False))
    if signed:
        cands.append(("all -1", " (the last element, as an index)", np.full_like(x, -1), False))
    if first not in (0, hi, -1):
        cands.append((f"all {first}", " (one index repeated: the other segments empty)", np.full_like(x, first), False))
    idx = fmt_index((0,) * x.ndim)
    for lim, what in ((int(info.max), "max"), (int(info.min), "min")):
        if lim == 0:
            continue
        y = x.copy()
        y.reshape(-1)[0] = lim
        cands.append((f"{idx or name} = {what}", f" ({x.dtype} {what}, {lim})", y, True))
    plans: list[_Plan] = []
    for short, why, y, may in cands:
        if not any(np.array_equal(y, p.value) for p in plans):
            label = f"{name} {short}" if short.startswith("all") else f"{name}{short}"
            plans.append(_Plan(i, label + why, short, y, may))
    return plans


def _plan(prog: Program, budget: int) -> tuple[list[_Plan], list[SweepInput]]:
    """Every input's probes, taken in turns up to ``budget``; and the per-input records (probes not run yet)."""
    leaves = prog.leaves()
    per: list[list[_Plan]] = []
    records: list[SweepInput] = []
    for i, (name, x) in enumerate(zip(prog.names, leaves)):
        kind, why = _kind(x)
        plans: list[_Plan] = []
        if not why:
            a = np.asarray(x)
            plans = (_bool_plans(i, name, a) if kind == "bool" else _int_plans(i, name, a) if kind == "int"
                     else _float_plans(i, name, a))
        per.append(plans)
        records.append(SweepInput(name, kind, not_varied=why))
    chosen: list[_Plan] = []
    for rnd in range(max((len(p) for p in per), default=0)):
        for plans in per:
            if rnd < len(plans) and len(chosen) < budget:
                chosen.append(plans[rnd])
    taken = {id(p) for p in chosen}
    for k, plans in enumerate(per):
        left = sum(id(p) not in taken for p in plans)
        if plans and left == len(plans):
            records[k] = dataclasses.replace(records[k], not_varied=(
                f"the sweep's budget of {budget} probes went to the inputs before it (audit it with fewer "
                "inputs, or with the others held in a closure)"))
        elif left:
            records[k] = dataclasses.replace(records[k], skipped=left)
    return chosen, records


# --------------------------------------------------------------------------- running


class _Runner:
    """The gradient's finiteness at probed inputs: one compiled function, the held inputs passed in.

    A function that needs a held input's value while tracing (``int(n)``, a
    shape) cannot take it as an argument: then each held probe re-traces with
    the probe as a constant.
    """

    def __init__(self, prog: Program, held: Sequence[int]) -> None:
        self.prog = prog
        self.held = list(held)  # leaf positions passed in as arguments
        self.traced = jax.jit(self._run)
        self.passed = True

    def program(self, dyn: Sequence[ArrayLike], held_vals: Sequence[ArrayLike]) -> Program:
        statics = list(self.prog.split.statics)
        for i, v in zip(self.held, held_vals):
            statics[i] = v
        split = dataclasses.replace(self.prog.split, statics=tuple(statics))
        return dataclasses.replace(self.prog, split=split, dyn=list(dyn))

    def _run(self, dyn: Sequence[ArrayLike], held_vals: Sequence[ArrayLike]) -> tuple[jax.Array, jax.Array]:
        p = self.program(dyn, held_vals)
        out, vjp = jax.vjp(p.flat(), *dyn)
        g = vjp([jnp.ones_like(o) for o in out])
        return _all_finite(out), _all_finite(g)

    def __call__(self, dyn: Sequence[ArrayLike], held_vals: Sequence[ArrayLike]) -> tuple[bool, bool]:
        if self.passed:
            try:
                vf, gf = self.traced(list(dyn), list(held_vals))
                return bool(vf), bool(gf)
            except Exception:
                if not self.held:
                    raise
                self.passed = False  # needs the held values while tracing: re-trace with them as constants
        static = jax.jit(lambda *d: self._run(d, held_vals))
        vf, gf = static(*dyn)
        return bool(vf), bool(gf)


def _all_finite(xs: Sequence[ArrayLike]) -> jax.Array:
    checks = [jnp.all(jnp.isfinite(x)) for x in xs if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)]
    return jnp.all(jnp.stack(checks)) if checks else jnp.asarray(True)


def sweep(prog: Program, progress: Callable[[int, int, str], None] | None,
          locate: Locate, budget: int = BUDGET) -> tuple[Sweep, int]:
    """The probes that break the gradient (with what was probed per input), and how many probes ran.

    ``locate`` finds where the NaN is born for one probe (the audit's own
    investigation, without fixes).
    """
    plan, records = _plan(prog, budget)
    leaves = prog.leaves()
    dyn_at = {leaf: k for k, leaf in enumerate(prog.split.dyn_pos)}
    held = sorted({p.leaf for p in plan if p.leaf not in dyn_at})
    base_held = [jnp.asarray(leaves[i]) for i in held]
    runner = _Runner(prog, held)
    results: list[tuple[_Plan, bool | None, bool, str]] = []  # (plan, value finite, grad finite, error)

    def inputs(p: _Plan) -> tuple[list[ArrayLike], list[ArrayLike]]:
        """The dynamic and held inputs with ``p``'s value in its leaf."""
        dyn = list(prog.dyn)
        hv: list[ArrayLike] = list(base_held)
        if p.leaf in dyn_at:
            k = dyn_at[p.leaf]
            dyn[k] = compat.typed_like(p.value, dyn[k])  # the input's weak type and sharding: no new trace
        else:
            k = held.index(p.leaf)
            hv[k] = compat.typed_like(p.value, hv[k])
        return dyn, hv

    for k, p in enumerate(plan):
        if progress is not None:
            progress(k, len(plan), p.label)
        dyn, hv = inputs(p)
        try:
            vf, gf = runner(dyn, hv)
        except Exception as e:  # the function refuses this input (an index out of range it checks): not a finding
            results.append((p, None, True, f"{type(e).__name__}: {one_line(str(e), limit=120)}"))
            continue
        results.append((p, vf, gf, ""))
    if progress is not None:
        progress(len(plan), len(plan), "done")
    by_leaf: dict[int, list[tuple[_Plan, bool | None, bool, str]]] = {}
    for r in results:
        by_leaf.setdefault(r[0].leaf, []).append(r)
    for leaf, rs in by_leaf.items():
        rec = records[leaf]
        records[leaf] = dataclasses.replace(
            rec, probes=tuple(r[0].short for r in rs if not r[3]),
            broken=sum(1 for r in rs if not r[3] and not r[2]),
            rejected=tuple(f"{p.short}: {err}" for p, _, _, err in rs if err),
            not_varied=rec.not_varied if any(not err for *_, err in rs) else "every probe was rejected by the "
            "function")
    probes: list[Probe] = []
    for p, value_ok, grad_ok, err in results:
        if err or grad_ok:
            continue
        op = where = ""
        if len(probes) < _LOCATED:
            try:
                findings = locate(runner.program(*inputs(p)))
            except Exception:  # locating is a courtesy: the probe is reported either way
                findings = ()
            if findings:
                op, where = findings[0].op, findings[0].location
        probes.append(Probe(prog.names[p.leaf], p.label, bool(value_ok), False, op, where))
    return Sweep(probes, records, budget), len(plan)
