"""Fixes for a finding: suggested, applied to the program, and checked against float64 finite differences.

A fix is a rule table (``gk.tables.SAFE`` covers a where-guarded singular
op: the program is re-run under ``gk.override``) or a stable function
(``gk.stable.log1pexp`` for ``log(1 + exp(x))``: the traced program is
rewritten, the matched equation replaced by one that calls the stable
function). Candidates are tried most specific first; the first whose
gradient is finite and matches float64 finite differences is shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradkit import stable, tables
from gradkit._src import compat, walk
from gradkit._src.audit_explain import Selection, callee, loc, via, zero_cotangent
from gradkit._src.audit_program import Program, gradient
from gradkit._src.audit_report import Fix, gk_name
from gradkit._src.describe import count_nonfinite, one_line, relative_error, to_f64
from gradkit._src.fd import differences, select_coords

_GRAD_RTOL = {np.dtype(np.float64): 1e-5, np.dtype(np.float32): 2e-3, np.dtype(np.float16): 1e-2,
              np.dtype(jnp.bfloat16): 1e-1}

_PRIM_FIX = {  # singular primitive -> (stable function, what it does there)
    "log": ("safe_log", "log(max(x, tiny)): equal to log on every normal positive input, derivative 0 at 0"),
    "sqrt": ("safe_sqrt", "equal to sqrt for x > 0, with derivative 0 at 0"),
    "div": ("safe_div", "x / y, and 0 with zero derivatives where y == 0"),
    "pow": ("safe_pow", "x ** y with finite derivatives at x = 0"),
    "atan2": ("safe_arctan2", "arctan2 with gradient 0 at the origin"),
}
_CALLEE_FIX = {  # library function the user called -> its stable twin in gradkit.stable
    "logsumexp": "logsumexp", "norm": "safe_norm", "arctan2": "safe_arctan2", "sqrt": "safe_sqrt",
    "hypot": "hypot", "xlogy": "xlogy", "power": "safe_pow", "divide": "safe_div", "true_divide": "safe_div",
    "log_softmax": "log_softmax", "softmax": "softmax", "normalize": "normalize",
}
_TABLES = ("SAFE", "STABLE")  # rule tables whose primitive rules may cover an op of the chain


@dataclasses.dataclass(frozen=True)
class Patch:
    """Replace equation ``eqn`` by ``fn`` applied to the values of ``atoms`` (variables of its jaxpr)."""

    eqn: compat.JaxprEqn
    atoms: tuple[Any, ...]
    fn: Callable[..., Any]


@dataclasses.dataclass
class Candidate:
    """A fix to try: a table (applied with override) or patches of the traced program."""

    fix: Fix
    table: Any = None
    patches: tuple[Patch, ...] | None = None


def _stable(name: str) -> tuple[str, Callable[..., Any]]:
    return f"gradkit.stable.{name}", getattr(stable, name)


# --------------------------------------------------------------------------- looking around an equation


def _holder(closed: Any, eqn: compat.JaxprEqn) -> Any:
    """The (sub-)jaxpr that holds ``eqn``."""
    return next((j for e, j in walk.equations(closed) if e is eqn), None)


def _producer(jaxpr: Any, var: Any) -> Any:
    if compat.is_literal(var):
        return None
    return next((e for e in jaxpr.eqns if var in e.outvars), None)


def _consumers(jaxpr: Any, eqn: compat.JaxprEqn) -> list[Any]:
    outs = set(eqn.outvars)
    return [e for e in jaxpr.eqns if any((not compat.is_literal(a)) and a in outs for a in e.invars)]


def _is_one(atom: Any) -> bool:
    return compat.is_literal(atom) and bool(np.all(np.asarray(atom.val) == 1))


def _square_base(eqn: compat.JaxprEqn) -> Any:
    """``x`` when ``eqn`` computes ``x**2`` (integer_pow, square, or x*x)."""
    if eqn is None:
        return None
    n = eqn.primitive.name
    if (n == "integer_pow" and eqn.params.get("y") == 2) or n == "square":
        return eqn.invars[0]
    if n == "mul" and eqn.invars[0] is eqn.invars[1]:
        return eqn.invars[0]
    return None


# --------------------------------------------------------------------------- candidates


def suggest(root: Selection, chain: Sequence[Selection], closed: Any) -> list[Candidate]:
    """Candidate fixes for a finding, most specific first; the first that verifies is shown."""
    rb = root.birth
    p = rb.name
    if rb.is_rule:
        return [Candidate(Fix("code", "rule", (
            f"the rule table's rule for `{p}` returns a NaN/inf cotangent here: guard its arithmetic (a double "
            f"where on the singular inputs), or check it with gk.check_grads / gk.compare."),
            note="the rule itself needs a change"))]
    eqn = rb.eqn
    jaxpr = _holder(closed, eqn)
    line = loc(eqn, rb.ctx)
    births = [s.birth for s in chain]
    cands: list[Candidate] = []
    names_in_chain = [p] + sorted({b.name for b in births} - {p})
    zero_ct = zero_cotangent(chain)
    lib = via(rb)

    # 1. Expressions with a stable counterpart, rewritten in the traced program.
    if p == "exp" and jaxpr is not None:
        for c in _consumers(jaxpr, eqn):
            if c.primitive.name == "log1p":
                cands.append(_log1pexp_patch(eqn, c, "log1p(exp(x))", line))
            elif c.primitive.name == "add" and any(_is_one(a) for a in c.invars):
                cands += [_log1pexp_patch(eqn, d, "log(1 + exp(x))", line)
                          for d in _consumers(jaxpr, c) if d.primitive.name == "log"]
            elif c.primitive.name == "reduce_sum":
                cands += [_logsumexp_patch(eqn, c, d, line) for d in _consumers(jaxpr, c) if d.primitive.name == "log"]
        if not cands:
            cands.append(Candidate(Fix("code", "gradkit.stable", (
                f"`exp` overflows above 88.7 in float32 at {line}: rewrite the expression so that exp is only "
                "taken of non-positive numbers (gk.stable.log1pexp, gk.stable.logsumexp, gk.stable.softmax)."),
                note="no automatic rewrite for this expression")))
    if p == "sqrt" and jaxpr is not None:
        src = _producer(jaxpr, eqn.invars[0])
        if src is not None and src.primitive.name == "reduce_sum":
            base = _square_base(_producer(jaxpr, src.invars[0]))
            if base is not None:
                cands.append(_safe_norm_patch(eqn, src, base, line, lib))
    # 2. The library function the user called has a stable twin (same signature).
    if lib in _CALLEE_FIX and not any(c.fix.name.endswith(_CALLEE_FIX[lib]) for c in cands):
        name, f = _stable(_CALLEE_FIX[lib])
        cands.append(Candidate(Fix("code", name, (
            f"replace `{lib}` at {line} with `{gk_name(name)}` (same arguments): " + _first_doc_line(f)),
            note="a code change: audit re-runs the gradient with the equivalent rule below")))
    # 3. Rule tables that cover an op of the chain (a where-guarded singular op, …).
    for tname in _TABLES:
        tbl = getattr(tables, tname)
        covered = [n for n in names_in_chain if n in tbl]
        if covered:
            cands.append(Candidate(Fix("table", f"gradkit.tables.{tname}", (
                f"apply gk.tables.{tname} with gk.override(fn, gk.tables.{tname}): its rule"
                f"{'s' if len(covered) > 1 else ''} for {', '.join('`' + n + '`' for n in covered)} replace"
                f"{'' if len(covered) > 1 else 's'} the derivative that blows up here (no code change).")),
                table=tbl))
    # 4. The singular primitive itself, replaced by its safe twin.
    if jaxpr is not None:
        b = next((b for b in [rb] + [b for b in births if b is not rb] if b.name in _PRIM_FIX), None)
        if b is not None:
            name, f = _stable(_PRIM_FIX[b.name][0])
            cands.append(_prim_patch(b.eqn, name, f, _PRIM_FIX[b.name][1], loc(b.eqn, b.ctx)))
    if zero_ct and p in _PRIM_FIX and not lib:
        cands.append(Candidate(Fix("code", "double where", (
            f"or guard the input as well as the output at {line} (the 'double where'): "
            f"jnp.where(ok, {p}(jnp.where(ok, x, safe_value)), fallback), so the unused branch never sees "
            "the singular value."), note="a code change")))
    patched = {c.fix.name for c in cands if c.patches is not None}
    cands = [c for c in cands if c.patches is not None or c.table is not None or c.fix.name not in patched]
    if not cands:
        cands.append(Candidate(Fix("code", "", (
            f"no known rule fixes `{p}` here: check the inputs that reach {line} (values above), or "
            "write a gk.vjp_rule for it."), note="no known fix")))
    return cands


def _first_doc_line(f: Any) -> str:
    doc = (getattr(f, "__doc__", None) or "").strip().splitlines()
    return doc[0].strip().replace("``", "`") if doc else ""


def _prim_patch(eqn: compat.JaxprEqn, name: str, f: Callable[..., Any], what: str, line: str) -> Candidate:
    lib = callee(eqn)
    shown = lib if lib and _CALLEE_FIX.get(lib) == name.split(".")[-1] else eqn.primitive.name
    return Candidate(Fix("code", name, f"replace `{shown}` at {line} with `{gk_name(name)}` ({what})."),
                     patches=(Patch(eqn, tuple(eqn.invars), lambda *xs: [f(*xs)]),))


def _log1pexp_patch(exp_eqn: Any, target: Any, how: str, line: str) -> Candidate:
    name, f = _stable("log1pexp")
    return Candidate(Fix("code", name, f"replace `{how}` at {line} with `{gk_name(name)}(x)`: it never evaluates "
                                       "exp of a large number, and its derivative is sigmoid(x)."),
                     patches=(Patch(target, (exp_eqn.invars[0],), lambda x: [f(x)]),))


def _logsumexp_patch(exp_eqn: Any, sum_eqn: Any, log_eqn: Any, line: str) -> Candidate:
    name, f = _stable("logsumexp")
    axes = tuple(sum_eqn.params.get("axes", ()))
    return Candidate(Fix("code", name, f"replace `log(sum(exp(x)))` at {line} with `{gk_name(name)}(x, axis={axes})`."),
                     patches=(Patch(log_eqn, (exp_eqn.invars[0],), lambda x: [f(x, axis=axes)]),))


def _safe_norm_patch(sqrt_eqn: Any, sum_eqn: Any, base: Any, line: str, lib: str) -> Candidate:
    name, f = _stable("safe_norm")
    axes = tuple(sum_eqn.params.get("axes", ()))
    axis = axes[0] if len(axes) == 1 else axes
    what = f"`{lib}`" if lib else "`sqrt(sum(x**2))`"
    return Candidate(Fix("code", name, f"replace {what} at {line} with `{gk_name(name)}(x, axis={axis})`: its "
                                       "gradient at x = 0 is 0 instead of NaN."),
                     patches=(Patch(sqrt_eqn, (base,), lambda x: [f(x, axis=axis)]),))


# --------------------------------------------------------------------------- applying and checking


def patched_program(closed: Any, patches: Sequence[Patch]) -> Any:
    """``closed`` with each patched equation replaced by one ``jit`` equation calling the patch."""
    by_eqn = {id(p.eqn): p for p in patches}

    def replace(eqn: compat.JaxprEqn) -> list[Any] | None:
        p = by_eqn.get(id(eqn))
        if p is None or p.eqn is not eqn:
            return None

        def fn(*xs: Any) -> list[Any]:  # the stable function's result, in the replaced equation's avals
            outs = [compat.struct_of(v.aval) for v in eqn.outvars]
            return [jnp.asarray(o).astype(s.dtype).reshape(s.shape) for o, s in zip(p.fn(*xs), outs)]
        with compat.source_of(eqn):
            return [compat.call_equation(fn, p.atoms, eqn.outvars, eqn)]
    return walk.Rewrite(replace)(closed)


def apply_fix(cand: Candidate, prog: Program, fn: Any, table: Any, closed: Any) -> Fix:
    """Re-runs the gradient with ``cand`` applied; the fix with the verdict filled in."""
    from gradkit._src.dispatch import override

    fx = cand.fix
    if cand.table is None and cand.patches is None:
        return fx
    try:
        if cand.table is not None:
            fixed_flat = prog.with_fn(override(fn, cand.table if table is None else (table | cand.table))).flat()
        else:
            fixed = patched_program(closed, cand.patches or ())
            fixed_flat = lambda *d: compat.eval_jaxpr(fixed, d)
        _, grads = gradient(fixed_flat, prog.dyn)
    except Exception as e:  # the fix does not apply to this program: say so, keep looking
        return dataclasses.replace(fx, applied=False, note=f"re-run failed: {type(e).__name__}: {one_line(str(e))}")
    bad = sum(count_nonfinite(g) for g in grads)
    if bad:
        return dataclasses.replace(fx, applied=True, finite=False, note=f"{bad} element(s) still non-finite")
    matches, rel, compared, excluded, note = fd_check(prog, grads)
    return dataclasses.replace(fx, applied=True, finite=True, matches_fd=matches, max_rel_err=rel,
                               compared=compared, excluded=excluded, note=note)


def choose_fix(cands: list[Candidate], prog: Program, fn: Any, table: Any, closed: Any,
               do_fix: bool) -> tuple[Fix | None, tuple[Fix, ...]]:
    """Re-runs candidates in order until one verifies; returns (shown fix, alternatives).

    A code change audit cannot apply (a library function swapped for its
    stable twin) stays the shown advice when a later, equivalent candidate
    verifies; the verdict then says which one was re-run.
    """
    results: list[Fix] = []
    found: Fix | None = None
    for c in cands:
        if found is not None:
            if c.table is not None and found.kind != "table":  # also worth knowing: a no-code-change fix
                results.append(apply_fix(c, prog, fn, table, closed) if do_fix else c.fix)
            elif c.table is None and (found.kind == "table" or c.patches is None):
                results.append(c.fix)  # listed as advice, not re-run
            continue
        r = apply_fix(c, prog, fn, table, closed) if do_fix else c.fix
        results.append(r)
        if r.verified:
            found = r
    if not results:
        return None, ()
    if found is None:
        return results[0], tuple(results[1:])
    lead = results[0]
    if lead is not found and lead.kind == "code" and lead.name.startswith("gradkit.stable") and not lead.applied:
        shown = dataclasses.replace(found, kind=lead.kind, name=lead.name, advice=lead.advice,
                                    checked_with=found.name)
        return shown, tuple(r for r in results[1:] if r is not found)
    return found, tuple(r for r in results if r is not found)


def fd_check(prog: Program, grads: Sequence[np.ndarray], max_coords: int = 256
             ) -> tuple[bool | None, float | None, int, int, str]:
    """Compares ``grads`` with central differences of the original function in float64.

    Returns ``(matches, max rel err, compared, excluded, note)``. Elements where
    finite differences are undefined are left out: the one-sided differences
    disagree (a kink or a jump), or a value is non-finite.
    """
    compared = excluded = 0
    worst = 0.0
    ok = True
    try:
        with jax.enable_x64(True):
            prog64 = prog.cast(to_f64)
            dyn64 = [jnp.asarray(x) for x in prog64.dyn]
            for pos, (x, g) in enumerate(zip(dyn64, grads)):
                def total(v: jax.Array, pos: int = pos) -> jax.Array:
                    d = list(dyn64)
                    d[pos] = v
                    return jnp.asarray(sum(jnp.sum(o.astype(jnp.float64)) for o in prog64.call(d)))

                coords = select_coords(x.size, max_coords)
                step = 1e-6 * np.maximum(1.0, np.abs(np.asarray(x).reshape(-1)[coords]))
                fd = differences(total, x, coords, step, one_sided=True)
                central, right, left = fd.central[0], fd.forward[0], fd.backward[0]  # type: ignore[index]
                with np.errstate(invalid="ignore", over="ignore"):
                    scale = np.nanmax(np.abs(np.where(np.isfinite(central), central, 0.0)), initial=0.0)
                    kink = np.abs(right - left) > 1e-2 * (np.abs(central) + 1e-3 * scale + 1e-12)
                usable = fd.finite[0] & np.isfinite(central) & np.isfinite(right) & np.isfinite(left) & ~kink
                gv = np.asarray(g, dtype=np.float64).reshape(-1)[coords]
                excluded += int((~usable).sum())
                compared += int(usable.sum())
                if not usable.any():
                    continue
                c, gu = central[usable], gv[usable]
                rtol = _GRAD_RTOL.get(np.dtype(np.asarray(g).dtype), 2e-3)
                atol = 0.1 * rtol * float(np.max(np.abs(c)))
                ok &= bool(np.all(np.abs(gu - c) <= atol + rtol * np.abs(c)))
                rel = relative_error(gu, c, atol / rtol)
                worst = max(worst, float(np.max(rel)))
    except Exception as e:  # the function does not run in float64: no comparison, and the report says why
        return None, None, compared, excluded, (f"finite differences in float64 failed: "
                                              f"{type(e).__name__}: {one_line(str(e))}")
    if compared == 0:
        return None, None, 0, excluded, "no element where finite differences are defined"
    return ok, worst, compared, excluded, ""
