"""An audit prints nothing of its own on stderr: no NumPy cast warning from replaying a masked gather (issue 29)."""

import inspect
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gradkit as gk


def attention_loss(q, k, mask, labels, valid):
    """-inf-masked softmax, then take_along_axis: a gather whose fill value is NaN."""
    s = jnp.where(mask, q @ k.T, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    lp = jnp.log(jnp.take_along_axis(p, labels[:, None], axis=-1))[:, 0]
    return jnp.sum(jnp.where(valid, -lp, 0.0)) / jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)


def inputs():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(4, 3)).astype(np.float32), rng.normal(size=(5, 3)).astype(np.float32)
    mask = rng.random((4, 5)) < 0.7
    mask[2] = False  # a fully masked row: softmax of all -inf is NaN
    return q, k, mask, np.array([0, 1, 2, 3], np.int32), np.array([True, True, False, True])


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_audit_of_a_masked_gather_warns_nothing():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = gk.audit(attention_loss, *inputs())
    assert not report.finite and report.findings  # the audit did replay the NaN
    assert [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})" for w in caught] == []


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_the_audit_command_writes_no_runtime_warning(tmp_path):
    src = tmp_path / "model.py"
    src.write_text("import jax, jax.numpy as jnp, numpy as np\n\n"
                   + textwrap.dedent(inspect.getsource(attention_loss)) + "\n"
                   + textwrap.dedent(inspect.getsource(inputs))
                   + "\n\nGRADKIT_INPUTS = {'attention_loss': inputs}\n")
    gradkit = Path(sys.executable).with_name("gradkit")  # the installed command
    done = subprocess.run([str(gradkit), "audit", "-q", str(src)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1, done.stderr  # findings remain: exit 1 by design
    assert "RuntimeWarning" not in done.stderr and "invalid value encountered" not in done.stderr, done.stderr
