"""Declarative tables: RuleTable.from_dict / from_toml and the library rules they name."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit import stable as st
from gradkit import tables

ERR = r"^\[gradkit\]"


def test_from_dict_builds_library_rules_with_stable_keys():
    t = gk.RuleTable.from_dict({"sqrt": "safe", "log": {"rule": "clamped_log", "eps": 1e-30},
                                "round": "straight_through"})
    assert sorted(t) == ["log", "round", "sqrt"]
    assert t["log"].key == ("gradkit", "clamped_log", (("eps", 1e-30),))
    assert t["sqrt"].key == ("gradkit", "safe", (("op", "sqrt"),))
    assert t["round"].key == ("gradkit", "straight_through", ())
    same = gk.RuleTable.from_dict({"round": "straight_through", "log": {"eps": 1e-30, "rule": "clamped_log"},
                                   "sqrt": {"rule": "safe"}})
    assert same.fingerprint == t.fingerprint and same == t
    other = gk.RuleTable.from_dict({"sqrt": "safe", "log": {"rule": "clamped_log", "eps": 1e-20},
                                    "round": "straight_through"})
    assert other.fingerprint != t.fingerprint
    # the ready tables are made of the same library rules
    assert gk.RuleTable.from_dict({n: "safe" for n in tables.SAFE}).fingerprint == tables.SAFE.fingerprint
    assert gk.RuleTable.from_dict({n: "stable" for n in tables.STABLE}).fingerprint == tables.STABLE.fingerprint
    assert gk.RuleTable({n: "stable" for n in tables.STABLE_FUNCTIONS}) == tables.STABLE_FUNCTIONS
    assert gk.RuleTable({n: "straight_through" for n in tables.STRAIGHT_THROUGH}) == tables.STRAIGHT_THROUGH


def test_fingerprint_is_stable_across_processes():
    code = textwrap.dedent("""
        import gradkit as gk
        from gradkit import tables
        t = gk.RuleTable.from_dict({"sqrt": "safe", "log": {"rule": "clamped_log", "eps": 1e-30},
                                    "my_op": {"rule": "scale_gradient", "scale": 0.5}})
        print(t.fingerprint, tables.SAFE.fingerprint, tables.STABLE.fingerprint, tables.STABLE_FUNCTIONS.fingerprint)
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONHASHSEED="123")
    out1 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    env["PYTHONHASHSEED"] = "456"
    out2 = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out1.stdout == out2.stdout
    here = gk.RuleTable.from_dict({"sqrt": "safe", "log": {"rule": "clamped_log", "eps": 1e-30},
                                   "my_op": {"rule": "scale_gradient", "scale": 0.5}})
    assert out1.stdout.split() == [here.fingerprint, tables.SAFE.fingerprint, tables.STABLE.fingerprint,
                                   tables.STABLE_FUNCTIONS.fingerprint]


def test_from_toml(tmp_path):
    p = tmp_path / "rules.toml"
    p.write_text('sqrt = "safe"\nlog = {rule = "clamped_log", eps = 1e-30}\n"my_softplus" = '
                 '{rule = "stable", op = "softplus"}\n')
    t = gk.RuleTable.from_toml(p)
    assert sorted(t) == ["log", "my_softplus", "sqrt"]
    assert t == gk.RuleTable.from_dict({"sqrt": "safe", "log": {"rule": "clamped_log", "eps": 1e-30},
                                        "my_softplus": {"rule": "stable", "op": "softplus"}})
    nested = tmp_path / "nested.toml"
    nested.write_text('[rules]\nround = "straight_through"\n')
    assert sorted(gk.RuleTable.from_toml(str(nested))) == ["round"]
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n[tool.gradkit.rules]\nsign = "straight_through"\n')
    assert sorted(gk.RuleTable.from_toml(pyproject)) == ["sign"]


def test_toml_errors(tmp_path):
    with pytest.raises(gk.GradkitError, match=ERR + ".*cannot read"):
        gk.RuleTable.from_toml(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("sqrt = \n")
    with pytest.raises(gk.GradkitError, match=ERR + ".*not valid TOML"):
        gk.RuleTable.from_toml(bad)
    wrong = tmp_path / "wrong.toml"
    wrong.write_text('log = {rule = "clamped_log", eps = "tiny"}\n')
    with pytest.raises(gk.GradkitError, match=ERR + ".*wrong.toml.*'log'.*`eps`.*number"):
        gk.RuleTable.from_toml(wrong)


@pytest.mark.parametrize("config,pattern", [
    ({"log": "clamp_log"}, r"unknown rule 'clamp_log' \(did you mean 'clamped_log'\?\).*Valid rules: safe"),
    ({"log": "os.system"}, r"unknown rule 'os.system'.*Valid rules"),
    ({"log": "__import__('os').system('true')"}, r"unknown rule"),
    ({"log": {"rule": "clamped_log", "epsilon": 1.0}}, r"no parameter `epsilon`.*Valid parameters: `eps`"),
    ({"log": {"rule": "clamped_log", "eps": -1.0}}, r"`eps`.*must be a finite number > 0"),
    ({"log": {"rule": "clamped_log", "eps": True}}, r"`eps`.*must be a number"),
    ({"log": {"rule": "clamped_log", "eps": "1e-3"}}, r"`eps`.*must be a number"),
    ({"f": {"rule": "scale_gradient"}}, r"needs parameter `scale`"),
    ({"f": {"rule": "scale_gradient", "scale": float("inf")}}, r"`scale`.*finite"),
    ({"f": {"rule": "clip_gradient", "lo": 1.0, "hi": -1.0}}, r"lo <= hi"),
    ({"f": {"eps": 1.0}}, r"no `rule` key"),
    ({"f": 3}, r"expected a rule name"),
    ({"f": {"rule": 3}}, r"unknown rule 3"),
    ({"my_op": "safe"}, r"no entry for op 'my_op'.*Ops it covers: .*sqrt"),
    ({"sqrt": {"rule": "stable", "op": "sofplus"}}, r"did you mean 'softplus'"),
    ({"": "safe"}, r"op names"),
])
def test_config_errors_list_what_is_valid(config, pattern):
    with pytest.raises(gk.GradkitError, match=ERR + ".*" + pattern):
        gk.RuleTable.from_dict(config)


def test_config_never_imports_or_evaluates():
    before = set(sys.modules)
    for name in ["json.loads", "antigravity", "os.system", "subprocess.run", "eval", "exec"]:
        with pytest.raises(gk.GradkitError, match=ERR + ".*unknown rule"):
            gk.RuleTable.from_dict({"log": name})
        with pytest.raises(gk.GradkitError):
            gk.RuleTable.from_dict({"log": {"rule": "safe", "op": name}})
    assert "antigravity" not in set(sys.modules) - before
    with pytest.raises(gk.GradkitError, match=ERR + ".*mapping"):
        gk.RuleTable.from_dict(["sqrt", "safe"])


def test_library_rules_do_what_they_say():
    x = jnp.array([0.0, 4.0])
    t = gk.RuleTable.from_dict({"log": {"rule": "clamped_log", "eps": 0.5}})
    np.testing.assert_allclose(np.asarray(jax.grad(gk.override(lambda v: jnp.sum(jnp.log(v)), t))(x)), [2.0, 0.25])
    t = gk.RuleTable.from_dict({"sqrt": {"rule": "clamped_sqrt", "eps": 0.25}})
    np.testing.assert_allclose(np.asarray(jax.grad(gk.override(lambda v: jnp.sum(jnp.sqrt(v)), t))(x)), [1.0, 0.25])
    t = gk.RuleTable.from_dict({"log": "clamped_log"})  # default eps: the smallest normal number
    assert np.isfinite(float(jax.grad(gk.override(jnp.log, t))(0.0)))
    t = gk.RuleTable.from_dict({"sin": "zero", "round": "straight_through"})
    f = gk.override(lambda v: jnp.sum(jnp.sin(v) + jnp.round(v)), t)
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(x)), [1.0, 1.0])
    np.testing.assert_array_equal(np.asarray(jax.jacfwd(f)(x)), [1.0, 1.0])


def test_scale_reverse_and_clip_rules_on_primitives_and_jit_functions():
    x = jnp.array([0.3, 2.0])
    f = lambda v: jnp.sum(jnp.sin(v) * 3.0)
    g = jax.grad(gk.override(f, gk.RuleTable.from_dict({"sin": {"rule": "scale_gradient", "scale": 0.5}})))(x)
    np.testing.assert_allclose(np.asarray(g), 1.5 * np.cos(np.asarray(x)), rtol=1e-6)
    g = jax.grad(gk.override(f, gk.RuleTable.from_dict({"sin": {"rule": "reverse_gradient", "scale": 2.0}})))(x)
    np.testing.assert_allclose(np.asarray(g), -6.0 * np.cos(np.asarray(x)), rtol=1e-6)
    g = jax.grad(gk.override(f, gk.RuleTable.from_dict({"sin": {"rule": "clip_gradient", "lo": -1.0, "hi": 1.0}})))(x)
    np.testing.assert_allclose(np.asarray(g), np.clip(3.0 * np.cos(np.asarray(x)), -1, 1), rtol=1e-6)
    # a jax.jit-ed function matched by name
    sp = lambda v: jnp.sum(jax.nn.softplus(v))
    g = jax.grad(gk.override(sp, gk.RuleTable.from_dict({"fn:softplus": {"rule": "scale_gradient", "scale": 2.0}}),
                             strict=True))(x)
    np.testing.assert_allclose(np.asarray(g), 2.0 * np.asarray(jax.nn.sigmoid(x)), rtol=1e-6)
    # forward mode through a scale rule
    _, t = jax.jvp(gk.override(jnp.sin, gk.RuleTable.from_dict({"sin": {"rule": "scale_gradient", "scale": 0.5}})),
                   (0.0,), (1.0,))
    assert float(t) == 0.5


def test_scale_rule_on_a_named_op_explains_the_limit():
    @gk.op("my_layer")
    def layer(v):
        return jnp.tanh(v) * 2.0

    t = gk.RuleTable.from_dict({"my_layer": {"rule": "scale_gradient", "scale": 0.5}})
    with pytest.raises(gk.GradkitError, match=ERR + ".*my_layer.*primitives and jax.jit"):
        jax.grad(gk.override(lambda v: jnp.sum(layer(v)), t))(jnp.ones(2))


def test_stable_rule_retargets_a_users_op():
    @gk.op("my_softplus")
    def my_softplus(v):
        return jnp.log(1.0 + jnp.exp(v))

    f = lambda v: jnp.sum(my_softplus(v))
    x = jnp.array([-200.0, 0.0, 200.0])
    assert np.isnan(np.asarray(jax.grad(f)(x))).any()
    t = gk.RuleTable.from_dict({"my_softplus": {"rule": "stable", "op": "softplus"}})
    np.testing.assert_array_equal(np.asarray(jax.grad(gk.override(f, t))(x)), np.asarray(jax.grad(
        lambda v: jnp.sum(st.softplus(v)))(x)))
    assert t["my_softplus"].key == ("gradkit", "stable", (("op", "softplus"),))


def test_safe_rule_retargets_a_named_op_wrapping_a_primitive():
    @gk.op("my_sqrt")
    def my_sqrt(v):
        return jnp.sqrt(v)

    t = gk.RuleTable.from_dict({"my_sqrt": {"rule": "safe", "op": "sqrt"}})
    f = gk.override(lambda v: jnp.sum(jnp.where(v > 0, my_sqrt(v), 0.0)), t)
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(jnp.array([0.0, 4.0]))), [0.0, 0.25])
    np.testing.assert_array_equal(np.asarray(jax.jacfwd(f)(jnp.array([0.0, 4.0]))), [0.0, 0.25])

    @jax.jit
    def jit_sqrt(v):  # a jit-ed function: its parameters are jit's, the primitive's are the defaults
        return jnp.sqrt(v)

    t = gk.RuleTable({"fn:jit_sqrt": {"rule": "safe", "op": "sqrt"}})
    f = gk.override(lambda v: jnp.sum(jnp.where(v > 0, jit_sqrt(v), 0.0)), t, strict=True)
    np.testing.assert_array_equal(np.asarray(jax.hessian(f)(jnp.array([0.0, 4.0]))), [[0.0, 0.0], [0.0, -1 / 32]])

    @gk.op("my_pow")
    def my_pow(v, *, y=3):  # a named op whose keyword is the primitive's parameter
        return jax.lax.integer_pow(v, y)

    t = gk.RuleTable({"my_pow": {"rule": "safe", "op": "integer_pow"}})
    f = gk.override(lambda v: jnp.sum(jnp.where(v != 0, my_pow(v, y=-1), 0.0)), t)
    np.testing.assert_array_equal(np.asarray(jax.grad(f)(jnp.array([0.0, 0.5, 2.0]))), [0.0, -4.0, -0.25])


def test_library_listing_for_docs_and_cli():
    lib = tables.library()
    for name, rule in lib.items():
        assert rule.name == name and rule.doc and rule.signature().startswith(name + "(")
    assert lib["clip_gradient"].signature() == "clip_gradient(lo: float = -inf, hi: float = inf)"


def test_clamp_parameters_must_be_finite():
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\].*`eps`.*finite number > 0"):
        gk.RuleTable.from_dict({"log": {"rule": "clamped_log", "eps": float("inf")}})


def test_plain_dicts_name_library_rules_as_from_dict_does():
    # RuleTable(...) and override(f, {...}) accept what from_dict accepts, with the same errors
    t = gk.RuleTable({"mul": "safe", "log": {"rule": "clamped_log", "eps": 0.5}})
    assert t == gk.RuleTable.from_dict({"mul": "safe", "log": {"rule": "clamped_log", "eps": 0.5}})
    f = lambda v: jnp.sum(jnp.where(v > 0, v * jnp.log(v), 0.0))
    x = jnp.array([0.0, 2.0])
    g = jax.grad(gk.override(f, {"mul": "safe", "log": "safe"}))(x)
    np.testing.assert_allclose(np.asarray(g), [0.0, np.log(2.0) + 1], rtol=1e-6)
    mixed = gk.RuleTable({"sqrt": "safe", "sin": gk.jvp_rule(lambda op, t: t[0])})
    assert mixed["sqrt"].key == ("gradkit", "safe", (("op", "sqrt"),)) and mixed["sin"].mode == "jvp"
    with pytest.raises(gk.GradkitError, match=ERR + r" table entry 'log': unknown rule 'clamp_log'"):
        gk.RuleTable({"log": "clamp_log"})
    with pytest.raises(gk.GradkitError, match=ERR + r".*'sin' is not a rule: got function; wrap"):
        gk.override(jnp.sin, {"sin": lambda op, g: g})
    with pytest.raises(gk.GradkitError, match=ERR + r".*no `rule` key"):
        gk.override(jnp.sin, {"sin": {"eps": 1.0}})
    with pytest.raises(gk.GradkitError, match=ERR + r" table entry 'sin' is not a rule: got int 3; .*library rule name"):
        gk.RuleTable({"sin": 3})


def test_fn_keys_default_the_op_of_family_rules():
    t = gk.RuleTable({"fn:softplus": "stable", "fn:my_fn": {"rule": "stable", "op": "softplus"}})
    assert t["fn:softplus"].key == t["fn:my_fn"].key == ("gradkit", "stable", (("op", "softplus"),))
    with pytest.raises(gk.GradkitError, match=ERR + r".*no entry for op 'sqrtt' \(did you mean 'sqrt'"):
        gk.RuleTable({"fn:sqrtt": "safe"})


def test_the_supported_pythons_agree_everywhere():
    """JAX 0.8 and later need Python 3.11: pyproject, the linters' targets and the README say one thing (tomllib
    is then always in the standard library, so RuleTable.from_toml needs no extra package)."""
    import pathlib
    import re
    import tomllib
    root = pathlib.Path(__file__).parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    assert project["project"]["requires-python"] == ">=3.11"
    assert not [d for d in project["project"]["dependencies"] if d.startswith("tomli")]
    assert project["tool"]["ruff"]["target-version"] == "py311"
    assert project["tool"]["mypy"]["python_version"] == "3.11"
    assert re.search(r"\*\*Supported:\*\* Python 3\.11–3\.13\b", (root / "README.md").read_text(encoding="utf-8"))
