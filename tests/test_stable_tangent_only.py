"""The STABLE rules of ``logistic``, ``tanh`` and ``expm1`` compute the derivative alone.

The matched equation computes the value; the rule adds only the kernel's
output tangent (what the kernel's own JVP rule computes), so a first call
traces, lowers and compiles no second copy of the kernel's value per match. The derivative is the one ``jax.jvp`` of the
kernel gave, bit for bit, in every mode and at second order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from budget import covering
from gradkit._src.stable import numerics as k
from gradkit._src.rules import stable as stable_rules
from gradkit._src.core.rule import OpView, Rule

OPS = {"logistic": (jax.nn.sigmoid, k.sigmoid), "tanh": (jnp.tanh, k.tanh), "expm1": (jnp.expm1, k.expm1)}
POINTS = [-90.0, -20.0, -5.0, -0.7, -0.6, -1e-3, -1e-30, -0.0, 0.0, 1e-30, 1e-3, 0.3, 0.625, 1.5, 5.0, 20.0, 90.0]


def _by_jvp_of_kernel(name: str) -> gk.RuleTable:
    """The rule as it was: ``jax.jvp`` of the whole kernel (a wrapper, so not the tangent-only path)."""
    kernel = OPS[name][1]
    fn = stable_rules.jvp_via(lambda x: kernel(x), label="reference")
    return gk.RuleTable({name: Rule(fn, "jvp", "reference", ("gradkit", "reference", name))})


def _programs(op):
    def f(x):
        return jnp.sum(jnp.sin(x) * op(0.5 * x) + op(x) ** 2)

    return {
        "grad": jax.grad(f),
        "jvp": lambda x: jax.jvp(f, (x,), (jnp.cos(x),))[1],
        "grad of grad": jax.grad(lambda x: jnp.sum(jax.grad(f)(x) ** 2)),
        "jvp of grad": lambda x: jax.jvp(jax.grad(f), (x,), (jnp.ones_like(x),))[1],
    }


# a covering half in the default set (each op, each dtype), all 12 in the slow set
@pytest.mark.parametrize("name,dtype", covering(sorted(OPS), ["float32", "float64", "float16", "bfloat16"]))
def test_tangent_only_rule_is_the_kernels_derivative_bit_for_bit(name, dtype, x64):
    op = OPS[name][0]
    x = jnp.asarray(POINTS, dtype)
    ours = gk.override(lambda x: op(x), gk.tables.STABLE)
    ref = gk.override(lambda x: op(x), _by_jvp_of_kernel(name))
    for label, prog in _programs(ours).items():
        got = np.asarray(jax.jit(prog)(x))
        want = np.asarray(jax.jit(_programs(ref)[label])(x))
        assert got.dtype == want.dtype, label
        assert got.tobytes() == want.tobytes(), (name, dtype, label, got, want)
    assert np.array_equal(np.asarray(jax.jit(ours)(x)), np.asarray(jax.jit(op)(x)), equal_nan=True)


def _custom_jvp_calls(jaxpr) -> int:
    return sum(e.primitive.name == "custom_jvp_call" for e in jaxpr.jaxpr.eqns)


@pytest.mark.parametrize("name", sorted(OPS))
def test_tangent_only_rule_traces_no_second_value(name):
    """The rule traces no call of the kernel itself: only what its tangent needs (sigmoid_prime)."""
    kernel = OPS[name][1]
    table_rule = gk.tables.STABLE[name]
    reference = stable_rules.jvp_via(lambda x: kernel(x), label="reference")
    x = jnp.linspace(-3.0, 3.0, 8, dtype=jnp.float32)

    def traced(rule):
        def f(x, t):
            return rule(OpView(name, (x,), (kernel(x),), {}, "here"), (t,))
        return jax.make_jaxpr(f)(x, x)

    ours, before = traced(table_rule.fn), traced(reference)
    # The op's output in the view is one call; the reference adds the kernel's value again.
    assert _custom_jvp_calls(before) == _custom_jvp_calls(ours) + 1
    assert len(ours.jaxpr.eqns) < len(before.jaxpr.eqns)


def test_integer_and_complex_inputs_keep_their_paths():
    """No float input: nothing to differentiate; complex: JAX's own derivative (as before)."""
    z = jnp.asarray([0.5 + 0.25j, -1.0 + 2.0j], jnp.complex64)
    f = gk.override(lambda z: jnp.tanh(z), gk.tables.STABLE)
    got = jax.jvp(f, (z,), (jnp.ones_like(z),))[1]
    want = jax.jit(lambda z: jax.jvp(jnp.tanh, (z,), (jnp.ones_like(z),))[1])(z)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
