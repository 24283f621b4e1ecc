"""Masks found by dataflow (gradkit._src.rules.liveness): where a path is masked, and where it is a value zero.

Work in progress on the SAFE redesign (issue 35): the analysis alone, on programs with JAX's jitted helpers
inlined. Each case states the elements whose derivative path through the singular op is masked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradkit._src import compat
from gradkit._src.core import liveness as L
from gradkit._src.core import masks as M

SINGULAR = ("sqrt", "log", "div", "acos")


def _dead(f, *args):
    c0 = jax.make_jaxpr(f)(*args)
    closed = jax.make_jaxpr(lambda *a: M._inline(c0.jaxpr, c0.consts, a, lambda e: False, lambda p, e: p))(*args)
    j = closed.jaxpr
    env = dict(zip(j.constvars, closed.consts))
    env.update(zip(j.invars, [jnp.asarray(a) for a in args]))
    for e in j.eqns:
        for v, o in zip(e.outvars, compat.bind(e, [compat.read_atom(env, a) for a in e.invars])):
            env[v] = o
    up_s = L.up_pass(j, None)
    static = {e.primitive.name: L.dead(e, up_s, L.down_pass(j, None, up_s), True) for e in j.eqns
              if e.primitive.name in SINGULAR}
    up = L.up_pass(j, env.__getitem__)
    down = L.down_pass(j, env.__getitem__, up)
    dyn = {e.primitive.name: L.dead(e, up, down, False) for e in j.eqns if e.primitive.name in SINGULAR}
    return static, dyn


X = jnp.array([0.0, 1.0, 4.0])
CASES = {
    "where": (lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)), X, [True, False, False]),
    "maximum": (lambda x: jnp.sum(jnp.maximum(jnp.sqrt(x), 0.5)), X, [True, False, False]),
    "constant_factor": (lambda x: jnp.sum(jnp.array([0.0, 1.0, 1.0]) * jnp.sqrt(x)), X, [True, False, False]),
    "contraction": (lambda x: jnp.array([0.0, 1.0, 1.0]) @ jnp.sqrt(x), X, [True, False, False]),
    "upstream_where": (lambda x: jnp.sum(jnp.sqrt(jnp.where(x > 0, x, 0.0))), X, [True, False, False]),
    "bool_mask": (lambda x: jnp.sum((x > 0).astype(x.dtype) * jnp.log(x)), X, [True, False, False]),
    "stop_gradient_factor": (lambda x: jnp.sum(jax.lax.stop_gradient(x) * jnp.sqrt(x)), X, [True, False, False]),
    # value zeros are not masks: JAX's answer stays
    "value_zero": (lambda x: jnp.sum(jnp.sqrt(x) ** 2), X, [False, False, False]),
    "varying_factor": (lambda x: jnp.sum(x * jnp.log(x)), X, [False, False, False]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_masked_elements(name):
    f, x, want = CASES[name]
    static, dyn = _dead(f, x)
    (op,) = set(static) & set(dyn)
    got = dyn[op][0]
    got = np.broadcast_to(np.asarray(got), np.shape(x)) if not isinstance(got, bool) else np.full(np.shape(x), got)
    np.testing.assert_array_equal(got, want)
    # statically: a mask is possible exactly where one is found at run time
    assert (static[op][0] is L.DYN) == bool(np.any(want))


# dot_general's liveness against a brute-force reference: every contracted term of the 0/1 masks, by einsum.
DOTS = {  # name: (lhs shape, rhs shape, ((lhs contracting, rhs contracting), (lhs batch, rhs batch)))
    "matvec": ((3, 4), (4,), (((1,), (0,)), ((), ()))),
    "matmul": ((2, 3), (3, 4), (((1,), (0,)), ((), ()))),
    "batched_attention": ((2, 3, 2, 4), (2, 5, 2, 4), (((3,), (3,)), ((0, 2), (0, 2)))),
    "batch_after_free": ((3, 2, 4), (4, 2, 5), (((2,), (0,)), ((1,), (1,)))),
    "two_contracted": ((2, 3, 4), (4, 3, 2), (((1, 2), (1, 0)), ((), ()))),
    "outer": ((3,), (2,), (((), ()), ((), ()))),
}


def _einsum_dims(sa, sb, dn):
    (lc, rc), (lb, rb) = dn
    letters = iter("abcdefghijklmnop")
    la = [next(letters) for _ in sa]
    lb_ = [next(letters) for _ in sb]
    for i, j in zip((*lc, *lb), (*rc, *rb)):
        lb_[j] = la[i]
    out = [la[i] for i in lb] + [la[i] for i in range(len(sa)) if i not in lc and i not in lb] + \
          [lb_[j] for j in range(len(sb)) if j not in rc and j not in rb]
    return "".join(la), "".join(lb_), "".join(out)


# the default set: three layouts that between them have every kind of dimension; all six in the slow set
_DOTS_DEFAULT = ("batched_attention", "two_contracted", "outer")


@pytest.mark.parametrize("name", [n if n in _DOTS_DEFAULT else pytest.param(n, marks=pytest.mark.slow)
                                  for n in sorted(DOTS)])
def test_dot_general_liveness_matches_brute_force(name):
    sa, sb, dn = DOTS[name]
    ea, eb, eo = _einsum_dims(sa, sb, dn)
    closed = jax.make_jaxpr(lambda x, y: jax.lax.dot_general(x, y, dn))(jnp.zeros(sa), jnp.zeros(sb))
    (eqn,) = closed.jaxpr.eqns
    so = tuple(eqn.outvars[0].aval.shape)
    rng = np.random.default_rng(sum(map(ord, name)))
    ops = L._Ops(False)

    def pattern(shape, kind):
        return {"all": True, "none": False, "some": rng.random(shape) < 0.4}[kind]

    def full(live, shape):
        return np.broadcast_to(np.asarray(live, bool), shape).astype(np.int64)

    trials, wants = [], []
    for ka, kb, kz in [(p, q, r) for p in ("all", "some", "none") for q in ("all", "some") for r in ("all", "some")]:
        up_a, up_b, d = pattern(sa, ka), pattern(sb, kb), pattern(so, kz)
        # a factor is a masking zero where it does not vary and its value is 0
        va = np.where(rng.random(sa) < 0.5, 0.0, 1.0).astype(np.float32)
        vb = np.where(rng.random(sb) < 0.5, 0.0, 1.0).astype(np.float32)
        nz_a, nz_b = full(up_a, sa) | (va != 0), full(up_b, sb) | (vb != 0)
        want_up = (np.einsum(f"{ea},{eb}->{eo}", full(up_a, sa), nz_b)
                   + np.einsum(f"{ea},{eb}->{eo}", nz_a, full(up_b, sb))) > 0
        want_a = np.einsum(f"{eo},{eb}->{ea}", full(d, so), nz_b) > 0
        want_b = np.einsum(f"{eo},{ea}->{eb}", full(d, so), nz_a) > 0
        trials.append((f"{ka}/{kb}/{kz}", up_a, up_b, d, va, vb))
        wants.append((want_up, want_a, want_b))

    def run(trials):
        got = []
        for _, up_a, up_b, d, va, vb in trials:
            values = {eqn.invars[0]: jnp.asarray(va), eqn.invars[1]: jnp.asarray(vb)}.__getitem__
            up = L._dot_up(ops, values, eqn, [up_a, up_b])
            down = L._dot_down(ops, values, eqn, [up_a, up_b], d)
            got.append([ops.array(x, s) for x, s in zip((up, *down), (so, sa, sb))])
        return got

    # under jit every case; without, a few (each op dispatched on its own is slow)
    for jit, picked in ((True, range(len(trials))), (False, (9,))):
        some = [trials[i] for i in picked]
        got = jax.jit(lambda some=some: run(some))() if jit else run(some)
        for i, g3 in zip(picked, got):
            for g, w, what in zip(g3, wants[i], ("up", "down lhs", "down rhs")):
                np.testing.assert_array_equal(np.asarray(g), w, err_msg=f"{name} {what} {trials[i][0]} jit={jit}")
