"""The default set's budget (issue 38) loses no value of any axis: what it leaves out, the slow set runs.

Checked on the helpers themselves (``budget.covering`` and conftest's ``maybe_jit`` split), with stand-in
items, so the check costs no collection of the suite.
"""

import itertools
import types

import conftest
import pytest
from budget import covering, pairwise


def _slow(param):
    return any(m.name == "slow" for m in param.marks)


@pytest.mark.parametrize("sizes", [(3,), (2, 2), (12, 3), (4, 2, 2, 2), (5, 2, 3)])
def test_covering_keeps_every_value_of_every_axis_in_the_default_set(sizes):
    axes = [[f"a{i}v{j}" for j in range(n)] for i, n in enumerate(sizes)]
    params = covering(*axes)
    assert [p.values for p in params] == list(itertools.product(*axes))  # every combination, once
    kept = [p.values for p in params if not _slow(p)]
    assert 0 < len(kept) < len(params) or len(params) == 1
    if len(axes) == 1:  # one axis: every second value (a test that checks another property of each value pairs
        assert [v[0] for v in kept] == axes[0][::2]  # with one that keeps the other half, see test_stable.py)
        return
    for i, axis in enumerate(axes):
        assert {v[i] for v in kept} == set(axis), f"axis {i} lost a value in the default set"
    if len(axes) > 2 and min(sizes) >= 2:  # a third axis balances any pair of values of two axes
        for i, j in itertools.combinations(range(len(axes)), 2):
            assert {(v[i], v[j]) for v in kept} == set(itertools.product(axes[i], axes[j])), (i, j)


class _Item:
    def __init__(self, nodeid, indices, both=False):
        self.nodeid = nodeid
        self.callspec = types.SimpleNamespace(params=dict(indices), indices=dict(indices))
        self.marks = []
        self.both = both

    def get_closest_marker(self, name):
        return name == "both_modes" and self.both or None

    def add_marker(self, mark):
        self.marks.append(mark.name)


def _items():
    """Two files; cases with and without another axis; a test without the fixture."""
    items = []
    for path, tests in (("tests/test_a.py", {"t1": [None], "t2": [0, 1, 2]}), ("tests/test_b.py", {"t3": [None]})):
        for name, others in tests.items():
            for other in others:
                for mode in (0, 1):
                    ix = {"maybe_jit": mode} | ({} if other is None else {"x": other})
                    items.append(_Item(f"{path}::{name}[{'-'.join(map(str, ix.values()))}]", ix))
    plain = _Item("tests/test_a.py::t4", {})
    plain.callspec = None
    both = [_Item(f"tests/test_b.py::t5[{mode}]", {"maybe_jit": mode}, both=True) for mode in (0, 1)]
    return items, plain, both


def test_each_case_runs_one_mode_by_default_and_the_other_in_the_slow_set():
    items, plain, both = _items()
    conftest.pytest_collection_modifyitems(None, items + [plain] + both)
    assert plain.marks == [] and [it.marks for it in both] == [[], []]  # both_modes: both in the default set
    cases = {}
    for it in items:
        key = (it.nodeid.split("[")[0], it.callspec.indices.get("x"))
        cases.setdefault(key, []).append(it)
    for key, pair in cases.items():
        assert sorted(len(it.marks) for it in pair) == [0, 1], key  # one in the default set, one slow
    default_a = {it.callspec.indices["maybe_jit"] for it in items if not it.marks and "test_a" in it.nodeid}
    assert default_a == {0, 1}, "a file runs both modes in the default set"


_OLD_HOLDER = []  # made before any leak check: the case gc.freeze() hides from the collector


@pytest.mark.parametrize("holder", ["new", "old"])
def test_checking_leaks_still_finds_a_leaked_tracer(holder):
    import jax
    from budget import checking_leaks

    kept = [] if holder == "new" else _OLD_HOLDER
    with pytest.raises(Exception, match="Leaked"):
        with checking_leaks():
            jax.jit(lambda x: kept.append(x) or x * 2.0)(1.0)
    kept.clear()
    with checking_leaks():  # and nothing is reported without a leak
        assert float(jax.jit(lambda x: x * 2.0)(1.0)) == 2.0


@pytest.mark.parametrize("sizes", [(2, 2), (3, 2, 2), (4, 3, 3, 2, 2, 2), (3, 2, 2, 2, 4, 3, 3, 2, 2)])
def test_pairwise_covers_every_pair_of_values(sizes):
    axes = {f"a{i}": [f"v{j}" for j in range(n)] for i, n in enumerate(sizes)}
    cfgs = pairwise(**axes)
    assert cfgs == pairwise(**axes)  # deterministic: a test id names the same model in every run
    assert all(list(c) == list(axes) and all(c[k] in axes[k] for k in c) for c in cfgs)
    for a, b in itertools.combinations(axes, 2):
        missing = {(u, v) for u in axes[a] for v in axes[b]} - {(c[a], c[b]) for c in cfgs}
        assert not missing, f"{a} x {b}: {sorted(missing)}"
    big = sorted(sizes)[-2:]  # the two largest axes' pairs need that many configurations; greedy stays near it
    assert big[0] * big[1] <= len(cfgs) <= 2 * big[0] * big[1]
