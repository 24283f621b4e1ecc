"""``override(fn, table, strict=True)``: does the table mean something for this program?

What a user means by a table decides what is checked:

* **the user's own entries** (a dict, ``gk.RuleTable({...})``, a TOML
  config, ``gk.tables.SAFE["sqrt"]`` put in a dict) are checked one by one:
  each names an op it expects, so each must match an op of the program
  (inside its scope, for a scoped entry);
* **a shipped table** (``gk.tables.SAFE``, ``STABLE``, ...: entries whose
  :meth:`RuleTable.origin` is set) is one unit: it covers every op it might
  meet, so it passes when *some* rule of it matches an op of the program
  (inside its scope). Its entries are grouped by scope, so
  ``SAFE.within("enc") | SAFE.within("dec")`` is two units (each scope must
  hold a match) and ``(SAFE | STABLE).within("dec")`` one, as the table it
  equals.

The message names what was checked and what failed; it says "fix the scope"
only where a scope matches no equation of the program at all (with the
scopes the program has, and the module paths of its Flax NNX and Equinox
arguments), and "fix the names" only where a user's entry names an op the
program lacks.

Whatever ``strict`` says, :func:`check_indices` refuses a scope that
indexes into a loop body's module (``"layers.3"`` of a stack ``nnx.scan``
runs): its body is traced once for every iteration, so no equation belongs
to one index, and the entry would match nothing, silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gradkit._src import compat
from gradkit._src.core import walk
from gradkit._src.core.module_paths import Path, dotted
from gradkit._src.core.scope import Scope, show, split_key
from gradkit._src.core.splice import op_name
from gradkit._src.core.table import RuleTable
from gradkit._src.errors import GradkitError, callable_name, near_misses

__all__ = ["check", "check_indices"]


class _Unit:
    """The entries of one or more shipped tables under one scope (``None``: unscoped)."""

    def __init__(self, scope: Scope | None) -> None:
        self.scope = scope
        self.tables: set[str] = set()
        self.ops: set[str] = set()

    @property
    def label(self) -> str:
        names = " | ".join(sorted(self.tables))
        return names if self.scope is None else f"{names} within scope '{self.scope.text}'"


def check(fn: Callable[..., object], table: RuleTable, body: compat.Jaxpr, modules: Sequence[Path] = ()) -> None:
    """Raises a :class:`GradkitError` naming what matched nothing (see the module docstring).

    ``modules``: the attribute paths of the modules among the function's
    arguments (``module_paths.collecting``), named when a scope matched nothing.
    """
    where: dict[str, set[tuple[str, ...]]] = {}  # op name -> the name-stack scopes it occurs at
    if table.scoped_ops:
        for eqn, scopes in walk.scoped_equations(body):
            where.setdefault(op_name(eqn), set()).add(scopes)
    else:  # no scope to read: every op at the top level
        for eqn, _ in walk.equations(body):
            where.setdefault(op_name(eqn), set()).add(())
    stacks = {s for ss in where.values() for s in ss}

    units: dict[str | None, _Unit] = {}
    names: list[str] = []  # the user's unscoped entries
    scoped: list[tuple[str, Scope, str]] = []  # the user's scoped entries
    for key in table:
        sc, op = split_key(key)
        origin = table.origin(key)
        if origin is not None:
            unit = units.setdefault(None if sc is None else sc.text, _Unit(sc))
            unit.tables.add(origin)
            unit.ops.add(op)
        elif sc is None:
            names.append(key)
        else:
            scoped.append((key, sc, op))

    empty: dict[str, list[str]] = {}  # scope text -> what was scoped to it, for scopes that hold no equation
    unmatched = sorted(n for n in names if n not in where)
    absent: list[str] = []  # the user's scoped entries whose scope exists but lacks their op
    for key, sc, op in scoped:
        if not any(sc.matches(s) for s in stacks):
            empty.setdefault(sc.text, []).append(op)
        elif not any(sc.matches(s) for s in where.get(op, ())):
            at = sorted({show(s) for s in where.get(op, ())})
            found = (f"it occurs in {_few(at)}" if at else "not in the program" + _did_you_mean(near_misses(op, where)))
            absent.append(f"  '{key}': no '{op}' inside scope '{sc.text}' ({found})")
    idle: list[str] = []  # shipped units with no rule matching (inside an existing scope)
    for unit in units.values():
        sc = unit.scope
        if sc is not None and not any(sc.matches(s) for s in stacks):
            empty.setdefault(sc.text, []).append(" | ".join(sorted(unit.tables)))
            continue
        if any(sc is None or sc.matches(s) for op in unit.ops for s in where.get(op, ())):
            continue
        there = _few(sorted(op for op, ss in where.items() if sc is None or any(sc.matches(s) for s in ss)), 12)
        idle.append(f"  {unit.label}: none of its {len(unit.ops)} rules matches an op "
                    + ("of the program (its ops: " if sc is None else "inside the scope (ops inside it: ")
                    + f"{there or 'none'})")
    if not (unmatched or empty or absent or idle):
        return

    paths = sorted({show(s[:i]) for s in stacks for i in range(1, len(s) + 1)})
    dotted_paths = [dotted(p) for p in sorted({p for p in modules if p}, key=lambda p: (len(p), p))]  # shallow first
    lines = [f"override({callable_name(fn)}, strict=True): {_checked(len(names) + len(scoped), units)}. "
             "These matched nothing:"]
    for text, what in empty.items():
        parts = {show((p,)) for s in stacks for p in s}
        close = near_misses(text.lstrip("/"), set(paths) | parts | set(dotted_paths))
        lines.append(f"  scope '{text}' (rules for {_few(what)}) matches no equation{_did_you_mean(close)}")
    lines += absent + idle
    for name in unmatched:
        close = near_misses(name, where)
        lines.append(f"  '{name}'" + (f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""))
    if unmatched:
        lines.append(f"Ops in the program: {', '.join(sorted(where))}. Fix the names of these entries.")
    if idle:
        lines.append("A shipped table is checked as a whole: some rule of it must match an op (inside its scope); "
                     "where none does, it changes nothing there. Apply it where its ops are, or drop it there.")
    if empty or absent:
        lines.append(
            f"Scopes in the program: {_few(paths, 20) or '(none: no jax.named_scope, module names or paths)'}. A "
            "scope's components ('/' or '.' between them) match a contiguous run of an equation's name stack "
            "(jax.named_scope, Flax linen names, the attribute paths of Flax NNX and Equinox modules passed as "
            "arguments), '*' within one component" + ("; fix the scope." if empty else "."))
        if dotted_paths:
            lines.append(f"Module paths of its arguments: {_few(dotted_paths, 30)} (a module's ops are inside its "
                         "path while it runs).")
        elif empty:
            lines.append("No module among its arguments: a Flax NNX or Equinox model's attribute paths ('enc', "
                         "'layers.3.attn') are scopes when the model is an argument of the overridden function (or "
                         "inside one), not closed over; else wrap the part in jax.named_scope('enc').")
    lines.append("Or drop strict=True.")
    raise GradkitError("\n".join(lines))


def _checked(entries: int, units: dict[str | None, _Unit]) -> str:
    """What strict checked: the user's entries one by one, each shipped table unit as a whole."""
    parts = []
    if entries:
        parts.append(f"{entries} entr{'y' if entries == 1 else 'ies'} of yours, one by one")
    if units:
        shown = "; ".join(u.label for u in units.values())
        parts.append(f"{len(units)} shipped table unit{'' if len(units) == 1 else 's'} as a whole ({shown}: "
                     "a unit passes when some rule of it matches)")
    return "checked " + "; ".join(parts)


def _few(items: Sequence[str], n: int = 6) -> str:
    return ", ".join(items[:n]) + (", ..." if len(items) > n else "")


def _did_you_mean(close: Sequence[str]) -> str:
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def check_indices(fn: Callable[..., object], table: RuleTable, body: compat.Jaxpr) -> None:
    """Refuses a scoped entry that indexes into a module a loop body runs (``"layers.3"``, ``layers`` a stack
    ``nnx.scan`` runs): it could match nothing. Cheap when no scope has a number after its first component."""
    if not table.scoped_ops:
        return
    indexed = [(key, sc, k) for key, sc, _ in table.scoped_entries() if (k := sc.index) is not None]
    if not indexed:
        return
    origins = walk.scope_origins(body, compat.is_loop)
    for key, sc, k in indexed:
        if any(sc.matches(s) for s, _ in origins):
            continue
        hit = next((s for s, flags in sorted(origins) if sc.ends_in(k, s, flags)), None)
        if hit is None:
            continue
        stack, rest = ".".join(sc.parts[:k]), sc.parts[k + 1:]
        inner = ".".join((*sc.parts[:k], *rest))
        every = f"'{stack}'" + (f", or '{inner}' for that part of every layer" if rest else "")
        raise GradkitError(
            f"override({callable_name(fn)}): the entry '{key}' scopes index {sc.parts[k]} inside '{stack}', which a "
            f"loop body runs (scopes {show(hit)}): nnx.scan over a stacked layer (as lax.scan or a while loop) traces "
            "its body once for every iteration, so no op belongs to one index, and the entry would match nothing. "
            f"Scope the whole stack ({every}), or give each layer a path of its own: an nnx.List of layers called "
            "in a Python loop.")
