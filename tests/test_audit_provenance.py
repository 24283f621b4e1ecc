"""gk.audit names exactly the elements whose NaN/inf reaches the gradient, with their values.

Each pattern mixes good and bad elements. The independent reference is JAX
itself: the elements where ``jax.grad`` is non-finite must be exactly the
elements the findings name (every function here is element-wise, so an
element of an op and of the input coincide). Elements that are non-finite in
the forward pass but do not reach the gradient must not be named.
"""

import jax
import jax.numpy as jnp
import numpy as np

import gradkit as gk


def _bad_grad(f, x):
    return [(int(i),) for i in np.flatnonzero(~np.isfinite(np.asarray(jax.grad(f)(x))))]


def _elements(step):
    return [(e.index, dict(e.values)) for e in step.elements]


def _step(finding, op, phase):
    (s,) = [s for s in finding.chain if s.op == op and s.phase == phase]
    return s


def test_where_guarded_log_names_only_the_zero(maybe_jit):
    def f(x):
        return jnp.sum(jnp.where(x > 0, jnp.log(x), 0.0))

    x = jnp.array([-1.0, -0.5, 0.0, 0.5, 1.0])
    assert _bad_grad(f, x) == [(2,)]  # log(-1) is NaN forward, but its gradient 0 / -1 is finite
    r = gk.audit(maybe_jit(f), x)
    (finding,) = r.findings
    root = finding.root
    assert (finding.op, root.phase) == ("log", "forward")
    assert root.message == "`log` of 0 gave -inf for 1 of 5 elements"
    assert _elements(root) == [((2,), {"x": 0.0})]
    assert _elements(_step(finding, "log", "backward")) == [((2,), {"x": 0.0})]
    assert r.nonfinite_at == (("x", ((2,),)),)
    text = str(r)
    assert "elements  x[2] = 0" in text and "non-finite in x (1 of 5: x[2])" in text
    assert "-0.5" not in text and "outside its domain" not in text


def test_where_guarded_sqrt_names_the_negatives_and_the_zero_apart(maybe_jit):
    def f(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))

    x = jnp.array([-1.0, 0.0, 4.0, -2.0, 9.0])
    bad = _bad_grad(f, x)
    assert bad == [(0,), (1,), (3,)]
    r = gk.audit(maybe_jit(f), x)
    domain, zero = r.findings  # two independent births: NaN forward at x < 0, 0·inf backward at x == 0
    assert (domain.op, domain.root.phase, zero.op, zero.root.phase) == ("sqrt", "forward", "sqrt", "backward")
    assert _elements(domain.root) == [((0,), {"x": -1.0}), ((3,), {"x": -2.0})]
    assert "outside its domain" in domain.root.message
    assert _elements(zero.root) == [((1,), {"x": 0.0})]
    assert zero.root.message.startswith("backward of `sqrt`: cotangent 0 × ∂sqrt/∂x = inf (at x = 0) gave NaN")
    assert sorted(e.index for f_ in r.findings for e in f_.root.elements) == bad


def test_exp_overflow_names_the_overflowed_elements(maybe_jit):
    def f(x):
        return jnp.sum(jnp.where(x < 150.0, jnp.exp(x), 0.0))

    x = jnp.array([1.0, 100.0, 2.0, 200.0, 3.0])
    assert _bad_grad(f, x) == [(1,), (3,)]  # inf at 100 (used), NaN at 200 (0·inf: masked)
    r = gk.audit(maybe_jit(f), x)
    (finding,) = r.findings
    assert finding.root.message == "`exp` overflowed to inf for 2 of 5 elements (max input 200)"
    assert _elements(finding.root) == [((1,), {"x": 100.0}), ((3,), {"x": 200.0})]
    assert _elements(_step(finding, "exp", "backward")) == [((3,), {"x": 200.0})]


def test_zero_times_inf_names_the_product_and_the_masked_overflow():
    s = jnp.array([0.0, 1.0, 0.0, 1.0])

    def f(x):
        return jnp.sum(jnp.tanh(s * jnp.exp(x)))

    x = jnp.array([100.0, 100.0, 1.0, 1.0])
    assert _bad_grad(f, x) == [(0,), (1,)]
    (finding,) = gk.audit(f, x).findings
    assert _elements(finding.root) == [((0,), {"x": 100.0}), ((1,), {"x": 100.0})]
    mul = _step(finding, "mul", "forward")  # 0·inf = NaN in the forward pass, at element 0 only
    assert mul.message.startswith("`mul` 0·inf gave NaN for 1 of 4 elements")
    assert _elements(mul) == [((0,), {"s": 0.0, "jnp.exp(x)": np.inf})]  # named as the line writes them
    # element 1: tanh(inf) = 1 is finite, but exp's backward multiplies its zero cotangent by inf
    assert _elements(_step(finding, "exp", "backward")) == [((1,), {"x": 100.0})]


def test_inf_minus_inf_is_told_apart_from_an_inf_reaching_sin():
    def f(x):
        return jnp.sum(jnp.sin(jnp.exp(x) - jnp.exp(2.0 * x)))

    x = jnp.array([1.0, 100.0, 50.0, -3.0])
    assert _bad_grad(f, x) == [(1,), (2,)]
    r = gk.audit(f, x)
    first, second = r.findings  # the two exps overflow independently
    assert _elements(first.root) == [((1,), {"x": 100.0})]
    assert _elements(second.root) == [((1,), {"2.0 * x": 200.0}), ((2,), {"2.0 * x": 100.0})]  # exp's operand
    assert str(second.root.elements[0]) == "(2.0 * x)[1] = 200"  # the user's expression, not the input x
    for finding in r.findings:
        sub = _step(finding, "sub", "forward")
        assert sub.message.startswith("`sub` inf - inf gave NaN for 1 of 4 elements")
        assert _elements(sub) == [((1,), {"jnp.exp(x)": np.inf, "jnp.exp(2.0 * x)": np.inf})]
    sin = _step(second, "sin", "forward")  # exp(50) - exp(100) = -inf: sin(-inf), not inf - inf
    assert _elements(sin) == [((2,), {"jnp.exp(x) - jnp.exp(2.0 * x)": -np.inf})]
    assert all(s.op != "sin" for s in first.chain)


def test_long_element_lists_are_capped():
    x = jnp.where(jnp.arange(100) % 3 == 0, 0.0, jnp.linspace(0.5, 2.0, 100))

    def f(v):
        return jnp.sum(jnp.where(v > 0, jnp.log(v), 0.0))

    r = gk.audit(f, x)
    root = r.findings[0].root
    assert root.count == 34 and len(root.elements) == 16
    assert [e.index for e in root.elements] == [(3 * k,) for k in range(16)]
    line = next(ln for ln in str(r).splitlines() if ln.lstrip().startswith("elements"))
    assert line.endswith("v[0] = 0, v[3] = 0, v[6] = 0, v[9] = 0, v[12] = 0, v[15] = 0 (and 28 more)")
    assert "non-finite in v (34 of 100: v[0], v[3], v[6], v[9], v[12], v[15], ...)" in str(r)


def test_elements_inside_a_scan_keep_their_iterations():
    def f(xs):
        def body(c, x):
            return c + jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)), None
        return jax.lax.scan(body, 0.0, xs)[0]

    xs = jnp.array([[1.0, 2.0], [1.0, 0.0], [3.0, 4.0], [0.0, 5.0]])
    assert _bad_grad(f, xs) == [(3,), (6,)]  # flat indices of [1, 1] and [3, 0]
    (finding,) = gk.audit(f, xs).findings
    assert finding.where.endswith("(iterations 1, 3 of 4)")
    root = finding.root
    assert [(e.iteration, e.index) for e in root.elements] == [(1, (1,))]  # the first iteration's elements


def test_every_suggested_stable_function_exists():
    from gradkit._src.audit import patterns as audit_patterns

    names = {p.function for p in audit_patterns.PATTERNS}  # the rewrites audit re-runs and suggests
    missing = [n for n in sorted(names) if not callable(getattr(gk.stable, n, None))]
    assert missing == [] and {"log1pexp", "logsumexp", "safe_norm", "log_sigmoid", "safe_arccos"} <= names
