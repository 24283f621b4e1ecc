"""The audit's float64 reference (audit_verify.py): the differences of many inputs in few compilations, and a
tolerance from the scale of the whole gradient, so that an input whose gradient is exactly 0 does not reject a
right fix on float32 rounding.

Every expected value here is computed independently: ``jax.grad`` of the same function in float64.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src.audit import verify as audit_verify
from gradkit._src.checks import fd
from gradkit._src.audit.program import make_program
from gradkit._src.audit.verify import Reference

F32 = np.float32


def grad64(f, args, argnums):
    with jax.enable_x64(True):
        return [np.asarray(g) for g in jax.grad(f, argnums)(*(jnp.asarray(a, jnp.float64) for a in args))]


# --------------------------------------------------------------------------- a leaf whose gradient is exactly 0


def _shift_invariant(w, b, x, norm):
    h = jnp.tanh(x @ w) + b[None, :]  # b shifts every row: the pairwise distances do not see it
    return jnp.sum(norm(h[:, None, :] - h[None, :, :], axis=-1))


W = np.asarray(jax.random.normal(jax.random.key(1), (3, 4)), F32)
B = np.array([0.3, -0.2, 0.1, 0.5], F32)
X = np.asarray(jax.random.normal(jax.random.key(2), (5, 3)), F32)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_a_right_fix_is_verified_where_one_input_has_a_zero_gradient():
    naive = lambda w, b, x: _shift_invariant(w, b, x, jnp.linalg.norm)
    fixed = lambda w, b, x: _shift_invariant(w, b, x, gk.stable.safe_norm)
    gw64, gb64 = grad64(fixed, (W, B, X), (0, 1))
    assert np.max(np.abs(gb64)) < 1e-14 * np.max(np.abs(gw64))  # b's gradient: 0 but for float64 rounding
    gw32, gb32 = (np.asarray(g) for g in jax.grad(fixed, (0, 1))(W, B, X))
    assert np.any(gb32 != 0)  # float32 rounding: the noise a per-input tolerance of 0 rejected
    np.testing.assert_allclose(gw32, gw64, rtol=1e-5, atol=1e-6)  # the fix is right

    r = gk.audit(naive, W, B, X, argnums=(0, 1))
    fix = r.findings[0].fix
    assert fix is not None and fix.verified, str(r)
    assert "safe_norm" in str(r) and "verified" in str(r), str(r)


def test_the_absolute_tolerance_is_the_scale_of_the_whole_gradient():
    f = lambda w, b, x: _shift_invariant(w, b, x, gk.stable.safe_norm)
    ref = Reference(make_program(f, (W, B, X), (0, 1)))
    gw64, gb64 = grad64(f, (W, B, X), (0, 1))
    scale = float(np.max(np.abs(gw64)))
    d = ref.differences()
    np.testing.assert_allclose(d[0].central, gw64.reshape(-1)[d[0].coords], rtol=1e-6)
    assert np.all(np.abs(d[1].central) <= 1e-8 * scale)

    gw32 = gw64.astype(F32)
    noise = np.array([1e-7, -1e-7, 0.0, 2e-7], F32) * scale  # float32 rounding of a zero gradient
    ok = ref.compare([gw32, noise])
    assert ok.matches and ok.compared == 16
    assert ok.max_rel_err < 2e-3  # relative to max(|reference|, a tenth of the scale): no 1e292
    wrong = ref.compare([gw32, np.array([0.05, 0.0, 0.0, 0.0], F32) * scale])  # 5% of the scale: an error
    assert wrong.matches is False and 0.3 < wrong.max_rel_err < 1.0
    off = gw32.copy()
    off[0, 0] *= 1.01  # 1% off where the reference is not small
    assert ref.compare([off, noise]).matches is False


def test_an_all_zero_reference_takes_only_a_zero_gradient():
    f = lambda b, x: jnp.sum((x + b[None, :]) - jnp.mean(x + b[None, :], axis=0, keepdims=True))  # 0 for every b
    ref = Reference(make_program(f, (B, X[:, :1].repeat(4, 1)), 0))
    assert ref.compare([np.zeros(4, F32)]).matches
    assert ref.compare([np.full(4, 1e-3, F32)]).matches is False


# --------------------------------------------------------------------------- few compilations for many inputs


def _traced(n_leaves, sizes=None):
    """The number of times the function is traced for the reference of ``n_leaves`` inputs."""
    sizes = sizes or [3 + (k % 5) for k in range(n_leaves)]
    rng = np.random.RandomState(0)
    leaves = [rng.normal(size=n).astype(F32) for n in sizes]
    count = [0]

    def f(*ps):
        count[0] += 1
        return sum(jnp.sum(jnp.sin(p) * (k + 1)) for k, p in enumerate(ps))

    ref = Reference(make_program(f, tuple(leaves), tuple(range(len(leaves)))))
    count[0] = 0
    d = ref.differences()
    traced = count[0]
    g64 = grad64(f, leaves, tuple(range(len(leaves))))
    atol = 1e-7 * max(float(np.max(np.abs(g))) for g in g64)  # float64 rounding of a sum of many terms
    for dk, gk_ in zip(d, g64):
        np.testing.assert_allclose(dk.central, gk_[dk.coords], rtol=1e-6, atol=atol)
        if len(dk.dirs):
            np.testing.assert_allclose(dk.dir_central, dk.dirs @ gk_, rtol=1e-6)
    return traced, d


def test_many_small_inputs_are_one_compilation():
    few, _ = _traced(4)
    many, d = _traced(80)
    assert many == few == 1
    assert all(dk.usable.all() for dk in d)


def test_a_large_input_is_evaluated_alone_its_directions_with_the_same_compilation():
    big = audit_verify._GROUP // 8 + 10  # float64 elements: more than one group holds
    count, d = _traced(6, [3, 4, big, 5, 600, 2])
    assert count == 2  # the small inputs together, the large one alone (coordinates and directions)
    assert len(d[2].coords) == audit_verify._LARGE_COORDS and len(d[2].dirs) == audit_verify._DIRECTIONS
    assert len(d[4].coords) == audit_verify._COORDS and len(d[4].dirs) == audit_verify._DIRECTIONS
    assert audit_verify._groups([np.zeros(n) for n in (3, 4, big, 5, 600, 2)]) == [[0, 1, 3, 4, 5], [2]]


def test_batches_hold_at_most_the_budget(monkeypatch):
    seen = []
    real = audit_verify.batch_size

    def spy(x, points):
        c = real(x, points)
        seen.append((fd.nbytes(x), c, points))
        return c

    rng = np.random.RandomState(1)
    leaves = [rng.normal(size=n).astype(F32) for n in (7, 300, 40)]
    f = lambda *ps: sum(jnp.sum(jnp.cos(p) * p) for p in ps)
    whole = Reference(make_program(f, tuple(leaves), (0, 1, 2))).differences()
    monkeypatch.setattr(audit_verify, "batch_size", spy)
    monkeypatch.setattr(fd, "BUDGET", 5 * 2 * 347 * 8)  # 5 points per batch: a copy and a perturbation each
    split = Reference(make_program(f, tuple(leaves), (0, 1, 2))).differences()
    assert seen and all(c * b <= fd.BUDGET and c < p for b, c, p in seen)
    for a, b in zip(whole, split):
        np.testing.assert_array_equal(a.coords, b.coords)
        np.testing.assert_array_equal(a.usable, b.usable)
        np.testing.assert_allclose(a.central, b.central, rtol=1e-6, atol=1e-7)  # another program's rounding
        np.testing.assert_allclose(a.dir_central, b.dir_central, rtol=1e-6)


def test_the_inputs_not_perturbed_are_passed_exactly():
    # -0.0 in one input, differentiated with respect to another of the same group: adding a zero step
    # would make it +0.0 and flip the sign the gradient depends on
    f = lambda a, b: jnp.sum(jnp.copysign(1.0, a) * b)
    a, b = np.array([-0.0, 1.0, -0.0], F32), np.array([2.0, 3.0, 4.0], F32)
    d = Reference(make_program(f, (a, b), (0, 1))).differences()
    np.testing.assert_allclose(d[1].central, [-1.0, 1.0, -1.0], rtol=1e-9)
    assert grad64(f, (a, b), (1,))[0].tolist() == [-1.0, 1.0, -1.0]


def test_a_function_that_needs_concrete_values_is_evaluated_point_by_point():
    f = lambda w, b: jnp.asarray(np.sum(np.sin(np.asarray(w)) * np.asarray(b)))  # no tracing: no jit, no vmap
    w, b = np.array([0.5, -1.0, 2.0], F32), np.array([1.5, 0.25, -2.0], F32)
    d = Reference(make_program(f, (w, b), (0, 1))).differences()
    w64, b64 = w.astype(np.float64), b.astype(np.float64)
    np.testing.assert_allclose(d[0].central, np.cos(w64) * b64, rtol=1e-6)
    np.testing.assert_allclose(d[1].central, np.sin(w64), rtol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_programs_run_once_compute_what_jit_computes(dtype):
    # The audit compiles the programs it runs once without LLVM's optimisation passes (program.RUN_ONCE): the
    # values and gradients of jax.jit's within a few roundings (a float32 sum here differs by 1 ULP: the passes
    # vectorise reductions), and the same elements finite.
    from gradkit._src.audit.program import gradient

    k = jax.random.split(jax.random.key(3), 3)
    x, w = jax.random.normal(k[0], (16, 24), dtype), jax.random.normal(k[1], (24, 24), dtype)
    mask = jax.random.bernoulli(k[2], 0.8, (16, 24))

    def attention_like(x, w):
        s = jnp.where(mask, (x @ w) / 4.0, -1e4)
        h = jax.nn.softmax(s, axis=-1) @ jnp.tanh(w) + jnp.log1p(jnp.exp(-jnp.abs(x)))
        return [jnp.mean(h * jax.nn.gelu(x)), jnp.sum(jnp.sqrt(jnp.abs(h) + 1e-3) * jnp.sin(x))]

    out, g = gradient(attention_like, [x, w])

    def run(x, w):
        o, vjp = jax.vjp(attention_like, x, w)
        return o, vjp([jnp.ones_like(v) for v in o])

    want_out, want_g = jax.jit(run)(x, w)
    for got, want in zip([*out, *g], [*want_out, *want_g]):
        want = np.asarray(want, np.float64)
        np.testing.assert_array_equal(np.isfinite(got), np.isfinite(want))
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=8 * float(jnp.finfo(dtype).eps),
                                   atol=8 * float(jnp.finfo(dtype).eps) * float(np.max(np.abs(want))))
