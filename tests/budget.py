"""The default set's budget for parametrized class tests (issue 38): a covering half by default, all in the slow set.

``covering(*axes)`` gives one ``pytest.param`` per combination of the axes' values; a combination whose
indices sum to an odd number is marked ``slow``. With two or more values on each axis, every value of every
axis, and every pair of values of any two axes with a third to balance them, stays in the default set.
With one axis, every second value does (for a property each value also meets in another default test).
A test that takes the ``maybe_jit`` fixture (conftest.py) runs one of its two modes in the default set, the
modes alternating from case to case in each file, and the other in the slow set.
"""

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
