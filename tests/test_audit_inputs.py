"""gk.audit and gk.guard on the inputs real programs pass: PRNG keys, a bad batch, complex numbers.

* PRNG keys (typed ``jax.random.key`` and raw ``uint32`` ``PRNGKey``) are
  ordinary held inputs: the replay runs ``random_wrap``, ``random_fold_in``,
  ``random_split``, ``random_bits``…, so a Flax model with dropout gets its
  NaN located, from ``gk.audit`` and from ``gk.guard`` inside a jitted step.
* A non-finite input that is not differentiated (a bad batch ``x`` while
  differentiating ``w``) is named, with its elements, as the origin of the
  non-finite gradient, and never blamed on XLA.
* NaN/inf inputs the program masks on purpose (the value is finite: ``nanmean``,
  a ``-inf`` attention mask a ``where`` removes) are not the cause: the audit
  finds where they break the gradient and searches routes as for any finding.
* Complex inputs are differentiated: a real loss of complex inputs is audited
  (its gradient is ``jax.grad``'s); a complex output's real part is.
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

HERE = os.path.abspath(__file__)


def line_of(marker):
    with open(HERE) as f:
        hits = [i + 1 for i, text in enumerate(f) if marker in text and "line_of(" not in text]
    assert len(hits) == 1, marker
    return hits[0]


def the_line(finding):
    path, line = finding.location.rsplit(":", 1)
    return os.path.abspath(path), int(line)


# --------------------------------------------------------------------------- PRNG keys


def noisy_sqrt(w, key):
    k1, _ = jax.random.split(jax.random.fold_in(key, 7))
    keep = jax.random.bernoulli(k1, 0.5, w.shape)
    return jnp.sum(jnp.where(keep, jnp.sqrt(w), 0.0) + jax.random.normal(key, w.shape) * 0.0)  # KEY-SQRT


@pytest.mark.parametrize("make_key", [jax.random.key, jax.random.PRNGKey], ids=["typed", "raw_uint32"])
def test_prng_key_arguments_are_held_inputs_and_random_ops_replay(make_key):
    w = jnp.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    key = make_key(3)
    r = gk.audit(noisy_sqrt, w, key, fix=False)
    assert not r.finite and r.findings, r.note  # the replay went through fold_in, split, bits
    assert r.findings[0].op == "sqrt"
    assert the_line(r.findings[0]) == (HERE, line_of("# KEY-SQRT"))
    assert r.inputs[1] == ("key: key<fry>[]" if make_key is jax.random.key else "key: uint32[2]")
    assert r.gradients[0][0] == "w"  # the key is held, not differentiated


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_guard_audits_a_step_that_splits_its_key():
    g = gk.guard(noisy_sqrt, on_nonfinite="report")

    @jax.jit
    def step(w, key):
        key, sub = jax.random.split(key)
        return g(w, sub)[1], key

    step(jnp.array([1.0, 0.0, 0.0, 0.0, 0.0, 0.0]), jax.random.key(0))
    (report,) = g.reports
    assert report.audit is not None and report.audit.findings, report
    assert report.audit.findings[0].op == "sqrt"
    assert the_line(report.audit.findings[0]) == (HERE, line_of("# KEY-SQRT"))


def _dropout_model():
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            h = nn.Dense(16)(x)
            h = nn.Dropout(0.5, deterministic=not train)(h)
            h = jnp.log(h * h)  # DROPOUT-LOG: a dropped unit is 0, log(0) = -inf
            return nn.Dense(1)(h)

    return Net()


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_flax_linen_dropout_nan_is_located_by_audit_and_guard():
    optax = pytest.importorskip("optax")
    model = _dropout_model()
    x = jax.random.normal(jax.random.key(1), (8, 4))
    params = model.init(jax.random.key(0), x, train=False)

    def loss(params, x, key):
        return jnp.mean(model.apply(params, x, train=True, rngs={"dropout": key}) ** 2)

    key = jax.random.key(2)
    assert not all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree_util.tree_leaves(jax.grad(loss)(params, x, key)))
    r = gk.audit(loss, params, x, key, argnums=0, fix=False)
    assert r.findings, r.note
    assert r.findings[0].op == "log" and the_line(r.findings[0]) == (HERE, line_of("# DROPOUT-LOG"))

    g = gk.guard(loss, on_nonfinite="skip")
    opt = optax.adam(1e-3)

    @jax.jit
    def step(params, state, x, key):
        key, sub = jax.random.split(key)
        value, grads = g(params, x, sub)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, key, value

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int32 and float32
        state = opt.init(params)
        params2, state, _, _ = step(params, state, x, key)
    (report,) = g.reports
    finding = report.audit.findings[0]
    assert finding.op == "log" and the_line(finding) == (HERE, line_of("# DROPOUT-LOG"))
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params2)):
        np.testing.assert_array_equal(a, b)  # skipped: zero gradients, Adam leaves the parameters alone


# --------------------------------------------------------------------------- a bad batch


def mlp(w, x):
    return jnp.mean(jnp.tanh(x @ w) ** 2)


def test_a_nan_in_a_held_input_is_named_with_its_elements():
    w = jnp.full((3, 2), 0.1)
    x = jnp.ones((4, 3)).at[2, 1].set(jnp.nan)
    r = gk.audit(mlp, w, x, argnums=0)
    assert not r.finite and not r.findings
    assert r.note.startswith("the inputs are already non-finite: x[2,1] = nan (1 of 12 elements of x reach")
    assert "Every non-finite gradient element comes from them" in r.note
    assert "XLA" not in r.note


def test_an_inf_input_turned_nan_by_an_op_is_traced_to_the_input():
    w = jnp.full((3, 2), 0.1)
    x = np.ones((4, 3), np.float32)  # a NumPy batch: a constant of the traced program
    x[1, 0] = np.inf

    def loss(w, x):
        h = x @ w - x @ w  # INF-MINUS-INF
        return jnp.mean(h**2)

    r = gk.audit(loss, w, x, argnums=0)
    assert not r.findings  # not "NaN born at sub": the inf came in with x
    assert "x[1,0] = inf" in r.note
    assert f"`sub` at {os.path.relpath(HERE)}:{line_of('# INF-MINUS-INF')}" in r.note


def test_an_input_nan_next_to_a_born_one_is_a_note_beside_the_finding():
    w = jnp.full((3, 2), 0.1).at[0, 0].set(0.0)
    x = jnp.ones((4, 3)).at[0, 2].set(jnp.inf)
    r = gk.audit(lambda w, x: jnp.sum(jnp.sqrt(w)) + jnp.sum(x @ w), w, x, argnums=0, fix=False)
    assert [f.op for f in r.findings] == ["sqrt"]
    assert "x[0,2] = inf" in r.note and "Part of the non-finite gradient comes from them" in r.note


def test_a_nan_inside_a_jitted_function_closure_is_followed():
    x = jnp.array([1.0, jnp.nan, 2.0])
    inner = jax.jit(lambda w: w * x)
    r = gk.audit(lambda w, x: jnp.sum(inner(w)), jnp.ones(3), x, argnums=0)
    assert r.note.startswith("the inputs are already non-finite: x[1] = nan")


def test_guard_report_of_a_nan_batch_names_the_input_and_element():
    g = gk.guard(mlp, on_nonfinite="skip")
    w = jnp.full((3, 2), 0.1)
    x = jnp.ones((4, 3)).at[3, 0].set(jnp.nan)
    jax.jit(g)(w, x)
    (report,) = g.reports
    assert report.audit is not None and not report.audit.findings
    assert "x[3,0] = nan" in report.audit.note and "XLA" not in str(report)


def test_a_non_finite_value_with_a_finite_gradient_names_the_bad_input():
    r = gk.audit(lambda w, x: jnp.sum(w) + jnp.sum(x), jnp.ones(2), jnp.array([0.0, jnp.inf]), argnums=0)
    assert r.gradients == (("w", 0, 2),)
    assert "x[1] = inf" in r.note


# --------------------------------------------------------------------------- complex inputs


def test_a_real_loss_of_complex_inputs_is_audited():
    def loss(z):
        return jnp.sum(jnp.sqrt(jnp.real(z * jnp.conj(z))))  # COMPLEX-SQRT

    z = jnp.array([1 + 1j, 0j, -2 + 0.5j], jnp.complex64)
    r = gk.audit(loss, z)
    assert r.inputs == ("z: c64[3]",)
    assert r.gradients == (("z", 1, 3),)
    assert r.findings[0].op == "sqrt" and the_line(r.findings[0]) == (HERE, line_of("# COMPLEX-SQRT"))
    assert str(r.findings[0].root.elements[0]) == "(jnp.real(z * jnp.conj(z)))[1] = 0"


def test_complex_and_real_inputs_together_match_jax_grad():
    def loss(z, w):
        return jnp.sum(jnp.real(jnp.log(z)) * w)

    z = jnp.array([1 + 1j, 0j, 2j], jnp.complex64)
    w = jnp.ones(3)
    gz, gw = jax.grad(loss, argnums=(0, 1))(z, w)
    r = gk.audit(loss, z, w, fix=False)
    assert r.gradients == (("z", int(np.sum(~np.isfinite(gz))), 3), ("w", int(np.sum(~np.isfinite(gw))), 3))
    assert r.findings[0].op == "log" and str(r.findings[0].root.elements[0]) == "z[1] = 0"


def test_a_complex_output_audits_the_gradient_of_its_real_part():
    z = jnp.array([1 + 1j, 0j], jnp.complex64)
    r = gk.audit(jnp.log, z, fix=False)  # holomorphic: the gradient jax.grad(holomorphic=True) gives
    assert r.gradients == (("x", 1, 2),) and r.findings[0].op == "log"
    out, vjp = jax.vjp(jnp.log, z)
    (g,) = vjp(jnp.ones_like(out))
    np.testing.assert_array_equal(np.isfinite(g), [True, False])


def test_integer_only_inputs_are_still_an_error():
    with pytest.raises(gk.GradkitError, match="no floating-point input to differentiate, real or complex"):
        gk.audit(lambda n: n * 2, 3)


# --------------------------------------------------------------------------- NaN/inf inputs masked on purpose


def _fd64(fn, args, pos, h=1e-6):
    """Float64 central differences of ``fn`` along every element of ``args[pos]`` (a NaN/inf element: 0, as
    ``-inf + h`` is ``-inf``)."""
    with jax.enable_x64(True):
        a64 = [np.asarray(a, np.float64) if np.asarray(a).dtype.kind == "f" else np.asarray(a) for a in args]
        f = jax.jit(fn)
        out = np.zeros(a64[pos].size)
        for i in range(out.size):
            plus, minus = [list(a64), list(a64)]
            for lst, s in ((plus, h), (minus, -h)):
                v = a64[pos].copy().reshape(-1)
                v[i] += s
                lst[pos] = v.reshape(a64[pos].shape)
            fp, fm = float(f(*plus)), float(f(*minus))
            out[i] = 0.0 if fp == fm else (fp - fm) / (2 * h)
    return out.reshape(np.shape(args[pos]))


def masked_attention(s, v):
    p = jax.nn.softmax(s, axis=-1)  # s holds -inf where masked, a whole row in a padded query
    kept = jnp.any(jnp.isfinite(s), axis=-1, keepdims=True)
    return jnp.sum(jnp.where(kept, p, 0.0) * v)


def nan_skipping_mean(w, x):
    return jnp.nanmean(x * w)  # x's NaNs are missing data


def _masked_cases():
    r = np.random.RandomState(3)
    s = r.normal(size=(3, 4)).astype(np.float32)
    s[1] = -np.inf
    s[0, 2] = -np.inf
    v = r.normal(size=(3, 4)).astype(np.float32)
    x = np.array([1.0, np.nan, 2.0, -0.5], np.float32)
    w = r.uniform(0.5, 2.0, 4).astype(np.float32)
    return [(masked_attention, (s, v), 0), (nan_skipping_mean, (w, x), 0)]


@pytest.mark.parametrize("fn,args,argnum", _masked_cases(), ids=["masked_attention", "nanmean"])
def test_inputs_non_finite_on_purpose_are_not_the_cause_and_routes_are_searched(fn, args, argnum):
    assert np.isfinite(fn(*args))  # the value is finite: the NaN/inf is masked on purpose
    g = jax.grad(fn, argnum)(*args)
    assert not np.all(np.isfinite(g)), "the case must break plain jax.grad"
    r = gk.audit(fn, *args, argnums=argnum)
    text = str(r)
    assert r.findings, text
    assert "already non-finite" not in text and "Check where these inputs come from" not in text, text
    assert r.note.startswith("the inputs hold NaN/inf but the value is finite") and "on purpose" in r.note
    fix = r.findings[0].fix
    assert fix.verified and fix.kind == "table", text
    # the route, applied independently as the report says, against float64 central differences
    fixed = jax.grad(gk.override(fn, eval(fix.expression, {"gk": gk})), argnum)(*args)
    assert np.all(np.isfinite(fixed))
    np.testing.assert_allclose(fixed, _fd64(fn, args, argnum), rtol=2e-3, atol=1e-5)


def test_a_nan_input_that_reaches_the_value_is_still_a_bad_batch():
    x = jnp.array([1.0, jnp.nan, 2.0])
    r = gk.audit(lambda w, x: jnp.mean(x * w), jnp.ones(3), x, argnums=0)  # mean, not nanmean
    assert not r.findings and r.value.startswith("NON-FINITE")
    assert r.note.startswith("the inputs are already non-finite: x[1] = nan")
    assert "Check where these inputs come from" in r.note
