"""Naive expressions that a :mod:`gradkit.stable` function replaces, found in a traced program by their structure.

A :class:`Pattern` is a small tree over equations: ``log(1 + exp(x))`` is a
``log`` whose operand is an ``add`` of the literal 1 (either side) and an
``exp``, whose operand is captured as ``x``. Matching follows each operand to
the equation that produced it, inside one jaxpr, so it sees through nothing
but the program itself: ``jnp.log1p(jnp.exp(z))``, a hand-written
``1 / (1 + jnp.exp(-z))``, ``jax.nn.logsumexp``'s shifted ``log(sum(exp))``
and the body of ``jnp.linalg.norm`` are recognised the same way, whatever
the source looks like.

:func:`find` returns one :class:`Rewrite` per match that covers an equation
where the NaN/inf was born: the equation whose output the stable function
gives, the variables it takes, and the call to write in its place.
:mod:`~gradkit._src.audit.fixes` re-runs the program with that equation
replaced before it suggests the rewrite.

Patterns come in two groups: ``"expression"`` (a formula with a stable
counterpart: tried before any rule table) and ``"primitive"`` (one singular
primitive and its ``safe_*`` twin, a convention at the singular point:
tried after the tables).
"""

from __future__ import annotations

import dataclasses
import linecache
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

import jax
import numpy as np

from gradkit._src import compat, stable
from gradkit._src.audit.explain import callee
from gradkit._src.core import walk

__all__ = ["PATTERNS", "Pattern", "Rewrite", "find", "source_text", "stable_doc"]


# --------------------------------------------------------------------------- pattern nodes


@dataclasses.dataclass(frozen=True)
class Op:
    """An equation: its primitive (or ``fn:<name>``, a jitted function) and its operands' patterns.

    ``commute``: a two-operand op whose operands may come in either order.
    ``when``: a test of the equation's params. ``tag``: record the equation
    under this name (a reduction's axes are read from it).
    """

    names: tuple[str, ...]
    args: tuple[Node, ...]
    commute: bool = False
    when: Callable[[Mapping[str, object]], bool] | None = None
    tag: str = ""


@dataclasses.dataclass(frozen=True)
class Var:
    """An operand of any kind, captured under ``name`` (the same name twice: the same variable)."""

    name: str


@dataclasses.dataclass(frozen=True)
class Const:
    """A literal equal to ``value`` (possibly converted or broadcast)."""

    value: float


@dataclasses.dataclass(frozen=True)
class Alt:
    """The first of ``options`` that matches (each is tried)."""

    options: tuple[Node, ...]


Node = Op | Var | Const | Alt


def op(names: str, *args: Node, commute: bool = False, when: Callable[[Mapping[str, object]], bool] | None = None,
       tag: str = "") -> Op:
    """``Op`` with names given as ``"log|log1p"``."""
    return Op(tuple(names.split("|")), tuple(args), commute, when, tag)


def alt(*options: Node) -> Alt:
    return Alt(tuple(options))


def _square(name: str) -> Node:
    """``x**2`` as ``integer_pow``, ``square`` or ``x * x``."""
    x = Var(name)
    return alt(op("integer_pow", x, when=lambda p: p.get("y") == 2), op("square", x), op("mul", x, x))


def _bcast(node: Node) -> Node:
    """``node``, possibly broadcast back (a reduction kept for a division)."""
    return alt(node, op("broadcast_in_dim|reshape", node))


def _one_plus(node: Node) -> Node:
    return op("add", Const(1.0), node, commute=True)


# sigmoid(x) written out, or as lax.logistic; "<name>_neg" captures z of 1/(1 + exp(z)) = sigmoid(-z)
def _sigmoid(name: str, naive_only: bool = False) -> Node:
    denominators = [(_one_plus(op("exp", op("neg", Var(name)))), ""),
                    (_one_plus(op("exp", Var(name + "_neg"))), "_neg")]
    forms: list[Node] = []
    for d, _ in denominators:
        forms += [op("div", Const(1.0), d), op("integer_pow", d, when=lambda p: p.get("y") == -1),
                  op("reciprocal", d)]
    if not naive_only:
        forms.insert(0, op("logistic", Var(name)))
    return alt(*forms)


def _clip(name: str) -> Node:
    """``clip(x, -1, 1)``: ``jnp.clip`` (a jitted function), ``lax.clamp`` or ``min(max(x, -1), 1)``."""
    x, lo, hi = Var(name), Const(-1.0), Const(1.0)
    return alt(op("fn:clip", x, lo, hi), op("clamp", lo, x, hi),
               op("min", op("max", x, lo, commute=True), hi, commute=True),
               op("max", op("min", x, hi, commute=True), lo, commute=True))


# --------------------------------------------------------------------------- patterns


# What a match captured: an operand under its name, a tagged equation under ``@tag``.
Capture = compat.Atom | compat.JaxprEqn
Caps = dict[str, Capture]
Span = tuple[str, int, str, int, int]  # compat.source_span: file, line, function, start, end column
Build = Callable[[Mapping[str, Capture]], tuple[tuple[str, ...], Callable[..., jax.Array], str]]


@dataclasses.dataclass(frozen=True)
class Pattern:
    """A naive form and the :mod:`gradkit.stable` function that replaces it.

    Attributes:
      function: the stable function's name in :mod:`gradkit.stable`.
      naive: the naive form, as the report shows it (``log(1 + exp(x))``).
      shape: the tree of equations (its root is the equation replaced).
      build: from the captures, ``(captured names passed in, fn(*values), call template)``;
        the template names the captures in braces: ``log_sigmoid(-{x})``.
      group: ``"expression"`` or ``"primitive"`` (see the module docstring).
    """

    function: str
    naive: str
    shape: Node
    build: Build
    group: str = "expression"


def _axes(caps: Mapping[str, Capture], tag: str) -> tuple[int, ...]:
    eqn = caps["@" + tag]
    assert isinstance(eqn, compat.JaxprEqn)  # an Op's tag records its equation
    return tuple(int(a) for a in eqn.params.get("axes", ()))


def _axis_text(axes: tuple[int, ...]) -> str:
    return str(axes[0]) if len(axes) == 1 else str(axes)


def _unary(function: str, template: str = "") -> Build:
    f = getattr(stable, function)

    def build(caps: Mapping[str, Capture]) -> tuple[tuple[str, ...], Callable[..., jax.Array], str]:
        return ("x",), f, template or f"{function}({{x}})"
    return build


def _binary(function: str, a: str = "x", b: str = "y") -> Build:
    f = getattr(stable, function)

    def build(caps: Mapping[str, Capture]) -> tuple[tuple[str, ...], Callable[..., jax.Array], str]:
        return (a, b), f, f"{function}({{{a}}}, {{{b}}})"
    return build


def _signed(function: str, flip: bool) -> Build:
    """``function(±x)`` for a sigmoid captured as ``x`` (sigmoid(x)) or ``x_neg`` (sigmoid(-x_neg))."""
    f = getattr(stable, function)

    def build(caps: Mapping[str, Capture]) -> tuple[tuple[str, ...], Callable[..., jax.Array], str]:
        neg = ("x_neg" in caps) != flip
        name = "x_neg" if "x_neg" in caps else "x"
        if neg:
            return (name,), lambda v: f(-v), f"{function}(-{{{name}}})"
        return (name,), f, f"{function}({{{name}}})"
    return build


def _reduce(function: str, tag: str) -> Build:
    f = getattr(stable, function)

    def build(caps: Mapping[str, Capture]) -> tuple[tuple[str, ...], Callable[..., jax.Array], str]:
        axes = _axes(caps, tag)
        return ("x",), lambda v: f(v, axis=axes), f"{function}({{x}}, axis={_axis_text(axes)})"
    return build


_LOG = "log"
_SUM_EXP = op("reduce_sum", op("exp", Var("x")), tag="sum")
_SUM_SQ = op("reduce_sum", _square("x"), tag="sum")
_HALF = Const(0.5)

PATTERNS: tuple[Pattern, ...] = (
    Pattern("log1pexp", "log(1 + exp(x))",
            alt(op(_LOG, _one_plus(op("exp", Var("x")))), op("log1p", op("exp", Var("x")))), _unary("log1pexp")),
    Pattern("log_sigmoid", "log(sigmoid(x))", op(_LOG, _sigmoid("x")), _signed("log_sigmoid", False)),
    Pattern("log_sigmoid", "log(1 - sigmoid(x))",
            alt(op(_LOG, op("sub", Const(1.0), _sigmoid("x"))), op("log1p", op("neg", _sigmoid("x")))),
            _signed("log_sigmoid", True)),
    Pattern("sigmoid", "1 / (1 + exp(-x))", _sigmoid("x", naive_only=True), _signed("sigmoid", False)),
    Pattern("log1mexp", "log(1 - exp(-x))",
            alt(op(_LOG, op("sub", Const(1.0), op("exp", op("neg", Var("x"))))),
                op("log1p", op("neg", op("exp", op("neg", Var("x"))))),
                op(_LOG, op("neg", op("expm1", op("neg", Var("x")))))), _unary("log1mexp")),
    Pattern("softplus_inverse", "log(exp(x) - 1)",
            alt(op(_LOG, op("expm1", Var("x"))), op(_LOG, op("sub", op("exp", Var("x")), Const(1.0)))),
            _unary("softplus_inverse")),
    Pattern("log_cosh", "log(cosh(x))", op(_LOG, op("cosh", Var("x"))), _unary("log_cosh")),
    Pattern("logaddexp", "log(exp(x) + exp(y))", op(_LOG, op("add", op("exp", Var("x")), op("exp", Var("y")))),
            _binary("logaddexp")),
    Pattern("log_softmax", "x - log(sum(exp(x)))",
            op("sub", Var("x"), op(_LOG, _bcast(op("reduce_sum", op("exp", Var("x")), tag="sum")))),
            _reduce("log_softmax", "sum")),
    Pattern("log_softmax", "log(softmax(x))",
            op(_LOG, op("div", op("exp", Var("x")), _bcast(op("reduce_sum", op("exp", Var("x")), tag="sum")))),
            _reduce("log_softmax", "sum")),
    Pattern("logsumexp", "log(sum(exp(x)))", op(_LOG, alt(_SUM_EXP, op("abs", _SUM_EXP))), _reduce("logsumexp", "sum")),
    Pattern("safe_norm", "sqrt(sum(x**2))",
            alt(op("sqrt", _SUM_SQ), op("pow", _SUM_SQ, _HALF)), _reduce("safe_norm", "sum")),
    Pattern("hypot", "sqrt(x**2 + y**2)",
            alt(op("sqrt", op("add", _square("x"), _square("y"))), op("pow", op("add", _square("x"), _square("y")),
                                                                        _HALF)), _binary("hypot")),
    Pattern("safe_arccos", "arccos(clip(x, -1, 1))", op("acos", _clip("x")), _unary("safe_arccos")),
    Pattern("safe_arcsin", "arcsin(clip(x, -1, 1))", op("asin", _clip("x")), _unary("safe_arcsin")),
    Pattern("xlogy", "x * log(y)", op("mul", Var("x"), op(_LOG, Var("y")), commute=True), _binary("xlogy")),
    Pattern("xlog1py", "x * log1p(y)", op("mul", Var("x"), op("log1p", Var("y")), commute=True),
            _binary("xlog1py")),
    # one singular primitive and its safe twin (a convention where the derivative is infinite)
    Pattern("safe_sqrt", "x ** 0.5", op("pow", Var("x"), _HALF), _unary("safe_sqrt"), "primitive"),
    Pattern("safe_sqrt", "sqrt(x)", op("sqrt", Var("x")), _unary("safe_sqrt"), "primitive"),
    Pattern("safe_log", "log(x)", op(_LOG, Var("x")), _unary("safe_log"), "primitive"),
    Pattern("safe_div", "x / y", op("div", Var("x"), Var("y")), _binary("safe_div"), "primitive"),
    Pattern("safe_pow", "x ** y", op("pow", Var("x"), Var("y")), _binary("safe_pow"), "primitive"),
    Pattern("safe_arctan2", "arctan2(y, x)", op("atan2", Var("y"), Var("x")), _binary("safe_arctan2", "y", "x"),
            "primitive"),
    Pattern("safe_arccos", "arccos(x)", op("acos", Var("x")), _unary("safe_arccos"), "primitive"),
    Pattern("safe_arcsin", "arcsin(x)", op("asin", Var("x")), _unary("safe_arcsin"), "primitive"),
)


def stable_doc(function: str) -> str:
    """The first line of a :mod:`gradkit.stable` function's docstring, as plain text: what it computes."""
    doc = (getattr(getattr(stable, function, None), "__doc__", None) or "").strip().splitlines()
    return doc[0].strip().replace("``", "`").rstrip(".") if doc else ""


# --------------------------------------------------------------------------- matching


def _name(eqn: compat.JaxprEqn) -> str:
    return compat.eqn_name(eqn) if compat.is_jit(eqn) else eqn.primitive.name


def _const(atom: compat.Atom, prod: Mapping[compat.Var, compat.JaxprEqn],
           ) -> tuple[np.ndarray, list[compat.JaxprEqn]] | None:
    """The value of a literal, seen through conversions and broadcasts; and the equations passed."""
    passed: list[compat.JaxprEqn] = []
    for _ in range(4):
        if isinstance(atom, compat.Literal):  # compat.is_literal
            return np.asarray(atom.val), passed
        eqn = prod.get(atom)
        if eqn is None or eqn.primitive.name not in ("convert_element_type", "broadcast_in_dim", "reshape"):
            return None
        passed.append(eqn)
        atom = eqn.invars[0]
    return None


def _match(node: Node, atom: compat.Atom, prod: Mapping[compat.Var, compat.JaxprEqn],
           caps: Caps) -> Iterator[tuple[Caps, list[compat.JaxprEqn]]]:
    """Every way ``atom`` matches ``node``: ``(captures, equations passed)``; the root equation first."""
    if isinstance(node, Var):
        if node.name not in caps:
            yield {**caps, node.name: atom}, []
        elif caps[node.name] is atom:
            yield caps, []
    elif isinstance(node, Const):
        const = _const(atom, prod)
        if const is not None and const[0].size and np.all(const[0].astype(np.float64) == node.value):
            yield caps, const[1]
    elif isinstance(node, Alt):
        for o in node.options:
            yield from _match(o, atom, prod, caps)
    else:
        eqn = None if isinstance(atom, compat.Literal) else prod.get(atom)
        if eqn is None or _name(eqn) not in node.names or len(eqn.invars) != len(node.args):
            return
        if node.when is not None and not node.when(eqn.params):
            return
        orders = [list(eqn.invars)] + ([list(eqn.invars)[::-1]] if node.commute and len(eqn.invars) == 2 else [])
        base = {**caps, "@" + node.tag: eqn} if node.tag else caps
        for ins in orders:
            for c, used in _match_all(node.args, ins, prod, base):
                yield c, [eqn] + used


def _match_all(nodes: Sequence[Node], atoms: Sequence[compat.Atom], prod: Mapping[compat.Var, compat.JaxprEqn],
               caps: Caps) -> Iterator[tuple[Caps, list[compat.JaxprEqn]]]:
    if not nodes:
        yield caps, []
        return
    for c, used in _match(nodes[0], atoms[0], prod, caps):
        for c2, used2 in _match_all(nodes[1:], atoms[1:], prod, c):
            yield c2, used + used2


# --------------------------------------------------------------------------- rewrites


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One match: replace ``eqn``'s output by ``fn`` of ``atoms``.

    Attributes:
      pattern: the pattern matched.
      eqn: the equation whose output the stable function gives (the pattern's root).
      atoms: the variables passed to it, of the jaxpr that holds ``eqn``.
      fn: the stable function applied to their values.
      call: the call to write, with the source's own operand text where known
        (``gk.stable.log1pexp(logits)``).
      covered: the equations the match spans.
      text: the user's source text of the replaced expression (the call it sits in, inside a
        library function); ``span`` its ``(file, line, function, start, end)``.
    """

    pattern: Pattern
    eqn: compat.JaxprEqn
    atoms: tuple[compat.Atom, ...]
    fn: Callable[..., jax.Array]
    call: str
    covered: tuple[compat.JaxprEqn, ...]
    text: str = ""
    span: Span | None = None

    @property
    def name(self) -> str:
        return f"gradkit.stable.{self.pattern.function}"


def source_text(eqn: compat.JaxprEqn) -> str:
    """The user's source text that made ``eqn`` (``jnp.log(1 + jnp.exp(x))``), or "" where unknown."""
    span = compat.source_span(eqn)
    if span is None:
        return ""
    file, line, _, c0, c1 = span
    text = linecache.getline(file, line).rstrip("\n")
    return text[c0:c1] if 0 <= c0 < c1 <= len(text) else ""


_BINARY = (("+", "-"), ("*", "/", "@"), ("**",))  # by precedence, lowest first


def _split(text: str) -> list[str]:
    """The pieces of ``text`` between its depth-0 commas (``a, g(b, c)`` -> ``["a", "g(b, c)"]``)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if depth < 0:
            return []
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [] if depth else out + [cur.strip()]


def _binary_operands(text: str) -> list[str]:
    """``[lhs, rhs]`` of a spaced binary operator at depth 0 (``y * jnp.log(y / q)``), else ``[]``."""
    depth, spots = 0, []
    for i, ch in enumerate(text):
        depth += 1 if ch in "([{" else -1 if ch in ")]}" else 0
        if depth == 0 and ch == " ":
            m = re.match(r" (\*\*|[-+*/@]) ", text[i:])
            if m:
                spots.append((i, m.group(1)))
    for ops in _BINARY:
        hits = [(i, o) for i, o in spots if o in ops]
        if hits:
            i, o = hits[0] if ops == ("**",) else hits[-1]  # ** groups to the right
            return [text[:i].strip(), text[i + len(o) + 2:].strip()]
    return []


def _call_args(text: str) -> list[str]:
    """The positional arguments' text of one call (``f(a, g(b, c), axis=1)`` -> ``["a", "g(b, c)"]``),
    or the two operands of a binary operator (``n / d``); ``[]`` otherwise."""
    m = re.fullmatch(r"\s*[\w.]+\((.*)\)\s*", text, re.S)
    args = _split(m.group(1)) if m else []
    if not args:
        return _binary_operands(text.strip())
    return [a for a in args if a and not re.match(r"^\w+\s*=(?!=)", a)]


class _Source:
    """Source text of equations, an equation inside a library function's body taking its caller's line."""

    def __init__(self, closed: compat.ClosedJaxpr | compat.Jaxpr) -> None:
        self._parent: dict[int, compat.JaxprEqn] = {}
        for eqn, _ in walk.equations(closed):
            for sub in walk.subprograms(eqn.params):
                for inner in compat.jaxpr_parts(sub)[0].eqns:
                    self._parent.setdefault(id(inner), eqn)

    def holder(self, eqn: compat.JaxprEqn) -> compat.JaxprEqn:
        """``eqn``, or the innermost enclosing call equation that has a user source line."""
        e: compat.JaxprEqn | None = eqn
        for _ in range(32):
            if e is None or compat.source_span(e) is not None:
                break
            e = self._parent.get(id(e))
        return e if e is not None else eqn

    def span(self, eqn: compat.JaxprEqn) -> Span | None:
        return compat.source_span(self.holder(eqn))

    def text(self, eqn: compat.JaxprEqn) -> str:
        return source_text(self.holder(eqn))

    def operand(self, atom: compat.Atom, top: compat.JaxprEqn, covered: Sequence[compat.JaxprEqn],
                prod: Mapping[compat.Var, compat.JaxprEqn]) -> str:
        """The user's text for an operand of a match: what made it, or the argument it was passed as."""
        if isinstance(atom, compat.Literal):  # compat.is_literal
            return repr(float(np.asarray(atom.val)))
        top_span = self.span(top)
        src = prod.get(atom)
        if src is not None and top_span is not None:
            span = self.span(src)
            if span is not None and span[:2] == top_span[:2] and span != top_span and self.text(src):
                return self.text(src)  # made on the same line, outside the matched call
        for eqn in covered:
            dyn = [a for a in eqn.invars if not compat.is_literal(a)]
            if not any(a is atom for a in dyn):
                continue
            text = self.text(eqn)
            if eqn.primitive.name == "neg" and text.startswith("-") and self.holder(eqn) is eqn:
                return text[1:].strip()
            args = _call_args(text)
            k = next(i for i, a in enumerate(dyn) if a is atom)
            if k < len(args):
                return args[k]
        return ""


def _call_text(template: str, names: Sequence[str], texts: Sequence[str]) -> str:
    """``gk.stable.log_sigmoid(-x)``: the template filled with the operands' text (their names where unknown)."""
    shown = {}
    for n, t in zip(names, texts):
        t = t or n.removesuffix("_neg")
        simple = re.fullmatch(r"[\w.]+(\[[^\]]*\])?", t) is not None or _binary_operands(t) == []
        shown[n] = t if simple or "-{" + n not in template else f"({t})"
    return "gk.stable." + template.format(**shown)


_NUMPY = frozenset({"", "log", "sqrt", "power", "divide", "true_divide", "arctan2", "arccos", "arcsin"})


def _written(eqn: compat.JaxprEqn, source: _Source | None) -> bool:
    """``eqn`` is a call on the user's line (not an equation inside a library function)."""
    return source is not None and source.holder(eqn) is eqn and callee(eqn) in _NUMPY


def find(closed: compat.ClosedJaxpr | compat.Jaxpr, births: Sequence[compat.JaxprEqn],
         group: str | None = None) -> list[Rewrite]:
    """The rewrites whose match covers one of ``births`` (equations where the NaN/inf was born), root first.

    Every equation of a jaxpr that holds a birth (inside ``jit``, ``scan``,
    ``cond``… bodies too) is tried as a pattern's root; ``group`` keeps one
    group of patterns.
    """
    wanted = {id(b) for b in births}
    order = {id(b): k for k, b in reversed(list(enumerate(births)))}
    found: list[tuple[int, int, Rewrite]] = []
    holders = {id(j): j for e, j in walk.equations(closed) if id(e) in wanted}
    source = _Source(closed)
    for jaxpr in holders.values():
        prod = {v: e for e in jaxpr.eqns for v in e.outvars}
        for eqn in jaxpr.eqns:
            if len(eqn.outvars) != 1:
                continue
            done: set[str] = set()
            for k, pat in enumerate(PATTERNS):
                if (group is not None and pat.group != group) or pat.function in done:
                    continue
                if pat.group == "primitive" and not _written(eqn, source):
                    continue  # inside a library function: not a call the user can replace
                for caps, covered in _match(pat.shape, eqn.outvars[0], prod, {}):
                    hits = [order[id(e)] for e in covered if id(e) in wanted]
                    if not hits:
                        continue
                    done.add(pat.function)
                    names, fn, template = pat.build(caps)
                    texts = [source.operand(_operand(caps, n), eqn, covered, prod) for n in names]
                    rw = Rewrite(pat, eqn, tuple(_operand(caps, n) for n in names), fn,
                                 _call_text(template, names, texts), tuple(covered), source.text(eqn), source.span(eqn))
                    found.append((min(hits), k, rw))
                    break
    found.sort(key=lambda t: (t[0], t[1]))
    return [rw for _, _, rw in found]



def _operand(caps: Caps, name: str) -> compat.Atom:
    atom = caps[name]
    assert not isinstance(atom, compat.JaxprEqn)  # a name (not an "@tag") captures an operand
    return atom

# --------------------------------------------------------------------------- a fully masked softmax row


def _producer(jaxpr: compat.Jaxpr) -> dict[compat.Var, compat.JaxprEqn]:
    return {v: e for e in jaxpr.eqns for v in e.outvars}


def max_shift(closed: compat.ClosedJaxpr | compat.Jaxpr, eqn: compat.JaxprEqn) -> bool:
    """``eqn`` is the max shift ``x - max(x)`` of a softmax, log_softmax or logsumexp.

    Its second operand is the row maximum of its first: a ``reduce_max`` of
    it, through ``max(-inf, .)``, ``stop_gradient``, broadcasts and reshapes.
    A row of ``x`` that is all ``-inf`` gives ``-inf - (-inf) = NaN`` here for
    the whole row (a fully masked attention row).
    """
    if eqn.primitive.name != "sub" or len(eqn.invars) != 2:
        return False
    holder = next((j for e, j in walk.equations(closed) if e is eqn), None)
    if holder is None:
        return False
    prod = _producer(holder)
    x, atom = eqn.invars
    for _ in range(8):
        src = None if isinstance(atom, compat.Literal) else prod.get(atom)
        if src is None:
            return False
        name = src.primitive.name
        if name == "reduce_max":
            return src.invars[0] is x
        if name in ("broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type", "squeeze",
                    "expand_dims"):
            atom = src.invars[0]
        elif name == "max" and len(src.invars) == 2:
            lit = [a for a in src.invars if compat.is_literal(a)]
            if not lit:
                return False
            atom = next(a for a in src.invars if not compat.is_literal(a))
        else:
            return False
    return False


def masked_row_advice(closed: compat.ClosedJaxpr | compat.Jaxpr, eqn: compat.JaxprEqn, line: str) -> str:
    """The code change for a softmax over a fully ``-inf`` row (``""`` when ``eqn`` is not such a max shift)."""
    if not max_shift(closed, eqn):
        return ""
    text = source_text(eqn) or source_text(_Source(closed).holder(eqn))
    call = f" (`{text}`)" if text else ""
    return (f"a row whose scores are all -inf (fully masked) makes the max shift of the softmax at {line}{call} "
            "compute -inf - (-inf) = NaN for the whole row. Mask with a finite value instead, "
            "`jnp.where(mask, scores, jnp.finfo(scores.dtype).min)`, or pass the mask as "
            "`jax.nn.softmax(scores, where=mask)` (a fully masked row is then 0); and drop padded rows with "
            "`jnp.where`, not by multiplying by 0 (NaN * 0 is NaN)")
