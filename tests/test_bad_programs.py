"""Bad programs: Python control flow on traced values and static arguments. See bad_input_cases.py for the contract."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bad_input_cases import (
    X,
    notes,
)

import gradkit as gk

# --------------------------------------------------------------------------- Python control flow in the function


def branchy(x):
    if x > 0:  # Python control flow on a traced value
        return jnp.sin(x)
    return x


@pytest.mark.parametrize("call", ["eager", "jit", "grad"])
def test_python_if_on_a_traced_argument_keeps_jax_error_with_a_gradkit_note(call):
    f = gk.override(branchy, {"sin": gk.vjp_rule(lambda op, g: (g,))})
    run = {"eager": f, "jit": jax.jit(f), "grad": jax.grad(f)}[call]
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        run(jnp.float32(1.0))
    text = notes(info.value)
    assert "branchy" in text and "dispatch.py" not in str(info.value)  # names the user's function
    if call == "eager":  # the gradkit note explains why an eager call fails
        assert "[gradkit] gk.override traces branchy" in text and "dyn[0] is x" in text
        assert "lax.cond" in text


@pytest.mark.parametrize("kind", ["int", "numpy"])
def test_other_concretizations_get_the_note(kind):
    def fn(params, n):
        w = params["w"]
        return jnp.ones(int(w)) if kind == "int" else jnp.asarray(np.asarray(w))

    with pytest.raises((jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                        jax.errors.TracerArrayConversionError)) as info:
        gk.override(fn, {})({"w": jnp.float32(3.0)}, 2)
    assert "dyn[0] is params['w']" in notes(info.value)


def test_python_if_on_a_python_number_works_it_is_static():
    f = gk.override(lambda x, n: jnp.sin(x) if n > 0 else x, {"sin": gk.vjp_rule(lambda op, g: (g * 5.0,))})
    assert float(jax.grad(f)(jnp.float32(1.0), 1)) == 5.0
    assert float(jax.grad(f)(jnp.float32(1.0), -1)) == 1.0


def test_python_if_inside_a_named_op_gets_a_note():
    @gk.op("branchy_op")
    def op_fn(x):
        return x if x > 0 else -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        op_fn(jnp.float32(1.0))
    assert "[gradkit] named op 'branchy_op'" in notes(info.value)


# --------------------------------------------------------------------------- static arguments


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return isinstance(other, _Unhashable)


@pytest.mark.parametrize("bad", [{1, 2}, _Unhashable(), (1.0, {"k": {2}})],
                         ids=["set", "eq_no_hash", "set_deep_in_a_pytree"])
def test_unhashable_static_arguments(bad):
    f = gk.override(lambda x, cfg: jnp.sum(x), {})
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override\(.*of type (set|_Unhashable) .*not hashable"):
        f(X, bad)


def test_hashable_non_array_statics_work_and_key_the_cache():
    calls = []

    def fn(x, mode, act, none):
        calls.append((mode, act))
        assert none is None
        return act(x) if mode == "act" else x

    f = gk.override(fn, {"sin": gk.vjp_rule(lambda op, g: (g * 4.0,))})
    assert float(jax.grad(lambda x: f(x, "act", jnp.sin, None))(jnp.float32(0.0))) == 4.0
    f(X, "act", jnp.sin, None), f(X, "act", jnp.sin, None), f(X, "id", jnp.sin, None)
    assert calls == [("act", jnp.sin), ("act", jnp.sin), ("id", jnp.sin)]  # one scalar trace, one per new static


def test_equal_statics_of_different_types_do_not_share_a_program():
    # 1 == 1.0 == True in Python; the programs differ (int / float / bool values).
    f = gk.override(lambda x, s: (x, jnp.asarray(s)), {})
    assert f(X, 1)[1].dtype == jnp.int32
    assert f(X, True)[1].dtype == jnp.bool_
    assert f(X, 1.0)[1].dtype == jnp.float32
    assert f.trace_count == 3


def test_negative_zero_static_is_not_served_the_positive_zero_program():
    f = gk.override(lambda x, s: x / s, {})
    assert np.all(np.asarray(f(X, 0.0)) == np.inf)
    assert np.all(np.asarray(f(X, -0.0)) == -np.inf)


def test_nan_static_hits_one_cache_entry():
    f = gk.override(lambda x, s: x + s, {})
    for _ in range(3):
        assert np.isnan(f(X, float("nan"))).all()
    assert f.trace_count == 1


def test_named_op_keyword_statics_of_different_types_do_not_share_a_program():
    @gk.op("typed_kw")
    def scale(x, *, s):
        return x * 1.0, jnp.asarray(s)

    assert scale(X, s=1)[1].dtype == jnp.int32
    assert scale(X, s=True)[1].dtype == jnp.bool_
    assert scale(X, s=1.0)[1].dtype == jnp.float32
    assert not np.signbit(scale(X, s=0.0)[1]) and np.signbit(scale(X, s=-0.0)[1])


def test_python_number_statics_equal_jit_with_static_argnums_bit_for_bit():
    # Python numbers are static (compile-time constants): the forward equals
    # jax.jit(f, static_argnums=...) bit for bit; `x ** 2.0` stays an exact square.
    fn = lambda x, p, s: jnp.tanh(x ** p) * s
    xs = jnp.linspace(-2.0, 2.0, 9, dtype=jnp.float32)
    f = gk.override(fn, {"tanh": gk.vjp_rule(lambda op, g: (g,))})
    np.testing.assert_array_equal(f(xs, 2.0, 0.3), jax.jit(fn, static_argnums=(1, 2))(xs, 2.0, 0.3))
    np.testing.assert_array_equal(f(xs, 2.0, 0.3), fn(xs, 2.0, 0.3))
