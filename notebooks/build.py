"""Builds the notebooks from their sources and executes them, storing the outputs.

    python notebooks/build.py            # every notebook
    python notebooks/build.py 01 03      # some of them

Sources are plain Python files in ``notebooks/src`` split into cells by lines
starting with ``# %%`` (code) or ``# %% [markdown]`` (markdown, each line
starting with ``# ``). The ``.ipynb`` files are what readers and CI use; this
script keeps them in step with the sources.
"""

from __future__ import annotations

import os
import pathlib
import sys

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent


def cells_of(source: str) -> list[nbformat.NotebookNode]:
    cells: list[nbformat.NotebookNode] = []
    kind, lines = None, []

    def flush() -> None:
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(text))
        elif kind == "code" and text:
            cells.append(nbformat.v4.new_code_cell(text))

    for line in source.splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        else:
            lines.append(line)
    flush()
    return cells


# Stored outputs are read in a browser, on GitHub and in the docs, where ANSI colour codes are noise: the
# kernel (which inherits this environment) prints jaxprs without them. JAX reads its flags from the
# environment at import.
os.environ["JAX_PPRINT_USE_COLOR"] = "false"


def build(src: pathlib.Path) -> pathlib.Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = cells_of(src.read_text())
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    out = HERE / f"{src.stem}.ipynb"
    nbformat.write(nb, out)
    return out


def main(argv: list[str]) -> int:
    for src in sorted((HERE / "src").glob("*.py")):
        if not argv or any(src.name.startswith(a) for a in argv):
            print("built", build(src).name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
