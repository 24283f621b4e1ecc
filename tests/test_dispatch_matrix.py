"""Composition matrix: transforms x program shapes, overridden vs hand-written.

Each program is built twice from the same template: once with ``jnp.sin`` and
run through ``gk.override`` with a rule for ``sin``, once with a hand-written
``jax.custom_vjp`` / ``jax.custom_jvp`` sine carrying the same rule. The rule
(derivative ``2·cos``) differs from autodiff, so a missed match would show.
"""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import gradkit as gk
from meshes import make_mesh

pytestmark = pytest.mark.slow  # a long matrix: `pytest -m slow` (CI runs it)

# --------------------------------------------------------------------------- rules

VJP_SIN = gk.vjp_rule(lambda op, g: (g * 2.0 * jnp.cos(op.inputs[0]),))
JVP_SIN = gk.jvp_rule(lambda op, t: t[0] * 2.0 * jnp.cos(op.inputs[0]))


@jax.custom_vjp
def vjp_sin(x):
    return jnp.sin(x)


vjp_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * 2.0 * jnp.cos(x),))


@jax.custom_jvp
def jvp_sin(x):
    return jnp.sin(x)


@jvp_sin.defjvp
def _jvp_sin(primals, tangents):
    (x,), (t,) = primals, tangents
    return jvp_sin(x), t * 2.0 * jnp.cos(x)


# --------------------------------------------------------------------------- programs


def plain(s, x):
    return jnp.sum(s(x) * x)


def nested_jit(s, x):
    inner = jax.jit(lambda z: jax.jit(s)(z) + 1.0)
    return jnp.sum(inner(x) ** 2)


def scan(s, x):
    def body(c, xi):
        c = 0.5 * s(c) + xi
        return c, s(c)
    c, ys = lax.scan(body, x, jnp.stack([x, 2.0 * x, 3.0 * x]))
    return jnp.sum(c) + jnp.sum(ys)


def fori(s, x):
    return jnp.sum(lax.fori_loop(0, 3, lambda i, c: s(c) + x, x))


def while_loop(s, x):
    # Reverse mode does not go through while_loop in JAX; used for forward mode only.
    def body(state):
        i, c = state
        return i + 1, s(c) + 0.1
    return jnp.sum(lax.while_loop(lambda st: st[0] < 3, body, (0, x))[1])


def cond(s, x):
    return jnp.sum(lax.cond(jnp.sum(x) > 0, lambda z: s(z) * 3.0, lambda z: z, x))


def switch(s, x):
    branches = [lambda z: z, lambda z: s(z) * 2.0, lambda z: s(s(z))]
    return jnp.sum(lax.switch(2, branches, x)) + jnp.sum(lax.switch(1, branches, x))


def checkpoint(s, x):
    return jnp.sum(jax.checkpoint(lambda z: s(z) * z)(x))


def shard_map(s, x):
    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    body = jax.shard_map(lambda z: s(z) * 2.0, mesh=mesh, in_specs=P("d"), out_specs=P("d"))
    return jnp.sum(body(x))


def sharded_inputs(s, x):
    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("d")))
    return jnp.sum(s(x) ** 2)


@jax.custom_jvp
def user_cube(x):
    return jnp.sin(x) * 0.0 + x ** 3  # the body's sin must not be overridden: the user's rule wins


user_cube.defjvp(lambda p, t: (user_cube(p[0]), 3.0 * p[0] ** 2 * t[0]))


@jax.custom_vjp
def user_scale(x):
    return jnp.sin(x) * 0.0 + 2.0 * x


user_scale.defvjp(lambda x: (user_scale(x), None), lambda _, g: (2.0 * g,))


def custom_jvp_fn(s, x):
    return jnp.sum(s(user_cube(x)) + user_cube(s(x)))


def custom_vjp_fn(s, x):
    return jnp.sum(s(user_scale(x)) * user_scale(s(x)))


PROGRAMS = [plain, nested_jit, scan, fori, while_loop, cond, switch, checkpoint, custom_jvp_fn, custom_vjp_fn,
            shard_map, sharded_inputs]
REVERSE_PROGRAMS = [p for p in PROGRAMS if p is not while_loop]
FORWARD_PROGRAMS = [p for p in PROGRAMS if p is not custom_vjp_fn]  # JAX: no forward mode through custom_vjp

X = jnp.linspace(-1.5, 2.0, 8, dtype=jnp.float32)


def _pair(program, mode):
    rule, ref = (VJP_SIN, vjp_sin) if mode == "vjp" else (JVP_SIN, jvp_sin)
    overridden = gk.override(partial(program, jnp.sin), {"sin": rule})
    return overridden, partial(program, ref)


def _close(a, b):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=2e-6, atol=1e-6)


# --------------------------------------------------------------------------- reverse mode


@pytest.mark.parametrize("program", REVERSE_PROGRAMS, ids=lambda p: p.__name__)
@pytest.mark.parametrize("mode", ["vjp", "jvp"])
def test_grad(program, mode, maybe_jit):
    f, ref = _pair(program, mode)
    got = maybe_jit(jax.grad(f))(X)
    _close(got, maybe_jit(jax.grad(ref))(X))
    # The rule really changed something: plain autodiff differs.
    assert not np.allclose(got, jax.grad(partial(program, jnp.sin))(X))


@pytest.mark.parametrize("program", REVERSE_PROGRAMS, ids=lambda p: p.__name__)
def test_vjp(program, maybe_jit):
    f, ref = _pair(program, "vjp")
    y, pull = jax.vjp(maybe_jit(f), X)
    y_ref, pull_ref = jax.vjp(maybe_jit(ref), X)
    # The forward value is bit-identical to the compiled plain program (the contract).
    np.testing.assert_array_equal(y, jax.jit(partial(program, jnp.sin))(X))
    _close(y, y_ref)
    _close(pull(jnp.float32(1.5)), pull_ref(jnp.float32(1.5)))


# Per-example vmap over an 8-way sharded axis is not a meaningful program: left out.
@pytest.mark.parametrize("program", [p for p in REVERSE_PROGRAMS if p not in (shard_map, sharded_inputs)],
                         ids=lambda p: p.__name__)
def test_vmap_of_grad(program, maybe_jit):
    f, ref = _pair(program, "vjp")
    xs = jnp.stack([X, X * 0.5, -X])
    _close(maybe_jit(jax.vmap(jax.grad(f)))(xs), maybe_jit(jax.vmap(jax.grad(ref)))(xs))


# --------------------------------------------------------------------------- forward mode (JVP rules)


@pytest.mark.parametrize("program", FORWARD_PROGRAMS, ids=lambda p: p.__name__)
def test_jvp_and_jacfwd(program, maybe_jit):
    f, ref = _pair(program, "jvp")
    t = jnp.ones_like(X)
    _close(maybe_jit(lambda x: jax.jvp(f, (x,), (t,)))(X), maybe_jit(lambda x: jax.jvp(ref, (x,), (t,)))(X))
    _close(maybe_jit(jax.jacfwd(f))(X), maybe_jit(jax.jacfwd(ref))(X))


@pytest.mark.parametrize("program", [plain, nested_jit, scan, fori, cond, switch, checkpoint, custom_jvp_fn],
                         ids=lambda p: p.__name__)
def test_hessian(program, maybe_jit):
    f, ref = _pair(program, "jvp")
    _close(maybe_jit(jax.hessian(f))(X), maybe_jit(jax.hessian(ref))(X))


def test_vmap_of_function_already_vmapped_inside():
    def prog(s, x):
        return jnp.sum(jax.vmap(s)(x.reshape(2, 4)))
    f, ref = _pair(prog, "vjp")
    _close(jax.grad(f)(X), jax.grad(ref)(X))


def test_forward_bit_identical_for_every_program():
    for program in PROGRAMS:
        f, _ = _pair(program, "vjp")
        plain_f = partial(program, jnp.sin)
        np.testing.assert_array_equal(f(X), jax.jit(plain_f)(X), err_msg=program.__name__)
        np.testing.assert_array_equal(jax.jit(f)(X), jax.jit(plain_f)(X), err_msg=program.__name__)


def test_sharded_input_array_keeps_working():
    mesh = make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    xs = jax.device_put(X, NamedSharding(mesh, P("d")))
    f, ref = _pair(plain, "vjp")
    got = jax.jit(jax.grad(f))(xs)
    _close(got, jax.jit(jax.grad(ref))(xs))
    assert len(got.sharding.device_set) == 8
