"""Scopes: where in a program a table entry applies, by the equations' name stack.

A scoped table key is ``"<scope>::<op>"`` (:meth:`RuleTable.within` writes
them). A scope is a ``/``-separated pattern matched against the scope names
on an equation's name stack (:func:`gradkit._src.compat.name_scopes`, with
the enclosing equations' scopes in front for an equation inside a scan body,
a jitted function, a cond branch, ...):

* each component is a shell pattern matched against one stack component
  (``*``, ``?``, ``[...]``; a ``*`` never spans a ``/``); ``**`` is any number
  of components, none included;
* the components must match a **contiguous run** of the stack's, anywhere in
  it, and everything below that run is inside the scope: ``"enc"`` matches
  ``Model/enc`` and ``Model/enc/Dense_0`` but not ``Model/encoder``;
  ``"Model/enc"`` matches ``Model/enc/...`` only;
* a leading ``/`` anchors the run at the top of the stack (the overridden
  function's own top level): ``"/enc"`` matches ``enc/...`` but not
  ``Model/enc``.

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

from gradkit._src.errors import GradkitError

SEPARATOR = "::"
_WILDCARDS = frozenset("*?[")


@dataclasses.dataclass(frozen=True)
class Scope:
    """A parsed scope pattern (see the module docstring)."""

    text: str  # normalized: components joined by "/", a leading "/" when anchored
    parts: tuple[str, ...]
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
        return Scope(("/" if outer.anchored else "") + "/".join(parts), parts, outer.anchored)


@functools.lru_cache(maxsize=4096)
def _matches(parts: tuple[str, ...], anchored: bool, stack: tuple[str, ...]) -> bool:
    starts = (0,) if anchored else range(len(stack) + 1)
    return any(_prefix(parts, 0, stack, i) for i in starts)


def _prefix(parts: tuple[str, ...], pi: int, stack: tuple[str, ...], si: int) -> bool:
    """Whether ``parts[pi:]`` matches a run of ``stack`` starting at ``si`` (the rest of the stack is inside)."""
    if pi == len(parts):
        return True
    if parts[pi] == "**":
        return any(_prefix(parts, pi + 1, stack, k) for k in range(si, len(stack) + 1))
    return si < len(stack) and fnmatch.fnmatchcase(stack[si], parts[pi]) and _prefix(parts, pi + 1, stack, si + 1)


def parse(text: object, *, where: str = "scope") -> Scope:
    """The :class:`Scope` a pattern spells; a :class:`GradkitError` saying how to write it if malformed."""
    if not isinstance(text, str):
        raise GradkitError(f"{where}: a scope is a string such as 'enc', 'Model/enc' or '*/Conv_*', "
                           f"got {type(text).__name__} {text!r}.")
    anchored = text.startswith("/")
    body = text[1:] if anchored else text
    parts = tuple(body.split("/"))
    if (not body or any(not p or p != p.strip() for p in parts) or SEPARATOR in text):
        raise GradkitError(
            f"{where}: malformed scope {text!r}. A scope is one or more name-stack components joined by '/', "
            "each non-empty and without surrounding spaces or '::' ('enc', 'Model/enc', '*/Conv_*', "
            "'enc/**/Dense_0'); a leading '/' anchors it at the function's top level ('/Model').")
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
