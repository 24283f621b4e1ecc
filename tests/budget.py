"""The default set's budget for parametrized class tests (issue 38): a covering half by default, all in the slow set.

``covering(*axes)`` gives one ``pytest.param`` per combination of the axes' values; a combination whose
indices sum to an odd number is marked ``slow``. With two or more values on each axis, every value of every
axis, and every pair of values of any two axes with a third to balance them, stays in the default set.
With one axis, every second value does (for a property each value also meets in another default test).
A test that takes the ``maybe_jit`` fixture (conftest.py) runs one of its two modes in the default set, the
modes alternating from case to case in each file, and the other in the slow set.
"""

import contextlib
import gc
import itertools

import pytest


def _id(v):
    return getattr(v, "__name__", None) or str(v)


def covering(*axes):
    params = []
    for idx in itertools.product(*(range(len(a)) for a in axes)):
        values = tuple(a[i] for a, i in zip(axes, idx))
        marks = [pytest.mark.slow] if sum(idx) % 2 else []
        params.append(pytest.param(*values, marks=marks, id="-".join(map(_id, values))))
    return params


MODES = ["eager", "jit"]


def in_mode(mode):
    """The ``maybe_jit`` fixture's two cases as a value of an axis of ``covering``: ``jax.jit`` for ``"jit"``,
    the function as written for ``"eager"``."""
    import jax

    return jax.jit if mode == "jit" else (lambda f: f)


@contextlib.contextmanager
def checking_leaks():
    """``jax.checking_leaks()`` at the cost of the objects made inside it.

    JAX's leak check runs ``gc.collect()`` and ``gc.get_referrers`` each time a trace ends: both walk every
    object the process holds, so late in a test run (hundreds of tests' programs alive) a leak-checked test
    took 5x its time alone. ``gc.freeze()`` first puts what already exists out of the collector's sight;
    every tracer is made inside the block, so a leaked one is still found (an object older than the block
    that comes to hold a tracer keeps it alive, and it is reported).
    """
    import jax

    gc.collect()
    gc.freeze()
    try:
        with jax.checking_leaks():
            yield
    finally:
        gc.unfreeze()


def pairwise(**axes):
    """Configurations (dicts) in which every pair of values of any two axes occurs at least once.

    Deterministic greedy construction: each new configuration is grown one axis at a time, taking the value
    that covers the most pairs not yet covered (ties: the value listed first). A random sample of the same
    size usually misses pairs; this covers them all, in about as many configurations as the product of the
    two largest axes.

    >>> cfgs = pairwise(a=[0, 1, 2], b="xy", c=[False, True])
    >>> len(cfgs), cfgs[0]
    (6, {'a': 0, 'b': 'x', 'c': False})
    """
    names = list(axes)
    values = [list(v) for v in axes.values()]
    todo = {(i, a, j, b) for i, j in itertools.combinations(range(len(names)), 2)
            for a in range(len(values[i])) for b in range(len(values[j]))}
    out = []
    while todo:
        # seed the configuration with an uncovered pair (the first in a fixed order), then fill the other axes
        i, a, j, b = min(todo)
        pick = {i: a, j: b}
        for k in range(len(names)):
            if k in pick:
                continue
            gain = lambda v, k=k: sum((min(k, m), v if k < m else pick[m], max(k, m), pick[m] if k < m else v)
                                      in todo for m in pick)
            pick[k] = max(range(len(values[k])), key=lambda v: (gain(v), -v))
        todo -= {(p, pick[p], q, pick[q]) for p, q in itertools.combinations(range(len(names)), 2)}
        out.append({names[k]: values[k][pick[k]] for k in range(len(names))})
    return out
