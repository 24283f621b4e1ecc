"""``audit``: where in the backward pass is a NaN or inf born, and what fixes it.

The gradient (reverse mode, cotangent 1 for every output) is first computed
as JAX computes it. If it is finite, that is the answer. Otherwise the
program is replayed equation by equation (:mod:`gradkit._src.replay`), and
each non-finite gradient entry is traced back to the equation where its NaN or
inf was born: the primitive, the user's file and line, the forward values that
caused it, and the scan/cond it sits in. The culprit is matched against known
patterns (``log(1 + exp(x))``, ``sqrt(sum(x**2))``, ``atan2`` at the origin,
a ``where``-guarded singular op…) and the fix — a rule table
(``gradkit.tables.SAFE``) or a stable function (``gradkit.stable``) — is applied
and checked: is the gradient finite now, and does it match float64 finite
differences?

With ``table=``, the audit also says which of the table's rules fired and
which never matched; with ``sweep=True`` it probes edge-value inputs.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import re
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import compat
from gradkit._src.check import fmt, fn_name, is_float, leaf_names, to_f64
from gradkit._src.errors import GradkitError
from gradkit._src.replay import Birth, Context, Replay, nonfinite
from gradkit._src.sourcepath import display_file

__all__ = ["AuditReport", "Finding", "Step", "Fix", "Coverage", "Probe", "audit"]

_GRAD_RTOL = {np.dtype(np.float64): 1e-5, np.dtype(np.float32): 2e-3, np.dtype(np.float16): 1e-2,
              np.dtype(jnp.bfloat16): 1e-1}


# --------------------------------------------------------------------------- report values


@dataclasses.dataclass(frozen=True)
class Step:
    """One birth in a finding's chain: where a NaN/inf appeared and why."""

    op: str
    phase: str  # "forward" | "backward"
    kind: str  # "nan" | "inf"
    file: str
    line: int
    function: str
    where: str  # "inside scan at f.py:12 (iteration 3 of 8)", or ""
    message: str
    code: str = ""  # the source line, with a marker under the call
    via: str = ""  # the library function the line called (``logsumexp``), if the op is inside one
    rule: bool = False  # the op is overridden by a rule of the audited table
    count: int = 0
    total: int = 0

    @property
    def location(self) -> str:
        return f"{_short(self.file)}:{self.line}" if self.file else "unknown source line"


@dataclasses.dataclass(frozen=True)
class Fix:
    """A suggested fix and, when it could be applied, the re-run verdict.

    Attributes:
      kind: ``"table"`` (apply a rule table with ``gk.override``) or ``"code"``
        (replace an expression with a stable function).
      name: what to use: ``"gradkit.tables.SAFE"``, ``"gradkit.stable.log1pexp"``.
      advice: one sentence saying what to change, where.
      applied: whether audit could apply it to re-run the gradient.
      finite: the gradient is finite with the fix (None: not run).
      matches_fd: it matches float64 finite differences on the compared elements.
      max_rel_err: the largest relative error there.
      compared: elements compared; ``excluded`` elements left out (finite
        differences undefined: a kink, a jump, a non-finite value).
      note: why it was not applied, or what the re-run found.
    """

    kind: str
    name: str
    advice: str
    applied: bool = False
    finite: bool | None = None
    matches_fd: bool | None = None
    max_rel_err: float | None = None
    compared: int = 0
    excluded: int = 0
    note: str = ""
    checked_with: str = ""  # the equivalent fix audit re-ran, when this one is a code change it cannot make

    @property
    def verified(self) -> bool:
        return bool(self.applied and self.finite and self.matches_fd)

    def verdict(self) -> str:
        if not self.applied:
            return f"not re-run: {self.note}" if self.note else "not re-run"
        if self.checked_with:
            return (f"(with the equivalent {_gk(self.checked_with)}) "
                    + dataclasses.replace(self, checked_with="").verdict())
        if not self.finite:
            return "gradient still non-finite" + (f" ({self.note})" if self.note else "")
        excl = (f"; {self.excluded} element(s) left out where finite differences are undefined (a kink, a jump or a non-finite value)"
                if self.excluded else "")
        if self.matches_fd is None:
            return f"gradient finite; not compared with finite differences ({self.note or 'no comparable element'})"
        if self.matches_fd:
            return (f"gradient finite, matches float64 finite differences on {self.compared} element(s) "
                    f"(max rel err {fmt(self.max_rel_err)}){excl}")
        return (f"gradient finite but differs from float64 finite differences (max rel err "
                f"{fmt(self.max_rel_err)} on {self.compared} element(s)){excl}")


@dataclasses.dataclass(frozen=True)
class Finding:
    """A non-finite gradient traced to where it was born, with a suggested fix."""

    op: str
    location: str
    where: str
    message: str
    chain: tuple[Step, ...]
    fix: Fix | None
    alternatives: tuple[Fix, ...] = ()

    @property
    def root(self) -> Step:
        return self.chain[0]


@dataclasses.dataclass(frozen=True)
class Coverage:
    """Which rules of the audited table fired (per equation in the program), and which never matched."""

    table_size: int
    fired: tuple[tuple[str, int], ...]
    never: tuple[str, ...]

    def __str__(self) -> str:
        fired = ", ".join(f"{n} x{c}" for n, c in self.fired) or "none"
        never = ", ".join(self.never) or "none"
        return f"{len(self.fired)} of {self.table_size} rules fired ({fired}); never matched: {never}"


@dataclasses.dataclass(frozen=True)
class Probe:
    """One edge-value input tried by ``audit(..., sweep=True)``."""

    input: str
    probe: str
    value_finite: bool
    grad_finite: bool
    op: str = ""
    location: str = ""


@dataclasses.dataclass(frozen=True)
class AuditReport:
    """Result of :func:`audit`. ``str(report)`` is the human report; ``to_dict()`` the JSON one.

    Attributes:
      function: the audited function's name; ``source`` its ``file:line``.
      inputs: ``"name: dtype[shape]"`` per input.
      value: a summary of the function's value (``"finite"`` or what is not).
      gradients: per differentiated input: ``(name, non-finite count, size)``.
      findings: one per independent birth place of the non-finite gradient.
      coverage: with ``table=``, which rules fired.
      sweep: with ``sweep=True``, the probes whose gradient was non-finite.
      probes: how many edge-value inputs the sweep tried.
      note: anything the audit could not do.
    """

    function: str
    source: str
    inputs: tuple[str, ...]
    value: str
    gradients: tuple[tuple[str, int, int], ...]
    findings: tuple[Finding, ...]
    coverage: Coverage | None = None
    sweep: tuple[Probe, ...] | None = None
    probes: int = 0
    note: str = ""

    @property
    def finite(self) -> bool:
        """The gradient at the audited inputs is finite everywhere."""
        return all(bad == 0 for _, bad, _ in self.gradients)

    @property
    def ok(self) -> bool:
        """Finite gradient, and no sweep probe broke it."""
        return self.finite and not self.sweep

    def __str__(self) -> str:
        return render(self)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["finite"] = self.finite
        d["ok"] = self.ok
        for f, fd in zip(self.findings, d["findings"]):
            for fix, fixd in zip(([f.fix] if f.fix else []) + list(f.alternatives),
                                 ([fd["fix"]] if f.fix else []) + list(fd["alternatives"])):
                fixd["verified"] = fix.verified
                fixd["verdict"] = fix.verdict()
            for s, sd in zip(f.chain, fd["chain"]):
                sd["location"] = s.location
        d["gradients"] = [{"input": n, "nonfinite": b, "size": s} for n, b, s in self.gradients]
        if self.coverage is not None:
            d["coverage"] = {"table_size": self.coverage.table_size, "fired": dict(self.coverage.fired),
                             "never": list(self.coverage.never)}
        return _jsonable(d)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, (np.floating, np.integer)):
        return _jsonable(x.item())
    return x


# --------------------------------------------------------------------------- inputs


@dataclasses.dataclass
class _Program:
    """The audited function, flattened to differentiable leaves -> float output leaves."""

    fn: Callable[..., Any]
    leaves: list[Any]
    treedef: Any
    names: list[str]
    diff: list[int]

    def call(self, leaves: Sequence[Any]) -> list[jax.Array]:
        out = self.fn(*jax.tree_util.tree_unflatten(self.treedef, list(leaves)))
        return [jnp.asarray(v) for v in jax.tree_util.tree_leaves(out)
                if jnp.issubdtype(jnp.asarray(v).dtype, jnp.inexact)]

    def flat(self, fn: Callable[..., Any] | None = None) -> Callable[..., list[jax.Array]]:
        prog = self if fn is None else dataclasses.replace(self, fn=fn)

        def f(*d: Any) -> list[jax.Array]:
            vals = list(prog.leaves)
            for i, x in zip(prog.diff, d):
                vals[i] = x
            return prog.call(vals)
        return f

    def dyn(self) -> list[Any]:
        return [self.leaves[i] for i in self.diff]


def _program(fn: Callable[..., Any], args: Sequence[Any], argnums: int | Sequence[int] | None) -> _Program:
    leaves, treedef, names = leaf_names(fn, args)
    leaves = [jnp.asarray(x) if isinstance(x, float) else x for x in leaves]
    if argnums is None:
        top = set(range(len(args)))
    else:
        top = {argnums} if isinstance(argnums, int) else set(argnums)
    owner = []
    for k, a in enumerate(args):
        owner += [k] * len(jax.tree_util.tree_leaves(a))
    diff = [i for i, x in enumerate(leaves) if owner[i] in top and is_float(x)]
    if not diff:
        raise GradkitError(f"audit({fn_name(fn)}): no floating-point input to differentiate "
                           f"(inputs: {', '.join(names) or 'none'}). Pass float arrays, or fix argnums.")
    return _Program(fn, leaves, treedef, names, diff)


def _grad(flat: Callable[..., list[jax.Array]], dyn: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(outputs, gradient of the sum of the outputs) — what ``jax.grad`` would give."""
    def run(*d: Any) -> tuple[list[Any], tuple[Any, ...]]:
        out, vjp = jax.vjp(flat, *d)
        return out, vjp([jnp.ones_like(o) for o in out])
    out, g = jax.jit(run)(*dyn)
    return [np.asarray(o) for o in out], [np.asarray(x) for x in g]


def _describe_input(name: str, x: Any) -> str:
    a = np.asarray(x)
    dt = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
          "int64": "i64", "bool": "bool"}.get(str(a.dtype), str(a.dtype))
    return f"{name}: {dt}[{','.join(map(str, a.shape))}]"


# --------------------------------------------------------------------------- audit


def audit(fn: Callable[..., Any], *args: Any, table: Any = None, argnums: int | Sequence[int] | None = None,
          fix: bool = True, sweep: bool = False, progress: Callable[[int, int, str], None] | None = None
          ) -> AuditReport:
    """Finds where a non-finite gradient of ``fn`` is born, and what fixes it.

    The gradient of the sum of ``fn``'s outputs with respect to every
    floating-point input (or ``argnums``) is computed as ``jax.grad`` would. If
    it holds a NaN or inf, the program is replayed equation by equation —
    through ``jit``, ``scan`` iterations and ``cond`` branches — and each
    non-finite entry is traced back to the equation where it was born: the
    primitive, the source line, the forward values that caused it ("``exp``
    overflowed to inf for 3 of 128 elements, max input 100"), and the chain
    that followed ("then 0·inf = NaN in the backward of ``exp``"). A fix is
    suggested — a rule table or a stable function — applied, and checked:
    finite now, and equal to float64 finite differences?

    Args:
      fn: a function of arrays (pytrees allowed).
      *args: the inputs to audit at.
      table: a rule table to audit ``gk.override(fn, table)`` with; the report
        then says which rules fired and which never matched.
      argnums: which positional arguments to differentiate (default: every
        floating-point one).
      fix: apply each suggested fix and re-check (finite, finite differences).
      sweep: also probe edge-value inputs (0, ±1e-30, ±1, ±100, ±1e4, ±1e30,
        everywhere and in one element) and report the ones that break the gradient.
      progress: ``progress(done, total, label)`` called during the sweep.

    Returns:
      An :class:`AuditReport`: ``report.finite``, ``report.findings``, ``print(report)``.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> def loss(x):
      ...     return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))
      >>> r = gk.audit(loss, jnp.array([0.0, 1.0, 2.0]))
      >>> r.finite, r.findings[0].op
      (False, 'log')
    """
    from gradkit._src.dispatch import override

    if table is not None:
        audited = override(fn, table)
    else:
        audited = fn
    prog = _program(audited, args, argnums)
    src = _def_source(fn)
    inputs = tuple(_describe_input(n, x) for n, x in zip(prog.names, prog.leaves))
    coverage = _coverage(prog, table) if table is not None else None
    try:
        out, grads = _grad(prog.flat(), prog.dyn())
    except GradkitError:
        raise
    except Exception as e:
        raise GradkitError(f"audit({fn_name(fn)}): the gradient could not be computed: {type(e).__name__}: "
                           f"{_one_line(str(e))}") from None
    value = _value_summary(out)
    gradients = tuple((prog.names[i], _count_nonfinite(g), int(np.size(g))) for i, g in zip(prog.diff, grads))
    findings: tuple[Finding, ...] = ()
    note = ""
    if any(bad for _, bad, _ in gradients):
        findings, note = _investigate(prog, fn, table, fix)
    probes: tuple[Probe, ...] | None = None
    n_probes = 0
    if sweep:
        probes, n_probes = _sweep(prog, progress)
    return AuditReport(fn_name(fn), src, inputs, value, gradients, findings, coverage, probes, n_probes, note)


def _one_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def _count_nonfinite(g: Any) -> int:
    a = np.asarray(g)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return 0
    if a.dtype.itemsize < 4 or a.dtype.kind == "V":
        a = a.astype(np.float32)
    return int((~np.isfinite(a)).sum())


def _value_summary(out: Sequence[np.ndarray]) -> str:
    bad = sum(_count_nonfinite(o) for o in out)
    if not bad:
        if len(out) == 1 and np.size(out[0]) == 1:
            return f"finite ({fmt(np.asarray(out[0]).reshape(-1)[0])})"
        return "finite"
    total = sum(int(np.size(o)) for o in out)
    kinds = set()
    for o in out:
        a = np.asarray(o, dtype=np.float64) if np.asarray(o).dtype.kind != "c" else np.abs(o)
        kinds |= {str(v) for v in np.unique(a[~np.isfinite(a)])}
    shown = ", ".join(sorted(kinds))
    if total == 1:
        return f"NON-FINITE ({shown})"
    return f"NON-FINITE: {shown} in {bad} of {total} elements"


def _def_source(fn: Any) -> str:
    inner = fn
    for _ in range(4):
        inner = getattr(inner, "__wrapped__", None) or getattr(inner, "_fn", None) or inner
    try:
        code = inner.__code__
        return f"{_short(code.co_filename)}:{code.co_firstlineno}"
    except AttributeError:
        return ""


def _short(path: str) -> str:
    return display_file(path)  # relative below the cwd; a Jupyter cell as `cell In[3]`, not its temp file


# --------------------------------------------------------------------------- investigation


def _investigate(prog: _Program, fn: Any, table: Any, do_fix: bool) -> tuple[tuple[Finding, ...], str]:
    flat = prog.flat()
    dyn = prog.dyn()
    closed = jax.make_jaxpr(flat)(*dyn)
    replay = Replay()
    try:
        frame = replay.forward(closed.jaxpr, closed.consts, dyn, [True] * len(dyn))
        outs = [compat.read_atom(frame.env, a) for a in closed.jaxpr.outvars]
        cts = replay.backward(frame, [(jnp.ones_like(o), frozenset()) for o in outs])
    except Exception as e:  # pragma: no cover - depends on exotic primitives
        return (), (f"the step-by-step replay stopped at an equation it cannot evaluate ({type(e).__name__}: "
                    f"{_one_line(str(e))}); run with jax.config.update('jax_debug_nans', True) to locate the NaN.")
    relevant: set[int] = set()
    for c in cts:
        if c is not None and any(nonfinite(c[0])):
            relevant |= set(c[1])
    bad_inputs = [f"{prog.names[i]} ({_count_nonfinite(x)} of {np.size(x)})" for i, x in zip(prog.diff, dyn)
                  if _count_nonfinite(x)]
    if bad_inputs and (not relevant or not births_of(replay, relevant)):
        return (), (f"the inputs are already non-finite: {', '.join(bad_inputs)}; the gradient inherits their "
                    "NaN/inf (no operation creates one). Check where these inputs come from.")
    if not relevant:
        return (), ("the gradient is non-finite under jax.jit but the eager step-by-step replay stayed finite "
                    "(XLA may fuse or reorder the computation); run with jax.config.update('jax_debug_nans', "
                    "True) and without jit to locate it.")
    births = sorted((b for b in replay.births.values() if b.key in relevant), key=lambda b: b.key)
    by_key = {b.key: b for b in births}
    roots = [b for b in births if not (b.causes & relevant)]
    findings = []
    for root in roots[:4]:
        chain = [root] + [b for b in births if b is not root and root.key in b.causes]
        steps = tuple(_step(b) for b in chain[:6])
        best, alts = _choose_fix(_suggest(root, chain, closed, by_key), prog, fn, table, closed, do_fix)
        loc = _loc(root.eqn, root.ctx)
        findings.append(Finding(root.name, loc, steps[0].where, steps[0].message, steps, best, alts))
    return tuple(findings), ""


def births_of(replay: Replay, keys: set[int]) -> list[Birth]:
    return [b for b in replay.births.values() if b.key in keys]


def _choose_fix(cands: list[_Candidate], prog: _Program, fn: Any, table: Any, closed: Any,
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
                r = _apply_fix(c, prog, fn, table, closed) if do_fix else c.fix
                results.append(r)
            elif c.table is None and (found.kind == "table" or c.patches is None):
                results.append(c.fix)  # listed as advice, not re-run
            continue
        r = _apply_fix(c, prog, fn, table, closed) if do_fix else c.fix
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


# --------------------------------------------------------------------------- describing births


def _where(ctx: Sequence[Context], iterations: Sequence[int]) -> str:
    parts = []
    loops = [x for x in ctx if x.kind in ("scan", "while")]
    for c in ctx:
        if c.kind in ("scan", "while"):
            its = sorted(iterations) if loops and c is loops[-1] else [c.index]
            name = "scan" if c.kind == "scan" else "while_loop"
            parts.append(f"inside {name} at {_loc(c.eqn)} ({_iterations(its, c.size)})")
        elif c.kind == "cond":
            parts.append(f"inside cond branch {c.index} (of {c.size}) at {_loc(c.eqn)}")
        elif c.kind == "jit" and c.name:
            parts.append(f"inside `{c.name}`")
    return ", ".join(parts)


def _iterations(its: Sequence[int], n: int) -> str:
    of = f" of {n}" if n else ""  # a while loop's trip count is not known up front
    if len(its) == 1:
        return f"iteration {its[0]}{of}"
    if n and len(its) == n:
        return f"all {n} iterations"
    if list(its) == list(range(its[0], its[-1] + 1)) and len(its) > 3:
        return f"iterations {its[0]}-{its[-1]}{of}"
    shown = ", ".join(map(str, its[:6])) + (", ..." if len(its) > 6 else "")
    return f"iterations {shown}{of}"


def _span(eqn: Any, ctx: Sequence[Context] = ()) -> tuple[str, int, str, int, int] | None:
    """The user source span of ``eqn``, else of the innermost enclosing jit/scan/cond that has one."""
    span = compat.source_span(eqn)
    for c in reversed(list(ctx)):
        if span is not None:
            break
        span = compat.source_span(c.eqn)
    return span


def _loc(eqn: Any, ctx: Sequence[Context] = ()) -> str:
    span = _span(eqn, ctx)
    return f"{_short(span[0])}:{span[1]}" if span else "unknown source line"


def _code(eqn: Any, ctx: Sequence[Context] = ()) -> str:
    span = _span(eqn, ctx)
    if not span:
        return ""
    file, line, _, c0, c1 = span
    text = linecache.getline(file, line).rstrip("\n")
    if not text:
        return ""
    out = f"{line:>5} | {text}"
    if 0 <= c0 < c1 <= len(text):
        out += "\n      | " + " " * c0 + "^" * (c1 - c0)
    return out


def _via(b: Birth) -> str:
    """The library function the op sits in: from the source stack, else the enclosing jit's name."""
    return callee(b.eqn) or next((c.name for c in reversed(b.ctx) if c.kind == "jit" and c.name), "")


def _step(b: Birth) -> Step:
    span = _span(b.eqn, b.ctx)
    file, line, func = (span[0], span[1], span[2]) if span else ("", 0, "")
    msg = _explain_forward(b) if b.phase == "forward" else _explain_backward(b)
    where = ", ".join(w for w in _where(b.ctx, b.iterations).split(", ") if not w.startswith("inside `"))
    return Step(b.name, b.phase, b.kind, file, line, func, where, msg, _code(b.eqn, b.ctx), _via(b), b.is_rule,
                b.count, b.total)


def _summ(a: np.ndarray) -> str:
    a = np.asarray(a, dtype=np.float64).reshape(-1)
    if a.size == 0:
        return "?"
    u = np.unique(a)
    if u.size == 1:
        return fmt(u[0])
    if u.size == 2:
        return f"{fmt(u[0])} or {fmt(u[1])}"
    fin = a[np.isfinite(a)]
    if fin.size == 0:
        return "non-finite"
    return f"{fmt(np.min(fin))}..{fmt(np.max(fin))}"


def _mask(a: Any, kind: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype.itemsize < 4 or a.dtype.kind == "V":
        a = a.astype(np.float32)
    return np.isnan(a) if kind == "nan" else ~np.isfinite(a)


def _at(x: Any, mask: np.ndarray) -> np.ndarray | None:
    a = np.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.number):
        return None
    try:
        return np.broadcast_to(a, mask.shape)[mask].astype(np.float64)
    except ValueError:
        return None


def _of(count: int, total: int) -> str:
    return f" for {count} of {total} elements" if total > 1 else ""


_OVERFLOW = {"exp", "exp2", "expm1", "cosh", "sinh", "pow", "integer_pow", "square", "mul", "dot_general",
             "reduce_sum", "add", "sub", "cumsum", "reduce_prod", "cumprod", "tan", "erf_inv", "lgamma", "digamma"}
_ARG_NAMES = {"atan2": ("y", "x"), "div": ("x", "y"), "pow": ("x", "y"), "mul": ("x", "y"), "sub": ("x", "y"),
              "add": ("x", "y"), "select_n": ("which", "a", "b")}
_BINARY_NAMES = {"add": "+", "sub": "-", "mul": "·", "div": "/"}


def _explain_forward(b: Birth) -> str:
    p = b.name
    bad_out = next((o for o in b.outvals if any(nonfinite(o))), b.outvals[0])
    mask = _mask(bad_out, b.kind)
    outs = _at(bad_out, mask)
    ins = [_at(x, mask) for x in b.invals]
    res = _summ(outs) if outs is not None else ("NaN" if b.kind == "nan" else "inf")
    n = _of(int(mask.sum()), int(mask.size))
    x0 = ins[0] if ins else None
    if b.kind == "inf":
        if p in ("log", "log1p", "log2", "log10") and x0 is not None:
            return f"`{p}` of {_summ(x0)} gave {res}{n}"
        if p in ("div", "rem") and len(ins) == 2 and ins[1] is not None and ins[0] is not None:
            return f"`{p}` by zero gave {res}{n} (numerator {_summ(ins[0])}, denominator {_summ(ins[1])})"
        if p in _OVERFLOW:
            big = [np.max(np.abs(v)) for v in ins if v is not None and v.size]
            shown = (f"max input {fmt(max(float(np.max(v)) for v in ins if v is not None and v.size))}"
                     if p in ("exp", "exp2", "expm1") else f"largest input magnitude {fmt(max(big))}") if big else ""
            return f"`{p}` overflowed to {res}{n}" + (f" ({shown})" if shown else "")
        if p in ("rsqrt", "reciprocal", "digamma", "lgamma", "tan") and x0 is not None:
            return f"`{p}` of {_summ(x0)} gave {res}{n}"
        vals = ", ".join(_summ(v) for v in ins if v is not None)
        return f"`{p}` of finite inputs ({vals}) gave {res}{n}"
    # NaN
    if len(ins) == 2 and ins[0] is not None and ins[1] is not None and p in _BINARY_NAMES:
        a, c = ins
        if p == "mul":
            return f"`mul` 0·inf gave NaN{n} ({_summ(a)} · {_summ(c)})"
        if p in ("add", "sub"):
            return f"`{p}` inf {_BINARY_NAMES[p]} inf of opposite signs gave NaN{n} ({_summ(a)} {_BINARY_NAMES[p]} {_summ(c)})"
        if p == "div":
            kind = "0/0" if np.all(a == 0) and np.all(c == 0) else ("inf/inf" if np.all(np.isinf(a)) else "")
            return f"`div` {kind} gave NaN{n} (numerator {_summ(a)}, denominator {_summ(c)})".replace("` ", "` ", 1).replace("`div`  ", "`div` ")
    if p in ("sqrt", "log", "log1p", "rsqrt", "pow", "acos", "asin", "acosh", "atanh", "lgamma") and x0 is not None:
        return f"`{p}` of {_summ(x0)} (outside its domain) gave NaN{n}"
    vals = ", ".join(_summ(v) for v in ins if v is not None)
    return f"`{p}` gave NaN{n} (inputs there: {vals})"


def _explain_backward(b: Birth) -> str:
    p = b.name
    if b.is_rule:
        return f"the table's rule for `{p}` returned a non-finite cotangent" + _rule_detail(b)
    in_cts = b.in_cts or []
    k = next((j for j, g in enumerate(in_cts) if g is not None and _mask(g, b.kind).any()), None)
    res = "NaN" if b.kind == "nan" else "inf"
    if k is None:
        return f"backward of `{p}` gave {res}"
    g = np.asarray(in_cts[k])
    mask = _mask(g, b.kind)
    n = _of(int(mask.sum()), int(mask.size))
    x = np.asarray(b.invals[k])
    xs = _at(x, mask) if x.shape == g.shape else None
    names = _ARG_NAMES.get(p, ("x", "y", "z"))
    argname = "x" if len(b.invals) == 1 else (names[k] if k < len(names) else f"input {k}")
    at = ""
    if len(b.invals) == 1 and xs is not None:
        at = f"x = {_summ(xs)}"
    elif all(np.shape(v) in (g.shape, ()) for v in b.invals):
        vals = [_at(v, mask) for v in b.invals]
        if all(v is not None for v in vals):
            shown = [names[j] if j < len(names) else f"in{j}" for j in range(len(vals))]
            at = f"({', '.join(shown)}) = (" + ", ".join(_summ(v) for v in vals) + ")"
    out_ct = b.out_cts[0] if b.out_cts and len(b.out_cts) == 1 else None
    elementwise = (out_ct is not None and np.shape(out_ct) == g.shape and len(b.outvals) == 1
                   and not compat.has_subjaxprs(b.eqn))
    if elementwise:
        ct = _at(out_ct, mask)
        partial = _partial(b, k, mask)
        if partial is not None and ct is not None:
            return (f"backward of `{p}`: cotangent {_summ(ct)} × ∂{p}/∂{argname} = {_summ(partial)}"
                    + (f" (at {at})" if at else "") + f" gave {res}{n}")
    return f"backward of `{p}` gave {res}{n} from finite cotangents" + (f" (at {at})" if at else "")


def _rule_detail(b: Birth) -> str:
    k = next((j for j, g in enumerate(b.in_cts or []) if g is not None and _mask(g, b.kind).any()), None)
    if k is None:
        return ""
    g = np.asarray(b.in_cts[k])
    mask = _mask(g, b.kind)
    x = _at(b.invals[k], mask) if np.shape(b.invals[k]) == g.shape else None
    ct = _at(b.out_cts[0], mask) if b.out_cts and np.shape(b.out_cts[0]) == g.shape else None
    parts = [f"{'NaN' if b.kind == 'nan' else 'inf'}{_of(int(mask.sum()), int(mask.size))}"]
    if x is not None:
        parts.append(f"at x = {_summ(x)}")
    if ct is not None:
        parts.append(f"incoming cotangent {_summ(ct)}")
    return " (" + ", ".join(p.strip() for p in parts) + ")"


def _partial(b: Birth, k: int, mask: np.ndarray) -> np.ndarray | None:
    invals = list(b.invals)

    def f(v: Any) -> Any:
        vals = list(invals)
        vals[k] = v
        return compat.bind(b.eqn, vals)[0]
    try:
        x = jnp.asarray(invals[k])
        _, t = jax.jvp(f, (x,), (jnp.ones_like(x),))
        return _at(t, mask)
    except Exception:
        return None


# --------------------------------------------------------------------------- fixes


@dataclasses.dataclass
class _Candidate:
    """A fix to try: a table (applied with override) or a patch of the traced program."""

    fix: Fix
    table: Any = None
    patches: dict[int, Callable[..., list[Any]]] | None = None


def _library_table(name: str) -> Any:
    try:
        from gradkit import tables  # noqa: PLC0415 - the rule library is optional at import time
    except Exception:
        return None
    return getattr(tables, name, None)


def _stable_fn(*names: str) -> tuple[str, Callable[..., Any] | None]:
    try:
        from gradkit import stable  # noqa: PLC0415
    except Exception:
        stable = None
    for n in names:
        f = getattr(stable, n, None) if stable is not None else None
        if callable(f):
            return f"gradkit.stable.{n}", f
    return f"gradkit.stable.{names[0]}", None


def _producer(jaxpr: Any, var: Any) -> Any:
    if compat.is_literal(var):
        return None
    for e in jaxpr.eqns:
        if var in e.outvars:
            return e
    return None


def _consumers(jaxpr: Any, eqn: Any) -> list[Any]:
    outs = set(v for v in eqn.outvars)
    return [e for e in jaxpr.eqns if any((not compat.is_literal(a)) and a in outs for a in e.invars)]


def _find_jaxpr(jaxpr: Any, eqn: Any) -> Any:
    """The (sub-)jaxpr that holds ``eqn``."""
    if any(e is eqn for e in jaxpr.eqns):
        return jaxpr
    for e in jaxpr.eqns:
        for _, sub in compat.jaxpr_params(e.params):
            for j in sub if isinstance(sub, tuple) else (sub,):
                found = _find_jaxpr(getattr(j, "jaxpr", j), eqn)
                if found is not None:
                    return found
    return None


def _is_one(atom: Any) -> bool:
    return compat.is_literal(atom) and np.all(np.asarray(atom.val) == 1)


_PRIM_FIX = {  # singular primitive -> (stable function, what it does there)
    "log": ("safe_log", "log(max(x, tiny)): equal to log on every normal positive input, derivative 0 at 0"),
    "sqrt": ("safe_sqrt", "equal to sqrt for x > 0, with derivative 0 at 0"),
    "div": ("safe_div", "x / y, and 0 with zero derivatives where y == 0"),
    "pow": ("safe_pow", "x ** y with finite derivatives at x = 0"),
    "atan2": ("safe_arctan2", "arctan2 with gradient 0 at the origin"),
}
_CALLEE_FIX = {  # library function the user called -> stable replacement
    "logsumexp": "logsumexp", "norm": "safe_norm", "arctan2": "safe_arctan2", "sqrt": "safe_sqrt",
    "hypot": "hypot", "xlogy": "xlogy", "power": "safe_pow", "divide": "safe_div", "true_divide": "safe_div",
    "log_softmax": "log_softmax", "softmax": "softmax", "normalize": "normalize",
}


def callee(eqn: Any) -> str:
    """The library function (``logsumexp``, ``norm``) the user's line called to make ``eqn``, or ""."""
    c = compat.library_callee(eqn)
    if c is None:
        return ""
    name = c[1].split(".")[-1]
    if name.startswith("_") or name == eqn.primitive.name or name in ("<lambda>", "<module>"):
        return ""
    return name


def _suggest(root: Birth, chain: Sequence[Birth], closed: Any, by_key: dict[int, Birth]) -> list[_Candidate]:
    """Candidate fixes for a finding, most specific first; the first that verifies is shown."""
    p = root.name
    if root.is_rule:
        return [_Candidate(Fix("code", "rule", (
            f"the rule table's rule for `{p}` returns a NaN/inf cotangent here: guard its arithmetic (a double "
            f"where on the singular inputs), or check it with gk.check_grads / gk.compare."),
            note="the rule itself needs a change"))]
    eqn = root.eqn
    jaxpr = _find_jaxpr(closed.jaxpr, eqn)
    line = _loc(eqn, root.ctx)
    cands: list[_Candidate] = []
    names_in_chain = [p] + sorted({b.name for b in chain} - {p})
    zero_ct = _zero_cotangent(chain)
    via = _via(root)

    # 1. Expressions with a stable counterpart, rewritten in the traced program.
    if p == "exp" and jaxpr is not None:
        for c in _consumers(jaxpr, eqn):
            if c.primitive.name == "log1p":
                cands.append(_log1pexp_patch(eqn, c, "log1p(exp(x))", line))
            elif c.primitive.name == "add" and any(_is_one(a) for a in c.invars):
                for d in _consumers(jaxpr, c):
                    if d.primitive.name == "log":
                        cands.append(_log1pexp_patch(eqn, d, "log(1 + exp(x))", line))
            elif c.primitive.name == "reduce_sum":
                for d in _consumers(jaxpr, c):
                    if d.primitive.name == "log":
                        cands.append(_logsumexp_patch(eqn, c, d, line))
        if not cands:
            cands.append(_Candidate(Fix("code", "gradkit.stable", (
                f"`exp` overflows above 88.7 in float32 at {line}: rewrite the expression so that exp is only "
                "taken of non-positive numbers (gk.stable.log1pexp, gk.stable.logsumexp, gk.stable.softmax)."),
                note="no automatic rewrite for this expression")))
    if p == "sqrt" and jaxpr is not None:
        src = _producer(jaxpr, eqn.invars[0])
        if src is not None and src.primitive.name == "reduce_sum":
            base = _square_base(_producer(jaxpr, src.invars[0]))
            if base is not None:
                cands.append(_safe_norm_patch(eqn, src, base, line, via))
    # 2. The library function the user called has a stable twin (same signature).
    if via in _CALLEE_FIX and not any(c.fix.name.endswith(_CALLEE_FIX[via]) for c in cands):
        name, f = _stable_fn(_CALLEE_FIX[via])
        if f is not None:
            cands.append(_Candidate(Fix("code", name, (
                f"replace `{via}` at {line} with `{_gk(name)}` (same arguments): "
                + _first_doc_line(f)), note="a code change: audit re-runs the gradient with the equivalent "
                                          "rule below")))
    # 3. Rule tables that cover an op of the chain (a where-guarded singular op, …).
    for tname in ("SAFE", "STABLE"):
        tbl = _library_table(tname)
        covered = [n for n in names_in_chain if tbl is not None and n in tbl]
        if tbl is None and tname == "SAFE" and zero_ct and p in _PRIM_FIX:
            cands.append(_Candidate(Fix("table", f"gradkit.tables.{tname}", (
                f"apply gk.tables.{tname} with gk.override(fn, gk.tables.{tname}): its `{p}` rule gives "
                "a zero gradient where the incoming cotangent is zero (the where-guard case)."),
                note="gradkit.tables is not importable here")))
        elif covered:
            cands.append(_Candidate(Fix("table", f"gradkit.tables.{tname}", (
                f"apply gk.tables.{tname} with gk.override(fn, gk.tables.{tname}): its rule"
                f"{'s' if len(covered) > 1 else ''} for {', '.join('`' + n + '`' for n in covered)} replace"
                f"{'' if len(covered) > 1 else 's'} the derivative that blows up here (no code change).")),
                table=tbl))
    # 4. The singular primitive itself, replaced by its safe twin.
    for b in [root] + [b for b in chain if b is not root]:
        if b.name in _PRIM_FIX and jaxpr is not None:
            name, f = _stable_fn(_PRIM_FIX[b.name][0])
            if f is not None:
                cands.append(_prim_patch(b.eqn, name, f, _PRIM_FIX[b.name][1], _loc(b.eqn, b.ctx)))
                break
    if zero_ct and p in _PRIM_FIX and not via:
        cands.append(_Candidate(Fix("code", "double where", (
            f"or guard the input as well as the output at {line} (the 'double where'): "
            f"jnp.where(ok, {p}(jnp.where(ok, x, safe_value)), fallback), so the unused branch never sees "
            "the singular value."), note="a code change")))
    patched = {c.fix.name for c in cands if c.patches is not None}
    cands = [c for c in cands if c.patches is not None or c.table is not None or c.fix.name not in patched]
    if not cands:
        cands.append(_Candidate(Fix("code", "", (
            f"no known rule fixes `{p}` here: check the inputs that reach {line} (values above), or "
            "write a gk.vjp_rule for it."), note="no known fix")))
    return cands


def _gk(name: str) -> str:
    """``gradkit.stable.x`` as users write it: ``gk.stable.x``."""
    return "gk." + name[len("gradkit."):] if name.startswith("gradkit.") else name


def _first_doc_line(f: Any) -> str:
    doc = (getattr(f, "__doc__", None) or "").strip().splitlines()
    return doc[0].strip().replace("``", "`") if doc else ""


def _prim_patch(eqn: Any, name: str, f: Callable[..., Any], what: str, line: str) -> _Candidate:
    atoms = list(eqn.invars)
    via = callee(eqn)
    shown = via if via and _CALLEE_FIX.get(via) == name.split(".")[-1] else eqn.primitive.name

    def patch(read: Callable[[Any], Any]) -> list[Any]:
        return [f(*[read(a) for a in atoms])]
    return _Candidate(Fix("code", name, f"replace `{shown}` at {line} with `{_gk(name)}` ({what})."),
                      patches={id(eqn): patch})


def _zero_cotangent(chain: Sequence[Birth]) -> bool:
    """The backward birth multiplies a zero cotangent by an infinite derivative (0·inf)."""
    for b in chain:
        if b.phase == "backward" and b.out_cts:
            k = next((j for j, g in enumerate(b.in_cts or []) if g is not None and _mask(g, b.kind).any()), None)
            if k is None:
                continue
            mask = _mask(b.in_cts[k], b.kind)
            ct = b.out_cts[0]
            if np.shape(ct) == mask.shape:
                v = _at(ct, mask)
                if v is not None and v.size and np.all(v == 0):
                    return True
    return False


def _square_base(eqn: Any) -> Any:
    if eqn is None:
        return None
    n = eqn.primitive.name
    if n == "integer_pow" and eqn.params.get("y") == 2:
        return eqn.invars[0]
    if n == "square":
        return eqn.invars[0]
    if n == "mul" and eqn.invars[0] is eqn.invars[1]:
        return eqn.invars[0]
    return None


def _log1pexp_patch(exp_eqn: Any, target: Any, how: str, line: str) -> _Candidate:
    name, f = _stable_fn("log1pexp", "softplus")
    if f is None:
        name, f = "jax.nn.softplus", jax.nn.softplus
    x_atom = exp_eqn.invars[0]

    def patch(read: Callable[[Any], Any]) -> list[Any]:
        return [f(read(x_atom))]
    return _Candidate(Fix("code", name, f"replace `{how}` at {line} with `{_gk(name)}(x)`: it never evaluates exp "
                                        "of a large number, and its derivative is sigmoid(x)."),
                      patches={id(target): patch})


def _logsumexp_patch(exp_eqn: Any, sum_eqn: Any, log_eqn: Any, line: str) -> _Candidate:
    name, f = _stable_fn("logsumexp")
    if f is None:
        name, f = "jax.nn.logsumexp", jax.nn.logsumexp
    x_atom = exp_eqn.invars[0]
    axes = tuple(sum_eqn.params.get("axes", ()))

    def patch(read: Callable[[Any], Any]) -> list[Any]:
        return [f(read(x_atom), axis=axes)]
    return _Candidate(Fix("code", name, f"replace `log(sum(exp(x)))` at {line} with `{_gk(name)}(x, axis={axes})`."),
                      patches={id(log_eqn): patch})


def _safe_norm_patch(sqrt_eqn: Any, sum_eqn: Any, base: Any, line: str, via: str) -> _Candidate:
    name, f = _stable_fn("safe_norm")
    fn = f if f is not None else _fallback_safe_norm
    axes = tuple(sum_eqn.params.get("axes", ()))
    axis = axes[0] if len(axes) == 1 else axes
    what = f"`{via}`" if via else "`sqrt(sum(x**2))`"

    def patch(read: Callable[[Any], Any]) -> list[Any]:
        return [fn(read(base), axis=axis)]
    return _Candidate(Fix("code", name, f"replace {what} at {line} with `{_gk(name)}(x, axis={axis})`: its gradient "
                                        "at x = 0 is 0 instead of NaN."), patches={id(sqrt_eqn): patch})


def _fallback_safe_norm(x: jax.Array, axis: Any) -> jax.Array:
    sq = jnp.sum(x * x, axis=axis)
    ok = sq > 0
    return jnp.where(ok, jnp.sqrt(jnp.where(ok, sq, 1.0)), 0.0)


class _Patcher:
    """Evaluates a jaxpr with some equations replaced (at any depth)."""

    def __init__(self, patches: dict[int, Callable[..., list[Any]]]):
        self.patches = patches
        self._needs: dict[int, bool] = {}

    def needs(self, jaxpr: Any) -> bool:
        j = getattr(jaxpr, "jaxpr", jaxpr)
        hit = self._needs.get(id(j))
        if hit is None:
            hit = any(id(e) in self.patches or any(
                self.needs(s) for _, sub in compat.jaxpr_params(e.params)
                for s in (sub if isinstance(sub, tuple) else (sub,))) for e in j.eqns)
            self._needs[id(j)] = hit
        return hit

    def eval(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        env.update(zip(jaxpr.invars, args))
        read = lambda a: compat.read_atom(env, a)  # noqa: E731
        for eqn in jaxpr.eqns:
            if id(eqn) in self.patches:
                with compat.source_of(eqn):
                    outs = self.patches[id(eqn)](read)
                outs = [jnp.asarray(o).astype(v.aval.dtype).reshape(v.aval.shape) for o, v in zip(outs, eqn.outvars)]
            elif compat.has_subjaxprs(eqn) and not compat.is_custom_derivative(eqn) and any(
                    self.needs(s) for _, sub in compat.jaxpr_params(eqn.params)
                    for s in (sub if isinstance(sub, tuple) else (sub,))):
                params = dict(eqn.params)
                for key, sub in compat.jaxpr_params(eqn.params):
                    params[key] = tuple(map(self._rewrite, sub)) if isinstance(sub, tuple) else self._rewrite(sub)
                outs = compat.bind(eqn, [read(a) for a in eqn.invars], params)
            else:
                outs = compat.bind(eqn, [read(a) for a in eqn.invars])
            env.update(zip(eqn.outvars, outs))
        return [read(a) for a in jaxpr.outvars]

    def _rewrite(self, j: Any) -> Any:
        if not self.needs(j):
            return j
        is_closed = isinstance(j, compat.ClosedJaxpr)
        inner = j.jaxpr if is_closed else j
        consts = j.consts if is_closed else ()
        structs = [compat.aval_struct(v.aval) for v in inner.invars]
        new = compat.trace(lambda *xs: self.eval(inner, consts, xs), structs)
        return new if is_closed else new.jaxpr


def _apply_fix(cand: _Candidate, prog: _Program, fn: Any, table: Any, closed: Any) -> Fix:
    from gradkit._src.dispatch import override

    fx = cand.fix
    if cand.table is None and cand.patches is None:
        return fx
    try:
        if cand.table is not None:
            tbl = cand.table if table is None else (table | cand.table)
            fixed_flat = prog.flat(override(fn, tbl))
        else:
            patcher = _Patcher(cand.patches or {})
            fixed_flat = lambda *d: patcher.eval(closed.jaxpr, closed.consts, d)  # noqa: E731
        _, grads = _grad(fixed_flat, prog.dyn())
    except Exception as e:
        return dataclasses.replace(fx, applied=False, note=f"re-run failed: {type(e).__name__}: {_one_line(str(e))}")
    finite = all(_count_nonfinite(g) == 0 for g in grads)
    if not finite:
        bad = sum(_count_nonfinite(g) for g in grads)
        return dataclasses.replace(fx, applied=True, finite=False, note=f"{bad} element(s) still non-finite")
    matches, rel, compared, excluded, note = _fd_check(prog, grads)
    return dataclasses.replace(fx, applied=True, finite=True, matches_fd=matches, max_rel_err=rel,
                               compared=compared, excluded=excluded, note=note)


# --------------------------------------------------------------------------- float64 finite differences


def _fd_check(prog: _Program, grads: Sequence[np.ndarray], max_coords: int = 256
              ) -> tuple[bool | None, float | None, int, int, str]:
    """Compares ``grads`` with central differences of the original function in float64.

    Elements where finite differences are undefined are left out: the one-sided
    differences disagree (a kink or a jump), or a value is non-finite.
    """
    from gradkit._src.check import select_coords

    compared = excluded = 0
    worst = 0.0
    ok = True
    try:
        with jax.enable_x64(True):
            leaves64 = [to_f64(x) for x in prog.leaves]
            prog64 = dataclasses.replace(prog, leaves=leaves64)
            flat64 = prog64.flat()

            def total(*d: Any) -> jax.Array:
                return sum(jnp.sum(o.astype(jnp.float64)) for o in flat64(*d))

            dyn64 = prog64.dyn()
            for pos, (x, g) in enumerate(zip(dyn64, grads)):
                x = jnp.asarray(x)
                coords = select_coords(x.size, max_coords)
                h = 1e-6 * np.maximum(1.0, np.abs(np.asarray(x).reshape(-1)[coords]))
                basis = np.zeros((len(coords), x.size))
                basis[np.arange(len(coords)), coords] = h
                basis = jnp.asarray(basis.reshape((len(coords),) + x.shape))

                def at(xs: jax.Array, pos: int = pos) -> jax.Array:
                    def one(v: jax.Array) -> jax.Array:
                        d = list(dyn64)
                        d[pos] = v
                        return total(*d)
                    return jax.vmap(one)(xs)

                m = len(coords)
                vals = np.asarray(jax.jit(at)(jnp.concatenate([x[None] + basis, x[None] - basis, x[None]])))
                fp, fm, f0 = vals[:m], vals[m:2 * m], float(vals[-1])
                with np.errstate(invalid="ignore", over="ignore"):
                    central = (fp - fm) / (2 * h)
                    right = (fp - f0) / h
                    left = (f0 - fm) / h
                    kink = np.abs(right - left) > 1e-2 * (np.abs(central) + 1e-3 * np.nanmax(
                        np.abs(np.where(np.isfinite(central), central, 0.0)), initial=0.0) + 1e-12)
                usable = np.isfinite(central) & np.isfinite(right) & np.isfinite(left) & ~kink
                gv = np.asarray(g, dtype=np.float64).reshape(-1)[coords]
                excluded += int((~usable).sum())
                compared += int(usable.sum())
                if not usable.any():
                    continue
                c, gu = central[usable], gv[usable]
                rtol = _GRAD_RTOL.get(np.dtype(np.asarray(g).dtype), 2e-3)
                atol = 0.1 * rtol * float(np.max(np.abs(c)))
                with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                    err = np.abs(gu - c)
                    ok &= bool(np.all(err <= atol + rtol * np.abs(c)))
                    rel = np.where(err == 0, 0.0, err / np.maximum(np.abs(c), max(atol / rtol, 1e-300)))
                worst = max(worst, float(np.max(rel)))
    except Exception as e:
        return None, None, compared, excluded, f"finite differences in float64 failed: {type(e).__name__}: {_one_line(str(e))}"
    if compared == 0:
        return None, None, 0, excluded, "no element where finite differences are defined"
    return ok, worst, compared, excluded, ""


# --------------------------------------------------------------------------- coverage


def _coverage(prog: _Program, table: Any) -> Coverage:
    from gradkit._src.dispatch import Rewriter, _as_table

    tbl = _as_table(table)
    counts: dict[str, int] = {}
    inner = getattr(prog.fn, "_fn", prog.fn)
    plain = dataclasses.replace(prog, fn=inner)
    closed = jax.make_jaxpr(plain.flat())(*prog.dyn())

    def on_match(name: str, eqn: Any) -> None:
        counts[name] = counts.get(name, 0) + 1

    rw = Rewriter(tbl, on_match=on_match)
    structs = [compat.aval_struct(v.aval) for v in closed.jaxpr.invars]
    compat.trace(lambda *xs: rw.eval(closed.jaxpr, closed.consts, xs), structs)
    fired = tuple(sorted(counts.items()))
    never = tuple(sorted(n for n in tbl.names() if n not in counts))
    return Coverage(len(tbl), fired, never)


# --------------------------------------------------------------------------- sweep

_EDGE = [("0", 0.0), ("1e-30", 1e-30), ("-1e-30", -1e-30), ("1", 1.0), ("-1", -1.0), ("100", 100.0),
         ("-100", -100.0), ("1e4", 1e4), ("-1e4", -1e4), ("1e30", 1e30), ("-1e30", -1e30)]


def _sweep(prog: _Program, progress: Callable[[int, int, str], None] | None) -> tuple[tuple[Probe, ...], int]:
    flat = prog.flat()

    def run(*d: Any) -> tuple[Any, Any]:
        out, vjp = jax.vjp(flat, *d)
        g = vjp([jnp.ones_like(o) for o in out])
        fin = lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))  # noqa: E731
        return fin(out), fin(g)
    run_j = jax.jit(run)
    plan = []
    for pos, i in enumerate(prog.diff):
        x = np.asarray(prog.leaves[i])
        for label, v in _EDGE:
            if float(jnp.finfo(x.dtype).max) < abs(v):
                continue
            everywhere = " (all elements)" if x.size > 1 else ""
            plan.append((pos, f"{prog.names[i]} = {label}{everywhere}", np.full(x.shape, v, x.dtype)))
            if x.size > 1:
                one = x.copy()
                one.reshape(-1)[0] = v
                plan.append((pos, f"{prog.names[i]}{_first(x.shape)} = {label} (one element)", one))
    broken = []
    dyn = prog.dyn()
    for k, (pos, label, val) in enumerate(plan):
        if progress is not None:
            progress(k, len(plan), label)
        d = list(dyn)
        d[pos] = jnp.asarray(val)
        vf, gf = run_j(*d)
        if not bool(gf):
            broken.append((pos, label, d, bool(vf)))
    if progress is not None:
        progress(len(plan), len(plan), "done")
    probes = []
    for pos, label, d, vf in broken:
        op = loc = ""
        if len(probes) < 8:  # locate the first few; the rest are listed
            try:
                leaves = list(prog.leaves)
                for i, x in zip(prog.diff, d):
                    leaves[i] = x
                findings, _ = _investigate(dataclasses.replace(prog, leaves=leaves), prog.fn, None, False)
                if findings:
                    op, loc = findings[0].op, findings[0].location
            except Exception:
                pass
        probes.append(Probe(prog.names[prog.diff[pos]], label, vf, False, op, loc))
    return tuple(probes), len(plan)


def _first(shape: tuple[int, ...]) -> str:
    return "[" + ",".join("0" for _ in shape) + "]"


# --------------------------------------------------------------------------- rendering


def _wrap(lines: list[str], width: int = 110) -> list[str]:
    """Wraps long report lines under their text column (code excerpts are left as they are)."""
    out = []
    for ln in lines:
        if len(ln) <= width or not ln.startswith(" ") or re.match(r"^\s+(\d+ )?\| ", ln):
            out.append(ln)
            continue
        col = 19
        out += textwrap.wrap(ln, width=width, subsequent_indent=" " * col, break_on_hyphens=False,
                             break_long_words=False) or [ln]
    return out


def render(r: AuditReport) -> str:
    """The human-readable report (what ``print(report)`` and ``gradkit audit`` show)."""
    status = "ok" if r.ok else ("FINDING" if not r.finite else "SWEEP FINDING")
    head = f"{r.function}({', '.join(r.inputs)})"
    lines = [f"{status:<8} {head}" + (f"   [{r.source}]" if r.source else "")]
    ind = " " * 9
    lines.append(f"{ind}value     {r.value}")
    if r.finite:
        lines.append(f"{ind}gradient  finite for every input")
    else:
        bad = [f"{n} ({b} of {s})" for n, b, s in r.gradients if b]
        lines.append(f"{ind}gradient  non-finite in {', '.join(bad)}")
    for k, f in enumerate(r.findings):
        tag = f"finding {k + 1}" if len(r.findings) > 1 else "born at"
        root = f.root
        via = f" in `{root.via}`" if root.via else ""
        phase = f"{root.phase} pass" + (" of the table's rule" if root.rule else "")
        lines.append(f"{ind}{tag:<9} {root.location}  `{root.op}`{via} ({phase})"
                     + (f", {root.where}" if root.where else ""))
        lines.append(f"{ind}          {root.message}")
        if root.code:
            lines += [f"{ind}          {ln}" for ln in root.code.splitlines()]
        for s in f.chain[1:]:
            lines.append(f"{ind}then      {s.location}  {s.message}" + (f", {s.where}" if s.where and s.where != root.where else ""))
        if f.fix is not None:
            lines.append(f"{ind}fix       {f.fix.advice}")
            lines.append(f"{ind}re-run    {f.fix.verdict()}")
        for a in f.alternatives:
            if a.verified:
                lines.append(f"{ind}also      {_gk(a.name)} (re-run: finite, matches finite differences)")
            elif a.kind == "code" and not a.applied:
                advice = a.advice[0].lower() + a.advice[1:] if a.advice.startswith("Or") else a.advice
                lines.append(f"{ind}also      {'' if advice.startswith('or ') else 'or '}{advice}")
    if r.note:
        lines.append(f"{ind}note      {r.note}")
    if r.coverage is not None:
        lines.append(f"{ind}rules     {r.coverage}")
    if r.sweep is not None:
        if not r.sweep:
            lines.append(f"{ind}sweep     {r.probes} edge-value probes: gradient finite for all")
        else:
            lines.append(f"{ind}sweep     {len(r.sweep)} of {r.probes} edge-value probes break the gradient:")
            for p in r.sweep[:12]:
                where = f" -> `{p.op}` at {p.location}" if p.op else ""
                val = "" if p.value_finite else " (value non-finite too)"
                lines.append(f"{ind}            {p.probe}{val}{where}")
            if len(r.sweep) > 12:
                lines.append(f"{ind}            ... and {len(r.sweep) - 12} more")
    return "\n".join(_wrap(lines))
