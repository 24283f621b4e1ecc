"""gk.compare: a custom gradient against a reference, with the cause of the difference, in numbers.

The three discrepancies of the issue: a rule that is a finite difference, a
rule with a branch that is wrong on one side, and a rule whose precision
differs from the forward pass (float32 inside a float64 forward, and a float64
cotangent for a float32 input).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src.checks.compare import compare


def plain_sin(x):
    return jnp.sum(jnp.sin(x))


def fd_sin(h):
    """(a) the rule is a forward finite difference (sin(x+h) - sin(x)) / h."""
    return gk.override(plain_sin, {"sin": gk.vjp_rule(lambda op, g: g * (jnp.sin(op.inputs[0] + h) - op.outputs[0]) / h)})


def test_finite_difference_rule_is_an_approximation_with_its_step(x64):
    x = jnp.linspace(0.0, 3.0, 12)
    c = compare(fd_sin(1e-3), plain_sin, (x,))
    (ci,) = c.inputs
    assert not c.agrees and ci.mismatched >= 11
    # the error is h/2·sin(x) for a forward difference: at most 5e-4 in absolute value
    assert 4e-4 < ci.max_abs_err < 5.1e-4
    cause = ci.causes[0]
    assert cause.startswith("approximation") and "forward difference" in cause
    h = float(cause.split("step h ≈ ")[1].split(" ")[0])
    assert h == pytest.approx(1e-3, rel=0.02)
    assert "R² = 1.000" in cause or "R² = 0.99" in cause
    # every element side by side: input, custom, reference
    assert len(ci.jacobians) == 12
    el, xv, cv, rv = ci.jacobians[5]
    assert el == "dx[5]" and xv == pytest.approx(float(x[5]))
    assert rv == pytest.approx(np.cos(float(x[5])), abs=1e-12)
    assert cv - rv == pytest.approx(-5e-4 * np.sin(float(x[5])), rel=2e-3)
    assert "h ≈ 0.001" in str(c)


def test_finite_difference_rule_in_float32(maybe_jit):
    c = compare(maybe_jit(fd_sin(1e-2)), plain_sin, (jnp.linspace(0.1, 3.0, 16, dtype=jnp.float32),))
    (ci,) = c.inputs
    assert ci.causes[0].startswith("approximation")
    assert ci.max_ulp_err > 1e3  # far beyond float32 rounding
    assert ci.max_abs_err == pytest.approx(5e-3 * np.sin(np.linspace(0.1, 3.0, 16)).max(), rel=0.05)


def test_branching_rule_wrong_on_one_side():
    """(b) d|x|/dx written as where(x > 0, 1, 1): right for x > 0, wrong for x < 0."""
    rule = gk.vjp_rule(lambda op, g: g * jnp.where(op.inputs[0] > 0, 1.0, 1.0))
    f = gk.override(lambda x: jnp.sum(jnp.abs(x)), {"abs": rule})
    x = jnp.array([-2.0, -0.5, 0.25, 1.0, 3.0, -4.0])
    for ref in (lambda x: jnp.sum(jnp.abs(x)), "fd"):
        (ci,) = compare(f, ref, (x,)).inputs
        assert ci.mismatched == 3 and ci.size == 6
        assert ci.max_abs_err == pytest.approx(2.0)
        assert ci.worst_custom == 1.0 and ci.worst_reference == pytest.approx(-1.0)
        assert ci.worst_input < 0
        assert ci.causes[0].startswith("branch: the gradient is wrong exactly where x < 0 (3 of 6 elements")


def test_float32_backward_inside_a_float64_forward(x64):
    """(c) the rule computes in float32 although the forward pass is float64."""
    rule = gk.vjp_rule(lambda op, g: g * jnp.cos(op.inputs[0].astype(jnp.float32)).astype(jnp.float64))
    f = gk.override(plain_sin, {"sin": rule})
    (ci,) = compare(f, plain_sin, (jnp.linspace(0.1, 3.0, 10),)).inputs
    assert ci.dtype == ci.custom_dtype == "float64"
    assert 1e-9 < ci.max_rel_err < 1e-6 and ci.max_ulp_err > 1e6  # float32 rounding, in float64 ULPs
    assert ci.causes[0].startswith("precision mismatch: all 10 custom values are exactly representable in float32")


def test_float64_cotangent_for_a_float32_input(x64):
    """(c') a jax.custom_vjp whose backward returns float64 for a float32 input: JAX passes it through."""
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: ((g * jnp.cos(x)).astype(jnp.float64),))
    (ci,) = compare(lambda x: jnp.sum(f(x)), plain_sin, (jnp.linspace(0.1, 1.0, 4, dtype=jnp.float32),)).inputs
    assert (ci.dtype, ci.custom_dtype, ci.reference_dtype) == ("float32", "float64", "float32")
    assert not ci.agrees
    assert ci.causes[0].startswith("dtype mismatch: the custom gradient is float64 but x is float32")


def test_ignored_term_and_agreement():
    @jax.custom_vjp
    def mul(x, y):
        return x * y

    mul.defvjp(lambda x, y: (x * y, (x, y)), lambda res, g: (g * res[1], None))  # forgets d/dy
    c = compare(lambda x, y: jnp.sum(mul(x, y)), lambda x, y: jnp.sum(x * y),
                (jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])))
    cx, cy = c.inputs
    assert cx.agrees and cx.max_abs_err == 0.0 and "no discrepancy" in cx.causes[0]
    assert not cy.agrees and cy.causes[0].startswith("ignored term: the custom gradient is exactly 0 on 2 of 2")
    assert c["y"] is cy
    with pytest.raises(gk.GradkitError, match="gradients DIFFER"):
        c.raise_if_differs()


def test_non_scalar_outputs_compare_full_jacobians():
    rule = gk.vjp_rule(lambda op, g: 2.0 * g * jnp.cos(op.inputs[0]))  # twice the derivative
    f = gk.override(jnp.sin, {"sin": rule})
    (ci,) = compare(f, jnp.sin, (jnp.array([0.1, 0.2, 0.3]),)).inputs
    assert ci.size == 9  # 3x3 Jacobian
    assert ci.causes[0].startswith("constant factor: the custom gradient is 2")
    assert ci.worst == "d out[0] / dx[0]"
    big = compare(f, jnp.sin, (jnp.linspace(0.1, 1.0, 10),), max_side_by_side=64).inputs[0]
    assert big.jacobians == ()  # 100 elements: not printed in full


def test_bad_arguments():
    with pytest.raises(gk.GradkitError, match="reference must be a function or 'fd'"):
        compare(plain_sin, "autodiff", (jnp.ones(2),))
    with pytest.raises(gk.GradkitError, match="mode must be 'fwd' or 'rev'"):
        compare(plain_sin, plain_sin, (jnp.ones(2),), mode="both")
