"""From births to report steps: which elements, where in the source, and what happened there.

:func:`select` keeps, of a birth, only the elements that lead to the
non-finite gradient (a ``log`` may give NaN at -1 and -inf at 0 while only the
0 reaches the gradient); :func:`step` turns that selection into a
:class:`~gradkit._src.audit.report.Step`: the op, its user source line (with
the call underlined), the loop iteration or branch it ran in, a sentence with
the values there ("``exp`` overflowed to inf for 3 of 128 elements (max input
120)") and the elements themselves, with their indices.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.provenance import is_elementwise
from gradkit._src.audit.replay.state import Birth, Context, Occurrence
from gradkit._src.audit.report import Element, Step
from gradkit._src.checks.describe import fmt, nonfinite_mask, short_path

_KEEP_ELEMENTS = 16  # elements kept per step in the report (the count says how many there are)


@dataclasses.dataclass(frozen=True)
class Selection:
    """The elements of a birth that lead to the non-finite gradient.

    Attributes:
      birth: the birth.
      occ: the occurrence shown (the earliest kept one that holds a selected element).
      masks: per position (output, or operand for a backward birth): the selected elements of ``occ``.
      iterations: the loop iterations the selected elements were born in.
    """

    birth: Birth
    occ: Occurrence | None
    masks: dict[int, np.ndarray]
    iterations: tuple[int, ...]

    @property
    def count(self) -> int:
        return int(sum(m.sum() for m in self.masks.values()))


def select(b: Birth, elements: Iterable[tuple[int, int]]) -> Selection:
    """The :class:`Selection` of ``b`` for ``elements`` (``(position, flat index)`` pairs)."""
    wanted = sorted(set(elements))
    its = sorted({it for pe in wanted for it in b.elements.get(pe, []) if it is not None})
    for occ in sorted(b.occurrences, key=lambda o: o.loops):  # the earliest iteration first
        masks = {}
        for pos, m in occ.masks.items():
            sel = np.zeros(m.size, bool)
            idx = [e for p, e in wanted if p == pos and 0 <= e < m.size]
            sel[idx] = True
            if (pos, -1) in wanted:  # past the per-birth atom limit elements share one atom: take them all
                sel[:] = True
            sel &= m.reshape(-1)
            if sel.any():
                masks[pos] = sel.reshape(m.shape)
        if masks:
            return Selection(b, occ, masks, tuple(its))
    return Selection(b, b.occurrences[0] if b.occurrences else None, {}, tuple(its))


# --------------------------------------------------------------------------- places


def where(ctx: Sequence[Context], iterations: Sequence[int]) -> str:
    """``inside scan at f.py:12 (iterations 1, 3 of 5), inside cond branch 1 (of 2) at f.py:9``."""
    parts = []
    loops = [x for x in ctx if x.kind in ("scan", "while")]
    for c in ctx:
        if c.kind in ("scan", "while"):
            its = sorted(iterations) if iterations and c is loops[-1] else [c.index]
            name = "scan" if c.kind == "scan" else "while_loop"
            parts.append(f"inside {name} at {loc(c.eqn)} ({_iterations(its, c.size)})")
        elif c.kind == "cond":
            parts.append(f"inside cond branch {c.index} (of {c.size}) at {loc(c.eqn)}")
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


def _span(eqn: compat.JaxprEqn, ctx: Sequence[Context] = ()) -> tuple[str, int, str, int, int] | None:
    """The user source span of ``eqn``, else of the innermost enclosing jit/scan/cond that has one."""
    span = compat.source_span(eqn)
    for c in reversed(list(ctx)):
        if span is not None:
            break
        span = compat.source_span(c.eqn)
    return span


def loc(eqn: compat.JaxprEqn, ctx: Sequence[Context] = ()) -> str:
    """``file.py:12`` of ``eqn``'s user source line."""
    span = _span(eqn, ctx)
    return f"{short_path(span[0])}:{span[1]}" if span else "unknown source line"


def _code(eqn: compat.JaxprEqn, ctx: Sequence[Context] = ()) -> str:
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


def callee(eqn: compat.JaxprEqn) -> str:
    """The library function (``logsumexp``, ``norm``) the user's line called to make ``eqn``, or ""."""
    c = compat.library_callee(eqn)
    if c is None:
        return ""
    name = c[1].split(".")[-1]
    if name.startswith("_") or name == eqn.primitive.name or name in ("<lambda>", "<module>"):
        return ""
    return name


def via(b: Birth) -> str:
    """The library function the op sits in: from the source stack, else the enclosing jit's name."""
    return callee(b.eqn) or next((c.name for c in reversed(b.ctx) if c.kind == "jit" and c.name), "")


def _ctx_of(sel: Selection) -> tuple[Context, ...]:
    """The birth's context with the loop indices of the shown occurrence."""
    if sel.occ is None:
        return sel.birth.ctx
    loops = iter(sel.occ.loops)
    return tuple(dataclasses.replace(c, index=next(loops)) if c.kind in ("scan", "while") else c
                 for c in sel.birth.ctx)


def step(sel: Selection, input_names: dict[compat.Var, str]) -> Step:
    """The report :class:`Step` of a selection; ``input_names`` names the audited inputs' variables."""
    b = sel.birth
    ctx = _ctx_of(sel)
    span = _span(b.eqn, ctx)
    file, line, func = (span[0], span[1], span[2]) if span else ("", 0, "")
    msg = _explain_forward(sel) if b.phase == "forward" else _explain_backward(sel)
    place = ", ".join(w for w in where(ctx, sel.iterations).split(", ") if not w.startswith("inside `"))
    size = int(next(iter(sel.masks.values())).size) if sel.masks else 0
    return Step(b.name, b.phase, b.kind, file, line, func, place, msg, _code(b.eqn, ctx), via(b), b.is_rule,
                _distinct(sel), size, _elements(sel, input_names))


def _distinct(sel: Selection) -> int:
    """Elements selected, an index selected in several operands' cotangents counted once."""
    masks = [m.reshape(-1) for m in sel.masks.values()]
    if masks and len({m.size for m in masks}) == 1:
        return int(np.any(np.stack(masks), axis=0).sum())
    return sel.count


# --------------------------------------------------------------------------- elements


_ARG_NAMES = {"atan2": ("y", "x"), "div": ("x", "y"), "pow": ("x", "y"), "mul": ("x", "y"), "sub": ("x", "y"),
              "add": ("x", "y"), "select_n": ("which", "a", "b")}


# NumPy-style functions whose operands are the primitive's operands, one for one (``jnp.sqrt(d2)``)
_THIN = frozenset({"", "sqrt", "log", "log1p", "log2", "log10", "exp", "exp2", "expm1", "power", "divide",
                   "true_divide", "multiply", "add", "subtract", "arctan2", "arccos", "arcsin", "arctanh",
                   "arccosh", "reciprocal", "square", "tan", "cbrt", "rsqrt"})


def _input_name(b: Birth, k: int, input_names: dict[compat.Var, str]) -> str | None:
    """The audited input's name when operand ``k`` of ``b``'s equation is that input."""
    atom = b.eqn.invars[k]
    return None if isinstance(atom, compat.Literal) else input_names.get(atom)


def source_operands(eqn: compat.JaxprEqn) -> list[str] | None:
    """The user's text for each operand of ``eqn`` where the source line's call passes them one for one.

    ``jnp.sqrt(d2)`` -> ``["d2"]``, ``w * x`` -> ``["w", "x"]``; ``None`` when
    the equation sits inside a library function (``sqrt`` in ``jnp.linalg.norm``
    takes no operand the line wrote) or the text is not known.
    """
    if callee(eqn) not in _THIN:
        return None
    span = compat.source_span(eqn)
    if span is None:
        return None
    file, line, _, c0, c1 = span
    text = linecache.getline(file, line).rstrip("\n")
    if not 0 <= c0 < c1 <= len(text):
        return None
    code = text[c0:c1]
    try:
        node = ast.parse(code, mode="eval").body
    except SyntaxError:
        return None
    if isinstance(node, ast.Call) and not node.keywords and not any(isinstance(a, ast.Starred) for a in node.args):
        args: list[ast.expr] = list(node.args)
    elif isinstance(node, ast.BinOp):
        args = [node.left, node.right]
    elif isinstance(node, ast.UnaryOp):
        args = [node.operand]
    else:
        return None
    if len(args) != len(eqn.invars):
        return None
    out = [ast.get_source_segment(code, a) or "" for a in args]
    return out if all(out) else None


def in_library(b: Birth) -> bool:
    """``b``'s equation is a library function's own code, not an expression of the user's line.

    It is when the user's line called a library function that made it (the
    ``sqrt`` of ``jnp.linalg.norm``: :func:`callee`), or when no user line made
    it at all (the body of a jitted library function). A NumPy-style function
    that passes its operands one for one (``jnp.sqrt(d2)``, ``jnp.arctan2(y, x)``)
    is the user's line itself.
    """
    name = callee(b.eqn)
    if name:
        return name not in _THIN
    return compat.source_span(b.eqn) is None


def library_name(b: Birth) -> str:
    """The library function whose code made ``b``'s equation (``norm``), or "" when not known or not one."""
    if not in_library(b):
        return ""
    return callee(b.eqn) or next((c.name for c in reversed(b.ctx) if c.kind == "jit" and c.name), "")


def operand_label(b: Birth, k: int) -> str:
    """A name for operand ``k`` of ``b``'s equation that no user variable can have.

    "`sqrt`'s operand in `norm`", "`div`'s operand 2": the op's own operand,
    never a bare ``x`` that reads as the user's ``x``. Used where the operand
    is neither an audited input nor an expression the user's line writes.
    """
    lib = library_name(b)
    what = f"`{b.name}`'s operand" + ("" if len(b.eqn.invars) == 1 else f" {k + 1}")
    return what + (f" in `{lib}`" if lib else "")


def _arg_name(b: Birth, k: int, input_names: dict[compat.Var, str], texts: Sequence[str] | None = None) -> str:
    name = _input_name(b, k, input_names)
    if name is not None:
        return name
    if texts is not None and not compat.is_literal(b.eqn.invars[k]):
        return texts[k]
    return operand_label(b, k)


def _elements(sel: Selection, input_names: dict[compat.Var, str]) -> tuple[Element, ...]:
    b, occ = sel.birth, sel.occ
    if occ is None:
        return ()
    out: list[Element] = []
    it = occ.iteration
    texts = source_operands(b.eqn) if is_elementwise(b.eqn) else None
    result = "result" if texts is None or callee(b.eqn) else f"result of `{b.name}`"
    for pos, mask in sorted(sel.masks.items()):
        shape = mask.shape
        operands: Sequence[int] = range(len(occ.invals)) if (b.phase == "backward" or is_elementwise(b.eqn)) else ()
        if b.phase == "backward" and not is_elementwise(b.eqn):
            operands = [pos]
        for e in np.flatnonzero(mask)[:_KEEP_ELEMENTS - len(out)]:
            idx = tuple(int(i) for i in np.unravel_index(int(e), shape))
            vals, ks = [], []
            for k in operands:
                v = np.asarray(occ.invals[k])
                if v.shape in (shape, ()) and jnp.issubdtype(v.dtype, jnp.number):
                    vals.append((_arg_name(b, k, input_names, texts), float(np.real(v if v.shape == () else v[idx]))))
                    ks.append(k)
            if not vals:  # no operand lines up with the result: the result of the op, named as such
                vals.append((f"result of `{b.name}`" if result == "result" else result,
                             float(np.real(np.asarray(occ.outvals[pos]).reshape(-1)[int(e)]))))
            named = len(ks) == 1 and np.shape(occ.invals[ks[0]]) == shape and (
                _input_name(b, ks[0], input_names) is not None or texts is not None)
            el = Element(idx, tuple(vals), it, named)
            if all(str(el) != str(o) for o in out):  # in both operands' cotangents, or another iteration: once
                out.append(el)
    return tuple(out)


# --------------------------------------------------------------------------- what happened


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


def at(x: ArrayLike, mask: np.ndarray) -> np.ndarray | None:
    """The values of ``x`` (broadcast to the mask's shape) at the mask, as float64; ``None`` if not numeric."""
    a = np.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.number):
        return None
    try:
        return np.real(np.broadcast_to(a, mask.shape)[mask]).astype(np.float64)
    except ValueError:
        return None


def _of(count: int, total: int) -> str:
    return f" for {count} of {total} elements" if total > 1 else ""


def _first(sel: Selection) -> tuple[int, np.ndarray] | None:
    return min(sel.masks.items(), key=lambda kv: kv[0]) if sel.masks else None


_OVERFLOW = {"exp", "exp2", "expm1", "cosh", "sinh", "pow", "integer_pow", "square", "mul", "dot_general",
             "reduce_sum", "add", "sub", "cumsum", "reduce_prod", "cumprod", "tan", "erf_inv", "lgamma", "digamma"}
_BINARY_NAMES = {"add": "+", "sub": "-", "mul": "·", "div": "/"}


def _explain_forward(sel: Selection) -> str:
    b, occ, first = sel.birth, sel.occ, _first(sel)
    p = b.name
    res = "NaN" if b.kind == "nan" else "inf"
    if occ is None or first is None:
        return f"`{p}` gave {res}"
    pos, mask = first
    outs = at(occ.outvals[pos], mask)
    ins = [at(x, mask) for x in occ.invals]
    res = _summ(outs) if outs is not None else res
    n = _of(int(mask.sum()), int(mask.size))
    x0 = ins[0] if ins else None
    if b.kind == "inf":
        if p in ("log", "log1p", "log2", "log10") and x0 is not None:
            return f"`{p}` of {_summ(x0)} gave {res}{n}"
        if p in ("div", "rem") and len(ins) == 2 and ins[1] is not None and ins[0] is not None:
            return f"`{p}` by zero gave {res}{n} (numerator {_summ(ins[0])}, denominator {_summ(ins[1])})"
        if p in _OVERFLOW:
            big = [v for v in ins if v is not None and v.size]
            shown = ""
            if big:
                shown = (f"max input {fmt(max(float(np.max(v)) for v in big))}" if p in ("exp", "exp2", "expm1")
                         else f"largest input magnitude {fmt(max(float(np.max(np.abs(v))) for v in big))}")
            return f"`{p}` overflowed to {res}{n}" + (f" ({shown})" if shown else "")
        if p in ("rsqrt", "reciprocal", "digamma", "lgamma", "tan") and x0 is not None:
            return f"`{p}` of {_summ(x0)} gave {res}{n}"
        vals = ", ".join(_summ(v) for v in ins if v is not None)
        return f"`{p}` of finite inputs ({vals}) gave {res}{n}"
    if len(ins) == 2 and ins[0] is not None and ins[1] is not None and p in _BINARY_NAMES:
        a, c = ins[0], ins[1]
        if p == "mul":
            return f"`mul` 0·inf gave NaN{n} ({_summ(a)} · {_summ(c)})"
        if p in ("add", "sub"):
            what = "inf - inf" if p == "sub" else "inf + (-inf)"
            return f"`{p}` {what} gave NaN{n} ({_summ(a)} {_BINARY_NAMES[p]} {_summ(c)})"
        kind = "0/0 " if np.all(a == 0) and np.all(c == 0) else ("inf/inf " if np.all(np.isinf(a)) else "")
        return f"`div` {kind}gave NaN{n} (numerator {_summ(a)}, denominator {_summ(c)})"
    if p in ("sqrt", "log", "log1p", "rsqrt", "pow", "acos", "asin", "acosh", "atanh", "lgamma") and x0 is not None:
        return f"`{p}` of {_summ(x0)} (outside its domain) gave NaN{n}"
    vals = ", ".join(_summ(v) for v in ins if v is not None)
    return f"`{p}` gave NaN{n} (inputs there: {vals})"


def _explain_backward(sel: Selection) -> str:
    b, occ, first = sel.birth, sel.occ, _first(sel)
    p = b.name
    res = "NaN" if b.kind == "nan" else "inf"
    if b.is_rule:
        return f"the table's rule for `{p}` returned a non-finite cotangent" + _rule_detail(sel)
    if occ is None or first is None:
        return f"backward of `{p}` gave {res}"
    k, mask = first
    assert occ.in_cts is not None  # a backward birth records its cotangents
    g = np.asarray(occ.in_cts[k])
    n = _of(int(mask.sum()), int(mask.size))
    x = np.asarray(occ.invals[k])
    xs = at(x, mask) if x.shape == g.shape else None
    names = _ARG_NAMES.get(p, ("x", "y", "z"))
    argname = "x" if len(occ.invals) == 1 else (names[k] if k < len(names) else f"input {k}")
    # inside a library function's code no operand is named (a bare x reads as the user's): "∂sqrt = inf (at 0)"
    lib = in_library(b)
    derivative = f"∂{p}/∂{argname}"
    if lib:
        derivative = f"∂{p}" if len(occ.invals) == 1 else f"∂{p}/∂(operand {k + 1})"
    where_ = ""
    if len(occ.invals) == 1 and xs is not None:
        where_ = ("" if lib else "x = ") + _summ(xs)
    elif all(np.shape(v) in (g.shape, ()) for v in occ.invals):
        vals = [at(v, mask) for v in occ.invals]
        if all(v is not None for v in vals):
            shown = "" if lib else "(" + ", ".join(
                names[j] if j < len(names) else f"in{j}" for j in range(len(vals))) + ") = "
            where_ = f"{shown}(" + ", ".join(_summ(v) for v in vals if v is not None) + ")"
    out_ct = occ.out_cts[0] if occ.out_cts and len(occ.out_cts) == 1 else None
    if out_ct is not None and np.shape(out_ct) == g.shape and len(occ.outvals) == 1 and is_elementwise(b.eqn):
        ct = at(out_ct, mask)
        partial = _partial(occ, b.eqn, k, mask)
        if partial is not None and ct is not None:
            return (f"backward of `{p}`: cotangent {_summ(ct)} × {derivative} = {_summ(partial)}"
                    + (f" (at {where_})" if where_ else "") + f" gave {res}{n}")
    return f"backward of `{p}` gave {res}{n} from finite cotangents" + (f" (at {where_})" if where_ else "")


def _rule_detail(sel: Selection) -> str:
    occ, first = sel.occ, _first(sel)
    if occ is None or first is None:
        return ""
    k, mask = first
    assert occ.in_cts is not None  # a backward birth records its cotangents
    g = np.asarray(occ.in_cts[k])
    x = at(occ.invals[k], mask) if np.shape(occ.invals[k]) == g.shape else None
    ct = at(occ.out_cts[0], mask) if occ.out_cts and np.shape(occ.out_cts[0]) == g.shape else None
    parts = [f"{'NaN' if sel.birth.kind == 'nan' else 'inf'}{_of(int(mask.sum()), int(mask.size))}".strip()]
    if x is not None:
        parts.append(f"at {'its operand' if in_library(sel.birth) else 'x'} = {_summ(x)}")
    if ct is not None:
        parts.append(f"incoming cotangent {_summ(ct)}")
    return " (" + ", ".join(parts) + ")"


def _partial(occ: Occurrence, eqn: compat.JaxprEqn, k: int, mask: np.ndarray) -> np.ndarray | None:
    """∂eqn/∂operand k at the masked elements (a JVP with a ones tangent)."""
    invals = list(occ.invals)

    def f(v: jax.Array) -> jax.Array:
        vals = list(invals)
        vals[k] = v
        return compat.bind(eqn, vals)[0]
    try:
        x = jnp.asarray(invals[k])
        _, t = jax.jvp(f, (x,), (jnp.ones_like(x),))
        return at(t, mask)
    except Exception:  # an op without a JVP at these values: the sentence goes without it
        return None


def zero_cotangent(chain: Sequence[Selection]) -> bool:
    """A backward birth multiplies a zero cotangent by an infinite derivative (0·inf)."""
    for sel in chain:
        occ, first = sel.occ, _first(sel)
        if sel.birth.phase != "backward" or occ is None or not occ.out_cts or first is None:
            continue
        ct = occ.out_cts[0]
        if np.shape(ct) == first[1].shape:
            v = at(ct, first[1])
            if v is not None and v.size and np.all(v == 0):
                return True
    return False


def nonfinite_indices(g: ArrayLike, limit: int = 16) -> tuple[tuple[int, ...], ...]:
    """The first ``limit`` non-finite elements of ``g``, as multi-indices."""
    m = nonfinite_mask(g)
    if m is None:
        return ()
    return tuple(tuple(int(i) for i in np.unravel_index(int(e), m.shape)) for e in np.flatnonzero(m)[:limit])
