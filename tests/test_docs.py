"""Every public docstring example runs and prints what it says."""

import doctest
import importlib

import pytest

MODULES = [
    "gradkit._src.rule",
    "gradkit._src.table",
    "gradkit._src.named",
    "gradkit._src.dispatch",
    "gradkit._src.errors",
    "gradkit._src.audit",
    "gradkit._src.check",
    "gradkit._src.compare",
    "gradkit._src.guard",
    "gradkit.tables",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    results = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0, f"{name} has no examples"
    assert results.failed == 0
