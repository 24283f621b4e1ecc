"""Random-program testing: hypothesis builds small programs, gradkit's invariants must hold on each.

A program is a tree (depth <= 3) over one input ``x: f32[8]`` built from the
primitive pool ``sin exp log tanh sqrt mul add integer_pow reduce_sum`` and
the wrappers ``jax.jit, lax.scan, lax.fori_loop, lax.while_loop, lax.cond,
jax.checkpoint, jax.vmap``. The same tree is built twice: with the plain
``lax`` primitives (run through ``gk.override``) and with hand-written
``jax.custom_vjp`` / ``jax.custom_jvp`` versions of one primitive that carry
the same rule (the reference). Checked on every program:

1. forward: ``override(f, table)(x)`` equals ``jax.jit(f)(x)`` bit for bit
   (eager calls run compiled), and under ``jax.jit`` too;
2. empty table: derivatives equal plain JAX's bit for bit;
3. a table of rules: derivatives equal the hand-written reference's bit for bit.

Derivatives are reverse mode (``jax.vjp``), or forward mode (``jax.jvp``, with
JVP rules) for programs that contain a ``while_loop``. Values stay finite:
``log`` and ``sqrt`` take ``logistic`` of their argument, ``exp`` too.

CI runs ~200 programs (deterministic); ``GRADKIT_NIGHTLY=1`` runs thousands,
randomly seeded.
"""

import pytest
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax

import gradkit as gk

pytestmark = pytest.mark.slow  # a long matrix: `pytest -m slow` (CI runs it)

NIGHTLY = os.environ.get("GRADKIT_NIGHTLY", "") not in ("", "0")
SETTINGS = dict(deadline=None, database=None, derandomize=not NIGHTLY,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
N = 8  # input length: three nested vmaps of reshape(2, -1) still see 1-D arrays

UNARY = ("sin", "exp", "log", "tanh", "sqrt")
POOL = UNARY + ("mul", "add", "integer_pow", "reduce_sum")
WRAPPERS = ("jit", "scan", "fori", "while", "remat", "vmap")

# --------------------------------------------------------------------------- programs


def trees(depth):
    """Programs of at most ``depth`` nested nodes above the input ``x``."""
    leaf = st.just(("x",))
    if depth == 0:
        return leaf
    sub = st.deferred(lambda: trees(depth - 1))
    return st.one_of(
        leaf,
        st.tuples(st.sampled_from(UNARY), sub),
        st.tuples(st.just("integer_pow"), st.sampled_from((2, 3)), sub),
        st.tuples(st.sampled_from(("mul", "add")), sub, sub),
        st.tuples(st.just("reduce_sum"), sub),
        *(st.tuples(st.just(w), sub) for w in WRAPPERS),  # one branch each: wrappers are frequent
        st.tuples(st.just("cond"), sub, sub),
    )


PROGRAMS = trees(3)


def ops_in(tree):
    if tree[0] == "x":
        return set()
    kids = [t for t in tree[1:] if isinstance(t, tuple)]
    own = {tree[0]} if tree[0] in POOL else set()
    return own.union(*map(ops_in, kids))


def has_while(tree):
    return tree[0] == "while" or any(has_while(t) for t in tree[1:] if isinstance(t, tuple))


def build(tree, impl):
    """The function ``x -> y`` (same shape) that ``tree`` describes, with primitives from ``impl``."""
    kind = tree[0]
    if kind == "x":
        return lambda x: x
    if kind == "integer_pow":
        inner = build(tree[2], impl)
        return lambda x: impl["integer_pow"](inner(x), tree[1])
    if kind in ("mul", "add", "cond"):
        a, b = build(tree[1], impl), build(tree[2], impl)
        if kind == "cond":
            return lambda x: lax.cond(jnp.max(x) > 0.0, a, b, x)
        return lambda x: impl[kind](a(x), b(x))
    inner = build(tree[1], impl)
    if kind in ("log", "sqrt", "exp"):  # arguments kept in (0, 1): no overflow, no NaN
        return lambda x: impl[kind](jax.nn.sigmoid(inner(x)))
    if kind in UNARY:
        return lambda x: impl[kind](inner(x))
    if kind == "reduce_sum":
        return lambda x: jnp.broadcast_to(impl["reduce_sum"](inner(x)), x.shape)

    def node(x):  # a name that is not an op name: a jit of it must not match any rule
        return inner(x)

    return {
        "jit": lambda x: jax.jit(node)(x),
        "scan": lambda x: lax.scan(lambda c, _: (node(c), None), x, None, length=2)[0],
        "fori": lambda x: lax.fori_loop(0, 2, lambda i, c: node(c), x),
        "while": lambda x: lax.while_loop(lambda s: s[0] > 0, lambda s: (s[0] - 1, node(s[1])), (2, x))[1],
        "remat": lambda x: jax.checkpoint(node)(x),
        "vmap": lambda x: jax.vmap(node)(x.reshape(2, -1)).reshape(x.shape),
    }[kind]


# --------------------------------------------------------------------------- primitives, rules, references

PLAIN = {
    "sin": lax.sin, "exp": lax.exp, "log": lax.log, "tanh": lax.tanh, "sqrt": lax.sqrt,
    "mul": lax.mul, "add": lax.add, "integer_pow": lax.integer_pow, "reduce_sum": jnp.sum,
}


def _lin(name, op, t):
    """The overriding derivative of each pool op, linear in ``t`` (tangents or the cotangent).

    Deliberately not autodiff's (factors 1.5, 2, 0.5, ...), so a missed or
    misplaced match changes the result.
    """
    x, y = op.inputs[0], op.outputs[0]
    if name == "sin":
        return (t * 2.0 * jnp.cos(x),)
    if name == "exp":
        return (t * 0.5 * y,)
    if name == "log":
        return (t * 3.0 / x,)
    if name == "tanh":
        return (t * 1.5 * (1.0 - y * y),)
    if name == "sqrt":
        return (t * 0.25 / y,)
    if name == "integer_pow":
        n = op.params["y"]
        return (t * (1.5 * n) * lax.integer_pow(x, n - 1),)
    if name == "reduce_sum":
        # From op.params, not an assumed shape: a jax.vmap *inside* the
        # overridden function makes the matched op the batched one (axes=(1,)).
        return (jnp.broadcast_to(jnp.expand_dims(t, op.params["axes"]), x.shape) * 1.5,)
    raise AssertionError(name)


def vjp_rule_fn(name):
    def rule(op, g):
        if g is None:  # an integer op (a loop counter) has no cotangent
            return None
        if name == "mul":
            a, b = op.inputs
            return (g * b * 2.0, g * a * 0.5)
        if name == "add":
            return (g * 2.0, g * 3.0)
        return _lin(name, op, g)
    rule.__name__ = f"vjp_{name}"
    return rule


def jvp_rule_fn(name):
    def rule(op, t):
        if all(ti is None for ti in t):
            return None
        if name == "mul":
            a, b = op.inputs
            ta, tb = (jnp.zeros_like(a) if ti is None else ti for ti in t)
            return ta * b * 2.0 + a * tb * 0.5
        if name == "add":
            ta, tb = (jnp.zeros_like(op.inputs[0]) if ti is None else ti for ti in t)
            return ta * 2.0 + tb * 3.0
        if name == "reduce_sum":
            return jnp.sum(t[0], axis=op.params["axes"]) * 1.5
        return _lin(name, op, t[0])[0]
    rule.__name__ = f"jvp_{name}"
    return rule


def _params(name, args):
    if name == "integer_pow":
        return {"y": args[1]}
    if name == "reduce_sum":
        return {"axes": (0,)}
    return {}


def hand_written(name, mode):
    """``PLAIN[name]`` as a jax.custom_vjp / custom_jvp carrying the same rule (the reference)."""
    prim = PLAIN[name]
    static = name == "integer_pow"

    def view(xs, y, params):
        return gk.OpView(name, tuple(xs), (y,), params)

    if mode == "vjp":
        rule = vjp_rule_fn(name)

        @functools.partial(jax.custom_vjp, nondiff_argnums=(1,) if static else ())
        def f(*args):
            return prim(*args)

        def fwd(*args):
            y = prim(*args)
            return y, (args[:1] if static else args, y)

        def bwd(*a):
            (xs, y), g = a[-2], a[-1]
            params = {"y": a[0]} if static else _params(name, xs)
            return tuple(rule(view(xs, y, params), g))

        f.defvjp(fwd, bwd)
        return f

    rule = jvp_rule_fn(name)

    @functools.partial(jax.custom_jvp, nondiff_argnums=(1,) if static else ())
    def f(*args):
        return prim(*args)

    @f.defjvp
    def f_jvp(*a):
        n, (primals, tangents) = (a[0], a[1:]) if static else (None, a)
        y = f(*primals, n) if static else f(*primals)
        params = {"y": n} if static else _params(name, primals)
        return y, rule(view(primals, y, params), tuple(tangents))

    return f


# --------------------------------------------------------------------------- invariants


def derivative(f, x, forward):
    if forward:
        return jax.jvp(f, (x,), (jnp.ones_like(x),))[1]
    y, pull = jax.vjp(f, x)
    return pull(jnp.ones_like(y))[0]


def _x(seed):
    return jnp.asarray(np.random.default_rng(seed).uniform(-1.0, 1.0, N), jnp.float32)


def _same(a, b, what, tree):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{what}: {tree}")


def _pick_op(data, tree):
    present = sorted(ops_in(tree))
    return data.draw(st.sampled_from(present)) if present else data.draw(st.sampled_from(POOL))


CHECKED = {"forward": 0, "empty_table": 0, "rules": 0}


@settings(max_examples=2000 if NIGHTLY else 70, **SETTINGS)
@given(tree=PROGRAMS, seed=st.integers(0, 2**16), data=st.data(), jit=st.booleans())
def test_forward_is_bit_identical(tree, seed, data, jit):
    x = _x(seed)
    name = _pick_op(data, tree)
    f = build(tree, PLAIN)
    mode = "jvp" if has_while(tree) or data.draw(st.booleans()) else "vjp"
    rule = gk.vjp_rule(vjp_rule_fn(name)) if mode == "vjp" else gk.jvp_rule(jvp_rule_fn(name))
    over = gk.override(f, {name: rule})
    ref = jax.jit(f)(x)
    _same(jax.jit(over)(x) if jit else over(x), ref, "forward", tree)
    CHECKED["forward"] += 1


@settings(max_examples=2000 if NIGHTLY else 70, **SETTINGS)
@given(tree=PROGRAMS, seed=st.integers(0, 2**16), jit=st.booleans())
def test_empty_table_gives_plain_derivatives_bit_for_bit(tree, seed, jit):
    x = _x(seed)
    f = build(tree, PLAIN)
    forward = has_while(tree)
    wrap = jax.jit if jit else (lambda h: h)
    got = wrap(lambda x: derivative(gk.override(f, {}), x, forward))(x)
    _same(got, wrap(lambda x: derivative(f, x, forward))(x), "empty table", tree)
    CHECKED["empty_table"] += 1


@settings(max_examples=4000 if NIGHTLY else 100, **SETTINGS)
@given(tree=PROGRAMS, seed=st.integers(0, 2**16), data=st.data(), jit=st.booleans())
def test_rule_table_equals_rules_applied_by_hand(tree, seed, data, jit):
    x = _x(seed)
    name = _pick_op(data, tree)
    mode = "jvp" if has_while(tree) or data.draw(st.booleans()) else "vjp"
    rule = gk.vjp_rule(vjp_rule_fn(name)) if mode == "vjp" else gk.jvp_rule(jvp_rule_fn(name))
    over = gk.override(build(tree, PLAIN), {name: rule})
    # Compared compiled to compiled: an overridden function runs as jax.jit would run it.
    hand = jax.jit(build(tree, {**PLAIN, name: hand_written(name, mode)}))
    # Forward mode for while programs (JAX has no reverse mode through while);
    # JVP rules are also checked in reverse mode (by transposition) elsewhere.
    forward = has_while(tree) or (mode == "jvp" and data.draw(st.booleans()))
    wrap = jax.jit if jit else (lambda h: h)
    got = wrap(lambda x: derivative(over, x, forward))(x)
    _same(got, wrap(lambda x: derivative(hand, x, forward))(x), f"rules ({name}, {mode})", tree)
    CHECKED["rules"] += 1


def test_report_counts():
    """Prints how many random programs were checked (the hypothesis tests above run first)."""
    print(f"\nrandom programs checked: {CHECKED} (total {sum(CHECKED.values())})")
