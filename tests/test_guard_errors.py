"""gk.guard raising inside jax.jit: the user gets gk.NonFiniteGradientError, first line where the NaN is born."""

import traceback

import jax
import jax.numpy as jnp
import pytest

import gradkit as gk


def log_loss(w, x):
    return jnp.sum(jnp.log(w * x))  # the NaN/inf is born here


LINE = f"test_guard_errors.py:{log_loss.__code__.co_firstlineno + 1}: `log` of 0 gave -inf for 1 of 3 elements"


def names_the_birth(line):
    return line.startswith("[gradkit] guard(log_loss): NaN/inf born at `log`, ") and LINE in line
GOOD, BAD = (jnp.ones(3), jnp.ones(3)), (jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))


def first_line(e):
    return str(e).splitlines()[0]


@pytest.mark.parametrize("warm", [False, True], ids=["first call (JaxRuntimeError)", "fast path (ValueError)"])
def test_with_guard_raises_the_gradkit_error_from_a_jitted_step(warm):
    g = gk.guard(log_loss)
    step = jax.jit(lambda w, x: g(w, x))
    if warm:  # a finite first call puts the step on JAX's C++ dispatch path
        jax.block_until_ready(step(*GOOD))
    with pytest.raises(gk.NonFiniteGradientError) as info:
        with g:
            jax.block_until_ready(step(*BAD))
    e = info.value
    assert isinstance(e, gk.GradkitError) and isinstance(e, FloatingPointError)
    assert names_the_birth(first_line(e)) and first_line(e).endswith(" (a compiled call, loss = -inf)")
    assert len(e.reports) == 1 and e.reports[0].audit.findings[0].op == "log"
    shown = "".join(traceback.format_exception(e))
    assert "INTERNAL" not in shown and "CpuCallback" not in shown and "JAX delivers" not in shown
    assert e.__suppress_context__ and "step(*BAD)" in shown  # the frame of the failing call, not JAX's wrapper


def test_wrap_raises_the_gradkit_error_from_the_call_and_the_step_goes_on():
    g = gk.guard(log_loss)
    step = g.wrap(jax.jit(lambda w, x: g(w, x)))
    jax.block_until_ready(step(*GOOD))
    with pytest.raises(gk.NonFiniteGradientError, match=r"^\[gradkit\] guard\(log_loss\): NaN/inf born at `log`"):
        step(*BAD)
    value, grad = step(*GOOD)
    assert float(value) == 0.0 and grad.tolist() == [1.0, 1.0, 1.0]


def test_without_the_block_jax_error_leads_with_the_finding_and_says_how_to_unwrap():
    g = gk.guard(log_loss)
    step = jax.jit(lambda w, x: g(w, x))
    with pytest.raises(g.step_errors) as info:
        jax.block_until_ready(step(*BAD))
    assert not isinstance(info.value, gk.NonFiniteGradientError)  # JAX's own type: nothing can change it here
    text = str(info.value)
    assert text.startswith("INTERNAL: CpuCallback error calling callback")
    report = text[text.index("NonFiniteGradientError: ") + len("NonFiniteGradientError: "):]
    assert names_the_birth(first_line(report))
    assert report.rstrip().splitlines()[-1].startswith("[gradkit] JAX delivers an error raised inside a compiled "
                                                        "step as its own")
    # the block re-raises it even when JAX's error was caught and re-raised by the loop first
    with pytest.raises(gk.NonFiniteGradientError):
        with g:
            try:
                jax.block_until_ready(step(*BAD))
            except g.step_errors:
                raise


def test_other_errors_pass_through_the_block_unchanged():
    g = gk.guard(log_loss)
    with pytest.raises(KeyError, match="unrelated"):
        with g:
            raise KeyError("unrelated")
    step = jax.jit(lambda w, x: g(w, x))
    with pytest.raises(g.step_errors) as info:  # another guard's error is not this guard's
        with gk.guard(log_loss):
            jax.block_until_ready(step(*BAD))  # on a GPU JAX raises at the first use of the results
    assert not isinstance(info.value, gk.NonFiniteGradientError)
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] guard\(log_loss\)\.wrap: expected the step"):
        g.wrap(3)


def test_eager_raise_leads_with_the_birth_place():
    g = gk.guard(log_loss)
    with pytest.raises(gk.NonFiniteGradientError) as info:
        with g:
            g(*BAD)
    assert names_the_birth(first_line(info.value))
    assert "(call 1, loss = -inf)" in first_line(info.value)
