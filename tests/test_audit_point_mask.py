"""The audit on a removable singularity patched at one point (``where(x == c, patch, expr)``): the program's
derivative there is the branch it takes (the patch), which SAFE and JAX's forward mode give; the audit says
so and names the Taylor branch when that is not the function's limit.

References: the limits come from the functions' Taylor series (``expm1(x)/x = 1 + x/2 + x²/6 + …``,
``sin(x)/x = 1 - x²/6 + …``), and JAX's own forward mode gives the branch-taken derivative.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

F32 = np.float32


def _exprel_patched(x):
    return jnp.sum(jnp.where(x == 0, 1.0, jnp.expm1(x) / x))


def _exprel_patched_ne(x):
    return jnp.sum(jnp.where(x != 0.0, jnp.expm1(x) / x, 1.0))


def _taylor_branch(x, delta=1e-3):
    # what the audit's advice says to write: the Taylor polynomial near 0, the expression guarded elsewhere
    near = jnp.abs(x) < delta
    safe = jnp.where(near, 1.0, x)
    return jnp.sum(jnp.where(near, 1 + x / 2 + x ** 2 / 6, jnp.expm1(safe) / safe))


@pytest.mark.parametrize("f", [_exprel_patched, pytest.param(_exprel_patched_ne, marks=pytest.mark.slow)],
                         ids=["eq", "ne"])
def test_a_point_patch_whose_derivative_is_not_the_limit_gets_the_taylor_branch(f):
    x = np.zeros(3, F32)
    # the branch taken at 0 is the constant: JAX's forward mode and SAFE give 0, the limit is 1/2
    assert np.array_equal(jax.jacfwd(f)(x), np.zeros(3, F32))
    assert np.array_equal(jax.grad(gk.override(f, gk.tables.SAFE))(x), np.zeros(3, F32))
    r = gk.audit(f, x)
    (finding,) = r.findings
    assert not finding.fix.verified, str(r)  # 0 is not the limit: no route verifies
    text = str(r)
    assert "patches the value only where" in text and "Taylor branch" in text, text
    assert "no gradkit route fixes this gradient" in text


def test_the_advised_taylor_branch_has_the_limit_as_its_gradient():
    x = np.zeros(3, F32)
    np.testing.assert_allclose(jax.grad(_taylor_branch)(x), np.full(3, 0.5, F32), rtol=0, atol=0)
    xs = np.array([1e-4, -3e-4, 0.5], F32)  # inside and outside the branch: the plain expression's derivative
    with jax.enable_x64(True):
        ref = jax.grad(lambda v: jnp.sum(jnp.expm1(v) / v))(xs.astype(np.float64))
    np.testing.assert_allclose(jax.grad(_taylor_branch)(xs), ref, rtol=2e-6)
    assert gk.audit(_taylor_branch, x).ok


def test_a_point_patch_whose_derivative_is_the_limit_is_verified_and_still_explained():
    """sin(x)/x patched with 1 at 0: the patch's derivative (0) is the limit (0), so SAFE verifies; the note
    on point patches is among the alternatives, since it holds only by that coincidence."""
    f = lambda x: jnp.sum(jnp.where(x == 0, 1.0, jnp.sin(x) / x))
    r = gk.audit(f, np.zeros(3, F32))
    (finding,) = r.findings
    assert finding.fix.verified, str(r)
    assert any(a.name == "point mask" for a in finding.alternatives), str(r)


def test_a_mask_that_is_not_a_point_gets_no_point_advice():
    """A where over an interval (x > 0) is an ordinary mask: the unused side contributes nothing."""
    f = lambda x: jnp.sum(jnp.where(x > 0, x * jnp.log(x), 0.0))
    r = gk.audit(f, np.zeros(3, F32))
    assert "patches the value only" not in str(r), str(r)
