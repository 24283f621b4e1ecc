"""docs/design.md is the map of the code: every module under gradkit/ is named in its Layout, and the
packages under gradkit/_src/ import only down the Layout's order."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
SRC = ROOT / "gradkit" / "_src"


def _block() -> str:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return text[text.index("## Layout"):].split("```")[1]


def _tree() -> dict[str, int]:
    """Every path the Layout's tree names (relative to the repository root) -> its line number."""
    stack: list[tuple[int, str]] = []
    out = {}
    for n, line in enumerate(_block().splitlines()):
        m = re.match(r"( *)(\S+)", line)
        if not m or "  " not in line.strip() and not line.strip().endswith("/"):
            continue
        indent, first = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        for name in re.findall(r"\S+\.py|\S+/", line[:indent + 28]):
            out[parent + name] = n
        if first.endswith("/"):
            stack.append((indent, parent + first))
    return out


def test_every_module_is_in_the_layout():
    named = _tree()
    modules = sorted((ROOT / "gradkit").rglob("*.py"))
    assert len(modules) > 60
    missing = [str(m.relative_to(ROOT)) for m in modules
               if str(m.relative_to(ROOT)) not in named and m.name != "__init__.py"]
    assert not missing, f"docs/design.md's Layout does not name {missing}: add each with what it owns"
    packages = sorted({str(m.parent.relative_to(ROOT)) + "/" for m in modules})
    assert not [p for p in packages if p not in named], "a package is missing from docs/design.md's Layout"


def test_the_layout_names_no_module_that_is_gone():
    gone = [p for p in _tree() if p.startswith("gradkit/") and not (ROOT / p).exists()]
    assert not gone, f"docs/design.md's Layout names modules that do not exist: {gone}"


def _order() -> list[str]:
    """The `_src` packages (and top-level modules) in the Layout's order: errors.py, then compat first."""
    return [p.split("/")[2].removesuffix(".py") for p in sorted(_tree(), key=_tree().get)
            if re.fullmatch(r"gradkit/_src/\w+(/|\.py)", p)]


def _imports(path: Path) -> list[tuple[str, bool]]:
    """(gradkit module imported, inside a function?) for every gradkit import in a file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if n is not f}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradkit":
            mods = [node.module] if node.module != "gradkit._src" else [f"gradkit._src.{a.name}" for a in node.names]
            out += [(m, id(node) in inside) for m in mods]
        elif isinstance(node, ast.Import):
            out += [(a.name, id(node) in inside) for a in node.names if a.name.split(".")[0] == "gradkit"]
    return out


def test_packages_import_only_down_the_layout():
    order = _order()
    assert order[:4] == ["errors", "compat", "core", "function_gradients"] and len(order) >= 10, order
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        me = path.relative_to(SRC).parts[0].removesuffix(".py")
        for module, in_function in _imports(path):
            parts = module.split(".")
            where = str(path.relative_to(ROOT))
            if parts[1:2] != ["_src"]:
                bad.append(f"{where} imports the public {module}")
            elif parts[2] not in order or order.index(parts[2]) > order.index(me):
                bad.append(f"{where} imports {module}, below it")
            elif in_function and me != "cli":  # the CLI defers JAX and gradkit for a fast `--help`
                bad.append(f"{where} imports {module} inside a function")
    assert not bad, "\n".join(bad)


def test_public_modules_only_reexport():
    for path in sorted((ROOT / "gradkit").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))]
        assert not defined, f"{path.name} defines {[d.name for d in defined]}: move them under gradkit/_src"


def _module_imports(path: Path) -> set[str]:
    """The gradkit modules a file imports, anywhere in it (`if TYPE_CHECKING:` blocks and functions too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradkit":
            for a in node.names:  # `from gradkit._src.core import walk` imports the module walk
                sub = f"{node.module}.{a.name}"
                is_module = (ROOT / Path(*sub.split("."))).with_suffix(".py").exists() or \
                    (ROOT / Path(*sub.split("."))).is_dir()
                out.add(sub if is_module else node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "gradkit"}
    return out


def _cycles(package: str) -> list[list[str]]:
    """Import circles among the modules of one `_src` package (each as the list of its modules)."""
    base = SRC / package
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in base.rglob("*.py")
             if p.name != "__init__.py"}
    graph = {m: sorted(_module_imports(p) & set(names)) for m, p in names.items()}
    found, state = [], {}

    def visit(m, stack):
        state[m] = 1
        for n in graph[m]:
            if state.get(n) == 1:
                found.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return found


def test_core_has_no_import_circle():
    # dispatch hands nnx_state what it needs (nnx_state.Route) instead of nnx_state importing dispatch back,
    # even for type checking: a circle there is one a refactor can no longer untangle module by module.
    assert _cycles("core") == [], "import circles in gradkit/_src/core"
    assert _cycles("compat") == [], "import circles in gradkit/_src/compat"
