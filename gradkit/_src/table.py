"""RuleTable: an immutable mapping from op name to Rule, and the declarative (dict / TOML) tables.

A declarative table maps op names to library rules::

    sqrt = "safe"
    log = {rule = "clamped_log", eps = 1e-30}
    round = "straight_through"
    my_softplus = {rule = "stable", op = "softplus"}

Nothing in it is imported or evaluated: a rule name is looked up in a fixed
registry (:data:`gradkit._src.library.LIBRARY`), so ``"os.system"`` is just an
unknown rule name. Unknown rules, unknown or missing parameters and bad values
are :class:`GradkitError`\\ s that list what is valid.
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from gradkit._src import library
from gradkit._src.errors import GradkitError
from gradkit._src.rule import Rule

if sys.version_info >= (3, 11):
    import tomllib as _toml
else:  # pragma: no cover - Python 3.10: the `tomli` dependency
    try:
        import tomli as _toml
    except ModuleNotFoundError:
        _toml = None


class RuleTable(Mapping[str, Rule]):
    """An immutable mapping from op name to :class:`Rule`.

    A key is a primitive's name (``"sqrt"``) or a :func:`gradkit.op` name, or
    ``"fn:<name>"`` for a function the program calls by its Python name (a
    ``jax.jit``-ed or ``custom_jvp``/``custom_vjp`` function). Lookup is a dict
    lookup; rules that never match cost nothing, so one table can hold
    thousands of rules. Tables merge with ``|`` (the right side wins), and
    compare equal to any mapping that makes the same table.

    Args:
      rules: a mapping from op name to a :class:`Rule`, or to a library rule
        by name (``"safe"``) or as ``{"rule": name, **params}``, exactly as in
        :meth:`from_dict`.

    Examples:
      >>> import jax.numpy as jnp, gradkit as gk
      >>> clip = gk.vjp_rule(lambda op, g: (jnp.clip(g, -1.0, 1.0),))
      >>> t = gk.RuleTable({"sin": clip}) | gk.RuleTable({"cos": clip})
      >>> sorted(t), "sin" in t, len(t.fingerprint)
      (['cos', 'sin'], True, 16)
    """

    __slots__ = ("_rules", "_fingerprint")

    def __init__(self, rules: Mapping[str, Any] | None = None, *, source: str | None = None):
        rules = {} if rules is None else rules
        if not isinstance(rules, Mapping):
            raise GradkitError(
                f"{source or 'RuleTable'} expects a mapping from op name to rule, got {type(rules).__name__}. "
                "Write gk.RuleTable({'sqrt': gk.vjp_rule(fn)}) or {'sqrt': 'safe', 'log': {'rule': "
                "'clamped_log', 'eps': 1e-30}}.")
        if isinstance(rules, RuleTable):
            self._rules: dict[str, Rule] = dict(rules._rules)
            self._fingerprint: str | None = rules._fingerprint
            return
        checked: dict[str, Rule] = {}
        for name, rule in rules.items():
            if not isinstance(name, str) or not name or name != name.strip():
                raise GradkitError(
                    f"{source + ': ' if source else ''}table entry {name!r}: op names must be non-empty strings "
                    "without surrounding spaces, such as 'sqrt', the name given to gk.op, or 'fn:softplus'.")
            checked[name] = rule if isinstance(rule, Rule) else _library_entry(name, rule, source)
        self._rules = checked
        self._fingerprint = None

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
        if isinstance(other, RuleTable):
            return self.fingerprint == other.fingerprint
        if not isinstance(other, Mapping):
            return NotImplemented
        try:  # a dict of rules (or of library rule names) that makes the same table
            return self.fingerprint == RuleTable(other).fingerprint
        except GradkitError:
            return False

    def __hash__(self) -> int:
        return hash(self.fingerprint)

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {r.mode}_rule({r.name})" for k, r in self._rules.items())
        return f"RuleTable({{{inner}}})"

    @property
    def fingerprint(self) -> str:
        """A 16-hex-digit digest that identifies the table's content (tables are equal iff it is).

        Equal for tables with the same names mapped to the same rules. Library
        rules (the ready tables, :meth:`from_dict`, :meth:`from_toml`) are
        identified by rule name and parameters, so their value is the same in
        every process (usable to record which table produced a result); rules
        made from your functions are identified by the function object, so
        their value holds within one process only.
        """
        if self._fingerprint is None:
            h = hashlib.sha256()
            for name in sorted(self._rules):
                rule = self._rules[name]
                h.update(repr((name, rule.mode, rule.key)).encode())
            self._fingerprint = h.hexdigest()[:16]
        return self._fingerprint

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], *, source: str = "config") -> RuleTable:
        """Builds a table from a declarative config naming library rules.

        Each entry maps an op name to a library rule name, or to a dict with
        ``rule`` and that rule's parameters (``gradkit rules`` lists them).
        Nothing is imported or evaluated. ``RuleTable(config)`` accepts the
        same entries (and :class:`Rule` values besides).

        Examples:
          >>> import gradkit as gk
          >>> t = gk.RuleTable.from_dict({"sqrt": "safe", "round": "straight_through"})
          >>> sorted(t), t == {"round": "straight_through", "sqrt": "safe"}
          (['round', 'sqrt'], True)
        """
        if not isinstance(config, Mapping):
            raise GradkitError(
                f"{source}: expected a mapping from op name to rule, got {type(config).__name__}. "
                "Write {'sqrt': 'safe', 'log': {'rule': 'clamped_log', 'eps': 1e-30}}.")
        return cls(config, source=source)

    @classmethod
    def from_toml(cls, path: str | os.PathLike[str]) -> RuleTable:
        """Builds a table from a TOML file with the same entries as :meth:`from_dict`.

        The rules may sit at the top level or under a ``[rules]`` table (or
        ``[tool.gradkit.rules]``, for a ``pyproject.toml``).

        Examples:
          >>> import pathlib, tempfile, gradkit as gk
          >>> p = pathlib.Path(tempfile.mkdtemp()) / "rules.toml"
          >>> _ = p.write_text('sqrt = "safe"\\nlog = {rule = "clamped_log", eps = 1e-30}\\n')
          >>> sorted(gk.RuleTable.from_toml(p))
          ['log', 'sqrt']
        """
        path = os.fspath(path)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise GradkitError(f"cannot read rule config {path}: {e.strerror or e}.") from None
        except UnicodeDecodeError as e:
            raise GradkitError(f"rule config {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                               "TOML files must be UTF-8.") from None
        data = _load_toml(text, path)
        tool = data.get("tool")
        if isinstance(tool, Mapping) and isinstance(tool.get("gradkit"), Mapping) and "rules" in tool["gradkit"]:
            data = tool["gradkit"]["rules"]
        elif set(data) == {"rules"} and isinstance(data["rules"], Mapping):
            data = data["rules"]
        return cls.from_dict(data, source=path)


def _library_entry(op_name: str, entry: Any, source: str | None) -> Rule:
    """The library rule an entry names: ``"safe"`` or ``{"rule": "clamped_log", "eps": 1e-30}``."""
    where = f"{source}: entry '{op_name}'" if source else f"table entry '{op_name}'"
    if isinstance(entry, str):
        return library.make_rule(entry, op_name, {}, where=where)
    if isinstance(entry, Mapping):
        if "rule" not in entry:
            raise GradkitError(
                f"{where} has no `rule` key: write {{rule = \"<name>\", <param> = <value>}}. Valid rules: "
                + ", ".join(library.LIBRARY) + ".")
        params = {k: v for k, v in entry.items() if k != "rule"}
        bad = [k for k in params if not isinstance(k, str)]
        if bad:
            raise GradkitError(f"{where}: parameter names must be strings, got {bad!r}.")
        return library.make_rule(entry["rule"], op_name, params, where=where)
    if callable(entry):
        raise GradkitError(f"{where} is not a rule: got {type(entry).__name__}; wrap the function with "
                           "gk.vjp_rule(fn) (reverse mode) or gk.jvp_rule(fn) (forward and reverse mode).")
    if source:  # a declarative config: only library rules can be written there
        raise GradkitError(
            f"{where}: expected a rule name (string) or a table {{rule = \"<name>\", ...}}, got "
            f"{type(entry).__name__} {entry!r}.")
    raise GradkitError(
        f"{where} is not a rule: got {type(entry).__name__} {entry!r}; give a rule made by gk.vjp_rule or "
        "gk.jvp_rule, a library rule name (\"safe\"), or {\"rule\": \"<name>\", <param>: <value>}.")


def _load_toml(text: str, path: str) -> Mapping[str, Any]:
    if _toml is None:  # pragma: no cover - Python 3.10 without tomli
        raise GradkitError(
            f"reading {path}: TOML needs Python 3.11+ (tomllib) or the `tomli` package on Python 3.10. "
            "Install it with `pip install tomli`, or pass a dict to gk.RuleTable.from_dict.")
    try:
        return _toml.loads(text)
    except _toml.TOMLDecodeError as e:
        raise GradkitError(f"{path} is not valid TOML: {e}.") from None
