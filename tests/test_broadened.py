"""gk.tables.BROADENED / broadened(eps): eigh and svd derivatives with Lorentzian-broadened 1/gap factors.

Where the spectrum is separated the rules give JAX's own gradient (and float64
finite differences); at repeated eigenvalues / singular values, where JAX's is
NaN (or round-off garbage), they give the gradient of every loss that depends
on a cluster only through what does not change inside it: the spectrum, the
projector onto the whole cluster, the polar factor. The last tests pin down
the documented limits (matrix functions, complex inputs, partial
decompositions).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

import gradkit as gk
from budget import covering
from gradkit import tables
from gradkit._src.rules import broadened as broadened_rules

B = tables.BROADENED
PROPERTY = settings(max_examples=8, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _orth(rng, n):
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.sign(np.diag(r))


def _sym(rng, n):
    x = rng.standard_normal((n, n))
    return (x + x.T) / 2


def _fd(f, a, h=1e-6):
    """Central finite differences in float64 of a scalar function of one matrix (JAX's forward pass only)."""
    with jax.enable_x64(True):
        a = np.asarray(a, np.float64)
        fj = jax.jit(f)
        g = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            e = np.zeros_like(a)
            e[idx] = h
            g[idx] = (float(fj(a + e)) - float(fj(a - e))) / (2 * h)
        return g


def _close(got, want, rtol):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), got
    err = np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol:.3g}\n got {got}\nwant {want}"
    return err


TOL = {np.float64: 1e-8, np.float32: 2e-4}


# ----------------------------------------------------------------------------- the table


def test_the_table_and_its_factory():
    assert set(B) == {"eigh", "svd"} and all(B[k].mode == "jvp" for k in B)
    d = tables.describe(B)
    assert d["eigh"].startswith("broadened: ") and "1/(w_j - w_i)" in d["eigh"]
    assert tables.describe(tables.broadened(1e-10))["svd"].startswith("broadened(eps=1e-10): ")
    assert B == tables.broadened() and B != tables.broadened(eps=1e-10)
    assert tables.broadened(1e-10) == gk.RuleTable.from_dict(
        {"eigh": {"rule": "broadened", "eps": 1e-10}, "svd": {"rule": "broadened", "eps": 1e-10}})
    assert "broadened" in tables.library() and "BROADENED" in tables.__all__ and "broadened" in tables.__all__
    assert tables.library()["broadened"].signature() == "broadened(op: str = <entry name>, eps: float (optional))"
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] gk.tables.broadened\(eps=.*`eps`.*finite number > 0"):
            tables.broadened(bad)
    with pytest.raises(gk.GradkitError, match=r"has no entry for op 'eig'.*eigh, svd"):
        gk.RuleTable.from_dict({"eig": "broadened"})


def test_the_primitives_it_names_are_the_ones_jax_traces():
    names = {e.primitive.name for e in jax.make_jaxpr(lambda a: jax.lax.linalg.eigh(a))(jnp.eye(3)).eqns}
    assert "eigh" in names
    for kw in ({"full_matrices": False}, {"full_matrices": True}, {"compute_uv": False}):
        text = str(jax.make_jaxpr(lambda a, kw=kw: jnp.linalg.svd(a, **kw))(jnp.ones((4, 3))))
        assert re.search(r"\bsvd\[", text)


# ----------------------------------------------------------------------------- separated spectra: JAX's gradient

M5 = _sym(np.random.default_rng(5), 5)


def eigh_loss(a, m):
    """Uses the eigenvalues and the eigenvectors (sign-invariant: squares and projectors)."""
    w, v = jnp.linalg.eigh(a)
    p = v[:, :2] @ v[:, :2].T
    return jnp.sum(w ** 3) + jnp.sum(p * m) + jnp.sum(v[:, -1] ** 2 * m[0])


def svd_loss(a, m):
    u, s, vt = jnp.linalg.svd(a, full_matrices=False)
    k = s.shape[0]
    pu, pv = u[:, :2] @ u[:, :2].T, vt[:2].T @ vt[:2]
    return (jnp.sum(s ** 3) + jnp.sum(pu * m[:a.shape[0], :a.shape[0]]) + jnp.sum(pv * m[:a.shape[1], :a.shape[1]])
            + jnp.sum((u @ vt) * m[:a.shape[0], :a.shape[1]]) + jnp.sum(u[:, k - 1] ** 2))


def _separated(rng, n, min_gap=0.05):
    """A random symmetric matrix whose eigenvalues are at least ``min_gap`` of the scale apart."""
    while True:
        a = _sym(rng, n)
        w = np.linalg.eigvalsh(a)
        if np.min(np.diff(w)) >= min_gap * np.max(np.abs(w)):
            return a


def _decomposition(x):
    w, v = jnp.linalg.eigh(x)
    return w, v[:, :1] @ v[:, :1].T  # the eigenvalues and a sign-invariant function of each vector


# Built once: each (n, dtype) compiles once across the examples.
EIGH_FNS = {name: (jax.jit(fn(gk.override(f, B))), jax.jit(fn(f))) for name, fn, f in [
    ("grad", jax.grad, eigh_loss),
    ("jvp", lambda g: lambda x, m, t: jax.jvp(lambda y: g(y, m), (x,), (t,))[1], eigh_loss),
    ("jacfwd", jax.jacfwd, _decomposition)]}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@given(seed=hst.integers(0, 2 ** 31 - 1), n=hst.integers(2, 4))
@PROPERTY
def test_eigh_equals_jax_on_separated_spectra(dtype, seed, n):
    rng = np.random.default_rng(seed)
    with jax.enable_x64(dtype == np.float64):
        a, m = jnp.asarray(_separated(rng, n), dtype), jnp.asarray(M5[:n, :n], dtype)
        t = jnp.asarray(_sym(rng, n), dtype)
        for name, args in [("grad", (a, m)), ("jvp", (a, m, t)), ("jacfwd", (a,))]:
            ours, theirs = EIGH_FNS[name]
            for got, want in zip(jax.tree.leaves(ours(*args)), jax.tree.leaves(theirs(*args))):
                _close(got, want, TOL[dtype])


def test_eigh_equals_jax_eagerly():
    """Without jit around the call (the override is still compiled), grad and jacfwd."""
    a, m = jnp.asarray(_separated(np.random.default_rng(1), 3), jnp.float32), jnp.asarray(M5[:3, :3], jnp.float32)
    _close(jax.grad(gk.override(eigh_loss, B))(a, m), jax.grad(eigh_loss)(a, m), TOL[np.float32])
    for got, want in zip(jax.jacfwd(gk.override(_decomposition, B))(a), jax.jacfwd(_decomposition)(a)):
        _close(got, want, TOL[np.float32])


def _sv_loss(y):
    return jnp.sum(jnp.linalg.svd(y, compute_uv=False) ** 2.5)  # compute_uv=False


# Built once: each (shape, dtype) compiles once. The references are JAX's own, jitted.
SVD_FNS = {name: (jax.jit(fn(gk.override(f, B))), jax.jit(fn(f))) for name, fn, f in [
    ("grad", jax.grad, svd_loss),
    ("jvp", lambda g: lambda x, m, t: jax.jvp(lambda y: g(y, m), (x,), (t,))[1], svd_loss),
    ("grad_s", jax.grad, _sv_loss), ("jacfwd_s", jax.jacfwd, _sv_loss)]}


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(4, 4), (5, 3), (3, 5)])
def test_svd_equals_jax_on_separated_spectra(dtype, shape):
    rng = np.random.default_rng(sum(shape))
    with jax.enable_x64(dtype == np.float64):
        while True:
            x = rng.standard_normal(shape)
            s = np.linalg.svd(x, compute_uv=False)
            if np.min(-np.diff(s)) >= 0.05 * s[0] and s[-1] >= 0.05 * s[0]:
                break
        a, m = jnp.asarray(x, dtype), jnp.asarray(M5, dtype)
        t = jnp.asarray(rng.standard_normal(shape), dtype)
        for name, args in [("grad", (a, m)), ("jvp", (a, m, t)), ("grad_s", (a,)), ("jacfwd_s", (a,))]:
            ours, theirs = SVD_FNS[name]
            _close(ours(*args), theirs(*args), TOL[dtype])


def test_svd_equals_jax_eagerly():
    """Without jit around the call (the override is still compiled)."""
    x = jnp.asarray(np.random.default_rng(3).standard_normal((4, 3)), jnp.float32)
    m = jnp.asarray(M5, jnp.float32)
    _close(jax.grad(gk.override(svd_loss, B))(x, m), SVD_FNS["grad"][1](x, m), TOL[np.float32])


def test_against_float64_finite_differences(x64, maybe_jit):
    rng = np.random.default_rng(11)
    a, m = _separated(rng, 4), M5[:4, :4]
    got = maybe_jit(jax.grad(gk.override(eigh_loss, B)))(a, m)
    _close(got, _fd(lambda x: eigh_loss(x, m), a), 1e-7)
    x = rng.standard_normal((5, 3))
    got = maybe_jit(jax.grad(gk.override(svd_loss, B)))(x, M5)
    _close(got, _fd(lambda y: svd_loss(y, M5), x), 1e-7)


def test_check_grads_to_second_order_on_a_separated_spectrum():
    """gk.check_grads, reverse mode, orders 1 and 2 (the rule transposed, then differentiated): float32 vs FD."""
    a = jnp.asarray(_separated(np.random.default_rng(12), 3), jnp.float32)
    m = jnp.asarray(M5[:3, :3], jnp.float32)
    report = gk.check_grads(gk.override(eigh_loss, B), (a, m), order=2, modes=("rev",))
    assert report.passed, str(report)


@pytest.mark.slow  # 5 s on 2 cores; the default set checks order 2 against finite differences (above)
def test_second_order_on_separated_spectra_equals_jax(x64):
    """Hessians, reverse over reverse too: the rule differentiated again (its diagonal 1/(w_i - w_i) underived)."""
    rng = np.random.default_rng(13)
    m = M5[:3, :3]
    cases = [(lambda x: eigh_loss(x, m), _separated(rng, 3)), (lambda x: svd_loss(x, M5), rng.standard_normal((3, 2)))]
    compositions = [[(jax.jacrev, jax.jacrev), (jax.jacfwd, jax.jacrev)], [(jax.jacrev, jax.jacrev)]]
    for (f, a), pairs in zip(cases, compositions):
        for outer, inner in pairs:
            _close(jax.jit(outer(inner(gk.override(f, B))))(a), jax.jit(outer(inner(f)))(a), 1e-9)


def test_batched_and_vmapped(x64):
    rng = np.random.default_rng(2)
    q = _orth(rng, 3)
    stack = np.stack([_separated(rng, 3), q @ np.diag([1.0, 1.0, 3.0]) @ q.T])

    def f(a):
        v = jnp.linalg.eigh(a)[1][..., :, :2]
        p = v @ jnp.swapaxes(v, -1, -2)
        return jnp.sum(p * jnp.broadcast_to(M5[:3, :3], p.shape))
    batched = jax.grad(gk.override(f, B))(stack)
    mapped = jax.vmap(jax.grad(gk.override(f, B)))(stack)
    one = [jax.grad(gk.override(f, B))(s) for s in stack]
    _close(batched, np.stack(one), 1e-10)
    _close(mapped, np.stack(one), 1e-10)
    _close(one[0], jax.grad(f)(stack[0]), 1e-8)
    _close(one[1], _projector_grad(stack[1], M5[:3, :3], [0, 1]), 1e-8)


# ----------------------------------------------------------------------------- degenerate eigh


def _projector_grad(a, m, cluster):
    """d tr(P_S m)/dA for the projector onto a whole cluster S (first-order perturbation theory, exact)."""
    w, v = np.linalg.eigh(np.asarray(a, np.float64))
    m = (m + m.T) / 2
    g = np.zeros((len(w), len(w)))
    for i in cluster:
        for j in set(range(len(w))) - set(cluster):
            c = 2 * (v[:, i] @ m @ v[:, j]) / (w[i] - w[j])
            g += c * (np.outer(v[:, i], v[:, j]) + np.outer(v[:, j], v[:, i])) / 2
    return g


def projector_loss(a, m):
    """tr(P m), P the projector onto the eigenvectors of the two smallest eigenvalues (a whole cluster here)."""
    v = jnp.linalg.eigh(a)[1][:, :2]
    return jnp.sum((v @ v.T) * m)


DEGENERATE = {  # name -> a matrix whose two smallest eigenvalues are 1 and 1
    "exact diag(1,1,3)": lambda rng: np.diag([1.0, 1.0, 3.0]),
    "block diag (1,1,2,4)": lambda rng: np.block([[np.eye(2), np.zeros((2, 2))],
                                                   [np.zeros((2, 2)), np.array([[3.0, 1.0], [1.0, 3.0]])]]),
    "rotated Q diag(1,1,3) Q^T": lambda rng: (lambda q: q @ np.diag([1.0, 1.0, 3.0]) @ q.T)(_orth(rng, 3)),
}


@pytest.mark.parametrize("name", sorted(DEGENERATE))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_eigh_projector_onto_a_degenerate_subspace(name, dtype, maybe_jit):
    rng = np.random.default_rng(7)
    a64 = DEGENERATE[name](rng)
    n = a64.shape[0]
    m64 = M5[:n, :n] + np.triu(np.ones((n, n)))  # not symmetric: only its symmetric part matters
    want = _projector_grad(a64, m64, [0, 1])
    with jax.enable_x64(dtype == np.float64):
        a, m = jnp.asarray(a64, dtype), jnp.asarray(m64, dtype)
        plain = np.asarray(jax.jit(jax.grad(projector_loss))(a, m), np.float64)
        # the need: JAX's 1/(w_j - w_i) is 1/0 (NaN) or 1/round-off (garbage) inside the cluster
        assert not np.all(np.isfinite(plain)) or np.max(np.abs(plain - want)) > 1e-3 * np.max(np.abs(want))
        got = maybe_jit(jax.grad(gk.override(projector_loss, B)))(a, m)
        _close(got, want, {np.float64: 1e-9, np.float32: 1e-5}[dtype])
        # forward mode agrees with reverse mode
        t = jnp.asarray(_sym(rng, n), dtype)
        fwd = maybe_jit(lambda x, t: jax.jvp(lambda y: gk.override(projector_loss, B)(y, m), (x,), (t,))[1])(a, t)
        _close(fwd, np.sum(want * np.asarray(t, np.float64)), {np.float64: 1e-9, np.float32: 1e-5}[dtype])
    if dtype == np.float64:
        _close(want, _fd(lambda x: projector_loss(x, m64), a64), 1e-7)  # the analytic answer is the true one


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_eigh_functions_of_the_spectrum_at_the_identity(dtype):
    """sum f(w): d/dA = V f'(w) V^T, the identity's f'(1) I; JAX has it too (its V cotangent is 0)."""
    with jax.enable_x64(dtype == np.float64):
        a = jnp.eye(4, dtype=dtype)
        for f, df in [(lambda w: w, lambda w: np.ones_like(w)), (jnp.exp, np.exp),
                      (lambda w: w ** 3, lambda w: 3 * w ** 2)]:
            loss = lambda x, f=f: jnp.sum(f(jnp.linalg.eigvalsh(x)))
            _close(jax.grad(gk.override(loss, B))(a), df(1.0) * np.eye(4), 1e-6)
            _close(jax.grad(gk.override(loss, B))(a), jax.grad(loss)(a), 1e-6)
        # the whole decomposition in one loss (the eigenvectors with zero weight): JAX's 0 * inf is NaN
        both = lambda x: (lambda w, v: jnp.sum(w ** 2) + 0.0 * jnp.sum(v))(*jnp.linalg.eigh(x))
        assert not np.all(np.isfinite(np.asarray(jax.grad(both)(a))))
        _close(jax.grad(gk.override(both, B))(a), 2 * np.eye(4), 1e-6)
        _close(jax.jacfwd(gk.override(both, B))(a), 2 * np.eye(4), 1e-6)


@given(seed=hst.integers(0, 2 ** 31 - 1), mult=hst.sampled_from([(2, 1, 1), (1, 3, 1), (2, 2, 1), (1, 1, 3)]),
       which=hst.integers(0, 2))
@PROPERTY
def test_eigh_property_whole_cluster_projectors(seed, mult, which):
    """Random orthogonal Q, clusters of random multiplicity, the projector onto one whole cluster."""
    rng = np.random.default_rng(seed)
    values = np.repeat(np.sort(rng.uniform(-3, 3, size=3)) + np.array([0.0, 1.0, 2.0]), mult)
    n = len(values)
    a = (lambda q: q @ np.diag(values) @ q.T)(_orth(rng, n))
    start = sum(mult[:which])
    cluster = list(range(start, start + mult[which]))
    m = rng.standard_normal((n, n))

    def loss(x, m):
        v = jnp.linalg.eigh(x)[1][:, start:start + mult[which]]
        return jnp.sum((v @ v.T) * m) + jnp.sum(jnp.linalg.eigvalsh(x) ** 2)

    want = _projector_grad(a, m, cluster) + 2 * a
    with jax.enable_x64(True):
        _close(jax.grad(gk.override(loss, B))(a, m), want, 1e-8)


def test_relative_eps_makes_the_gradient_scale_equivariant(x64):
    """P(cA) = P(A), so d/dA at cA is (d/dA at A) / c, for c = 1e-6 and 1e6: eps is relative to the scale."""
    rng = np.random.default_rng(3)
    q = _orth(rng, 3)
    a, m = q @ np.diag([1.0, 1.0, 3.0]) @ q.T + 0.0, M5[:3, :3]
    g1 = np.asarray(jax.grad(gk.override(projector_loss, B))(a, m))
    for c in (1e-6, 1e6):
        _close(c * np.asarray(jax.grad(gk.override(projector_loss, B))(c * a, m)), g1, 1e-8)
    # separated: a gap of 1e-3 of the scale is resolved at any scale (an absolute eps of 1e-12 would not at 1e-6)
    a2 = q @ np.diag([1.0, 1.001, 3.0]) @ q.T
    for c in (1e-6, 1.0, 1e6):
        _close(c * np.asarray(jax.grad(gk.override(projector_loss, B))(c * a2, m)),
               jax.grad(projector_loss)(a2, m), 1e-5)


def test_eps_sets_the_width():
    """A gap of 1e-4 of the scale: resolved (1/gap) with eps = 1e-12, treated as degenerate with eps = 1e-4."""
    with jax.enable_x64(True):
        f = broadened_rules.lorentzian
        x, scale = jnp.asarray(1e-4), jnp.asarray(1.0)
        assert float(f(x, scale, 1e-12)) == pytest.approx(1e4, rel=1e-3)
        assert float(f(x, scale, 1e-4)) == pytest.approx(1e-4 / (1e-8 + 1e-4))
        assert float(f(jnp.asarray(0.0), scale, 1e-12)) == 0.0
        assert float(jnp.max(f(jnp.linspace(-1, 1, 2001), scale, 1e-6))) <= 1 / (2 * 1e-3) * (1 + 1e-12)
        assert broadened_rules.effective_eps(None, jnp.float64) == 1e-12
        assert broadened_rules.effective_eps(None, jnp.float32) == 1e-9
        assert broadened_rules.effective_eps(1e-12, jnp.float32) == 1e-12


# ----------------------------------------------------------------------------- degenerate svd


def polar_loss(a, m):
    """The polar factor U V^T (the Kabsch rotation): smooth wherever A is invertible, repeated singular values too."""
    u, s, vt = jnp.linalg.svd(a)
    return jnp.sum((u @ vt) * m)


def _plain_is_wrong(loss, a, m, want):
    """JAX's own gradient is NaN or wrong at a repeated singular value: the failure the rule fixes.

    JAX 0.8 and 0.9 raise NotImplementedError for the derivative of ``svd(full_matrices=True)`` at every
    matrix (0.10 added it for square ones): there JAX has no gradient to compare, and gradkit's rule gives one.
    """
    try:
        plain = np.asarray(jax.jit(jax.grad(loss))(a, m), np.float64)
    except NotImplementedError:
        assert jax.__version_info__ < (0, 10), "JAX 0.10+ differentiates a square full-matrices svd"
        return True
    return not np.all(np.isfinite(plain)) or np.max(np.abs(plain - want)) > 1e-3 * np.max(np.abs(want))


def _polar_grad(a, m):
    """d tr(Q^T m)/dA, Q = U V^T: dQ = U (H o (dS - dS^T)) V^T, H_ij = 1/(s_i + s_j) (exact)."""
    u, s, vt = np.linalg.svd(np.asarray(a, np.float64))
    h = 1 / (s[:, None] + s[None, :])
    x = u.T @ m @ vt.T
    return u @ (h * (x - x.T)) @ vt


SVD_DEGENERATE = {
    "identity": lambda rng: np.eye(4),
    "exact diag(2,2,1,1)": lambda rng: np.diag([2.0, 2.0, 1.0, 1.0]),
    "rotated (2,2,1,0.5)": lambda rng: _orth(rng, 4) @ np.diag([2.0, 2.0, 1.0, 0.5]) @ _orth(rng, 4).T,
    "orthogonal": lambda rng: _orth(rng, 4),
}


# a covering half in the default set (each case, each dtype), all in the slow set
@pytest.mark.parametrize("name,dtype", covering(sorted(SVD_DEGENERATE), [np.float32, np.float64]))
def test_svd_polar_factor_at_repeated_singular_values(name, dtype):
    rng = np.random.default_rng(9)
    a64, m64 = SVD_DEGENERATE[name](rng), rng.standard_normal((4, 4))
    want = _polar_grad(a64, m64)
    with jax.enable_x64(dtype == np.float64):
        a, m = jnp.asarray(a64, dtype), jnp.asarray(m64, dtype)
        assert _plain_is_wrong(polar_loss, a, m, want)
        _close(jax.jit(jax.grad(gk.override(polar_loss, B)))(a, m), want, {np.float64: 1e-8, np.float32: 5e-5}[dtype])
        polar = lambda x: jnp.sum(jax.scipy.linalg.polar(x, method="svd")[0] * m)
        _close(jax.grad(gk.override(polar, B))(a), want, {np.float64: 1e-8, np.float32: 5e-5}[dtype])
    if dtype == np.float64:
        _close(want, _fd(lambda x: polar_loss(x, m64), a64), 1e-7)


def test_svd_broadens_only_the_degenerate_factor(x64):
    """Broadening 1/(s_j^2 - s_i^2) whole would zero the polar factor's derivative at the identity; split, it stays."""
    m = M5[:4, :4] + np.triu(np.ones((4, 4)))
    got = np.asarray(jax.grad(gk.override(polar_loss, B))(jnp.eye(4), m))
    _close(got, (m - m.T) / 2, 1e-12)  # dQ = asym(dA) at the identity
    assert np.max(np.abs(got)) > 0.1


def cluster_loss(a, m):
    """Projectors onto the left and right singular subspaces of the cluster s = (1, 1), and the singular values."""
    u, s, vt = jnp.linalg.svd(a)
    us, vs = u[:, 1:3], vt[1:3].T
    return jnp.sum((us @ us.T) * m) + jnp.sum((vs @ vs.T) * m.T) + jnp.sum(s ** 2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_svd_cluster_projectors(dtype):
    rng = np.random.default_rng(4)
    m64 = rng.standard_normal((4, 4))
    for a64 in (np.diag([3.0, 1.0, 1.0, 0.5]), _orth(rng, 4) @ np.diag([3.0, 1.0, 1.0, 0.5]) @ _orth(rng, 4).T):
        want = _fd(lambda x: cluster_loss(x, m64), a64)
        with jax.enable_x64(dtype == np.float64):
            a, m = jnp.asarray(a64, dtype), jnp.asarray(m64, dtype)
            assert _plain_is_wrong(cluster_loss, a, m, want)
            _close(jax.grad(gk.override(cluster_loss, B))(a, m), want, {np.float64: 1e-7, np.float32: 5e-5}[dtype])


def test_svd_low_rank(x64):
    """Rank-deficient matrices: zero singular values (1/s and 1/(0 + 0)) and the range projector."""
    rng = np.random.default_rng(6)
    m5 = rng.standard_normal((5, 5))

    def range_loss(a):
        u, s, vt = jnp.linalg.svd(a, full_matrices=False)
        return jnp.sum((u[:, :2] @ u[:, :2].T) * m5[:a.shape[0], :a.shape[0]]) + jnp.sum(s ** 2)

    cases = [  # the matrix, and whether JAX's own gradient is NaN there
        (np.diag([3.0, 1.0, 0.0, 0.0]), True),  # exact zeros: 1/(0^2 - 0^2)
        (np.pad(np.diag([2.0, 1.0]), ((0, 3), (0, 1))), None),
        (np.linalg.qr(rng.standard_normal((5, 5)))[0][:, :3] @ np.diag([2.0, 1.0, 0.0]) @ _orth(rng, 3).T, None)]
    for a, plain_nan in cases:
        got = jax.grad(gk.override(range_loss, B))(a)
        _close(got, _fd(range_loss, a), 1e-7)
        if plain_nan:
            assert not np.all(np.isfinite(np.asarray(jax.grad(range_loss)(a))))


@pytest.mark.parametrize("shape", [(5, 3), (3, 5)])
def test_svd_full_matrices_non_square(x64, shape):
    """JAX refuses full_matrices=True for a non-square matrix; the rule differentiates it (U_perp^T dU_perp = 0)."""
    rng = np.random.default_rng(8)
    a, m = rng.standard_normal(shape), rng.standard_normal((5, 5))

    def complement(x):  # the projector onto the complement of the range (of x or of x^T): gauge-invariant
        u, s, vt = jnp.linalg.svd(x, full_matrices=True)
        p = u[:, 3:] if shape[0] > shape[1] else vt[3:].T
        return jnp.sum((p @ p.T) * m) + jnp.sum(s ** 3)

    with pytest.raises(NotImplementedError):
        jax.grad(complement)(a)
    want = _fd(complement, a)
    _close(jax.grad(gk.override(complement, B))(a), want, 1e-7)
    t = rng.standard_normal(shape)
    _close(jax.jvp(gk.override(complement, B), (a,), (t,))[1], np.sum(want * t), 1e-7)


# ----------------------------------------------------------------------------- documented limits


def test_matrix_functions_at_a_degeneracy_are_finite_but_not_the_limit(x64):
    """tr(V diag(w) V^T m) = tr(A m): true gradient m; at the identity the broadened one keeps only diag(m).

    The true derivative of a matrix function has f'(w) inside a cluster (a divided difference); the
    broadening sets the cluster's 1/(w_j - w_i) to 0 and drops it. README/tables docstring say so.
    """
    m = M5[:3, :3]
    recon = lambda a: (lambda w, v: jnp.sum((v * w[None, :]) @ v.T * m))(*jnp.linalg.eigh(a))
    assert not np.all(np.isfinite(np.asarray(jax.grad(recon)(jnp.eye(3)))))
    got = np.asarray(jax.grad(gk.override(recon, B))(jnp.eye(3)))
    _close(got, np.diag(np.diag(m)), 1e-12)
    assert np.max(np.abs(got - m)) > 0.1
    # away from the degeneracy it is exact again
    a = np.diag([1.0, 2.0, 3.0])
    _close(jax.grad(gk.override(recon, B))(a), m, 1e-9)


def test_complex_inputs_and_partial_decompositions_are_refused():
    def f(a):
        return jnp.real(jnp.sum(jax.lax.linalg.eigh(a)[0]))  # lax: the op's line is the user's (not jnp's jit)

    a = jnp.eye(3, dtype=jnp.complex64)
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] rule gradkit.broadened\[eigh\] for op 'eigh' at "
                                              r".*test_broadened.py:\d+.*complex64\[3,3\].*Fix: leave this op out"):
        jax.grad(gk.override(f, B))(a)
    with pytest.raises(gk.GradkitError, match=r"broadened\[svd\] for op 'svd'.*complex64"):
        jax.grad(gk.override(lambda x: jnp.sum(jnp.linalg.svd(x, compute_uv=False)), B))(a)
    # subset_by_index: refused at trace time (CPU cannot run it anyway)
    part = lambda x: jnp.sum(jax.lax.linalg.eigh(x, subset_by_index=(0, 2))[1])
    with pytest.raises(gk.GradkitError, match=r"subset_by_index=\(0, 2\).*all 3 of them.*Fix: decompose in full"):
        jax.make_jaxpr(jax.grad(gk.override(part, B)))(jnp.eye(3))
    part = lambda x: jnp.sum(jax.lax.linalg.svd(x, subset_by_index=(0, 2), full_matrices=False)[1])
    with pytest.raises(gk.GradkitError, match=r"broadened\[svd\].*subset_by_index=\(0, 2\)"):
        jax.make_jaxpr(jax.grad(gk.override(part, B)))(jnp.eye(3))
