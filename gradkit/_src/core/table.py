"""RuleTable: an immutable mapping from op name to Rule, and the declarative (dict / TOML) tables.

A declarative table maps op names to library rules::

    sqrt = "safe"
    log = {rule = "clamped_log", eps = 1e-30}
    round = "straight_through"
    my_softplus = {rule = "stable", op = "softplus"}

Nothing in it is imported or evaluated: a rule name is looked up in a fixed
registry (the rule library registers itself with :func:`use_library` when it
loads), so ``"os.system"`` is just an
unknown rule name. Unknown rules, unknown or missing parameters and bad values
are :class:`GradkitError`\\ s that list what is valid.
"""

from __future__ import annotations

import hashlib
import os
import tomllib as _toml
from collections.abc import Callable, Iterator, Mapping
from typing import TypeVar, overload

from gradkit._src.core import scope as _scope
from gradkit._src.core.rule import Rule
from gradkit._src.errors import GradkitError

T = TypeVar("T")


class RuleTable(Mapping[str, Rule]):
    """An immutable mapping from op name to :class:`Rule`.

    A key is a primitive's name (``"sqrt"``) or a :func:`gradkit.op` name, or
    ``"fn:<name>"`` for a function the program calls by its Python name (a
    ``jax.jit``-ed or ``custom_jvp``/``custom_vjp`` function). Lookup is a dict
    lookup; rules that never match cost nothing, so one table can hold
    thousands of rules. Tables merge with ``|`` (the right side wins), and
    compare equal to any mapping that makes the same table.

    A key ``"<scope>::<op>"`` applies its rule only inside a part of the
    program (see :meth:`within`, which writes such keys): where an unscoped
    and a scoped entry for one op both match, the more specific scope wins.

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

    __slots__ = ("_rules", "_fingerprint", "_scoped", "_origin")

    def __init__(self, rules: Mapping[str, object] | None = None, *, source: str | None = None):
        rules = {} if rules is None else rules
        if not isinstance(rules, Mapping):
            raise GradkitError(
                f"{source or 'RuleTable'} expects a mapping from op name to rule, got {type(rules).__name__}. "
                "Write gk.RuleTable({'sqrt': gk.vjp_rule(fn)}) or {'sqrt': 'safe', 'log': {'rule': "
                "'clamped_log', 'eps': 1e-30}}.")
        if isinstance(rules, RuleTable):
            self._rules: dict[str, Rule] = dict(rules._rules)
            self._fingerprint: str | None = rules._fingerprint
            self._scoped: dict[str, tuple[tuple[str, _scope.Scope, Rule], ...]] = rules._scoped
            self._origin: dict[str, str] = rules._origin
            return
        checked: dict[str, Rule] = {}
        scoped: dict[str, list[tuple[str, _scope.Scope, Rule]]] = {}
        for name, rule in rules.items():
            if not isinstance(name, str) or not name or name != name.strip():
                raise GradkitError(
                    f"{source + ': ' if source else ''}table entry {name!r}: op names must be non-empty strings "
                    "without surrounding spaces, such as 'sqrt', the name given to gk.op, or 'fn:softplus'.")
            where = f"{source + ': ' if source else ''}table entry"
            sc, op = _scope.split_key(name, where=where)
            key = name if sc is None else _scope.join_key(sc, op)
            rule = rule if isinstance(rule, Rule) else _library_entry(op, rule, source, key)
            checked[key] = rule
            if sc is not None:
                scoped.setdefault(op, []).append((key, sc, rule))
        self._rules = checked
        self._fingerprint = None
        # op name -> its scoped entries, most specific first (ties: see rule_for)
        self._scoped = {op: tuple(sorted(entries, key=lambda e: e[1].rank, reverse=True))
                        for op, entries in scoped.items()}
        self._origin = {}  # key -> the shipped table it came from (see shipped); not part of the content

    # Mapping protocol
    def __getitem__(self, name: str) -> Rule:
        return self._rules[name]

    @overload
    def get(self, name: str) -> Rule | None: ...
    @overload
    def get(self, name: str, default: T) -> Rule | T: ...

    def get(self, name: str, default: object = None) -> object:  # hot path: no Mapping mixin overhead
        return self._rules.get(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._rules

    def __iter__(self) -> Iterator[str]:
        return iter(self._rules)

    def __len__(self) -> int:
        return len(self._rules)

    def names(self) -> frozenset[str]:
        return frozenset(self._rules)

    @property
    def scoped_ops(self) -> frozenset[str]:
        """The op names some scoped entry (``"<scope>::<op>"``) is for; empty for an unscoped table.

        Examples:
          >>> import gradkit as gk
          >>> sorted(gk.RuleTable({"sqrt": "safe", "enc::log": "safe"}).scoped_ops)
          ['log']
        """
        return frozenset(self._scoped)

    def scoped_entries(self) -> list[tuple[str, _scope.Scope, str]]:
        """``(key, scope, op)`` of every scoped entry, in table order; the scope is parsed (``.text``, ``.parts``).

        Examples:
          >>> import gradkit as gk
          >>> t = gk.RuleTable({"*/Conv_*::conv_general_dilated": "zero"})
          >>> [(k, s.parts, op) for k, s, op in t.scoped_entries()]
          [('*/Conv_*::conv_general_dilated', ('*', 'Conv_*'), 'conv_general_dilated')]
        """
        out = []
        for key in self._rules:
            sc, op = _scope.split_key(key)
            if sc is not None:
                out.append((key, sc, op))
        return out

    def origin(self, key: str) -> str | None:
        """The shipped table entry ``key`` came from (``"gk.tables.SAFE"``), through ``|`` and :meth:`within`.

        ``None`` for an entry of your own (a dict, a config, a rule taken out
        of a table into a dict). ``strict=True`` checks a shipped table as one
        unit (some rule of it must match) and your own entries one by one.
        Not part of the content: tables equal by content compare equal
        whatever their origins.

        Examples:
          >>> import gradkit as gk
          >>> t = gk.tables.SAFE.within("dec") | {"round": "straight_through"}
          >>> t.origin("dec::sqrt"), t.origin("round")
          ('gk.tables.SAFE', None)
        """
        return self._origin.get(key)

    def rule_for(self, name: str, scopes: tuple[str, ...],
                 where: str | Callable[[], str] = "unknown source line") -> tuple[str, Rule] | None:
        """The entry that applies to op ``name`` at name-stack ``scopes``: ``(key, rule)``, or ``None``.

        The most specific matching scope wins (``gradkit._src.core.scope``),
        then the unscoped entry. Two different rules of equal rank on one
        equation raise: no order of the table may decide. ``scopes`` is the
        equation's whole name stack (the scope names, outermost first);
        ``where`` (a string, or a function giving it) names it in that error.

        Examples:
          >>> import gradkit as gk
          >>> t = gk.RuleTable({"sqrt": "safe", "enc::sqrt": "zero", "enc/Dense_0::sqrt": "straight_through"})
          >>> [t.rule_for("sqrt", s)[0] for s in [(), ("Model", "enc"), ("Model", "enc", "Dense_0")]]
          ['sqrt', 'enc::sqrt', 'enc/Dense_0::sqrt']
          >>> t.rule_for("log", ("enc",)) is None
          True
        """
        entries = self._scoped.get(name)
        if entries:
            for i, (key, sc, rule) in enumerate(entries):
                if not sc.matches(scopes):
                    continue
                for key2, sc2, rule2 in entries[i + 1:]:
                    if sc2.rank != sc.rank:
                        break
                    if (rule2.mode, rule2.key) != (rule.mode, rule.key) and sc2.matches(scopes):
                        raise GradkitError(
                            f"op '{name}' at {where() if callable(where) else where} "
                            f"(scopes {_scope.show(scopes)}) is matched by "
                            f"'{key}' ({rule.name}) and '{key2}' ({rule2.name}), equally specific scopes with "
                            "different rules. Make one more specific (more components, fewer wildcards, or "
                            "anchored with a leading '/'), or give both scopes the same rule.")
                return key, rule
        plain = self._rules.get(name)
        return None if plain is None else (name, plain)

    def within(self, scope: str) -> RuleTable:
        """This table with every rule restricted to the part of the program inside ``scope``.

        ``scope`` is matched against the equations' **name stack**, the scope
        names ``jax.named_scope`` records (Flax linen records module paths
        such as ``Model/enc/Dense_0``; Equinox records module types such as
        ``eqx.nn.MLP/eqx.nn.Linear``), at any depth of the program: inside
        ``jit``, ``scan``, ``while``, ``cond``, ``checkpoint`` and ``vmap``,
        a sub-program's scopes follow those of the equation that calls it.
        A Flax NNX or Equinox module passed to the overridden function (as
        an argument, or inside one) adds its **attribute path** while it
        runs: ``"enc"``, ``"layers.3.attn"`` (an ``nnx.List``/``nnx.Dict``
        entry, a tuple field), ``"encoder.layers.0"``, matched apart from
        the names JAX records as well as with them. A module reached under
        two paths is inside either; a stack run by ``nnx.scan`` has one
        body for every layer, so its path (``"layers"``) can be addressed
        but not an index inside it (a :class:`GradkitError` says so).

        Matching: ``scope`` is components separated by ``/`` or ``.`` (the
        same: ``"layers.3.attn"`` is ``"layers/3/attn"``), each a shell
        pattern for one name-stack component (``*``, ``?``, ``[...]``;
        ``**`` stands for any number of components). It matches an equation
        when its components match a contiguous run of the equation's scopes,
        anywhere — everything below that run is inside, as ops created in a
        ``with`` block were for TensorFlow's ``gradient_override_map``:
        ``"enc"`` covers ``Model/enc`` and ``Model/enc/Dense_0``, not
        ``Model/encoder``; ``"*/Conv_*"`` covers every ``Conv_<i>`` one level
        or more below the top. A leading ``/`` anchors the run at the top of
        the overridden function (``"/Model/enc"``). Scopes are those inside
        the overridden function: a ``jax.named_scope`` around the *call* of
        an overridden function is not part of them.

        Precedence: where several entries for one op match one equation, a
        scoped entry beats an unscoped one; between scopes the one with more
        components (``**`` not counted) wins, then the one with more
        components free of wildcards, then an anchored one. Two different
        rules equally specific on one equation are a :class:`GradkitError`
        (tables compare by content, so no order may decide); the same key in
        both operands of ``|`` is replaced by the right one, as for unscoped
        entries.

        The keys of the result are ``"<scope>::<op>"`` (``"enc::sqrt"``),
        which :meth:`from_dict` and TOML configs accept too. An entry already
        scoped to ``s`` becomes ``"<scope>/**/<s>"`` (``s`` anywhere inside
        ``scope``), or ``"<scope>/<s>"`` for an anchored ``"/<s>"``.

        Args:
          scope: the scope pattern, e.g. ``"enc"``, ``"Model/dec"``, ``"layers.3.attn"``, ``"*/Conv_*"``.

        Returns:
          A new table; this one is unchanged.

        Examples:
          >>> import jax, jax.numpy as jnp, gradkit as gk
          >>> def f(x):
          ...     with jax.named_scope("enc"):
          ...         a = jnp.sqrt(x)
          ...     with jax.named_scope("dec"):
          ...         b = jnp.sqrt(x)
          ...     return jnp.where(x > 0, a + b, 0.0)
          >>> float(jax.grad(f)(0.0))
          nan
          >>> t = gk.tables.SAFE.within("enc") | gk.tables.SAFE.within("dec")
          >>> float(jax.grad(gk.override(f, t))(0.0))
          0.0
          >>> "enc::sqrt" in t, gk.RuleTable({"*/Conv_*::sqrt": "safe"}) == {"*/Conv_*::sqrt": "safe"}
          (True, True)
          >>> list(gk.RuleTable({"sqrt": "safe"}).within("layers.3.attn"))  # a module path, as NNX writes it
          ['layers.3.attn::sqrt']
        """
        outer = _scope.parse(scope, where="RuleTable.within")
        out: dict[str, Rule] = {}
        origin: dict[str, str] = {}
        for key, rule in self._rules.items():
            sc, op = _scope.split_key(key)
            new = _scope.join_key(outer if sc is None else sc.inside(outer), op)
            out[new] = rule
            if key in self._origin:
                origin[new] = self._origin[key]
        return _with_origin(RuleTable(out), origin)

    def __or__(self, other: Mapping[str, Rule]) -> RuleTable:
        if not isinstance(other, Mapping):
            return NotImplemented
        other_table = other if isinstance(other, RuleTable) else RuleTable(other)
        other_rules = other_table._rules
        merged = RuleTable({**self._rules, **other_rules})  # keys are normalized: the right side replaces
        if not (self._origin or other_table._origin):
            return merged
        kept = {k: v for k, v in self._origin.items() if k not in other_rules}
        return _with_origin(merged, {**kept, **other_table._origin})

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
    def from_dict(cls, config: Mapping[str, object], *, source: str = "config") -> RuleTable:
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


def shipped(table: RuleTable, name: str) -> RuleTable:
    """``table`` with every entry's :meth:`RuleTable.origin` set to ``name`` (the ready tables, ``gk.tables``)."""
    return _with_origin(RuleTable(table), dict.fromkeys(table, name))


def _with_origin(table: RuleTable, origin: dict[str, str]) -> RuleTable:
    table._origin = origin
    return table


class _Library:
    """The rule library as tables see it: its rule names, and the maker of a rule from a name and parameters.

    ``rules/library.py`` registers itself with :func:`use_library` when it is
    imported (``import gradkit`` does), so the core never imports the library.
    """

    names: Mapping[str, object] = {}
    make: Callable[..., Rule] | None = None


def use_library(names: Mapping[str, object], make: Callable[..., Rule]) -> None:
    """Registers the rule library that declarative entries (``"safe"``, ``{rule = ...}``) name."""
    _Library.names, _Library.make = names, make


def _make(rule_name: object, op_name: str, params: Mapping[str, object], where: str) -> Rule:
    if _Library.make is None:  # pragma: no cover - gradkit/__init__ imports the library
        raise GradkitError(f"{where}: the rule library is not loaded; `import gradkit` before naming library rules.")
    return _Library.make(rule_name, op_name, params, where=where)


def _library_entry(op_name: str, entry: object, source: str | None, key: str | None = None) -> Rule:
    """The library rule an entry names: ``"safe"`` or ``{"rule": "clamped_log", "eps": 1e-30}``."""
    key = key or op_name
    where = f"{source}: entry '{key}'" if source else f"table entry '{key}'"
    if isinstance(entry, str):
        return _make(entry, op_name, {}, where)
    if isinstance(entry, Mapping):
        if "rule" not in entry:
            raise GradkitError(
                f"{where} has no `rule` key: write {{rule = \"<name>\", <param> = <value>}}. Valid rules: "
                + ", ".join(_Library.names) + ".")
        params = {k: v for k, v in entry.items() if k != "rule"}
        bad = [k for k in params if not isinstance(k, str)]
        if bad:
            raise GradkitError(f"{where}: parameter names must be strings, got {bad!r}.")
        return _make(entry["rule"], op_name, params, where)
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


def _load_toml(text: str, path: str) -> Mapping[str, object]:
    try:
        data: dict[str, object] = _toml.loads(text)
        return data
    except _toml.TOMLDecodeError as e:
        raise GradkitError(f"{path} is not valid TOML: {e}.") from None
