"""What ``gk.audit`` returns: the report values, their JSON form and the human rendering.

An :class:`AuditReport` holds one :class:`Finding` per independent birth place
of a non-finite gradient; a finding is a chain of :class:`Step` s (where the
NaN/inf was born, then what it became), each naming the exact elements
involved (:class:`Element`), and the suggested :class:`Fix` with the verdict
of its re-run.
"""

from __future__ import annotations

import dataclasses
import math
import re
import textwrap
from typing import Any

import numpy as np

from gradkit._src.checks.describe import fmt, fmt_index, group_leaves, name_path, short_path

__all__ = ["AuditReport", "Coverage", "Element", "Finding", "Fix", "Probe", "Step", "render"]

_SHOWN = 6  # elements listed per step; the rest are counted


def gk_name(name: str) -> str:
    """``gradkit.stable.x`` as users write it: ``gk.stable.x``."""
    return "gk." + name[len("gradkit."):] if name.startswith("gradkit.") else name


@dataclasses.dataclass(frozen=True)
class Element:
    """One element where a NaN/inf was born (or passed through), with the values there.

    Attributes:
      index: the element's index in the op's operand (backward) or result (forward).
      values: ``(name, value)`` pairs: the op's operands there (``x``; ``y``, ``x``),
        named after the audited input when the operand is one.
      iteration: the loop iteration, inside a scan or while loop.
      on_input: the single operand is a value of the user's, indexed as the element is: an audited
        input or the expression the source line passes (``x[2] = 0``, ``d2[0,0] = 0``, ``(w * x)[1] = 0``;
        not ``[2]: x = 0``).
    """

    index: tuple[int, ...]
    values: tuple[tuple[str, float], ...]
    iteration: int | None = None
    on_input: bool = False

    def __str__(self) -> str:
        idx = fmt_index(self.index)
        if len(self.values) == 1:
            name, v = self.values[0]
            if self.on_input and idx:
                return f"{name if _simple(name) else f'({name})'}{idx} = {fmt(v)}"
            return f"{name}{idx} = {fmt(v)}" if self.on_input or not idx else f"{idx}: {name} = {fmt(v)}"
        names = ", ".join(n for n, _ in self.values)
        vals = ", ".join(fmt(v) for _, v in self.values)
        return f"{idx}: ({names}) = ({vals})" if idx else f"({names}) = ({vals})"


def _simple(name: str) -> bool:
    """A name that can be indexed as written: ``x``, ``d2``, ``params['w']``, ``args[0].b``."""
    return re.fullmatch(r"[A-Za-z_][\w.]*(\[[^\[\]]*\]|\.\w+)*", name) is not None


def elements_text(elements: tuple[Element, ...], count: int) -> str:
    """``x[2] = 0, x[4] = -1 (and 3 more)``: each element once (loop iterations of one element are one)."""
    texts = list(dict.fromkeys(str(e) for e in elements))
    shown = ", ".join(texts[:_SHOWN])
    more = max(count, len(texts)) - min(len(texts), _SHOWN)
    return shown + (f" (and {more} more)" if more > 0 else "")


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
    count: int = 0  # elements born here that lead to the non-finite gradient
    total: int = 0  # elements of the array they are in
    elements: tuple[Element, ...] = ()  # the first of them, with their values

    @property
    def location(self) -> str:
        return f"{short_path(self.file)}:{self.line}" if self.file else "unknown source line"



@dataclasses.dataclass(frozen=True)
class Fix:
    """A suggested fix and, when it could be applied, the re-run verdict.

    Attributes:
      kind: ``"table"`` (apply a rule table with ``gk.override``), ``"code"``
        (replace an expression with a stable function) or ``"none"`` (no route
        verified: ``advice`` says what was re-run).
      name: what to use: ``"gradkit.tables.SAFE"``, ``'gradkit.tables.SAFE | {"mul": "safe"}'``,
        ``"gradkit.stable.log1pexp"``.
      advice: one sentence saying what to change, where.
      applied: whether audit could apply it to re-run the gradient.
      finite: the gradient is finite with the fix (None: not run).
      matches_fd: it matches float64 finite differences on the compared elements.
      max_rel_err: the largest relative error there.
      compared: elements compared one by one; ``directions``: random directions
        compared (a large input); ``excluded`` elements or directions left out
        (finite differences undefined: a kink, a jump, a pole, a non-finite value).
      note: why it was not applied, or what the re-run found.
      checked_with: the equivalent fix audit re-ran, when this one could not be (unused: every route is
        re-run as itself).
      expression: how to apply it, as code: the table (``gk.tables.SAFE | {"mul": "safe"}``, for
        ``gk.override(fn, ...)``) or the call that replaces the expression (``gk.stable.log1pexp(logits)``).
      location: ``file.py:12``, the line to change (a code fix); ``replaces`` the source text replaced.
      value_same: the forward value is unchanged wherever it was finite (or no farther from its float64
        value); ``value_note`` says how it compares (``None``/"" when not re-run).
      with_table: a code fix that needs a rule table too (two NaNs born apart): apply
        ``gk.override(fn, <with_table>)`` to the rewritten function.
      rewritten: a code fix's source line (at ``location``) as it reads with the fix applied.
      kink: where finite differences were undefined at elements of the finding and the float64 gradients at
        nearby points decided instead (``gradkit._src.audit.kink``): ``"subgradient"`` (they differ, the
        function has a kink there: the gradient must lie in their convex hull) or ``"gradient"`` (they
        agree: it must equal them); ``kink_ok`` whether it did, on ``kink_elements`` elements from
        ``kink_points`` nearby gradients, ``kink_err`` the distance to the hull over the largest of them
        (a subgradient) or the relative error (a gradient).
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
    checked_with: str = ""
    expression: str = ""
    location: str = ""
    replaces: str = ""
    directions: int = 0
    value_same: bool | None = None
    value_note: str = ""
    with_table: str = ""
    rewritten: str = ""
    kink: str = ""
    kink_ok: bool | None = None
    kink_elements: int = 0
    kink_points: int = 0
    kink_err: float | None = None

    @property
    def verified(self) -> bool:
        """Whether the re-run gradient is finite, matches float64 finite differences and keeps the forward value."""
        return bool(self.applied and self.finite and self.matches_fd and self.value_same is not False)

    def _compared(self) -> str:
        parts = [f"{self.compared} element(s)"] if self.compared or not self.directions else []
        if self.directions:
            parts.append(f"{self.directions} random direction(s)")
        return " and ".join(parts)

    def verdict(self) -> str:
        """What was re-run and what it gave; a fix that was not re-run says so, and claims nothing."""
        if self.kind == "none":
            return self.note or "no route verified"
        if not self.applied:
            if self.note.startswith("re-run failed"):
                return f"{self.note}: not verified"
            why = f" ({self.note})" if self.note else " (audit ran with fix=False)"
            return f"not re-run, so not verified{why}"
        if self.checked_with:
            return (f"re-ran the equivalent {gk_name(self.checked_with)} instead: "
                    + dataclasses.replace(self, checked_with="").verdict())
        value = f"; {self.value_note}" if self.value_note else ""
        if not self.finite:
            return "gradient still non-finite" + (f" ({self.note})" if self.note else "") + value
        excl = (f"; {self.excluded} left out where finite differences are undefined "
                "(a kink, a jump, a pole or a non-finite value)"
                if self.excluded else "")
        if self.matches_fd is None:
            return (f"gradient finite; not compared with finite differences "
                    f"({self.note or 'no comparable element'}){value}")
        if self.kink and self.kink_ok is False:
            return self._kink_text() + excl + value
        if self.matches_fd:
            head = "verified: " if self.verified else ""
            fd = (f"gradient finite, matches float64 finite differences on {self._compared()} "
                  f"(max rel err {fmt(self.max_rel_err)})" if self.compared or self.directions else "gradient finite")
            if self.kink == "subgradient":
                return f"{head}{self._kink_text()}; {fd}{excl}{value}"
            kink = f"; {self._kink_text()}" if self.kink else ""
            return f"{head}{fd}{kink}{excl}{value}"
        return (f"gradient finite but differs from float64 finite differences (max rel err "
                f"{fmt(self.max_rel_err)} on {self._compared()}){excl}{value}")

    def _kink_text(self) -> str:
        """What the float64 gradients at nearby points said where finite differences are undefined."""
        at = f"{self.kink_elements} element(s)"
        near = f"the float64 gradients at {self.kink_points} nearby points"
        if self.kink == "subgradient" and self.kink_ok:
            return (f"the function has a kink here; this is a subgradient (at {at}, in the convex hull of {near}: "
                    f"distance {fmt(self.kink_err)} of their scale)")
        if self.kink == "subgradient":
            return (f"gradient finite but not a subgradient: at {at} where the function has a kink it lies "
                    f"outside the convex hull of {near} (distance {fmt(self.kink_err)} of their scale)")
        if self.kink_ok:
            return (f"at {at} where finite differences are undefined, equal to {near} inside the function's "
                    f"domain (rel err {fmt(self.kink_err)})")
        return (f"gradient finite but differs from {near} inside the function's domain at {at} where finite "
                f"differences are undefined (rel err {fmt(self.kink_err)})")


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
    """One probe input (an edge value, a mask pattern, an index extreme) tried by ``audit(..., sweep=True)``."""

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
      sweep: with ``sweep=True``, the probes whose gradient was non-finite; its
        ``inputs`` say per input what was probed, or why it was not varied.
      probes: how many probe inputs the sweep tried.
      note: anything the audit could not do.
      nonfinite_at: per differentiated input with a non-finite gradient, ``(name,
        indices)``: the first few non-finite elements of its gradient.
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
    nonfinite_at: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()

    @property
    def finite(self) -> bool:
        """The gradient at the audited inputs is finite everywhere."""
        return all(bad == 0 for _, bad, _ in self.gradients)

    @property
    def ok(self) -> bool:
        """Finite gradient, no sweep probe broke it, and a sweep varied every array input it could.

        A sweep that left a float, complex, bool or integer input unvaried (its
        probe budget ran out, every probe was rejected) is not an all-clear:
        the report says ``SWEEP PARTIAL`` and names the input. PRNG keys and
        Python values are never varied; the report says so and they do not
        count against ``ok``.
        """
        return self.finite and not self.sweep and not self.unswept

    @property
    def unswept(self) -> tuple[str, ...]:
        """The array inputs a sweep could have varied and did not (empty without a sweep)."""
        inputs = getattr(self.sweep, "inputs", ())
        return tuple(i.input for i in inputs if not i.varied and i.kind not in ("key", "static"))

    def __str__(self) -> str:
        return render(self)

    def text(self, verbose: bool = False) -> str:
        """The human report; ``verbose=True`` lists every input leaf and non-finite element (``str()`` groups
        many leaves by module path)."""
        return render(self, verbose)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["finite"] = self.finite
        d["ok"] = self.ok
        if self.sweep is not None:
            d["sweep_inputs"] = [dataclasses.asdict(i) for i in getattr(self.sweep, "inputs", ())]
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


def _indices(name: str, idx: tuple[tuple[int, ...], ...], count: int) -> str:
    if not idx or not idx[0]:
        return ""
    shown = ", ".join(f"{name}{fmt_index(i)}" for i in idx[:_SHOWN])
    return ": " + shown + (", ..." if count > min(len(idx), _SHOWN) else "")


_GROUP_FROM = 4  # more leaves than this in an argument (header) or in the gradient line: grouped by module path


def _parse_input(text: str) -> tuple[str, str, int]:
    """``"p['w']: f32[3,4]"`` -> ``("p['w']", "f32", 12)``."""
    name, _, desc = text.rpartition(": ")
    m = re.fullmatch(r"(.*)\[([\d,]*)\]", desc)
    if not name or m is None:
        return text, "", 0
    return name, m.group(1), math.prod(int(d) for d in m.group(2).split(",") if d)


def _signature(r: AuditReport, verbose: bool) -> str:
    """``loss(params: 102 arrays (f32, 1032 elements), x: f32[3,4])``: an argument of many leaves summarised."""
    if verbose:
        return f"{r.function}({', '.join(r.inputs)})"
    parsed = [_parse_input(t) for t in r.inputs]
    by_arg: dict[str, list[int]] = {}
    for i, (name, _, _) in enumerate(parsed):
        by_arg.setdefault(name_path(name)[0], []).append(i)
    parts = []
    for arg, ix in by_arg.items():
        if len(ix) <= _GROUP_FROM:
            parts += [r.inputs[i] for i in ix]
            continue
        dtypes = ", ".join(dict.fromkeys(parsed[i][1] for i in ix))
        parts.append(f"{arg}: {len(ix)} arrays ({dtypes}, {sum(parsed[i][2] for i in ix)} elements)")
    return f"{r.function}({', '.join(parts)})"


def _gradient_line(r: AuditReport, verbose: bool) -> str:
    """Where the gradient is non-finite: per input, or per module path when there are many inputs."""
    at = dict(r.nonfinite_at)
    bad = [(n, b, s) for n, b, s in r.gradients if b]
    if verbose or len(bad) <= _GROUP_FROM:
        return ", ".join(f"{n} ({b} of {s}{_indices(n, at.get(n, ()), b)})" for n, b, s in bad)
    groups = group_leaves([n for n, _, _ in bad])
    shown = []
    for label, ix in groups[:_SHOWN]:
        if len(ix) == 1:
            n, b, s = bad[ix[0]]
            shown.append(f"{n} ({b} of {s}{_indices(n, at.get(n, ()), b)})")
        else:
            shown.append(f"{label} ({len(ix)} arrays, {sum(bad[i][1] for i in ix)} of "
                         f"{sum(bad[i][2] for i in ix)} elements)")
    more = f" (and {len(groups) - _SHOWN} more groups)" if len(groups) > _SHOWN else ""
    total = sum(b for _, b, _ in bad)
    size = sum(s for _, _, s in r.gradients)
    return (f"{total} of {size} elements, in {len(bad)} of {len(r.gradients)} arrays: "
            + "; ".join(shown) + more)


def _finding_lines(k: int, f: Finding, many: bool, verbose: bool) -> list[str]:
    """A finding, in the order a reader acts on it: where it is born, the op, the line, the fix and its re-run;
    then the elements, what followed, and the other routes."""
    ind = " " * 9
    lines = []
    tag = f"finding {k + 1}" if many else "born at"
    root = f.root
    via = f" in `{root.via}`" if root.via else ""
    phase = f"{root.phase} pass" + (" of the table's rule" if root.rule else "")
    lines.append(f"{ind}{tag:<9} {root.location}  `{root.op}`{via} ({phase})"
                 + (f", {root.where}" if root.where else ""))
    lines.append(f"{ind}          {root.message}")
    if root.code:
        lines += [f"{ind}          {ln}" for ln in root.code.splitlines()]
    if f.fix is not None:
        lines.append(f"{ind}fix       {f.fix.advice}")
        if f.fix.rewritten:
            number = f.fix.location.rpartition(":")[2]
            lines.append(f"{ind}          {number:>5} | {f.fix.rewritten}")
        lines.append(f"{ind}re-run    {f.fix.verdict()}")
    if root.elements:
        lines.append(f"{ind}elements  {elements_text(root.elements, root.count)}")
    for s in f.chain[1:]:
        where = f", {s.where}" if s.where and s.where != root.where else ""
        lines.append(f"{ind}then      {s.location}  {s.message}{where}")
        if s.elements:
            lines.append(f"{ind}          at {elements_text(s.elements, s.count)}")
    for a in f.alternatives:
        if f.fix is not None and f.fix.kind == "none" and a.applied:
            lines.append(f"{ind}tried     {a.expression or gk_name(a.name)}: {a.verdict()}")
        elif a.verified:
            what = "a subgradient at the kink" if a.kink == "subgradient" else "matches finite differences"
            lines.append(f"{ind}also      {a.expression or gk_name(a.name)} (re-run: finite, {what}, same value)")
        elif a.kind == "code" and not a.applied:
            advice = a.advice[0].lower() + a.advice[1:] if a.advice.startswith("Or") else a.advice
            lines.append(f"{ind}also      {'' if advice.startswith('or ') else 'or '}{advice} (not re-run)")
    return lines


def render(r: AuditReport, verbose: bool = False) -> str:
    """The human-readable report (what ``print(report)`` and ``gradkit audit`` show).

    Each finding comes first — where the NaN/inf is born, the op, the user's
    line, the fix and its re-run — then the value and which gradient elements
    are non-finite. Many inputs (a model's parameters) are grouped by module
    path with counts (``params/Dense_0/* (2 arrays, 20 of 20 elements)``);
    ``verbose=True`` lists every input and element, as ``to_dict()`` does.
    """
    value_bad = r.value.startswith("NON-FINITE")
    status = ("FINDING" if not r.finite else "SWEEP FINDING" if r.sweep else "SWEEP PARTIAL" if r.unswept
              else "VALUE" if value_bad else "ok")
    lines = [f"{status:<8} {_signature(r, verbose)}" + (f"   [{r.source}]" if r.source else "")]
    ind = " " * 9
    for k, f in enumerate(r.findings):
        lines += _finding_lines(k, f, len(r.findings) > 1, verbose)
    lines.append(f"{ind}value     {r.value}")
    if r.finite:
        lines.append(f"{ind}gradient  finite for every input"
                     + ("; the value is not: check the loss itself (its inputs, a log of 0, an overflow)"
                        if value_bad else ""))
    else:
        lines.append(f"{ind}gradient  non-finite in {_gradient_line(r, verbose)}")
    if r.note:
        lines.append(f"{ind}note      {r.note}")
    if r.coverage is not None:
        lines.append(f"{ind}rules     {r.coverage}")
    if r.sweep is not None:
        lines += _sweep_lines(r, verbose)
    return "\n".join(_wrap(lines))


_SWEEP_INPUTS_SHOWN = 8


def _sweep_lines(r: AuditReport, verbose: bool) -> list[str]:
    """The sweep's verdict, then what it probed per input (all of them with ``verbose``)."""
    ind = " " * 9
    lines: list[str] = []
    if not r.sweep:
        verdict = "gradient finite for all"
        if r.unswept:
            verdict += f"; NOT an all-clear: {len(r.unswept)} input(s) not varied"
        lines.append(f"{ind}sweep     {r.probes} probes: {verdict}")
    else:
        lines.append(f"{ind}sweep     {len(r.sweep)} of {r.probes} probes break the gradient:")
        for p in r.sweep[:12]:
            where = f" -> `{p.op}` at {p.location}" if p.op else ""
            val = "" if p.value_finite else " (value non-finite too)"
            lines.append(f"{ind}            {p.probe}{val}{where}")
        if len(r.sweep) > 12:
            lines.append(f"{ind}            ... and {len(r.sweep) - 12} more")
    inputs = list(getattr(r.sweep, "inputs", ()))
    # the inputs not varied first: they are what limits the verdict
    inputs.sort(key=lambda i: i.varied)
    shown = inputs if verbose else inputs[:_SWEEP_INPUTS_SHOWN]
    lines += [f"{ind}  probed  {i.summary()}" for i in shown]
    if len(shown) < len(inputs):
        rest = inputs[len(shown):]
        unvaried = sum(not i.varied for i in rest)
        lines.append(f"{ind}          ... and {len(rest)} more input(s)"
                     + (f", {unvaried} of them not varied" if unvaried else "") + " (verbose: all)")
    return lines
