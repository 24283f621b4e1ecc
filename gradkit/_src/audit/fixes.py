"""Fixes for a finding: every gradkit route, re-run on the program, the first that verifies shown.

A route is one of:

* a rewrite to a :mod:`gradkit.stable` function whose naive form the program
  contains next to where the NaN/inf was born (``log(1 + exp(x))``,
  ``1 / (1 + exp(-x))``, ``log(1 - sigmoid(x))``, ``pow(sum(x**2), 0.5)``,
  ``arccos(clip(x, -1, 1))``, ``x * log(y)``, … :mod:`gradkit._src.audit.patterns`),
  re-run by replacing the matched equations in the traced program with one
  call of the stable function;
* a rule table, re-run under ``gk.override``: every ready table of
  :mod:`gradkit.tables` with a rule for an op of the program, each opt-in
  library rule for an op of the chain (``{"mul": "safe"}``: the records of
  :mod:`gradkit._src.rules.library` that no ready table ships), and their unions;
* one singular primitive replaced by its ``safe_*`` twin (a convention at the
  singular point), re-run like a rewrite.

Routes are tried in that order (rewrites of a formula first, then the tables
that need no code change, then the conventions); the first whose gradient
is finite, matches float64 finite differences and leaves the forward value
as it was (:mod:`gradkit._src.audit.verify`) is the fix shown. Nothing is
assumed to work: a table is suggested only when its re-run verified. When
no route does, the report says so and lists what was re-run.

Every description comes from one place: a stable function's from the first
line of its docstring, a rule's from its library record
(:func:`gradkit.tables.describe`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import compat
from gradkit._src.audit.explain import Selection, loc, via, zero_cotangent
from gradkit._src.audit.patterns import Rewrite, find, masked_row_advice, stable_doc
from gradkit._src.audit.point_mask import point_mask_advice
from gradkit._src.audit.program import Program, gradient
from gradkit._src.audit.report import Fix
from gradkit._src.audit.verify import Reference, value_check
from gradkit._src.checks.describe import count_nonfinite, nonfinite_mask, one_line, short_path
from gradkit._src.core import walk
from gradkit._src.core.dispatch import op_name, override
from gradkit._src.core.rule import Rule
from gradkit._src.core.table import RuleTable
from gradkit._src.rules import library, tables

__all__ = ["Candidate", "Patch", "apply_fix", "choose_fix", "patched_program", "suggest"]

_MAX_ROUTES = 24  # table routes (unions included) re-run per finding at most
_MUST = 16  # non-finite gradient elements per input compared one by one with finite differences
_ALSO = 2  # single tables re-run after a rewrite verified, to say whether one also works
_ANYWHERE = 4  # stable rewrites elsewhere in the program re-run when no route verified
_PAIRS = 9  # pairs of partial routes re-run when no route verified alone


Table = RuleTable | Mapping[str, Rule]  # what gk.override takes

@dataclasses.dataclass(frozen=True)
class Patch:
    """Replace equation ``eqn`` by ``fn`` applied to the values of ``atoms`` (variables of its jaxpr)."""

    eqn: compat.JaxprEqn
    atoms: tuple[compat.Atom, ...]
    fn: Callable[..., Sequence[jax.Array]]


@dataclasses.dataclass
class Candidate:
    """A route to try: a table (applied with override), patches of the traced program, or advice only."""

    fix: Fix
    table: RuleTable | None = None
    patches: tuple[Patch, ...] | None = None

    @property
    def runnable(self) -> bool:
        return self.table is not None or self.patches is not None


# --------------------------------------------------------------------------- candidates


def suggest(root: Selection, chain: Sequence[Selection], closed: compat.ClosedJaxpr | compat.Jaxpr) -> list[Candidate]:
    """Every route for a finding, in the order they are tried (see the module docstring)."""
    rb = root.birth
    p = rb.name
    if rb.is_rule:
        return [Candidate(Fix("code", "rule", (
            f"the rule table's rule for `{p}` returns a NaN/inf cotangent here: guard its arithmetic (a double "
            f"where on the singular inputs), or check it with gk.check_grads / gk.compare."),
            note="the rule itself needs a change"))]
    line = loc(rb.eqn, rb.ctx)
    births = [s.birth.eqn for s in chain if s.birth.eqn is not None]
    cands = [_rewrite(rw) for rw in find(closed, births, "expression")]
    point = point_mask_advice(closed, rb.eqn, line) if rb.eqn is not None else ""
    if point:
        cands.append(Candidate(Fix("code", "point mask", point, note="a code change: not re-run")))
    if p == "exp" and not cands:
        cands.append(Candidate(Fix("code", "gradkit.stable", (
            f"`exp` overflows (above 88.7 in float32) at {line}: rewrite the expression so that exp is only "
            "taken of non-positive numbers (gk.stable.log1pexp, gk.stable.logsumexp, gk.stable.softmax)."),
            note="no stable function matches this expression")))
    masked = masked_row_advice(closed, rb.eqn, line) if rb.phase == "forward" and rb.eqn is not None else ""
    if masked:
        cands.append(Candidate(Fix("code", "masked row", f"or change the code: {masked}.",
                                   note="a code change: not re-run")))
    cands += table_routes(chain, closed)
    twins = find(closed, births, "primitive")
    cands += [_rewrite(rw) for rw in twins]
    if zero_cotangent(chain) and twins and not via(rb):
        cands.append(Candidate(Fix("code", "double where", (
            f"or guard the input as well as the output at {line} (the 'double where'): "
            f"jnp.where(ok, {p}(jnp.where(ok, x, safe_value)), fallback), so the unused branch never sees "
            "the singular value."), note="a code change")))
    return cands


def _rewrite(rw: Rewrite) -> Candidate:
    """The candidate that replaces a matched expression by its stable function."""
    span = rw.span
    where = f"{short_path(span[0])}:{span[1]}" if span else "an unknown source line"
    shown = f"`{rw.text}`" if rw.text else f"`{rw.pattern.naive}`"
    advice = f"replace {shown} at {where} with `{rw.call}`: {stable_doc(rw.pattern.function)}."
    fix = Fix("code", rw.name, advice, expression=rw.call, location=where, replaces=rw.text or rw.pattern.naive)
    return Candidate(fix, patches=(Patch(rw.eqn, rw.atoms, lambda *xs, f=rw.fn: [f(*xs)]),))


# --------------------------------------------------------------------------- table routes


def _program_ops(closed: compat.ClosedJaxpr | compat.Jaxpr) -> set[str]:
    return {op_name(e) for e, _ in walk.equations(closed)}


def _low_precision(closed: compat.ClosedJaxpr | compat.Jaxpr) -> bool:
    """The program computes in a float narrower than float32 (what an upcast table changes)."""
    return any(jnp.issubdtype(v.aval.dtype, jnp.floating) and np.dtype(v.aval.dtype).itemsize < 4
               for e, _ in walk.equations(closed) for v in e.outvars if hasattr(v.aval, "dtype"))


def _shipped_tables() -> list[tuple[str, RuleTable]]:
    """The ready tables of :mod:`gradkit.tables`, by name (the order of its ``__all__``)."""
    return [(n, t) for n, t in sorted(vars(tables).items()) if not n.startswith("_") and isinstance(t, RuleTable)]


def _opt_in_rules() -> list[tuple[str, str, tuple[str, ...]]]:
    """``(family, op, table keys)`` of the library rules no ready table ships (``{"mul": "safe"}``)."""
    return [(fam, r.op, r.keys) for fam, records in library.FAMILIES.items() for r in records.values()
            if r.table is None]


@dataclasses.dataclass(frozen=True)
class _Part:
    """One piece of a table route: a ready table, or an opt-in rule."""

    name: str  # "gradkit.tables.SAFE" or '{"mul": "safe"}'
    expression: str  # "gk.tables.SAFE" or '{"mul": "safe"}'
    table: RuleTable
    on_chain: bool


def table_routes(chain: Sequence[Selection], closed: compat.ClosedJaxpr | compat.Jaxpr) -> list[Candidate]:
    """Ready tables with a rule for an op of the program, opt-in rules for an op of the chain, and their unions.

    Smaller routes first; among routes of one size, those with a rule for an op
    where the NaN/inf was born first. At most ``_MAX_ROUTES``.
    """
    prog_ops = _program_ops(closed)
    chain_ops = {s.birth.name for s in chain}
    chain_ops |= {compat.FUNCTION_PREFIX + c.name for s in chain for c in s.birth.ctx if c.kind == "jit" and c.name}
    low = _low_precision(closed)
    parts: list[_Part] = []
    for name, tbl in _shipped_tables():
        used = tbl.names() & prog_ops
        upcast = all(r.key[1:2] == ("upcast_backward",) for r in tbl.values())
        if used and (low or not upcast):
            parts.append(_Part(f"gradkit.tables.{name}", f"gk.tables.{name}", tbl, bool(used & chain_ops)))
    # A NaN born in the forward pass and dropped later (a fully masked softmax row under a `where`)
    # reaches the gradient through products anywhere downstream: opt-in rules for any op of the program.
    masked_value = bool(chain) and chain[0].birth.phase == "forward"
    for fam, op, keys in _opt_in_rules():
        hit = [k for k in keys if k in chain_ops or (masked_value and k in prog_ops)]
        if hit:
            entry = "{" + ", ".join(f'"{k}": "{fam}"' for k in hit) + "}"
            rule_table = RuleTable({k: library.make_rule(fam, k, {"op": op}) for k in hit})
            parts.append(_Part(entry, entry, rule_table, any(k in chain_ops for k in hit)))
    parts.sort(key=lambda q: not q.on_chain)  # stable: the tables that cover an op of the chain first
    routes: list[Candidate] = []
    for size in range(1, len(parts) + 1):
        for combo in itertools.combinations(parts, size):
            if len(routes) >= _MAX_ROUTES:
                return routes
            routes.append(_table_candidate(combo, chain_ops, prog_ops))
    return routes


def _table_candidate(combo: Sequence[_Part], chain_ops: set[str], prog_ops: set[str]) -> Candidate:
    tbl = combo[0].table
    for q in combo[1:]:
        tbl = tbl | q.table
    name = " | ".join(q.name for q in combo)
    expression = " | ".join(q.expression for q in combo)
    covered = sorted(tbl.names() & chain_ops) or sorted(tbl.names() & prog_ops)[:4]
    docs = tables.describe(RuleTable({k: tbl[k] for k in covered}))
    rules = "; ".join(f"`{k}` ({docs[k]})" for k in covered)
    what = ("rules for {} replace the derivatives that blow up here" if len(covered) > 1
            else "rule for {} replaces the derivative that blows up here").format(rules)
    advice = f"apply {expression} with gk.override(fn, {expression}) (no code change): its {what}."
    return Candidate(Fix("table", name, advice, expression=expression), table=tbl)


# --------------------------------------------------------------------------- applying and checking


def patched_program(closed: compat.ClosedJaxpr, patches: Sequence[Patch]) -> compat.ClosedJaxpr:
    """``closed`` with each patched equation replaced by one ``jit`` equation calling the patch."""
    by_eqn = {id(p.eqn): p for p in patches}

    def replace(eqn: compat.JaxprEqn) -> list[compat.JaxprEqn] | None:
        p = by_eqn.get(id(eqn))
        if p is None or p.eqn is not eqn:
            return None

        def fn(*xs: jax.Array) -> list[jax.Array]:  # the stable function's result, in the replaced equation's avals
            outs = [compat.struct_of(v.aval) for v in eqn.outvars]
            return [jnp.asarray(o).astype(s.dtype).reshape(s.shape) for o, s in zip(p.fn(*xs), outs)]
        with compat.source_of(eqn):
            return [compat.call_equation(fn, p.atoms, eqn.outvars, eqn)]
    return walk.Rewrite(replace)(closed)


class _Original:
    """The audited program's own outputs, non-finite gradient elements and float64 reference, computed once."""

    def __init__(self, prog: Program) -> None:
        self.prog = prog
        self.bad = 0  # non-finite gradient elements without a fix
        self._run: tuple[list[np.ndarray], Reference] | None = None

    def _get(self) -> tuple[list[np.ndarray], Reference]:
        if self._run is None:
            out, grads = gradient(self.prog.flat(), self.prog.dyn)
            masks = [nonfinite_mask(g) for g in grads]
            must = [[] if m is None else [int(i) for i in np.flatnonzero(m)[:_MUST]] for m in masks]
            self.bad = sum(count_nonfinite(g) for g in grads)
            self._run = out, Reference(self.prog, must)
        return self._run

    @property
    def outputs(self) -> list[np.ndarray]:
        return self._get()[0]

    @property
    def reference(self) -> Reference:
        return self._get()[1]


def apply_fix(cand: Candidate, prog: Program, fn: Callable[..., object], table: Table | None,
              closed: compat.ClosedJaxpr,
              original: _Original | None = None) -> Fix:
    """Re-runs the gradient with ``cand`` applied; the fix with the verdict filled in."""
    return _apply(cand, prog, fn, table, closed, original or _Original(prog))[0]


def _apply(cand: Candidate, prog: Program, fn: Callable[..., object], table: Table | None,
           closed: compat.ClosedJaxpr, original: _Original) -> tuple[Fix, int]:
    """:func:`apply_fix`, and how many gradient elements are still non-finite (-1: not re-run)."""
    fx = cand.fix
    if not cand.runnable:
        return fx, -1
    try:
        rules = cand.table if table is None or cand.table is None else (table | cand.table)
        if cand.patches is None:
            assert rules is not None  # runnable without patches: a table route
            fixed_flat = prog.with_fn(override(fn, rules)).flat()
        else:
            fixed = patched_program(closed, cand.patches)
            run = lambda *d: compat.eval_jaxpr(fixed, d)
            fixed_flat = run if rules is None else override(run, rules)
        out, grads = gradient(fixed_flat, prog.dyn)
    except Exception as e:  # the route does not apply to this program: say so, keep looking
        note = f"re-run failed: {type(e).__name__}: {one_line(str(e))}"
        return dataclasses.replace(fx, applied=False, note=note), -1
    bad = sum(count_nonfinite(g) for g in grads)
    same, value_note = value_check(original.outputs, out, original.reference.values)
    if bad:
        return dataclasses.replace(fx, applied=True, finite=False, note=f"{bad} element(s)", value_same=same,
                                   value_note=value_note), bad
    fd = original.reference.compare(grads)
    fx = dataclasses.replace(fx, applied=True, finite=True, matches_fd=fd.matches, max_rel_err=fd.max_rel_err,
                             compared=fd.compared, directions=fd.directions, excluded=fd.excluded, note=fd.note,
                             value_same=same, value_note=value_note)
    if fd.kink is not None:  # decided by the float64 gradients at nearby points (a kink, the domain's edge)
        k = fd.kink
        fx = dataclasses.replace(fx, kink=k.kind, kink_ok=k.ok, kink_elements=k.elements, kink_points=k.points,
                                 kink_err=k.error)
    return fx, 0


def choose_fix(cands: list[Candidate], prog: Program, fn: Callable[..., object], table: Table | None,
               closed: compat.ClosedJaxpr,
               do_fix: bool) -> tuple[Fix | None, tuple[Fix, ...]]:
    """Re-runs candidates in order until one verifies; returns (shown fix, alternatives).

    Without ``do_fix`` nothing is re-run: the first route is the advice. When
    no route verifies alone (two NaNs born apart, each needing its own
    route), the routes that each removed some non-finite elements — and the
    stable rewrites anywhere in the program — are tried in pairs
    (:func:`_combinations`). When nothing verifies, the shown fix says so and
    the alternatives are every route re-run, with its verdict.
    """
    if not cands:
        return None, ()
    if not do_fix:
        return cands[0].fix, tuple(c.fix for c in cands[1:])
    original = _Original(prog)
    tried: list[Fix] = []
    partial: list[Candidate] = []
    found: Fix | None = None
    rest: list[Candidate] = []
    for k, c in enumerate(cands):
        if not c.runnable:
            continue
        r, bad = _apply(c, prog, fn, table, closed, original)
        tried.append(r)
        if r.verified:
            found, rest = r, cands[k + 1:]
            break
        if 0 < bad < original.bad:
            partial.append(c)
    advice = [c.fix for c in cands if not c.runnable]
    double_where = [a for a in advice if a.name in ("double where", "masked row", "point mask")]
    if found is None:
        found = _combinations(cands, partial, tried, prog, fn, table, closed, original)
    # A rule changes derivatives only, never the value: where the value is NaN/inf and no route (a
    # rewrite of the formula, alone or with a table) verified, no table can: say so, and what to change.
    masked_row = any(a.name == "masked row" for a in advice)
    if found is None and masked_row and any(count_nonfinite(o) for o in original.outputs):
        return _no_table(tried, advice), tuple(tried) + tuple(a for a in double_where if a.name != "masked row")
    if found is None:
        shown = _nothing_verified(tried, advice)
        return shown, tuple(tried) + tuple(a for a in double_where if a.advice not in shown.advice)
    also: list[Fix] = []
    if found.kind == "code":  # a rule table that works too needs no code change: worth a line
        for c in [c for c in rest if c.table is not None and " | " not in c.fix.name][:_ALSO]:
            r = _apply(c, prog, fn, table, closed, original)[0]
            if r.verified:
                also.append(r)
                break
    return found, tuple(also + double_where)


def _combinations(cands: Sequence[Candidate], partial: list[Candidate], tried: list[Fix], prog: Program,
                  fn: Callable[..., object], table: Table | None, closed: compat.ClosedJaxpr,
                  original: _Original) -> Fix | None:
    """A pair of routes that verifies together, each having removed some of the non-finite elements alone.

    The stable rewrites anywhere in the program join the partial routes first
    (re-run alone; one may verify by itself). Pairs: at most ``_PAIRS``; two
    tables are not paired (their unions were routes already).
    """
    known = {c.fix.expression or c.fix.name for c in cands}
    anywhere = [_rewrite(rw) for rw in find(closed, [e for e, _ in walk.equations(closed)], "expression")]
    for c in [c for c in anywhere if c.fix.expression not in known][:_ANYWHERE]:
        r, bad = _apply(c, prog, fn, table, closed, original)
        tried.append(r)
        if r.verified:
            return r
        if 0 < bad < original.bad:
            partial.append(c)
    pairs = [(a, b) for a, b in itertools.combinations(partial, 2) if a.patches is not None or b.patches is not None]
    for a, b in pairs[:_PAIRS]:
        r = _apply(_pair(a, b), prog, fn, table, closed, original)[0]
        tried.append(r)
        if r.verified:
            return r
    return None


def _pair(a: Candidate, b: Candidate) -> Candidate:
    """Both routes at once: the rewrites patched in together, under the table (if one is a table)."""
    if a.patches is None:
        a, b = b, a
    fa, fb = a.fix, b.fix
    if b.patches is None:  # a rewrite, with a table
        also = fb.advice.replace(" (no code change)", "")
        fix = dataclasses.replace(fa, name=f"{fa.name} + {fb.name}", with_table=fb.expression,
                                  advice=f"{fa.advice} Also {also[0].lower()}{also[1:]}")
        return Candidate(fix, table=b.table, patches=a.patches)
    fix = dataclasses.replace(fa, name=f"{fa.name} + {fb.name}", expression=f"{fa.expression}; {fb.expression}",
                              location=f"{fa.location}; {fb.location}", replaces=f"{fa.replaces}; {fb.replaces}",
                              advice=f"{fa.advice} Also {fb.advice[0].lower()}{fb.advice[1:]}")
    return Candidate(fix, patches=(a.patches or ()) + (b.patches or ()))


def _no_table(tried: Sequence[Fix], advice: Sequence[Fix]) -> Fix:
    """The shown fix when the value itself is NaN/inf (a fully masked softmax row times 0): no rule table can fix
    it — a rule changes derivatives only — and what to change in the code."""
    change = next(a.advice for a in advice if a.name == "masked row").removeprefix("or change the code: ")
    names = ", ".join(f.expression or f.name for f in tried)
    ran = f" (re-ran {len(tried)} route(s): {names}; none verified)" if tried else ""
    text = (f"no rule table fixes this: the function's value is already NaN/inf, and a rule changes only "
            f"derivatives, never the value{ran}. Change the code: {change}")
    return Fix("none", "", text, note="the code change is not re-run: apply it and audit again")


def _nothing_verified(tried: Sequence[Fix], advice: Sequence[Fix]) -> Fix:
    """The shown fix when no route verified: what was re-run, and what is left to do."""
    if tried:
        names = ", ".join(f.expression or f.name for f in tried)
        what = (f"re-ran {len(tried)} route(s) ({names}); none gives a finite gradient that matches float64 "
                "finite differences with the same forward value")
    else:
        what = ("no route applies here: no shipped table or opt-in rule has a rule for these ops, and no "
                "gk.stable function's naive form is in the expression")
    hint = " " + advice[0].advice if advice and advice[0].name != "double where" else ""
    text = (f"no gradkit route fixes this gradient: {what}.{hint} Otherwise the derivative may not exist or "
            "not fit the dtype at these inputs (see the values above).")
    return Fix("none", "", text, note=f"nothing verified ({len(tried)} route(s) re-run)")
