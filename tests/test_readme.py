"""The README's Python blocks run exactly as written, each on its own (a reader copies one block)."""

import contextlib
import io
import re
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

README = Path(__file__).parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.S)


def _run(code):
    ns = {"__name__": "readme"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), ns)  # noqa: S102 - the README is the project's own text
    return ns, out.getvalue()


def test_the_readme_has_python_blocks():
    assert len(BLOCKS) >= 4


def test_the_readme_reads_in_five_minutes():
    """Set-up, the guide, a handful of examples and links; the long sections live in docs/ (tested there)."""
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md is {len(lines)} lines: move a long section to a page in docs/"
    setup = lines.index("## Set up (fresh machine)")
    guide = next(i for i, s in enumerate(lines) if s.startswith("## Guide"))
    commands = [i for i, s in enumerate(lines) if s.startswith("python3 -m venv .venv && ")]
    assert setup < 30 and len(commands) == 2 and all(setup < i < guide for i in commands)  # the commands come first


@pytest.mark.parametrize("i", range(len(BLOCKS)))
def test_block_runs_as_written(i):
    _run(BLOCKS[i])


def test_the_guide_block_shows_what_it_says():
    ns, out = _run(BLOCKS[0])
    import jax

    w, x = ns["w"], ns["x"]
    assert np.isnan(np.asarray(jax.grad(ns["loss"])(w, x))).all()
    assert np.isfinite(np.asarray(jax.grad(ns["fixed"])(w, x))).all()
    assert "passed" in out and "`sqrt`" in out and "gk.tables.SAFE" in out


def test_the_audit_block_names_the_element():
    block = next(b for b in BLOCKS if "gk.audit(loss, jnp.array([-1.0" in b)
    ns, out = _run(block)
    assert ns["a"].findings[0].op == "log" and "x[2] = 0" in out


def test_the_guard_block_raises_the_finding():
    block = next(b for b in BLOCKS if "gk.guard(loss)" in b)
    _, out = _run(block)
    lines = out.strip().splitlines()
    assert lines[0] == "3.0", lines  # the first step is fine
    assert lines[-1].startswith("[gradkit] guard(loss)") and "born at `sqrt`" in lines[-1], lines
