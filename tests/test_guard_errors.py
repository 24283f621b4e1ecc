"""gk.guard raising: `except gk.NonFiniteGradientError` catches a guarded step's failure, however it is called.

JAX cannot carry an exception out of a compiled program (a plain `jax.jit` call gets JAX's `INTERNAL:
CpuCallback error …`); every call that passes gradkit's code — the guard's own call, the step `guard.wrap`
wraps, `with guard:` — gets the guard's own exception back by one mechanism (guard/delivery.py). And a
report's headline says where the NaN was born and which step it was.
"""

import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src import compat


def log_loss(w, x):
    return jnp.sum(jnp.log(w * x))  # the NaN/inf is born here


BIRTH = f"test_guard_errors.py:{log_loss.__code__.co_firstlineno + 1}: `log` of 0 gave -inf for 1 of 3 elements"


def names_the_birth(line):
    return line.startswith("[gradkit] guard(log_loss): NaN/inf born at `log`, ") and BIRTH in line


GOOD, BAD = (jnp.ones(3), jnp.ones(3)), (jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))


def first_line(e):
    return str(e).splitlines()[0]


def assert_clean(e, *, jax_context=True):
    """The guard's own error, its report, and nothing of JAX's wrapping in what the user is shown."""
    assert type(e) is gk.NonFiniteGradientError and isinstance(e, FloatingPointError)
    assert names_the_birth(first_line(e)), first_line(e)
    assert e.reports and e.reports[0].audit.findings[0].op == "log"
    shown = "".join(traceback.format_exception(e))
    assert "INTERNAL" not in shown and "CpuCallback" not in shown and "JAX delivers" not in shown
    if jax_context:  # chained: JAX's error is kept, not shown
        assert isinstance(e.__context__, compat.CALLBACK_ERRORS) and e.__suppress_context__
        assert str(e) in str(e.__context__) or str(e).splitlines()[0] in str(e.__context__)


# --------------------------------------------------------------------------- every way of calling a guarded step


def _jitted_step(g):
    @jax.jit
    def step(w, x):
        value, grad = g(w, x)
        return w - 0.1 * grad, value
    return step


def _scan_step(g):
    @jax.jit
    def steps(w, xs):
        def body(w, x):
            value, grad = g(w, x)
            return w - 0.1 * grad, value
        return jax.lax.scan(body, w, xs)
    return steps


WAYS = {
    # name: (make the callable to call from g, its good and bad arguments, the step index the report knows)
    "eager": (lambda g: g, GOOD, BAD, 2),
    "eager vmap": (lambda g: jax.vmap(g, in_axes=(None, 0)), (GOOD[0], GOOD[1][None]), (BAD[0], BAD[1][None]),
                   None),
    "jit(guard), wrapped": (lambda g: g.wrap(jax.jit(g)), GOOD, BAD, 2),
    "user's jitted step, wrapped": (lambda g: g.wrap(_jitted_step(g)), GOOD, BAD, 2),
    "jit(vmap(guard)), wrapped": (lambda g: g.wrap(jax.jit(jax.vmap(g, in_axes=(None, 0)))),
                                  (GOOD[0], GOOD[1][None]), (BAD[0], BAD[1][None]), 2),
    "scan over steps, wrapped": (lambda g: g.wrap(_scan_step(g)), (GOOD[0], GOOD[1][None].repeat(2, 0)),
                                 (BAD[0], jnp.stack([GOOD[1], BAD[1]])), 2),
}


@pytest.mark.parametrize("way", WAYS)
def test_except_nonfinite_gradient_error_catches_every_way_of_calling(way):
    make, good, bad, step_index = WAYS[way]
    g = gk.guard(log_loss)
    call = make(g)
    jax.block_until_ready(call(*good))  # a finite first call: later calls take JAX's C++ fast path
    try:
        jax.block_until_ready(call(*bad))
    except gk.NonFiniteGradientError as e:
        assert_clean(e, jax_context=way != "eager")
        assert e.reports[0].call == step_index
        where = f"step {step_index}" if step_index else "a compiled step"
        batch = ", batch element (0,)" if "vmap" in way else ""
        assert first_line(e).endswith(f"({where}{batch}, loss = -inf)"), first_line(e)
    else:
        pytest.fail("no error")
    jax.block_until_ready(call(*good))  # and the step goes on


@pytest.mark.parametrize("warm", [False, True], ids=["first call (JaxRuntimeError)", "fast path (ValueError)"])
def test_a_wrapped_step_raises_the_gradkit_error_from_its_call(warm):
    g = gk.guard(log_loss)
    step = g.wrap(jax.jit(lambda w, x: g(w, x)))
    if warm:
        jax.block_until_ready(step(*GOOD))
    with pytest.raises(gk.NonFiniteGradientError) as info:
        step(*BAD)  # no block_until_ready: in raise mode the wrapped step waits for its results
    assert_clean(info.value)
    shown = "".join(traceback.format_exception(info.value))
    assert "step(*BAD)" in shown  # the frame of the failing call, not JAX's wrapper
    assert step.__wrapped__ is not None and step.__name__ == "<lambda>"


def test_the_with_block_is_the_same_mechanism():
    g = gk.guard(log_loss)
    step = jax.jit(lambda w, x: g(w, x))
    with pytest.raises(gk.NonFiniteGradientError) as info:
        with g:
            jax.block_until_ready(step(*BAD))  # on a GPU JAX raises at the first use of the results
    assert_clean(info.value)
    assert first_line(info.value).endswith("(a compiled step, loss = -inf)")  # not counted: no step boundary
    # it re-raises the guard's error even when JAX's was caught and re-raised by the loop first
    with pytest.raises(gk.NonFiniteGradientError):
        with g:
            try:
                jax.block_until_ready(step(*BAD))
            except g.step_errors:
                raise


def test_any_guards_error_is_converted_at_any_boundary():
    inner, outer = gk.guard(log_loss), gk.guard(lambda w: jnp.sum(w ** 2))
    step = outer.wrap(jax.jit(lambda w, x: (outer(w), inner(w, x))))  # two guards in one step
    with pytest.raises(gk.NonFiniteGradientError) as info:
        step(*BAD)
    assert names_the_birth(first_line(info.value))
    with pytest.raises(gk.NonFiniteGradientError):
        with gk.guard(log_loss):
            jax.block_until_ready(jax.jit(lambda w, x: inner(w, x))(*BAD))


def test_a_plain_jit_call_gets_jax_error_with_the_report_and_the_idiom():
    """The one call no code of gradkit's sees: JAX's type, nothing can change it (JAX issue 26102)."""
    g = gk.guard(log_loss)
    step = jax.jit(lambda w, x: g(w, x))
    with pytest.raises(compat.CALLBACK_ERRORS) as info:
        jax.block_until_ready(step(*BAD))
    assert not isinstance(info.value, gk.NonFiniteGradientError)
    text = str(info.value)
    assert text.startswith("INTERNAL: CpuCallback error calling callback")
    report = text[text.index("NonFiniteGradientError: ") + len("NonFiniteGradientError: "):]
    assert names_the_birth(first_line(report))
    assert report.rstrip().splitlines()[-1].startswith(
        "[gradkit] JAX delivers an error raised inside a compiled step as its own")
    assert "guarded.wrap(jax.jit(step))" in report


def test_other_errors_pass_through_unchanged():
    g = gk.guard(log_loss)
    with pytest.raises(KeyError, match="unrelated"):
        with g:
            raise KeyError("unrelated")

    def failing_callback(x):
        raise ValueError("the user's own callback")

    def own(w, x):
        y = jax.pure_callback(failing_callback, jax.ShapeDtypeStruct((), jnp.float32), w[0])
        return g(w, x)[0] + y

    with pytest.raises(compat.CALLBACK_ERRORS, match="the user's own callback") as info:
        g.wrap(jax.jit(own))(*GOOD)  # a JAX callback error that no guard raised: JAX's, untouched
    assert not isinstance(info.value, gk.NonFiniteGradientError)

    def bad_value(w, x):
        raise ValueError("a user error while tracing")

    with pytest.raises(ValueError, match="a user error while tracing"):
        gk.guard(bad_value)(*GOOD)
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] guard\(log_loss\)\.wrap: expected the step"):
        g.wrap(3)


# --------------------------------------------------------------------------- the headline: birth place and step


@pytest.mark.parametrize("mode", ["raise", "skip", "report"])
def test_the_headline_names_the_birth_place_and_the_step(mode):
    g = gk.guard(log_loss, on_nonfinite=mode)
    step = g.wrap(jax.jit(lambda w, x: g(w, x)))
    for k in range(1, 6):
        try:
            jax.block_until_ready(step(*(BAD if k in (3, 5) else GOOD)))
        except gk.NonFiniteGradientError:
            assert mode == "raise"
    (r,) = g.reports
    assert g.bad_calls == 2 and r.repeats == 1  # the 5th step's audit found the same birth place
    assert r.call == 3 and r.headline.startswith("NaN/inf born at `log`, ")  # then the source line (its path
    assert r.headline.endswith(f"/{BIRTH} (step 3, loss = -inf)")  # as the audit shows it), what `log` did
    assert str(r).splitlines()[0] == r.headline


def test_an_eager_call_is_numbered_by_the_guards_own_count():
    g = gk.guard(log_loss, on_nonfinite="report")
    for args in (GOOD, GOOD, BAD):
        g(*args)
    (r,) = g.reports
    assert r.call == 3 and r.headline.endswith("(step 3, loss = -inf)") and g.calls == 3
    with pytest.raises(gk.NonFiniteGradientError) as info:
        gk.guard(log_loss)(*BAD)
    assert names_the_birth(first_line(info.value)) and first_line(info.value).endswith("(step 1, loss = -inf)")


def log_or_sqrt(w, x, y):
    return jnp.sum(jnp.log(w * x)) + jnp.sum(jnp.sqrt(w * y))  # born at `log` where x = 0, `sqrt` where y = 0


def test_the_step_is_unknown_when_an_earlier_wrapped_call_was_still_running():
    # XLA:CPU runs a cheap program inside its call; 200 dependent 400x400 products run asynchronously (long enough
    # that a loaded machine does not finish them before the call returns)
    slow = jax.jit(lambda x: jax.lax.fori_loop(0, 200, lambda i, c: jnp.tanh(c @ c), x))
    g = gk.guard(log_or_sqrt, on_nonfinite="report")
    guarded = jax.jit(lambda w, x, y: g(w, x, y))

    @g.wrap
    def step(x, y, busy=None):
        return guarded(jnp.ones(3), x, y), slow(busy) if busy is not None else None

    ones, hole = jnp.ones(3), jnp.array([1.0, 0.0, 2.0])
    _, pending = step(ones, ones, jnp.full((400, 400), 1 / 400))  # returns while `slow` runs: not finished
    running = not pending.is_ready()
    # the premise: the products take far longer than a return. JAX 0.10+ dispatches them asynchronously on the
    # CPU; JAX 0.8's CPU client may run them inside the call, and then the call finished: its step is known
    assert running or jax.__version_info__ < (0, 10)
    pending.block_until_ready()  # finished now, but no call of the step saw it finish
    step(hole, ones)  # bad, after a call that had not finished when it returned: which step is not known
    step(ones, ones)  # each call since finished inside its call: numbering resumes
    step(ones, hole)  # bad: step 4
    log, sqrt = g.reports
    assert log.audit.findings[0].op == "log" and log.call == (None if running else 2)
    assert log.headline.endswith("(a compiled step, loss = -inf)" if running else "(step 2, loss = -inf)")
    assert sqrt.audit.findings[0].op == "sqrt" and sqrt.call == 4 and "(step 4, loss = " in sqrt.headline


def test_a_report_without_a_birth_place_says_so_in_its_headline():
    g = gk.guard(lambda w: jnp.sum(w) + jnp.log(0.0), on_nonfinite="report")
    g.wrap(jax.jit(g))(jnp.ones(2))
    (r,) = g.reports
    assert r.audit.finite and r.headline == "non-finite loss or gradient at step 1: loss = -inf"
    np.testing.assert_equal(r.loss, "-inf")
