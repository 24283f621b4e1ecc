"""The audit's text report: the finding first (where, the op, the line, the fix and its re-run), short with many
leaves, each element once under the user's name for it, the fix in the user's own spelling (issue 29.2, 4-6)."""

import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk

HERE = os.path.relpath(__file__)  # reports show a source file relative to the working directory


def line_of(marker):
    with open(__file__) as f:
        return next(i for i, ln in enumerate(f, 1) if marker in ln and "line_of" not in ln)


# --------------------------------------------------------------------------- a Flax model of 100+ parameter leaves


def _flax_model(layers):
    nn = pytest.importorskip("flax.linen")

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            e = jnp.tanh(sum(nn.Dense(2)(x) for _ in range(layers)))
            d = jnp.linalg.norm(e[:, None, :] - e[None, :, :], axis=-1)  # FLAX-NORM
            return jnp.sum(d)

    net = Net()
    x = jnp.array([[0.1, 0.2], [0.3, -0.1], [0.5, 0.4]])
    params = net.init(jax.random.key(0), x)
    assert len(jax.tree_util.tree_leaves(params)) == 2 * layers

    def loss(params, x):
        return net.apply(params, x)
    return loss, params, x


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_a_flax_model_of_102_leaves_leads_with_the_birth_and_a_verified_fix():
    loss, params, x = _flax_model(51)
    r = gk.audit(loss, params, x)
    text = str(r)
    lines = text.splitlines()
    head = "\n".join(lines[:10])
    line = line_of("# FLAX-NORM")
    assert f"born at   {HERE}:{line}  `sqrt` in `norm` (backward pass)" in head, text
    assert "d = jnp.linalg.norm(e[:, None, :] - e[None, :, :], axis=-1)" in head  # the user's line
    assert "d = gk.stable.safe_norm(e[:, None, :] - e[None, :, :], axis=-1)" in head  # the rewritten line
    assert "re-run    verified: gradient finite, matches float64 finite differences" in head
    assert r.findings[0].fix.verified
    assert len(lines) <= 40, text
    assert "params: 102 arrays (f32, 306 elements)" in lines[0] and len(lines[0]) < 120
    flat = " ".join(ln.strip() for ln in lines)  # the report wraps long lines
    assert "params/params/* (102 arrays, 306 of 306 elements)" in flat
    assert "['Dense_7']['kernel']" not in text  # leaf names only with verbose and in JSON
    verbose = r.text(verbose=True)
    assert "params['params']['Dense_7']['kernel']" in verbose and len(verbose.splitlines()) > 100
    assert len(r.to_dict()["inputs"]) == 103


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_many_leaves_are_grouped_by_module_path_without_verbose():
    loss, params, x = _flax_model(51)
    r = gk.audit(loss, params, x, fix=False)
    lines = str(r).splitlines()
    assert lines[1].lstrip().startswith("born at"), lines[:3]
    assert len(lines) <= 40, "\n".join(lines)
    assert lines[0].startswith("FINDING  loss(params: 102 arrays (f32, 306 elements), x: f32[3,2])")
    text = " ".join(ln.strip() for ln in lines)  # wrapped lines joined
    assert ("gradient  non-finite in 312 of 312 elements, in 103 of 103 arrays: params/params/* (102 arrays, 306 "
            "of 306 elements); x (6 of 6") in text
    assert any("params['params']['Dense_50']['bias']: f32[2]" in ln for ln in r.text(verbose=True).splitlines())


def test_a_few_modules_are_one_group_each():
    nn = pytest.importorskip("flax.linen")

    class Small(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(3)(nn.Dense(3)(nn.Dense(3)(x)))
            return jnp.sum(jnp.sqrt(h * h))

    x = jnp.zeros((2, 3))
    params = Small().init(jax.random.key(0), x)
    r = gk.audit(lambda p, x: Small().apply(p, x), params, x, fix=False)
    text = " ".join(ln.strip() for ln in str(r).splitlines())
    assert "p/params/Dense_0/* (2 arrays, 12 of 12 elements)" in text, text
    assert "p/params/Dense_2/* (2 arrays" in text and "x (6 of 6" in text


# --------------------------------------------------------------------------- elements: once, named as the user wrote


def test_elements_are_named_by_the_user_expression_and_listed_once():
    def loss(w, x):
        return jnp.sum(jnp.where(w * x > 0, jnp.log(w * x), 0.0))

    r = gk.audit(loss, jnp.ones(3), jnp.array([1.0, 0.0, 2.0]), fix=False)
    assert str(r.findings[0].root.elements[0]) == "(w * x)[1] = 0"  # not "[1]: x = 0" (x is w * x here)

    def angle(p):
        y, x = p[:, 0], p[:, 1]
        return jnp.sum(jnp.arctan2(y, x))

    r = gk.audit(angle, jnp.array([[1.0, 2.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]), fix=False)
    line = next(ln for ln in str(r).splitlines() if ln.lstrip().startswith("elements  "))
    assert line.split("elements", 1)[1].strip() == "[1]: (y, x) = (0, 0), [2]: (y, x) = (0, 0)"

    def dist(e):
        diff = e[:, None, :] - e[None, :, :]
        d2 = jnp.sum(diff ** 2, axis=2)
        return jnp.sum(jnp.sqrt(d2))

    r = gk.audit(dist, jnp.arange(6.0).reshape(3, 2), fix=False)
    assert [str(e) for e in r.findings[0].root.elements] == ["d2[0,0] = 0", "d2[1,1] = 0", "d2[2,2] = 0"]


# --------------------------------------------------------------------------- the fix in the user's terms


def test_the_fix_keeps_the_users_axis_spelling_and_shows_the_rewritten_line():
    def pd(e):
        return jnp.sum(jnp.linalg.norm(e[:, None, :] - e[None, :, :], axis=-1))  # PD-NORM

    r = gk.audit(pd, jnp.arange(12.0).reshape(3, 4) / 10)
    fix = r.findings[0].fix
    assert fix.verified and fix.expression == "gk.stable.safe_norm(e[:, None, :] - e[None, :, :], axis=-1)"
    assert fix.rewritten.strip() == ("return jnp.sum(gk.stable.safe_norm(e[:, None, :] - e[None, :, :], axis=-1))"
                                     "  # PD-NORM")
    assert f"{line_of('# PD-NORM'):>5} | " + fix.rewritten in str(r)
    assert "axis=2" not in str(r)


def test_the_fix_quotes_the_line_that_defines_what_it_replaces():
    def pd(e):
        d2 = jnp.sum((e[:, None, :] - e[None, :, :]) ** 2, axis=-1)  # PD-D2
        return jnp.sum(jnp.sqrt(d2))  # PD-SQRT

    r = gk.audit(pd, jnp.arange(12.0).reshape(3, 4) / 10)
    fix = r.findings[0].fix
    assert fix.verified and fix.expression == "gk.stable.safe_norm(e[:, None, :] - e[None, :, :], axis=-1)"
    assert fix.rewritten.strip().startswith("return jnp.sum(gk.stable.safe_norm(e[:, None, :] - e[None, :, :], "
                                            "axis=-1))")
    assert (f"`d2 = jnp.sum((e[:, None, :] - e[None, :, :]) ** 2, axis=-1)` (line {line_of('# PD-D2')}) "
            "is then unused") in fix.advice


# --------------------------------------------------------------------------- re-run: what was done, or nothing claimed


def test_a_fix_not_re_run_claims_nothing():
    def loss(x):
        return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))

    r = gk.audit(loss, jnp.array([0.0, 1.0]), fix=False)
    fix = r.findings[0].fix
    assert not fix.verified and fix.verdict() == "not re-run, so not verified (audit ran with fix=False)"
    assert "re-run    not re-run, so not verified" in str(r)
    r = gk.audit(loss, jnp.array([0.0, 1.0]))
    assert r.findings[0].fix.verdict().startswith("verified: gradient finite")


# --------------------------------------------------------------------------- a library's own values: never a bare x


def _bad_sqrt_rule():
    return {"sqrt": gk.vjp_rule(lambda op, g: (g * 0.5 / op.outputs[0],), name="naive_sqrt")}


# The user's argument is `x` in each; every NaN/inf is born inside the library function the line calls: a jitted
# one (norm), one whose code the line's call runs (logsumexp), the body of a jit with a private name (std), and
# a table's rule applied inside one (norm with a rule for its sqrt).
LIBRARY_CASES = {
    "norm": (lambda x: jnp.linalg.norm(x), jnp.zeros((2, 2)), None),
    "norm over an axis": (lambda x: jnp.sum(jnp.linalg.norm(x, axis=-1)), jnp.array([[0.0, 0.0], [3.0, 4.0]]),
                          None),
    "logsumexp": (lambda x: jax.nn.logsumexp(x), jnp.full(3, -jnp.inf), None),
    "std": (lambda x: jnp.std(x), jnp.ones(3), None),
    "a rule inside norm": (lambda x: jnp.linalg.norm(x), jnp.zeros(3), "rule"),
}


@pytest.mark.parametrize("case", list(LIBRARY_CASES))
def test_a_value_inside_a_library_function_is_named_as_its_operand_not_as_the_users_x(case):
    """Issue 38.4: `elements [0,0]: x = 0` named norm's inner operand as if it were the user's own `x`."""
    f, x, table = LIBRARY_CASES[case]
    r = gk.audit(f, x, fix=False, table=_bad_sqrt_rule() if table else None)
    steps = [s for finding in r.findings for s in finding.chain]
    assert steps, str(r)
    user_x = np.asarray(x)
    for s in steps:
        assert not re.search(r"\bx\b", s.message), (case, s.message)  # "∂sqrt = inf (at 0)", not "(at x = 0)"
        for e in s.elements:
            for name, value in e.values:
                if name == "x":  # only where the operand is the audited input itself, at that element
                    assert len(e.index) == user_x.ndim and user_x[e.index] == value, (case, str(e))
                else:
                    assert name.startswith(f"`{s.op}`'s operand") or name == f"result of `{s.op}`", (case, str(e))
    elements = [ln for ln in str(r).splitlines() if ln.lstrip().startswith("elements  ")]
    assert elements and not any(re.search(r"(  |, )(\[[\d,]+\]: )?x = ", ln) for ln in elements), elements


def test_norms_inner_operand_is_named_with_the_function_it_is_in():
    r = gk.audit(lambda x: jnp.linalg.norm(x), jnp.zeros((2, 2)), fix=False)
    root = r.findings[0].root
    assert [str(e) for e in root.elements] == ["`sqrt`'s operand in `norm` = 0"]
    assert root.message == "backward of `sqrt`: cotangent 1 × ∂sqrt = inf (at 0) gave inf"
    assert "elements  `sqrt`'s operand in `norm` = 0" in str(r)
    # the user's own line keeps the user's names and the derivative's usual notation
    own = gk.audit(lambda x: jnp.sqrt(jnp.sum(x * x)), jnp.zeros(2), fix=False).findings[0].root
    assert own.message.startswith("backward of `sqrt`: cotangent 1 × ∂sqrt/∂x = inf (at x = 0)")
    assert [str(e) for e in own.elements] == ["jnp.sum(x * x) = 0"]
