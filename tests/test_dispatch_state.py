"""The dispatcher's state: bounded and clearable caches, nothing written during a trace, every named op found.

Each test is one reported way an overridden function could answer differently
from ``jax.jit`` or fail where ``jax.jit`` works: more than 128 named ops in one
trace, an output structure that depends on the input type, ``jax.disable_jit``,
a rule closing over a traced value, a method, caches that grow for ever.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src.core import named
from gradkit._src.core.cache import LRU, MAXSIZE

# --------------------------------------------------------------------------- many named ops in one trace

# Not JAX's derivative (scale): scale squared, so a rule that was not applied shows.
SCALE_RULE = {"act": gk.vjp_rule(lambda op, g: (g * op.params["scale"] ** 2,))}


def chain(n, scale):
    def loss(x):
        for _ in range(n):  # decorated on the fly: each op's function is dropped right after its call
            x = gk.op("act")(lambda v, *, scale: v * scale)(x, scale=scale)
        return x
    return loss


@pytest.mark.parametrize("n", [10, 128, 129])
def test_every_named_op_of_a_long_chain_keeps_its_rule(n, maybe_jit):
    scale = 1.001
    g = maybe_jit(jax.grad(gk.override(chain(n, scale), SCALE_RULE)))(jnp.float32(1.0))
    np.testing.assert_allclose(float(g), scale ** (2 * n), rtol=1e-4)


@pytest.mark.slow
def test_a_thousand_named_ops_in_one_trace():
    scale = 1.001
    g = jax.jit(jax.grad(gk.override(chain(1000, scale), SCALE_RULE)))(jnp.float32(1.0))
    np.testing.assert_allclose(float(g), scale ** 2000, rtol=1e-3)


def test_a_vanished_named_op_signature_is_an_error_not_a_fallback():
    # A jitted function traced once outside any override, whose named op was decorated on the fly:
    # its cached trace is reused later, when the decorated function (and its signature) are gone.
    @jax.jit
    def inner(x):
        return gk.op("gone")(lambda v, *, scale: v * scale)(x, scale=3.0)

    inner(jnp.float32(1.0))
    named._RECENT.cache_clear()  # as after 2048 other signatures
    gc.collect()
    f = gk.override(lambda x: inner(x), {"gone": gk.vjp_rule(lambda op, g: (g * op.params["scale"],))})
    with pytest.raises(gk.GradkitError, match=r"\[gradkit\] named op 'gone' at .*no longer known"):
        jax.grad(f)(jnp.float32(1.0))


# --------------------------------------------------------------------------- output structure per trace


def test_named_op_output_structure_follows_each_input_type():
    @gk.op("shape_dependent")
    def op(x):
        return (x, x * 2.0) if x.ndim else x * 3.0

    v, s = jnp.arange(2.0), jnp.float32(1.0)
    for _ in range(3):  # the third call used to read the 0-d call's structure
        a, b = op(v)
        np.testing.assert_array_equal(b, v * 2.0)
        assert float(op(s)) == 3.0


def test_custom_gradient_output_structure_follows_each_input_type():
    @gk.custom_gradient
    def cg(x):
        if x.ndim:
            return (x, x * 2.0), lambda ga, gb: (ga + 2.0 * gb,)
        return x * 3.0, lambda g: (3.0 * g,)

    v, s = jnp.arange(2.0), jnp.float32(1.0)
    for _ in range(3):
        a, b = cg(v)
        np.testing.assert_array_equal(b, v * 2.0)
        assert float(cg(s)) == 3.0
        assert float(jax.grad(cg)(s)) == 3.0
        np.testing.assert_array_equal(jax.grad(lambda v: jnp.sum(cg(v)[1]))(v), [2.0, 2.0])


# --------------------------------------------------------------------------- jax.disable_jit


def test_disable_jit_gives_the_same_values_and_rules_still_apply():
    def loss(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))

    f = gk.override(loss, gk.tables.SAFE)
    x = jnp.array([0.0, 4.0])
    want_v, want_g = f(x), jax.grad(f)(x)
    with jax.disable_jit():
        got_v, got_g = f(x), jax.grad(f)(x)
        fresh = gk.override(loss, gk.tables.SAFE)  # first traced under disable_jit
        fresh_g = jax.grad(fresh)(x)
        _, jvp = jax.jvp(fresh, (x,), (jnp.ones(2),))
    np.testing.assert_array_equal(got_v, want_v)
    np.testing.assert_array_equal(got_g, want_g)
    np.testing.assert_array_equal(fresh_g, [0.0, 0.25])
    assert np.isfinite(jvp)


def test_disable_jit_with_named_ops_and_custom_gradient():
    @gk.custom_gradient
    def clipped(x):
        return x, lambda g: (jnp.clip(g, -1.0, 1.0),)

    act = gk.op("double")(lambda v: v * 2.0)
    f = gk.override(lambda x: jnp.sum(act(clipped(x)) * 5.0), {"double": gk.vjp_rule(lambda op, g: (g * 3.0,))})
    want = jax.grad(f)(jnp.ones(2))
    with jax.disable_jit():
        got = jax.grad(f)(jnp.ones(2))
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, [1.0, 1.0])


# --------------------------------------------------------------------------- rules that close over traced values


def test_rule_closing_over_a_traced_value_is_a_clear_error():
    def loss(x):
        return jnp.sum(jnp.sin(x))

    @jax.jit
    def step(x, temperature):
        scale = 1.0 / temperature  # a traced value, computed in the step
        table = {"sin": gk.vjp_rule(lambda op, g: (g * scale * jnp.cos(op.inputs[0]),))}
        return jax.grad(gk.override(loss, table))(x)

    with pytest.raises(gk.GradkitError, match=r"\[gradkit\] rule .* for op 'sin' at .*test_dispatch_state.py.*"
                                              r"closes over a traced value \(`scale`\).*op.inputs\[i\]"):
        step(jnp.ones(2), jnp.float32(2.0))


def test_rule_closing_over_a_traced_value_in_a_jvp_rule():
    @jax.jit
    def step(x, k):
        table = {"sin": gk.jvp_rule(lambda op, t: t[0] * k)}
        return jax.jvp(gk.override(jnp.sin, table), (x,), (jnp.ones_like(x),))[1]

    with pytest.raises(gk.GradkitError, match=r"closes over a traced value \(`k`\)"):
        step(jnp.ones(2), jnp.float32(2.0))


def test_rule_closing_over_constants_is_fine(maybe_jit):
    scale = np.float32(2.0)
    f = gk.override(jnp.sin, {"sin": gk.vjp_rule(lambda op, g: (g * scale,))})
    assert float(maybe_jit(jax.grad(f))(jnp.float32(0.3))) == 2.0


# --------------------------------------------------------------------------- methods


def test_override_on_a_method_binds_self(maybe_jit):
    table = {"sin": gk.vjp_rule(lambda op, g: (g * 10.0,))}

    class Model:
        def __init__(self, k):
            self.k = k

        @gk.override(table)
        def loss(self, x):
            return jnp.sum(jnp.sin(x) * self.k)

    m2, m3 = Model(2.0), Model(3.0)
    x = jnp.ones(2)
    np.testing.assert_array_equal(maybe_jit(jax.grad(m2.loss))(x), [20.0, 20.0])
    np.testing.assert_array_equal(maybe_jit(jax.grad(m3.loss))(x), [30.0, 30.0])
    assert float(m2.loss(x)) == pytest.approx(2 * 2 * np.sin(1.0), rel=1e-6)
    assert Model.loss.table is not None  # on the class: the Overridden itself


def test_override_on_an_equinox_module_method():
    table = {"sin": gk.vjp_rule(lambda op, g: (g * 10.0,))}

    class Lin(eqx.Module):
        w: jax.Array

        @gk.override(table)
        def __call__(self, x):
            return jnp.sum(jnp.sin(self.w * x))

    m = Lin(jnp.array([1.0, 2.0]))
    g = jax.grad(lambda m: m(jnp.float32(1.0)))(m)
    np.testing.assert_array_equal(g.w, [10.0, 10.0])


# --------------------------------------------------------------------------- bounded, clearable caches


def test_lru_evicts_the_least_recently_used():
    c = LRU[str, int]("test", maxsize=2)
    c.setdefault("a", 1)
    c.setdefault("b", 2)
    assert c.get("a") == 1  # "a" is now the most recent
    c.setdefault("c", 3)
    assert c.cache_keys() == ["a", "c"] and c.get("b") is None
    assert c.cache_info().currsize == 2 and c.cache_info().maxsize == 2


def test_override_cache_is_bounded_and_stays_correct():
    f = gk.override(lambda x, k: jnp.sin(x) * k, {"sin": gk.vjp_rule(lambda op, g: (g * 2.0,))})
    assert f._cache.maxsize == MAXSIZE
    f._cache.maxsize = 3
    x = jnp.float32(0.5)
    for rnd in range(2):
        for k in range(6):
            assert float(jax.grad(f)(x, float(k))) == 2.0 * k
            assert f.cache_size() <= 3
    assert f.cache_info().traces == 12  # evicted signatures are traced again, never answered wrongly


def test_clear_cache_and_jax_clear_caches_empty_the_caches():
    f = gk.override(jnp.sin, gk.tables.SAFE)
    f(jnp.float32(1.0))
    jax.grad(f)(jnp.float32(1.0))
    assert f.cache_size() == 1
    f.clear_cache()
    assert f.cache_size() == 0
    assert float(f(jnp.float32(1.0))) == pytest.approx(np.sin(1.0))
    jax.grad(f)(2.0)
    assert f.cache_size() >= 1
    jax.clear_caches()
    assert f.cache_size() == 0 and len(f._replacements._cache) == 0
    assert float(jax.grad(f)(jnp.float32(0.0))) == 1.0


@pytest.mark.slow
def test_many_static_values_keep_the_cache_at_its_bound():
    f = gk.override(lambda x, k: x * k, {})
    for k in range(MAXSIZE + 50):
        jax.make_jaxpr(f, static_argnums=1)(jnp.float32(1.0), k)  # traced, not compiled: the cache fills alike
    assert f.cache_size() == MAXSIZE


# --------------------------------------------------------------------------- import touches no backend


def test_import_gradkit_does_not_initialize_the_backend():
    code = textwrap.dedent("""
        import jax
        import gradkit as gk
        jax.config.update("jax_num_cpu_devices", 3)  # raises once a backend exists
        assert len(jax.devices()) == 3, jax.devices()
        print(float(jax.grad(gk.override(jax.numpy.sqrt, gk.tables.SAFE))(4.0)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0.25"
