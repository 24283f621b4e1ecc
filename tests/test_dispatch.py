"""Dispatcher behaviour: invariants, caching, op kinds, dtypes, statics, strict mode."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from gradkit._src import compat

SAFE_SQRT = gk.vjp_rule(lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),))


def guarded_sqrt(x):
    return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))


def mlp_like(x):
    h = jnp.tanh(x @ jnp.ones((4, 3), x.dtype) * 0.1)
    return jnp.sum(jnp.log1p(jnp.exp(h)) + jnp.sin(h) ** 2)


PROGRAMS = [guarded_sqrt, mlp_like, lambda x: jnp.sum(jax.nn.softmax(x) * jnp.cos(x))]
X = jnp.array([[0.0, 1.0, 4.0, 9.0], [0.5, 2.0, 0.0, 3.0]], jnp.float32)


# --------------------------------------------------------------------------- invariants


@pytest.mark.parametrize("fn", PROGRAMS)
def test_forward_is_bit_identical(fn, maybe_jit):
    f = gk.override(fn, {"sqrt": SAFE_SQRT, "sin": SAFE_SQRT})
    np.testing.assert_array_equal(maybe_jit(f)(X), jax.jit(fn)(X))


TRANSFORMS = {
    "value": lambda f: f,
    "grad": jax.grad,
    "jacfwd": jax.jacfwd,
    "jacrev": jax.jacrev,
    "hessian": jax.hessian,
    "jvp": lambda f: (lambda x: jax.jvp(f, (x,), (jnp.cos(x),))[1]),
    "vjp": lambda f: (lambda x: jax.vjp(f, x)[1](jnp.float32(1.5))[0]),
    "vmap_grad": lambda f: jax.vmap(jax.grad(f)),
    "linearize": lambda f: (lambda x: jax.linearize(f, x)[1](jnp.sin(x))),
}


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("fn", PROGRAMS)
def test_contract_no_matching_rule_is_jax_jit_bit_for_bit(fn, transform, maybe_jit):
    # The stated contract: with no rule matching, override(fn, table) computes
    # exactly what jax.jit(fn) computes, in every transform, eager or nested.
    t = TRANSFORMS[transform]
    for table in ({}, {"cosh": SAFE_SQRT, "erf_inv": SAFE_SQRT}):
        np.testing.assert_array_equal(maybe_jit(t(gk.override(fn, table)))(X), maybe_jit(t(jax.jit(fn)))(X))


def test_no_global_jax_state_changes():
    before = compat.rule_registries_snapshot()
    assert np.isinf(jax.grad(jnp.sqrt)(0.0))
    f = gk.override(guarded_sqrt, {"sqrt": SAFE_SQRT})
    assert jax.grad(f)(X)[0, 0] == 0.0
    jax.jit(jax.grad(f))(X)
    assert np.isinf(jax.grad(jnp.sqrt)(0.0))
    assert np.isnan(jax.grad(guarded_sqrt)(X)[0, 0])
    assert compat.rule_registries_snapshot() == before


def test_guarded_sqrt_gradient_is_fixed(maybe_jit):
    g = maybe_jit(jax.grad(gk.override(guarded_sqrt, {"sqrt": SAFE_SQRT})))(X)
    expected = np.where(np.asarray(X) > 0, 0.5 / np.sqrt(np.maximum(np.asarray(X), 1e-30)), 0.0)
    np.testing.assert_allclose(g, expected, rtol=1e-6)
    assert np.isnan(jax.grad(guarded_sqrt)(X)).any()


# --------------------------------------------------------------------------- compile once


def test_second_call_does_not_retrace():
    calls = []

    def fn(x):
        calls.append(1)
        return jnp.sum(jnp.sqrt(x))

    f = gk.override(fn, {"sqrt": SAFE_SQRT})
    f(X), f(X + 1.0), jax.grad(f)(X), jax.grad(f)(X * 2.0)
    assert len(calls) == 1
    assert f.trace_count == 1
    f(jnp.ones((3,), jnp.float32))  # new signature: exactly one more trace
    f(jnp.zeros((3,), jnp.float32))
    assert len(calls) == 2
    f(jnp.ones((3,), jnp.float16))
    assert len(calls) == 3


def test_new_table_traces_again_once():
    calls = []

    def fn(x):
        calls.append(1)
        return jnp.sum(jnp.sqrt(x))

    a = gk.override(fn, {"sqrt": SAFE_SQRT})
    b = gk.override(fn, {})
    a(X), a(X), b(X), b(X)
    assert len(calls) == 2
    np.testing.assert_array_equal(jax.grad(b)(X), jax.grad(fn)(X))


def test_static_python_arguments_are_part_of_the_key():
    calls = []

    def fn(x, scale, mode="a"):
        calls.append((scale, mode))
        return jnp.sum(jnp.sqrt(x) * scale) if mode == "a" else jnp.sum(x)

    f = gk.override(fn, {"sqrt": SAFE_SQRT})
    assert float(f(X, 2.0)) == pytest.approx(2 * float(jnp.sum(jnp.sqrt(X))), rel=1e-6)
    f(X, 2.0), f(X, 3.0), f(X, 3.0, mode="b")
    assert calls == [(2.0, "a"), (3.0, "a"), (3.0, "b")]


def test_unhashable_static_argument_is_a_clear_error():
    class Config:
        __hash__ = None

    f = gk.override(lambda x, cfg: jnp.sum(x), {})
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\].*not hashable"):
        f(X, Config())


def test_pytree_inputs_and_outputs(maybe_jit):
    def fn(params, batch):
        y = jnp.sqrt(params["w"]) * batch[0] + params["b"]
        return {"loss": jnp.sum(y), "aux": (y, None)}

    params = {"w": jnp.array([1.0, 4.0]), "b": jnp.float32(1.0)}
    batch = (jnp.array([1.0, 2.0]),)
    f = gk.override(fn, {"sqrt": SAFE_SQRT})
    out = maybe_jit(f)(params, batch)
    assert out["aux"][1] is None
    np.testing.assert_array_equal(out["loss"], jax.jit(fn)(params, batch)["loss"])
    g = maybe_jit(jax.grad(lambda p: f(p, batch)["loss"]))(params)
    np.testing.assert_allclose(g["w"], [0.5, 0.5], rtol=1e-6)
    assert float(g["b"]) == 2.0


def test_closure_over_outer_tracer_is_not_cached_and_is_correct():
    def loss(w, x):
        f = gk.override(lambda x: jnp.sum(jnp.sqrt(x) * w), {"sqrt": SAFE_SQRT})
        return f(x)

    x = jnp.array([1.0, 4.0])
    gw = jax.jit(jax.grad(loss))(jnp.float32(3.0), x)
    assert float(gw) == pytest.approx(3.0)
    gx = jax.grad(loss, argnums=1)(jnp.float32(3.0), x)
    np.testing.assert_allclose(gx, [1.5, 0.75])


# --------------------------------------------------------------------------- op kinds


def test_multiple_output_primitive_sort():
    seen = {}

    def rule(op, g):
        seen["n_out"] = len(op.outputs)
        seen["g_is_tuple"] = isinstance(g, tuple)
        gk_, gv = g
        # sort permutes: scatter the cotangents back through the permutation.
        perm = jnp.argsort(op.inputs[0])
        inv = jnp.argsort(perm)
        return (gk_[inv] * 2.0, gv[inv])

    def fn(k, v):
        ks, vs = lax.sort((k, v), num_keys=1)
        return jnp.sum(ks * jnp.arange(3.0)) + jnp.sum(vs ** 2)

    k, v = jnp.array([3.0, 1.0, 2.0]), jnp.array([10.0, 20.0, 30.0])
    gk_, gv = jax.grad(gk.override(fn, {"sort": gk.vjp_rule(rule)}), argnums=(0, 1))(k, v)
    ref_k, ref_v = jax.grad(fn, argnums=(0, 1))(k, v)
    assert seen == {"n_out": 2, "g_is_tuple": True}
    np.testing.assert_allclose(gk_, 2.0 * ref_k)
    np.testing.assert_allclose(gv, ref_v)


def test_static_params_are_visible_to_rules():
    seen = {}

    def rule(op, g):
        seen["axes"], seen["op"] = op.params["axes"], op
        return (jnp.broadcast_to(jnp.expand_dims(g, op.params["axes"]), op.inputs[0].shape) * 3.0,)

    fn = lambda x: jnp.sum(jnp.sum(x, axis=1) ** 2)
    g = jax.grad(gk.override(fn, {"reduce_sum": gk.vjp_rule(rule)}))(X)
    assert seen["axes"] == (1,)
    # The outer sum (axes=(0,)) is a reduce_sum too: both get the factor 3.
    np.testing.assert_allclose(g, 9.0 * jax.grad(fn)(X), rtol=1e-6)
    with pytest.raises(TypeError):
        seen["op"].params["axes"] = (0,)  # rules see a read-only view


def test_integer_pow_param():
    rule = gk.vjp_rule(lambda op, g: (g * op.params["y"] * 10.0,))
    fn = lambda x: jnp.sum(x ** 3)
    np.testing.assert_allclose(jax.grad(gk.override(fn, {"integer_pow": rule}))(X), 30.0)


def test_integer_inputs_get_float0_without_the_user_thinking():
    # gather has an integer index operand; the rule returns None for it.
    def rule(op, g):
        x, idx = op.inputs[0], op.inputs[1]
        assert jnp.issubdtype(idx.dtype, jnp.integer)
        return (jnp.zeros_like(x).at[0].set(jnp.sum(g)), None)

    fn = lambda x, i: jnp.sum(x[i])
    x, i = jnp.arange(4.0), jnp.array([1, 2])
    g = jax.grad(gk.override(fn, {"gather": gk.vjp_rule(rule)}))(x, i)
    np.testing.assert_array_equal(g, [2.0, 0, 0, 0])
    # An integer argument differentiated with allow_int gets float0 zeros.
    gi = jax.grad(gk.override(fn, {"gather": gk.vjp_rule(rule)}), argnums=1, allow_int=True)(x, i)
    assert gi.dtype == jax.dtypes.float0


def test_boolean_input_select():
    def rule(op, g):
        pred, on_false, on_true = op.inputs
        assert pred.dtype == jnp.bool_
        return (None, jnp.where(pred, 0.0, g), jnp.where(pred, g, 0.0) * 5.0)

    fn = lambda x: jnp.sum(jnp.where(x > 1.0, x, -x))
    g = jax.grad(gk.override(fn, {"select_n": gk.vjp_rule(rule)}))(X)
    np.testing.assert_array_equal(g, np.where(np.asarray(X) > 1.0, 5.0, -1.0))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_low_precision_dtypes(dtype, maybe_jit):
    rule = gk.vjp_rule(lambda op, g: (g * 2.0 * jnp.cos(op.inputs[0]),))
    fn = lambda x: jnp.sum(jnp.sin(x))
    x = jnp.linspace(-1, 1, 5).astype(dtype)
    g = maybe_jit(jax.grad(gk.override(fn, {"sin": rule})))(x)
    assert g.dtype == dtype
    np.testing.assert_allclose(np.asarray(g, np.float32), 2 * np.cos(np.asarray(x, np.float32)), rtol=2e-2)


def test_float64(x64, maybe_jit):
    rule = gk.vjp_rule(lambda op, g: (g * 2.0 * jnp.cos(op.inputs[0]),))
    x = jnp.linspace(-1, 1, 5, dtype=jnp.float64)
    g = maybe_jit(jax.grad(gk.override(lambda x: jnp.sum(jnp.sin(x)), {"sin": rule})))(x)
    assert g.dtype == jnp.float64
    np.testing.assert_allclose(g, 2 * np.cos(np.asarray(x)), rtol=1e-15)


def test_user_custom_functions_keep_their_rules_unless_named():
    @jax.custom_jvp
    def my_act(x):
        return jnp.sin(x)

    my_act.defjvp(lambda p, t: (my_act(p[0]), t[0] * 7.0))

    @jax.custom_vjp
    def my_clip(x):
        return jnp.sin(x)

    my_clip.defvjp(lambda x: (jnp.sin(x), None), lambda _, g: (g * 11.0,))

    fn = lambda x: jnp.sum(my_act(x) + my_clip(x) + jnp.sin(x))
    sin_rule = gk.vjp_rule(lambda op, g: (g * 0.0 + 1.0,))
    g = jax.grad(gk.override(fn, {"sin": sin_rule}))(X)
    np.testing.assert_allclose(g, 7.0 + 11.0 + 1.0)  # only the bare sin is overridden
    named = gk.override(fn, {"fn:my_act": gk.vjp_rule(lambda op, g: (g * 100.0,)), "fn:my_clip": sin_rule})
    np.testing.assert_allclose(jax.grad(named)(X), 100.0 + 1.0 + np.cos(np.asarray(X)), rtol=1e-6)


def test_jitted_functions_match_by_name():
    rule = gk.vjp_rule(lambda op, g: (g * 0.0 + 0.25,))
    fn = lambda x: jnp.sum(jax.nn.softplus(x))
    g = jax.grad(gk.override(fn, {"fn:softplus": rule}))(X)
    np.testing.assert_array_equal(g, 0.25)


def test_rule_runs_once_per_trace_not_per_step():
    calls = []

    def rule(op, g):
        calls.append(1)
        return (g,)

    f = jax.jit(jax.grad(gk.override(lambda x: jnp.sum(jnp.sqrt(x)), {"sqrt": gk.vjp_rule(rule)})))
    for _ in range(5):
        f(X + 1.0)
    assert len(calls) == 1


# --------------------------------------------------------------------------- strict and tables


def test_strict_reports_unmatched_rules_with_near_misses():
    table = {"sqrtt": SAFE_SQRT, "sqrt": SAFE_SQRT}
    f = gk.override(guarded_sqrt, table, strict=True)
    with pytest.raises(gk.GradkitError, match=r"(?s)\[gradkit\].*'sqrtt' \(did you mean 'sqrt'\?\)"):
        f(X)
    gk.override(guarded_sqrt, {"sqrt": SAFE_SQRT}, strict=True)(X)  # all matched: fine


def test_strict_sees_ops_inside_control_flow():
    fn = lambda x: jnp.sum(lax.scan(lambda c, z: (c + jnp.sqrt(z), None), 0.0, x)[0])
    gk.override(fn, {"sqrt": SAFE_SQRT}, strict=True)(jnp.arange(3.0))


def test_strict_takes_a_shipped_table_as_one_unit():
    # SAFE has a rule for dozens of ops; a program using one of them is what the user meant.
    gk.override(guarded_sqrt, gk.tables.SAFE, strict=True)(X)
    with pytest.raises(gk.GradkitError, match=r"(?s)^\[gradkit\] override\(.*<lambda>, strict=True\): checked 1 "
                       r"shipped table unit as a whole \(gk\.tables\.SAFE: .*gk\.tables\.SAFE: none of its \d+ "
                       r"rules matches an op of the program \(its ops: reduce_sum, sin\)"):
        gk.override(lambda x: jnp.sum(jnp.sin(x)), gk.tables.SAFE, strict=True)(X)


def test_ten_thousand_rules():
    table = gk.RuleTable({f"no_such_op_{i}": SAFE_SQRT for i in range(10_000)}) | {"sqrt": SAFE_SQRT}
    assert len(table) == 10_001
    g = jax.grad(gk.override(guarded_sqrt, table))(X)
    assert np.isfinite(g).all() and g[0, 0] == 0.0


def test_decorator_form():
    @gk.override({"sqrt": SAFE_SQRT})
    def f(x):
        return guarded_sqrt(x)

    assert jax.grad(f)(X)[0, 0] == 0.0
    assert "with 1 rules" in repr(f)


def test_rewritten_program_is_inspectable():
    f = gk.override(guarded_sqrt, {"sqrt": SAFE_SQRT})
    text = str(f.rewritten_jaxpr(X))
    assert "custom_vjp_call" in text and "gradkit_rule[sqrt]" in text


def test_override_bad_arguments():
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override expects a RuleTable"):
        gk.override(guarded_sqrt, [("sqrt", SAFE_SQRT)])
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override expects a function"):
        gk.override(3, {})
    with pytest.raises(gk.GradkitError, match="needs a rule table"):
        gk.override(guarded_sqrt)


# --------------------------------------------------------------------------- jax.jit's ahead-of-time stages


def _costs(compiled):
    ca = compiled.cost_analysis()
    return ca[0] if isinstance(ca, list) else ca  # a list of one dict on some JAX versions


def test_lower_compiles_the_rewritten_program_bit_for_bit():
    fixed = gk.override(guarded_sqrt, {"sqrt": SAFE_SQRT})
    lowered = fixed.lower(X)
    compiled = lowered.compile()
    assert isinstance(lowered, jax.stages.Lowered) and isinstance(compiled, jax.stages.Compiled)
    np.testing.assert_array_equal(compiled(X), fixed(X))
    np.testing.assert_array_equal(compiled(X), jax.jit(guarded_sqrt)(X))
    assert fixed.cache_info().traces == 1  # lower, compile and the call share one trace
    assert "stablehlo.sqrt" in lowered.as_text()
    plain = _costs(jax.jit(guarded_sqrt).lower(X).compile())
    costs = _costs(compiled)
    assert costs["flops"] == plain["flops"] > 0 and costs["transcendentals"] == plain["transcendentals"]


def test_trace_is_the_rewritten_program_and_lowers_to_its_gradient():
    fixed = gk.override(guarded_sqrt, {"sqrt": SAFE_SQRT})
    traced = fixed.trace(X)
    assert isinstance(traced, jax.stages.Traced)
    assert "custom_vjp_call" in str(traced.jaxpr)
    assert "custom_vjp_call" not in str(jax.jit(guarded_sqrt).trace(X).jaxpr)
    np.testing.assert_array_equal(traced.lower().compile()(X), jax.jit(guarded_sqrt)(X))
    # what a user lowers to see the rule: the gradient
    g, plain = (jax.jit(jax.grad(f)).lower(X).compile()(X) for f in (fixed, guarded_sqrt))
    assert g[0, 0] == 0.0 and np.isnan(plain[0, 0])
    np.testing.assert_array_equal(g[X > 0], plain[X > 0])


def test_stages_take_static_arguments_as_a_call_does():
    def fn(x, c, *, mode):
        return jnp.sum(x / c) if mode == "sum" else x / c

    fixed = gk.override(fn, {"sqrt": SAFE_SQRT})
    for c in (2.0, 0.0, -0.0):  # 0.0 and -0.0 are equal in Python and different programs (inf vs -inf)
        for mode in ("sum", "each"):
            compiled = fixed.lower(X, c, mode=mode).compile()  # statics are left out of the compiled call
            np.testing.assert_array_equal(compiled(X), fixed(X, c, mode=mode))
            # a fresh jax.jit per value: jax.jit's own cache takes -0.0 for 0.0 (they compare equal)
            np.testing.assert_array_equal(compiled(X), jax.jit(lambda x, c=c, mode=mode: fn(x, c, mode=mode))(X))
    spec = jax.ShapeDtypeStruct(X.shape, X.dtype)  # AOT from a shape alone
    np.testing.assert_array_equal(fixed.lower(spec, 3.0, mode="each").compile()(X), fixed(X, 3.0, mode="each"))
    assert fixed.trace(spec, 3.0, mode="sum").jaxpr.in_avals == [jax.core.ShapedArray(X.shape, X.dtype)]


def test_eval_shape_gives_jax_shape_dtype_structs():
    fixed = gk.override(lambda p, x, label: {"y": jnp.tanh(p["w"] @ x), label: x.sum()}, gk.tables.SAFE)
    p = {"w": jnp.ones((2, 4)), "name": "dense"}  # a string leaf: static, as in a call
    out = fixed.eval_shape(p, jax.ShapeDtypeStruct((4,), jnp.float32), "total")
    assert out == {"y": jax.ShapeDtypeStruct((2,), jnp.float32), "total": jax.ShapeDtypeStruct((), jnp.float32)}
    assert fixed.cache_info().traces == 1


def test_stages_refuse_what_jax_jit_cannot_take_with_gradkit_errors():
    fixed = gk.override(lambda p, n: p["w"] * n, gk.tables.SAFE)
    p = {"w": jnp.ones(3), "act": jnp.tanh}
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override\(.*<lambda>\)\.lower: argument p mixes arrays "
                       r"with a non-array leaf \(p\['act'\] is \w+\)\..*functools\.partial"):
        fixed.lower(p, 2)
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override\(.*<lambda>\)\.trace: argument n \(list\) is "
                       r"not an array and not hashable"):
        fixed.trace({"w": jnp.ones(3)}, [2])
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override\(f\)\.trace: jax\.jit functions of this JAX "
                       r"\(.*\) have no \.trace.*Use \.lower"):
        compat.staged(object(), "trace", "override(f)")
