"""Declarative rule tables: a dict or a TOML file that names library rules.

A config maps op names to library rules::

    sqrt = "safe"
    log = {rule = "clamped_log", eps = 1e-30}
    round = "straight_through"
    my_softplus = {rule = "stable", op = "softplus"}

Nothing in a config is imported or evaluated: a rule name is looked up in a
fixed registry (:data:`gradkit._src.library.LIBRARY`), so ``"os.system"`` is
just an unknown rule name. Unknown rules, unknown or missing parameters and
bad values are :class:`GradkitError`\\ s that list what is valid.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from gradkit._src import library
from gradkit._src.errors import GradkitError
from gradkit._src.table import RuleTable


def table_from_dict(config: Mapping[str, Any], *, source: str = "config") -> RuleTable:
    """Builds a :class:`RuleTable` from ``{op name: rule name | {"rule": name, **params}}``."""
    if not isinstance(config, Mapping):
        raise GradkitError(
            f"{source}: expected a mapping from op name to rule, got {type(config).__name__}. "
            "Write {'sqrt': 'safe', 'log': {'rule': 'clamped_log', 'eps': 1e-30}}.")
    rules = {}
    for op_name, entry in config.items():
        if not isinstance(op_name, str) or not op_name or op_name != op_name.strip():
            raise GradkitError(f"{source}: op names must be non-empty strings without surrounding spaces, "
                               f"got {op_name!r}.")
        where = f"{source}: entry '{op_name}'"
        if isinstance(entry, str):
            rule_name, params = entry, {}
        elif isinstance(entry, Mapping):
            if "rule" not in entry:
                raise GradkitError(
                    f"{where} has no `rule` key: write {{rule = \"<name>\", <param> = <value>}}. Valid rules: "
                    + ", ".join(library.LIBRARY) + ".")
            params = {k: v for k, v in entry.items() if k != "rule"}
            rule_name = entry["rule"]
            bad = [k for k in params if not isinstance(k, str)]
            if bad:
                raise GradkitError(f"{where}: parameter names must be strings, got {bad!r}.")
        else:
            raise GradkitError(
                f"{where}: expected a rule name (string) or a table {{rule = \"<name>\", ...}}, got "
                f"{type(entry).__name__} {entry!r}.")
        rules[op_name] = library.make_rule(rule_name, op_name, params, where=where)
    return RuleTable(rules)


def _load_toml(text: str, path: str) -> Mapping[str, Any]:
    try:
        import tomllib as toml  # Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as toml  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise GradkitError(
                f"reading {path}: TOML needs Python 3.11+ (tomllib) or the `tomli` package on Python 3.10. "
                "Install it with `pip install tomli`, or pass a dict to gk.RuleTable.from_dict.") from None
    try:
        return toml.loads(text)
    except toml.TOMLDecodeError as e:
        raise GradkitError(f"{path} is not valid TOML: {e}.") from None


def table_from_toml(path: str | os.PathLike[str]) -> RuleTable:
    """Builds a :class:`RuleTable` from a TOML file (same entries as :func:`table_from_dict`).

    The rules may sit at the top level or under a ``[rules]`` table (or
    ``[tool.gradkit.rules]``, for a ``pyproject.toml``).
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
    return table_from_dict(data, source=path)
