"""Every ```python block of every page under docs/ runs exactly as written, each on its own.

The pages are found, not listed: a new page's examples are tested from the start. A block that is not
meant to run (a shell command, a TOML file) is fenced with its own language, never `python`.
"""

import contextlib
import functools
import io
import re
from pathlib import Path

import jax
import numpy as np
import pytest

ROOT = Path(__file__).parents[1]
DOCS = ROOT / "docs"
GENERATED = ("_build", "notebooks")  # the site's output and the notebooks copied in by the build
PAGES = sorted(p for p in DOCS.rglob("*.md") if not set(p.relative_to(DOCS).parts) & set(GENERATED))
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks(page: Path) -> list[str]:
    return FENCE.findall(page.read_text(encoding="utf-8"))


CASES = [(page, i) for page in PAGES for i in range(len(_blocks(page)))]


@functools.cache  # a block runs once per process; the checks below read what it left
def _run(page: Path, i: int):
    ns = {"__name__": "docs"}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(_blocks(page)[i], str(page), "exec"), ns)  # noqa: S102 - the project's own pages
    return ns, out.getvalue()


def test_the_pages_are_found():
    names = {p.name for p in PAGES}
    assert {"index.md", "contract.md", "performance.md", "guide-overrides.md", "guide-diagnose.md"} <= names
    assert len(CASES) >= 7, CASES


@pytest.mark.parametrize(("page", "i"), CASES, ids=[f"{p.relative_to(DOCS)}[{i}]" for p, i in CASES])
def test_block_runs_as_written(page, i):
    _run(page, i)


def test_a_python_fence_in_any_form_is_found():
    """A block fenced ```python must be seen by FENCE whatever follows it, or it would go untested."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        opened = len(re.findall(r"^```python\s*$", text, re.M))
        assert opened == len(_blocks(page)), f"{page.name}: a ```python fence the test does not read"
        assert not re.search(r"^```(py|python3|ipython|pycon)\s*$", text, re.M), (
            f"{page.name}: fence Python as ```python so that it runs as a test")


def test_the_index_block_shows_what_it_says():
    ns, out = _run(DOCS / "index.md", 0)
    params, batch = ns["params"], ns["batch"]
    assert np.isnan(np.asarray(jax.grad(ns["loss"])(params, batch))).all()
    assert np.isfinite(np.asarray(jax.grad(ns["fixed"])(params, batch))).all()
    assert "passed" in out and "`sqrt`" in out and "gk.tables.SAFE" in out


def test_every_page_is_on_the_site_and_linked_from_the_readme():
    """A page left out of the toctree is a warning (an error on the site build); one the README does not
    link is a page a newcomer never finds."""
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    toctree = "\n".join(re.findall(r"^```\{toctree\}\n(.*?)^```", index, re.S | re.M))
    listed = {line.strip() for line in toctree.splitlines() if line.strip() and not line.startswith(":")}
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for page in PAGES:
        name = page.relative_to(DOCS).with_suffix("").as_posix()
        if name == "index":
            continue
        assert name in listed, f"docs/{name}.md is in no toctree of docs/index.md"
        assert f"](docs/{name}.md" in readme, f"the README does not link docs/{name}.md"
