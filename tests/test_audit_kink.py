"""The audit's verification at a kink (audit/kink.py): where finite differences cannot decide, the float64
gradients at nearby points do (an estimate of the Clarke subdifferential).

The references here are independent of the audit's code: the subdifferential of the norm at 0 is the unit
ball, that of a convex piecewise-linear function the convex hull of its active pieces' slopes, and the
one-sided float64 gradient is ``jax.grad`` of the float64 function inside the domain.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

import gradkit as gk
from gradkit._src.audit import audit as audit_mod
from gradkit._src.audit import fixes as audit_fixes
from gradkit._src.audit import kink, verify
from gradkit._src.audit.fixes import Candidate, Patch
from gradkit._src.audit.program import make_program
from gradkit._src.audit.report import Fix
from gradkit._src.audit.verify import Reference

F32 = np.float32


def _reference(f, x):
    return Reference(make_program(f, (x,), 0), [list(range(np.size(x)))])


# --------------------------------------------------------------------------- the norm at 0


def test_safe_norm_at_zero_is_verified_as_a_subgradient():
    x = np.zeros(3, F32)
    assert not np.all(np.isfinite(jax.grad(jnp.linalg.norm)(x)))
    g = np.asarray(jax.grad(gk.stable.safe_norm)(x))
    assert np.linalg.norm(g) <= 1.0  # in the unit ball: the norm's subdifferential at 0
    r = gk.audit(lambda x: jnp.linalg.norm(x), x)
    fix = r.findings[0].fix
    text = str(r)
    assert fix.verified and fix.name == "gradkit.stable.safe_norm", text
    assert fix.kink == "subgradient" and fix.kink_ok and fix.kink_elements == 3 and fix.kink_points >= 8
    assert fix.verdict().startswith("verified: the function has a kink here; this is a subgradient")
    assert "re-run    verified: the function has a kink here" in text
    assert "no gradkit route fixes this gradient" not in text


def test_a_smooth_point_whose_gradient_vanishes_is_one_gradient_not_a_kink():
    """|x|^2 written as norm(x) ** 2 at 0: JAX's gradient is NaN (0 * inf), SAFE keeps it (a value zero, not
    a mask); the audit proposes the stable norm and verifies its 0 as *the* gradient (the nearby gradients
    vanish with the step: their limit is 0), not as a subgradient of a kink."""
    x = np.zeros(3, F32)
    f = lambda x: jnp.linalg.norm(x) ** 2
    assert not np.all(np.isfinite(jax.grad(gk.override(f, gk.tables.SAFE))(x)))
    r = gk.audit(f, x)
    fix = r.findings[0].fix
    assert fix.verified and fix.name == "gradkit.stable.safe_norm", str(r)
    assert fix.kink == "gradient" and fix.kink_ok, str(r)
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: gk.stable.safe_norm(x) ** 2)(x)), np.zeros(3))


def test_the_verification_takes_points_of_the_hull_and_rejects_others():
    ref = _reference(jnp.linalg.norm, np.zeros(3, F32))
    inside = ref.compare([np.array([0.3, -0.2, 0.1], F32)])  # |c| = 0.37: in the unit ball
    assert inside.matches and inside.kink.kind == "subgradient" and inside.kink.ok
    wrong = ref.compare([np.array([5.0, 0.0, 0.0], F32)])  # 5 times a unit vector: 4 from the ball
    assert wrong.matches is False and wrong.kink.ok is False
    assert 4.0 - 1e-6 <= wrong.kink.error <= 5.0  # the hull is inside the ball: at least 4 away
    # the nearby gradients are the norm's own: unit vectors, in opposite pairs
    near = ref.nearby()
    np.testing.assert_allclose(np.linalg.norm(near.grads, axis=1), 1.0, rtol=1e-9)
    assert len(near.grads) >= 2 * 3 + 2


def _wrong_norm():
    @jax.custom_vjp
    def norm(x):
        return jnp.sqrt(jnp.sum(x * x))

    norm.defvjp(lambda x: (norm(x), x), lambda x, ct: (ct * 5.0 * jnp.eye(x.size, dtype=x.dtype)[0],))
    return norm


def test_a_wrong_route_at_the_kink_is_rejected_by_the_audit(monkeypatch):
    wrong = _wrong_norm()

    def suggest(root, chain, closed):  # one route: the whole norm replaced by one whose gradient is 5 e_0
        sqrt = next(e for e in closed.jaxpr.eqns if e.primitive.name == "sqrt")
        fix = Fix("code", "wrong_norm", "replace it with wrong_norm", expression="wrong_norm(x)")
        return [Candidate(fix, patches=(Patch(sqrt, (closed.jaxpr.invars[0],), lambda x: [wrong(x)]),))]

    monkeypatch.setattr(audit_mod, "suggest", suggest)
    monkeypatch.setattr(audit_fixes, "find", lambda *a, **k: [])  # no stable rewrite elsewhere either
    r = gk.audit(lambda x: jnp.sqrt(jnp.sum(x * x)), np.zeros(3, F32))
    (tried,) = [a for a in r.findings[0].alternatives if a.applied]
    assert tried.finite and not tried.verified and tried.kink == "subgradient" and tried.kink_ok is False
    assert r.findings[0].fix.advice.startswith("no gradkit route fixes this gradient")
    assert tried.verdict().startswith("gradient finite but not a subgradient"), tried.verdict()


# --------------------------------------------------------------------------- the edge of the domain


def test_maximum_of_sqrt_at_zero_takes_the_gradient_inside_the_domain():
    f = lambda x: jnp.sum(jnp.maximum(jnp.sqrt(x), 0.5))
    x = np.zeros(1, F32)
    r = gk.audit(f, x)
    fix = r.findings[0].fix
    assert fix.verified and fix.kind == "table", str(r)
    assert fix.kink == "gradient" and fix.kink_ok and fix.compared == 0
    assert "equal to the float64 gradients at" in fix.verdict() and "kink" not in fix.verdict()
    # independently: the route as reported, and jax.grad of the float64 function just inside the domain
    got = jax.grad(gk.override(f, eval(fix.expression, {"gk": gk})))(x)
    with jax.enable_x64(True):
        inside = float(jax.grad(f)(jnp.array([1e-5], jnp.float64))[0])
    assert inside == 0.0 and float(got[0]) == inside


def test_a_pole_is_left_out_not_judged():
    # 1/x behind a where at 0: the gradient grows as the step shrinks, no generalized gradient exists
    ref = _reference(lambda x: jnp.sum(jnp.where(x != 0, 1 / x, 0.0)), np.array([0.0, 2.0], F32))
    assert ref.nearby() is None
    res = ref.compare([np.array([0.0, -0.25], F32)])
    assert res.matches and res.kink is None and res.excluded == 1 and res.compared == 1


def test_a_smooth_point_uses_the_ordinary_check(monkeypatch):
    calls = []
    monkeypatch.setattr(verify.kink_ref, "nearby", lambda *a, **k: calls.append(a))
    x = np.array([0.5, -1.0, 2.0], F32)
    ref = _reference(lambda x: jnp.sum(jnp.sin(x) * x), x)
    with jax.enable_x64(True):
        g64 = np.asarray(jax.grad(lambda x: jnp.sum(jnp.sin(x) * x))(x.astype(np.float64)))
    res = ref.compare([g64.astype(F32)])
    assert res.matches and res.compared == 3 and res.excluded == 0 and res.kink is None
    assert calls == []


# --------------------------------------------------------------------------- the hull itself


def test_hull_distance_against_known_geometry():
    square = np.array([[1.0, 1.0], [1.0, -1.0], [-1.0, 1.0], [-1.0, -1.0]])
    assert kink.hull_distance(square, np.array([0.2, -0.7])) < 1e-9
    assert abs(kink.hull_distance(square, np.array([3.0, 0.0])) - 2.0) < 1e-9
    assert abs(kink.hull_distance(square, np.array([4.0, 5.0])) - 5.0) < 1e-9  # to the corner (1, 1)
    segment = np.array([[0.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    assert abs(kink.hull_distance(segment, np.array([1.0, 3.0, 4.0])) - 5.0) < 1e-9


# --------------------------------------------------------------------------- convex piecewise-linear functions


def _pl_case(seed, n, active):
    """``max_i(a_i x + b_i)`` at a point ``x`` where ``active`` pieces are equal and the rest at least 1 lower.

    Small integers throughout, so that the active pieces are exactly equal at ``x`` in float32 (a rounded
    ``b`` would move the kink off ``x`` by a rounding error, closer than the nearby points).
    """
    r = np.random.RandomState(seed)
    a = r.randint(-3, 4, size=(active + 2, n)).astype(np.float64)
    while len({tuple(row) for row in a[:active]}) < active:  # distinct active slopes: a kink
        a[:active] = r.randint(-3, 4, size=(active, n))
    x = r.randint(-2, 3, n).astype(np.float64)
    b = float(r.randint(-3, 4)) - a @ x
    b[active:] -= r.randint(1, 3, 2)
    return a.astype(F32), b.astype(F32), x.astype(F32)


@settings(max_examples=4, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 2**31 - 1), n=hs.integers(2, 3), active=hs.integers(2, 3),
       weights=hs.lists(hs.floats(0.0, 1.0), min_size=3, max_size=3))
def test_convex_combinations_of_active_slopes_are_accepted_and_far_points_rejected(seed, n, active, weights):
    a, b, x = _pl_case(seed, n, active)
    f = lambda x, a, b: jnp.max(a @ x + b)
    ref = Reference(make_program(f, (x, a, b), 0), [list(range(n))])
    assert np.isclose(np.sort(a @ x + b)[-active], np.max(a @ x + b), atol=1e-5)  # the pieces are active
    w = np.asarray(weights[:active]) + 1e-3
    c = (w / w.sum()) @ a[:active].astype(np.float64)  # a convex combination of the active slopes
    ok = ref.compare([c.astype(F32)])
    assert ok.matches and ok.kink is not None and ok.kink.kind == "subgradient", ok
    for vertex in a[:active]:  # each slope of an active piece is a subgradient
        assert ref.compare([vertex]).matches
    far = c + 10.0 * np.max(np.abs(a)) * np.eye(n)[0]
    bad = ref.compare([far.astype(F32)])
    assert bad.matches is False  # by the hull, or already by finite differences along a shared slope
    assert bad.kink is None or bad.kink.ok is False


@pytest.mark.slow  # 40 examples, a compilation each: about 5 s on 2 cores
@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=hs.integers(0, 2**31 - 1), n=hs.integers(2, 4), active=hs.integers(2, 4),
       weights=hs.lists(hs.floats(0.0, 1.0), min_size=4, max_size=4))
def test_convex_combinations_more_examples(seed, n, active, weights):
    test_convex_combinations_of_active_slopes_are_accepted_and_far_points_rejected.hypothesis.inner_test(
        seed, n, active, weights)
