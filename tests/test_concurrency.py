"""Concurrency: 8 threads building tables, overriding and tracing at once.

Results must equal serial runs bit for bit, and no cache (per-override
programs, named-op instances, rewritten sub-programs) may hand one thread a
program rewritten for another table or signature. Every thread's table scales
the derivatives by its own factor, so a mix-up shows in the numbers.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk

THREADS = 8
ITERATIONS = 4

DERIV = {  # d op / dx from (input, output)
    "sin": lambda x, y: jnp.cos(x),
    "tanh": lambda x, y: 1.0 - y * y,
    "exp": lambda x, y: y,
    "sqrt": lambda x, y: 0.5 / y,
    "log": lambda x, y: 1.0 / x,
}


def scaled(name, c):
    return gk.vjp_rule(lambda op, g: (g * c * DERIV[name](op.inputs[0], op.outputs[0]),), name=f"{name}x{c}")


def table_for(t):
    """Thread t's table, built the way users build them: dict, merge, named op."""
    base = gk.RuleTable({name: scaled(name, float(t + 2)) for name in ("sin", "tanh")})
    return base | {name: scaled(name, float(t + 2)) for name in ("exp", "sqrt", "log")} | {
        "softplus_op": gk.vjp_rule(lambda op, g: (g * float(t + 2) * jax.nn.sigmoid(op.inputs[0]),))}


@gk.op("softplus_op")
def softplus_op(x, *, shift=0.0):
    return jnp.log1p(jnp.exp(x + shift))


PROGRAMS = [
    lambda x: jnp.sum(jnp.sin(x) * x),
    lambda x: jnp.sum(jnp.sqrt(x * x + 1.0)),
    lambda x: jnp.sum(lax.scan(lambda c, z: (jnp.tanh(c + z), None), jnp.zeros(x.shape[1:]), x.reshape(-1, *x.shape[1:]))[0]),
    lambda x: jnp.sum(softplus_op(x)) + jnp.sum(softplus_op(x, shift=1.0)),
    lambda x: jnp.sum(lax.cond(jnp.sum(x) > 0, jnp.sin, jnp.tanh, x)),
    lambda x: jnp.sum(jax.vmap(lambda r: jnp.exp(jnp.sin(r)))(x)),
    lambda x: jnp.sum(jax.jit(lambda z: jnp.log(jnp.exp(z) + 1.0))(x)),
    lambda x: jnp.sum(lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c) * 0.5 + x, x)),
]
SHAPES = [(3,), (2, 3), (4,)]


def _x(shape):
    return jnp.linspace(0.1, 1.3, int(np.prod(shape)), dtype=jnp.float32).reshape(shape)


def run(fn, table, shape, jit):
    f = gk.override(fn, table)
    x = _x(shape)
    out = f(x)
    g = (jax.jit(jax.grad(f)) if jit else jax.grad(f))(x)
    return np.asarray(out), np.asarray(g)


def case(t, it):
    """(program, table id, shape, jit) that thread t runs at iteration it."""
    return (t + it) % len(PROGRAMS), t, SHAPES[(t + it) % len(SHAPES)], it % 2 == 1


def in_threads(work):
    """Runs work(t) in THREADS threads started together; re-raises the first failure."""
    barrier = threading.Barrier(THREADS)
    errors = []

    def target(t):
        try:
            barrier.wait()
            work(t)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((t, e))

    threads = [threading.Thread(target=target, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a thread hung"
    if errors:
        raise errors[0][1]


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_threads_building_tables_and_overriding_different_functions():
    cases = {case(t, it) for t in range(THREADS) for it in range(ITERATIONS)}
    serial = {c: run(PROGRAMS[c[0]], table_for(c[1]), c[2], c[3]) for c in sorted(cases)}
    # The tables really differ: two threads' results for one program differ.
    assert not np.array_equal(run(PROGRAMS[0], table_for(0), (3,), False)[1],
                              run(PROGRAMS[0], table_for(1), (3,), False)[1])
    done = []

    def work(t):
        for it in range(ITERATIONS):
            c = case(t, it)
            out, g = run(PROGRAMS[c[0]], table_for(c[1]), c[2], c[3])  # fresh table and override each time
            np.testing.assert_array_equal(out, serial[c][0])
            np.testing.assert_array_equal(g, serial[c][1], err_msg=f"thread {t} iteration {it}: {c}")
            done.append(c)

    in_threads(work)
    assert len(done) == THREADS * ITERATIONS


def test_one_shared_override_called_from_eight_threads_with_different_shapes():
    calls = []

    def fn(x):
        calls.append(x.shape)
        return jnp.sum(softplus_op(jnp.sin(x)) * jnp.tanh(x))

    shared = gk.override(fn, table_for(3))
    shapes = [(t % 4 + 1,) if t % 2 else (2, t % 4 + 1) for t in range(THREADS)]  # pairs share a shape
    serial_f = gk.override(fn, table_for(3))
    serial = {s: (np.asarray(serial_f(_x(s))), np.asarray(jax.grad(serial_f)(_x(s))),
                  np.asarray(jax.jit(jax.grad(serial_f))(_x(s)))) for s in set(shapes)}
    calls.clear()

    def work(t):
        x = _x(shapes[t])
        for _ in range(ITERATIONS):
            np.testing.assert_array_equal(shared(x), serial[shapes[t]][0])
            np.testing.assert_array_equal(jax.grad(shared)(x), serial[shapes[t]][1])
            np.testing.assert_array_equal(jax.jit(jax.grad(shared))(x), serial[shapes[t]][2])

    in_threads(work)
    # One program per signature in the cache; a first call racing another with
    # the same signature may trace twice (like jax.jit), never more per thread.
    assert len(shared._cache) == len(set(shapes))
    assert len(set(shapes)) <= shared.trace_count <= THREADS
    assert set(calls) == set(shapes)


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_one_shared_named_op_from_eight_threads_under_different_tables():
    serial = {}
    for t in range(THREADS):
        x = _x(SHAPES[t % len(SHAPES)])
        f = gk.override(lambda x, s=float(t % 3): jnp.sum(softplus_op(x, shift=s)), table_for(t))
        serial[t] = (np.asarray(f(x)), np.asarray(jax.grad(f)(x)), np.asarray(softplus_op(x, shift=float(t % 3))))

    def work(t):
        x = _x(SHAPES[t % len(SHAPES)])
        for _ in range(ITERATIONS):
            f = gk.override(lambda x, s=float(t % 3): jnp.sum(softplus_op(x, shift=s)), table_for(t))
            np.testing.assert_array_equal(f(x), serial[t][0])
            np.testing.assert_array_equal(jax.grad(f)(x), serial[t][1])
            np.testing.assert_array_equal(softplus_op(x, shift=float(t % 3)), serial[t][2])  # outside any table

    in_threads(work)
    # Each thread's gradient carries its own table's factor (t + 2) through the one named op.
    g0, g1 = serial[0][1], serial[3][1]  # same shape (3,) and shift 0, tables 0 and 3
    np.testing.assert_allclose(g1, g0 * 5.0 / 2.0, rtol=1e-6)


@pytest.mark.parametrize("jit", [False, True])
def test_concurrent_first_calls_with_one_signature_agree(jit):
    # All 8 threads race the very first call of one override with one signature.
    shared = gk.override(PROGRAMS[2], table_for(5))
    x = _x((2, 3))
    ref = np.asarray(gk.override(PROGRAMS[2], table_for(5))(x))
    ref_g = np.asarray(jax.grad(gk.override(PROGRAMS[2], table_for(5)))(x))
    results = [None] * THREADS

    def work(t):
        results[t] = (np.asarray((jax.jit(shared) if jit else shared)(x)), np.asarray(jax.grad(shared)(x)))

    in_threads(work)
    for out, g in results:
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(g, ref_g)
    assert len(shared._cache) == 1
