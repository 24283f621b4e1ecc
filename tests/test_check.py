"""gk.check_grads: element-wise float64 finite-difference checks, per input, order and mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src.check import check_grads


def smooth(x, w):
    return jnp.sum(jnp.sin(x) * w) + jnp.sum(x**3) * 0.1


def test_smooth_function_passes_every_order_and_mode(maybe_jit):
    x = jnp.array([0.3, -1.2, 2.0])
    w = jnp.array([1.0, 2.0, -0.5])
    r = check_grads(maybe_jit(smooth), (x, w), order=2)
    assert r.passed, str(r)
    assert [(row.input, row.order, row.mode) for row in r.rows] == [
        ("x", 1, "fwd"), ("x", 2, "fwd"), ("x", 1, "rev"), ("x", 2, "rev"),
        ("w", 1, "fwd"), ("w", 2, "fwd"), ("w", 1, "rev"), ("w", 2, "rev")]
    assert all(row.max_abs_err < 1e-7 for row in r.rows)
    assert [m for m, ok, _ in r.jax_check] == ["fwd", "rev"] and all(ok for _, ok, _ in r.jax_check)
    # the worst element is named with the autodiff and finite-difference values there
    row = r.rows[2]
    assert row.worst.startswith("d out / dx[")
    j = int(row.worst.split("dx[")[1].rstrip("]"))
    assert row.autodiff == pytest.approx(float(np.cos(float(x[j])) * w[j] + 0.3 * x[j] ** 2), rel=1e-6)
    assert r.raise_if_failed() is r
    assert "passed" in str(r)


def test_wrong_rule_fails_with_the_worst_element_and_numbers():
    rule = gk.vjp_rule(lambda op, g: g * 1.01 * jnp.cos(op.inputs[0]))
    f = gk.override(lambda x: jnp.sum(jnp.sin(x)), {"sin": rule})
    x = jnp.array([0.0, 1.0, 2.0])
    r = check_grads(f, (x,), order=1, modes=("rev",))
    assert not r.passed
    (row,) = r.failures
    assert row.mode == "rev" and row.order == 1
    assert row.worst == "d out / dx[0]"  # |0.01 cos(x)| is largest at x = 0
    assert row.autodiff == pytest.approx(1.01, rel=1e-6)
    assert row.numeric == pytest.approx(1.0, rel=1e-6)
    assert row.max_rel_err == pytest.approx(0.01, rel=1e-3)
    assert r.jax_check == (("rev", False, r.jax_check[0][2]),)
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] check_grads\(<lambda>\) failed:\n.*FAIL x"):
        r.raise_if_failed()
    with pytest.raises(gk.GradkitError, match="autodiff 1.01 vs finite difference 1"):
        check_grads(f, (x,), order=1, modes=("rev",), raise_on_failure=True)


def test_forward_mode_through_a_vjp_rule_is_reported_not_raised():
    f = gk.override(jnp.sin, {"sin": gk.vjp_rule(lambda op, g: g * jnp.cos(op.inputs[0]))})
    r = check_grads(f, (jnp.array([0.5, 1.0]),), order=1)
    fwd = [row for row in r.rows if row.mode == "fwd"][0]
    rev = [row for row in r.rows if row.mode == "rev"][0]
    assert not fwd.passed and "forward-mode" in fwd.error
    assert rev.passed
    assert not r.passed


def test_second_order_error_is_isolated_to_order_2():
    @jax.custom_jvp
    def f(x):
        return jnp.sin(x)

    # right first derivative, but its own derivative is 0 (stop_gradient): the Hessian is wrong
    f.defjvp(lambda p, t: (f(p[0]), t[0] * jnp.cos(jax.lax.stop_gradient(p[0]))))
    r = check_grads(lambda x: jnp.sum(f(x)), (jnp.array([0.4, 1.3]),), order=2, modes=("fwd",))
    by_order = {row.order: row for row in r.rows}
    assert by_order[1].passed and not by_order[2].passed
    assert by_order[2].worst.startswith("d^2 out / dx[")
    assert by_order[2].autodiff == 0.0
    assert by_order[2].numeric == pytest.approx(-np.sin(1.3), rel=1e-5)


def test_pytree_and_integer_inputs():
    params = {"b": jnp.array(0.5), "w": jnp.array([1.0, -2.0])}

    def f(p, x, n):
        return jnp.sum(jnp.tanh(p["w"] * x + p["b"])) * n

    r = check_grads(f, (params, jnp.array([0.3, 0.7]), 3), order=1, modes=("rev",))
    assert r.passed, str(r)
    assert [row.input for row in r.rows] == ["p['b']", "p['w']", "x"]  # the integer n is not differentiated


def test_large_inputs_are_sampled_and_float32_is_checked_in_float64():
    x = jnp.linspace(-2.0, 2.0, 200, dtype=jnp.float32)
    r = check_grads(lambda v: jnp.sum(jnp.exp(v) * v), (x,), order=1, modes=("rev",), max_coords=16)
    (row,) = r.rows
    assert (row.checked, row.total) == (16, 200)
    assert row.passed and row.max_rel_err < 1e-6  # float64: far below float32 rounding (1.2e-7 per op)
    assert "(16 of 200 coordinates)" in str(row)


@pytest.mark.parametrize("kwargs, match", [
    (dict(order=0), "order must be at least 1"),
    (dict(order=1, modes=("sideways",)), "modes must be 'fwd' and/or 'rev'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(gk.GradkitError, match=match):
        check_grads(jnp.sin, (jnp.ones(2),), **kwargs)
    with pytest.raises(gk.GradkitError, match="tuple of arguments"):
        check_grads(jnp.sin, jnp.ones(2))


def test_relative_error_stays_meaningful_where_the_finite_difference_is_zero():
    """d(x²)/dx at 0: the central difference is exactly 0, so |error| / |fd| alone would be ~1e+280."""
    def with_offset(offset):
        rule = gk.vjp_rule(lambda op, g: g * 2.0 * op.inputs[0] + offset)
        return gk.override(lambda x: jnp.sum(x**2), {"integer_pow": rule})

    x = jnp.array([0.0, 1.0])
    (row,) = check_grads(with_offset(1e-20), (x,), order=1, modes=("rev",)).rows
    assert row.passed
    # the error at x[0] counts against atol (1e-20 / 1e-5); at x[1] against |fd| = 2 (float64 rounding)
    assert row.max_rel_err < 1e-9
    (row,) = check_grads(with_offset(1e-3), (x,), order=1, modes=("rev",)).rows
    assert not row.passed
    assert row.max_rel_err == pytest.approx(1e-3 / 1e-5, rel=1e-6)  # 100 atol-units off, not 1e+297
    assert row.max_rel_at == "d out / dx[0]" == row.worst
    assert row.numeric == 0.0 and row.autodiff == pytest.approx(1e-3)
    assert "max rel err 100 at d out / dx[0]" in str(row)
