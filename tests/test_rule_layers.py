"""What a library rule adds to a program is what its derivative needs, and no more.

* A library rule sees ``None`` for an input that carries no tangent (data, a
  mask: a constant of the program), as JAX's own rules see a symbolic zero,
  and computes no term for it; a user's rule still gets zeros there.
* SAFE's primal quantities that are products by a finite nonzero constant
  (``2 * x`` in the derivative of ``x ** 2``) are JAX's equations, with no
  ``custom_jvp`` layer.

Values stay JAX's, bit for bit, wherever JAX's are finite.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import gradkit as gk

SAFE = gk.tables.SAFE


def _count(jaxpr, name: str) -> int:
    n = 0
    for e in jaxpr.eqns:
        n += e.primitive.name == name
        for v in e.params.values():
            for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _count(inner, name)
    return n


def test_a_constant_operand_gets_no_term():
    c = jnp.asarray([2.0, -0.0, 3.0, np.inf], jnp.float32)  # a closed-over array: an input of the matched mul
    x = jnp.asarray([1.0, -2.0, 0.0, 0.5], jnp.float32)
    t = jnp.asarray([1.0, -1.0, -0.0, 2.0], jnp.float32)

    def f(x):
        return x * c

    ours = gk.override(f, SAFE)
    jaxpr = jax.make_jaxpr(lambda x, t: jax.jvp(ours, (x,), (t,)))(x, t)
    # no mask reaches the product (nothing selects or zeroes it): JAX's own equation, no layer at all
    assert _count(jaxpr.jaxpr, "gradkit_safe_scale") == 0 and _count(jaxpr.jaxpr, "gradkit_masked_scale") == 0
    got = jax.jit(lambda x, t: jax.jvp(ours, (x,), (t,))[1])(x, t)
    want = jax.jit(lambda x, t: jax.jvp(f, (x,), (t,))[1])(x, t)
    assert np.asarray(got).tobytes() == np.asarray(want).tobytes()  # the sign of each zero too
    g = jax.jit(jax.grad(lambda x: jnp.sum(ours(x) * jnp.arange(4.0))))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(jnp.arange(4.0) * c))


def test_a_user_rule_still_gets_zeros_for_a_constant_operand():
    seen = []

    @gk.jvp_rule
    def mul_rule(op, tangents):
        seen.append(tuple(t is None for t in tangents))
        x, y = op.inputs
        tx, ty = tangents
        return tx * y + x * ty

    c = jnp.asarray([2.0, 3.0], jnp.float32)
    f = gk.override(lambda x: x * c, {"mul": mul_rule})
    x = jnp.asarray([1.0, -2.0], jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.grad(lambda x: jnp.sum(f(x)))(x)), np.asarray(c))
    assert seen and all(s == (False, False) for s in seen)


def test_safe_primal_products_by_a_constant_have_no_layer():
    def f(x):
        return jnp.sum(jnp.sin(x) ** 2)  # integer_pow's derivative 2 * s: no mul of the program's own

    ours = gk.override(f, SAFE)
    x = jnp.asarray([0.5, -1.5, 0.0, 2.0], jnp.float32)
    bodies = []

    def visit(j):
        for e in j.eqns:
            if e.primitive.name == "custom_jvp_call":
                bodies.append([b.primitive.name for b in e.params["call_jaxpr"].jaxpr.eqns])
            for v in e.params.values():
                for sub in (v if isinstance(v, (tuple, list)) else (v,)):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        visit(inner)

    visit(jax.make_jaxpr(jax.grad(ours))(x).jaxpr)
    assert bodies == []  # no mask reaches integer_pow or its 2 * s: JAX's own equations, no layer
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(ours))(x)), np.asarray(jax.jit(jax.grad(f))(x)))
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.hessian(ours))(x)), np.asarray(jax.jit(jax.hessian(f))(x)))
