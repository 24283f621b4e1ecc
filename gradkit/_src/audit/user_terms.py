"""A code fix in the user's own terms: the call as the source spells it, the line as it reads rewritten.

The audit finds a fix on the traced program (``gk.stable.safe_norm(x, axis=2)``);
:func:`in_user_terms` turns it into what the user would write on their line
(``axis=-1`` where the source says so, the expression a replaced name stood
for) and :func:`fix_file` finds the file a fix's location names.
"""

from __future__ import annotations

import ast
import dataclasses
import linecache
import re
from collections.abc import Iterable, Sequence

from gradkit._src.audit.report import Fix
from gradkit._src.checks.describe import short_path

__all__ = ["fix_file", "in_user_terms"]

_DEFS_BACK = 40  # source lines searched upwards for the assignment of a name the replaced text uses


def _strip_parens(arg: str) -> str:
    """``(a - b)`` -> ``a - b`` when the parentheses wrap the whole argument."""
    while arg.startswith("(") and arg.endswith(")"):
        try:
            inner = ast.parse(arg[1:-1], mode="eval").body
        except SyntaxError:
            return arg
        if isinstance(inner, ast.Tuple):
            return arg
        arg = arg[1:-1].strip()
    return arg


def _axis_kwargs(code: str) -> list[str]:
    """The text of every ``axis=`` argument of the calls in ``code``."""
    try:
        tree = ast.parse(code.strip(), mode="exec")
    except SyntaxError:
        return []
    return [ast.get_source_segment(code.strip(), kw.value) or "" for node in ast.walk(tree)
            if isinstance(node, ast.Call) for kw in node.keywords if kw.arg == "axis"]


def _definitions(file: str, line: int, names: Sequence[str]) -> dict[str, tuple[int, str]]:
    """For each name, the nearest assignment ``name = <text>`` above ``line`` in the same function."""
    found: dict[str, tuple[int, str]] = {}
    for n in range(line - 1, max(0, line - _DEFS_BACK), -1):
        text = linecache.getline(file, n)
        if re.match(r"\s*(async\s+)?def\s", text):
            break
        for name in names:
            m = re.match(rf"\s*{re.escape(name)}\s*=(?!=)\s*(.+?)\s*$", text)
            if m and name not in found:
                found[name] = (n, re.sub(r"\s*#[^'\"]*$", "", m.group(1)))
    return found


def fix_file(location: str, files: Iterable[str]) -> str:
    """The full path of a fix's ``file.py:12`` location: one of ``files`` (the finding's), else as written."""
    path = location.rpartition(":")[0]
    return next((f for f in files if f and short_path(f) == path), path)


def in_user_terms(fix: Fix, file: str) -> Fix:
    """A code fix's call and advice as the user would write them, and the line as it reads rewritten.

    The call keeps the source's own spelling of the reduction axis
    (``axis=-1`` where the source says so, not the traced ``axis=2``), from
    the replaced text or from the line that defines a name it uses (``d2 =
    jnp.sum(diff ** 2, axis=-1)`` for ``jnp.sqrt(d2)``), which the advice then
    quotes; ``fix.rewritten`` is the source line with the call in place.
    """
    if not isinstance(fix, Fix) or fix.kind != "code" or not fix.expression or not fix.replaces or not file:
        return fix
    if ";" in fix.location or not fix.location.rpartition(":")[2].isdigit():
        return fix
    line = int(fix.location.rpartition(":")[2])
    source = linecache.getline(file, line).rstrip("\n")
    if fix.replaces not in source:
        return fix
    expr = fix.expression
    m = re.fullmatch(r"(gk\.stable\.\w+)\((.*)\)", expr, re.S)
    if m is None:
        return fix
    try:
        call = ast.parse(expr, mode="eval").body
    except SyntaxError:
        return fix
    if not isinstance(call, ast.Call):
        return fix
    args = [_strip_parens(ast.get_source_segment(expr, a) or "") for a in call.args]
    kwargs = {kw.arg: ast.get_source_segment(expr, kw.value) or "" for kw in call.keywords if kw.arg}
    names = sorted({n.id for n in ast.walk(ast.parse(fix.replaces.strip(), mode="eval"))
                    if isinstance(n, ast.Name)}) if _parses(fix.replaces) else []
    defs = _definitions(file, line, [n for n in names if n not in " ".join(args)])
    if "axis" in kwargs:
        spelled = _axis_kwargs(fix.replaces) or [a for _, d in defs.values() for a in _axis_kwargs(d)]
        if len(set(spelled)) == 1 and _same_axis(spelled[0], kwargs["axis"]):
            kwargs["axis"] = spelled[0]
    new = m.group(1) + "(" + ", ".join(args + [f"{k}={v}" for k, v in kwargs.items()]) + ")"
    rewritten = source.replace(fix.replaces, new, 1).rstrip()
    advice = fix.advice.replace(f"`{expr}`", f"`{new}`")
    unused = [f"`{n} = {d}` (line {k})" for n, (k, d) in defs.items() if n not in new]
    if unused:
        advice = advice.rstrip(".") + f"; {' and '.join(unused)} is then unused."
    return dataclasses.replace(fix, expression=new, advice=advice, rewritten=rewritten)


def _parses(code: str) -> bool:
    try:
        ast.parse(code.strip(), mode="eval")
    except SyntaxError:
        return False
    return True


def _same_axis(user: str, traced: str) -> bool:
    """The user's axis spelling can stand for the traced one: equal, or negative (counted from the end)."""
    try:
        u, t = ast.literal_eval(user), ast.literal_eval(traced)
    except (ValueError, SyntaxError):
        return False
    us, ts = (u if isinstance(u, tuple) else (u,)), (t if isinstance(t, tuple) else (t,))
    if len(us) != len(ts) or not all(isinstance(a, int) for a in us + ts):
        return False
    return all(a == b or a < 0 for a, b in zip(us, ts))
