"""Scopes: where in a program a table entry applies, by the equations' name stack.

A scoped table key is ``"<scope>::<op>"`` (:meth:`RuleTable.within` writes
them). A scope is a pattern matched against the scope names on an
equation's name stack (:func:`gradkit._src.compat.name_scopes`, with the
enclosing equations' scopes in front for an equation inside a scan body, a
jitted function, a cond branch, ...):

* its **components** are separated by ``/`` or ``.``, the same either way:
  ``"layers.3.attn"`` is ``"layers/3/attn"`` (a name-stack entry is split at
  both too, so ``"eqx.nn.Linear"`` is three components and so is the
  Equinox scope it matches);
* each component is a shell pattern matched against one stack component
  (``*``, ``?``, ``[...]``; a ``*`` never spans a ``/`` or a ``.``); ``**``
  is any number of components, none included;
* the components must match a **contiguous run** of the stack's, anywhere in
  it, and everything below that run is inside the scope: ``"enc"`` matches
  ``Model/enc`` and ``Model/enc/Dense_0`` but not ``Model/encoder``;
  ``"Model/enc"`` matches ``Model/enc/...`` only;
* a leading ``/`` anchors the run at the top of the stack (the overridden
  function's own top level): ``"/enc"`` matches ``enc/...`` but not
  ``Model/enc``.

**Module paths** (:mod:`gradkit._src.core.module_paths`): a call of a Flax
NNX or Equinox module passed to an overridden function enters a name-stack
entry for its attribute path, marked with a leading ``.`` (:func:`path_entry`:
``.enc``, ``.layers.0``; ``.a|b`` for a module reached under two paths,
either of which matches). Such entries interleave with the names JAX records
(``jax.named_scope``, Equinox's ``eqx.nn.MLP``), so a stack is matched in
three **views**: the whole stack, its module paths alone (``encoder.layers.0``
across Equinox's type names), and the recorded names alone
(``eqx.nn.MLP/eqx.nn.Linear`` across the paths between them). :func:`show`
writes a stack for messages, marks dropped.

Precedence (:func:`rank`), where several entries for one op match one
equation: a scoped entry beats an unscoped one; between scopes, more
components (``**`` not counted) win, then more components without a
wildcard, then an anchored scope over a floating one. Two different rules
with equal rank on one equation are an error: tables compare equal by
content, not by order, so no order may decide.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import functools
import itertools
from collections.abc import Sequence

from gradkit._src.errors import GradkitError

SEPARATOR = "::"
PATH_MARK = "."  # a name-stack entry for a module's attribute path starts with it (module_paths enters them)
_ALTERNATIVES = "|"  # between the paths of a module reached under several
_WILDCARDS = frozenset("*?[")

# One token of a view of a stack: (component, index of its name-stack entry, last component of that entry).
_Token = tuple[str, int, bool]


@dataclasses.dataclass(frozen=True)
class Scope:
    """A parsed scope pattern (see the module docstring)."""

    text: str  # as written: components joined by "/" or ".", a leading "/" when anchored
    parts: tuple[str, ...]  # the components, split at both separators
    anchored: bool

    @property
    def rank(self) -> tuple[int, int, int]:
        """Higher is more specific: (components, literal components, anchored); ``**`` counts for nothing."""
        real = [p for p in self.parts if p != "**"]
        return len(real), sum(1 for p in real if not _WILDCARDS & set(p)), int(self.anchored)

    def matches(self, stack: tuple[str, ...]) -> bool:
        """Whether an equation with these name-stack scopes is inside this scope."""
        return _matches(self.parts, self.anchored, stack)

    def inside(self, outer: Scope) -> Scope:
        """This scope nested in ``outer``: ``outer/**/self``, or ``outer/self`` for an anchored ``self``."""
        parts = (*outer.parts, *(() if self.anchored else ("**",)), *self.parts)
        return Scope(outer.text + (self.text if self.anchored else "/**/" + self.text), parts, outer.anchored)

    @property
    def index(self) -> int | None:
        """Where the first component that is a number (``3`` in ``layers.3.attn``) stands, after another; else None."""
        return next((i for i, p in enumerate(self.parts) if i and p.isdigit()), None)

    def ends_in(self, k: int, stack: tuple[str, ...], entries: Sequence[bool]) -> bool:
        """Whether the first ``k`` components match a run of ``stack`` that ends with a whole entry ``i``
        for which ``entries[i]`` holds (the strict check's question: is ``layers`` of ``layers.3`` a loop body's?)."""
        for view in _views(stack):
            tokens = tuple(t for t, _, _ in view)
            starts = (0,) if self.anchored else range(len(tokens) + 1)
            for i in starts:
                for end in _ends(self.parts[:k], 0, tokens, i):
                    if end and view[end - 1][2] and entries[view[end - 1][1]]:
                        return True
        return False


def path_entry(paths: Sequence[tuple[str, ...]]) -> str:
    """The name-stack entry of a module call at these attribute paths (relative to the module calling it).

    Examples:
      >>> path_entry([("layers", "0")]), path_entry([("a",), ("b",)])
      ('.layers.0', '.a|b')
    """
    return PATH_MARK + _ALTERNATIVES.join(".".join(p) for p in paths)


def show(stack: Sequence[str]) -> str:
    """A stack as messages write it: entries joined by ``/``, module-path marks dropped.

    Examples:
      >>> show((".enc", "attn_core", ".proj")), show(())
      ('enc/attn_core/proj', '(top level)')
    """
    return "/".join(e[len(PATH_MARK):] if _is_path(e) else e for e in stack) or "(top level)"


def module_paths(stack: Sequence[str]) -> tuple[str, ...]:
    """The dotted module paths a stack's path entries spell (one per alternative), for messages.

    Examples:
      >>> module_paths((".enc", "eqx.nn.MLP", ".layers.0")), module_paths(("enc",))
      (('enc.layers.0',), ())
    """
    alts = [e[len(PATH_MARK):].split(_ALTERNATIVES) for e in stack if _is_path(e)]
    return tuple(".".join(c) for c in itertools.product(*alts)) if alts else ()


def _is_path(entry: str) -> bool:
    return entry.startswith(PATH_MARK) and len(entry) > len(PATH_MARK)


@functools.lru_cache(maxsize=4096)
def _views(stack: tuple[str, ...]) -> tuple[tuple[_Token, ...], ...]:
    """The token sequences a stack is matched as: whole, module paths alone, recorded names alone (each
    alternative of a path entry spelled out)."""
    entries: list[tuple[bool, list[list[_Token]]]] = []
    for i, e in enumerate(stack):
        path = _is_path(e)
        alts = e[len(PATH_MARK):].split(_ALTERNATIVES) if path else [e]
        spelled = []
        for alt in alts:
            tokens = alt.split(".")
            spelled.append([(t, i, j == len(tokens) - 1) for j, t in enumerate(tokens)])
        entries.append((path, spelled))
    views: dict[tuple[_Token, ...], None] = {}
    for keep in (lambda p: True, lambda p: p, lambda p: not p):
        chosen = [spelled for path, spelled in entries if keep(path)]
        if entries and not chosen:
            continue  # a view with nothing in it (no path entry, or nothing but them) matches only what the whole does
        for combo in itertools.product(*chosen):
            views[tuple(t for part in combo for t in part)] = None
    return tuple(views)


@functools.lru_cache(maxsize=4096)
def _matches(parts: tuple[str, ...], anchored: bool, stack: tuple[str, ...]) -> bool:
    for view in _views(stack):
        tokens = tuple(t for t, _, _ in view)
        starts = (0,) if anchored else range(len(tokens) + 1)
        if any(_prefix(parts, 0, tokens, i) for i in starts):
            return True
    return False


def _prefix(parts: tuple[str, ...], pi: int, stack: tuple[str, ...], si: int) -> bool:
    """Whether ``parts[pi:]`` matches a run of ``stack`` starting at ``si`` (the rest of the stack is inside)."""
    if pi == len(parts):
        return True
    if parts[pi] == "**":
        return any(_prefix(parts, pi + 1, stack, k) for k in range(si, len(stack) + 1))
    return si < len(stack) and fnmatch.fnmatchcase(stack[si], parts[pi]) and _prefix(parts, pi + 1, stack, si + 1)


def _ends(parts: tuple[str, ...], pi: int, stack: tuple[str, ...], si: int) -> set[int]:
    """Where the runs of ``stack`` from ``si`` that ``parts[pi:]`` matches end."""
    if pi == len(parts):
        return {si}
    if parts[pi] == "**":
        return {e for k in range(si, len(stack) + 1) for e in _ends(parts, pi + 1, stack, k)}
    if si < len(stack) and fnmatch.fnmatchcase(stack[si], parts[pi]):
        return _ends(parts, pi + 1, stack, si + 1)
    return set()


def parse(text: object, *, where: str = "scope") -> Scope:
    """The :class:`Scope` a pattern spells; a :class:`GradkitError` saying how to write it if malformed."""
    if not isinstance(text, str):
        raise GradkitError(f"{where}: a scope is a string such as 'enc', 'Model/enc', 'layers.3.attn' or "
                           f"'*/Conv_*', got {type(text).__name__} {text!r}.")
    anchored = text.startswith("/")
    body = text[1:] if anchored else text
    parts = tuple(p for c in body.split("/") for p in c.split("."))
    if (not body or any(not p or p != p.strip() for p in parts) or SEPARATOR in text
            or _ALTERNATIVES in text):
        raise GradkitError(
            f"{where}: malformed scope {text!r}. A scope is one or more name-stack components joined by '/' or "
            "'.' (the same: 'layers.3.attn' is 'layers/3/attn'), each non-empty and without surrounding spaces, "
            "'::' or '|' ('enc', 'Model/enc', '*/Conv_*', 'enc/**/Dense_0'); a leading '/' anchors it at the "
            "function's top level ('/Model').")
    return Scope(text, parts, anchored)


def split_key(key: str, *, where: str = "table entry") -> tuple[Scope | None, str]:
    """``"enc::sqrt"`` -> (scope ``enc``, ``"sqrt"``); an unscoped key -> (None, key)."""
    if SEPARATOR not in key:
        return None, key
    scope_text, _, op = key.rpartition(SEPARATOR)
    if not op or op != op.strip():
        raise GradkitError(f"{where} {key!r}: a scoped entry is '<scope>::<op>', such as 'enc::sqrt' or "
                           "'*/Conv_*::conv_general_dilated'; the op name after '::' is missing or padded.")
    return parse(scope_text, where=f"{where} {key!r}"), op


def join_key(scope: Scope, op: str) -> str:
    return f"{scope.text}{SEPARATOR}{op}"
