"""SAFE gives one answer per program, whatever the mode.

Random programs (hypothesis) compose singular ops (``sqrt``, ``log``, ``pow``,
division, ``arccos``, ``arcsin``, ``arctan2``, ``rsqrt``, norms) with guards
(``where``, ``clip``, ``maximum``, ``abs``, masks by multiplication) and are
evaluated at inputs that sit on the singular points (0, ±1) as well as at
generic ones. Under ``SAFE | STABLE``:

* wherever the function's value is finite, ``jax.grad`` (reverse) and
  ``jax.jacfwd`` (forward) agree elementwise, and one is finite exactly where
  the other is;
* ``jax.jvp`` along a direction equals the gradient's dot product with it;
* ``jax.hessian`` is finite wherever plain second derivatives are defined
  through the same masks (checked: forward-over-reverse equals
  reverse-over-reverse);
* at generic points the gradient matches float64 central differences.

In float32 and float64. The reported cases (``arccos(clip(y))`` at 10, the norm
of a zero vector, ``pow(·, 0.5)`` of a zero distance, a converged cosine) are
written out too.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from budget import MODES, covering, in_mode
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st

import gradkit as gk

NIGHTLY = os.environ.get("GRADKIT_NIGHTLY", "") not in ("", "0")
SETTINGS = dict(deadline=None, database=None, derandomize=not NIGHTLY, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
TABLE = gk.tables.SAFE | gk.tables.STABLE
N = 4

# --------------------------------------------------------------------------- programs

SINGULAR = ("sqrt", "log", "pow_half", "pow_3half", "recip", "arccos", "arcsin", "atan2", "rsqrt", "norm")
GUARDS = ("where_pos", "clip", "maximum", "abs", "mask_mul", "where_unit", "none")


def programs(depth: int):
    leaf = st.just(("x",))
    if depth == 0:
        return leaf
    sub = st.deferred(lambda: programs(depth - 1))
    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(SINGULAR), st.sampled_from(GUARDS), sub),
        st.tuples(st.just("add"), sub, sub),
        st.tuples(st.just("mul"), sub, sub),
    )


def _singular(name, v):
    if name == "sqrt":
        return jnp.sqrt(v)
    if name == "log":
        return jnp.log(v)
    if name == "pow_half":
        return jnp.power(v, 0.5)
    if name == "pow_3half":
        return jnp.power(v, 1.5)
    if name == "recip":
        return 1.0 / v
    if name == "arccos":
        return jnp.arccos(v)
    if name == "arcsin":
        return jnp.arcsin(v)
    if name == "atan2":
        return jnp.arctan2(v, v * v)
    if name == "rsqrt":
        return jax.lax.rsqrt(v)
    return jnp.sqrt(jnp.sum(v * v)) * jnp.ones_like(v)  # norm


def _guarded(name, guard, v):
    """``name`` applied to ``v`` behind ``guard``: only at points where ``name`` is defined, or masked."""
    if guard == "where_pos":
        return jnp.where(v > 0, _singular(name, jnp.where(v > 0, v, 1.0)), 0.0) + jnp.where(
            v > 0, _singular(name, v), 0.0)
    if guard == "clip":
        return _singular(name, jnp.clip(v, 0.0, 1.0))
    if guard == "maximum":
        return _singular(name, jnp.maximum(v, 0.0))
    if guard == "abs":
        return _singular(name, jnp.abs(v))
    if guard == "mask_mul":
        return _singular(name, v) * (v > 0).astype(v.dtype)
    if guard == "where_unit":
        return jnp.where(jnp.abs(v) < 1, _singular(name, v), 0.0)
    return _singular(name, v)


def build(prog):
    def f(x):
        def ev(p):
            if p[0] == "x":
                return x
            if p[0] == "add":
                return ev(p[1]) + ev(p[2])
            if p[0] == "mul":
                return ev(p[1]) * ev(p[2])
            return _guarded(p[0], p[1], ev(p[2]))
        return jnp.sum(ev(prog))
    return f


SPECIAL = (0.0, 1.0, -1.0, 0.5, -0.5, 2.0)

# --------------------------------------------------------------------------- the checks


def _rtol(dtype):
    return 2e-4 if dtype == jnp.float32 else 1e-10


def check_modes(f, x, in_hypothesis=True):
    """The modes agree where the function's value is finite (else: an overflow, not a mask; see SAFE's doc)."""
    g = gk.override(f, TABLE)
    finite_value = bool(np.isfinite(jax.jit(g)(x)))
    if in_hypothesis:
        assume(finite_value)
    assert finite_value
    rev = np.asarray(jax.jit(jax.grad(g))(x))
    fwd = np.asarray(jax.jit(jax.jacfwd(g))(x))
    eager = np.asarray(jax.grad(g)(x))
    d = jnp.linspace(0.5, 1.5, x.shape[0], dtype=x.dtype)
    _, tangent = jax.jit(lambda x, d: jax.jvp(g, (x,), (d,)))(x, d)
    finite_r, finite_f = np.isfinite(rev), np.isfinite(fwd)
    # One answer: finite in both modes or in neither. Where an unmasked derivative is infinite at one element
    # (JAX's answer), forward mode's one-hot seeds meet it as 0 * inf in the other columns too, as plain JAX.
    assert finite_r.all() == finite_f.all(), f"finite in one mode only: grad {rev}, jacfwd {fwd}"
    np.testing.assert_array_equal(np.isfinite(eager), finite_r, err_msg=f"eager grad {eager} vs jit {rev}")
    finite_r = finite_r & finite_f
    tol = _rtol(x.dtype)
    scale = max(1.0, float(np.max(np.abs(np.where(finite_r, rev, 0.0)))))
    np.testing.assert_allclose(np.where(finite_r, fwd, 0.0), np.where(finite_r, rev, 0.0), rtol=tol,
                               atol=tol * scale, err_msg="jacfwd vs grad")
    if finite_r.all():
        dd = np.asarray(d, np.float64)
        assert np.isfinite(tangent), f"jvp {tangent} but grad {rev}"
        assert abs(float(tangent) - float(rev.astype(np.float64) @ dd)) <= tol * scale * (1 + np.abs(dd).sum())
    return rev


def fd64(f, x, h=1e-6):
    x = np.asarray(x, np.float64)
    with jax.enable_x64(True):
        fx = jax.jit(f)
        out = []
        for i in range(x.shape[0]):
            e = np.zeros_like(x)
            e[i] = h
            out.append((float(fx(jnp.asarray(x + e))) - float(fx(jnp.asarray(x - e)))) / (2 * h))
    return np.array(out)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@settings(max_examples=5, **SETTINGS)  # the default set's budget; the long version below runs 40 at depth 4
@given(prog=programs(3), vals=st.lists(st.sampled_from(SPECIAL), min_size=N, max_size=N))
def test_forward_and_reverse_agree_at_singular_points(dtype, prog, vals):
    with jax.enable_x64(dtype == "float64"):
        check_modes(build(prog), jnp.asarray(vals, dtype))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@settings(max_examples=40, **SETTINGS)
@given(prog=programs(4), vals=st.lists(st.sampled_from(SPECIAL + (0.25, 3.0, -2.0)), min_size=N, max_size=N))
def test_forward_and_reverse_agree_at_singular_points_long(dtype, prog, vals):
    with jax.enable_x64(dtype == "float64"):
        check_modes(build(prog), jnp.asarray(vals, dtype))


@settings(max_examples=8, **SETTINGS)
@given(prog=programs(3), vals=st.lists(st.floats(0.15, 0.85), min_size=N, max_size=N))
def test_matches_float64_finite_differences_where_smooth(prog, vals):
    """Inside (0, 1), away from every singular point and kink: SAFE is the true derivative."""
    f = build(prog)
    with jax.enable_x64(True):
        x = jnp.asarray(vals, jnp.float64)
        got = check_modes(f, x)
        want = fd64(f, x)
    defined = np.isfinite(want)  # outside a function's domain (arccos of 1.2) the value itself is NaN
    assert np.all(np.isfinite(got[defined])), f"SAFE {got} where finite differences give {want}"
    scale = max(1.0, float(np.max(np.abs(want[defined]), initial=0.0)))
    np.testing.assert_allclose(got[defined], want[defined], rtol=1e-5, atol=1e-5 * scale)


def test_hessian_forward_over_reverse_equals_reverse_over_reverse():
    # Not the norm at 0: its true second derivative is infinite there, and where the first derivative
    # exists only because SAFE masked a singularity, the orders of composition may differ (documented).
    cases = [(lambda x: jnp.sum(jnp.arccos(jnp.clip(x, -1.0, 1.0))), [jnp.zeros(3), jnp.array([0.0, 0.5, 2.0])]),
             (lambda x: jnp.sqrt(jnp.sum(x * x)), [jnp.array([0.0, 0.5, 2.0])]),
             (lambda x: jnp.sum(jnp.where(x > 0, x * jnp.log(x), 0.0)), [jnp.zeros(3), jnp.array([0.0, 0.5, 2.0])])]
    for f, points in cases:
        g = gk.override(f, TABLE)
        for x in points:
            h1 = np.asarray(jax.jit(jax.hessian(g))(x))
            h2 = np.asarray(jax.jit(jax.jacrev(jax.jacrev(g)))(x))
            np.testing.assert_array_equal(np.isfinite(h1), np.isfinite(h2))
            np.testing.assert_allclose(np.where(np.isfinite(h1), h1, 0), np.where(np.isfinite(h2), h2, 0),
                                       rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- the reported cases

REPORTED = {
    "arccos of clip at 10": (lambda y: jnp.sum(jnp.arccos(jnp.clip(y, -1.0, 1.0))), [10.0, 0.5], [0.0, None]),
    "norm of a zero vector, masked": (lambda x: jnp.where(jnp.any(x != 0), jnp.linalg.norm(x), 0.0),
                                      [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]),
    "pow 0.5 of a zero distance, masked": (lambda x: jnp.where(jnp.sum((x - 1.0) ** 2) > 0, jnp.power(
        jnp.sum((x - 1.0) ** 2), 0.5), 0.0), [1.0, 1.0], [0.0, 0.0]),
    "sqrt times a literal zero": (lambda x: jnp.sum(jnp.sqrt(x) * jnp.array([0.0, 1.0])), [0.0, 4.0], [0.0, 0.25]),
    "sqrt in a contraction with a constant zero": (lambda x: jnp.array([0.0, 1.0]) @ jnp.sqrt(x), [0.0, 4.0],
                                                   [0.0, 0.25]),
    "sqrt in a product with a constant zero": (lambda x: jnp.prod(jnp.stack([jnp.sqrt(x[0]), jnp.zeros(())]))
                                               + x[1], [0.0, 4.0], [0.0, 1.0]),
    "sqrt times a mask": (lambda x: jnp.sum(jnp.sqrt(x) * (x > 0).astype(x.dtype)), [0.0, 4.0], [0.0, 0.25]),
    "x log x under where": (lambda x: jnp.sum(jnp.where(x > 0, x * jnp.log(x), 0.0)), [0.0, 1.0], [0.0, 1.0]),
}


def test_a_singularity_the_gradient_reaches_is_non_finite_in_every_mode():
    """arccos of a cosine that converged to exactly 1 (the clip's bound, where its derivative is 1/2): the
    cotangent reaches arccos'(1) = -inf. SAFE cannot make that finite (gk.stable.safe_arccos can), but every
    mode says the same."""
    f = lambda y: jnp.sum(jnp.arccos(jnp.clip(y, -1.0, 1.0)))
    rev = check_modes(f, jnp.array([1.0, 0.5], jnp.float32), in_hypothesis=False)
    assert not np.isfinite(rev[0]) and np.isfinite(rev[1])


@pytest.mark.parametrize("name,mode", covering(sorted(REPORTED), MODES))  # every case, one mode by default
def test_reported_cases_agree_in_every_mode(name, mode):
    maybe_jit = in_mode(mode)
    f, x, want = REPORTED[name]
    x = jnp.asarray(x, jnp.float32)
    g = gk.override(f, TABLE)
    plain = np.asarray(jax.grad(f)(x))
    assert not np.all(np.isfinite(plain)), "the reported case is NaN in plain JAX"
    results = {
        "grad": np.asarray(maybe_jit(jax.grad(g))(x)),
        "jacrev": np.asarray(maybe_jit(jax.jacrev(g))(x)),
        "jacfwd": np.asarray(maybe_jit(jax.jacfwd(g))(x)),
        "jvp": np.asarray([maybe_jit(lambda x, e: jax.jvp(g, (x,), (e,))[1])(x, e) for e in jnp.eye(x.shape[0])]),
    }
    for mode, r in results.items():
        assert np.all(np.isfinite(r)), f"{mode}: {r}"
        for i, w in enumerate(want):
            if w is not None:
                assert r[i] == pytest.approx(w, abs=1e-6), f"{mode}: {r}"
        np.testing.assert_allclose(r, results["grad"], rtol=1e-6, atol=1e-7, err_msg=mode)
    assert np.all(np.isfinite(np.asarray(maybe_jit(jax.hessian(g))(x))))


VALUE_ZEROS = {
    # a zero that is a value, not a mask: JAX's answer stays (NaN); the old answer is an explicit choice
    "norm of a zero vector": (lambda x: jnp.sqrt(jnp.sum(x ** 2)), [0.0, 0.0, 0.0]),
    "pow 0.5 of a zero distance": (lambda x: jnp.power(jnp.sum((x - 1.0) ** 2), 0.5), [1.0, 1.0]),
    "sqrt squared": (lambda x: jnp.sum(jnp.sqrt(x) ** 2), [0.0, 4.0]),
    "harmonic energy": (lambda x: jnp.linalg.norm(x) ** 2, [0.0, 0.0]),
}


@pytest.mark.parametrize("name", sorted(VALUE_ZEROS))
def test_a_value_zero_is_not_a_mask(name):
    f, x = VALUE_ZEROS[name]
    x = jnp.asarray(x, jnp.float32)
    g = gk.override(f, TABLE)
    plain = np.asarray(jax.grad(f)(x))
    for mode in (jax.grad, jax.jacrev, jax.jacfwd):
        got = np.asarray(jax.jit(mode(g))(x))
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(np.asarray(jax.jit(mode(f))(x))), err_msg=str(got))
    assert not np.all(np.isfinite(plain))
    np.testing.assert_array_equal(np.isnan(np.asarray(jax.grad(g)(x))), np.isnan(plain))


def test_the_old_answer_is_an_explicit_stable_function():
    """SAFE gave 0 for a norm of a zero vector; ``gk.stable.safe_norm`` gives it on purpose (a subgradient)."""
    x = jnp.zeros(3)
    assert bool(jnp.all(jnp.isnan(jax.grad(gk.override(jnp.linalg.norm, TABLE))(x))))
    np.testing.assert_array_equal(np.asarray(jax.grad(gk.stable.safe_norm)(x)), np.zeros(3))
