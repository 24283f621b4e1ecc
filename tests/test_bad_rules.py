"""Bad rules: what a rule returns, raises or does on the side, and the modes it serves. See bad_input_cases.py for the contract."""

import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bad_input_cases import (
    AFFINE_LINE,
    BINARY_LINE,
    LOSS_LINE,
    THIS_FILE,
    X,
    affine_loss,
    binary_loss,
    loss,
    x64,
)
from jax import lax

import gradkit as gk
from gradkit._src import compat
from gradkit._src.core import walk

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
    text = "\n".join(getattr(info.value, "__notes__", []))
    assert "[gradkit] raised inside" in text and rule.name in text and f"op '{op}'" in text, text
    assert re.search(rf"{THIS_FILE}:{line}\b", text), text
    return f"{info.value}\n{text}"


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
    assert "broken_jvp" in msg and "op 'sin'" in msg and f"bad_input_cases.py:{LOSS_LINE}" in msg
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
    text = "\n".join(getattr(info.value, "__notes__", []))
    assert "[gradkit]" in text and "branchy" in text and "op 'sin'" in text and "jnp.where" in text


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
    assert f'bad_input_cases.py", line {LOSS_LINE}' in "".join(traceback.format_exception(cause))


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


# --------------------------------------------------------------------------- ops inside library code

# Library functions whose ops JAX traces in a jitted body of their own: the equations there keep no
# frame of the user's code, so an error names the line that called the library function.
def _softplus(x):
    return jnp.sum(jax.nn.softplus(x))  # LIBRARY_LINE


def _silu(x):
    return jnp.sum(jax.nn.silu(x))  # LIBRARY_LINE


def _norm(x):
    return jnp.linalg.norm(x)  # LIBRARY_LINE


def _log_softmax(x):
    return jnp.sum(jax.nn.log_softmax(x))  # LIBRARY_LINE


def _nested(x):
    return jax.jit(_softplus)(x)  # a user jit around the library call: still the library call's line


LIBRARY_CASES = [(_softplus, "fn:logaddexp"), (_silu, "logistic"), (_norm, "sqrt"),
                 (_log_softmax, "exp"), (_nested, "fn:logaddexp")]


def _library_line(fn):
    import inspect

    target = _softplus if fn is _nested else fn
    lines, start = inspect.getsourcelines(target)
    return start + next(i for i, ln in enumerate(lines) if "# LIBRARY_LINE" in ln)


@pytest.mark.parametrize("mode", ["vjp", "jvp"])
@pytest.mark.parametrize("fn,op", LIBRARY_CASES, ids=[c[0].__name__ for c in LIBRARY_CASES])
def test_an_op_inside_library_code_is_reported_at_the_users_call(fn, op, mode):
    if mode == "vjp":
        bad = gk.vjp_rule(lambda o, g: (g,) * (len(o.inputs) + 1), name="too_many")
    else:
        bad = gk.jvp_rule(lambda o, t: [t[0], t[0], t[0]], name="too_many")
    x = jnp.array([0.5, -1.0, 2.0])
    # the op is there, inside the library's body; on jax 0.12 its equation carries no user frame (0.8 kept one)
    found = [e for e, _ in walk.equations(jax.make_jaxpr(fn)(x)) if compat.eqn_name(e) == op]
    assert found, op
    if compat.JAX_VERSION >= (0, 12):
        assert all(compat.source_line(e) == "unknown source line" for e in found), op
    for wrap in (lambda f: f, jax.jit):
        with pytest.raises(gk.GradkitError) as info:
            wrap(jax.grad(gk.override(fn, {op: bad})))(x)
        msg = str(info.value)
        assert msg.startswith("[gradkit]") and "too_many" in msg and f"op '{op}'" in msg, msg
        assert f"{__file__}:{_library_line(fn)} ({(_softplus if fn is _nested else fn).__name__})" in msg, msg


_ELSEWHERE = {_softplus: jax.nn.softplus, _silu: jax.nn.silu, _norm: jnp.linalg.norm,
              _log_softmax: jax.nn.log_softmax, _nested: jax.nn.softplus}


def _first_caller(library_fn, x):
    return jax.make_jaxpr(lambda v: library_fn(v))(x)  # traces (and caches) the library's jitted body first


@pytest.mark.parametrize("fn,op", LIBRARY_CASES, ids=[c[0].__name__ for c in LIBRARY_CASES])
def test_the_users_line_is_the_current_call_when_the_library_body_was_traced_elsewhere_first(fn, op):
    # JAX caches a jitted library function's body; on JAX 0.8 its equations keep the frames of their first
    # trace, so their user frame was another function's call (this file's _first_caller) until gradkit took
    # the line of the call being rewritten
    x = jnp.array([0.5, -1.0, 2.0])
    _first_caller(_ELSEWHERE[fn], x)
    bad = gk.vjp_rule(lambda o, g: (g,) * (len(o.inputs) + 1), name="too_many")
    with pytest.raises(gk.GradkitError) as info:
        jax.grad(gk.override(fn, {op: bad}))(x)
    msg = str(info.value)
    assert f"{__file__}:{_library_line(fn)} ({(_softplus if fn is _nested else fn).__name__})" in msg, msg
    assert "_first_caller" not in msg, msg
