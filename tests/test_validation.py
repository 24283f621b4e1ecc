"""Bad rules and bad tables get `[gradkit]` errors naming the rule, the op and the user's line."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

X = jnp.array([1.0, 2.0, 3.0], jnp.float32)
THIS_FILE = re.escape(__file__.rsplit("/", 1)[-1])


def loss(x):
    return jnp.sum(jnp.sin(x) * 2.0)  # the line the errors must point at


LOSS_LINE = loss.__code__.co_firstlineno + 1


def _grad_error(rule, fn=loss, x=X, jit=False):
    g = jax.grad(gk.override(fn, {"sin": rule}))
    with pytest.raises(gk.GradkitError) as info:
        (jax.jit(g) if jit else g)(x)
    msg = str(info.value)
    assert msg.startswith("[gradkit]")
    return msg


def _names_rule_op_and_line(msg, rule_name):
    assert rule_name in msg, msg
    assert "op 'sin'" in msg, msg
    assert re.search(rf"{THIS_FILE}:{LOSS_LINE}\b", msg), msg


@pytest.mark.parametrize("jit", [False, True])
def test_wrong_count(jit):
    def two_cotangents(op, g):
        return (g, g)

    msg = _grad_error(gk.vjp_rule(two_cotangents), jit=jit)
    _names_rule_op_and_line(msg, "two_cotangents")
    assert "returned 2 cotangents for 1 inputs" in msg


def test_wrong_shape():
    def summed(op, g):
        return (jnp.sum(g),)

    msg = _grad_error(gk.vjp_rule(summed))
    _names_rule_op_and_line(msg, "summed")
    assert "shape ()" in msg and "expected (3,)" in msg


def test_wrong_dtype():
    def as_f16(op, g):
        return (g.astype(jnp.float16),)

    msg = _grad_error(gk.vjp_rule(as_f16))
    _names_rule_op_and_line(msg, "as_f16")
    assert "dtype float16" in msg and "expected float32" in msg and ".astype(float32)" in msg


def test_python_scalar_for_array_input():
    msg = _grad_error(gk.vjp_rule(lambda op, g: (1.0,)))
    assert "Python float" in msg and "jnp.full_like" in msg


def test_python_scalar_for_scalar_input_is_accepted():
    f = gk.override(lambda x: jnp.sin(x) * 2.0, {"sin": gk.vjp_rule(lambda op, g: (0.5,))})
    assert float(jax.grad(f)(jnp.float32(1.0))) == 0.5


def test_numpy_array_of_right_shape_and_dtype_is_accepted():
    f = gk.override(loss, {"sin": gk.vjp_rule(lambda op, g: (np.full((3,), 4.0, np.float32),))})
    np.testing.assert_array_equal(jax.grad(f)(X), 4.0)


def test_non_array_value():
    msg = _grad_error(gk.vjp_rule(lambda op, g: ("oops",)))
    assert "returned str" in msg


def test_wrong_structure_dict_for_array():
    msg = _grad_error(gk.vjp_rule(lambda op, g: ({"a": g},)))
    assert "subtree" in msg or "structure" in msg


def test_rule_that_raises():
    def broken(op, g):
        raise KeyError("no such thing")

    with pytest.raises(KeyError, match="no such thing") as info:
        jax.grad(gk.override(loss, {"sin": gk.vjp_rule(broken)}))(X)
    notes = "\n".join(info.value.__notes__)
    assert notes.startswith("[gradkit] raised inside")
    _names_rule_op_and_line(notes, "broken")


def test_jvp_rule_errors_in_forward_mode():
    rule = gk.jvp_rule(lambda op, t: jnp.sum(t[0]))
    f = gk.override(loss, {"sin": rule})
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\].*output tangent of shape \(\)"):
        jax.jvp(f, (X,), (X,))


def test_single_bare_cotangent_is_accepted():
    f = gk.override(loss, {"sin": gk.vjp_rule(lambda op, g: g * 3.0)})
    np.testing.assert_allclose(jax.grad(f)(X), 6.0)


def test_none_cotangent_means_zero():
    f = gk.override(loss, {"sin": gk.vjp_rule(lambda op, g: (None,))})
    np.testing.assert_array_equal(jax.grad(f)(X), 0.0)


# --------------------------------------------------------------------------- tables and rules


def test_table_entries_must_be_rules():
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] table entry 'sin' is not a rule.*gk.vjp_rule"):
        gk.RuleTable({"sin": lambda op, g: g})
    with pytest.raises(gk.GradkitError, match="table entry 'cos' is not a rule"):
        gk.RuleTable({"cos": None})


@pytest.mark.parametrize("name", ["", "  sin", 3, None])
def test_table_names_must_be_clean_strings(name):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] table entry"):
        gk.RuleTable({name: gk.vjp_rule(lambda op, g: g)})


def test_table_needs_a_mapping():
    with pytest.raises(gk.GradkitError, match="expects a mapping"):
        gk.RuleTable([("sin", gk.vjp_rule(lambda op, g: g))])


def test_rule_needs_a_callable_and_a_mode():
    with pytest.raises(gk.GradkitError, match="expected a callable"):
        gk.vjp_rule(3)
    with pytest.raises(gk.GradkitError, match="mode must be"):
        gk.Rule(lambda op, g: g, mode="backward")
