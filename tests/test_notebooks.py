"""Every notebook executes top to bottom; a cell that raises fails the run.

The stored outputs are what readers see (GitHub, the docs site): they carry no ANSI colour codes and no
machine paths (a Jupyter cell's temporary file, the build machine's checkout).
"""

import os
import pathlib
import re
import tempfile

import nbformat
import pytest
from nbclient import NotebookClient

from gradkit._src.checks.describe import short_path as display_file
from gradkit._src.checks.sourcepath import notebook_cell

pytestmark = pytest.mark.slow  # a long matrix: `pytest -m slow` (CI runs it)

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))

ANSI = re.compile(r"\x1b\[")
MACHINE_PATH = re.compile("|".join([r"ipykernel_\d+", r"/tmp/", r"/var/folders/", r"\\Temp\\",
                                    re.escape(tempfile.gettempdir() + os.sep), re.escape(str(ROOT) + os.sep)]))


def leaks(nb: nbformat.NotebookNode) -> list[str]:
    """Every stored output text with an ANSI escape or a machine path, as `cell N: problem: excerpt`."""
    found = []
    for k, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            texts = [out.get("text", ""), out.get("evalue", ""), "\n".join(out.get("traceback", []))]
            texts += [v for mime, v in out.get("data", {}).items() if mime.startswith("text/")]
            for text in ("".join(t) if isinstance(t, list) else t for t in texts):
                for pattern, what in ((ANSI, "ANSI escape"), (MACHINE_PATH, "machine path")):
                    m = pattern.search(text)
                    if m:
                        found.append(f"cell {k}: {what}: {text[max(0, m.start() - 40):m.end() + 40]!r}")
    return found


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_stored_outputs_have_no_ansi_codes_or_machine_paths(path):
    nb = nbformat.read(path, as_version=4)
    assert not leaks(nb), "\n".join(leaks(nb)) + "\n(rebuild with python notebooks/build.py)"


def test_the_leak_check_finds_what_it_looks_for():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("print(report)", outputs=[
        nbformat.v4.new_output("stream", name="stdout", text="born at /tmp/ipykernel_32504/4144624164.py:28"),
        nbformat.v4.new_output("execute_result", data={"text/plain": "{ \x1b[34;1mlambda \x1b[39;22m; }"}),
    ])]
    assert [p.split(":")[1].strip() for p in leaks(nb)] == ["machine path", "ANSI escape"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, monkeypatch):
    nb = nbformat.read(path, as_version=4)
    assert any(c.cell_type == "code" and c.get("outputs") for c in nb.cells), "stored without outputs"
    monkeypatch.setenv("JAX_PPRINT_USE_COLOR", "false")  # as notebooks/build.py does; the kernel inherits it
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    # what a rebuild would store is clean too: in a live kernel, gradkit names a cell, not its temporary file
    assert not leaks(nb), "\n".join(leaks(nb))


def test_source_paths_outside_jupyter(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    assert display_file(str(tmp_path / "sub" / "model.py")) == os.path.join("sub", "model.py")
    elsewhere = str(tmp_path.parent / "model.py")
    assert display_file(elsewhere) == elsewhere  # not below the cwd: absolute, never ../../
    assert notebook_cell(elsewhere) is None
