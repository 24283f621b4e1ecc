"""An overridden function never answers differently from ``jax.jit``: the call key is JAX's whole type.

Differential property test: one gradkit object and one ``jax.jit`` object are
called on the same random sequence of arguments that vary one attribute of
the call at a time — shape, dtype, weak type, sharding on an Auto and an
Explicit mesh, replicated or per-device inside ``shard_map``, static values
(``-0.0``, NaN, ``1`` vs ``1.0`` vs ``True``), pytree structure — and must agree
bitwise after every call in value, ``grad``, ``jvp`` and output type. The
function under test branches on exactly those attributes (and returns a
different structure for 0-d and 1-d input), so a cache entry shared between
two of them gives a visibly wrong answer. Same for ``gk.op`` and
``gk.custom_gradient`` functions, and from several threads at once.
"""

from __future__ import annotations

import concurrent.futures
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import gradkit as gk
from meshes import make_mesh, mesh_devices

NIGHTLY = os.environ.get("GRADKIT_NIGHTLY", "") not in ("", "0")
# No shrinking: a failing sequence is printed as drawn (shrinking retraces for minutes).
SETTINGS = dict(deadline=None, database=None, derandomize=not NIGHTLY, phases=[Phase.explicit, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

AUTO = make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=mesh_devices(4)[:2])
EXPLICIT = make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=mesh_devices(4)[2:4])


# --------------------------------------------------------------------------- the function under test


def _type_factor(x):
    """A number that differs for every attribute of ``x``'s type the cache key must separate."""
    t = jax.typeof(x)
    spec = getattr(getattr(t, "sharding", None), "spec", None)
    sharded = spec is not None and any(s is not None for s in spec)
    varying = bool(getattr(t, "vma", frozenset()))
    return (1.0 + 2.0 * t.weak_type + 4.0 * sharded + 8.0 * varying + 16.0 * (t.dtype == jnp.float16)
            + 32.0 * (t.dtype == jnp.bfloat16) + t.ndim)


def _static_factor(s):
    if isinstance(s, bool):
        return 5.0 if s else 6.0
    if isinstance(s, int):
        return 7.0 + s
    if math.isnan(s):
        return 11.0
    return math.copysign(1.0, s) * (2.0 + abs(s))  # -0.0 and 0.0 differ


def body(sin):
    """The function: ``sin`` is jnp.sin (override, op) or a hand-written custom_jvp (reference)."""
    def fn(tree, s):
        leaves = jax.tree_util.tree_leaves(tree)
        k = _type_factor(leaves[0]) * _static_factor(s) + len(leaves) + 100.0 * isinstance(tree, dict)
        y = sum(jnp.sum(sin(leaf.astype(jnp.float32))) for leaf in leaves) * k
        if leaves[0].ndim == 0:
            return y  # the output structure depends on the input type
        return y, leaves[0] * k
    return fn


def _rule_jvp(x, t):
    return 2.0 * jnp.cos(x) * t  # deliberately not sin's derivative: the rule must visibly apply


@jax.custom_jvp
def ref_sin(x):
    return jnp.sin(x)


@ref_sin.defjvp
def _ref_sin_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return jnp.sin(x), _rule_jvp(x, t)


TABLE = {"sin": gk.jvp_rule(lambda op, t: _rule_jvp(op.inputs[0], t[0]))}


class _Static:
    """A static value keyed by type and bits. ``jax.jit``'s own static arguments are keyed by ``==``, so it
    shares one trace between ``0.0`` and ``-0.0`` (and ``1``, ``1.0``, ``True``): the reference must not."""

    def __init__(self, value):
        self.value = value
        self.key = (type(value), value.hex() if isinstance(value, float) else value)

    def __eq__(self, other):
        return isinstance(other, _Static) and self.key == other.key

    def __hash__(self):
        return hash(self.key)


def reference():
    jitted = jax.jit(lambda tree, s: body(ref_sin)(tree, s.value), static_argnums=1)
    return lambda tree, s: jitted(tree, _Static(s))


def overridden():
    return gk.override(body(jnp.sin), TABLE)


def named_op():
    op = gk.op("typed_body")(body(ref_sin))
    return lambda tree, s: op(tree, s=s)  # keyword arguments of a named op are static


def custom_gradient():
    fn = body(ref_sin)

    @gk.custom_gradient
    def cg(tree, s):
        out = fn(tree, s)
        _, vjp = jax.vjp(lambda t: fn(t, s), tree)
        return out, lambda *g: (vjp(g[0] if len(g) == 1 else tuple(g))[0], None)

    return cg


# --------------------------------------------------------------------------- the arguments


def _place(x, how):
    if how == "auto":
        return jax.device_put(x, NamedSharding(AUTO, P("x") if x.ndim else P()))
    if how == "auto-replicated":
        return jax.device_put(x, NamedSharding(AUTO, P()))
    if how == "explicit":
        return jax.device_put(x, NamedSharding(EXPLICIT, P("x") if x.ndim else P()))
    if how == "explicit-replicated":
        return jax.device_put(x, NamedSharding(EXPLICIT, P()))
    return x


def make_args(shape, dtype, weak, placement, structure, static):
    if weak:  # a weakly typed array: from a Python scalar
        x = jax.device_put(0.5)
    else:
        x = jnp.linspace(0.25, 1.5, math.prod(shape), dtype=jnp.float32).reshape(shape).astype(dtype)
    x = _place(x, placement)
    tree = {"tuple": (x,), "dict": {"a": x}, "list2": [x, x]}[structure]
    return tree, static


CALLS = st.tuples(
    st.sampled_from([(), (4,), (2, 4)]),
    st.sampled_from(["float32", "float16", "bfloat16"]),
    st.booleans(),
    st.sampled_from(["none", "auto", "auto-replicated", "explicit", "explicit-replicated"]),
    st.sampled_from(["tuple", "dict", "list2"]),
    st.sampled_from([1.0, 0.0, -0.0, float("nan"), 1, True, 2.5]),
).map(lambda c: c if not c[2] else ((), "float32", True, *c[3:]))


def results(f, tree, s):
    """Value, gradient, JVP and output types of ``f`` at one call, as NumPy (for bitwise comparison)."""
    explicit = any(isinstance(getattr(x, "sharding", None), NamedSharding) and x.sharding.mesh == EXPLICIT
                   for x in jax.tree_util.tree_leaves(tree))
    if explicit:  # Explicit mesh axes: computations run inside the mesh context, as JAX asks
        with jax.set_mesh(EXPLICIT):
            return _results(f, tree, s)
    return _results(f, tree, s)


def _results(f, tree, s):
    out = f(tree, s)
    scalar = lambda t: jax.tree_util.tree_leaves(f(t, s))[0]  # noqa: E731
    grad = jax.grad(scalar)(tree)
    tangent = jax.tree_util.tree_map(jnp.ones_like, tree)
    _, jvp = jax.jvp(scalar, (tree,), (tangent,))
    types = jax.tree_util.tree_map(lambda a: str(jax.typeof(a)), out)
    return jax.tree_util.tree_map(np.asarray, (out, grad, jvp)), types, jax.tree_util.tree_structure(out)


def assert_same(got, want, where):
    (g_vals, g_types, g_tree), (w_vals, w_types, w_tree) = got, want
    assert g_tree == w_tree, where
    assert g_types == w_types, where
    for a, b in zip(jax.tree_util.tree_leaves(g_vals), jax.tree_util.tree_leaves(w_vals)):
        np.testing.assert_array_equal(a, b, err_msg=where)


MAKERS = {"override": overridden, "gk.op": named_op, "custom_gradient": custom_gradient}


def check_sequence(make, calls, jit_outer=False):
    f, ref = make(), reference()
    if jit_outer:
        f, ref = jax.jit(f, static_argnums=1), jax.jit(ref, static_argnums=1)
    for i, c in enumerate(calls):
        tree, s = make_args(*c)
        assert_same(results(f, tree, s), results(ref, tree, s), f"call {i}: {c}")


@pytest.mark.parametrize("kind", list(MAKERS))
@settings(max_examples=2, **SETTINGS)  # the default set's budget; the long version below: 5 longer ones, jit too
@given(calls=st.lists(CALLS, min_size=3, max_size=5))
def test_agrees_with_jit_on_any_call_sequence(kind, calls):
    check_sequence(MAKERS[kind], calls)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(MAKERS))
@pytest.mark.parametrize("jit_outer", [False, True])
@settings(max_examples=5, **SETTINGS)
@given(calls=st.lists(CALLS, min_size=4, max_size=8))
def test_agrees_with_jit_on_any_call_sequence_long(kind, jit_outer, calls):
    check_sequence(MAKERS[kind], calls, jit_outer)


# the default set threads one kind (each kind's call sequences run above); the slow set all three
@pytest.mark.parametrize("kind", [pytest.param(k, marks=[pytest.mark.slow] if k != "override" else [])
                                  for k in MAKERS])
def test_agrees_with_jit_from_threads(kind):
    calls = [((), "float32", False, "none", "tuple", 1.0), ((4,), "float32", False, "none", "tuple", 1.0),
             ((), "float32", True, "none", "tuple", 1.0), ((4,), "float16", False, "auto", "dict", -0.0),
             ((4,), "float32", False, "explicit", "list2", 0.0), ((2, 4), "float32", False, "none", "tuple", 1)]
    want = [results(reference(), *make_args(*c)) for c in calls]
    f = MAKERS[kind]()
    order = [i for _ in range(3) for i in range(len(calls))]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda i: (i, results(f, *make_args(*calls[i]))), order))
    for i, g in got:
        assert_same(g, want[i], f"call {calls[i]}")


# --------------------------------------------------------------------------- shard_map: replicated vs varying


@pytest.mark.parametrize("kind", list(MAKERS))
def test_shard_map_replicated_and_varying_calls_get_their_own_program(kind):
    mesh = make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=mesh_devices(4)[:2])

    def make_loss(f):
        def loss(w, x):  # f sees w replicated, then x * w varying over "x": same shape and dtype
            return jnp.sum(f((w,), 1.0)[0]) + jax.lax.psum(jnp.sum(f((x * w,), 1.0)[0]), "x")
        return jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())

    w = jnp.array([1.0, 2.0])
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    got = jax.jit(jax.grad(make_loss(MAKERS[kind]())))(w, x)
    want = jax.jit(jax.grad(make_loss(reference())))(w, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_reported_shard_map_case():
    mesh = make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=mesh_devices(4)[:2])

    def make(fn):
        def loss(w, x):
            return jnp.sum(fn(w)) + jax.lax.psum(jnp.sum(fn(x * w)), "x")
        return jax.shard_map(loss, mesh=mesh, in_specs=(P(), P("x")), out_specs=P())

    f = lambda v: jnp.sqrt(v * v + 1)  # noqa: E731
    w = jnp.array([1.0, 2.0])
    x = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    got = jax.jit(jax.grad(make(gk.override(f, gk.tables.SAFE))))(w, x)
    want = jax.jit(jax.grad(make(jax.jit(f))))(w, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_explicit_mesh_output_type_follows_each_input():
    mesh = EXPLICIT
    f = gk.override(lambda a: a * 2.0, {})
    sharded = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P("x")))
    replicated = jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))
    def traced(a):
        assert jax.typeof(f(a)) == jax.typeof(a * 2.0)
        return a

    with jax.set_mesh(mesh):
        for a in (sharded, replicated, sharded, replicated):
            assert jax.typeof(f(a)) == jax.typeof(jax.jit(lambda a: a * 2.0)(a))
            jax.jit(traced)(a)
