"""gk.audit: where a non-finite gradient is born, the fix, and its re-run.

The examples of ``examples/unstable_losses.py`` are audited once (module
fixture); for each, the report must name the primitive and the source line,
and the suggested fix must have been re-run to a finite gradient that matches
float64 finite differences. The fixed versions are then checked independently
against float64 autodiff of the original loss (exp(120) does not overflow in
float64).
"""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
import gradkit.stable  # noqa: F401  (the examples' fixed versions use it)
import gradkit.tables  # noqa: F401
from gradkit._src.audit.audit import audit

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples", "unstable_losses.py")


def _load_examples():
    spec = importlib.util.spec_from_file_location("unstable_losses", EXAMPLES)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


U = _load_examples()
INPUTS = U.GRADKIT_INPUTS()


def _line(marker):
    with open(EXAMPLES) as f:
        hits = [i + 1 for i, text in enumerate(f) if marker in text]
    assert len(hits) == 1, marker
    return hits[0]


# name -> (primitive, marker on the user's line, the library function it sits in, fix name)
EXPECTED = {
    "logistic_loss": ("exp", "jnp.log1p(jnp.exp(logits))", "", "gradkit.stable.log1pexp"),
    "gaussian_nll": ("log", "jnp.log(sigma) + 0.5", "", "gradkit.tables.SAFE"),
    "log_spectral_distance": ("log", "jnp.log(power)", "", "gradkit.tables.SAFE"),
    "pair_distance_loss": ("sqrt", "jnp.linalg.norm(", "norm", "gradkit.stable.safe_norm"),
    "angle_loss": ("atan2", "jnp.arctan2(", "", "gradkit.stable.safe_arctan2"),
    "masked_log_partition": ("log", "jax.nn.logsumexp(", "logsumexp", "gradkit.stable.logsumexp"),
    "path_length": ("sqrt", "jnp.sqrt(jnp.sum(", "", "gradkit.stable.safe_norm"),
}


class _Reports(dict):
    """Each example's audit, run when a test first asks for it and kept for the module: a worker that runs some
    of this file's tests (xdist may split a file) audits only their examples, once."""

    def __missing__(self, name):
        self[name] = report = audit(getattr(U, name), *INPUTS[name])
        return report


@pytest.fixture(scope="module")
def reports():
    return _Reports()


def test_every_example_is_declared_and_expected():
    assert set(INPUTS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_names_primitive_line_and_a_verified_fix(reports, name):
    op, marker, via, fix_name = EXPECTED[name]
    r = reports[name]
    assert not r.finite and not r.ok
    assert len(r.findings) == 1, str(r)
    f = r.findings[0]
    assert f.op == op
    assert f.location == f"examples/unstable_losses.py:{_line(marker)}" or f.location.endswith(
        f"unstable_losses.py:{_line(marker)}")
    assert f.root.via == via
    assert marker.split("(")[0] in f.root.code  # the source line is quoted
    assert f.fix is not None and f.fix.name == fix_name, str(r)
    assert f.fix.verified, f.fix.verdict()
    assert f.fix.max_rel_err < 2e-3 and f.fix.compared > 0
    assert "gradient finite, matches float64 finite differences" in f.fix.verdict()
    assert "re-run    " in str(r)


def test_forward_values_and_chain_are_reported(reports):
    f = reports["logistic_loss"].findings[0]
    assert [s.phase for s in f.chain] == ["forward", "backward"]
    assert f.chain[0].message == "`exp` overflowed to inf for 3 of 128 elements (max input 120)"
    assert f.chain[1].message.startswith("backward of `exp`: cotangent 0 × ∂exp/∂x = inf (at x = 95..120) gave NaN")
    g = reports["gaussian_nll"].findings[0]
    assert g.chain[0].message == "`log` of 0 gave -inf for 4 of 16 elements"
    assert "cotangent 0 × ∂log/∂x = inf (at x = 0) gave NaN for 4 of 16 elements" in g.chain[1].message
    a = reports["angle_loss"].findings[0]
    assert "(at (y, x) = (0, 0))" in a.root.message
    assert reports["logistic_loss"].value == "NON-FINITE (inf)"
    assert reports["gaussian_nll"].value.startswith("finite")
    assert dict((n, b) for n, b, _ in reports["pair_distance_loss"].gradients) == {"anchors": 4, "positives": 4}


def test_nan_inside_scan_says_so(reports):
    f = reports["path_length"].findings[0]
    assert f.where == f"inside scan at examples/unstable_losses.py:{_line('lax.scan(step')} (iteration 4 of 9)" or (
        "inside scan" in f.where and f.where.endswith("(iteration 4 of 9)"))
    assert "inside scan at" in str(reports["path_length"])


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_fixed_examples_match_float64_autodiff_of_the_original(x64):
    for name in ("logistic_loss", "pair_distance_loss", "angle_loss", "masked_log_partition"):
        args = INPUTS[name]
        fixed = jax.grad(getattr(U, name + "_fixed"))(*[jnp.asarray(a) for a in args])
        truth = jax.grad(getattr(U, name))(*[jnp.asarray(a, jnp.float64) if np.asarray(a).dtype == np.float32
                                             else jnp.asarray(a) for a in args])
        assert np.all(np.isfinite(fixed)), name
        ok = np.isfinite(truth)  # float64 autodiff is NaN only where the derivative does not exist
        assert ok.mean() > 0.7
        np.testing.assert_allclose(np.asarray(fixed)[ok], np.asarray(truth)[ok], rtol=2e-5, atol=1e-6, err_msg=name)
    safe = gk.override(U.gaussian_nll, gk.tables.SAFE)
    g = jax.grad(safe, argnums=1)(*INPUTS["gaussian_nll"])
    assert np.all(np.isfinite(g)) and np.all(np.asarray(g)[12:] == 0)  # padding gets a zero gradient


def test_nan_inside_cond_branch_and_jit():
    @jax.jit
    def f(x, flag):
        def branch_a(v):
            return jnp.sum(jnp.where(v > 0, jnp.log(v), 0.0))

        def branch_b(v):
            return jnp.sum(v)

        return lax.cond(flag > 0, branch_a, branch_b, x)

    r = audit(f, jnp.array([1.0, 0.0, 2.0]), 1.0)
    (finding,) = r.findings
    assert finding.op == "log"
    assert "inside cond branch 1 (of 2)" in finding.where
    assert finding.root.function.endswith("branch_a")
    assert finding.fix.name == "gradkit.tables.SAFE" and finding.fix.verified
    # the other branch has no log: finite, nothing to report
    assert audit(f, jnp.array([1.0, 0.0, 2.0]), -1.0).finite


def test_scan_iterations_are_listed():
    def f(xs):
        def body(c, x):
            return c + jnp.sqrt(x), None
        return lax.scan(body, 0.0, xs)[0]

    r = audit(f, jnp.array([1.0, 0.0, 4.0, 0.0, 0.0]))
    (finding,) = r.findings
    assert finding.op == "sqrt" and finding.root.phase == "backward"
    assert finding.where.endswith("(iterations 1, 3, 4 of 5)")
    assert finding.root.message.startswith("backward of `sqrt`: cotangent 1 × ∂sqrt/∂x = inf (at x = 0) gave inf")


def test_finite_gradient_has_no_finding_and_renders_ok():
    r = audit(lambda x, y: jnp.sum(jnp.sin(x) * y), jnp.ones(3), jnp.arange(3.0))
    assert r.finite and r.ok and r.findings == ()
    assert str(r).startswith("ok       <lambda>(x: f32[3], y: f32[3])")
    assert json.loads(json.dumps(r.to_dict()))["ok"] is True


def test_only_differentiated_paths_count():
    """log(y) at y = 0 is not on the path to x's gradient, as in jax.grad(argnums=0); stop_gradient blocks too."""
    def f(x, y):
        return jnp.sum(x * jnp.log(y))

    assert not audit(f, jnp.ones(2), jnp.zeros(2)).finite
    assert audit(f, jnp.ones(2), jnp.zeros(2), argnums=0).value.startswith("NON-FINITE")
    assert audit(f, jnp.ones(2), jnp.ones(2), argnums=0).finite
    r = audit(lambda x: jnp.sum(x + lax.stop_gradient(jnp.where(x > 0, jnp.log(x), 0.0))), jnp.zeros(2))
    assert r.finite


def test_rule_coverage_with_a_table():
    r = audit(U.gaussian_nll, *INPUTS["gaussian_nll"], table=gk.tables.SAFE)
    assert r.finite and r.findings == ()  # SAFE fixes this loss
    cov = r.coverage
    fired = dict(cov.fired)
    # (y - mu) / sigma and the mean's division; the product 0.5 * log(2 pi sigma^2)
    assert fired == {"div": 2, "integer_pow": 1, "log": 1, "mul": 1}
    assert "atan2" in cov.never and "log" not in cov.never
    assert cov.table_size == len(gk.tables.SAFE)
    assert f"4 of {len(gk.tables.SAFE)} rules fired (div x2, integer_pow x1, log x1, mul x1)" in str(r)


def test_a_table_rule_that_returns_inf_is_named():
    naive = gk.vjp_rule(lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),), name="half_safe_sqrt")
    r = audit(lambda x: jnp.sum(jnp.sqrt(x)), jnp.array([0.0, 1.0]), table={"sqrt": naive})
    (finding,) = r.findings
    assert finding.op == "sqrt" and finding.root.rule
    assert finding.root.message.startswith("the table's rule for `sqrt` returned a non-finite cotangent (inf")
    assert dict(r.coverage.fired) == {"sqrt": 1}


def test_sweep_finds_breaking_inputs_and_reports_progress():
    seen = []
    r = audit(lambda x: jnp.sum(jnp.sqrt(x * x + 1.0) * jnp.log1p(x * x)), jnp.ones(3), sweep=True,
              progress=lambda done, total, label: seen.append((done, total)))
    assert r.finite  # finite at the given inputs…
    assert not r.ok and r.sweep  # …but not everywhere
    assert r.probes == seen[-1][1] and seen[-1][0] == seen[-1][1]
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    broken = {p.probe for p in r.sweep}
    assert "x = 1e30 (all elements)" in broken  # x*x overflows to inf: inf/inf in the backward
    assert "x = 1 (all elements)" not in broken
    assert "probes break the gradient" in str(r)


def test_report_is_json_serialisable(reports):
    d = json.loads(json.dumps(reports["masked_log_partition"].to_dict()))
    f = d["findings"][0]
    assert f["op"] == "log" and f["fix"]["verified"] is True
    assert f["fix"]["name"] == "gradkit.stable.logsumexp" and f["fix"]["checked_with"] == ""  # re-run as itself
    assert f["fix"]["expression"] == "gk.stable.logsumexp(masked, axis=-1)" and f["fix"]["value_same"] is True
    assert d["gradients"] == [{"input": "scores", "nonfinite": 6, "size": 24}]


def test_no_float_input_is_an_error():
    with pytest.raises(gk.GradkitError, match="no floating-point input"):
        audit(lambda n: n * 2, 3)


def test_replay_matches_jax_grad_through_every_kind_of_equation():
    """The step-by-step replay does JAX's arithmetic: jit, scan, cond, fori/while, remat, custom rules, named ops."""
    from gradkit._src import compat
    from gradkit._src.audit.replay.replay import Replay

    @jax.custom_vjp
    def cube(x):
        return x**3

    cube.defvjp(lambda x: (x**3, x), lambda x, g: (3 * g * x * x,))
    act = gk.op("audit_test_act")(lambda x, scale=2.0: jnp.tanh(x) * scale)
    inner = gk.override(jnp.sqrt, {"sqrt": gk.vjp_rule(lambda op, g: g * 0.5 / op.outputs[0])})

    def zoo(x, y):
        a = jax.nn.relu(x) + jax.nn.softplus(y) + jax.nn.gelu(x)
        b = cube(a) + act(a, scale=3.0)
        c = jax.checkpoint(lambda v: jnp.sin(v) * v)(b)
        s, ys = lax.scan(lambda carry, xi: (carry * 0.9 + jnp.cos(xi * carry), carry**2), jnp.float32(0.5), c)
        d = lax.cond(s > 0, jnp.exp, lambda v: -v, c)
        k = lax.fori_loop(0, 3, lambda i, v: v * 1.1 + jnp.sin(v), d)
        w = lax.while_loop(lambda q: q[0] < 3, lambda q: (q[0] + 1, q[1] * 2.0), (0, lax.stop_gradient(y)))[1]
        return (jnp.sum(k * w) + jnp.sum(ys) + jnp.sum(inner(y * y + 1.0)) + jnp.linalg.norm(x)
                + jax.nn.logsumexp(y))

    x = jnp.array([0.3, -0.2, 1.1])
    y = jnp.array([0.5, 1.5, -0.7])
    jaxpr, consts = compat.jaxpr_parts(jax.make_jaxpr(zoo)(x, y))
    replay = Replay()
    frame = replay.forward(jaxpr, consts, [x, y], [True, True])
    (out,) = frame.outputs()
    gx, gy = (c[0] for c in replay.backward(frame, [(jnp.ones_like(out), None)]))
    want_x, want_y = jax.grad(zoo, argnums=(0, 1))(x, y)
    np.testing.assert_allclose(out, zoo(x, y), rtol=1e-6)
    np.testing.assert_allclose(gx, want_x, rtol=2e-6)
    np.testing.assert_allclose(gy, want_y, rtol=2e-6)
    assert not replay.births


def test_forward_birth_inside_a_while_loop_and_float64(x64):
    def f(x):
        def body(c):
            i, v = c
            return i + 1, v * jnp.where(i == 2, jnp.exp(v * 400.0), 1.0)  # overflows in float64 too

        _, s = lax.while_loop(lambda c: c[0] < 4, body, (0, lax.stop_gradient(x)))
        return jnp.sum(x * s)

    r = audit(f, jnp.array([1.0, 2.0]))
    assert r.inputs == ("x: f64[2]",)
    f0 = r.findings[0]
    assert f0.op == "exp" and f0.root.phase == "forward"
    # jnp.where evaluates exp on every iteration; the first occurrence's values are shown
    assert f0.where.startswith("inside while_loop at") and f0.where.endswith("(iterations 0, 1, 2)")
    assert f0.root.message == "`exp` overflowed to inf for 1 of 2 elements (max input 800)"
