"""Every docstring example in gradkit runs and prints what it says.

The modules are found, not listed: any module of the package whose source holds
a ``>>>`` example is run, so a new module's examples are tested from the start.
"""

import doctest
import importlib
import pathlib

import pytest

import gradkit

ROOT = pathlib.Path(gradkit.__file__).parent


def _modules_with_examples():
    names = []
    for path in ROOT.rglob("*.py"):
        if ">>>" in path.read_text():
            parts = path.relative_to(ROOT.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return sorted(names)


MODULES = _modules_with_examples()


def test_the_public_modules_are_found():
    for name in ("gradkit.stable", "gradkit.tables", "gradkit.estimators", "gradkit._src.core.dispatch",
                 "gradkit._src.function_gradients.custom_gradient", "gradkit._src.audit.audit", "gradkit._src.stable.cardinal_sine"):
        assert name in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    results = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0, f"{name} has no examples"
    assert results.failed == 0
