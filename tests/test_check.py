"""gk.check_grads: the derivative at the inputs' dtypes (under jit) against float64 finite differences."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as hst

import gradkit as gk
from gradkit._src.checks.check import check_grads
from gradkit._src.checks.describe import fmt
from gradkit._src.checks.fd import select_coords
from budget import covering

F32_TOL = math.sqrt(float(np.finfo(np.float32).eps))  # 3.45e-4: the default atol and rtol for float32


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
    # float32 autodiff against float64 differences: errors at float32 rounding (the old check, in float64
    # throughout, saw 1e-9 here), far inside the float32 tolerance
    assert all(row.dtype == "float32" and row.max_abs_err < 2e-6 for row in r.rows)
    assert all((row.atol, row.rtol) == (F32_TOL, F32_TOL) for row in r.rows)
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


def test_large_inputs_are_sampled_and_float32_is_checked_at_float32():
    x = jnp.linspace(-2.0, 2.0, 200, dtype=jnp.float32)
    f = lambda v: jnp.sum(jnp.exp(v) * v)
    r = check_grads(f, (x,), order=1, modes=("rev",), max_coords=16)
    (row,) = r.rows
    assert (row.checked, row.total) == (16, 200)
    assert row.passed and row.dtype == "float32"
    assert 3e-8 < row.max_rel_err < 1e-6  # float32 rounding (1.2e-7 per op): the gradient is the float32 one
    assert "(16 of 200 coordinates)" in str(row)
    # upcast=True is the old check, float64 throughout: what is left is the finite difference's own error
    (up,) = check_grads(f, (x,), order=1, modes=("rev",), max_coords=16, upcast=True).rows
    assert up.passed and up.dtype == "float64" and up.max_rel_err < row.max_rel_err / 2


def test_a_nan_in_a_coordinate_the_rows_sample_out_fails_the_random_direction():
    n, keep = 200, 16
    hole = next(j for j in range(n) if j not in set(select_coords(n, keep)))
    x = jnp.linspace(0.5, 2.0, n, dtype=jnp.float32).at[hole].set(200.0)
    f = lambda v: jnp.sum(jnp.where(jnp.arange(n) == hole, jnp.log1p(jnp.exp(v)), v**2))  # NaN at `hole` only
    r = check_grads(f, (x,), order=1, modes=("rev",), max_coords=keep)
    assert r.rows[0].passed  # the sampled coordinates are fine
    assert not r.passed and r.jax_check[0][:2] == ("rev", False)
    assert "autodiff nan (float32) where the float64 finite difference is finite" in r.jax_check[0][2]
    assert "random direction through every input (rev): FAILED" in str(r)


@pytest.mark.parametrize("kwargs, match", [
    (dict(order=0), "order must be at least 1"),
    (dict(order=1.5), "order must be at least 1 \\(an integer\\), got 1.5"),
    (dict(order=1, modes=("sideways",)), "modes must be 'fwd' and/or 'rev'"),
    (dict(eps=0.0), "eps, the finite-difference step, must be positive"),
    (dict(atol=-1e-3), "atol must be a finite number ≥ 0, got -0.001"),
    (dict(rtol=float("nan")), "rtol must be a finite number ≥ 0"),
    (dict(max_coords=0), "max_coords must be a positive integer, got 0"),
    (dict(upcast="yes"), "upcast must be True or False, got 'yes'"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(gk.GradkitError, match="^\\[gradkit\\] check_grads: " + match):
        check_grads(jnp.sin, (jnp.ones(2),), **kwargs)
    with pytest.raises(gk.GradkitError, match="^\\[gradkit\\] check_grads expects args as a tuple of arguments"):
        check_grads(jnp.sin, jnp.ones(2))


def test_no_float_input_is_an_error_not_a_vacuous_pass():
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] check_grads\(f\): no floating-point input"):
        def f(n):
            return jnp.sin(n * 1.0)
        check_grads(f, (3,))


def test_relative_error_stays_meaningful_where_the_finite_difference_is_zero():
    """d(x²)/dx at 0: the central difference is exactly 0, so |error| / |fd| alone would be ~1e+280."""
    def with_offset(offset):
        rule = gk.vjp_rule(lambda op, g: g * 2.0 * op.inputs[0] + offset)
        return gk.override(lambda x: jnp.sum(x**2), {"integer_pow": rule})

    x = jnp.array([0.0, 1.0])
    # atol=1e-5 given (float32's default would be 3.45e-4): the numbers below count in units of it
    (row,) = check_grads(with_offset(1e-20), (x,), order=1, modes=("rev",), atol=1e-5).rows
    assert row.passed
    # the error at x[0] counts against atol (1e-20 / 1e-5); at x[1] against |fd| = 2 (float64 rounding)
    assert row.max_rel_err < 1e-9
    (row,) = check_grads(with_offset(1e-3), (x,), order=1, modes=("rev",), atol=1e-5).rows
    assert not row.passed
    assert row.max_rel_err == pytest.approx(1e-3 / 1e-5, rel=1e-6)  # 100 atol-units off, not 1e+297
    assert row.max_rel_at == "d out / dx[0]" == row.worst
    assert row.numeric == 0.0 and row.autodiff == pytest.approx(1e-3)
    assert "max rel err 100 at d out / dx[0]" in str(row)


# ----------------------------------------------------------------------------- at the dtype the function runs at


def naive_softplus(x):
    return jnp.sum(jnp.log1p(jnp.exp(x)))


def test_the_reported_case_a_nan_float32_gradient_fails():
    """Issue 25: float32 [1, 200] gave a NaN gradient, and check_grads, evaluating after an upcast, said passed."""
    f = gk.override(lambda x: jnp.sum(jnp.log1p(jnp.exp(x))), gk.tables.SAFE | gk.tables.STABLE)
    x = jnp.array([1.0, 200.0], jnp.float32)
    g = np.asarray(jax.jit(jax.grad(f))(x))  # what the user gets
    assert np.isfinite(g[0]) and np.isnan(g[1])
    r = gk.check_grads(f, (x,), order=2)
    assert not r.passed and not r
    rev1 = next(row for row in r.rows if (row.mode, row.order) == ("rev", 1))
    assert not rev1.passed and rev1.dtype == "float32" and rev1.nonfinite == 1 and rev1.elements == 2
    assert rev1.worst == "d out / dx[1]" and np.isnan(rev1.autodiff) and rev1.numeric == pytest.approx(1.0)
    text = str(r)
    assert text.startswith("check_grads(<lambda>): FAILED (autodiff at the inputs' dtypes under jax.jit vs "
                           "float64 finite differences, eps=0.0001; tolerance float32: atol=rtol=0.000345 "
                           "(sqrt(eps(float32))))")
    assert ("FAIL x              order 1 rev (float32): autodiff is not finite at 1 of 2 elements where the "
            "float64 finite difference is finite; first d out / dx[1]: autodiff nan vs finite difference 1") in text
    assert all(not row.passed for row in r.rows)  # orders 1 and 2, both modes
    assert [ok for _, ok, _ in r.jax_check] == [False, False]
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] check_grads\(<lambda>\) failed:\n  FAIL x .*dx\[1\]"):
        r.raise_if_failed()
    # the old check, now an explicit option: float64 throughout, where exp(200) does not overflow
    up = gk.check_grads(f, (x,), upcast=True)
    assert up.passed and up.upcast and all(row.dtype == "float64" for row in up.rows)
    assert "upcast=True: autodiff and finite differences both in float64, not at the inputs' dtypes" in str(up)
    assert "jax.test_util.check_grads modes=('rev',): passed" in str(up)


def test_a_non_finite_element_is_named_by_leaf_and_index():
    def loss(params, x):
        return jnp.sum(jnp.log1p(jnp.exp(params["w"] * x[None, :]))) + jnp.sum(params["b"] ** 2)

    params = {"b": jnp.array([0.5]), "w": jnp.array([[1.0, 2.0], [3.0, 100.0]])}
    r = check_grads(loss, (params, jnp.array([1.0, 1.0])), order=1, modes=("rev",))
    by_input = {row.input: row for row in r.rows}
    assert by_input["params['b']"].passed
    w = by_input["params['w']"]
    assert w.nonfinite == 1 and w.worst == "d out / dparams['w'][1,1]" and np.isnan(w.autodiff)
    assert not by_input["x"].passed and by_input["x"].worst == "d out / dx[1]"


def test_order_2_is_checked_at_the_inputs_dtype():
    """exp(x)/(1+exp(x)) differentiated again overflows in float32 at x = 50: the gradient is right, the Hessian not."""
    x = jnp.array([1.0, 50.0], jnp.float32)
    h = np.asarray(jax.jit(jax.hessian(naive_softplus))(x))
    assert abs(h[1, 1] - 1.9e-22) > 0.5  # float32's Hessian at 50 is far from the true 1.9e-22
    r = check_grads(naive_softplus, (x,), order=2)
    by = {(row.mode, row.order): row for row in r.rows}
    assert by["rev", 1].passed and by["fwd", 1].passed
    assert not by["rev", 2].passed and not by["fwd", 2].passed
    assert by["rev", 2].worst == "d^2 out / dx[1] dx[1]" and by["rev", 2].numeric == pytest.approx(0.0, abs=1e-12)
    assert check_grads(naive_softplus, (x,), order=2, upcast=True).passed  # float64 has no overflow there


@pytest.mark.parametrize("dtype, tol", [(jnp.float32, 3.45e-4), (jnp.bfloat16, 0.0884), (jnp.float16, 0.03125)])
def test_tolerances_follow_the_dtype(dtype, tol):
    x = jnp.array([0.3, 1.2, -0.7], dtype)
    r = check_grads(lambda v: jnp.sum(jnp.sin(v)), (x,), order=2)
    assert r.passed, str(r)
    name = jnp.dtype(dtype).name
    assert {row.dtype for row in r.rows} == {name}
    assert r.atol == r.rtol == pytest.approx(tol, rel=1e-3)
    assert r.tolerances == ((name, r.atol, r.rtol),)
    assert f"tolerance {name}: atol=rtol={fmt(r.atol)} (sqrt(eps({name})))" in str(r)
    # a rule 1% off: beyond float32's tolerance, within float16's and bfloat16's (one rounding: 0.05%, 0.4%)
    wrong = gk.override(lambda v: jnp.sum(jnp.sin(v)), {"sin": gk.vjp_rule(lambda op, g: g * 1.01 * jnp.cos(
        op.inputs[0]))})
    assert check_grads(wrong, (x,), order=1, modes=("rev",)).passed == (dtype != jnp.float32)


def test_float64_inputs_keep_the_float64_tolerance_and_mixed_dtypes_each_their_own(x64):
    x = jnp.array([0.3, 1.2], jnp.float64)
    w = jnp.array([2.0, -1.0], jnp.float32)
    r = check_grads(lambda x, w: jnp.sum(jnp.sin(x) * w.astype(jnp.float64)) + jnp.sum(w * w).astype(jnp.float64), (x, w), order=1)
    assert r.passed, str(r)
    # w's derivative runs through the float32 w * w: checked at float32; x's at float64 (1e-5, JAX's)
    assert {row.input: row.dtype for row in r.rows} == {"x": "float64", "w": "float32"}
    assert dict((d, a) for d, a, _ in r.tolerances) == {"float64": 1e-5, "float32": pytest.approx(F32_TOL)}
    assert (r.atol, r.rtol) == (pytest.approx(F32_TOL), pytest.approx(F32_TOL))  # the loosest


def test_huge_inputs_are_stepped_relative_and_swamped_elements_are_reported():
    x = jnp.array([1.0, 3e38, -1e30], jnp.float32)
    r = check_grads(lambda v: jnp.sum(jax.nn.softplus(v)), (x,), order=1, modes=("rev",))
    (row,) = r.rows
    assert r.passed, str(r)
    # x[1]: the step is 3e38·2^-30 (x ± 1e-4 is x in float64), so its derivative 1 is resolved; x[0] and x[2]
    # move the 3e38 sum by less than its float64 rounding: only checked to that, and the report says so
    assert row.unresolved == 2 and row.noise > 1e20
    assert "2 of 3 elements only checked to ±" in str(row)


# ----------------------------------------------------------------------------- near a singularity or a kink

# Smooth where they are checked, with a singularity or a kink at 0: a few steps (eps = 1e-4) from it, a central
# difference's truncation error (about h²·f⁽³⁾/6) exceeds the tolerance although the derivative is right.
NEAR_ZERO = {
    "norm": lambda x: jnp.sqrt(jnp.sum(x**2)),
    "reciprocal": lambda x: jnp.sum(1.0 / x),
    "log": lambda x: jnp.sum(jnp.log(x)),
    "sqrt": lambda x: jnp.sum(jnp.sqrt(x)),
    "cbrt": lambda x: jnp.sum(jnp.cbrt(x)),
    "abs": lambda x: jnp.sum(jnp.abs(x)),  # a kink: smooth on each side
}


def _scaled(f, factor):
    """``f`` with every derivative multiplied by ``factor``: a wrong rule (its own derivative is scaled too)."""
    g = jax.custom_jvp(f)
    g.defjvp(lambda primals, tangents: (f(*primals), factor * jax.jvp(f, primals, tangents)[1]))
    return g


def _near_zero_point(distance, dtype):
    u = np.random.RandomState(int(distance * 1e6)).uniform(1.0, 2.0, 3)
    return jnp.asarray(distance * u * np.array([1.0, 1.3, 0.7]), dtype)


# 20, 5 and 0.03 steps from 0; a covering half by default (every function, every distance), all in the slow set
@pytest.mark.parametrize("name,distance", covering(sorted(NEAR_ZERO), [2e-3, 5e-4, 3e-6]))
def test_a_right_derivative_near_a_singularity_passes_and_a_wrong_one_fails(name, distance):
    f = NEAR_ZERO[name]
    for dtype, order in ((jnp.float32, 1), (jnp.float32, 2), (jnp.float64, 1)):
        if dtype == jnp.float32 and order == 2 and name == "norm" and distance < 1e-4:
            continue  # its float32 Hessian cancels to ~1e-7·|H| in some elements: a true float32 error, not a step's
        with jax.enable_x64(dtype == jnp.float64):
            x = _near_zero_point(distance, dtype)
            right = check_grads(f, (x,), order=order)
            assert right.passed, f"{name} at {distance}, order {order}, {dtype.__name__}:\n{right}"
            wrong = check_grads(_scaled(f, 1.01), (x,), order=order, modes=("rev",))
            assert not wrong.passed, f"{name} at {distance}: a derivative 1% off passed:\n{wrong}"


def test_a_kink_inside_the_smallest_step_still_fails():
    # |x| at x = 1e-9, closer to its kink than the smallest step tried (1e-4 / 2^16): the differences never
    # settle, nothing is refined, and autodiff's 1 is compared with the step's difference 1e-5 as before.
    with jax.enable_x64(True):
        x = jnp.array([1e-9], jnp.float64)
        r = check_grads(lambda v: jnp.sum(jnp.abs(v)), (x,), order=1, modes=("rev",))
    assert not r.passed and r.rows[0].numeric == pytest.approx(1e-5, rel=1e-3), str(r)


# ----------------------------------------------------------------------------- property: the verdict is the truth

F32 = np.float32
FUNCTIONS = {
    "softplus naive": naive_softplus,
    "softplus, the reported override": gk.override(naive_softplus, gk.tables.SAFE | gk.tables.STABLE),
    "softplus stable": lambda x: jnp.sum(jax.nn.softplus(x)),
    "log(sum(exp)) naive": lambda x: jnp.log(jnp.sum(jnp.exp(x))),
    "logsumexp stable": jax.nn.logsumexp,
    "sqrt(sum(x^2)) naive": lambda x: jnp.sqrt(jnp.sum(x**2)),
    "sqrt(sum(x^2)) SAFE": gk.override(lambda x: jnp.sqrt(jnp.sum(x**2)), gk.tables.SAFE),
}
ELEMENTS = hst.one_of(
    hst.just(0.0),
    hst.floats(-4.0, 4.0, width=32),
    hst.floats(-120.0, 120.0, width=32),  # exp overflows float32 at 88.7, float64 at 709
    hst.floats(width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False),  # up to 3.4e38
    hst.sampled_from([1e19, -2e19, 1e30, -1e30, 88.0, 89.0, 1e-20]),
)
POINTS = hst.lists(ELEMENTS, min_size=1, max_size=4).map(lambda v: np.array(v, F32))


def _oracle(f, x, order):
    """True when the derivative the user gets (``jax.jit`` at float32) is wrong: non-finite, or off from
    the float64 derivative by more than sqrt(eps32)·(1 + |fd|) plus the difference's own float64 rounding.
    The derivative: a float64 central difference with a step 64 times finer than check_grads' first
    (max(1e-4, |x|·2^-30) / 64), where one at twice that step agrees with it (else the point is not one this
    test can settle: a kink or a singularity within the step). Written plainly: eager float64 evaluations."""
    grad = jax.grad(f)
    user = np.asarray(jax.jit(grad if order == 1 else jax.jacrev(grad))(jnp.asarray(x)), np.float64)
    with jax.enable_x64(True):
        g64 = f if order == 1 else (lambda v: jax.grad(f)(v))
        xs = x.astype(np.float64)

        def central(j, h):
            plus, minus = xs.copy(), xs.copy()
            plus[j] += h
            minus[j] -= h
            fp = np.atleast_1d(np.asarray(g64(jnp.asarray(plus)), np.float64))
            fm = np.atleast_1d(np.asarray(g64(jnp.asarray(minus)), np.float64))
            with np.errstate(invalid="ignore", over="ignore"):
                mag = np.fmax(np.abs(fp), np.abs(fm))
                noise = np.where(np.isfinite(mag), 64 * np.finfo(np.float64).eps * mag / h, 0.0)
                return np.where(fp == fm, 0.0, fp - fm) / (plus[j] - minus[j]), noise

        errs, allowed = [], []
        for j in range(x.size):
            h = max(1e-4, abs(xs[j]) * 2.0**-30) / 64
            fd, noise = central(j, h)
            coarse, coarse_noise = central(j, 2 * h)
            with np.errstate(invalid="ignore", over="ignore"):
                unsettled = np.abs(fd - coarse) > F32_TOL * (1 + np.abs(fd)) / 4 + noise + coarse_noise
                assume(not np.any(unsettled & np.isfinite(fd) & np.isfinite(coarse)))
                a = user[j] if order == 1 else user[:, j]
                err = np.where((a == fd) | (np.isnan(a) & np.isnan(fd)), 0.0, np.abs(a - fd))
            errs.append(np.where(np.isnan(err), np.inf, err))
            allowed.append(F32_TOL * (1 + np.abs(fd)) + noise)
    errs, allowed = np.concatenate([np.ravel(e) for e in errs]), np.concatenate([np.ravel(a) for a in allowed])
    # too close to the line to call (a factor 4 either side): not a question this test can settle
    assume(not np.any((errs > allowed / 4) & (errs < allowed * 4) & np.isfinite(errs)))
    return bool(np.any(~np.isfinite(user)) or np.any(errs > allowed))


def _check_verdict_matches(name, x, order):
    f = FUNCTIONS[name]
    wrong = _oracle(f, x, order) or (order == 2 and _oracle(f, x, 1))
    r = check_grads(f, (jnp.asarray(x),), order=order, modes=("rev",))
    assert r.passed == (not wrong), f"{name} at {x!r}: the user's gradient is {'wrong' if wrong else 'right'}:\n{r}"


NAMES = hst.sampled_from(sorted(FUNCTIONS))


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@settings(max_examples=20, deadline=None, derandomize=True)
@given(name=NAMES, x=POINTS)
@example(name="softplus, the reported override", x=np.array([1.0, 200.0], F32))  # issue 25
@example(name="sqrt(sum(x^2)) naive", x=np.array([0.0, 0.0], F32))  # 0/0
@example(name="sqrt(sum(x^2)) SAFE", x=np.array([0.0, 0.0], F32))
@example(name="sqrt(sum(x^2)) naive", x=np.array([2e19, 1.0], F32))  # x² overflows: gradient 0, not 1
@example(name="logsumexp stable", x=np.array([1e30, -3e38, 1.0], F32))
def test_verdict_is_the_float32_gradient_against_float64_differences(name, x):
    _check_verdict_matches(name, x, order=1)


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@settings(max_examples=6, deadline=None, derandomize=True)
@given(name=hst.sampled_from(["softplus naive", "logsumexp stable", "log(sum(exp)) naive", "sqrt(sum(x^2)) SAFE"]),
       x=POINTS)
@example(name="softplus naive", x=np.array([1.0, 50.0], F32))  # gradient right, Hessian overflows
@example(name="logsumexp stable", x=np.array([528741472.0], F32))  # the direction's atol scales with its length
def test_order_2_verdict_is_the_float32_hessian_against_float64_differences(name, x):
    _check_verdict_matches(name, x, order=2)


@pytest.mark.slow
@settings(max_examples=150, deadline=None, derandomize=True)
@given(name=NAMES, x=POINTS, order=hst.sampled_from([1, 1, 2]))
def test_verdict_property_long(name, x, order):
    _check_verdict_matches(name, x, order)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_default_order_is_one_and_a_passing_report_is_one_line_per_order_and_mode():
    """Issue 29: order 2 by default cost a 65-parameter model 24 s and 24 lines; now order 1, one line per mode."""
    def loss(p, x):
        return jnp.sum(jnp.tanh(x @ p["w"] + p["b"][None, :]) ** 2)

    params = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.array([0.1, -0.2, 0.3])}
    x = jnp.linspace(-2.0, 2.0, 8).reshape(2, 4)
    r = check_grads(loss, (params, x))
    assert r.passed and {row.order for row in r.rows} == {1} and len(r.rows) == 3 * 2  # 3 inputs, 2 modes
    lines = str(r).splitlines()
    assert len(lines) == 1 + 2 + 2  # header, one line per (order, mode), the two random directions
    assert lines[1].startswith("  ok   order 1 fwd: 3 input(s) (float32); max rel err ")
    assert lines[2].startswith("  ok   order 1 rev: 3 input(s) (float32); max rel err ")
    two = check_grads(loss, (params, x), order=2)
    assert {row.order for row in two.rows} == {1, 2} and len(str(two).splitlines()) == 1 + 4 + 2


# --------------------------------------------------------------------------- matmul precision


def _precision_seen(matmul_precision, **outer):
    seen = []

    def f(w, x):
        seen.append(jax.config.jax_default_matmul_precision)
        return jnp.sum(jnp.tanh(x @ w))

    w, x = jnp.ones((3, 2)) * 0.1, jnp.arange(6.0).reshape(2, 3) / 6
    with jax.default_matmul_precision(outer.get("ambient", "bfloat16")):
        report = gk.check_grads(f, (w, x), matmul_precision=matmul_precision)
    assert report.passed  # on the CPU every precision computes float32 products in full
    return set(seen)


def test_products_are_checked_at_full_float32_by_default():
    """TF32 (GPU) or bfloat16 passes (TPU), JAX's defaults there, would fail a float32 check with no bug."""
    assert _precision_seen("float32") == {"float32"}


def test_matmul_precision_none_checks_under_the_callers_configuration():
    assert _precision_seen(None) == {"bfloat16"}


def test_matmul_precision_is_validated():
    with pytest.raises(gk.GradkitError, match=r"check_grads: matmul_precision must be one of .*got 'fp32'"):
        gk.check_grads(jnp.sin, (jnp.ones(2),), matmul_precision="fp32")
