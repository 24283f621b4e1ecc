"""validate.check_leaf: the one leaf checker, under the rules' policy and custom_gradient's.

Rules (``cast="weak", absent="zeros"``) cast only weakly typed values and turn
``None`` into zeros; custom_gradient closures (``cast="real", absent="none"``)
cast any boolean, integer or floating value back to the argument's dtype and
keep ``None``. The same value is checked under both here.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src.core import validate

RULE = dict(where="rule r for op 'sin' at f.py:3", leaf="leaf 0", what="cotangent", cast="weak", absent="zeros")
FN = dict(where="custom_gradient function 'f': its grad_fn", leaf="`x`", what="gradient", cast="real", absent="none")
X32 = jnp.array([1.0, 2.0, 3.0], jnp.float32)


def _raises(value, primal, policy, pattern):
    with pytest.raises(gk.GradkitError, match=pattern) as info:
        validate.check_leaf(value, primal, **policy)
    msg = str(info.value)
    assert msg.startswith(f"[gradkit] {policy['where']} returned ") and policy["leaf"] in msg, msg
    return msg


def _same(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_float64_leaf_for_float32_primal_under_x64():
    with jax.enable_x64(True):
        g = jnp.array([0.1, 1e-50, 3e40], jnp.float64)  # rounds, flushes to 0, overflows to inf
        _same(validate.check_leaf(g, X32, **FN), np.array([np.float32(0.1), 0.0, np.inf], np.float32))
        _raises(g, X32, RULE, r"of dtype float64 for leaf 0, expected float32 .*\.astype\(float32\)")
        weak = jnp.asarray(0.5) * jnp.ones(3, jnp.float64)  # float64, but not weakly typed
        _raises(weak, X32, RULE, r"of dtype float64")
        # a weakly typed float64 value takes the primal's dtype under both
        _same(validate.check_leaf(jnp.asarray(0.1), jnp.float32(2.0), **RULE), jnp.float32(0.1))
        _same(validate.check_leaf(jnp.asarray(0.1), jnp.float32(2.0), **FN), jnp.float32(0.1))


@pytest.mark.parametrize("value", [np.array([1, 0, 2], np.int32), np.array([True, False, True])])
def test_integer_and_boolean_arrays(value):
    _same(validate.check_leaf(value, X32, **FN), value.astype(np.float32))
    _raises(value, X32, RULE, rf"of dtype {value.dtype} for leaf 0, expected float32")


def test_python_numbers():
    one = jnp.float32(1.0)
    _same(validate.check_leaf(True, one, **FN), jnp.float32(1.0))
    _raises(True, one, RULE, r"returned a Python bool as the cotangent for leaf 0 \(float32\[\]\)")
    for policy in (RULE, FN):
        _same(validate.check_leaf(0.1, jnp.bfloat16(1.0), **policy), jnp.asarray(0.1, jnp.bfloat16))
        _same(validate.check_leaf(2**40, one, **policy), jnp.float32(2.0**40))  # not through int32
        _same(validate.check_leaf(1j, jnp.complex64(1.0), **policy), jnp.complex64(1j))
        _raises(1j, one, policy, r"Python complex .* imaginary part would be lost")
        _raises(0.5, X32, policy, r"Python float as the .* which is float32\[3\]\. .*jnp\.full_like")


def test_complex_for_real_shape_and_non_arrays_are_errors_under_both():
    for policy in (RULE, FN):
        _raises(X32.astype(jnp.complex64), X32, policy, r"of dtype complex64 .* expected float32 .*is complex")
        _raises(jnp.ones((2, 3)), X32, policy, r"of shape \(2, 3\) for .*, expected \(3,\) .*It looks broadcast")
        _raises(jnp.ones((3, 2)), jnp.ones((2, 3)), policy, r"of shape \(3, 2\) .*Broadcast or reduce it")
        _raises("oops", X32, policy, r"returned str as the .*expected an array float32\[3\] or None")
        # an object array is a GradkitError under both (it is not cast)
        _raises(np.array([None, 1, 2], dtype=object), X32, policy, r"of dtype object")
    # a real value for a complex primal is cast under "real" only
    _same(validate.check_leaf(X32, X32.astype(jnp.complex64), **FN), X32.astype(jnp.complex64))
    _raises(X32, X32.astype(jnp.complex64), RULE, r"of dtype float32 .* expected complex64")


def test_none_and_no_tangent_space():
    _same(validate.check_leaf(None, X32, **RULE), jnp.zeros(3, jnp.float32))
    assert validate.check_leaf(None, X32, **FN) is None
    for value in (None, X32, "anything"):  # whatever was returned for an integer primal
        z = validate.check_leaf(value, jnp.arange(3), **RULE)
        assert z.dtype == jax.dtypes.float0 and z.shape == (3,)
        assert validate.check_leaf(value, jnp.arange(3), **FN) is None


def test_matching_leaves_pass_through_as_jax_values():
    for policy in (RULE, FN):
        got = validate.check_leaf(np.full(3, 4.0, np.float32), X32, **policy)
        assert isinstance(got, jax.Array)
        _same(got, np.full(3, 4.0, np.float32))
