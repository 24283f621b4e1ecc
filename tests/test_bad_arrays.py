"""Bad arrays: input dtypes and shapes, donated buffers, outputs. See bad_input_cases.py for the contract."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bad_input_cases import (
    X,
    hand_sin,
    loss,
    x64,
)

import gradkit as gk

# --------------------------------------------------------------------------- input dtypes and shapes


def _rule_sin(op, g):
    return (g * 2.0 * jnp.cos(op.inputs[0]),)


SIN2 = gk.vjp_rule(_rule_sin)

DTYPE_CASES = [
    # id, function of (sine, x), input, differentiable
    ("int32", lambda s, x: s(x.astype(jnp.float32)) * 2.0, jnp.arange(4, dtype=jnp.int32), False),
    ("uint8", lambda s, x: s(x.astype(jnp.float32)), jnp.arange(4, dtype=jnp.uint8), False),
    ("bool", lambda s, x: jnp.where(x, s(jnp.ones(x.shape)), 0.0), jnp.array([True, False, True]), False),
    ("bf16", lambda s, x: s(x) * x, jnp.linspace(-1, 1, 5, dtype=jnp.bfloat16), True),
    ("f16", lambda s, x: s(x) * x, jnp.linspace(-1, 1, 5, dtype=jnp.float16), True),
    ("f32_zero_size", lambda s, x: s(x) * x, jnp.ones((0,), jnp.float32), True),
    ("f32_zero_size_2d", lambda s, x: s(x) + 1.0, jnp.ones((3, 0), jnp.float32), True),
    ("f32_scalar", lambda s, x: s(x) * x, jnp.float32(0.7), True),
]


@pytest.mark.parametrize("case", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
def test_input_dtypes_forward_and_gradients(case, maybe_jit):
    name, template, x, differentiable = case
    fn = functools.partial(template, jnp.sin)
    f = gk.override(fn, {"sin": SIN2})
    out, ref = maybe_jit(f)(x), jax.jit(fn)(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)
    scalar = lambda h: lambda x: jnp.sum(h(x)).astype(jnp.float32)
    if not differentiable:
        # Same error as plain JAX for an integer/boolean argument under grad...
        with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
            jax.grad(scalar(f))(x)
        # ...and float0 zeros with allow_int, like plain JAX.
        g = maybe_jit(jax.grad(scalar(f), allow_int=True))(x)
        assert g.dtype == jax.dtypes.float0 and g.shape == x.shape
        return
    np.testing.assert_array_equal(maybe_jit(jax.grad(scalar(gk.override(fn, {}))))(x),
                                  maybe_jit(jax.grad(scalar(fn)))(x))
    hand = functools.partial(template, hand_sin(_rule_sin))
    got, want = maybe_jit(jax.grad(scalar(f)))(x), maybe_jit(jax.grad(scalar(hand)))(x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, want)


def test_float64_inputs(maybe_jit):
    with x64():
        x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float64)
        f = gk.override(loss, {"sin": SIN2})
        np.testing.assert_array_equal(maybe_jit(f)(x), jax.jit(loss)(x))
        g = maybe_jit(jax.grad(f))(x)
        assert g.dtype == jnp.float64
        np.testing.assert_array_equal(g, maybe_jit(jax.grad(lambda x: jnp.sum(hand_sin(_rule_sin)(x) * 2.0)))(x))


def test_complex_inputs_follow_jax_custom_vjp_convention(maybe_jit):
    # Decision: complex is supported; a rule receives the cotangent JAX gives a
    # jax.custom_vjp bwd and returns what that bwd would (no extra conjugation).
    z = jnp.array([1.0 + 1.0j, -0.5 + 2.0j], jnp.complex64)
    fn = lambda z: jnp.sum(jnp.sin(z))
    f = gk.override(fn, {"sin": SIN2})
    np.testing.assert_array_equal(maybe_jit(f)(z), jax.jit(fn)(z))
    hand = lambda z: jnp.sum(hand_sin(_rule_sin)(z))
    got = maybe_jit(jax.grad(f, holomorphic=True))(z)
    np.testing.assert_array_equal(got, maybe_jit(jax.grad(hand, holomorphic=True))(z))
    np.testing.assert_allclose(got, 2.0 * jnp.cos(z), rtol=1e-6)
    # Real-valued loss of a complex input (the usual case): same as the reference.
    real = lambda z: jnp.real(jnp.sum(jnp.sin(z) * jnp.conj(z)))
    real_hand = lambda z: jnp.real(jnp.sum(hand_sin(_rule_sin)(z) * jnp.conj(z)))
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(real, {"sin": SIN2})))(z),
                                  maybe_jit(jax.grad(real_hand))(z))
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(real, {})))(z), maybe_jit(jax.grad(real))(z))


def test_complex_rule_returning_real_cotangent_is_rejected():
    rule = gk.vjp_rule(lambda op, g: (jnp.real(g),), name="realified")
    with pytest.raises(gk.GradkitError, match=r"realified .*dtype float32.*expected complex64"):
        jax.grad(gk.override(lambda z: jnp.sum(jnp.sin(z)), {"sin": rule}), holomorphic=True)(
            jnp.array([1.0 + 1.0j], jnp.complex64))


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_python_numbers_are_static_as_jax_jit_static_argnums_is():
    """Eager calls with a Python float: jax.jit(static_argnums=0)'s value bit for bit, over many values."""
    fn = lambda x: jnp.sin(x) * 2.0 + jnp.exp(x / 50.0)
    f = gk.override(fn, {"sin": SIN2})
    ref = jax.jit(fn, static_argnums=0)
    for v in np.linspace(-100.0, 100.0, 101):
        np.testing.assert_array_equal(f(float(v)), ref(float(v)))
        np.testing.assert_array_equal(f(jnp.float32(v)), jax.jit(fn)(jnp.float32(v)))  # arrays: dynamic


@pytest.mark.parametrize("arg", [1.0, "weak_array", "strong_array", "numpy_scalar"])
def test_weak_typed_scalars_keep_dtype_and_weak_type(arg, maybe_jit):
    x = {1.0: 1.0, "weak_array": jnp.asarray(1.0), "strong_array": jnp.float32(1.0),
         "numpy_scalar": np.float32(1.0)}[arg]
    fn = lambda x: jnp.sin(x) * 2.0
    f = gk.override(fn, {"sin": SIN2})
    # An eager call keys a Python number as static (README, "Compile once"): its reference is jax.jit with
    # static_argnums, which XLA may constant-fold (sin(1.0) folded on the host can differ from the device's
    # sin in the last bit); under jit the number is a tracer, as it is for jax.jit.
    static = isinstance(x, float) and maybe_jit is not jax.jit
    out, ref = maybe_jit(f)(x), jax.jit(fn, static_argnums=0 if static else ())(x)
    assert (out.dtype, out.weak_type) == (ref.dtype, ref.weak_type)
    np.testing.assert_array_equal(out, ref)
    g = maybe_jit(jax.grad(f))(x)
    assert float(g) == pytest.approx(4.0 * np.cos(1.0), rel=1e-6)


def test_prng_key_inputs():
    fn = lambda key, x: jnp.sum(jax.random.normal(key, x.shape) * jnp.sin(x))
    f = gk.override(fn, {"sin": SIN2})
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        np.testing.assert_array_equal(f(key, X), jax.jit(fn)(key, X))
        g = jax.grad(lambda x: f(key, x))(X)
        np.testing.assert_allclose(g, 2.0 * np.asarray(jax.random.normal(key, X.shape)) * np.cos(X), rtol=1e-6)


# --------------------------------------------------------------------------- donated buffers


def test_donated_buffers_donate_through_an_outer_jit():
    # Decision: an eager override call never donates (like jax.jit without
    # donate_argnums); to donate, wrap it: the rewritten program is inlined.
    fn = lambda x: jnp.sin(x) * 2.0
    step = jax.jit(gk.override(fn, {"sin": SIN2}), donate_argnums=0)
    x = X + 0.0
    out = step(x)
    np.testing.assert_array_equal(out, jax.jit(fn)(X))
    assert x.is_deleted()
    # Using the donated array again: JAX's own error, as with jax.jit (its exact
    # type depends on JAX's dispatch path: RuntimeError or ValueError).
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        gk.override(fn, {"sin": SIN2})(x)
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        jax.jit(fn)(x)


def test_eager_call_does_not_donate():
    x = X + 0.0
    gk.override(lambda x: jnp.sin(x), {"sin": SIN2})(x)
    assert not x.is_deleted()


# --------------------------------------------------------------------------- outputs


OUTPUTS = {"none": lambda x: None, "nested_empty": lambda x: ((), {}, [None], {"a": ()}),
           "python_constant": lambda x: 1.5, "identity": lambda x: x,
           "mixed": lambda x: {"y": jnp.sin(x), "empty": (), "n": None}}


@pytest.mark.parametrize("out", list(OUTPUTS))
def test_unusual_outputs_match_jit(out, maybe_jit):
    fn = OUTPUTS[out]
    got, ref = maybe_jit(gk.override(fn, {"sin": SIN2}))(X), jax.jit(fn)(X)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
        np.testing.assert_array_equal(a, b)


def test_grad_of_a_function_returning_none_is_jax_own_error():
    with pytest.raises(TypeError) as ours:
        jax.grad(gk.override(lambda x: None, {}))(X)
    with pytest.raises(TypeError) as plain:
        jax.grad(lambda x: None)(X)
    assert str(ours.value) == str(plain.value)


def test_non_jax_output_names_the_users_function():
    def returns_text(x):
        return jnp.sin(x), "label"

    with pytest.raises(TypeError, match=r"returns_text .* not a valid JAX type"):
        gk.override(returns_text, {})(X)


def test_no_arguments_and_empty_pytree_arguments():
    fn = lambda *args: jnp.sin(jnp.arange(3.0))
    f = gk.override(fn, {"sin": SIN2})
    np.testing.assert_array_equal(f(), jax.jit(fn)())
    np.testing.assert_array_equal(f({}, (), []), jax.jit(fn)({}, (), []))
