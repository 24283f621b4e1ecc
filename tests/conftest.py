"""Test configuration: bugs should surface here, not in users' runs.

* 8 virtual CPU devices, so sharded inputs and shard_map are tested;
* strict dtype promotion and rank promotion errors;
* float32 matrix products at full float32 on every backend (``highest``): JAX's
  default on a GPU is TF32 (10-bit mantissa), which the float32 tolerances here
  are not written for. A no-op on the CPU; gk.check_grads's own handling of
  the default is tested in test_check.py;
* warnings are errors (pyproject's filterwarnings).
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(params=[False, True], ids=["eager", "jit"])
def maybe_jit(request):
    """Runs a test once as written and once with `jax.jit` around the tested function."""
    return jax.jit if request.param else (lambda f: f)


@pytest.fixture
def x64():
    """Float64 enabled for the duration of a test."""
    with jax.enable_x64(True):
        yield
