"""``audit``: where in the backward pass is a NaN or inf born, and what fixes it.

The gradient (reverse mode, cotangent 1 for every output) is first computed
as JAX computes it. If it is finite, that is the answer. Otherwise the
program is replayed equation by equation (:mod:`gradkit._src.audit.replay.replay`), and
each non-finite gradient element is traced back, element by element, to the
equation where its NaN or inf was born: the primitive, the user's file and
line, the elements and the forward values there, and the scan/cond it sits
in (:mod:`~gradkit._src.audit.explain`). A fix — a rule table or a stable
function — is suggested, applied and checked: is the gradient finite now,
and does it match float64 finite differences
(:mod:`~gradkit._src.audit.fixes`)?

With ``table=``, the audit also says which of the table's rules fired and
which never matched; with ``sweep=True`` it probes every array input: edge
values for floats, mask patterns for bools, index extremes for integers
(:mod:`~gradkit._src.audit.sweep`). The report types and their rendering are
in :mod:`~gradkit._src.audit.report`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.activity import call_body
from gradkit._src.audit.explain import Selection, loc, nonfinite_indices, select, step
from gradkit._src.audit.fixes import Table, choose_fix, suggest
from gradkit._src.audit.program import Program, describe_input, gradient, make_program
from gradkit._src.audit.provenance import AtomKey, Label, Provenance
from gradkit._src.audit.replay.leaf import mask_of
from gradkit._src.audit.replay.replay import Birth, Replay
from gradkit._src.audit.report import AuditReport, Coverage, Finding, Fix, Probe, Step
from gradkit._src.audit.sweep import sweep as run_sweep
from gradkit._src.audit.user_terms import fix_file, in_user_terms
from gradkit._src.checks.describe import count_nonfinite, def_source, fmt, fmt_index, fn_name, one_line
from gradkit._src.core import walk
from gradkit._src.core.dispatch import op_name, override
from gradkit._src.core.table import RuleTable
from gradkit._src.errors import GradkitError

__all__ = ["AuditReport", "Finding", "Step", "Fix", "Coverage", "Probe", "audit"]

_FINDINGS = 4  # independent birth places reported
_CHAIN = 6  # steps per finding


def audit(fn: Callable[..., object], *args: object, table: Table | None = None,
          argnums: int | Sequence[int] | None = None, fix: bool = True, sweep: bool = False,
          progress: Callable[[int, int, str], None] | None = None) -> AuditReport:
    """Finds where a non-finite gradient of ``fn`` is born, and what fixes it.

    The gradient of the sum of ``fn``'s outputs with respect to every
    floating-point input (or ``argnums``) is computed as ``jax.grad`` would. If
    it holds a NaN or inf, the program is replayed equation by equation —
    through ``jit``, ``scan`` iterations and ``cond`` branches — and each
    non-finite element is traced back to the equation and the elements where
    it was born: the primitive, the source line, the forward values that
    caused it ("``exp`` overflowed to inf for 3 of 128 elements, max input
    100", at ``x[7] = 95, x[40] = 100…``), and the chain that followed ("then
    0·inf = NaN in the backward of ``exp``"). A fix is suggested — a rule
    table or a stable function — applied, and checked: finite now, and equal
    to float64 finite differences?

    Inputs: every floating-point and complex input is differentiated, the
    rest is held. A complex input gets the gradient ``jax.grad`` gives a real
    loss of it; a complex output is audited through its real part (the
    cotangent of each output element is 1, which for a holomorphic function
    is ``jax.grad(..., holomorphic=True)``): audit ``jnp.imag(fn(...))`` for
    the imaginary part. PRNG keys (``jax.random.key`` or raw ``uint32``
    ``PRNGKey``) are held inputs like any other: the random ops replay. A
    NaN or inf that arrives in an input, differentiated or held (a bad
    batch), is named with its elements as the origin of the non-finite
    gradient elements it reaches (``report.note``), not as a birth.

    Args:
      fn: a function of arrays (pytrees allowed).
      *args: the inputs to audit at.
      table: a rule table to audit ``gk.override(fn, table)`` with; the report
        then says which rules fired and which never matched.
      argnums: which positional arguments to differentiate (default: every
        floating-point or complex one).
      fix: apply each suggested fix and re-check (finite, finite differences).
      sweep: also probe every array input (floats: 0, ±1e-30, ±1, ±100, ±1e4,
        ±1e30, everywhere and in one element; bool masks: all False/True, a row
        all False/True, one True per row; integers: 0, the maximum seen, -1, a
        repeated index, the dtype's extremes; at most 64 probes in all) and
        report the ones that break the gradient. ``report.ok`` is False while
        an array input was left unvaried (``report.unswept``).
      progress: ``progress(done, total, label)`` called during the sweep.

    Returns:
      An :class:`AuditReport`: ``report.finite``, ``report.findings``, ``print(report)``.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> def loss(x):
      ...     return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))
      >>> r = gk.audit(loss, jnp.array([-1.0, 0.0, 2.0]))
      >>> r.finite, r.findings[0].op, str(r.findings[0].root.elements[0])
      (False, 'log', 'x[1] = 0')
    """
    audited = override(fn, table) if table is not None else fn
    prog = make_program(audited, args, argnums)
    inputs = tuple(describe_input(n, x) for n, x in zip(prog.names, prog.leaves()))
    coverage = _coverage(prog.with_fn(fn), table) if table is not None else None
    try:
        out, grads = gradient(prog.flat(), prog.dyn)
    except GradkitError:
        raise
    except Exception as e:
        raise GradkitError(f"audit({fn_name(fn)}): the gradient could not be computed: {type(e).__name__}: "
                           f"{one_line(str(e))}") from None
    gradients = tuple((n, count_nonfinite(g), int(np.size(g))) for n, g in zip(prog.dyn_names, grads))
    at = tuple((n, nonfinite_indices(g)) for n, g in zip(prog.dyn_names, grads) if count_nonfinite(g))
    findings: tuple[Finding, ...] = ()
    note = ""
    if at:
        findings, note = investigate(prog, fn, table, fix)
    elif any(count_nonfinite(o) for o in out):
        bad = _BadInputs(prog)
        if bad.bad:
            note = (f"the value is non-finite and so are the inputs: {bad.listing()}; the gradient stayed "
                    "finite. Check where these inputs come from.")
    probes: tuple[Probe, ...] | None = None
    n_probes = 0
    if sweep:
        probes, n_probes = run_sweep(prog, progress, lambda p: investigate(p, fn, None, False)[0])
    return AuditReport(fn_name(fn), def_source(fn), inputs, _value_summary(out), gradients, findings, coverage,
                       probes, n_probes, note, nonfinite_at=at)


def _value_summary(out: Sequence[np.ndarray]) -> str:
    bad = sum(count_nonfinite(o) for o in out)
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


# --------------------------------------------------------------------------- investigation


def investigate(prog: Program, fn: Callable[..., object], table: Table | None,
                do_fix: bool) -> tuple[tuple[Finding, ...], str]:
    """Replays the gradient; one finding per birth place of the non-finite gradient elements (and a note).

    A non-finite input element (differentiated or held) is an atom of its
    own, keyed ``(_INPUT, leaf)``: a NaN the gradient inherits from a bad
    batch is traced back to the input and its elements, and an operation
    that turns an input's inf into NaN is not reported as where it was born.
    """
    closed = jax.make_jaxpr(prog.flat())(*prog.dyn)
    core, consts = compat.jaxpr_parts(closed)
    inputs = _BadInputs(prog)
    replay = Replay(const_label=lambda c: inputs.label_const(replay.prov, c))
    dyn_labels = [inputs.label(replay.prov, i) for i in prog.split.dyn_pos]
    intended = False
    try:
        frame = replay.forward(core, consts, prog.dyn, [True] * len(prog.dyn), dyn_labels)
        # NaN/inf inputs and a finite value: the program masks them on purpose (nanmean, a -inf attention
        # mask a where removes), so where they make the gradient non-finite is a finding like any other
        intended = inputs.bad and not any(count_nonfinite(o) for o in frame.outputs())
        replay.cotangent_births = intended
        cts = replay.backward(frame, [(jnp.ones_like(o), None) for o in frame.outputs()])
    except Exception as e:  # an equation the replay cannot evaluate: say so, and how else to look
        return (), (f"the step-by-step replay stopped at an equation it cannot evaluate ({type(e).__name__}: "
                    f"{one_line(str(e))}); run with jax.config.update('jax_debug_nans', True) to locate the NaN.")
    prov = replay.prov
    relevant = prov.atoms_of([c[1] for c in cts if c is not None])
    from_inputs = {a for a in relevant if _is_input(prov.atoms[a][0])}
    born = relevant - from_inputs
    # atoms are elements of births; an atom is a root when nothing relevant caused it (an intended
    # non-finite input is not a cause: the first birth it leads to is where the gradient breaks)
    causing = born if intended else relevant
    roots = sorted({_birth_key(prov, a) for a in born if not (prov.sets[prov.causes[a]] & causing)})
    if intended and roots:
        note = inputs.intended_note()
    elif from_inputs:
        note = inputs.note(prov, from_inputs, _children(replay, born, from_inputs), bool(roots))
    else:
        note = ""
    if not roots:
        if note:
            return (), note
        if inputs.bad:  # non-finite inputs the provenance could not follow (a literal): name them anyway
            return (), (f"the inputs are already non-finite: {inputs.listing()}; the gradient inherits their NaN/inf "
                        "(no operation creates one). Check where these inputs come from.")
        return (), ("the gradient is non-finite under jax.jit but the eager step-by-step replay stayed finite "
                    "(XLA may fuse or reorder the computation); run with jax.config.update('jax_debug_nans', "
                    "True) and without jit to locate it.")
    by_birth: dict[int, set[int]] = {}
    for a in born:
        by_birth.setdefault(_birth_key(prov, a), set()).add(a)
    names = _input_names(core, dict(zip(core.invars, prog.dyn_names)), inputs.const_name, consts)

    def selection(key: int, atoms: set[int]) -> Selection:
        return select(replay.by_key[key], [prov.atoms[a][1:] for a in atoms])

    findings = []
    for key in roots[:_FINDINGS]:
        root_atoms = {a for a in by_birth[key] if not (prov.sets[prov.causes[a]] & causing)}
        chain = [selection(key, root_atoms)]
        for other in sorted(by_birth):
            caused = {a for a in by_birth[other] if prov.sets[prov.causes[a]] & root_atoms}
            if other != key and caused:
                chain.append(selection(other, caused))
        chain = chain[:_CHAIN]
        steps = tuple(step(s, names) for s in chain)
        best, alts = choose_fix(suggest(chain[0], chain, closed), prog, fn, table, closed, do_fix)
        files = [s.file for s in steps]
        best, alts = ((in_user_terms(best, fix_file(best.location, files)) if best is not None else None),
                      tuple(in_user_terms(a, fix_file(a.location, files)) for a in alts))
        root = chain[0].birth
        findings.append(Finding(root.name, loc(root.eqn, root.ctx), steps[0].where, steps[0].message, steps,
                                best, alts))
    return tuple(findings), note


def _input_names(jaxpr: compat.Jaxpr, names: dict[compat.Var, str | None],
                 const_name: Callable[[ArrayLike], str | None],
                 consts: Sequence[ArrayLike] = ()) -> dict[compat.Var, str]:
    """The audited inputs' names for their variables, followed into called bodies (``jit``).

    A held input is a constant of the program, here or in a called body
    (``const_name`` names it). A body called with different inputs (a jitted
    function used twice) names none of them.
    """
    for v, c in zip(jaxpr.constvars, consts):
        n = const_name(c)
        if n is not None:
            names[v] = n
    for eqn in jaxpr.eqns:
        call = call_body(eqn)
        if call is None:
            continue
        inner = {bv: names[a] for a, bv in zip(eqn.invars, call[0].invars)
                 if not isinstance(a, compat.Literal) and names.get(a) is not None}
        for bv, n in inner.items():
            names[bv] = n if names.get(bv, n) == n else None
        _input_names(call[0], names, const_name, call[1])
    return {v: n for v, n in names.items() if n is not None}


# --------------------------------------------------------------------------- non-finite inputs

_INPUT = "input"  # the birth key of a non-finite input's atoms: (_INPUT, leaf index)
_LISTED = 6  # input elements named in a note


def _is_input(key: AtomKey) -> bool:
    return isinstance(key, tuple) and key[:1] == (_INPUT,)


def _children(replay: Replay, born: set[int], from_inputs: set[int]) -> list[Birth]:
    """The births that the non-finite inputs' elements turned into something else (inf - inf = NaN)."""
    prov = replay.prov
    keys = sorted({_birth_key(prov, a) for a in born if prov.sets[prov.causes[a]] & from_inputs})
    return [replay.by_key[k] for k in keys]



def _birth_key(prov: Provenance, atom: int) -> int:
    """The key of the birth an atom is an element of (an atom not of an input)."""
    key = prov.atoms[atom][0]
    assert isinstance(key, int)
    return key

class _BadInputs:
    """The non-finite elements of the audited inputs, differentiated or held, as provenance atoms."""

    def __init__(self, prog: Program) -> None:
        self.names = prog.names
        self.leaves = prog.leaves()
        self.masks: dict[int, np.ndarray] = {}
        for i, x in enumerate(self.leaves):
            m = mask_of(x) if hasattr(x, "dtype") else None
            if m is not None and m.any():
                self.masks[i] = m
        self._const: dict[int, tuple[object, int | None]] = {}  # id(const) -> (const, its leaf)

    @property
    def bad(self) -> bool:
        return bool(self.masks)

    def label(self, prov: Provenance, i: int) -> Label | None:
        """Leaf ``i``'s labels: one atom per non-finite element, the same atoms on every call."""
        m = self.masks.get(i)
        if m is None:
            return None
        label = np.zeros(m.shape, np.int32)
        prov.born(label, (_INPUT, i), 0, m)
        return label

    def leaf_of(self, c: ArrayLike) -> int | None:
        """The held leaf a program constant is (the same object, or the same values and NaNs), else None."""
        hit = self._const.get(id(c))
        if hit is not None and hit[0] is c:
            return hit[1]
        found = next((i for i, x in enumerate(self.leaves) if x is c), None)
        if found is None and self.masks and getattr(c, "dtype", None) is not None:
            m = mask_of(c)
            if m is not None and m.any():
                a = np.asarray(c)
                found = next((i for i in self.masks if np.shape(self.leaves[i]) == a.shape
                              and np.asarray(self.leaves[i]).dtype == a.dtype
                              and np.array_equal(np.asarray(self.leaves[i]), a, equal_nan=True)), None)
        self._const[id(c)] = (c, found)
        return found

    def label_const(self, prov: Provenance, c: ArrayLike) -> Label | None:
        i = self.leaf_of(c)
        return None if i is None else self.label(prov, i)

    def const_name(self, c: ArrayLike) -> str | None:
        i = self.leaf_of(c)
        return None if i is None else self.names[i]

    def _elements(self, i: int, flat: Sequence[int]) -> str:
        a = np.asarray(self.leaves[i])
        shown = [f"{self.names[i]}{fmt_index(np.unravel_index(e, a.shape))} = {fmt(a.reshape(-1)[e])}"
                 for e in sorted(flat)[:_LISTED]]
        return ", ".join(shown) + (f" (and {len(flat) - _LISTED} more)" if len(flat) > _LISTED else "")

    def listing(self) -> str:
        """Every non-finite input: ``x (2 of 8 elements: x[3] = nan, x[5] = inf)``."""
        return "; ".join(f"{self.names[i]} ({int(m.sum())} of {m.size} elements: "
                         f"{self._elements(i, list(np.flatnonzero(m)))})" for i, m in self.masks.items())

    def intended_note(self) -> str:
        """What the report says of non-finite inputs whose NaN/inf the program keeps out of its value."""
        return (f"the inputs hold NaN/inf but the value is finite: {self.listing()}. The program masks them on "
                "purpose, so they are not the cause; the findings are where they make the gradient non-finite.")

    def note(self, prov: Provenance, atoms: set[int], children: Sequence[Birth], born: bool) -> str:
        """What the report says of the non-finite input elements (``atoms``) that reach the gradient."""
        per_leaf: dict[int, set[int]] = {}
        for a in atoms:
            key, _, e = prov.atoms[a]
            assert isinstance(key, tuple)  # an input's atom
            per_leaf.setdefault(key[1], set()).add(e)
        parts = []
        for i, elems in sorted(per_leaf.items()):
            flat = sorted(e for e in elems if e >= 0)
            parts.append(f"{self._elements(i, flat)} ({len(flat)} of {self.masks[i].size} elements of "
                         f"{self.names[i]} reach the gradient)")
        text = "the inputs are already non-finite: " + "; ".join(parts)
        turned = ", ".join(f"`{b.name}` at {loc(b.eqn, b.ctx)}" for b in children[:2])
        via = f" (made NaN/inf anew by {turned})" if turned else ""
        if born:
            return f"{text}. Part of the non-finite gradient comes from them{via}; the findings are the rest."
        return (f"{text}. Every non-finite gradient element comes from them{via}: no operation makes a NaN "
                "or inf from finite values. Check where these inputs come from (a bad batch, a parameter "
                "that has diverged).")


# --------------------------------------------------------------------------- coverage


def _coverage(prog: Program, table: Table) -> Coverage:
    """How often each rule of ``table`` matches an equation of the traced program."""
    tbl = table if isinstance(table, RuleTable) else RuleTable(table)
    closed = jax.make_jaxpr(prog.flat())(*prog.dyn)
    counts: Counter[str] = Counter()
    if tbl.scoped_ops:  # a scoped entry matches by the equation's name stack: count the key that applies
        for eqn, scopes in walk.scoped_equations(closed):
            hit = tbl.rule_for(op_name(eqn), scopes)
            if hit is not None:
                counts[hit[0]] += 1
    else:
        # a matched equation is replaced whole by its rule: nothing inside it is matched
        enter = lambda eqn: walk.enters(eqn) and op_name(eqn) not in tbl
        counts.update(name for name in (op_name(e) for e, _ in walk.equations(closed, enter)) if name in tbl)
    fired = tuple(sorted(counts.items()))
    never = tuple(sorted(n for n in tbl.names() if n not in counts))
    return Coverage(len(tbl), fired, never)
