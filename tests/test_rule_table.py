"""RuleTable: immutable mapping, merge, fingerprint, size."""

import jax.numpy as jnp
import pytest

import gradkit as gk


def r1(op, g):
    return (g,)


def r2(op, g):
    return (g * 2.0,)


A, B = gk.vjp_rule(r1), gk.vjp_rule(r2)


def test_mapping_protocol_and_immutability():
    t = gk.RuleTable({"sin": A, "cos": B})
    assert len(t) == 2 and set(t) == {"sin", "cos"} and t["sin"] is A and t.get("tan") is None
    assert "sin" in t and "tan" not in t
    with pytest.raises(TypeError):
        t["tan"] = A  # type: ignore[index]
    src = {"sin": A}
    t2 = gk.RuleTable(src)
    src["cos"] = B
    assert "cos" not in t2  # the table copied its input


def test_merge_right_wins_and_accepts_dicts():
    left, right = gk.RuleTable({"sin": A, "cos": A}), gk.RuleTable({"cos": B})
    merged = left | right
    assert merged["cos"] is B and merged["sin"] is A
    assert (left | {"tan": B})["tan"] is B
    assert ({"tan": B} | left)["sin"] is A
    assert left["cos"] is A  # operands unchanged


def test_fingerprint_is_stable_and_content_based():
    t1 = gk.RuleTable({"sin": A, "cos": B})
    t2 = gk.RuleTable({"cos": B, "sin": A})
    assert t1.fingerprint == t2.fingerprint and t1 == t2 and hash(t1) == hash(t2)
    assert t1.fingerprint != gk.RuleTable({"sin": B, "cos": A}).fingerprint
    assert t1.fingerprint != gk.RuleTable({"sin": A}).fingerprint
    assert gk.RuleTable({"sin": gk.Rule(r1, key=("lib", "x"))}).fingerprint == \
        gk.RuleTable({"sin": gk.Rule(r2, key=("lib", "x"))}).fingerprint  # keyed library rules
    assert gk.vjp_rule(r1).key != gk.jvp_rule(r2).key


def test_rule_metadata():
    assert A.mode == "vjp" and "r1" in A.name
    j = gk.jvp_rule(name="my_rule")(lambda op, t: t[0])
    assert j.mode == "jvp" and j.name == "my_rule"
    assert j(gk.OpView("x", (jnp.ones(()),), (), {}), (3.0,)) == 3.0


def test_large_tables_are_cheap():
    big = gk.RuleTable({f"op_{i}": A for i in range(10_000)})
    assert len(big | {"sin": B}) == 10_001
    assert len(big.fingerprint) == 16
    assert "op_9999" in big and "sin" not in big


def test_tables_equal_mappings_with_the_same_items():
    assert gk.RuleTable({}) == {} and {} == gk.RuleTable({})
    t = gk.RuleTable({"sin": A, "cos": B})
    assert t == {"cos": B, "sin": A} and {"sin": A, "cos": B} == t
    assert t != {"sin": A} and t != {"sin": B, "cos": A} and t != {"sin": 3}  # an invalid mapping: not equal
    assert t != ["sin", "cos"] and t != "sin"
    assert gk.RuleTable({"sqrt": "safe"}) == {"sqrt": "safe"}  # library rules by name
    # equal tables hash equally (a dict is unhashable: nothing to keep consistent there)
    assert hash(t) == hash(gk.RuleTable({"cos": B, "sin": A})) and len({t, gk.RuleTable(t)}) == 1
    assert gk.RuleTable(t) is not t and gk.RuleTable(t) == t
