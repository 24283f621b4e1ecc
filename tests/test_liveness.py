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
