"""RuleTable: an immutable mapping from op name to Rule."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from gradkit._src.errors import GradkitError
from gradkit._src.rule import Rule


class RuleTable(Mapping[str, Rule]):
    """An immutable mapping from op name (primitive, named op, custom function) to :class:`Rule`.

    Lookup is a dict lookup; rules that never match cost nothing, so one table
    can hold thousands of rules. Tables merge with ``|`` (the right side wins)
    and have a :attr:`fingerprint` that the dispatcher uses as a cache key.

    Args:
      rules: a mapping from op name to :class:`Rule` (or another table).

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> clip = gk.vjp_rule(lambda op, g: (jnp.clip(g, -1.0, 1.0),))
      >>> t = gk.RuleTable({"sin": clip}) | gk.RuleTable({"cos": clip})
      >>> sorted(t), "sin" in t, len(t.fingerprint)
      (['cos', 'sin'], True, 16)
    """

    __slots__ = ("_rules", "_fingerprint")

    def __init__(self, rules: Mapping[str, Rule] | None = None):
        rules = {} if rules is None else rules
        if not isinstance(rules, Mapping):
            raise GradkitError(
                f"RuleTable expects a mapping from op name to rule, got {type(rules).__name__}. "
                "Write gk.RuleTable({'sqrt': gk.vjp_rule(fn)}).")
        checked: dict[str, Rule] = {}
        for name, rule in rules.items():
            if not isinstance(name, str) or not name or name != name.strip():
                raise GradkitError(
                    f"table entry {name!r}: op names must be non-empty strings without surrounding "
                    "spaces, such as 'sqrt' or the name given to gk.op.")
            if not isinstance(rule, Rule):
                hint = ("wrap the function with gk.vjp_rule(fn) (reverse mode) or gk.jvp_rule(fn) "
                        "(forward mode)") if callable(rule) else "give a rule made by gk.vjp_rule or gk.jvp_rule"
                raise GradkitError(f"table entry {name!r} is not a rule: got {type(rule).__name__}; {hint}.")
            checked[name] = rule
        self._rules: dict[str, Rule] = checked
        self._fingerprint: str | None = None

    # Mapping protocol
    def __getitem__(self, name: str) -> Rule:
        return self._rules[name]

    def get(self, name: str, default: Any = None) -> Any:  # hot path: no Mapping mixin overhead
        return self._rules.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._rules

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def names(self) -> frozenset[str]:
        return frozenset(self._rules)

    def __or__(self, other: Mapping[str, Rule]) -> RuleTable:
        if not isinstance(other, Mapping):
            return NotImplemented
        other_rules = other._rules if isinstance(other, RuleTable) else RuleTable(other)._rules
        return RuleTable({**self._rules, **other_rules})

    def __ror__(self, other: Mapping[str, Rule]) -> RuleTable:
        if not isinstance(other, Mapping):
            return NotImplemented
        return RuleTable(other) | self

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RuleTable) and self.fingerprint == other.fingerprint

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {r.mode}_rule({r.name})" for k, r in self._rules.items())
        return f"RuleTable({{{inner}}})"

    @property
    def fingerprint(self) -> str:
        """A 16-hex-digit digest of the table's entries, used as a cache key.

        Equal for tables with the same names mapped to the same rules. Library
        rules (from config) fingerprint by name and parameters, so the value is
        stable across processes; user functions fingerprint by identity.
        """
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name in sorted(self._rules):
                rule = self._rules[name]
                h.update(repr((name, rule.mode, rule.key)).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @classmethod
    def from_dict(cls, config: Mapping[str, Any]) -> RuleTable:
        """Builds a table from a declarative config naming library rules.

        Each entry maps an op name to a library rule name, or to a dict with
        ``rule`` and that rule's parameters. Nothing is imported or evaluated.

        Examples:
          >>> import gradkit as gk
          >>> t = gk.RuleTable.from_dict({"sqrt": "safe", "round": "straight_through"})
          >>> sorted(t)
          ['round', 'sqrt']
        """
        from gradkit._src import config as _config

        return _config.table_from_dict(config)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> RuleTable:
        """Builds a table from a TOML file with the same entries as :meth:`from_dict`.

        Examples:
          >>> import pathlib, tempfile, gradkit as gk
          >>> p = pathlib.Path(tempfile.mkdtemp()) / "rules.toml"
          >>> _ = p.write_text('sqrt = "safe"\\nlog = {rule = "clamped_log", eps = 1e-30}\\n')
          >>> sorted(gk.RuleTable.from_toml(p))
          ['log', 'sqrt']
        """
        from gradkit._src import config as _config

        return _config.table_from_toml(path)
