"""gk.guard: bit-for-bit value_and_grad while finite; an audit of exactly the bad call otherwise."""

import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import gradkit as gk
from meshes import make_mesh
from gradkit._src.guard import audits as audits_mod

# a guard runs different code eagerly (checks and reports in Python) and under jit (a host callback): every
# test here keeps both modes in the default set (conftest.py)
pytestmark = pytest.mark.both_modes


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"][None, :])
    logits = h @ params["w2"]
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - jnp.sum(logits * y, axis=-1))


def make_params(seed=0):
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w1": jax.random.normal(k1, (6, 16), jnp.float32) / 3, "b1": jnp.zeros(16, jnp.float32),
            "w2": jax.random.normal(k2, (16, 4), jnp.float32) / 4}


def batch(n=8, seed=1):
    kx, ky = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (n, 6), jnp.float32)
    y = jax.nn.one_hot(jax.random.randint(ky, (n,), 0, 4), 4, dtype=jnp.float32)
    return x, y


def log_loss(w, x):
    """NaN gradient w.r.t. w wherever w * x == 0 (the guarded-log problem)."""
    return jnp.sum(jnp.where(w * x > 0, jnp.log(w * x), 0.0))


def assert_same(a, b):
    """Bit for bit on XLA:CPU (the guard's promise there); elsewhere within 2 ULP: on an H200 the guard's
    check changed XLA:GPU's fusion of a has_aux step and the last bit of 11 of 16 gradient elements."""
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for u, v in zip(la, lb):
        assert u.dtype == v.dtype and u.shape == v.shape
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))  # bit for bit (NaN == NaN here)
        else:
            np.testing.assert_array_max_ulp(np.asarray(u), np.asarray(v), maxulp=2)


@pytest.fixture
def spy(monkeypatch):
    """Counts the host callbacks (the bad path) of every guard."""
    calls = []
    original = audits_mod.Auditor.on_bad

    def counted(self, *a):
        calls.append(a)
        return original(self, *a)

    monkeypatch.setattr(audits_mod.Auditor, "on_bad", counted)
    return calls


# --------------------------------------------------------------------------- finite: exactly value_and_grad


@pytest.mark.parametrize("mode", ["raise", "skip", "report"])
def test_finite_calls_are_value_and_grad_bit_for_bit(maybe_jit, mode, spy):
    params, (x, y) = make_params(), batch()
    ours = maybe_jit(gk.guard(mlp_loss, on_nonfinite=mode))
    ref = maybe_jit(jax.value_and_grad(mlp_loss))
    for seed in range(3):
        x, y = batch(seed=seed)
        assert_same(ours(params, x, y), ref(params, x, y))
    assert spy == []  # the finite path never reaches the host


def test_has_aux_tuple_argnums_and_kwargs_bit_for_bit(maybe_jit):
    params, (x, y) = make_params(), batch()

    def loss(params, x, y, *, scale):
        out = mlp_loss(params, x, y) * scale
        return out, {"logits_mean": jnp.mean(x @ params["w1"]), "n": jnp.int32(x.shape[0])}

    for argnums in [0, (0, 1), (1,)]:
        ours = maybe_jit(lambda p, x, y, g=gk.guard(loss, argnums=argnums, has_aux=True): g(p, x, y, scale=2.0))
        ref = maybe_jit(lambda p, x, y, a=argnums: jax.value_and_grad(loss, a, has_aux=True)(p, x, y, scale=2.0))
        assert_same(ours(params, x, y), ref(params, x, y))


def test_inside_a_jitted_optax_step_bit_for_bit():
    optax = pytest.importorskip("optax")
    params, (x, y) = make_params(), batch(32)
    opt = optax.sgd(1e-2, momentum=0.9)

    def make(vg):
        @jax.jit
        def step(params, state, x, y):
            loss, g = vg(params, x, y)
            updates, state = opt.update(g, state, params)
            return optax.apply_updates(params, updates), state, loss
        return step

    ours, ref = make(gk.guard(mlp_loss)), make(jax.value_and_grad(mlp_loss))
    p1, s1, p2, s2 = params, opt.init(params), params, opt.init(params)
    for _ in range(5):
        p1, s1, l1 = ours(p1, s1, x, y)
        p2, s2, l2 = ref(p2, s2, x, y)
        assert_same((p1, l1), (p2, l2))


# --------------------------------------------------------------------------- the three modes


def test_raise_mode_eager_raises_gradkit_error_with_the_report():
    g = gk.guard(log_loss)
    with pytest.raises(gk.NonFiniteGradientError, match=r"^\[gradkit\] guard\(log_loss\)") as info:
        g(jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))
    text = str(info.value)
    assert "(step 1, loss = " in text.splitlines()[0]
    assert "`log`" in text and "test_guard.py" in text and "gk.tables.SAFE" in text
    assert isinstance(info.value, gk.GradkitError) and len(info.value.reports) == 1
    assert g.reports[0].call == 1 and g.calls == 1


def test_raise_mode_jitted_raises_jax_runtime_error_with_the_report(spy):
    g = gk.guard(log_loss)
    step = jax.jit(lambda w, x: g(w, x))
    jax.block_until_ready(step(jnp.ones(3), jnp.ones(3)))
    # the second call of the step: on the CPU JAX's C++ dispatch path delivers the callback's exception as a
    # ValueError; on a GPU block_until_ready raises it as a JaxRuntimeError. Both are in step_errors.
    with pytest.raises(g.step_errors) as info:
        jax.block_until_ready(step(jnp.ones(3), jnp.array([1.0, 0.0, 2.0])))
    if jax.default_backend() == "cpu":
        assert isinstance(info.value, ValueError)
    text = str(info.value)
    assert "[gradkit] guard(log_loss)" in text and "born at" in text and "`log`" in text
    assert "(w * x)[1] = 0" in text
    assert len(spy) == 1 and len(g.reports) == 1
    # and the next good step runs normally
    assert_same(step(jnp.ones(3), jnp.ones(3)), jax.value_and_grad(log_loss)(jnp.ones(3), jnp.ones(3)))


def test_skip_mode_zeros_the_gradient_and_training_goes_on(maybe_jit):
    g = gk.guard(log_loss, on_nonfinite="skip")

    @maybe_jit
    def step(w, x):
        loss, grad = g(w, x)
        return w - 0.1 * grad, loss

    w = jnp.full(3, 2.0)
    xs = [jnp.ones(3), jnp.array([1.0, 0.0, 2.0]), jnp.ones(3)]
    trace = []
    for x in xs:
        w_new, loss = step(w, x)
        trace.append((w, w_new, loss))
        w = w_new
    # the bad step is a no-op; the others are SGD steps with JAX's gradient
    np.testing.assert_array_equal(trace[1][1], trace[1][0])
    np.testing.assert_allclose(trace[0][1], trace[0][0] - 0.1 / trace[0][0], rtol=1e-6)
    np.testing.assert_allclose(trace[2][1], trace[2][0] - 0.1 / trace[2][0], rtol=1e-6)
    assert float(trace[1][2]) == pytest.approx(float(log_loss(trace[1][0], xs[1])))  # the loss is unchanged
    (r,) = g.reports
    assert r.audit.findings[0].op == "log" and not r.audit.finite
    # audited at exactly that call's inputs: x[1] == 0
    assert r.audit.inputs == ("w: f32[3]", "x: f32[3]") and str(r.audit.findings[0].root.elements[0]) == "(w * x)[1] = 0"


def test_report_mode_returns_values_unchanged(maybe_jit):
    g = maybe_jit(gk.guard(log_loss, on_nonfinite="report"))
    w, x = jnp.ones(3), jnp.array([1.0, 0.0, 2.0])
    assert_same(g(w, x), jax.value_and_grad(log_loss)(w, x))
    guard = g if isinstance(g, gk.Guard) else None
    assert guard is None or len(guard.reports) == 1


def test_reports_wait_for_dispatched_steps():
    g = gk.guard(log_loss, on_nonfinite="report")
    step = jax.jit(lambda w, x: g(w, x))
    step(jnp.ones(3), jnp.array([0.0, 1.0, 1.0]))  # not blocked on
    (r,) = g.reports
    assert r.call is None and r.batch_index == ()
    assert r.headline.startswith("NaN/inf born at `log`, ") and r.headline.endswith("(a compiled step, loss = 0)")


def test_fix_from_the_report_makes_the_guard_silent(spy):
    g = gk.guard(log_loss, on_nonfinite="report")
    jax.jit(g)(jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))
    fix = g.reports[0].audit.findings[0].fix
    assert fix.name == "gradkit.tables.SAFE" and fix.verified
    fixed = gk.guard(gk.override(log_loss, gk.tables.SAFE), on_nonfinite="report")
    _, grad = jax.jit(fixed)(jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))
    np.testing.assert_array_equal(grad, [1.0, 0.0, 1.0])  # d/dw log(w x) = 1/w, 0 where masked
    assert fixed.reports == [] and len(spy) == 1


def test_nonfinite_loss_alone_is_caught(maybe_jit):
    g = gk.guard(lambda w: jnp.sum(w) + jnp.log(0.0), on_nonfinite="report")
    loss, grad = maybe_jit(g)(jnp.ones(2))
    assert float(loss) == -np.inf and np.all(np.isfinite(grad))
    (r,) = g.reports
    assert r.loss == "-inf" and r.audit.finite


# --------------------------------------------------------------------------- bounded: a cap, a report per birth place


@pytest.fixture
def audits(monkeypatch):
    """Weak references to the host copies each audit ran from, one list per audit."""
    runs = []
    original = audits_mod.Auditor.audit

    def spied(self, call, index, loss, split, dyn, note=""):
        runs.append([weakref.ref(x) for x in dyn if isinstance(x, np.ndarray)])
        return original(self, call, index, loss, split, dyn, note)

    monkeypatch.setattr(audits_mod.Auditor, "audit", spied)
    return runs


def two_nans(w, x, y):
    """NaN gradient born at `log` where x == 0, at `sqrt` where y == 0."""
    return jnp.sum(jnp.where(w * x > 0, jnp.log(w * x), 0.0)) + jnp.sum(jnp.sqrt(w * y))


@pytest.mark.parametrize("mode", ["skip", "report"])
def test_the_cap_audits_the_first_bad_calls_and_counts_the_rest(maybe_jit, mode, audits):
    g = gk.guard(log_loss, on_nonfinite=mode, max_reports=2)
    step = maybe_jit(g)
    for k in range(8):
        x = jnp.array([1.0, 0.0, 2.0]) if k % 2 else jnp.ones(3)  # 4 finite, 4 bad
        jax.block_until_ready(step(jnp.ones(3), x))
    (r,) = g.reports  # both audits found `log`: one report, one repeat
    assert len(audits) == 2 and g.bad_calls == 4
    assert r.repeats == 1 and r.audit.findings[0].op == "log"
    assert "repeats: 1 later audit(s)" in str(r)


def test_raise_mode_past_the_cap_raises_without_an_audit(maybe_jit, audits):
    g = gk.guard(log_loss, max_reports=1)
    step = maybe_jit(g)
    texts = []
    for _ in range(3):
        with pytest.raises(g.step_errors) as info:
            jax.block_until_ready(step(jnp.ones(3), jnp.array([1.0, 0.0, 2.0])))
        texts.append(str(info.value))
    assert len(audits) == 1 and g.bad_calls == 3 and len(g.reports) == 1
    assert "born at" in texts[0] and "Not audited" not in texts[0]
    for n, text in zip((2, 3), texts[1:]):
        assert "[gradkit] guard(log_loss): non-finite loss or gradient at " in text and "loss = " in text
        assert f"Not audited: this guard audits its first max_reports=1 bad call(s) (read guard.reports); " \
               f"this is bad call {n}." in text
        assert "born at" not in text
    if not isinstance(step, gk.Guard):
        return
    assert isinstance(info.value, gk.NonFiniteGradientError) and info.value.reports == ()


def test_max_reports_zero_only_counts(audits):
    g = gk.guard(log_loss, on_nonfinite="skip", max_reports=0)
    step = jax.jit(g)
    for _ in range(3):
        _, grad = step(jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))
        np.testing.assert_array_equal(grad, 0.0)  # still skipped
    assert g.bad_calls == 3 and g.reports == [] and audits == []


def test_distinct_findings_get_their_own_report(maybe_jit, audits):
    g = gk.guard(two_nans, on_nonfinite="skip")  # the default cap, 4
    step = maybe_jit(g)
    ones, hole = jnp.ones(3), jnp.array([1.0, 0.0, 1.0])
    for x, y in [(hole, ones), (hole, ones), (ones, hole), (hole, ones), (hole, ones), (ones, hole)]:
        jax.block_until_ready(step(ones, x, y))
    log, sqrt = g.reports  # in the order first seen; the 5th and 6th bad calls were not audited
    assert audits_mod.MAX_REPORTS == 4 and len(audits) == 4 and g.bad_calls == 6
    assert [f.op for f in log.audit.findings] == ["log"] and log.repeats == 2
    assert [f.op for f in sqrt.audit.findings] == ["sqrt"] and sqrt.repeats == 0
    assert "test_guard.py" in log.audit.findings[0].location


def test_vmap_elements_count_against_the_cap(audits):
    g = gk.guard(log_loss, on_nonfinite="skip", max_reports=3)
    xs = jnp.ones((12, 3)).at[jnp.arange(2, 12), 1].set(0.0)  # elements 2..11 bad
    _, grads = jax.jit(jax.vmap(g, in_axes=(None, 0)))(jnp.ones(3), xs)
    np.testing.assert_array_equal(grads[2:], 0.0)
    (r,) = g.reports
    assert len(audits) == 3 and g.bad_calls == 1 and r.batch_index == (2,) and r.repeats == 2
    assert r.note == "7 more bad batch element(s) in this call were not audited: (5,), (6,), (7,), (8,), (9,), " \
                     "(10,), (11,)."
    assert all(len(refs) == 2 for refs in audits)  # each audit copied one element (w and that row), not the batch


@pytest.mark.parametrize("mode", ["raise", "skip"])
def test_reports_hold_no_copy_of_the_arguments(maybe_jit, mode, audits):
    g = gk.guard(log_loss, on_nonfinite=mode)
    step = maybe_jit(g)
    errors = []  # kept alive: an exception must not keep the inputs either
    for _ in range(2):
        try:
            jax.block_until_ready(step(jnp.ones(3), jnp.array([1.0, 0.0, 2.0])))
        except g.step_errors as e:
            errors.append(e)
    reports = g.reports
    gc.collect()
    assert len(audits) == 2 and all(len(refs) == 2 for refs in audits)
    assert [ref() for refs in audits for ref in refs] == [None] * 4  # every host copy is gone
    assert len(errors) == (2 if mode == "raise" else 0)
    (r,) = reports
    assert not hasattr(r, "args") and r.repeats == 1
    assert not any(isinstance(v, (np.ndarray, jax.Array)) for v in vars(r).values())


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_reports_wait_only_for_the_capped_audits(monkeypatch, audits):
    slow_s = 2.0

    def slow_audit(*a, **k):
        time.sleep(slow_s)
        return real_audit(*a, **k)

    real_audit = audits_mod.audit
    monkeypatch.setattr(audits_mod, "audit", slow_audit)
    g = gk.guard(log_loss, on_nonfinite="skip", max_reports=2)
    step = jax.jit(g)
    bad = 12
    for _ in range(bad):
        step(jnp.ones(3), jnp.array([1.0, 0.0, 2.0]))
    t0 = time.perf_counter()
    (r,) = g.reports  # waits for the two audits at most
    elapsed = time.perf_counter() - t0
    assert len(audits) == 2 and g.bad_calls == bad and r.repeats == 1
    assert elapsed < bad * slow_s / 2, elapsed  # uncapped: 12 audits of more than 2 s each


# --------------------------------------------------------------------------- vmap: only the bad elements


def test_vmap_audits_only_the_bad_elements(spy):
    g = gk.guard(log_loss, on_nonfinite="skip")
    xs = jnp.array([[1.0, 2.0, 3.0], [1.0, 0.0, 2.0], [2.0, 2.0, 2.0], [0.0, 1.0, 1.0]])
    per_example = jax.jit(jax.vmap(g, in_axes=(None, 0)))
    loss, grads = per_example(jnp.ones(3), xs[jnp.array([0, 2])])  # all good: no callback at all
    assert spy == [] and np.all(np.isfinite(grads))
    loss, grads = per_example(jnp.ones(3), xs)
    np.testing.assert_array_equal(grads[jnp.array([1, 3])], 0.0)  # skip is per element
    np.testing.assert_array_equal(grads[jnp.array([0, 2])], jnp.ones((2, 3)))
    assert len(spy) == 1 and g.bad_calls == 1  # one callback for the whole batch
    # both bad elements audited; their NaN is born at the same `log`: one report, one repeat
    (r,) = g.reports
    assert r.batch_index == (1,) and r.repeats == 1 and r.audit.findings[0].op == "log"
    assert r.audit.inputs == ("w: f32[3]", "x: f32[3]")  # the element, not the batch
    assert str(r.audit.findings[0].root.elements[0]) == "(w * x)[1] = 0"  # xs[1] = [1, 0, 2]


def test_nested_vmap_indices():
    g = gk.guard(log_loss, on_nonfinite="report")
    xs = jnp.ones((2, 3, 3)).at[1, 2, 0].set(0.0)
    ws = jnp.ones((2, 3))
    jax.jit(jax.vmap(jax.vmap(g, in_axes=(None, 0)), in_axes=(0, 0)))(ws, xs)
    (r,) = g.reports
    assert r.batch_index == (1, 2)
    assert r.audit.inputs == ("w: f32[3]", "x: f32[3]")  # ws[1] and xs[1, 2]
    assert str(r.audit.findings[0].root.elements[0]) == "(w * x)[0] = 0"


# --------------------------------------------------------------------------- data parallel


def _mesh():
    from jax.sharding import AxisType

    return make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))


def sqrt_loss(w, x):
    return jnp.mean(jnp.sqrt(x @ w))


def test_sharded_inputs_bit_for_bit_and_the_global_batch_is_audited():
    mesh = _mesh()
    w = jnp.full((4,), 0.5)
    x = jax.device_put(jax.random.uniform(jax.random.key(0), (16, 4)) + 0.1, NamedSharding(mesh, P("d")))
    g = gk.guard(sqrt_loss, on_nonfinite="report")
    assert_same(jax.jit(g)(w, x), jax.jit(jax.value_and_grad(sqrt_loss))(w, x))
    bad = jax.device_put(x.at[5].set(0.0), NamedSharding(mesh, P("d")))
    # the step's results used first: jax 0.8's effects_barrier can return before this callback has run
    jax.block_until_ready(jax.jit(g)(w, bad))
    (r,) = g.reports
    assert r.audit.inputs[1] == "x: f32[16,4]" and r.audit.findings[0].op == "sqrt"
    assert "x[5, 0]" in str(r.audit) or "[5]" in str(r.audit)


def varying(x, axis):
    if hasattr(jax.lax, "pvary"):  # jax < 0.10
        return jax.lax.pvary(x, axis)
    return jax.lax.pcast(x, axis, to="varying")


def test_inside_shard_map_only_the_bad_shard_reports(spy):
    mesh = _mesh()
    g = gk.guard(sqrt_loss, on_nonfinite="skip")

    def data_parallel(w, x):
        w = varying(w, "d")  # per-device gradients; the mean over devices is ours
        loss, grad = g(w, x)
        return jax.lax.pmean(loss, "d"), jax.lax.pmean(grad, "d")

    step = jax.jit(jax.shard_map(data_parallel, mesh=mesh, in_specs=(P(), P("d")), out_specs=(P(), P())))
    w = jnp.full((4,), 0.5)
    x = jax.random.uniform(jax.random.key(0), (16, 4)) + 0.1
    loss, grad = step(w, x)
    ref = jax.value_and_grad(sqrt_loss)(w, x)
    np.testing.assert_allclose(loss, ref[0], rtol=1e-6)
    np.testing.assert_allclose(grad, ref[1], rtol=1e-5)
    assert spy == []
    loss, grad = step(w, x.at[5].set(0.0))  # row 5 lives on device 2 (rows 4, 5)
    good = jax.vmap(jax.grad(sqrt_loss), in_axes=(None, 0))(w, x.reshape(8, 2, 4))
    np.testing.assert_allclose(grad, jnp.sum(good.at[2].set(0.0), axis=0) / 8, rtol=1e-5)  # that shard skipped
    (r,) = g.reports
    assert r.audit.inputs[1] == "x: f32[2,4]" and r.audit.findings[0].op == "sqrt"
    assert str(r.audit.findings[0].root.elements[0]).startswith("(x @ w)[1]")


# --------------------------------------------------------------------------- other inputs


def test_prng_key_arguments_reach_the_audit():
    def noisy(w, key):
        return jnp.sum(jnp.sqrt(w + jax.random.normal(key, w.shape) * 0.0))

    g = gk.guard(noisy, on_nonfinite="report")
    jax.jit(g)(jnp.array([1.0, 0.0]), jax.random.key(3))
    (r,) = g.reports
    assert r.audit is not None and r.audit.findings[0].op == "sqrt"  # jax.random.normal ran: a key arrived


def test_static_python_arguments_are_kept():
    def loss(w, mode):
        return jnp.sum(jnp.log(w)) if mode == "log" else jnp.sum(w)

    g = gk.guard(loss, on_nonfinite="report")
    jax.jit(g, static_argnums=1)(jnp.array([1.0, 0.0]), "log")
    (r,) = g.reports
    assert r.audit.findings[0].op == "log"  # the branch of mode == "log"


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("kwargs, match", [
    ({"on_nonfinite": "warn"}, r"unknown on_nonfinite='warn'.*'raise'.*'skip'.*'report'"),
    ({"argnums": "0"}, r"argnums must be an int"),
    ({"argnums": ()}, r"argnums must be an int"),
    ({"has_aux": 1}, r"has_aux must be True or False"),
    ({"max_reports": -1}, r"max_reports must be an int >= 0 \(how many bad calls to audit"),
    ({"max_reports": 2.0}, r"max_reports must be an int >= 0"),
    ({"max_reports": True}, r"max_reports must be an int >= 0"),
])
def test_bad_arguments_fail_at_wrap_time(kwargs, match):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] guard\(mlp_loss\): " + match):
        gk.guard(mlp_loss, **kwargs)


def test_not_a_function():
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] guard: expected a loss function"):
        gk.guard(3.0)


def test_non_scalar_loss_fails_at_first_trace(maybe_jit):
    def per_example(w):
        return w * 2.0

    g = maybe_jit(gk.guard(per_example))
    with pytest.raises(gk.GradkitError, match=r"guard\(per_example\): the loss must be a scalar, but per_example "
                                               r"\(defined at .*test_guard.py:\d+\) returned shape \(3,\)"):
        g(jnp.ones(3))


def test_has_aux_needs_a_pair():
    g = gk.guard(lambda w: jnp.sum(w), has_aux=True)
    with pytest.raises(gk.GradkitError, match=r"has_aux=True.*must return \(loss, aux\)"):
        g(jnp.ones(3))


def test_user_errors_keep_their_type(maybe_jit):
    def broken(w):
        raise KeyError("missing batch field")

    with pytest.raises(KeyError, match="missing batch field"):
        maybe_jit(gk.guard(broken))(jnp.ones(2))


# --------------------------------------------------------------------------- the check itself


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_the_check_is_exact(maybe_jit, dtype):
    from gradkit._src.guard.host import all_finite

    check = maybe_jit(lambda leaves: all_finite(leaves))
    big = jnp.full((64,), jnp.finfo(dtype).max, dtype)  # huge but finite: a plain sum would overflow
    assert bool(check([big, jnp.ones(3, dtype)]))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        assert not bool(check([big, jnp.ones(3, dtype).at[1].set(bad)]))
    assert bool(check([jnp.arange(3)]))  # integer leaves have nothing to check


def test_the_check_sees_an_overflowed_matmul_element():
    from gradkit._src.guard.host import all_finite

    # h.T @ d overflows in one element although h and d are finite; XLA may rewrite sum(h.T @ d)
    h = jnp.zeros((4, 3), jnp.float32).at[0, 0].set(3e38)
    d = jnp.zeros((4, 2), jnp.float32).at[0, 0].set(2.0).at[0, 1].set(-2.0)
    ok = jax.jit(lambda h, d: all_finite([h.T @ d]))(h, d)
    assert not np.all(np.isfinite(np.asarray(h.T @ d))) and not bool(ok)
