"""The house (issue 38.6): no import circles among gradkit's modules, no module over 600 lines, no machine paths
anywhere in the repository.

What counts as an import: every ``import gradkit…`` and ``from gradkit… import …`` in a module, wherever it
stands — at module level, under ``if TYPE_CHECKING:``, and inside a function. A lazy or type-only import hides
a circle from the interpreter, not from a reader or a type checker: the modules still depend on each other (the
replay's four modules did so through ``TYPE_CHECKING`` imports alone). ``from package import name`` counts as an
import of the submodule ``package.name`` when there is one, else of the package (its ``__init__.py``). The
implicit import of a module's parent packages (``gradkit._src.audit`` before ``gradkit._src.audit.report``) is
not counted: Python runs a package's ``__init__`` first by design, and ``__init__`` files under ``_src`` import
nothing of their submodules.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parents[1]
PACKAGE = ROOT / "gradkit"
MAX_LINES = 600


# --------------------------------------------------------------------------- import circles


def _modules() -> dict[str, Path]:
    """Every module of gradkit by dotted name (a package by its ``__init__.py``)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The gradkit modules ``path`` (module ``name``) imports, at any depth of its syntax tree."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # a relative import
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import gradkit._src.x.y` names the module y
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imported(path, name, modules) for name, path in modules.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """One circle through the component's modules, for the message: a -> b -> … -> a."""
    members = set(component)
    start = component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & members)
        back = [m for m in nxt if m == start]
        if back and len(path) > 1:
            return path + [start]
        fresh = [m for m in nxt if m not in seen]
        if not fresh:
            return path + [nxt[0]]
        path.append(fresh[0])
        seen.add(fresh[0])


def test_the_import_graph_is_read():
    graph = _import_graph()
    assert len(graph) > 60
    # an import at module level, one under TYPE_CHECKING, one inside a function: all three are edges
    assert "gradkit._src.audit.replay.state" in graph["gradkit._src.audit.replay.replay"]
    assert "gradkit._src.audit.report" in graph["gradkit._src.cli.main"]  # TYPE_CHECKING only
    assert "gradkit._src.audit.audit" in graph["gradkit._src.cli.main"]  # inside cmd_audit
    assert "gradkit._src.compat" in graph["gradkit._src.audit.replay.state"]  # `from gradkit._src import compat`


def test_the_cycle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _cycle_in(["a", "b", "c"], graph) == ["a", "b", "c", "a"]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circles():
    graph = _import_graph()
    circles = [" -> ".join(_cycle_in(c, graph)) for c in _circles(graph)]
    assert not circles, ("gradkit's modules import each other in circles (module-level, TYPE_CHECKING and "
                         "function-level imports all count): move what both need into a lower module, or pass "
                         "a function as an argument:\n  " + "\n  ".join(circles))


# --------------------------------------------------------------------------- module size


def test_no_module_over_600_lines():
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in sorted(PACKAGE.rglob("*.py"))}
    assert len(sizes) > 60
    big = {p: n for p, n in sizes.items() if n > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split them by responsibility): {big}"


# --------------------------------------------------------------------------- machine paths


def _repository_files() -> list[Path]:
    """The repository's files: tracked, and new ones not ignored (so a path is caught before it is committed)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=60).stdout.decode()
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.SubprocessError):  # not a git checkout (an unpacked sdist): every file
        names = [str(Path(d, f).relative_to(ROOT)) for d, dirs, files in os.walk(ROOT)
                 for f in files if not any(part.startswith(".") for part in Path(d).relative_to(ROOT).parts)]
    return [ROOT / n for n in sorted(set(names)) if (ROOT / n).is_file()]


# Each pattern is assembled from pieces so that this file does not match itself.
_SEP = "/"
MACHINE_PATHS = {
    "this project's machines' checkout root": r"(?<![\w.])" + re.escape(_SEP + "work" + _SEP),
    "a Linux home directory": r"(?<![\w.])" + re.escape(_SEP + "home" + _SEP) + r"[A-Za-z_][\w.-]*",
    "root's home directory": r"(?<![\w.])" + re.escape(_SEP + "root" + _SEP),
    "a macOS home directory": r"(?<![\w.])" + re.escape(_SEP + "Users" + _SEP) + r"[A-Za-z_][\w.-]*",
    "a Windows home directory": r"\b[A-Za-z]:(\\\\?|/)" + "Users" + r"(\\\\?|/)",
    "a macOS per-user temporary folder": r"(?<![\w.])" + re.escape(_SEP + "var" + _SEP + "folders" + _SEP),
    "a mount point": r"(?<![\w.])" + re.escape(_SEP + "mnt" + _SEP) + r"\w",
    # a file right in the temporary folder (tmp/NAME.json) is the same everywhere; a folder in it (tmp/DIR/…)
    # is one that one run made (ipykernel_1234, pytest-of-…)
    "a temporary folder one run made": r"(?<![\w.])" + re.escape(_SEP + "tmp" + _SEP) + r"[\w.-]+/",
    "the project's private research folder": re.escape(".." + _SEP + "shared") + r"\b|" + re.escape(
        "..\\" + "shared") + r"\b",
}

# Legitimate mentions: (file, the exact text, why it may stay).
ALLOWED = [
    ("gradkit/_src/checks/sourcepath.py", _SEP + "tmp" + _SEP + "ipykernel_1234/",
     "describes the temporary file Jupyter runs a cell as: the path this module turns into a cell number"),
    ("tests/test_notebooks.py", _SEP + "tmp" + _SEP + "ipykernel_32504/",
     "that test's fixture: a stored output holding a machine path, which the notebook check must reject"),
    ("tests/test_notebooks.py", 'r"' + _SEP + "var" + _SEP + "folders" + _SEP + '"',
     "that test's own pattern for machine paths in notebook outputs"),
]


def test_the_machine_path_patterns_match_what_they_are_for():
    examples = {
        "this project's machines' checkout root": _SEP + "work" + _SEP + "main/.venv/bin/python",
        "a Linux home directory": _SEP + "home" + _SEP + "alice/src/gradkit",
        "root's home directory": _SEP + "root" + _SEP + ".cache/jax",
        "a macOS home directory": _SEP + "Users" + _SEP + "bob/code",
        "a Windows home directory": "C:" + "\\" + "Users" + "\\" + "carol",
        "a macOS per-user temporary folder": _SEP + "var" + _SEP + "folders" + _SEP + "xy/T/",
        "a mount point": _SEP + "mnt" + _SEP + "data/run1",
        "a temporary folder one run made": _SEP + "tmp" + _SEP + "pytest-of-dave/pytest-3/x.py",
        "the project's private research folder": "see .." + _SEP + "shared" + _SEP + "notes.md",
    }
    for what, text in examples.items():
        assert re.search(MACHINE_PATHS[what], text), (what, text)
    for generic in ["python bench.py --out " + _SEP + "tmp" + _SEP + "p0.json", "~/.cache/jax",
                    "https://github.com/jax-ml/jax", "src" + _SEP + "home" + _SEP + "x", "shared_memory",
                    "https://example.org" + _SEP + "work" + _SEP + "x"]:
        assert not any(re.search(p, generic) for p in MACHINE_PATHS.values()), generic


def test_no_machine_paths_in_the_repository():
    files = _repository_files()
    assert len(files) > 100 and any(f.name == "test_house.py" for f in files)
    pattern = re.compile("|".join(f"(?P<p{i}>{p})" for i, p in enumerate(MACHINE_PATHS.values())))
    names = list(MACHINE_PATHS)
    hits = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # images, archives
            continue
        rel = str(path.relative_to(ROOT)).replace(os.sep, "/")
        allowed = [t for f, t, _ in ALLOWED if f == rel]
        for n, line in enumerate(text.splitlines(), 1):
            for m in pattern.finditer(line):
                if any(t in line[max(0, m.start() - 40):m.end() + 40] for t in allowed):
                    continue
                what = names[int(next(k for k, v in m.groupdict().items() if v is not None)[1:])]
                hits.append(f"{rel}:{n}: {what}: {line.strip()[:120]}")
    assert not hits, ("machine-specific paths in the repository (write a path relative to the repository, or a "
                      "placeholder; a legitimate mention goes in ALLOWED with why):\n  " + "\n  ".join(hits))


def test_every_allowed_mention_is_still_there():
    """An entry of ALLOWED whose text is gone is removed, so the list stays the list of real exceptions."""
    for rel, text, why in ALLOWED:
        assert text in (ROOT / rel).read_text(encoding="utf-8"), (rel, text, why)
