"""The STABLE rules on complex inputs: JAX's own derivative, bit for bit, in every mode.

The stable derivatives (``gradkit.stable``, the numerics kernels) are for real
inputs; a primitive or a JAX function matched with a complex input keeps the
derivative JAX gives it (before: ``tanh`` raised a dtype error, ``logistic`` a
``KeyError``). SAFE handles complex itself; it is checked here too.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from budget import covering

FUNCTIONS = {
    "logistic": lax.logistic, "tanh": lax.tanh, "expm1": lax.expm1, "sigmoid": jax.nn.sigmoid,
    "softplus": jax.nn.softplus, "log_sigmoid": jax.nn.log_sigmoid, "silu": jax.nn.silu,
    "logaddexp": lambda z: jnp.logaddexp(z, z * 2), "xlogy": lambda z: jax.scipy.special.xlogy(z, z),
    "xlog1py": lambda z: jax.scipy.special.xlog1py(z, z), "sinc": jnp.sinc,
}
TABLES = ["STABLE", "STABLE_FUNCTIONS", "SAFE"]
Z = jnp.array([0.5 + 0.3j, -1.5 + 2.0j, 3.0 - 0.25j], jnp.complex64)


def real_loss(f):
    return lambda z: jnp.sum(jnp.real(f(z)))


# a covering half in the default set (each function, each table), all 33 in the slow set
@pytest.mark.parametrize("name,table", covering(sorted(FUNCTIONS), TABLES))
def test_complex_inputs_get_jax_own_derivative(name, table):
    f = jax.jit(FUNCTIONS[name])  # an overridden function is a jitted one: its reference is jax.jit(f)
    fixed = gk.override(FUNCTIONS[name], getattr(gk.tables, table))
    np.testing.assert_array_equal(jax.grad(real_loss(fixed))(Z), jax.grad(real_loss(f))(Z))
    np.testing.assert_array_equal(jax.jit(jax.grad(real_loss(fixed)))(Z[0]), jax.jit(jax.grad(real_loss(f)))(Z[0]))
    t = jnp.ones_like(Z)
    np.testing.assert_array_equal(jax.jvp(fixed, (Z,), (t,))[1], jax.jvp(f, (Z,), (t,))[1])
    per = jax.vmap(jax.grad(real_loss(fixed)))(Z.reshape(3, 1))
    np.testing.assert_array_equal(per, jax.vmap(jax.grad(real_loss(f)))(Z.reshape(3, 1)))


def test_the_reported_cases():
    z = jnp.complex64(0.5 + 0.3j)
    for prim in (lax.tanh, lax.logistic):
        got = jax.grad(lambda z, p=prim: jnp.real(gk.override(p, gk.tables.STABLE)(z)))(z)
        np.testing.assert_array_equal(got, jax.grad(lambda z, p=prim: jnp.real(p(z)))(z))


def test_real_inputs_keep_the_stable_derivative():
    """The complex fallback does not leak into the real case: at 20, JAX's s(1 - s) is 0 (s rounds to 1)."""
    for prim, x in ((lax.logistic, 20.0), (lax.tanh, 10.0)):
        stable = jax.grad(gk.override(prim, gk.tables.STABLE))(jnp.float32(x))
        assert float(jax.grad(prim)(jnp.float32(x))) == 0.0 and 1e-9 < float(stable) < 1e-8
