"""gradkit.tables: SAFE, STRAIGHT_THROUGH, STABLE, STABLE_FUNCTIONS (every mode: test_tables_modes.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit import stable as st
from gradkit import tables
from gradkit._src import compat

SAFE, STABLE, STE = tables.SAFE, tables.STABLE, tables.STRAIGHT_THROUGH
FUNCTIONS = tables.STABLE_FUNCTIONS

# ----------------------------------------------------------------------------- SAFE

# The guarded-function family ("double where", JAX FAQ): the first where alone
# leaves a NaN gradient at the guarded points; SAFE fixes it without the second.
DOUBLE_WHERE = {
    "log": (lambda x: jnp.where(x > 0.0, jnp.log(x), 0.0), lambda x: np.where(x > 0, 1 / x, 0.0)),
    "sqrt": (lambda x: jnp.where(x > 0.0, jnp.sqrt(x), 0.0), lambda x: np.where(x > 0, 0.5 / np.sqrt(x), 0.0)),
    "div": (lambda x: jnp.where(x != 0.0, 1.0 / x, 0.0), lambda x: np.where(x != 0, -1 / x ** 2, 0.0)),
    "pow": (lambda x: jnp.where(x > 0.0, x ** 0.5, 0.0), lambda x: np.where(x > 0, 0.5 / np.sqrt(x), 0.0)),
    "integer_pow": (lambda x: jnp.where(x != 0.0, x ** -2, 0.0), lambda x: np.where(x != 0, -2 / x ** 3, 0.0)),
    "atan2": (lambda x: jnp.where(x != 0.0, jnp.arctan2(x, x), 0.0), lambda x: np.zeros_like(x)),
    "acos": (lambda x: jnp.where(jnp.abs(x) < 1.0, jnp.arccos(x), 0.0),
             lambda x: np.where(np.abs(x) < 1, -1 / np.sqrt(np.maximum(1 - x ** 2, 1e-30)), 0.0)),
    "log1p": (lambda x: jnp.where(x > -1.0, jnp.log1p(x), 0.0), lambda x: np.where(x > -1, 1 / (1 + x), 0.0)),
    "rsqrt": (lambda x: jnp.where(x > 0.0, jax.lax.rsqrt(x), 0.0),
              lambda x: np.where(x > 0, -0.5 * np.maximum(x, 1e-30) ** -1.5, 0.0)),
}


@pytest.mark.parametrize("name", sorted(DOUBLE_WHERE))
def test_safe_fixes_the_double_where_family(name):
    f, df = DOUBLE_WHERE[name]
    x = jnp.array([-1.0, 0.0, 0.5, 2.0, 100.0])
    plain = jax.vmap(jax.grad(f))(x)
    assert not bool(jnp.all(jnp.isfinite(plain)))  # the problem exists
    safe = jax.vmap(jax.grad(gk.override(f, SAFE)))(x)
    assert bool(jnp.all(jnp.isfinite(safe)))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        want = df(np.asarray(x, np.float64))
    np.testing.assert_allclose(np.asarray(safe), want, rtol=1e-6)
    # wherever plain JAX was finite, SAFE is bit-identical
    fin = np.isfinite(np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(safe)[fin], np.asarray(plain)[fin])


def test_safe_faq_examples():
    """The examples of JAX's FAQ ("gradients contain NaN where using where")."""
    def my_log(x):
        return jnp.where(x > 0.0, jnp.log(x), 0.0)

    assert np.isnan(float(jax.grad(my_log)(0.0)))
    assert float(jax.grad(gk.override(my_log, SAFE))(0.0)) == 0.0
    assert float(jax.grad(gk.override(my_log, SAFE))(2.0)) == 0.5

    def safe_for_sqrt(x):  # a norm that is 0 at the origin, written with where
        n2 = jnp.sum(x ** 2)
        return jnp.where(n2 > 0, jnp.sqrt(n2), 0.0)

    g = jax.grad(gk.override(safe_for_sqrt, SAFE))(jnp.zeros(3))
    np.testing.assert_array_equal(np.asarray(g), np.zeros(3))
    g = jax.grad(gk.override(safe_for_sqrt, SAFE))(jnp.array([3.0, 4.0, 0.0]))
    np.testing.assert_allclose(np.asarray(g), [0.6, 0.8, 0.0], rtol=1e-6)


SINGLE_OPS = {
    "sqrt": jnp.sqrt, "rsqrt": jax.lax.rsqrt, "cbrt": jnp.cbrt, "log": jnp.log, "log1p": jnp.log1p,
    "acos": lambda x: jnp.arccos(x / 4), "asin": lambda x: jnp.arcsin(x / 4), "acosh": lambda x: jnp.arccosh(1 + x),
    "atanh": lambda x: jnp.arctanh(x / 4), "lgamma": jax.scipy.special.gammaln,
    "digamma": jax.scipy.special.digamma, "erf_inv": lambda x: jax.scipy.special.erfinv(x / 4),
    "integer_pow": lambda x: x ** -3, "integer_pow_2": lambda x: jnp.tanh(x) ** 2, "div": lambda x: x / (1 + x), "rem": lambda x: jnp.remainder(1.0, x),
    "atan2": lambda x: jnp.arctan2(x, 1 + x), "pow": lambda x: x ** 2.5,
}
UNMATCHED = {  # no primitive of SAFE's (products by dot_general, not mul; softplus is a custom_jvp function)
    "no_safe_ops": lambda x: jnp.sum(jnp.tanh(jnp.tanh(x[:, None] @ x[None, :]))) + jnp.sum(jnp.sin(x)),
    "softplus_mlp": lambda x: jnp.sum(jax.nn.softplus(x[:, None] @ x[None, :8]) + jnp.cos(x)[:, None]),
}
COMPOSITES = {
    "chain": lambda x: jnp.log1p(jnp.sqrt(x)) / (1.0 + x) ** 2,
    "norm_like": lambda x: jnp.sqrt(jnp.sum(x ** 2)) + jnp.log(jnp.sum(jnp.exp(x))),
    "many_terms": lambda x: (jnp.sqrt(x) + jnp.log(x) + x / (1 + x) + x ** 2.5 + jnp.arctan2(x, 1 + x)
                             + jnp.arccos(x / 4) + x ** -3 + jnp.log1p(x) + jax.lax.rsqrt(x) + jnp.cbrt(x)),
}


def _atanh_jvp_is_two_quotients():
    """JAX's JVP of atanh is written as a product of 1/(1+x) and t/(1-x) (the older form)."""
    jvp = jax.make_jaxpr(lambda x, t: jax.jvp(jnp.arctanh, (x,), (t,)))(0.5, 1.0)
    return any(e.primitive.name == "mul" for e in jvp.eqns)


@pytest.mark.parametrize("name", sorted(SINGLE_OPS))
def test_safe_is_bit_identical_on_non_singular_functions(name):
    """Where the cotangent is nonzero a SAFE rule is JAX's formula, operation for operation.

    Compared within one XLA program (``jit(grad(...))`` on both sides): XLA
    compiles the two the same way.
    """
    fn = SINGLE_OPS[name]
    f = lambda x: jnp.sum(fn(x))
    x = jax.random.uniform(jax.random.key(0), (257,), minval=0.1, maxval=3.0)
    got, want = np.asarray(jax.jit(jax.grad(gk.override(f, SAFE)))(x)), np.asarray(jax.jit(jax.grad(f))(x))
    if name == "atanh" and _atanh_jvp_is_two_quotients():
        # JAX up to 0.10 writes atanh' as (1/(1+x)) * (t/(1-x)) (0.12: t / one_minus_square(x)); XLA's
        # simplifier merges the two quotients of the plain program into 1/((1+x)(1-x)), which SAFE's masked
        # products keep apart. Three roundings against two, each at most half an ULP (eps/2 relative): at
        # most 2.5 eps apart (found: 2 ULP at 1 of 257 on 0.8, 1 ULP at 77 of 257 on 0.10). Keyed on the
        # formula JAX uses, not on a version number. SAFE's own: it goes when SAFE leaves a path that no mask
        # reaches as JAX's own equation.
        np.testing.assert_allclose(got, want, rtol=2.5 * float(jnp.finfo(jnp.float32).eps), atol=0)
        return
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", sorted(SINGLE_OPS))
def test_safe_forward_mode_is_jaxs_jvp_bit_for_bit(name):
    """Forward mode too: each product of JAX's JVP in JAX's order (no re-associated chains)."""
    fn = SINGLE_OPS[name]
    x = jax.random.uniform(jax.random.key(0), (257,), minval=0.1, maxval=3.0)
    t = jax.random.uniform(jax.random.key(1), (257,), minval=-2.0, maxval=2.0)
    got = jax.jit(lambda x, t: jax.jvp(gk.override(fn, SAFE), (x,), (t,))[1])(x, t)
    want = jax.jit(lambda x, t: jax.jvp(fn, (x,), (t,))[1])(x, t)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", sorted(UNMATCHED))
def test_safe_leaves_programs_without_safe_ops_bit_identical(name):
    f = UNMATCHED[name]
    x = jax.random.uniform(jax.random.key(0), (64,), minval=0.1, maxval=3.0)
    # Compiled: as plain JAX. Eager: as the dispatcher with an empty table (what SAFE adds is nothing;
    # the eager dispatcher itself is checked against plain JAX in its own tests).
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.grad(gk.override(f, SAFE)))(x)),
                                  np.asarray(jax.jit(jax.grad(f))(x)))
    np.testing.assert_array_equal(np.asarray(jax.grad(gk.override(f, SAFE))(x)),
                                  np.asarray(jax.grad(gk.override(f, {}))(x)))


@pytest.mark.parametrize("name", sorted(COMPOSITES))
def test_safe_on_composites_differs_at_most_by_summation_order(name):
    """Several cotangents reaching one value may be summed in another order, and XLA may simplify
    the two programs differently: last-bit differences of the terms only."""
    f = lambda x: jnp.sum(COMPOSITES[name](x))
    x = jax.random.uniform(jax.random.key(0), (257,), minval=0.1, maxval=3.0)
    got = np.asarray(jax.jit(jax.grad(gk.override(f, SAFE)))(x))
    want = np.asarray(jax.jit(jax.grad(f))(x))
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, rtol=4e-7, atol=4e-7 * scale)


def test_safe_keeps_true_infinities_and_the_forward_pass():
    # the cotangent reaches sqrt at 0: the true derivative is infinite, SAFE does not hide it
    assert float(jax.grad(gk.override(jnp.sqrt, SAFE))(0.0)) == jnp.inf
    # the norm of a zero vector: sqrt's infinite derivative meets the 0 of x * x's derivative, a value
    # zero, not a mask: SAFE keeps JAX's NaN in every mode; safe_norm gives 0 (a subgradient) on purpose
    norm = gk.override(jnp.linalg.norm, SAFE)
    for g in (jax.grad(norm)(jnp.zeros(3)), jax.jacfwd(norm)(jnp.zeros(3))):
        assert bool(jnp.all(jnp.isnan(g)))
    assert bool(jnp.all(jnp.isnan(jax.grad(jnp.linalg.norm)(jnp.zeros(3)))))
    np.testing.assert_array_equal(np.asarray(jax.grad(st.safe_norm)(jnp.zeros(3))), np.zeros(3))
    f = lambda x: jnp.where(x > 0, jnp.log(x), 0.0) + x ** -2 + jnp.sqrt(x)
    x = jnp.array([0.0, 1.0, 3.0])
    np.testing.assert_array_equal(np.asarray(gk.override(f, SAFE)(x)), np.asarray(jax.jit(f)(x)))


def test_safe_does_not_fix_overflow_inside_a_formula():
    """log(1 + exp(x)) at x = 100: inf forward, NaN backward; primitive rules cannot help.

    (exp is deliberately not in SAFE: its zero cotangent here is 1/inf, not a
    mask, and zeroing it would turn the NaN into a wrong 0.)"""
    naive = lambda x: jnp.log(1 + jnp.exp(x))
    assert "exp" not in SAFE
    assert np.isnan(float(jax.grad(gk.override(naive, SAFE))(100.0)))
    # a named op of that name plus STABLE_FUNCTIONS does
    named = gk.op("log1pexp")(naive)
    assert float(jax.grad(gk.override(named, FUNCTIONS))(100.0)) == 1.0


def test_safe_mul_rule():
    """x log x under a where: the NaN comes from mul's rule (0 * -inf on the masked side); SAFE masks it."""
    f = lambda x: jnp.where(x > 0.0, x * jnp.log(x), 0.0)
    assert "mul" in SAFE
    assert np.isnan(float(jax.grad(f)(0.0)))
    assert float(jax.grad(gk.override(f, SAFE))(0.0)) == 0.0
    table = SAFE | {"mul": "safe"}  # a library rule by name, as in from_dict
    assert table == SAFE | gk.RuleTable.from_dict({"mul": "safe"})
    g = jax.vmap(jax.grad(gk.override(f, table)))(jnp.array([0.0, 0.5, 2.0]))
    np.testing.assert_allclose(np.asarray(g), [0.0, np.log(0.5) + 1, np.log(2.0) + 1], rtol=1e-6)
    h = jax.vmap(jax.hessian(gk.override(f, table)))(jnp.array([0.0, 0.5, 2.0]))
    np.testing.assert_allclose(np.asarray(h), [0.0, 2.0, 0.5], rtol=1e-6)


def test_safe_second_order_reverse_and_jit_vmap():
    f = lambda x: jnp.where(x > 0.0, jnp.log(x), 0.0)
    g = gk.override(f, SAFE)
    x = jnp.array([0.0, 0.5, 2.0])
    np.testing.assert_allclose(np.asarray(jax.vmap(jax.grad(jax.grad(g)))(x)), [0.0, -4.0, -0.25], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(jax.grad(g)))(x)),
                                  np.asarray(jax.vmap(jax.grad(g))(x)))


def test_every_safe_entry_matches_a_primitive():
    fns = {
        "sqrt": jnp.sqrt, "rsqrt": jax.lax.rsqrt, "cbrt": jnp.cbrt, "log": jnp.log, "log1p": jnp.log1p,
        "acos": jnp.arccos, "asin": jnp.arcsin, "acosh": jnp.arccosh, "atanh": jnp.arctanh,
        "lgamma": jax.scipy.special.gammaln, "digamma": jax.scipy.special.digamma,
        "erf_inv": jax.scipy.special.erfinv, "integer_pow": lambda x: x ** -3, "div": lambda x: 1.0 / x,
        "rem": lambda x: jnp.remainder(1.0, x), "atan2": lambda x: jnp.arctan2(x, x), "pow": lambda x: x ** x,
        "mul": lambda x: x * jnp.sin(x),
    }
    assert set(fns) == set(SAFE)
    for name, fn in fns.items():
        f = gk.override(lambda x: jnp.sum(jnp.where(x > 10.0, fn(x), 0.0)), {name: SAFE[name]}, strict=True)
        g = jax.grad(f)(jnp.array([0.0, 1.0, -1.0]))
        np.testing.assert_array_equal(np.asarray(g), np.zeros(3), err_msg=name)


def test_safe_integer_pow_positive_powers_and_pow_integer_exponent():
    for y in [0, 1, 2, 3]:
        f = lambda x: jnp.sum(x ** y)
        x = jnp.array([0.0, -1.5, 2.0])
        want = jax.jit(jax.grad(f))(x)
        np.testing.assert_array_equal(np.asarray(jax.grad(gk.override(f, SAFE))(x)), np.asarray(want))
    f = lambda x, n: jnp.sum(jnp.where(x > 0, jax.lax.pow(x, n), 0.0))
    x = jnp.array([0.0, 2.0])
    g = jax.grad(gk.override(f, SAFE))(x, jnp.int32(-1))
    np.testing.assert_allclose(np.asarray(g), [0.0, -0.25])


# ----------------------------------------------------------------------------- STRAIGHT_THROUGH


def test_straight_through_table():
    f = lambda x: jnp.sum(jnp.round(x) * 2.0 + jnp.floor(x) + jnp.ceil(x) + jnp.sign(x))
    x = jnp.array([0.3, 1.7, -2.2])
    assert set(STE) == {"round", "floor", "ceil", "sign"}
    np.testing.assert_array_equal(np.asarray(jax.grad(jax.jit(f))(x)), np.zeros(3))
    g = gk.override(f, STE)
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(jax.jit(f)(x)))
    np.testing.assert_array_equal(np.asarray(jax.grad(g)(x)), np.full(3, 5.0))
    np.testing.assert_array_equal(np.asarray(jax.jacfwd(g)(x)), np.full(3, 5.0))


# ----------------------------------------------------------------------------- STABLE, STABLE_FUNCTIONS


@gk.op("log1pexp")
def _user_log1pexp(x):
    return jnp.log(1 + jnp.exp(x))


@gk.op("softplus")
def _user_softplus(x):
    return jnp.log(1 + jnp.exp(x))


@gk.op("logsumexp")
def _user_logsumexp(x):
    return jnp.log(jnp.sum(jnp.exp(x)))


def _sigmoid_prime(x):
    return np.exp(-np.abs(x)) / (1 + np.exp(-np.abs(x))) ** 2


def _silu_prime(x):
    return 1 / (1 + np.exp(-x)) * (1 + x * (1 - 1 / (1 + np.exp(-x))))


def _sinc_prime(x):
    return (np.cos(np.pi * x) - np.sin(np.pi * x) / (np.pi * x)) / x


_sp = jax.scipy.special

# table key -> (function whose program contains the key, argument, reference gradient function)
STABLE_TARGETS = {
    # STABLE: primitives
    "logistic": (lambda x: jnp.sum(jax.nn.sigmoid(x)), jnp.array([-20.0, 0.0, 20.0]), _sigmoid_prime),
    "tanh": (lambda x: jnp.sum(jnp.tanh(x)), jnp.array([-10.0, 0.5, 10.0]), lambda x: 1 / np.cosh(x) ** 2),
    "expm1": (lambda x: jnp.sum(jnp.expm1(x)), jnp.array([-20.0, 0.5, 3.0]), np.exp),
    # STABLE_FUNCTIONS: JAX's functions, by name
    "fn:softplus": (lambda x: jnp.sum(jax.nn.softplus(x)), jnp.array([-200.0, 0.0, 200.0]),
                    lambda x: 1 / (1 + np.exp(-x))),
    "fn:log_sigmoid": (lambda x: jnp.sum(jax.nn.log_sigmoid(x)), jnp.array([-200.0, 0.0, 200.0]),
                       lambda x: 1 / (1 + np.exp(x))),
    "fn:silu": (lambda x: jnp.sum(jax.nn.silu(x)), jnp.array([-30.0, 0.0, 30.0]), _silu_prime),
    "fn:logaddexp": (lambda x: jnp.sum(jnp.logaddexp(x, -jnp.inf)), jnp.array([-jnp.inf, 0.0, 1.0]),
                     lambda x: np.array([0.5, 1.0, 1.0])),  # (-inf, -inf): the limit along x == y
    "fn:xlogy": (lambda x: jnp.sum(_sp.xlogy(x, x)), jnp.array([1.0, 2.0]), lambda x: np.log(x) + 1),
    "fn:xlog1py": (lambda x: jnp.sum(_sp.xlog1py(0.0, x)), jnp.array([-1.0, 2.0]), np.zeros_like),
    "fn:sinc": (lambda x: jnp.sum(jnp.sinc(x)), jnp.array([1e-3, 0.3]), _sinc_prime),
    "fn:hypot": (lambda x: jnp.sum(jnp.hypot(x, x)), jnp.array([0.0, 3e30]), lambda x: np.array([0.0, np.sqrt(2)])),
    # STABLE_FUNCTIONS: named ops (gradkit.stable's, or your own of that name)
    "log1pexp": (lambda x: jnp.sum(_user_log1pexp(x)), jnp.array([-200.0, 0.0, 200.0]), lambda x: 1 / (1 + np.exp(-x))),
    "softplus": (lambda x: jnp.sum(_user_softplus(x)), jnp.array([-200.0, 0.0, 200.0]), lambda x: 1 / (1 + np.exp(-x))),
    "log_sigmoid": (lambda x: jnp.sum(st.log_sigmoid(x)), jnp.array([-200.0, 0.0, 200.0]),
                    lambda x: 1 / (1 + np.exp(x))),
    "sigmoid": (lambda x: jnp.sum(st.sigmoid(x)), jnp.array([-20.0, 0.0, 20.0]), _sigmoid_prime),
    "silu": (lambda x: jnp.sum(st.silu(x)), jnp.array([-30.0, 0.0, 30.0]), _silu_prime),
    "logaddexp": (lambda x: jnp.sum(st.logaddexp(x, -jnp.inf)), jnp.array([-jnp.inf, 0.0, 1.0]),
                  lambda x: np.array([0.5, 1.0, 1.0])),
    "logsumexp": (lambda x: _user_logsumexp(x), jnp.full(4, -jnp.inf), lambda x: np.full(4, 0.25)),
    "softmax": (lambda x: st.softmax(x)[0], jnp.array([0.0, 1.0]),
                lambda x: np.array([0.19661193, -0.19661193])),
    "log_softmax": (lambda x: st.log_softmax(x)[0], jnp.full(2, -jnp.inf), lambda x: np.array([0.5, -0.5])),
    "xlogy": (lambda x: jnp.sum(st.xlogy(x, x)), jnp.array([1.0, 2.0]), lambda x: np.log(x) + 1),
    "xlog1py": (lambda x: jnp.sum(st.xlog1py(0.0, x)), jnp.array([-1.0, 2.0]), np.zeros_like),
    "sinc": (lambda x: jnp.sum(st.sinc(x)), jnp.array([1e-3, 0.3]), _sinc_prime),
    "hypot": (lambda x: jnp.sum(st.hypot(x, x)), jnp.array([0.0, 3e30]), lambda x: np.array([0.0, np.sqrt(2)])),
    "log1mexp": (lambda x: jnp.sum(st.log1mexp(x)), jnp.array([1e-3, 3.0]), lambda x: 1 / np.expm1(x)),
    "log_sub_exp": (lambda x: jnp.sum(st.log_sub_exp(x, 0.0)), jnp.array([1e-3, 3.0]),
                    lambda x: 1 / (1 - np.exp(-x))),
    "softplus_inverse": (lambda x: jnp.sum(st.softplus_inverse(x)), jnp.array([1e-3, 300.0]),
                         lambda x: 1 / (1 - np.exp(-x))),
    "log_cosh": (lambda x: jnp.sum(st.log_cosh(x)), jnp.array([-300.0, 0.5]), np.tanh),
    "safe_sqrt": (lambda x: jnp.sum(st.safe_sqrt(x)), jnp.array([0.0, 4.0]), lambda x: np.array([0.0, 0.25])),
    "safe_log": (lambda x: jnp.sum(st.safe_log(x)), jnp.array([0.0, 4.0]), lambda x: np.array([0.0, 0.25])),
    "safe_div": (lambda x: jnp.sum(st.safe_div(1.0, x)), jnp.array([0.0, 2.0]), lambda x: np.array([0.0, -0.25])),
    "safe_arctan2": (lambda x: jnp.sum(st.safe_arctan2(x, x)), jnp.array([0.0, 2.0]), lambda x: np.zeros(2)),
    "safe_pow": (lambda x: jnp.sum(st.safe_pow(x, 0.0)), jnp.array([0.0, 2.0]), lambda x: np.zeros(2)),
    "safe_arccos": (lambda x: jnp.sum(st.safe_arccos(x)), jnp.array([0.0, 2.0]), lambda x: np.array([-1.0, 0.0])),
    "safe_arcsin": (lambda x: jnp.sum(st.safe_arcsin(x)), jnp.array([0.0, 2.0]), lambda x: np.array([1.0, 0.0])),
    "safe_norm": (lambda x: st.safe_norm(x), jnp.zeros(2), lambda x: np.zeros(2)),
    "normalize": (lambda x: st.normalize(x)[0], jnp.zeros(2), lambda x: np.zeros(2)),
}
BOTH = STABLE | FUNCTIONS


def test_stable_targets_cover_the_tables_and_the_tables_split_by_namespace():
    assert set(STABLE_TARGETS) == set(STABLE) | set(FUNCTIONS)
    assert set(STABLE) == {"logistic", "tanh", "expm1"}
    assert not set(STABLE) & set(FUNCTIONS)
    # the primitive-only tables hold no function keys; STABLE_FUNCTIONS holds no primitive names
    for table in (SAFE, STABLE, STE):
        assert all(gk.RuleTable({k: table[k]}) and not k.startswith("fn:") for k in table)
        assert all(compat.primitive_by_name(k) is not None for k in table), sorted(table)
    assert not any(compat.primitive_by_name(k) is not None for k in FUNCTIONS)
    assert {k for k in FUNCTIONS if k.startswith("fn:")} == {
        "fn:softplus", "fn:log_sigmoid", "fn:silu", "fn:logaddexp", "fn:xlogy", "fn:xlog1py", "fn:sinc", "fn:hypot"}


@pytest.mark.parametrize("name", sorted(STABLE_TARGETS))
def test_every_stable_entry_matches_and_gives_the_stable_gradient(name, maybe_jit):
    f, x, ref = STABLE_TARGETS[name]
    g = gk.override(f, {name: BOTH[name]}, strict=True)  # raises if the name matches nothing
    got = np.asarray(maybe_jit(jax.grad(g))(x))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        want = np.asarray(ref(np.asarray(x, np.float64)), np.float64)
    assert np.all(np.isfinite(got)), (name, got)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-30, err_msg=name)
    np.testing.assert_array_equal(np.asarray(g(x)), np.asarray(jax.jit(f)(x)))


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(STABLE_TARGETS))
def test_every_stable_entry_serves_every_mode(name, maybe_jit):
    """Forward and reverse agree (jvp, jacfwd, jacrev, grad), and so do both Hessians, under jit and vmap."""
    f, x, _ = STABLE_TARGETS[name]
    g = gk.override(f, {name: BOTH[name]})
    x = jnp.where(jnp.isfinite(x), jnp.clip(x, -30.0, 30.0), x)  # keep second derivatives representable
    if name.removeprefix("fn:") == "xlog1py":
        # Not at y = -1: gradkit.stable.xlog1py's own forward mode is NaN there (0 * x/(1+y) = 0 * 0/0),
        # with or without a table; reverse mode is 0 (test above).
        x = jnp.array([-0.5, 2.0])
    rev, fwd = maybe_jit(jax.jacrev(g))(x), maybe_jit(jax.jacfwd(g))(x)
    np.testing.assert_allclose(np.asarray(fwd), np.asarray(rev), rtol=1e-5, atol=1e-30, err_msg=name)
    t = jnp.linspace(0.5, 1.5, x.shape[0])
    _, jvp = maybe_jit(lambda x, t: jax.jvp(g, (x,), (t,)))(x, t)
    fin = np.isfinite(np.asarray(rev))
    np.testing.assert_allclose(float(jvp), float(np.sum(np.asarray(rev)[fin] * np.asarray(t)[fin])),
                               rtol=1e-5, atol=1e-30, err_msg=name)
    h_fr = np.asarray(maybe_jit(jax.hessian(g))(x))
    h_rr = np.asarray(maybe_jit(jax.jacrev(jax.jacrev(g)))(x))
    both = np.isfinite(h_fr) & np.isfinite(h_rr)
    np.testing.assert_allclose(h_fr[both], h_rr[both], rtol=1e-5, atol=1e-6, err_msg=name)
    batched = maybe_jit(jax.vmap(jax.grad(g)))(jnp.stack([x, x]))
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(rev), rtol=1e-6, atol=1e-30, err_msg=name)


def test_stable_fixes_what_jax_gets_wrong_and_supports_forward_mode():
    for f, x, ref in [(jax.nn.sigmoid, 20.0, _sigmoid_prime), (jnp.tanh, 10.0, lambda x: 1 / np.cosh(x) ** 2),
                      (jnp.expm1, -20.0, np.exp)]:
        if f is not jnp.expm1:  # (JAX 0.12 fixed its expm1 rule)
            assert float(jax.grad(f)(x)) == 0.0  # JAX's own rule cancels to 0
        g = gk.override(f, STABLE)
        np.testing.assert_allclose(float(jax.grad(g)(x)), ref(x), rtol=2e-6)
        assert float(jax.jacfwd(g)(x)) == float(jax.grad(g)(x))
    h = jax.hessian(gk.override(lambda x: jnp.sum(jax.nn.softplus(x)), FUNCTIONS))(jnp.array([0.0, 100.0]))
    np.testing.assert_allclose(np.asarray(h), [[0.25, 0.0], [0.0, 0.0]], atol=1e-30)


def test_fn_keys_match_any_function_of_that_name():
    @jax.jit
    def softplus(x):  # the user's own, naive: a function called softplus gets softplus's derivative
        return jnp.log(1.0 + jnp.exp(x))

    f = lambda x: jnp.sum(softplus(x))
    x = jnp.array([-200.0, 0.0, 200.0])
    assert not np.all(np.isfinite(np.asarray(jax.grad(f)(x))))
    np.testing.assert_allclose(np.asarray(jax.grad(gk.override(f, FUNCTIONS))(x)), [0.0, 0.5, 1.0], atol=1e-30)

    @jax.jit
    def sinc(x, w):  # same name, another signature: a clear error, not a wrong gradient
        return jnp.sin(x * w)

    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] rule gradkit.stable\[sinc\] for op 'fn:sinc'.*2 inputs"):
        jax.grad(gk.override(lambda x: jnp.sum(sinc(x, x)), FUNCTIONS))(x)


def test_stable_rule_on_a_jit_function_with_keywords_keeps_its_gradient():
    # jax.nn.log_softmax's axis is not the stable body's: its own derivative is kept
    f = lambda x: jnp.sum(jax.nn.log_softmax(x, axis=0) * jnp.arange(3.0)[:, None])
    x = jax.random.normal(jax.random.key(1), (3, 2))
    table = gk.RuleTable({"fn:log_softmax": "stable"})
    np.testing.assert_allclose(np.asarray(jax.grad(gk.override(f, table, strict=True))(x)),
                               np.asarray(jax.grad(f)(x)), rtol=1e-6)


def test_tables_compose_and_describe():
    both = SAFE | STE
    assert set(both) == set(SAFE) | set(STE)
    assert (STE | SAFE).fingerprint == both.fingerprint
    custom = gk.vjp_rule(lambda op, g: (g * 0.0,))
    assert (SAFE | {"log": custom})["log"] is custom
    f = lambda x: jnp.sum(jnp.round(jnp.where(x > 0, jnp.log(x), 0.0)))
    np.testing.assert_array_equal(np.asarray(jax.grad(gk.override(f, both))(jnp.array([0.0, 2.0]))), [0.0, 0.5])
    d = tables.describe(SAFE | STABLE | STE | FUNCTIONS | {"my_op": {"rule": "clamped_log", "eps": 0.5}})
    assert d["log"].startswith("safe:") and d["logistic"].startswith("stable:") and "identity" in d["round"]
    assert d["fn:softplus"] == d["softplus"] and "jax.nn.softplus" in d["fn:softplus"]
    assert d["my_op"].startswith("clamped_log(eps=0.5)")
    lib = tables.library()
    assert {"safe", "stable", "straight_through", "clamped_log", "clip_gradient", "scale_gradient"} <= set(lib)
    assert all(r.doc for r in lib.values())
    assert all(t[k].mode == "jvp" for t in (SAFE, STABLE, STE, FUNCTIONS) for k in t)  # every mode


# ----------------------------------------------------------------------------- SAFE in every mode: checks


@pytest.mark.slow
def test_safe_passes_check_grads_to_second_order_wherever_the_plain_gradient_is_finite():
    """gk.check_grads(override(f, SAFE), order=2): both modes, against float64 finite differences."""
    x = jnp.array([0.3, 0.7, 1.6])
    cases = {  # each SAFE primitive, at points where it is smooth; guarded versions where the guard is off
        "sqrt": lambda x: jnp.sqrt(x), "rsqrt": lambda x: jax.lax.rsqrt(x), "cbrt": jnp.cbrt, "log": jnp.log,
        "log1p": jnp.log1p, "acos": lambda x: jnp.arccos(x / 2), "asin": lambda x: jnp.arcsin(x / 2),
        "acosh": lambda x: jnp.arccosh(1 + x), "atanh": lambda x: jnp.arctanh(x / 2),
        "lgamma": jax.lax.lgamma, "digamma": jax.lax.digamma, "erf_inv": lambda x: jax.lax.erf_inv(x / 2),
        "integer_pow": lambda x: x ** -3 + x ** 2, "div": lambda x: x / (1 + x), "rem": lambda x: jax.lax.rem(x, 2.5),
        "atan2": lambda x: jnp.arctan2(x, 1 + x), "pow": lambda x: x ** x,
        "mul": lambda x: x * jnp.sin(x), "square": lambda x: jnp.square(jnp.sin(x)),
        "max": lambda x: jnp.maximum(jnp.sin(x), 0.5), "min": lambda x: jnp.minimum(jnp.sin(x), 0.9),
        "reduce_max": lambda x: jnp.max(jnp.sin(x)) * x, "reduce_min": lambda x: jnp.min(jnp.sin(x)) * x,
        "guarded": lambda x: jnp.where(x > 0, jnp.log(x) + jnp.sqrt(x) / x, 0.0),
    }
    assert set(cases) >= set(SAFE)
    for name, fn in cases.items():
        f = lambda x: jnp.sum(fn(x))
        assert np.all(np.isfinite(np.asarray(jax.grad(f)(x)))), name
        report = gk.check_grads(gk.override(f, SAFE), (x,), order=2)
        assert report.passed, (name, str(report))


def test_safe_accepts_python_float_cotangents():
    f = gk.override(lambda x: jnp.sqrt(x) / 2.0, SAFE)
    (g,) = jax.vjp(f, 4.0)[1](1.0)
    assert float(g) == 0.125
    (g,) = jax.vjp(gk.override(lambda x, y: x / y, SAFE), 3.0, 2.0)[1](1.0)[:1]
    assert float(g) == 0.5


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_safe_serves_forward_mode_through_x_squared():
    """``x ** 2`` is integer_pow, a SAFE primitive: forward mode used to stop there."""
    def model(w, x):
        h = jnp.tanh(x @ w)
        return jnp.mean((h - 1.0) ** 2) + 1e-3 * jnp.sum(w ** 2)

    w = jax.random.normal(jax.random.key(0), (3, 2))
    x = jax.random.normal(jax.random.key(1), (4, 3))
    f = gk.override(model, SAFE | STABLE)
    np.testing.assert_allclose(np.asarray(jax.jacfwd(f)(w, x)), np.asarray(jax.jacfwd(model)(w, x)), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(jax.hessian(f)(w, x)), np.asarray(jax.hessian(model)(w, x)),
                               rtol=1e-4, atol=1e-6)
    assert gk.check_grads(f, (w, x), order=2).passed
