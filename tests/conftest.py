"""Test configuration: bugs should surface here, not in users' runs.

* 8 virtual CPU devices, so sharded inputs and shard_map are tested;
* strict dtype promotion and rank promotion errors;
* float32 matrix products at full float32 on every backend (``highest``): JAX's
  default on a GPU is TF32 (10-bit mantissa), which the float32 tolerances here
  are not written for. A no-op on the CPU; gk.check_grads's own handling of
  the default is tested in test_check.py;
* warnings are errors (pyproject's filterwarnings);
* JAX's persistent compilation cache within one run: many tests compile the
  same small programs (a table's rule at a shape, a reference gradient), and
  XLA's compile is about half of the run's time. Each process (each xdist
  worker) has its own folder under one temporary folder for the run, removed
  at its end; nothing is kept between runs, so every run compiles from cold.
  ``GRADKIT_TEST_JAX_CACHE=off`` turns it off; ``GRADKIT_TEST_JAX_CACHE=FOLDER``
  uses FOLDER and keeps it (.ci/run: the slow tests reuse what the README's
  test command compiled with the same JAX). A cached executable is the one
  XLA compiled for the same program (JAX keys an entry by the program, the
  versions, the backend and XLA_FLAGS), so no result depends on it.
"""

import os
import shutil
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

# The run's cache folder: made by the first process that loads this file (pytest itself, or the xdist
# controller, whose environment its workers inherit), one subfolder per process: no two write one entry.
_CACHE_ENV = "GRADKIT_TEST_JAX_CACHE"
_OWN_CACHE = _CACHE_ENV not in os.environ
if _OWN_CACHE:
    os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="gradkit-tests-jax-cache-")
if os.environ[_CACHE_ENV] != "off":
    jax.config.update("jax_compilation_cache_dir",
                      os.path.join(os.environ[_CACHE_ENV], os.environ.get("PYTEST_XDIST_WORKER", "main")))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    if _OWN_CACHE and not hasattr(config, "workerinput"):
        shutil.rmtree(os.environ.pop(_CACHE_ENV), ignore_errors=True)


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test once as written and once with `jax.jit` around the tested function.

    The default set runs one of the two per test (the slow set the other; see
    ``pytest_collection_modifyitems``)."""
    return jax.jit if request.param else (lambda f: f)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """The default set's budget for ``maybe_jit`` (issue 38): each test case runs in one mode there, the
    modes alternating from case to case in each file, so every file runs both; the other mode of each
    case is marked ``slow`` (CI runs it). An eager case compiles every operation on its own and costs
    about twice its jitted twin: the pairs were 9% of the default set's time.
    ``@pytest.mark.both_modes`` keeps both in the default set where the two modes run different gradkit
    code (test_guard.py: a guard checks and reports in Python eagerly, from a host callback under jit)."""
    seen: dict[str, int] = {}
    order: dict[tuple[str, str], int] = {}
    for item in items:
        spec = getattr(item, "callspec", None)
        if spec is None or "maybe_jit" not in spec.params or item.get_closest_marker("both_modes"):
            continue
        rest = {k: v for k, v in spec.indices.items() if k != "maybe_jit"}
        case = (item.nodeid.split("[")[0], repr(sorted(rest.items())))
        if case not in order:
            path = item.nodeid.split("::")[0]
            order[case] = seen.get(path, 0)
            seen[path] = order[case] + 1
        if order[case] % 2 != spec.indices["maybe_jit"]:
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def x64():
    """Float64 enabled for the duration of a test."""
    with jax.enable_x64(True):
        yield
