"""The sweep probes every input kind: masks, indices, floats; and says what it probed per input (issue 29.1)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk
from gradkit._src.audit.sweep import BUDGET, Sweep


def attention(scores, v, mask):
    """Masked-softmax attention: a fully masked row is NaN forward, dropped by a where; its gradient is NaN."""
    s = jnp.where(mask, scores, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    valid = mask.any(-1)
    return jnp.sum(jnp.where(valid[:, None], p @ v, 0.0))


def _random_mask():
    for seed in range(100):  # a bernoulli(0.7) mask with no all-False row: the case that passed before
        mask = jax.random.bernoulli(jax.random.key(seed), 0.7, (8, 5))
        if bool(mask.any(-1).all()):
            return mask
    raise AssertionError("no mask without a fully masked row")


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_sweep_finds_a_fully_masked_row_from_a_random_mask():
    mask = _random_mask()
    scores = jax.random.normal(jax.random.key(1), (8, 5))
    v = jax.random.normal(jax.random.key(2), (5, 3))
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.grad(attention, (0, 1))(scores, v, mask))
    r = gk.audit(attention, scores, v, mask, table=gk.tables.SAFE, sweep=True)
    assert r.finite and not r.ok  # finite at the audited mask, but a mask pattern breaks it
    broken = {p.probe for p in r.sweep if p.input == "mask"}
    assert "mask all False" in broken
    assert any(b.startswith("mask[0,:] all False") for b in broken), broken
    assert all(p.op == "sub" for p in r.sweep if p.input == "mask")  # located: the softmax's max shift
    assert not any(b.startswith("mask all True") for b in broken)
    # independent check: plain jax.grad at the first reported pattern is NaN
    row = np.asarray(mask).copy()
    row[0, :] = False
    assert not bool(jnp.all(jnp.isfinite(jax.grad(attention, 1)(scores, v, jnp.asarray(row)))))
    # what was probed, per input
    assert isinstance(r.sweep, Sweep) and r.sweep.complete
    rec = {i.input: i for i in r.sweep.inputs}
    assert rec["mask"].kind == "bool" and rec["mask"].broken == 2
    assert {"all False", "all True", "row [0,:] all False", "row [:,0] all False", "one True per row"} <= set(
        rec["mask"].probes)
    assert rec["scores"].kind == "float" and "0 (all elements)" in rec["scores"].probes
    assert rec["mask"].summary().startswith("mask: 7 patterns (all False, row [0,:] all False")
    assert r.probes <= BUDGET


def test_integer_inputs_are_probed_at_index_extremes():
    def edge_lengths(x, edges):  # a repeated index (a self-loop) is a zero-length edge: sqrt'(0) = inf
        d = x[edges[:, 0]] - x[edges[:, 1]]
        return jnp.sum(jnp.sqrt(jnp.sum(d * d, axis=-1)))

    edges = jnp.array([[0, 1], [1, 2], [2, 3]])  # distinct ends: finite gradient
    x = jnp.array([[0.0, 1.0], [2.0, 0.5], [1.0, 3.0], [4.0, 4.0]])
    assert bool(jnp.all(jnp.isfinite(jax.grad(edge_lengths)(x, edges))))
    r = gk.audit(edge_lengths, x, edges, sweep=True)
    assert r.finite and not r.ok
    broken = {p.probe for p in r.sweep if p.input == "edges"}
    assert any(b.startswith("edges all 0") for b in broken), broken  # every index repeated
    assert not bool(jnp.all(jnp.isfinite(jax.grad(edge_lengths)(x, jnp.zeros_like(edges)))))  # independent
    rec = {i.input: i for i in r.sweep.inputs}["edges"]
    assert rec.kind == "int" and {"all 0", "all 3", "all -1"} <= set(rec.probes)
    tried = set(rec.probes) | {q.split(":")[0] for q in rec.rejected}
    assert "[0,0] = max" in tried and "[0,0] = min" in tried
    assert rec.summary().startswith("edges: ")


def test_inputs_not_varied_say_why_and_the_budget_holds():
    def loss(ws, key):
        return sum(jnp.sum(jnp.tanh(w)) for w in ws) + 0.0 * jax.random.normal(key)

    ws = [jnp.ones(2) * k for k in range(40)]
    r = gk.audit(loss, ws, jax.random.key(0), sweep=True)
    assert r.probes == BUDGET  # 40 inputs x 22 probes, cut to the budget
    recs = {i.input: i for i in r.sweep.inputs}
    assert recs["key"].kind == "key" and recs["key"].not_varied.startswith("a PRNG key")
    assert "not varied: a PRNG key" in recs["key"].summary()
    assert not r.sweep.complete
    assert all(i.varied for n, i in recs.items() if n != "key")  # every float input got a turn (40 < 64)
    assert sum(len(i.probes) for i in r.sweep.inputs) == BUDGET
    assert all(i.skipped > 0 for n, i in recs.items() if n != "key")


def test_budget_reached_before_an_input_is_said():
    def loss(*xs):
        return sum(jnp.sum(jnp.sin(x)) for x in xs)

    xs = [jnp.ones(2)] * (BUDGET + 3)
    r = gk.audit(loss, *xs, sweep=True)
    left = [i for i in r.sweep.inputs if not i.varied]
    assert len(left) == 3 and all("budget" in i.not_varied for i in left)
    assert r.probes == BUDGET and not r.sweep.complete


def test_float_edge_values_still_found_and_each_breaks_plain_jax_grad():
    f = lambda x: jnp.sum(jnp.sqrt(x * x + 1.0) * jnp.log1p(x * x))
    r = gk.audit(f, jnp.ones(3), sweep=True)
    broken = {p.probe for p in r.sweep}
    assert "x = 1e30 (all elements)" in broken and "x = 1 (all elements)" not in broken
    assert not bool(jnp.all(jnp.isfinite(jax.grad(f)(jnp.full(3, 1e30)))))
    assert r.finite


def test_a_sweep_that_leaves_an_array_unvaried_is_not_an_all_clear():
    """More leaves than the probe budget: the sweep cannot vary them all, so the verdict is SWEEP PARTIAL."""
    params = {f"w{i:02d}": jnp.full((2,), 1.0 + i) for i in range(BUDGET + 6)}

    def loss(params):  # finite everywhere the sweep can reach: exp of a bounded value
        return sum(jnp.sum(jnp.tanh(w)) for w in params.values())

    r = gk.audit(loss, params, sweep=True)
    assert r.finite and not r.sweep  # nothing broke
    assert r.unswept and not r.ok  # … but some leaves were never varied
    assert set(r.unswept) == {i.input for i in r.sweep.inputs if not i.varied}
    text = r.text()
    assert text.splitlines()[0].startswith("SWEEP PARTIAL")
    assert "NOT an all-clear" in text and "not varied" in text
    assert len(text.splitlines()) < 30  # grouped: not one line per leaf …
    assert len(r.text(verbose=True).splitlines()) > BUDGET  # … unless asked
    assert r.to_dict()["sweep_inputs"][0]["input"]


def test_a_key_is_listed_as_not_varied_and_does_not_block_ok():
    def noisy(x, key):
        return jnp.sum(jnp.tanh(x + jax.random.normal(key, x.shape)))

    r = gk.audit(noisy, jnp.ones(3), jax.random.key(0), sweep=True)
    assert r.finite and not r.sweep and r.ok and r.unswept == ()
    rec = {i.input: i for i in r.sweep.inputs}
    assert rec["key"].kind == "key" and not rec["key"].varied
    assert "key: not varied: a PRNG key" in str(r)


def _sharded(x):
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))


def test_the_sweep_compiles_once_whatever_the_inputs_types():
    """Probes keep each input's whole type (weak type, sharding): the loss is traced a fixed number of times,
    not once per probe. A strong probe for a weakly typed input used to re-trace (and re-compile) every time."""
    inputs = {
        "weakly typed": ({f"w{i}": jnp.full((2,), 1.0 + i) for i in range(12)}, 0.5),  # jnp.full and a float
        "strong": ({f"w{i}": jnp.ones((2,), jnp.float32) * (1 + i) for i in range(12)}, jnp.float32(0.5)),
        "sharded": ({f"w{i}": _sharded(jnp.arange(8.0) + i) for i in range(12)}, jnp.float32(0.5)),
    }
    for kind, (params, scale) in inputs.items():
        assert jnp.full((2,), 1.0).weak_type  # the premise of the first case
        traces = []

        def loss(params, scale):
            traces.append(1)
            return scale * sum(jnp.sum(jnp.tanh(w)) for w in params.values())

        traces.clear()
        plain = gk.audit(loss, params, scale)
        base = len(traces)
        traces.clear()
        r = gk.audit(loss, params, scale, sweep=True)
        probes = sum(len(i.probes) for i in r.sweep.inputs)
        assert r.finite and not r.sweep and probes > 40, kind
        # the audit's own traces, plus one for the sweep's compiled function: not one per probe
        assert len(traces) <= base + 2, (kind, len(traces), base, probes)
        assert plain.finite
