"""Bad rule tables and configs. See bad_input_cases.py for the contract."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bad_input_cases import (
    X,
    loss,
)

import gradkit as gk

# --------------------------------------------------------------------------- rule tables


def test_string_rule_in_a_table_is_a_clear_error():
    # a string names a library rule (as in RuleTable.from_dict); a misspelt one is a clear error
    assert gk.RuleTable({"sqrt": "safe"}) == gk.RuleTable.from_dict({"sqrt": "safe"})
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] table entry 'sqrt': unknown rule 'saf' "
                                              r"\(did you mean 'safe'\?\)"):
        gk.RuleTable({"sqrt": "saf"})


def test_rule_instance_in_the_table_with_non_callable_fn():
    with pytest.raises(gk.GradkitError, match=r"expected a callable"):
        gk.Rule(fn=None)  # type: ignore[arg-type]
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override expects a RuleTable"):
        gk.override(loss, gk.vjp_rule(lambda op, g: g))  # a rule where the table goes


def test_two_named_ops_sharing_a_name_are_both_matched():
    # Decision: an op name is a *type* of op (like TF's gradient_override_map):
    # every function registered under it is matched by the one rule.
    @gk.op("shared_name")
    def a(x):
        return jnp.sin(x)

    @gk.op("shared_name")
    def b(x):
        return jnp.cos(x)

    f = gk.override(lambda x: jnp.sum(a(x) + b(x)), {"shared_name": gk.vjp_rule(lambda op, g: (g * 10.0,))})
    np.testing.assert_array_equal(jax.grad(f)(X), 20.0)


def test_merging_tables_with_the_same_name_keeps_the_right_one():
    left = gk.RuleTable({"sin": gk.vjp_rule(lambda op, g: (g * 0.0,))})
    right = gk.RuleTable({"sin": gk.vjp_rule(lambda op, g: (g * 3.0,))})
    np.testing.assert_array_equal(jax.grad(gk.override(loss, left | right))(X), 6.0)
    np.testing.assert_array_equal(jax.grad(gk.override(loss, right | left))(X), 0.0)


@pytest.mark.parametrize("name", ["jnp.sin", "Sin", "sine", "lax.sin"])
def test_names_of_no_op_are_ignored_unless_strict(name, maybe_jit):
    table = {name: gk.vjp_rule(lambda op, g: (g * 0.0,))}
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(loss, table)))(X), jax.grad(loss)(X))
    with pytest.raises(gk.GradkitError, match=rf"(?s)'{re.escape(name)}' \(did you mean 'sin'\?\)"):
        gk.override(loss, table, strict=True)(X)


def test_name_of_an_op_hidden_inside_a_custom_jvp_function():
    # jax.nn.relu is a custom_jvp function: its body's `max` keeps the user's
    # (JAX's) rule; strict mode says the name matched nothing.
    fn = lambda x: jnp.sum(jax.nn.relu(x - 1.0))
    table = {"max": gk.vjp_rule(lambda op, g: (g * 0.0, g * 0.0))}
    np.testing.assert_array_equal(jax.grad(gk.override(fn, table))(X), jax.grad(fn)(X))
    with pytest.raises(gk.GradkitError, match=r"'max'.*\n.*Ops in the program: .*relu"):
        gk.override(fn, table, strict=True)(X)


# --------------------------------------------------------------------------- TOML / dict configs

BAD_TOML = [
    # (id, TOML text, expected message fragment)
    ("unterminated_string", 'sqrt = "safe\n', r"is not valid TOML"),
    ("missing_value", "sqrt = \n", r"is not valid TOML"),
    ("duplicate_key", 'sqrt = "safe"\nsqrt = "stable"\n', r"is not valid TOML"),
    ("unknown_rule_near_miss", 'sqrt = "saf"\n', r"unknown rule 'saf' \(did you mean 'safe'\?\)"),
    ("code_dotted_path", 'sqrt = "os.system"\n', r"unknown rule 'os.system'. Valid rules: safe"),
    ("code_expression", "sqrt = {rule = \"__import__('os').system('true')\"}\n", r"unknown rule"),
    ("code_module_colon", 'sqrt = "test_bad_tables:_config_sentinel"\n', r"unknown rule"),
    ("code_in_parameter", 'sqrt = {rule = "safe", op = "os.system"}\n', r"has no entry for op 'os.system'"),
    ("param_string_for_float", 'log = {rule = "clamped_log", eps = "1e-30"}\n', r"`eps` .* must be a number, got '1e-30' \(str\)"),
    ("param_bool_for_float", 'log = {rule = "clamped_log", eps = true}\n', r"must be a number, got True \(bool\)"),
    ("param_array_for_float", 'log = {rule = "clamped_log", eps = [1e-30]}\n', r"must be a number, got \[1e-30\] \(list\)"),
    ("param_datetime", 'log = {rule = "clamped_log", eps = 1979-05-27T07:32:00Z}\n', r"must be a number, got datetime"),
    ("param_negative", 'log = {rule = "clamped_log", eps = -1.0}\n', r"must be a finite number > 0"),
    ("param_nan", 'log = {rule = "clamped_log", eps = nan}\n', r"is NaN"),
    ("param_unknown", 'log = {rule = "clamped_log", epsilon = 1e-30}\n', r"has no parameter `epsilon`. Valid parameters: `eps`"),
    ("param_missing_required", 'sin = {rule = "scale_gradient"}\n', r"needs parameter `scale`"),
    ("clip_bounds_reversed", 'round = {rule = "clip_gradient", lo = 1.0, hi = -1.0}\n', r"needs lo <= hi"),
    ("no_rule_key", "log = {eps = 1e-30}\n", r"has no `rule` key"),
    ("entry_is_int", "log = 3\n", r"expected a rule name \(string\) or a table"),
    ("entry_is_array", 'log = ["safe"]\n', r"expected a rule name \(string\) or a table"),
    ("empty_op_name", '"" = "safe"\n', r"op names must be non-empty strings"),
    ("padded_op_name", '" sqrt" = "safe"\n', r"op names must be non-empty strings"),
]

_SENTINEL = []


def _config_sentinel(*args, **kwargs):  # a config naming this must never call it
    _SENTINEL.append(1)


@pytest.mark.parametrize("case", BAD_TOML, ids=[c[0] for c in BAD_TOML])
def test_bad_toml_config(case, tmp_path):
    import sys

    name, text, pattern = case
    (tmp_path / "warm.toml").write_text('sqrt = "safe"\n')
    gk.RuleTable.from_toml(tmp_path / "warm.toml")  # the config machinery's own lazy imports
    path = tmp_path / "rules.toml"
    path.write_text(text)
    modules = set(sys.modules)
    with pytest.raises(gk.GradkitError) as info:
        gk.RuleTable.from_toml(path)
    msg = str(info.value)
    assert msg.startswith("[gradkit]") and str(path) in msg, msg
    assert re.search(pattern, msg), msg
    assert set(sys.modules) == modules and not _SENTINEL  # nothing imported, nothing called


@pytest.mark.parametrize("kind", ["missing", "directory", "not_utf8"])
def test_unreadable_toml_config(kind, tmp_path):
    path = {"missing": tmp_path / "nope.toml", "directory": tmp_path, "not_utf8": tmp_path / "bin.toml"}[kind]
    if kind == "not_utf8":
        path.write_bytes(b"\xff\xfesqrt = 'safe'")
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\].*(cannot read|not valid|UTF-8|utf-8)"):
        gk.RuleTable.from_toml(path)


@pytest.mark.parametrize("cfg", [{"sqrt": None}, ["sqrt", "safe"], {"sqrt": {"rule": 3}}, {3: "safe"},
                                 {"sqrt": {"rule": "safe", 3: 1}}, "sqrt = 'safe'"],
                         ids=["none_entry", "list", "int_rule_name", "int_op_name", "int_param_name", "toml_text"])
def test_bad_dict_config(cfg):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] config"):
        gk.RuleTable.from_dict(cfg)


def test_good_configs_fingerprint_equally_and_empty_config_is_plain_jax(tmp_path):
    (tmp_path / "a.toml").write_text('sqrt = "safe"\nlog = {rule = "clamped_log", eps = 1e-30}\n')
    (tmp_path / "empty.toml").write_text("")
    a = gk.RuleTable.from_toml(tmp_path / "a.toml")
    assert a == gk.RuleTable.from_dict({"log": {"rule": "clamped_log", "eps": 1e-30}, "sqrt": "safe"})
    empty = gk.RuleTable.from_toml(tmp_path / "empty.toml")
    assert len(empty) == 0
    np.testing.assert_array_equal(jax.grad(gk.override(loss, empty))(X), jax.grad(loss)(X))


# --------------------------------------------------------------------------- a misspelt rule name: names valid there


def _library():
    from gradkit._src.rules.library import FAMILIES, LIBRARY

    ops = {key for family in FAMILIES.values() for record in family.values() for key in record.keys}
    return LIBRARY, sorted(ops | {"round", "sign", "fn:my_function"})  # and ops no family covers


def _accepted(rule, op, library):
    """Does a table accept library rule ``rule`` for ``op`` (its required parameters given)?"""
    required = {p.name: 1.0 for p in library[rule].params if p.required}
    try:
        gk.RuleTable({op: {"rule": rule, **required} if required else rule})
    except gk.GradkitError:
        return False
    return True


def _suggested(entry, op):
    with pytest.raises(gk.GradkitError, match="unknown rule") as e:
        gk.RuleTable({op: entry})
    m = re.search(r"\(did you mean (.*?)\?\)", str(e.value))
    return re.findall(r"'([^']*)'", m.group(1)) if m else []


def _misspellings(name):
    out = {name[:k] + name[k + 1:] for k in range(len(name))}  # a letter left out
    out |= {name[:k] + name[k + 1] + name[k] + name[k + 2:] for k in range(len(name) - 1)}  # two swapped
    return sorted(out - {name})


def test_a_misspelt_rule_name_suggests_only_rules_valid_for_the_op():
    """Issue 38.4: RuleTable({"round": "ste"}) suggested 'stable', which has no rule for round."""
    assert _suggested("ste", "round") == []
    assert _suggested("stabel", "round") == [] and _suggested("stabel", "softplus") == ["stable"]
    library, ops = _library()
    typos = sorted({t for name in library for t in _misspellings(name)} | {"ste", "sfe", "stabel"})
    valid = {(r, op): _accepted(r, op, library) for r in library for op in ops}
    assert all(valid[r, "round"] == (not library[r].op_dependent) for r in library)
    checked = 0
    for op in ops:
        for typo in typos:
            if typo in library:
                continue
            for s in _suggested(typo, op):
                assert valid[s, op], f"{op!r}: {typo!r} suggests {s!r}, which is not a rule for {op!r}"
                checked += 1
        # and every rule valid for the op is still suggested for its own misspelling
        for r in library:
            if valid[r, op]:
                assert r in _suggested(r[:-1], op), (op, r)
    assert checked > 1000


def test_a_misspelt_rule_name_with_parameters_suggests_rules_that_take_them():
    assert _suggested({"rule": "clamped_lgo", "eps": 1e-30}, "log") == ["clamped_log", "clamped_sqrt"]
    assert _suggested({"rule": "zeor", "eps": 1e-30}, "log") == []  # `zero` has no eps
    # an explicit op: the family rules that cover it, for an entry named anything
    assert _suggested({"rule": "stabel", "op": "softplus"}, "fn:my_softplus") == ["stable"]
    assert _suggested({"rule": "stabel", "op": "log"}, "fn:my_log") == ["safe"]
