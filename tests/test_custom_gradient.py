"""custom_gradient / custom_jvp: TF-style gradient closures, forward mode, tables.

References are independent of the code under test: central finite
differences in float64, hand-derived formulas, or JAX autodiff of the plain
function where that is correct.
"""

import dataclasses
import doctest
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from budget import checking_leaks
from meshes import make_mesh, mesh_backend, on_mesh_backend
from gradkit._src import compat
from gradkit._src.function_gradients import custom_gradient as cg_module

from gradkit import custom_gradient, custom_jvp


# --------------------------------------------------------------------------- references


def fd_grad(f, args, eps=1e-6):
    """Central differences of a scalar function, float64, one array per argument."""
    args = [np.asarray(a, np.float64) for a in args]
    grads = []
    for i, a in enumerate(args):
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            up = [x.copy() for x in args]
            dn = [x.copy() for x in args]
            up[i][idx] += eps
            dn[i][idx] -= eps
            g[idx] = (float(f(*up)) - float(f(*dn))) / (2 * eps)
        grads.append(g)
    return grads


def fd_jac(f, x, eps=1e-6):
    """Jacobian of f: R^n -> R^m (flat), float64 central differences."""
    x = np.asarray(x, np.float64)
    cols = []
    for idx in np.ndindex(x.shape):
        up, dn = x.copy(), x.copy()
        up[idx] += eps
        dn[idx] -= eps
        cols.append((np.asarray(f(up)) - np.asarray(f(dn))) / (2 * eps))
    return np.stack(cols, axis=-1).reshape(np.shape(f(x)) + x.shape)


# --------------------------------------------------------------------------- seed examples


@custom_gradient
def log1pexp(x):
    e = jnp.exp(x)

    def grad(upstream):
        return upstream * (1 - 1 / (1 + e))

    return jnp.log1p(e), grad


@custom_gradient
def bar(x, y):
    def grad(upstream):
        return upstream * y, upstream * x

    return x * y, grad


@custom_gradient
def square(x):
    def grad(upstream):
        return upstream * 2 * x

    return x * x, grad


@custom_gradient
def complex_op(x, y):
    z = x * y + jnp.sin(x)
    w = x / y

    def grad(dz, dw):
        dx = dz * (y + jnp.cos(x)) + dw / y
        dy = dz * x - dw * x / y**2
        return dx, dy

    return z, w, grad


@custom_gradient
def non_diff_op(x):
    # |x| written with a branch; the gradient is sign(x), 0 at the kink.
    y = jnp.where(x >= 0, x, -x)

    def grad(upstream):
        return upstream * jnp.where(x > 0, 1.0, jnp.where(x < 0, -1.0, 0.0))

    return y, grad


@custom_gradient
def piecewise(x, kind):
    # A Python branch on a static (non-array) argument.
    if kind == "square":
        y, dy = x * x, 2 * x
    else:
        y, dy = jnp.sin(x), jnp.cos(x)
    return y, lambda g: (g * dy, None)


def test_log1pexp_gradient_at_100_is_one(maybe_jit):
    naive = jax.grad(lambda x: jnp.log1p(jnp.exp(x)))(100.0)
    assert np.isnan(naive)
    assert float(maybe_jit(jax.grad(log1pexp))(100.0)) == 1.0


def test_log1pexp_matches_finite_differences(x64, maybe_jit):
    xs = np.array([-30.0, -2.0, 0.0, 0.5, 3.0, 30.0])
    g = maybe_jit(jax.vmap(jax.grad(log1pexp)))(xs)
    ref = [fd_grad(lambda v: np.log1p(np.exp(v)), [x])[0] for x in xs]
    np.testing.assert_allclose(g, ref, rtol=1e-7, atol=1e-9)
    np.testing.assert_allclose(maybe_jit(log1pexp)(xs), np.log1p(np.exp(xs)), rtol=1e-15)


def test_bar_gradients_are_3_and_2(maybe_jit):
    gx, gy = maybe_jit(jax.grad(bar, argnums=(0, 1)))(2.0, 3.0)
    assert (float(gx), float(gy)) == (3.0, 2.0)
    assert float(maybe_jit(bar)(2.0, 3.0)) == 6.0


def test_square(x64, maybe_jit):
    x = np.array([-1.5, 0.0, 0.25, 4.0])
    g = maybe_jit(jax.grad(lambda v: jnp.sum(square(v))))(x)
    np.testing.assert_allclose(g, fd_grad(lambda v: np.sum(v * v), [x])[0], rtol=1e-8, atol=1e-9)
    np.testing.assert_allclose(g, 2 * x, rtol=0)


def test_complex_op_two_inputs_two_outputs(x64, maybe_jit):
    def loss(f):
        return lambda x, y: jnp.sum(f(x, y)[0] * 1.5 + f(x, y)[1] ** 2)

    plain = lambda x, y: (x * y + jnp.sin(x), x / y)
    x, y = np.array([0.3, -1.2, 2.0]), np.array([1.5, 0.7, -2.5])
    z, w = maybe_jit(complex_op)(x, y)
    np.testing.assert_allclose(z, x * y + np.sin(x), rtol=1e-14)
    np.testing.assert_allclose(w, x / y, rtol=1e-14)
    g = maybe_jit(jax.grad(loss(complex_op), argnums=(0, 1)))(x, y)
    ref = fd_grad(lambda a, b: np.sum((a * b + np.sin(a)) * 1.5 + (a / b) ** 2), [x, y])
    for got, want in zip(g, ref):
        np.testing.assert_allclose(got, want, rtol=1e-7)
    for got, want in zip(g, jax.grad(loss(plain), argnums=(0, 1))(x, y)):
        np.testing.assert_allclose(got, want, rtol=1e-12)


def test_non_diff_op_branches(x64, maybe_jit):
    x = np.array([-2.0, -0.5, 0.0, 0.5, 3.0])
    g = maybe_jit(jax.grad(lambda v: jnp.sum(non_diff_op(v))))(x)
    np.testing.assert_array_equal(g, np.sign(x))
    away = x[x != 0]
    np.testing.assert_allclose(g[x != 0], fd_grad(lambda v: np.sum(np.abs(v)), [away])[0], rtol=1e-8)


def test_python_branch_on_a_static_argument(x64, maybe_jit):
    x = np.array([0.3, 1.7])
    for kind, f, df in [("square", np.square, lambda v: 2 * v), ("sin", np.sin, np.cos)]:
        g = maybe_jit(jax.grad(lambda v, k=kind: jnp.sum(piecewise(v, k))))(x)
        np.testing.assert_allclose(g, df(x), rtol=1e-14)
        np.testing.assert_allclose(g, fd_grad(lambda v: np.sum(f(v)), [x])[0], rtol=1e-8)


def test_float64_gradient_for_float32_forward_is_cast_back(x64, maybe_jit):
    @custom_gradient
    def scale(x):
        def grad(upstream):
            return upstream.astype(jnp.float64) * jnp.float64(2.0)  # computed in float64

        return 2 * x, grad

    x32 = jnp.array([1.0, -3.0], jnp.float32)
    g = maybe_jit(jax.grad(lambda v: jnp.sum(scale(v))))(x32)
    assert g.dtype == jnp.float32  # the parameter's dtype, not promoted
    np.testing.assert_array_equal(g, [2.0, 2.0])
    # and the other way round: a float32 gradient for a float64 argument
    @custom_gradient
    def half(x):
        return x / 2, lambda g: (g / 2).astype(jnp.float32)

    g64 = maybe_jit(jax.grad(lambda v: jnp.sum(half(v))))(jnp.array([1.0, 2.0]))
    assert g64.dtype == jnp.float64
    np.testing.assert_array_equal(g64, [0.5, 0.5])


# --------------------------------------------------------------------------- structure


@custom_gradient
def pytree_op(params, x):
    """params: {"w": (3,), "b": ()}; returns ({"y": (3,)}, s ())."""
    y = params["w"] * x + params["b"]
    s = jnp.sum(y**2)

    def grad(dout, ds):
        dy = dout["y"] + ds * 2 * y
        return {"w": dy * x, "b": jnp.sum(dy)}, dy * params["w"]

    return ({"y": y}, s), grad


def test_pytree_inputs_and_outputs(x64, maybe_jit):
    params = {"w": np.array([0.5, -1.0, 2.0]), "b": np.float64(0.3)}
    x = np.array([1.0, 2.0, -0.5])

    def loss(f, p, v):
        out, s = f(p, v)
        return jnp.sum(jnp.sin(out["y"])) + 0.1 * s

    def plain(p, v):
        y = p["w"] * v + p["b"]
        return {"y": y}, jnp.sum(y**2)

    gp, gx = maybe_jit(jax.grad(lambda p, v: loss(pytree_op, p, v), argnums=(0, 1)))(params, x)
    rp, rx = jax.grad(lambda p, v: loss(plain, p, v), argnums=(0, 1))(params, x)
    np.testing.assert_allclose(gp["w"], rp["w"], rtol=1e-12)
    np.testing.assert_allclose(gp["b"], rp["b"], rtol=1e-12)
    np.testing.assert_allclose(gx, rx, rtol=1e-12)
    fd_w = fd_grad(lambda w: loss(plain, {"w": w, "b": params["b"]}, x), [params["w"]])[0]
    np.testing.assert_allclose(gp["w"], fd_w, rtol=1e-7)


def test_none_means_no_gradient_at_any_depth(maybe_jit):
    @custom_gradient
    def f(params, x):
        def grad(g):
            return {"w": g * x, "b": None}, None  # None for a leaf and for a whole argument

        return params["w"] * x + params["b"], grad

    @custom_gradient
    def nothing(x, y):
        return x * y, lambda g: None  # None for everything

    params = {"w": jnp.float32(2.0), "b": jnp.float32(1.0)}
    gp, gx = maybe_jit(jax.grad(f, argnums=(0, 1)))(params, jnp.float32(3.0))
    assert (float(gp["w"]), float(gp["b"]), float(gx)) == (3.0, 0.0, 0.0)
    assert maybe_jit(jax.grad(nothing, argnums=(0, 1)))(2.0, 3.0) == (0.0, 0.0)


def test_keyword_and_python_number_arguments_are_static(maybe_jit):
    traces = []

    @custom_gradient
    def power(x, n, *, scale=1.0):
        traces.append((n, scale))
        assert type(n) is int and type(scale) is float  # static: real Python values, not tracers
        y = scale * x ** n if n > 0 else jnp.ones_like(x)  # Python control flow on them is fine
        return y, lambda g: (g * scale * n * x ** (n - 1), "ignored: n is static")

    x = jnp.array([1.5, 2.0])
    for n in (2, 3):
        g = maybe_jit(jax.grad(lambda v, n=n: jnp.sum(power(v, n, scale=0.5))))(x)
        np.testing.assert_allclose(g, 0.5 * n * x ** (n - 1), rtol=1e-6)
    before = len(traces)
    power(x + 1, 3, scale=0.5)  # same signature: the forward is not traced again
    assert len(traces) == before
    assert power(x, 3, scale=2.0)[0] == 2 * 1.5**3 and len(traces) > before  # new static value: new entry


def test_static_int_and_float_are_separate_cache_entries():
    @custom_gradient
    def typed(x, n):
        return x * (3.0 if isinstance(n, int) else 2.0), lambda g: (g, None)

    x = jnp.float32(1.0)
    assert float(typed(x, 1)) == 3.0 and float(typed(x, 1.0)) == 2.0


def test_integer_inputs_and_outputs(maybe_jit):
    seen = []

    @custom_gradient
    def top(x, idx):
        i = jnp.argmax(x)

        def grad(g_val, g_index):
            seen.append(g_index)
            return jnp.zeros_like(x).at[i].set(g_val) + jnp.zeros_like(x).at[idx].add(1.0), g_val

        return x[i] * 1.0, i, grad

    x = jnp.array([0.5, 3.0, -1.0])
    g = maybe_jit(jax.grad(lambda v: top(v, jnp.int32(2))[0]))(x)
    np.testing.assert_array_equal(g, [0.0, 1.0, 1.0])
    assert seen and all(s is None for s in seen)  # no upstream for an integer output


# --------------------------------------------------------------------------- transforms


@custom_gradient
def take_max(x):
    i = jnp.argmax(x)  # an integer forward intermediate, closed over by grad

    def grad(g):
        return jnp.zeros_like(x).at[i].set(g * jnp.cos(x[i]))

    return jnp.sin(x[i]), grad


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_closure_over_forward_values_under_transforms(maybe_jit):
    xs = jnp.array([[0.1, 0.9, 0.3], [1.2, 0.4, 0.2], [0.3, 0.2, 0.8]])
    ref_rows = np.zeros_like(np.asarray(xs))
    for r, row in enumerate(np.asarray(xs)):
        ref_rows[r, row.argmax()] = np.cos(row.max())

    def scanned(x):
        c, ys = lax.scan(lambda c, row: (c + take_max(row * c), take_max(row)), jnp.float32(1.0), x)
        return c + jnp.sum(ys)

    def scanned_plain(x):
        m = lambda v: jnp.sin(jnp.max(v))
        c, ys = lax.scan(lambda c, row: (c + m(row * c), m(row)), jnp.float32(1.0), x)
        return c + jnp.sum(ys)

    with checking_leaks():
        np.testing.assert_allclose(maybe_jit(jax.vmap(jax.grad(take_max)))(xs), ref_rows, rtol=1e-6)
        g_scan = maybe_jit(jax.grad(scanned))(xs)
        g_remat = maybe_jit(jax.grad(jax.checkpoint(scanned)))(xs)
        g_remat_body = maybe_jit(jax.grad(lambda x: jnp.sum(jax.vmap(jax.checkpoint(take_max))(x))))(xs)
    want = jax.grad(scanned_plain)(xs)
    np.testing.assert_allclose(g_scan, want, rtol=1e-5)
    np.testing.assert_allclose(g_remat, want, rtol=1e-5)
    np.testing.assert_allclose(g_remat_body, ref_rows, rtol=1e-6)


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_closure_over_values_of_an_enclosing_trace(maybe_jit):
    # JAX's own custom_vjp/custom_jvp inside jit fail here ("No constant handler for type ...Tracer").
    def make(t, mode):
        if mode == "jvp":
            return custom_jvp(lambda x: (x / t, lambda tx: tx / t))
        return custom_gradient(mode=mode)(lambda x: (x / t, lambda g: g / t))

    x = jnp.array([1.0, 2.0])
    for mode in ("vjp", "both", "jvp"):
        @maybe_jit
        def step(x, t, mode=mode):
            return jax.grad(lambda v: jnp.sum(make(t, mode)(v) ** 2))(x)

        np.testing.assert_allclose(step(x, jnp.float32(4.0)), 2 * x / 16, rtol=1e-6)
        if mode != "vjp":
            h = maybe_jit(jax.hessian(lambda v, mode=mode: jnp.sum(make(jnp.float32(2.0), mode)(v) ** 2)))(x)
            np.testing.assert_allclose(h, np.eye(2) / 2, rtol=1e-6)
        if mode == "both":
            continue  # the same custom_jvp machinery as "jvp"
        per_t = maybe_jit(jax.vmap(lambda t, mode=mode: jax.grad(lambda v: jnp.sum(make(t, mode)(v)))(x)))
        np.testing.assert_allclose(per_t(jnp.array([1.0, 2.0])), [[1.0, 1.0], [0.5, 0.5]])

        def scanned(xs, mode=mode):
            return jnp.sum(lax.scan(lambda c, xi: (c + 1.0, make(c, mode)(xi)), jnp.float32(2.0), xs)[1])

        with checking_leaks():
            g = maybe_jit(jax.grad(jax.checkpoint(scanned)))(jnp.array([1.0, 2.0, 3.0]))
        np.testing.assert_allclose(g, [1 / 2, 1 / 3, 1 / 4], rtol=1e-6)


def test_error_closing_over_a_value_being_differentiated():
    def f(w, x):
        @custom_gradient
        def scaled(x):
            return x * w, lambda g: g * w

        return scaled(x)

    x = jnp.float32(3.0)
    assert float(jax.grad(f, argnums=1)(jnp.float32(2.0), x)) == 2.0
    msg = _raises(r"scaled.*closes over a traced value that is being differentiated", jax.grad(f), 2.0, x)
    assert "pass that value as an argument" in msg


def test_grad_fn_errors_wait_until_differentiation():
    @custom_gradient
    def no_gradient(x):
        def grad(g):
            raise NotImplementedError("no gradient for this op")

        return jnp.floor(x), grad

    x = jnp.array([1.5, -0.5])
    np.testing.assert_array_equal(no_gradient(x), [1.0, -1.0])  # the forward is fine
    np.testing.assert_array_equal(jax.jit(no_gradient)(x), [1.0, -1.0])
    for transform in (jax.grad, jax.jacfwd):  # forward mode reports the same error
        with pytest.raises(NotImplementedError, match="no gradient for this op") as info:
            transform(lambda v: jnp.sum(no_gradient(v)))(x)
        assert "[gradkit] raised in the grad_fn of custom_gradient function 'no_gradient'" in _notes(info.value)


def test_forward_is_traced_once_per_signature():
    traced = []

    @custom_gradient
    def f(x):
        traced.append(1)
        return jnp.exp(x), lambda g: g * jnp.exp(x)

    x = jnp.ones(3)
    f(x)
    n = len(traced)  # f runs twice per signature: for the outputs, and for grad_fn's closure
    assert n == 2
    f(x + 1), jax.grad(lambda v: jnp.sum(f(v)))(x), jax.jit(lambda v: f(v))(x)
    assert len(traced) == n
    # The gradient program computes the forward once (XLA merges the duplicate).
    hlo = jax.jit(jax.grad(lambda v: jnp.sum(f(v)))).lower(x).compile().as_text()
    assert hlo.count("exponential(") == 1


def test_sharded_input_keeps_its_sharding():
    mesh = make_mesh((8,), ("d",))
    xs = jnp.linspace(-5.0, 100.0, 16)
    x = jax.device_put(xs, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    g = jax.jit(jax.grad(lambda v: jnp.sum(log1pexp(v))))(x)
    with mesh_backend():  # the eager reference on the mesh's backend, constants included
        np.testing.assert_array_equal(g, jax.grad(lambda v: jnp.sum(log1pexp(v)))(on_mesh_backend(xs)))
    assert g.sharding.is_equivalent_to(x.sharding, 1)


# --------------------------------------------------------------------------- tables


def test_is_a_named_op_that_a_table_retargets(maybe_jit):
    def loss(x):
        return jnp.sum(log1pexp(x) * 2.0)

    x = jnp.array([0.5, 1.0, 100.0])
    seven = gk.vjp_rule(lambda op, g: (g * 7.0,))
    jaxpr = jax.make_jaxpr(loss)(x)
    assert jaxpr.jaxpr.eqns[0].params["name"].endswith(":log1pexp")
    f = gk.override(loss, {"log1pexp": seven}, strict=True)
    np.testing.assert_array_equal(maybe_jit(f)(x), loss(x))
    np.testing.assert_array_equal(maybe_jit(jax.grad(f))(x), [14.0, 14.0, 14.0])
    # An unrelated table leaves its own gradient in place, even for ops used inside it.
    g = gk.override(loss, {"exp": seven, "sin": seven})
    np.testing.assert_array_equal(maybe_jit(jax.grad(g))(x), jax.grad(loss)(x))


def test_name_can_be_overridden():
    @custom_gradient(name="my_softplus")
    def f(x):
        return jnp.logaddexp(x, 0.0), lambda g: g * jax.nn.sigmoid(x)

    assert f.gradkit_op_name == "my_softplus" and f.__name__ == "f"
    h = gk.override(f, {"my_softplus": gk.vjp_rule(lambda op, g: (g * 0.0,))}, strict=True)
    assert float(jax.grad(h)(1.0)) == 0.0


def test_own_rule_serves_another_op(maybe_jit):
    @gk.op("softplus_naive")
    def softplus_naive(x):
        return jnp.log1p(jnp.exp(x))

    x = jnp.array([-3.0, 0.0, 2.0, 100.0])
    assert isinstance(log1pexp.rule, gk.Rule) and log1pexp.rule.mode == "jvp"  # grad_fn transposed: both modes
    f = gk.override(lambda v: jnp.sum(softplus_naive(v)), {"softplus_naive": log1pexp.rule})
    np.testing.assert_allclose(maybe_jit(jax.jacfwd(f))(x), jax.nn.sigmoid(x), rtol=1e-6)
    np.testing.assert_allclose(maybe_jit(jax.grad(f))(x), jax.nn.sigmoid(x), rtol=1e-6)

    @custom_gradient(mode="vjp")
    def log1pexp_vjp(x):
        e = jnp.exp(x)
        return jnp.log1p(e), lambda g: g * (1 - 1 / (1 + e))

    assert log1pexp_vjp.rule.mode == "vjp"  # a reverse-mode rule, for any grad_fn
    f = gk.override(lambda v: jnp.sum(softplus_naive(v)), {"softplus_naive": log1pexp_vjp.rule})
    np.testing.assert_allclose(maybe_jit(jax.grad(f))(x), jax.nn.sigmoid(x), rtol=1e-6)

    @gk.op("argmax_value")
    def argmax_value(v):
        i = jnp.argmax(v)
        return v[i] * 1.0, i

    f = gk.override(lambda v: argmax_value(v)[0] * 3.0, {"argmax_value": take_top.rule})  # integer output too
    np.testing.assert_array_equal(maybe_jit(jax.grad(f))(jnp.array([1.0, 5.0, 2.0])), [0.0, 3.0, 0.0])


@custom_gradient
def take_top(x):
    i = jnp.argmax(x)
    return x[i], i, lambda g_value, g_index: jnp.zeros_like(x).at[i].set(g_value)


def test_rule_of_a_multi_input_function_in_a_table():
    @gk.op("mul2")
    def mul2(a, b):
        return a * b * 2.0

    f = gk.override(lambda a, b: mul2(a, b), {"mul2": bar.rule})  # bar's gradient: (g*y, g*x)
    assert jax.grad(f, argnums=(0, 1))(2.0, 3.0) == (3.0, 2.0)


# --------------------------------------------------------------------------- errors


def _notes(e):
    """An exception's notes (Python 3.11+), or its message where notes are appended to it."""
    return "\n".join(getattr(e, "__notes__", [])) or str(e)


def _raises(match, fn, *args):
    with pytest.raises(gk.GradkitError, match=match) as info:
        fn(*args)
    assert str(info.value).startswith("[gradkit]")
    return str(info.value)


def test_error_wrong_number_of_gradients():
    @custom_gradient
    def two(x, y):
        return x * y, lambda g: g * y  # one gradient for two arguments

    msg = _raises(r"two", jax.grad(two), 2.0, 3.0)
    assert "tuple of 2 gradients" in msg and "`x`, `y`" in msg and "test_custom_gradient.py" in msg

    @custom_gradient
    def three(x, y):
        return x * y, lambda g: (g, g, g)

    assert "returned 3 gradients, expected 2" in _raises("three", jax.grad(three), 2.0, 3.0)


def test_error_wrong_shape_and_structure():
    @custom_gradient
    def bcast(x, y):
        return x * y, lambda g: (g * y, g * x)  # y is a scalar but its gradient is not reduced

    msg = _raises(r"bcast", jax.grad(lambda x, y: jnp.sum(bcast(x, y)), argnums=1), jnp.ones(3), jnp.float32(2.0))
    assert "shape (3,) for `y`, expected ()" in msg and "jnp.sum" in msg

    @custom_gradient
    def tree(p):
        return p["a"] * p["b"], lambda g: {"a": g * p["b"]}  # missing key "b"

    msg = _raises("tree", jax.grad(tree), {"a": 1.0, "b": 2.0})
    assert "structure" in msg and "`p`" in msg


def test_error_complex_gradient_for_real_input():
    @custom_gradient
    def cplx(x):
        return x, lambda g: lax.complex(g, g)

    assert "complex" in _raises("cplx", jax.grad(cplx), 1.0)


def test_error_function_does_not_return_a_pair():
    @custom_gradient
    def no_grad(x):
        return x * 2, x * 3

    msg = _raises(r"no_grad.*\(outputs, grad_fn\)", no_grad, jnp.float32(1.0))
    assert "tuple (float32[], float32[])" in msg


def test_error_nested_grad_grad_fn_is_rejected():
    @custom_gradient
    def nested(x):
        def grad(g):
            return g * 2 * x, lambda gg: gg * 2

        return x * x, grad

    msg = _raises(r"nested.*\(gradients, grad_grad_fn\)", jax.grad(nested), 1.0)
    assert "grad of grad already works" in msg


def test_error_inside_grad_fn_names_the_function():
    @custom_gradient
    def branchy(x):
        def grad(g):
            if g > 0:  # Python control flow on a traced value
                return g
            return -g

        return x, grad

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:  # the user's error keeps its type
        jax.grad(branchy)(1.0)
    note = _notes(info.value)
    assert "[gradkit] raised in the grad_fn of custom_gradient function 'branchy'" in note
    assert "jnp.where" in note


def test_error_bad_arguments_and_options():
    _raises("keyword arguments are static", lambda: piecewise(jnp.ones(2), kind=jnp.ones(2)))
    _raises("unhashable", lambda: piecewise(jnp.ones(2), {"square"}))
    _raises("mode must be", lambda: custom_gradient(mode="fwd"))
    _raises("name", lambda: custom_gradient(name=" x ")(lambda x: (x, None)))
    _raises("pass the op name as a keyword", lambda: custom_gradient("log1pexp"))
    _raises("decorates a function", lambda: custom_jvp(3))


# --------------------------------------------------------------------------- higher order


def test_grad_of_grad_differentiates_grad_fn(x64, maybe_jit):
    @custom_gradient
    def cube(x):
        return x**3, lambda g: g * 3 * x**2

    xs = np.array([-1.0, 0.5, 2.0])
    gg = maybe_jit(jax.vmap(jax.grad(jax.grad(cube))))(xs)
    np.testing.assert_allclose(gg, 6 * xs, rtol=1e-12)
    fd = [fd_grad(lambda v: 3 * v**2, [x])[0] for x in xs]
    np.testing.assert_allclose(gg, fd, rtol=1e-7)


def test_rule_holds_for_outputs_at_second_order(maybe_jit):
    @custom_gradient
    def ste_round(x):  # straight-through: forward round, gradient identity
        return jnp.round(x), lambda g: g

    h = lambda x: ste_round(x) ** 2
    # d/dx [2 round(x) * 1] with the rule at both orders = 2 (autodiff of round would give 0).
    assert float(maybe_jit(jax.grad(jax.grad(h)))(1.3)) == 2.0


def test_custom_gradient_inside_grad_fn_controls_the_second_derivative(maybe_jit):
    @custom_gradient
    def first_derivative(x):  # value 3x^2, but declared derivative 100
        return 3 * x**2, lambda g: g * 100.0

    @custom_gradient
    def cube(x):
        return x**3, lambda g: g * first_derivative(x)

    assert float(maybe_jit(jax.grad(cube))(2.0)) == 12.0
    assert float(maybe_jit(jax.grad(jax.grad(cube)))(2.0)) == 100.0


# --------------------------------------------------------------------------- forward mode


@custom_gradient(mode="both")
def both_op(x, y):
    e = jnp.exp(-x)

    def grad(dz, dw):
        return dz * y * (1 - e) + dw * 2 * x, dz * (x + e)

    return y * (x + e), x**2, grad


def _both_plain(x, y):
    return y * (x + jnp.exp(-x)), x**2


def test_mode_both_serves_jvp_jacfwd_hessian(x64, maybe_jit):
    x, y = np.array([0.3, -1.0]), np.array([2.0, 0.5])
    t = (np.array([1.0, -2.0]), np.array([0.5, 0.25]))
    out, tan = maybe_jit(lambda a, b, ta, tb: jax.jvp(both_op, (a, b), (ta, tb)))(x, y, *t)
    rout, rtan = jax.jvp(_both_plain, (x, y), t)
    for a, b in zip(out + tan, rout + rtan):
        np.testing.assert_allclose(a, b, rtol=1e-12)

    z = lambda v: jnp.concatenate(both_op(v[:2], v[2:]))
    v = np.concatenate([x, y])
    jf, jr = maybe_jit(jax.jacfwd(z))(v), maybe_jit(jax.jacrev(z))(v)
    np.testing.assert_allclose(jf, jr, rtol=1e-12)
    plain_z = lambda u: np.concatenate([u[2:] * (u[:2] + np.exp(-u[:2])), u[:2] ** 2])
    np.testing.assert_allclose(jf, fd_jac(plain_z, v), rtol=1e-7, atol=1e-9)

    s = lambda u: jnp.sum(jnp.sin(z(u)))
    h = maybe_jit(jax.hessian(s))(v)
    np.testing.assert_allclose(h, jax.jacfwd(jax.jacrev(s))(v), rtol=1e-10)
    plain_s = lambda u: jnp.sum(jnp.sin(jnp.concatenate(_both_plain(u[:2], u[2:]))))
    np.testing.assert_allclose(h, jax.hessian(plain_s)(v), rtol=1e-10)
    fd_h = fd_jac(lambda u: np.asarray(jax.grad(s)(u)), v)
    np.testing.assert_allclose(h, fd_h, rtol=1e-6, atol=1e-8)


def test_mode_both_under_vmap_and_override(maybe_jit):
    xs = jnp.array([0.5, 1.0, 2.0])
    f = lambda x: jnp.sum(both_op(x, 2.0 * x)[0])
    hv = maybe_jit(jax.vmap(jax.hessian(f)))(xs)
    np.testing.assert_allclose(hv, jax.vmap(jax.hessian(lambda x: _both_plain(x, 2.0 * x)[0]))(xs), rtol=1e-5)
    assert both_op.rule.mode == "jvp"
    assert float(jax.jacfwd(gk.override(f, {"exp": gk.vjp_rule(lambda op, g: (g * 0,))}))(1.0)) == float(
        jax.jacfwd(f)(1.0))


# Each grad_fn below is not linear in upstream: reverse mode must use it as written, forward mode must refuse.
NONLINEAR = {
    "clips": (lambda x, g: jnp.clip(g, -1.0, 1.0) * x, "JAX cannot transpose it"),
    "branches": (lambda x, g: jnp.where(g > 0, g, 0.5 * g) * x, "non-float"),
    "squares": (lambda x, g: g * g * x, "JAX cannot transpose it"),
    "adds_a_constant": (lambda x, g: g * x + 1.0, "does not depend on upstream"),
    "is_constant": (lambda x, g: jnp.ones_like(x), "does not depend on upstream"),
    "rounds": (lambda x, g: jnp.round(g * 4.0) * x, "JAX cannot transpose it"),
}


def _nonlinear(kind, mode="both"):
    grad = NONLINEAR[kind][0]

    @custom_gradient(name=kind, mode=mode)
    def f(x):
        return jnp.sin(x), lambda g: grad(x, g)

    return f


@pytest.mark.parametrize("kind", sorted(NONLINEAR))
def test_nonlinear_grad_fn_keeps_reverse_mode_and_refuses_forward_mode(kind, maybe_jit):
    f, f_vjp = _nonlinear(kind), _nonlinear(kind, mode="vjp")
    x = jnp.array([0.5, -2.0, 3.0])
    upstream = jnp.array([0.25, -3.0, 1.7])
    # Reverse mode: exactly grad_fn(upstream), as with mode="vjp" (and as before forward mode existed).
    want = NONLINEAR[kind][0](x, upstream)
    got = maybe_jit(lambda v, u: jax.vjp(f, v)[1](u)[0])(x, upstream)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, maybe_jit(lambda v, u: jax.vjp(f_vjp, v)[1](u)[0])(x, upstream))
    # Forward mode: a [gradkit] error naming the function and why.
    for fwd in (lambda v: jax.jvp(f, (v,), (v,)), jax.jacfwd(f), jax.hessian(lambda v: jnp.sum(f(v)))):
        msg = _raises(rf"{kind}.*forward mode", maybe_jit(fwd), x)
        assert "not linear in the upstream gradients" in msg and NONLINEAR[kind][1] in msg
        assert "gk.custom_jvp" in msg and "test_custom_gradient.py" in msg


def test_forward_mode_applied_inside_jit_names_the_function():
    # jax.jvp inside an enclosing jit: JAX itself would only fail when compiling the outer jit.
    f = _nonlinear("clips")
    _raises("clips.*forward mode", jax.jit(lambda v: jax.jvp(f, (v,), (v,))), jnp.ones(2))
    # Forward mode of a jit that was traced first reaches only the compiled program: JAX's own error.
    with pytest.raises((TypeError, gk.GradkitError), match="custom_vjp|forward mode"):
        jax.jvp(jax.jit(f), (jnp.ones(2),), (jnp.ones(2),))


# Linear grad_fns written in common ways: each must serve forward mode (no false "not linear").
LINEAR = {
    "where_zero": lambda x, g: jnp.where(x > 0, g, 0.0) * jnp.cos(x),
    "scatter_into_zeros": lambda x, g: jnp.zeros_like(x).at[jnp.argmax(x)].set(jnp.sum(g)),
    "pad_and_slice": lambda x, g: jnp.pad(g[1:], (1, 0)) * 2.0,
    "concatenate_zeros": lambda x, g: jnp.concatenate([g[:1] * 3.0, jnp.zeros(2, g.dtype)]),
    "library_function": lambda x, g: g * jax.nn.sigmoid(x),
    "cond_on_primal": lambda x, g: lax.cond(jnp.sum(x) > 0, lambda u: u * 2.0, lambda u: -u, g),
    "scan_over_upstream": lambda x, g: lax.scan(lambda c, u: (c + u, c + u), 0.0, g)[1],
    "minus": lambda x, g: -g - g * x,
}


@pytest.mark.parametrize("kind", sorted(LINEAR))
def test_linear_grad_fns_serve_forward_mode(kind, x64, maybe_jit):
    grad = LINEAR[kind]

    @custom_gradient(name=kind)
    def f(x):
        return jnp.sin(x), lambda g: grad(x, g)

    x = np.array([0.5, -2.0, 3.0])
    jr = maybe_jit(jax.jacrev(f))(x)
    np.testing.assert_allclose(jr, jax.vmap(lambda u: grad(x, u))(np.eye(3)), rtol=1e-14)  # rows: grad_fn(e_i)
    try:  # whether this JAX transposes it (jax 0.8 does not transpose a scan)
        jax.linear_transpose(lambda u: grad(x, u), x)(x)
    except Exception:
        _raises(f"{kind}.*forward mode.*JAX cannot transpose it", maybe_jit(jax.jacfwd(f)), x)
        return
    np.testing.assert_allclose(maybe_jit(jax.jacfwd(f))(x), jr, rtol=1e-14)


def test_mode_vjp_is_reverse_only():
    @custom_gradient(mode="vjp")
    def cube(x):
        return x**3, lambda g: g * 3 * x**2

    assert float(jax.grad(cube)(2.0)) == 12.0
    msg = _raises(r"cube.*forward mode.*mode='vjp'", jax.jacfwd(cube), 2.0)
    assert "jax.grad" in msg
    _raises(r"cube.*forward mode", lambda: jax.jvp(cube, (2.0,), (1.0,)))
    _raises("mode must be 'both' \\(the default\\) or 'vjp'", lambda: custom_gradient(mode="jvp"))


def test_mode_both_is_the_default():
    def f(x):
        return jnp.sin(x), lambda g: g * jnp.cos(x)

    default, both, vjp = custom_gradient(f), custom_gradient(mode="both")(f), custom_gradient(mode="vjp")(f)

    def prims(g):
        inner = jax.make_jaxpr(g)(1.0).jaxpr.eqns[0].params["jaxpr"]
        return [e.primitive.name for e in compat.jaxpr_parts(inner)[0].eqns]

    assert prims(default) == prims(both) == ["custom_jvp_call"]
    assert prims(vjp) == ["custom_vjp_call"] or prims(vjp) == ["custom_vjp_call_jaxpr"]


@custom_gradient
def twice_identity(x):
    # A gradient that is not the true one (TensorFlow's forward-accumulator test): forward mode must use it.
    return x, lambda g: g * 2.0


def test_forward_mode_by_default_uses_grad_fn(x64, maybe_jit):
    x = np.array([0.3, -1.2])
    out, tan = maybe_jit(lambda v, t: jax.jvp(twice_identity, (v,), (t,)))(x, np.array([1.0, 5.0]))
    np.testing.assert_array_equal(out, x)
    np.testing.assert_array_equal(tan, [2.0, 10.0])
    # The seed examples: forward mode against JAX's autodiff of the plain functions and finite differences.
    xs = np.array([-3.0, 0.5, 2.0])
    np.testing.assert_allclose(maybe_jit(jax.jacfwd(log1pexp))(xs), np.diag(1 / (1 + np.exp(-xs))), rtol=1e-12)
    np.testing.assert_allclose(maybe_jit(jax.hessian(lambda v: jnp.sum(log1pexp(v))))(xs),
                               jax.hessian(lambda v: jnp.sum(jnp.log1p(jnp.exp(v))))(xs), rtol=1e-12)
    jb = maybe_jit(jax.jacfwd(bar, argnums=(0, 1)))(2.0, 3.0)
    assert (float(jb[0]), float(jb[1])) == (3.0, 2.0)
    a, b = np.array([0.7, 1.3]), np.array([2.0, -0.4])
    jz = maybe_jit(jax.jacfwd(lambda u: jnp.concatenate(complex_op(u[:2], u[2:]))))(np.concatenate([a, b]))
    plain = lambda u: np.concatenate([u[:2] * u[2:] + np.sin(u[:2]), u[:2] / u[2:]])
    np.testing.assert_allclose(jz, fd_jac(plain, np.concatenate([a, b])), rtol=1e-7, atol=1e-9)
    rows = np.array([[0.1, 0.9, 0.3], [1.2, 0.4, 0.2]])
    jt = maybe_jit(jax.vmap(jax.jacfwd(take_max)))(rows)
    np.testing.assert_allclose(jt, maybe_jit(jax.vmap(jax.grad(take_max)))(rows), rtol=1e-12)


def test_reverse_mode_of_the_default_matches_mode_vjp(x64, maybe_jit):
    def make(mode):
        @custom_gradient(mode=mode)
        def layer(w, x):
            h = jnp.tanh(x @ w)

            def grad(g):
                d = g * (1 - h**2)
                return x.T @ d, d @ w.T

            return h, grad

        return layer

    rng = np.random.default_rng(0)
    w, x = rng.normal(size=(4, 3)), rng.normal(size=(5, 4))
    loss = lambda layer: lambda w, x: jnp.sum(jnp.sin(layer(w, x)))
    g_both = maybe_jit(jax.grad(loss(make("both")), argnums=(0, 1)))(w, x)
    g_vjp = maybe_jit(jax.grad(loss(make("vjp")), argnums=(0, 1)))(w, x)
    g_ref = jax.grad(lambda w, x: jnp.sum(jnp.sin(jnp.tanh(x @ w))), argnums=(0, 1))(w, x)
    for a, b, c in zip(g_both, g_vjp, g_ref):
        np.testing.assert_allclose(a, b, rtol=1e-13)
        np.testing.assert_allclose(a, c, rtol=1e-12)
    jf = maybe_jit(jax.jacfwd(make("both"), argnums=0))(w, x)
    np.testing.assert_allclose(jf, jax.jacfwd(lambda w: jnp.tanh(x @ w))(w), rtol=1e-12)


@custom_jvp
def jvp_op(p, x, n):
    """p: {"a": (), "b": ()}; x: (2,); n: static int."""
    y = p["a"] * jnp.sin(x) ** n + p["b"]

    def jvp_fn(tp, tx, tn):
        assert tn is None  # n is static
        dy = tp["a"] * jnp.sin(x) ** n + tp["b"] + p["a"] * n * jnp.sin(x) ** (n - 1) * jnp.cos(x) * tx
        return dy, None  # the second output is an integer: no tangent

    return y, jnp.argmax(y), jvp_fn


def test_custom_jvp_all_modes_against_finite_differences(x64, maybe_jit):
    p = {"a": np.float64(1.5), "b": np.float64(-0.5)}
    x = np.array([0.3, 1.1])

    def plain(u, n=3):
        return u[0] * np.sin(u[2:]) ** n + u[1]

    f = lambda u: jvp_op({"a": u[0], "b": u[1]}, u[2:], 3)[0]
    u = np.concatenate([[p["a"], p["b"]], x])
    jf, jr = maybe_jit(jax.jacfwd(f))(u), maybe_jit(jax.jacrev(f))(u)
    np.testing.assert_allclose(jf, jr, rtol=1e-12)
    np.testing.assert_allclose(jf, fd_jac(plain, u), rtol=1e-7, atol=1e-9)
    s = lambda v: jnp.sum(f(v) ** 2)
    np.testing.assert_allclose(maybe_jit(jax.hessian(s))(u), fd_jac(lambda v: np.asarray(jax.grad(s)(v)), u),
                               rtol=1e-6, atol=1e-8)
    gp, gx = maybe_jit(jax.grad(lambda q, v: jnp.sum(jvp_op(q, v, 3)[0]), argnums=(0, 1)))(p, x)
    np.testing.assert_allclose(gx, fd_grad(lambda v: np.sum(plain(np.concatenate([[p["a"], p["b"]], v]))), [x])[0],
                               rtol=1e-7)
    assert float(gp["b"]) == 2.0


def test_custom_jvp_shares_forward_values_and_works_in_tables(maybe_jit):
    @custom_jvp
    def safe_norm(x):
        n = jnp.sqrt(jnp.sum(x * x))
        unit = jnp.where(n == 0, 0.0, x / jnp.where(n == 0, 1.0, n))
        return n, lambda t: jnp.sum(unit * t)

    zero, v = jnp.zeros(3), jnp.array([3.0, 4.0, 0.0])
    assert np.isnan(jax.grad(lambda x: jnp.sqrt(jnp.sum(x * x)))(zero)).all()
    np.testing.assert_array_equal(maybe_jit(jax.grad(safe_norm))(zero), [0.0, 0.0, 0.0])
    np.testing.assert_array_equal(maybe_jit(jax.jacfwd(safe_norm))(zero), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(maybe_jit(jax.vmap(jax.grad(safe_norm)))(jnp.stack([v, zero])),
                               [[0.6, 0.8, 0.0], [0.0, 0.0, 0.0]], rtol=1e-6)
    assert safe_norm.rule.mode == "jvp"

    @gk.op("norm")
    def norm(x):
        return jnp.sqrt(jnp.sum(x * x))

    f = gk.override(norm, {"norm": safe_norm.rule})
    np.testing.assert_array_equal(maybe_jit(jax.jacfwd(f))(zero), [0.0, 0.0, 0.0])
    np.testing.assert_allclose(maybe_jit(jax.grad(f))(v), [0.6, 0.8, 0.0], rtol=1e-6)


def test_custom_jvp_errors():
    @custom_jvp
    def two_out(x):
        return x, 2 * x, lambda t: t  # two outputs, one tangent

    msg = _raises(r"two_out.*jvp_fn.*tuple of 2 output tangents", jax.jvp, two_out, (1.0,), (1.0,))
    assert "output 0, output 1" in msg

    @custom_jvp
    def wrong_shape(x):
        return jnp.sum(x), lambda t: t  # tangent not reduced

    assert "shape (3,) for the output, expected ()" in _raises("wrong_shape", jax.jvp, wrong_shape, (jnp.ones(3),), (jnp.ones(3),))


# --------------------------------------------------------------------------- methods


class Scaled:
    """A plain object: `self` is keyed by identity and its arrays are closed over."""

    def __init__(self, scale):
        self.scale = scale

    @custom_gradient
    def mul(self, a, b):
        s = self.scale
        return a * b * s, lambda g: (g * b * s, g * a * s)

    @custom_gradient
    def power(self, x, n, *, shift=0.0):
        y = (x + shift) ** n * self.scale
        return y, lambda g: (g * n * (x + shift) ** (n - 1) * self.scale, None)

    @custom_jvp
    def mul_jvp(self, a, b):
        return a * b * self.scale, lambda ta, tb: (ta * b + a * tb) * self.scale


@jax.tree_util.register_pytree_node_class
class PScaled:
    """A pytree: its arrays are passed in at each call, so instances share one trace."""

    traces = 0

    def __init__(self, scale):
        self.scale = scale

    def tree_flatten(self):
        return (self.scale,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)

    @custom_gradient
    def mul(self, a, b):
        PScaled.traces += 1
        s = self.scale
        return a * b * s, lambda g: (g * b * s, g * a * s)


def test_method_binds_self_first(x64, maybe_jit):
    m = Scaled(jnp.float64(1.5))
    a, b = np.array([0.5, -2.0]), np.array([3.0, 0.25])
    plain = lambda a, b: jnp.sum(a * b * 1.5)
    want = jax.grad(plain, argnums=(0, 1))(a, b)
    for f in (lambda a, b: m.mul(a, b), lambda a, b: Scaled.mul(m, a, b)):
        got = maybe_jit(jax.grad(lambda a, b: jnp.sum(f(a, b)), argnums=(0, 1)))(a, b)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-15)
        jf = maybe_jit(jax.jacfwd(f, argnums=1))(a, b)
        np.testing.assert_allclose(jf, np.diag(a * 1.5), rtol=1e-15)
    fd = fd_grad(lambda a, b: np.sum(a * b * 1.5), [a, b])
    np.testing.assert_allclose(want[0], fd[0], rtol=1e-8)
    # Statics and keywords after self; another instance is another trace with its own values.
    x = np.array([1.0, 2.0])
    g3 = maybe_jit(jax.grad(lambda v: jnp.sum(m.power(v, 3, shift=1.0))))(x)
    np.testing.assert_allclose(g3, 3 * (x + 1) ** 2 * 1.5, rtol=1e-15)
    m2 = Scaled(jnp.float64(-2.0))
    np.testing.assert_allclose(maybe_jit(jax.grad(lambda a: jnp.sum(m2.mul(a, b))))(a), b * -2.0, rtol=1e-15)
    # custom_jvp methods get tangents for the arguments after self.
    _, t = maybe_jit(lambda a, b: jax.jvp(m.mul_jvp, (a, b), (b, a)))(a, b)
    np.testing.assert_allclose(t, (b * b + a * a) * 1.5, rtol=1e-15)
    np.testing.assert_allclose(maybe_jit(jax.grad(lambda a: jnp.sum(m.mul_jvp(a, b))))(a), b * 1.5, rtol=1e-15)


def test_pytree_self_is_passed_in_and_closed_over(maybe_jit):
    a, b = jnp.array([0.5, -2.0]), jnp.array([3.0, 0.25])
    loss = maybe_jit(lambda m, a: jnp.sum(m.mul(a, b)))
    seen = []
    for scale in (1.5, -4.0, 0.25):  # same structure: one trace, each call with its own scale
        m = PScaled(jnp.float32(scale))
        np.testing.assert_allclose(jax.grad(loss, argnums=1)(m, a), b * scale, rtol=1e-6)
        np.testing.assert_allclose(loss(m, a), np.sum(np.asarray(a) * np.asarray(b) * scale), rtol=1e-6)
        seen.append(PScaled.traces)
    assert seen[0] == seen[-1]  # the later instances reused the first one's trace
    msg = _raises(r"mul.*closes over a traced value.*or holds one in `self`",
                  jax.grad(lambda m: jnp.sum(m.mul(a, b))), PScaled(jnp.float32(2.0)))
    assert "stop_gradient" in msg


def test_method_errors():
    class Three:
        @custom_gradient
        def mul(self, a, b):
            return a * b, lambda g: (None, g * b, g * a)  # a gradient for self too

    assert "returned 3 gradients, expected 2" in _raises("mul", jax.grad(Three().mul), 2.0, 3.0)

    @dataclasses.dataclass
    class Unhashable:  # eq=True without frozen: no __hash__, and not a pytree
        s: float

        @custom_gradient
        def mul(self, a):
            return a * self.s, lambda g: g * self.s

    assert "`self` is keyed by its hash" in _raises("unhashable", Unhashable(2.0).mul, jnp.ones(2))

    def outside(self, a):  # a method assigned after the class was made: bound by the name `self`
        return a * self.k, lambda g: g * self.k

    class Late:
        k = 3.0

    Late.mul = custom_gradient(outside)
    assert float(jax.grad(Late().mul)(1.0)) == 3.0

    @custom_gradient
    def two_for_three(x, y, z):
        return x * y * z, lambda g: (g, g)

    msg = _raises("returned 2 gradients, expected 3", jax.grad(two_for_three), 1.0, 2.0, 3.0)
    assert "`self`" not in msg  # the hint is only for one extra gradient


# --------------------------------------------------------------------------- user errors keep their type


def test_exceptions_in_grad_fn_and_jvp_fn_keep_their_type(maybe_jit):
    @custom_gradient
    def boom(x):
        def grad(g):
            raise RuntimeError("grad_fn exploded")

        return x * 2.0, grad

    @custom_jvp
    def boom_jvp(x):
        def jvp_fn(t):
            raise ValueError("jvp_fn exploded")

        return x * 2.0, jvp_fn

    x = jnp.array([1.0, 2.0])
    np.testing.assert_array_equal(maybe_jit(boom)(x), [2.0, 4.0])
    cases = [(RuntimeError, "grad_fn exploded", "grad_fn of custom_gradient function 'boom'", boom),
             (ValueError, "jvp_fn exploded", "jvp_fn of custom_jvp function 'boom_jvp'", boom_jvp)]
    for kind, message, note, f in cases:
        for transform in (jax.grad, jax.jacfwd):
            with pytest.raises(kind, match=message) as info:
                maybe_jit(transform(lambda v: jnp.sum(f(v))))(x)
            assert not isinstance(info.value, gk.GradkitError)
            assert f"[gradkit] raised in the {note}" in _notes(info.value)
            assert "test_custom_gradient.py" in _notes(info.value)

    @custom_gradient
    def none_upstream(x):
        return x * 2.0, jnp.argmax(x), lambda g, gi: (g + gi,)  # gi is None: integer output

    with pytest.raises(TypeError) as info:
        jax.grad(lambda v: jnp.sum(none_upstream(v)[0]))(x)
    assert "None for integer outputs" in _notes(info.value)


# --------------------------------------------------------------------------- static-argument cache


def test_static_cache_keys_signed_zero_and_nan(maybe_jit):
    traces = []

    @custom_gradient
    def signed(x, s):
        traces.append(s)
        sign = math.copysign(1.0, s)
        return x * sign, lambda g: (g * sign, None)

    x = jnp.array([1.0, -2.0])
    np.testing.assert_array_equal(signed(x, 0.0), x)
    per_signature = len(traces)
    np.testing.assert_array_equal(signed(x, -0.0), -x)  # not the +0.0 program
    assert len(traces) == 2 * per_signature
    np.testing.assert_array_equal(maybe_jit(jax.grad(lambda v: jnp.sum(signed(v, -0.0))))(x), [-1.0, -1.0])
    np.testing.assert_array_equal(maybe_jit(jax.grad(lambda v: jnp.sum(signed(v, 0.0))))(x), [1.0, 1.0])
    n = len(traces)
    for _ in range(3):
        np.testing.assert_array_equal(signed(x, float("nan")), x)  # copysign(1, nan) = 1
    assert len(traces) == n + per_signature  # every NaN hits one entry
    signed(x, 0.0), signed(x, -0.0), signed(x, float("nan"))
    assert len(traces) == n + per_signature


# --------------------------------------------------------------------------- docs


def test_docstring_examples_run():
    results = doctest.testmod(cg_module, optionflags=doctest.ELLIPSIS)
    assert results.attempted >= 4 and results.failed == 0
