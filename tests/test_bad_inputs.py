"""Bad-input matrix: every case gets a clear `[gradkit]` error or the right result.

The contract (issue 8): under bad input gradkit raises a `GradkitError` whose
message names the rule, the op and the user's source line, or it does what a
JAX user would expect; never a crash deep inside JAX, never a silently wrong
gradient, never a change to what the program computes. Where JAX's own error
is the right one (control flow on traced values, deleted buffers, grad of a
non-scalar) it surfaces unchanged in type, with a gradkit note where gradkit is
the reason it happens.

Cases already covered by test_validation.py / test_dispatch.py are not repeated.
"""

import contextlib
import functools
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from gradkit._src import compat

X = jnp.array([0.5, 1.0, 2.0], jnp.float32)
THIS_FILE = re.escape(__file__.rsplit("/", 1)[-1])


def loss(x):
    return jnp.sum(jnp.sin(x) * 2.0)  # the line every rule error must point at


LOSS_LINE = loss.__code__.co_firstlineno + 1


def binary_loss(x):
    return jnp.sum(jnp.sin(x) * jnp.cos(x))  # a `mul` with two array inputs


BINARY_LINE = binary_loss.__code__.co_firstlineno + 1


@gk.op("affine")
def affine(params, x):
    return params["w"] * x + params["b"]


def affine_loss(x):
    return jnp.sum(affine({"w": jnp.float32(2.0), "b": jnp.float32(1.0)}, x))  # named-op call line


AFFINE_LINE = affine_loss.__code__.co_firstlineno + 1


@contextlib.contextmanager
def x64():
    """float64 on for a block (jax.enable_x64 since 0.8; jax.experimental before)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # pragma: no cover - older JAX
        from jax.experimental import enable_x64 as enable
    with enable(True):
        yield


def notes(e):
    return str(e) + "\n".join(getattr(e, "__notes__", []))


def hand_sin(rule_fn):
    """``jnp.sin`` as a hand-written jax.custom_vjp carrying ``rule_fn`` (the reference)."""

    @jax.custom_vjp
    def s(x):
        return jnp.sin(x)

    s.defvjp(lambda x: (jnp.sin(x), (x, jnp.sin(x))),
             lambda res, g: tuple(rule_fn(gk.OpView("sin", (res[0],), (res[1],), {}), g)))
    return s


# --------------------------------------------------------------------------- rule return values (VJP)


def _err(rule, fn=loss, x=X, op="sin", jit=False, line=LOSS_LINE, check_line=True):
    g = jax.grad(gk.override(fn, {op: rule}))
    with pytest.raises(gk.GradkitError) as info:
        (jax.jit(g) if jit else g)(x)
    msg = str(info.value)
    assert msg.startswith("[gradkit]"), msg
    assert rule.name in msg and f"op '{op}'" in msg, msg
    if check_line:
        assert re.search(rf"{THIS_FILE}:{line}\b", msg), msg
    return msg


def _raised(rule, exc_type, fn=loss, x=X, op="sin", jit=False, line=LOSS_LINE):
    """An exception from inside a rule keeps its type; a [gradkit] note names the rule, op and line."""
    g = jax.grad(gk.override(fn, {op: rule}))
    with pytest.raises(exc_type) as info:
        (jax.jit(g) if jit else g)(x)
    assert not isinstance(info.value, gk.GradkitError)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "[gradkit] raised inside" in notes and rule.name in notes and f"op '{op}'" in notes, notes
    assert re.search(rf"{THIS_FILE}:{line}\b", notes), notes
    return f"{info.value}\n{notes}"


def gen_rule(op, g):
    return (c for c in (g,))


BAD_VJP = [
    # (id, rule fn, expected message fragment, extra kwargs for _err)
    ("count_zero", lambda op, g: (), r"returned 0 cotangents for 1 inputs", {}),
    ("count_one_for_binary", lambda op, g: (g,), r"returned 1 cotangents for 2 inputs",
     dict(fn=binary_loss, op="mul", line=BINARY_LINE)),
    ("count_three_for_binary", lambda op, g: (g, g, g), r"returned 3 cotangents for 2 inputs",
     dict(fn=binary_loss, op="mul", line=BINARY_LINE)),
    ("bare_value_for_binary", lambda op, g: g, r"must return a tuple with one cotangent per input \(2 here\)",
     dict(fn=binary_loss, op="mul", line=BINARY_LINE)),
    ("list_of_two_for_one", lambda op, g: [g, g], r"structure PyTreeDef\(\(\*, \*\)\) but the input has PyTreeDef\(\*\)", {}),
    ("nested_tuple", lambda op, g: ((g,),), r"structure PyTreeDef\(\(\*,\)\)", {}),
    ("named_op_wrong_dict_keys", lambda op, g: ({"w": None, "c": None}, g), r"structure",
     dict(fn=affine_loss, op="affine", line=AFFINE_LINE)),
    ("named_op_leaf_for_subtree", lambda op, g: (jnp.float32(1.0), g), r"leaf .* where the input has a subtree",
     dict(fn=affine_loss, op="affine", line=AFFINE_LINE)),
    ("shape_broadcastable", lambda op, g: (g[None],), r"shape \(1, 3\) for leaf 0, expected \(3,\)", {}),
    ("shape_scalar_array", lambda op, g: (jnp.sum(g),), r"shape \(\) for leaf 0, expected \(3,\)", {}),
    ("shape_transposed", lambda op, g: (g.T,), r"shape \(3, 2\) for leaf 0, expected \(2, 3\)",
     dict(x=jnp.ones((2, 3), jnp.float32))),
    ("shape_zero_size", lambda op, g: (jnp.zeros((0,), jnp.float32),), r"shape \(0,\) for leaf 0, expected \(3, 0\)",
     dict(x=jnp.ones((3, 0), jnp.float32))),
    ("dtype_int", lambda op, g: (g.astype(jnp.int32),), r"dtype int32 .* expected float32", {}),
    ("dtype_bool", lambda op, g: (g > 0,), r"dtype bool .* expected float32", {}),
    ("dtype_complex_for_real", lambda op, g: (g.astype(jnp.complex64),), r"dtype complex64 .* expected float32", {}),
    ("dtype_bf16_for_f32", lambda op, g: (g.astype(jnp.bfloat16),), r"dtype bfloat16 .* \.astype\(float32\)", {}),
    ("python_bool", lambda op, g: (True,), r"returned a Python bool", dict(x=jnp.float32(1.0))),
    ("python_complex_for_real", lambda op, g: (1j,), r"Python complex .* imaginary part would be lost",
     dict(x=jnp.float32(1.0))),
    ("string", lambda op, g: ("oops",), r"returned str as the cotangent", {}),
    ("object", lambda op, g: (object(),), r"returned object as the cotangent", {}),
    ("generator", gen_rule, r"returned generator as the cotangent", {}),
    ("numpy_f64_for_f32", lambda op, g: (np.ones(3),), r"dtype float64 .* expected float32", {}),
    ("numpy_wrong_shape", lambda op, g: (np.ones(4, np.float32),), r"shape \(4,\) for leaf 0, expected \(3,\)", {}),
    ("numpy_scalar_for_array", lambda op, g: (np.float32(1.0),), r"shape \(\) for leaf 0, expected \(3,\)", {}),
    ("numpy_object_array", lambda op, g: (np.array([None, 1, 2], dtype=object),), r"dtype object", {}),
]


@pytest.mark.parametrize("case", BAD_VJP, ids=[c[0] for c in BAD_VJP])
def test_bad_vjp_rule_return(case):
    name, fn, pattern, kw = case
    msg = _err(gk.vjp_rule(fn, name=f"bad_{name}"), **kw)
    assert re.search(pattern, msg), msg


def test_rule_with_the_wrong_arity_is_pythons_type_error_with_a_note():
    msg = _raised(gk.vjp_rule(lambda g: g, name="one_arg"), TypeError)
    assert "positional argument" in msg


def test_bad_rule_error_under_jit_names_the_same_line():
    msg = _err(gk.vjp_rule(lambda op, g: (g[None],), name="bcast"), jit=True)
    assert "shape (1, 3)" in msg


def test_f64_cotangent_for_f32_input_under_x64():
    with x64():
        msg = _err(gk.vjp_rule(lambda op, g: (g.astype(jnp.float64),), name="widened"))
    assert "dtype float64" in msg and "expected float32" in msg


# --------------------------------------------------------------------------- accepted on purpose


def test_weakly_typed_scalar_takes_the_input_dtype():
    # jnp.asarray(0.5) is weakly typed: no dtype opinion, like the Python float 0.5.
    f = gk.override(lambda x: jnp.sin(x), {"sin": gk.vjp_rule(lambda op, g: (jnp.asarray(0.5),))})
    g = jax.grad(f)(jnp.float32(1.0))
    assert g.dtype == jnp.float32 and float(g) == 0.5
    with x64():  # weak float64 for a float32 input: still cast, not rejected
        g = jax.grad(f)(jnp.float32(1.0))
    assert g.dtype == jnp.float32 and float(g) == 0.5
    f16 = jax.grad(f)(jnp.float16(1.0))
    assert f16.dtype == jnp.float16 and float(f16) == 0.5


def test_weakly_typed_complex_for_real_input_is_rejected():
    f = gk.override(lambda x: jnp.sin(x), {"sin": gk.vjp_rule(lambda op, g: (jnp.asarray(1j),), name="cplx")})
    with pytest.raises(gk.GradkitError, match=r"dtype complex64 .* expected float32"):
        jax.grad(f)(jnp.float32(1.0))


def test_python_int_for_scalar_and_list_for_tuple_are_accepted():
    f = gk.override(lambda x: jnp.sin(x), {"sin": gk.vjp_rule(lambda op, g: [2])})
    assert float(jax.grad(f)(jnp.float32(1.0))) == 2.0


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_nan_or_inf_from_a_rule_is_the_gradient_not_masked(bad, maybe_jit):
    # gradkit checks types, never values (a value check would need a host sync
    # under jit): a rule's NaN is the gradient, exactly where the rule put it.
    rule = gk.vjp_rule(lambda op, g: (jnp.where(op.inputs[0] > 1.5, bad, g),))
    f = gk.override(loss, {"sin": rule})
    g = np.asarray(maybe_jit(jax.grad(f))(X))
    np.testing.assert_array_equal(g, [2.0, 2.0, bad])
    np.testing.assert_array_equal(maybe_jit(f)(X), jax.jit(loss)(X))  # forward untouched


# --------------------------------------------------------------------------- rules that raise


def test_gradkit_error_raised_inside_a_rule_passes_through_unchanged():
    def rule(op, g):
        raise gk.GradkitError("my own message")

    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] my own message\b"):
        jax.grad(gk.override(loss, {"sin": gk.vjp_rule(rule)}))(X)


def test_rule_that_raises_under_jit():
    def broken(op, g):
        return g / {}["missing"]

    msg = _raised(gk.vjp_rule(broken), KeyError, jit=True)
    assert "missing" in msg and "float32[3]" in msg


def test_jvp_rule_that_raises_names_rule_op_and_line():
    def broken_jvp(op, t):
        raise ValueError("bad tangent")

    with pytest.raises(ValueError, match="bad tangent") as info:
        jax.jvp(gk.override(loss, {"sin": gk.jvp_rule(broken_jvp)}), (X,), (X,))
    msg = "\n".join(info.value.__notes__)
    assert "broken_jvp" in msg and "op 'sin'" in msg and f"{__file__.rsplit('/', 1)[-1]}:{LOSS_LINE}" in msg
    assert msg.startswith("[gradkit] raised inside") and "incoming tangents" in msg


@pytest.mark.parametrize("kind", ["if", "float", "numpy"])
def test_python_control_flow_in_a_rule_under_jit_gets_a_hint(kind):
    def rule(op, g):
        if kind == "if":
            return (g if jnp.sum(g) > 0 else -g,)
        if kind == "float":
            return (g * float(jnp.sum(g)),)
        return (jnp.asarray(np.asarray(g)),)

    msg = _raised(gk.vjp_rule(rule, name="pythonic"), compat.CONCRETIZATION_ERRORS, jit=True)
    assert "Rules are traced" in msg and "jnp.where" in msg


def test_python_control_flow_in_a_rule_is_jaxs_error_with_a_note():
    # An overridden function is a jitted function: its rules are traced (like a
    # custom_vjp bwd inside jax.jit), even under an eager jax.grad.
    rule = gk.vjp_rule(lambda op, g: (g if float(jnp.sum(g)) > 0 else -g,), name="branchy")
    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        jax.grad(gk.override(loss, {"sin": rule}))(X)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "[gradkit]" in notes and "branchy" in notes and "op 'sin'" in notes and "jnp.where" in notes


# --------------------------------------------------------------------------- JVP rules and modes


@pytest.mark.parametrize("tangent_fn", [lambda t: t ** 2, lambda t: t * t, lambda t: jnp.clip(t, -1.0, 1.0),
                                        jnp.sin], ids=["square", "product", "clip", "sin"])
@pytest.mark.parametrize("mode", ["grad", "jvp"])
def test_nonlinear_jvp_rule_is_a_clear_error(tangent_fn, mode):
    # Without the check, reverse mode fails deep in JAX's transposition
    # ("Transpose rule for 'integer_pow' not implemented", a bare AssertionError).
    rule = gk.jvp_rule(lambda op, t: tangent_fn(t[0]) * jnp.cos(op.inputs[0]), name="nonlinear")
    f = gk.override(loss, {"sin": rule})
    with pytest.raises(gk.GradkitError) as info:
        jax.grad(f)(X) if mode == "grad" else jax.jvp(f, (X,), (X,))
    msg = str(info.value)
    assert "nonlinear" in msg and "op 'sin'" in msg and "not linear in its tangents" in msg
    assert re.search(rf"{THIS_FILE}:{LOSS_LINE}\b", msg), msg


def test_linear_jvp_rule_with_where_passes_the_linearity_check(maybe_jit):
    rule = gk.jvp_rule(lambda op, t: jnp.where(op.inputs[0] > 1.0, t[0], 0.0) * 3.0)
    g = maybe_jit(jax.grad(gk.override(loss, {"sin": rule})))(X)
    np.testing.assert_array_equal(g, [0.0, 0.0, 6.0])


def test_jvp_rule_wrong_dtype_tangent():
    rule = gk.jvp_rule(lambda op, t: t[0].astype(jnp.float16), name="halved")
    with pytest.raises(gk.GradkitError, match=r"halved for op 'sin'.*output tangent of dtype float16"):
        jax.jvp(gk.override(loss, {"sin": rule}), (X,), (X,))


@pytest.mark.parametrize("where", ["top_level", "inside_scan"])
def test_vjp_rule_under_forward_mode_is_a_clear_error(where, maybe_jit):
    rule = gk.vjp_rule(lambda op, g: (g * 2.0,), name="reverse_only")
    if where == "top_level":
        fn = loss
    else:
        def fn(x):
            return jnp.sum(lax.scan(lambda c, z: (c + jnp.sin(z), None), jnp.zeros_like(x), jnp.stack([x, x]))[0])
    f = gk.override(fn, {"sin": rule})
    with pytest.raises(gk.GradkitError, match=r"(?s)^\[gradkit\].*(reverse_only|'sin').*jvp_rule"):
        jax.jvp(f, (X,), (X,))
    assert np.isfinite(maybe_jit(jax.grad(f))(X)).all()  # reverse mode is fine


def test_vjp_rule_under_jit_of_jvp_is_jax_own_error_at_the_op_line():
    # Under jax.jit(jax.jvp(...)) JAX defers this error to compilation, after
    # gradkit has run; its message and the "preceding stack trace" (the op's
    # source line) still say what happened.
    f = gk.override(loss, {"sin": gk.vjp_rule(lambda op, g: (g * 2.0,))})
    with pytest.raises(TypeError, match="forward-mode autodiff .* custom_vjp") as info:
        jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(X)
    cause = info.value.__cause__ or info.value.__context__
    assert cause is not None
    assert f'test_bad_inputs.py", line {LOSS_LINE}' in "".join(traceback.format_exception(cause))


# --------------------------------------------------------------------------- rules with side effects


def test_rule_side_effects_run_once_per_trace_under_jit(capsys):
    # Decision: a rule is Python run while JAX builds the backward pass, like a
    # jax.custom_vjp bwd: once per compilation under jit (not once per step).
    calls = []

    def noisy(op, g):
        print("rule ran")
        calls.append(1)
        return (g,)

    step = jax.jit(jax.grad(gk.override(loss, {"sin": gk.vjp_rule(noisy)})))
    for i in range(4):
        step(X + i)
    assert len(calls) == 1 and capsys.readouterr().out.count("rule ran") == 1


def test_rule_python_runs_at_trace_time_once_per_signature():
    calls = []

    def counting(op, g):
        calls.append(1)
        return (g,)

    g = jax.jit(jax.grad(gk.override(loss, {"sin": gk.vjp_rule(counting)})))
    for i in range(3):
        g(X + i)
    assert len(calls) == 1  # traced once; jax.debug.print (below) is the way to act every step


def test_jax_debug_print_in_a_rule_runs_every_step(capsys):
    def rule(op, g):
        jax.debug.print("g_sum={s}", s=jnp.sum(g))
        return (g,)

    step = jax.jit(jax.grad(gk.override(loss, {"sin": gk.vjp_rule(rule)})))
    for i in range(3):
        step(X + i)
    jax.effects_barrier()
    assert capsys.readouterr().out.count("g_sum=6.0") == 3


def test_rule_storing_a_traced_value_globally_gets_jax_leak_error():
    leaked = []

    def leaky(op, g):
        leaked.append(g)
        return (g,)

    jax.jit(jax.grad(gk.override(loss, {"sin": gk.vjp_rule(leaky)})))(X)
    with pytest.raises(jax.errors.UnexpectedTracerError):
        leaked[0] + 1.0


# --------------------------------------------------------------------------- rule tables


def test_string_rule_in_a_table_is_a_clear_error():
    # a string names a library rule (as in RuleTable.from_dict); a misspelt one is a clear error
    assert gk.RuleTable({"sqrt": "safe"}) == gk.RuleTable.from_dict({"sqrt": "safe"})
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] table entry 'sqrt': unknown rule 'saf' "
                                              r"\(did you mean 'safe'\?\)"):
        gk.RuleTable({"sqrt": "saf"})


def test_rule_instance_in_the_table_with_non_callable_fn():
    with pytest.raises(gk.GradkitError, match=r"expected a callable"):
        gk.Rule(fn=None)  # type: ignore[arg-type]
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override expects a RuleTable"):
        gk.override(loss, gk.vjp_rule(lambda op, g: g))  # a rule where the table goes


def test_two_named_ops_sharing_a_name_are_both_matched():
    # Decision: an op name is a *type* of op (like TF's gradient_override_map):
    # every function registered under it is matched by the one rule.
    @gk.op("shared_name")
    def a(x):
        return jnp.sin(x)

    @gk.op("shared_name")
    def b(x):
        return jnp.cos(x)

    f = gk.override(lambda x: jnp.sum(a(x) + b(x)), {"shared_name": gk.vjp_rule(lambda op, g: (g * 10.0,))})
    np.testing.assert_array_equal(jax.grad(f)(X), 20.0)


def test_merging_tables_with_the_same_name_keeps_the_right_one():
    left = gk.RuleTable({"sin": gk.vjp_rule(lambda op, g: (g * 0.0,))})
    right = gk.RuleTable({"sin": gk.vjp_rule(lambda op, g: (g * 3.0,))})
    np.testing.assert_array_equal(jax.grad(gk.override(loss, left | right))(X), 6.0)
    np.testing.assert_array_equal(jax.grad(gk.override(loss, right | left))(X), 0.0)


@pytest.mark.parametrize("name", ["jnp.sin", "Sin", "sine", "lax.sin"])
def test_names_of_no_op_are_ignored_unless_strict(name, maybe_jit):
    table = {name: gk.vjp_rule(lambda op, g: (g * 0.0,))}
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(loss, table)))(X), jax.grad(loss)(X))
    with pytest.raises(gk.GradkitError, match=rf"(?s)'{re.escape(name)}' \(did you mean 'sin'\?\)"):
        gk.override(loss, table, strict=True)(X)


def test_name_of_an_op_hidden_inside_a_custom_jvp_function():
    # jax.nn.relu is a custom_jvp function: its body's `max` keeps the user's
    # (JAX's) rule; strict mode says the name matched nothing.
    fn = lambda x: jnp.sum(jax.nn.relu(x - 1.0))
    table = {"max": gk.vjp_rule(lambda op, g: (g * 0.0, g * 0.0))}
    np.testing.assert_array_equal(jax.grad(gk.override(fn, table))(X), jax.grad(fn)(X))
    with pytest.raises(gk.GradkitError, match=r"'max'.*\n.*Ops in the program: .*relu"):
        gk.override(fn, table, strict=True)(X)


# --------------------------------------------------------------------------- Python control flow in the function


def branchy(x):
    if x > 0:  # Python control flow on a traced value
        return jnp.sin(x)
    return x


@pytest.mark.parametrize("call", ["eager", "jit", "grad"])
def test_python_if_on_a_traced_argument_keeps_jax_error_with_a_gradkit_note(call):
    f = gk.override(branchy, {"sin": gk.vjp_rule(lambda op, g: (g,))})
    run = {"eager": f, "jit": jax.jit(f), "grad": jax.grad(f)}[call]
    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        run(jnp.float32(1.0))
    text = notes(info.value)
    assert "branchy" in text and "dispatch.py" not in str(info.value)  # names the user's function
    if call == "eager":  # the gradkit note explains why an eager call fails
        assert "[gradkit] gk.override traces branchy" in text and "dyn[0] is x" in text
        assert "lax.cond" in text


@pytest.mark.parametrize("kind", ["int", "numpy"])
def test_other_concretizations_get_the_note(kind):
    def fn(params, n):
        w = params["w"]
        return jnp.ones(int(w)) if kind == "int" else jnp.asarray(np.asarray(w))

    with pytest.raises((jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError,
                        jax.errors.TracerArrayConversionError)) as info:
        gk.override(fn, {})({"w": jnp.float32(3.0)}, 2)
    assert "dyn[0] is params['w']" in notes(info.value)


def test_python_if_on_a_python_number_works_it_is_static():
    f = gk.override(lambda x, n: jnp.sin(x) if n > 0 else x, {"sin": gk.vjp_rule(lambda op, g: (g * 5.0,))})
    assert float(jax.grad(f)(jnp.float32(1.0), 1)) == 5.0
    assert float(jax.grad(f)(jnp.float32(1.0), -1)) == 1.0


def test_python_if_inside_a_named_op_gets_a_note():
    @gk.op("branchy_op")
    def op_fn(x):
        return x if x > 0 else -x

    with pytest.raises(jax.errors.TracerBoolConversionError) as info:
        op_fn(jnp.float32(1.0))
    assert "[gradkit] named op 'branchy_op'" in notes(info.value)


# --------------------------------------------------------------------------- static arguments


class _Unhashable:
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other):
        return isinstance(other, _Unhashable)


@pytest.mark.parametrize("bad", [{1, 2}, _Unhashable(), (1.0, {"k": {2}})],
                         ids=["set", "eq_no_hash", "set_deep_in_a_pytree"])
def test_unhashable_static_arguments(bad):
    f = gk.override(lambda x, cfg: jnp.sum(x), {})
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override\(.*of type (set|_Unhashable) .*not hashable"):
        f(X, bad)


def test_hashable_non_array_statics_work_and_key_the_cache():
    calls = []

    def fn(x, mode, act, none):
        calls.append((mode, act))
        assert none is None
        return act(x) if mode == "act" else x

    f = gk.override(fn, {"sin": gk.vjp_rule(lambda op, g: (g * 4.0,))})
    assert float(jax.grad(lambda x: f(x, "act", jnp.sin, None))(jnp.float32(0.0))) == 4.0
    f(X, "act", jnp.sin, None), f(X, "act", jnp.sin, None), f(X, "id", jnp.sin, None)
    assert calls == [("act", jnp.sin), ("act", jnp.sin), ("id", jnp.sin)]  # one scalar trace, one per new static


def test_equal_statics_of_different_types_do_not_share_a_program():
    # 1 == 1.0 == True in Python; the programs differ (int / float / bool values).
    f = gk.override(lambda x, s: (x, jnp.asarray(s)), {})
    assert f(X, 1)[1].dtype == jnp.int32
    assert f(X, True)[1].dtype == jnp.bool_
    assert f(X, 1.0)[1].dtype == jnp.float32
    assert f.trace_count == 3


def test_negative_zero_static_is_not_served_the_positive_zero_program():
    f = gk.override(lambda x, s: x / s, {})
    assert np.all(np.asarray(f(X, 0.0)) == np.inf)
    assert np.all(np.asarray(f(X, -0.0)) == -np.inf)


def test_nan_static_hits_one_cache_entry():
    f = gk.override(lambda x, s: x + s, {})
    for _ in range(3):
        assert np.isnan(f(X, float("nan"))).all()
    assert f.trace_count == 1


def test_named_op_keyword_statics_of_different_types_do_not_share_a_program():
    @gk.op("typed_kw")
    def scale(x, *, s):
        return x * 1.0, jnp.asarray(s)

    assert scale(X, s=1)[1].dtype == jnp.int32
    assert scale(X, s=True)[1].dtype == jnp.bool_
    assert scale(X, s=1.0)[1].dtype == jnp.float32
    assert not np.signbit(scale(X, s=0.0)[1]) and np.signbit(scale(X, s=-0.0)[1])


def test_python_number_statics_equal_jit_with_static_argnums_bit_for_bit():
    # Python numbers are static (compile-time constants): the forward equals
    # jax.jit(f, static_argnums=...) bit for bit; `x ** 2.0` stays an exact square.
    fn = lambda x, p, s: jnp.tanh(x ** p) * s
    xs = jnp.linspace(-2.0, 2.0, 9, dtype=jnp.float32)
    f = gk.override(fn, {"tanh": gk.vjp_rule(lambda op, g: (g,))})
    np.testing.assert_array_equal(f(xs, 2.0, 0.3), jax.jit(fn, static_argnums=(1, 2))(xs, 2.0, 0.3))
    np.testing.assert_array_equal(f(xs, 2.0, 0.3), fn(xs, 2.0, 0.3))


# --------------------------------------------------------------------------- input dtypes and shapes


def _rule_sin(op, g):
    return (g * 2.0 * jnp.cos(op.inputs[0]),)


SIN2 = gk.vjp_rule(_rule_sin)

DTYPE_CASES = [
    # id, function of (sine, x), input, differentiable
    ("int32", lambda s, x: s(x.astype(jnp.float32)) * 2.0, jnp.arange(4, dtype=jnp.int32), False),
    ("uint8", lambda s, x: s(x.astype(jnp.float32)), jnp.arange(4, dtype=jnp.uint8), False),
    ("bool", lambda s, x: jnp.where(x, s(jnp.ones(x.shape)), 0.0), jnp.array([True, False, True]), False),
    ("bf16", lambda s, x: s(x) * x, jnp.linspace(-1, 1, 5, dtype=jnp.bfloat16), True),
    ("f16", lambda s, x: s(x) * x, jnp.linspace(-1, 1, 5, dtype=jnp.float16), True),
    ("f32_zero_size", lambda s, x: s(x) * x, jnp.ones((0,), jnp.float32), True),
    ("f32_zero_size_2d", lambda s, x: s(x) + 1.0, jnp.ones((3, 0), jnp.float32), True),
    ("f32_scalar", lambda s, x: s(x) * x, jnp.float32(0.7), True),
]


@pytest.mark.parametrize("case", DTYPE_CASES, ids=[c[0] for c in DTYPE_CASES])
def test_input_dtypes_forward_and_gradients(case, maybe_jit):
    name, template, x, differentiable = case
    fn = functools.partial(template, jnp.sin)
    f = gk.override(fn, {"sin": SIN2})
    out, ref = maybe_jit(f)(x), jax.jit(fn)(x)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    np.testing.assert_array_equal(out, ref)
    scalar = lambda h: lambda x: jnp.sum(h(x)).astype(jnp.float32)
    if not differentiable:
        # Same error as plain JAX for an integer/boolean argument under grad...
        with pytest.raises(TypeError, match="grad requires real- or complex-valued inputs"):
            jax.grad(scalar(f))(x)
        # ...and float0 zeros with allow_int, like plain JAX.
        g = maybe_jit(jax.grad(scalar(f), allow_int=True))(x)
        assert g.dtype == jax.dtypes.float0 and g.shape == x.shape
        return
    np.testing.assert_array_equal(maybe_jit(jax.grad(scalar(gk.override(fn, {}))))(x),
                                  maybe_jit(jax.grad(scalar(fn)))(x))
    hand = functools.partial(template, hand_sin(_rule_sin))
    got, want = maybe_jit(jax.grad(scalar(f)))(x), maybe_jit(jax.grad(scalar(hand)))(x)
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(got, want)


def test_float64_inputs(maybe_jit):
    with x64():
        x = jnp.linspace(-1.0, 1.0, 5, dtype=jnp.float64)
        f = gk.override(loss, {"sin": SIN2})
        np.testing.assert_array_equal(maybe_jit(f)(x), jax.jit(loss)(x))
        g = maybe_jit(jax.grad(f))(x)
        assert g.dtype == jnp.float64
        np.testing.assert_array_equal(g, maybe_jit(jax.grad(lambda x: jnp.sum(hand_sin(_rule_sin)(x) * 2.0)))(x))


def test_complex_inputs_follow_jax_custom_vjp_convention(maybe_jit):
    # Decision: complex is supported; a rule receives the cotangent JAX gives a
    # jax.custom_vjp bwd and returns what that bwd would (no extra conjugation).
    z = jnp.array([1.0 + 1.0j, -0.5 + 2.0j], jnp.complex64)
    fn = lambda z: jnp.sum(jnp.sin(z))
    f = gk.override(fn, {"sin": SIN2})
    np.testing.assert_array_equal(maybe_jit(f)(z), jax.jit(fn)(z))
    hand = lambda z: jnp.sum(hand_sin(_rule_sin)(z))
    got = maybe_jit(jax.grad(f, holomorphic=True))(z)
    np.testing.assert_array_equal(got, maybe_jit(jax.grad(hand, holomorphic=True))(z))
    np.testing.assert_allclose(got, 2.0 * jnp.cos(z), rtol=1e-6)
    # Real-valued loss of a complex input (the usual case): same as the reference.
    real = lambda z: jnp.real(jnp.sum(jnp.sin(z) * jnp.conj(z)))
    real_hand = lambda z: jnp.real(jnp.sum(hand_sin(_rule_sin)(z) * jnp.conj(z)))
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(real, {"sin": SIN2})))(z),
                                  maybe_jit(jax.grad(real_hand))(z))
    np.testing.assert_array_equal(maybe_jit(jax.grad(gk.override(real, {})))(z), maybe_jit(jax.grad(real))(z))


def test_complex_rule_returning_real_cotangent_is_rejected():
    rule = gk.vjp_rule(lambda op, g: (jnp.real(g),), name="realified")
    with pytest.raises(gk.GradkitError, match=r"realified .*dtype float32.*expected complex64"):
        jax.grad(gk.override(lambda z: jnp.sum(jnp.sin(z)), {"sin": rule}), holomorphic=True)(
            jnp.array([1.0 + 1.0j], jnp.complex64))


@pytest.mark.parametrize("arg", [1.0, "weak_array", "strong_array", "numpy_scalar"])
def test_weak_typed_scalars_keep_dtype_and_weak_type(arg, maybe_jit):
    x = {1.0: 1.0, "weak_array": jnp.asarray(1.0), "strong_array": jnp.float32(1.0),
         "numpy_scalar": np.float32(1.0)}[arg]
    fn = lambda x: jnp.sin(x) * 2.0
    f = gk.override(fn, {"sin": SIN2})
    out, ref = maybe_jit(f)(x), jax.jit(fn)(x)
    assert (out.dtype, out.weak_type) == (ref.dtype, ref.weak_type)
    np.testing.assert_array_equal(out, ref)
    g = maybe_jit(jax.grad(f))(x)
    assert float(g) == pytest.approx(4.0 * np.cos(1.0), rel=1e-6)


def test_prng_key_inputs():
    fn = lambda key, x: jnp.sum(jax.random.normal(key, x.shape) * jnp.sin(x))
    f = gk.override(fn, {"sin": SIN2})
    for key in (jax.random.key(0), jax.random.PRNGKey(0)):
        np.testing.assert_array_equal(f(key, X), jax.jit(fn)(key, X))
        g = jax.grad(lambda x: f(key, x))(X)
        np.testing.assert_allclose(g, 2.0 * np.asarray(jax.random.normal(key, X.shape)) * np.cos(X), rtol=1e-6)


# --------------------------------------------------------------------------- donated buffers


def test_donated_buffers_donate_through_an_outer_jit():
    # Decision: an eager override call never donates (like jax.jit without
    # donate_argnums); to donate, wrap it: the rewritten program is inlined.
    fn = lambda x: jnp.sin(x) * 2.0
    step = jax.jit(gk.override(fn, {"sin": SIN2}), donate_argnums=0)
    x = X + 0.0
    out = step(x)
    np.testing.assert_array_equal(out, jax.jit(fn)(X))
    assert x.is_deleted()
    # Using the donated array again: JAX's own error, as with jax.jit (its exact
    # type depends on JAX's dispatch path: RuntimeError or ValueError).
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        gk.override(fn, {"sin": SIN2})(x)
    with pytest.raises((RuntimeError, ValueError), match="deleted"):
        jax.jit(fn)(x)


def test_eager_call_does_not_donate():
    x = X + 0.0
    gk.override(lambda x: jnp.sin(x), {"sin": SIN2})(x)
    assert not x.is_deleted()


# --------------------------------------------------------------------------- outputs


OUTPUTS = {"none": lambda x: None, "nested_empty": lambda x: ((), {}, [None], {"a": ()}),
           "python_constant": lambda x: 1.5, "identity": lambda x: x,
           "mixed": lambda x: {"y": jnp.sin(x), "empty": (), "n": None}}


@pytest.mark.parametrize("out", list(OUTPUTS))
def test_unusual_outputs_match_jit(out, maybe_jit):
    fn = OUTPUTS[out]
    got, ref = maybe_jit(gk.override(fn, {"sin": SIN2}))(X), jax.jit(fn)(X)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert (a.dtype, a.weak_type) == (b.dtype, b.weak_type)
        np.testing.assert_array_equal(a, b)


def test_grad_of_a_function_returning_none_is_jax_own_error():
    with pytest.raises(TypeError) as ours:
        jax.grad(gk.override(lambda x: None, {}))(X)
    with pytest.raises(TypeError) as plain:
        jax.grad(lambda x: None)(X)
    assert str(ours.value) == str(plain.value)


def test_non_jax_output_names_the_users_function():
    def returns_text(x):
        return jnp.sin(x), "label"

    with pytest.raises(TypeError, match=r"returns_text .* not a valid JAX type"):
        gk.override(returns_text, {})(X)


def test_no_arguments_and_empty_pytree_arguments():
    fn = lambda *args: jnp.sin(jnp.arange(3.0))
    f = gk.override(fn, {"sin": SIN2})
    np.testing.assert_array_equal(f(), jax.jit(fn)())
    np.testing.assert_array_equal(f({}, (), []), jax.jit(fn)({}, (), []))


# --------------------------------------------------------------------------- TOML / dict configs

BAD_TOML = [
    # (id, TOML text, expected message fragment)
    ("unterminated_string", 'sqrt = "safe\n', r"is not valid TOML"),
    ("missing_value", "sqrt = \n", r"is not valid TOML"),
    ("duplicate_key", 'sqrt = "safe"\nsqrt = "stable"\n', r"is not valid TOML"),
    ("unknown_rule_near_miss", 'sqrt = "saf"\n', r"unknown rule 'saf' \(did you mean 'safe'\?\)"),
    ("code_dotted_path", 'sqrt = "os.system"\n', r"unknown rule 'os.system'. Valid rules: safe"),
    ("code_expression", "sqrt = {rule = \"__import__('os').system('true')\"}\n", r"unknown rule"),
    ("code_module_colon", 'sqrt = "test_bad_inputs:_config_sentinel"\n', r"unknown rule"),
    ("code_in_parameter", 'sqrt = {rule = "safe", op = "os.system"}\n', r"has no entry for op 'os.system'"),
    ("param_string_for_float", 'log = {rule = "clamped_log", eps = "1e-30"}\n', r"`eps` .* must be a number, got '1e-30' \(str\)"),
    ("param_bool_for_float", 'log = {rule = "clamped_log", eps = true}\n', r"must be a number, got True \(bool\)"),
    ("param_array_for_float", 'log = {rule = "clamped_log", eps = [1e-30]}\n', r"must be a number, got \[1e-30\] \(list\)"),
    ("param_datetime", 'log = {rule = "clamped_log", eps = 1979-05-27T07:32:00Z}\n', r"must be a number, got datetime"),
    ("param_negative", 'log = {rule = "clamped_log", eps = -1.0}\n', r"must be a finite number > 0"),
    ("param_nan", 'log = {rule = "clamped_log", eps = nan}\n', r"is NaN"),
    ("param_unknown", 'log = {rule = "clamped_log", epsilon = 1e-30}\n', r"has no parameter `epsilon`. Valid parameters: `eps`"),
    ("param_missing_required", 'sin = {rule = "scale_gradient"}\n', r"needs parameter `scale`"),
    ("clip_bounds_reversed", 'round = {rule = "clip_gradient", lo = 1.0, hi = -1.0}\n', r"needs lo <= hi"),
    ("no_rule_key", "log = {eps = 1e-30}\n", r"has no `rule` key"),
    ("entry_is_int", "log = 3\n", r"expected a rule name \(string\) or a table"),
    ("entry_is_array", 'log = ["safe"]\n', r"expected a rule name \(string\) or a table"),
    ("empty_op_name", '"" = "safe"\n', r"op names must be non-empty strings"),
    ("padded_op_name", '" sqrt" = "safe"\n', r"op names must be non-empty strings"),
]

_SENTINEL = []


def _config_sentinel(*args, **kwargs):  # a config naming this must never call it
    _SENTINEL.append(1)


@pytest.mark.parametrize("case", BAD_TOML, ids=[c[0] for c in BAD_TOML])
def test_bad_toml_config(case, tmp_path):
    import sys

    name, text, pattern = case
    (tmp_path / "warm.toml").write_text('sqrt = "safe"\n')
    gk.RuleTable.from_toml(tmp_path / "warm.toml")  # the config machinery's own lazy imports
    path = tmp_path / "rules.toml"
    path.write_text(text)
    modules = set(sys.modules)
    with pytest.raises(gk.GradkitError) as info:
        gk.RuleTable.from_toml(path)
    msg = str(info.value)
    assert msg.startswith("[gradkit]") and str(path) in msg, msg
    assert re.search(pattern, msg), msg
    assert set(sys.modules) == modules and not _SENTINEL  # nothing imported, nothing called


@pytest.mark.parametrize("kind", ["missing", "directory", "not_utf8"])
def test_unreadable_toml_config(kind, tmp_path):
    path = {"missing": tmp_path / "nope.toml", "directory": tmp_path, "not_utf8": tmp_path / "bin.toml"}[kind]
    if kind == "not_utf8":
        path.write_bytes(b"\xff\xfesqrt = 'safe'")
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\].*(cannot read|not valid|UTF-8|utf-8)"):
        gk.RuleTable.from_toml(path)


@pytest.mark.parametrize("cfg", [{"sqrt": None}, ["sqrt", "safe"], {"sqrt": {"rule": 3}}, {3: "safe"},
                                 {"sqrt": {"rule": "safe", 3: 1}}, "sqrt = 'safe'"],
                         ids=["none_entry", "list", "int_rule_name", "int_op_name", "int_param_name", "toml_text"])
def test_bad_dict_config(cfg):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] config"):
        gk.RuleTable.from_dict(cfg)


def test_good_configs_fingerprint_equally_and_empty_config_is_plain_jax(tmp_path):
    (tmp_path / "a.toml").write_text('sqrt = "safe"\nlog = {rule = "clamped_log", eps = 1e-30}\n')
    (tmp_path / "empty.toml").write_text("")
    a = gk.RuleTable.from_toml(tmp_path / "a.toml")
    assert a == gk.RuleTable.from_dict({"log": {"rule": "clamped_log", "eps": 1e-30}, "sqrt": "safe"})
    empty = gk.RuleTable.from_toml(tmp_path / "empty.toml")
    assert len(empty) == 0
    np.testing.assert_array_equal(jax.grad(gk.override(loss, empty))(X), jax.grad(loss)(X))
