"""Programs the dispatcher must know: each case stands for a class of programs.

* sub-programs kept in any container of a primitive's params (custom_linear_solve's
  NamedTuple with None entries, custom_root, the solvers built on them);
* Explicit mesh axes (the default of ``jax.make_mesh``), with and without ``jax.set_mesh``;
* overrides nested in overrides;
* JAX's own errors, raised through an overridden function;
* the two namespaces of table keys (primitives vs functions).
"""

import jax
import jax.numpy as jnp
import jax.scipy.sparse.linalg as jsl
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from budget import MODES, covering, in_mode

import gradkit as gk
from meshes import make_mesh

A = jnp.array([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]], jnp.float32)
B = jnp.array([1.0, 2.0, 3.0], jnp.float32)
DOUBLE_SIN = gk.jvp_rule(lambda op, t: 2.0 * jnp.cos(op.inputs[0]) * t[0], name="double_sin")


@jax.custom_jvp
def _double_sin(x):
    return jnp.sin(x)


_double_sin.defjvp(lambda p, t: (jnp.sin(p[0]), 2.0 * jnp.cos(p[0]) * t[0]))


def _close(a, b, rtol=2e-5, atol=1e-6):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


# --------------------------------------------------------------------------- linear solves


def _solve_program(sin_fn):
    """custom_linear_solve whose matvec and solve both contain a `sin` of the input (the op a rule targets)."""

    def f(x):
        m = A + jnp.diag(sin_fn(x))  # symmetric, positive definite for the x used here

        def matvec(v):
            return m @ v  # linear in v; sin(x) is a constant of the jaxpr

        def solve(mv, b):
            return jnp.linalg.solve(A + jnp.diag(sin_fn(x)), b)

        return jnp.sum(lax.custom_linear_solve(matvec, B, solve, symmetric=True) ** 2)

    return f


@pytest.mark.parametrize("mode,run", covering(["grad", "jacfwd"], MODES))  # a covering half; all in the slow set
def test_rule_inside_custom_linear_solve(mode, run):
    maybe_jit = in_mode(run)
    # The params hold a NamedTuple (matvec, vecmat, solve, transpose_solve) with None
    # entries: it is rebuilt with its own type, and the rule reaches inside both jaxprs.
    over = gk.override(_solve_program(jnp.sin), {"sin": DOUBLE_SIN})
    twin = _solve_program(_double_sin)
    t = jax.grad if mode == "grad" else jax.jacfwd
    x = jnp.array([0.3, 0.9, 1.4])
    np.testing.assert_array_equal(maybe_jit(over)(x), jax.jit(_solve_program(jnp.sin))(x))
    _close(maybe_jit(t(over))(x), maybe_jit(t(twin))(x))
    assert not np.allclose(t(over)(x), t(_solve_program(jnp.sin))(x))  # the rule changed it
    assert "custom_linear_solve" in str(over.rewritten_jaxpr(x))


def test_cg_under_safe_value_and_gradient(maybe_jit):
    spd = A @ A.T + jnp.eye(3)

    def f(b):
        x, _ = jsl.cg(lambda v: spd @ v, b, tol=1e-7)
        return jnp.sum(jnp.sqrt(x * x + 1.0))

    over = gk.override(f, gk.tables.SAFE)
    np.testing.assert_array_equal(maybe_jit(over)(B), jax.jit(f)(B))
    _close(maybe_jit(jax.grad(over))(B), jax.grad(f)(B), rtol=1e-5)
    # checked independently: the solve's gradient by the implicit function theorem
    x = np.linalg.solve(np.asarray(spd, np.float64), np.asarray(B, np.float64))
    want = np.linalg.solve(np.asarray(spd, np.float64).T, x / np.sqrt(x * x + 1.0))
    _close(jax.grad(over)(B), want, rtol=1e-4)


def _solver_program(solver, sin_fn):
    if solver == "linalg_solve":
        def f(x):
            return jnp.sum(jnp.linalg.solve(A + jnp.diag(sin_fn(x)), B))
        return f

    def f(x):
        s = sin_fn(x)

        def g(y):
            return y * y * y + s * y - 1.0

        def newton(g_, y0):
            y = y0
            for _ in range(20):
                y = y - g_(y) / (3.0 * y * y + s)
            return y

        def tangent_solve(g_, y):
            return y / jax.grad(lambda z: jnp.sum(g_(z)))(jnp.ones_like(y))

        return jnp.sum(lax.custom_root(g, jnp.ones_like(x), newton, tangent_solve))
    return f


@pytest.mark.parametrize("solver,run", covering(["linalg_solve", "custom_root"], MODES))  # all in the slow set
def test_rule_reaches_into_other_solvers(solver, run):
    maybe_jit = in_mode(run)
    f = _solver_program(solver, jnp.sin)
    over = gk.override(f, {"sin": DOUBLE_SIN})
    x = jnp.array([0.3, 0.7, 1.1])
    np.testing.assert_array_equal(maybe_jit(over)(x), jax.jit(f)(x))
    # the reference: the same program with a sin whose derivative is doubled, by hand
    _close(maybe_jit(jax.grad(over))(x), jax.grad(_solver_program(solver, _double_sin))(x))
    assert not np.allclose(jax.grad(over)(x), jax.grad(f)(x))


# --------------------------------------------------------------------------- Explicit mesh axes


def _explicit_mesh():
    return make_mesh((8,), ("x",))  # Explicit axes: the default


TRANSFORMS = {
    "value": lambda f: f,
    "grad": lambda f: jax.grad(lambda x: jnp.sum(f(x))),
    "jacfwd": jax.jacfwd,
    "jacrev": jax.jacrev,
}


def _like_jit(over, f, twin, x, transform):
    """What jax.jit(f) does, the override does: the twin's result, or the same error type."""
    t = TRANSFORMS[transform]
    try:
        plain = t(jax.jit(f))(x)
    except Exception as e:  # JAX refuses this transform here: so must the override, the same way
        with pytest.raises(type(e)):
            t(over)(x)
        return False
    got = t(over)(x)
    if transform == "value":
        np.testing.assert_array_equal(got, plain)
    else:
        _close(got, t(jax.jit(twin))(x))
    return True


@pytest.mark.parametrize("set_mesh,transform", covering([False, True], list(TRANSFORMS)))  # all in the slow set
def test_shard_map_on_an_explicit_mesh(set_mesh, transform):
    mesh = _explicit_mesh()
    x = jax.device_put(jnp.linspace(0.5, 4.0, 8), NamedSharding(mesh, P("x")))

    def program(sin_fn):
        return jax.shard_map(lambda z: jnp.sqrt(z) * sin_fn(z), mesh=mesh, in_specs=P("x"), out_specs=P("x"))

    over = gk.override(program(jnp.sin), {"sin": DOUBLE_SIN} | gk.tables.SAFE)
    if set_mesh:
        with jax.set_mesh(mesh):
            assert _like_jit(over, program(jnp.sin), program(_double_sin), x, transform)
    else:
        ran = _like_jit(over, program(jnp.sin), program(_double_sin), x, transform)
        assert ran or transform == "grad"  # jax 0.12 needs set_mesh for a reduction to a scalar here


@pytest.mark.parametrize("set_mesh,transform", covering([False, True], list(TRANSFORMS)))  # all in the slow set
def test_named_sharding_input_on_an_explicit_mesh(set_mesh, transform):
    mesh = _explicit_mesh()
    x = jax.device_put(jnp.linspace(0.1, 1.6, 8), NamedSharding(mesh, P("x")))
    over = gk.override(lambda x: jnp.sin(x) * 3.0, {"sin": DOUBLE_SIN})
    f, twin = (lambda x: jnp.sin(x) * 3.0), (lambda x: _double_sin(x) * 3.0)
    if set_mesh:
        with jax.set_mesh(mesh):
            assert _like_jit(over, f, twin, x, transform)
    else:
        ran = _like_jit(over, f, twin, x, transform)
        assert ran or transform == "grad"
    if transform == "jacfwd":  # and independently of JAX: d(3 sin x)/dx doubled
        _close(jax.jacfwd(over)(x), np.diag(6.0 * np.cos(np.asarray(x))))


# --------------------------------------------------------------------------- nested overrides


def test_nested_overrides_compose_and_the_innermost_wins(maybe_jit):
    triple_sin = gk.jvp_rule(lambda op, t: 3.0 * jnp.cos(op.inputs[0]) * t[0], name="triple_sin")
    exp_rule = gk.jvp_rule(lambda op, t: 5.0 * op.outputs[0] * t[0], name="five_exp")

    def f(x):
        return jnp.sum(jnp.sin(x) + jnp.exp(x))

    inner = gk.override(f, {"sin": DOUBLE_SIN})
    outer = gk.override(inner, {"sin": triple_sin, "exp": exp_rule})
    x = jnp.array([0.1, 0.5, 2.0])
    # sin: the inner table's rule (2 cos); exp: only the outer table names it (5 exp)
    want = 2.0 * np.cos(np.asarray(x)) + 5.0 * np.exp(np.asarray(x))
    _close(maybe_jit(jax.grad(outer))(x), want)
    _close(jax.jacfwd(outer)(x), want)
    assert outer.table is not inner.table and "exp" in outer.table and "exp" not in inner.table
    # decorator form, three deep
    deco = gk.override({"exp": exp_rule})(gk.override({"sin": DOUBLE_SIN})(f))
    _close(jax.grad(deco)(x), want)


# --------------------------------------------------------------------------- JAX's errors keep their type


@jax.custom_vjp
def _user_vjp(x):
    return jnp.sin(x)


_user_vjp.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


@pytest.mark.parametrize("table", [{}, gk.tables.SAFE], ids=["empty", "safe"])
def test_forward_mode_through_a_users_custom_vjp_is_jaxs_type_error(table):
    f = lambda x: jnp.sum(_user_vjp(x) * jnp.sqrt(x))  # noqa: E731
    x = jnp.array([0.5, 1.0])
    kinds = []
    for g in (f, jax.jit(f), gk.override(f, table)):
        with pytest.raises(TypeError) as info:
            jax.jvp(g, (x,), (x,))
        kinds.append(type(info.value))
        assert "custom_vjp" in str(info.value)
        assert not isinstance(info.value, gk.GradkitError)
    assert len(set(kinds)) == 1


def test_forward_mode_reaching_a_vjp_rule_names_the_rule():
    f = lambda x: jnp.sum(jnp.sin(x))  # noqa: E731
    with pytest.raises(gk.GradkitError, match=r"VJP rule .*'sin' at .*test_programs.py:\d+"):
        jax.jvp(gk.override(f, {"sin": gk.vjp_rule(lambda op, g: (g,))}), (jnp.ones(2),), (jnp.ones(2),))


def test_concretization_errors_keep_their_type():
    def f(x):
        return x if x.sum() > 0 else -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        gk.override(f, {})(jnp.ones(2))
    assert any("[gradkit]" in n for n in info.value.__notes__)


# --------------------------------------------------------------------------- namespaces


def _users_div():
    @jax.custom_vjp
    def div(x, y):
        return x / y

    div.defvjp(lambda x, y: (x / y, y), lambda y, g: (g * 100.0, jnp.zeros_like(y)))
    return div


@pytest.mark.parametrize("kind", ["custom_vjp", "custom_jvp", "jit"])
def test_a_table_never_replaces_a_users_function_named_like_a_primitive(kind, maybe_jit):
    if kind == "custom_vjp":
        div = _users_div()
    elif kind == "custom_jvp":
        @jax.custom_jvp
        def div(x, y):
            return x / y

        div.defjvp(lambda p, t: (p[0] / p[1], t[0] * 100.0))
    else:
        @jax.jit
        def div(x, y):
            return x * 100.0 / (y * 100.0)

    f = lambda x: jnp.sum(div(x, 2.0))  # noqa: E731
    x = jnp.array([1.0, 3.0])
    own = jax.grad(f)(x)
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(f, gk.tables.SAFE)))(x), maybe_jit(jax.grad(f))(x))
    # the function namespace targets it on purpose
    zero = gk.jvp_rule(lambda op, t: None, name="zero")
    np.testing.assert_array_equal(jax.grad(gk.override(f, {"fn:div": zero}))(x), np.zeros(2, np.float32))
    assert not np.all(own == 0)


def test_shipped_tables_target_primitives_only():
    prims = {p.name for p in vars(jax.extend.core.primitives).values()
             if isinstance(p, jax.extend.core.Primitive)}
    for table in (gk.tables.SAFE, gk.tables.STABLE, gk.tables.STRAIGHT_THROUGH):
        assert set(table) <= prims, set(table) - prims
        assert not any(k.startswith("fn:") for k in table)


def test_strict_mode_lists_function_names_in_their_namespace():
    f = lambda x: jnp.sum(jax.nn.softplus(x))  # noqa: E731
    with pytest.raises(gk.GradkitError, match=r"'softplus'.*did you mean 'fn:softplus'"):
        gk.override(f, {"softplus": DOUBLE_SIN}, strict=True)(jnp.ones(2))

