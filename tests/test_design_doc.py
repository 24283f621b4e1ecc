"""docs/design.md is the map of the code: every module under gradkit/ is named in its Layout."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def _layout() -> str:
    text = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    return text[text.index("## Layout"):]


def test_every_module_is_in_the_layout():
    layout = _layout()
    named = set(re.findall(r"[A-Za-z_]+\.py", layout))
    modules = sorted((ROOT / "gradkit").rglob("*.py"))
    assert len(modules) > 40
    missing = [str(m.relative_to(ROOT)) for m in modules if m.name not in named]
    assert not missing, f"docs/design.md's Layout does not name {missing}: add each with what it owns"


def test_the_layout_names_no_module_that_is_gone():
    files = {m.name for m in (ROOT / "gradkit").rglob("*.py")}
    block = _layout().split("```")[1]
    named = set(re.findall(r"\b([A-Za-z_]+\.py)\b", block))
    gone = sorted(named - files - {"pyproject.py"})
    assert not gone, f"docs/design.md's Layout names modules that do not exist: {gone}"


# Known inversions of the layering (docs/design.md says which): this list may only shrink.
KNOWN_INVERSIONS = {
    ("table", "library"),
    ("library", "public gradkit.stable"),
    ("audit_patterns", "public gradkit.stable"),
    ("audit_fixes", "public gradkit.tables"),
}


def _groups() -> dict[str, int]:
    """Module stem -> its group's position in the Layout (0: compat, then the `# …` groups in order)."""
    block = _layout().split("```")[1]
    where, group, inside = {}, 0, False
    for line in block.splitlines():
        text = line.strip()
        if text.startswith("_src/"):
            inside = True
        elif inside and text.startswith("#"):
            group += 1
        elif inside and (m := re.match(r"([A-Za-z_]+)\.py\b", text)):
            where[m.group(1)] = group
    return where


def _imports(path: Path) -> list[str]:
    """gradkit modules a file imports (anywhere in it): `_src` stems, or `public gradkit.X`."""
    import ast

    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gradkit"):
            parts = node.module.split(".")
            if parts[:2] == ["gradkit", "_src"]:
                out += [a.name for a in node.names] if len(parts) == 2 else [parts[2]]
            else:
                out += [f"public gradkit.{a.name}" for a in node.names] if len(parts) == 1 else [
                    f"public gradkit.{parts[1]}"]
        elif isinstance(node, ast.Import):
            out += [f"public gradkit.{a.name.split('.')[1]}" for a in node.names
                    if a.name.startswith("gradkit.") and not a.name.startswith("gradkit._src")]
    return out


def test_src_modules_import_only_down_the_layout():
    groups = _groups()
    inversions = set()
    for path in sorted((ROOT / "gradkit" / "_src").glob("*.py")):
        me = path.stem
        for target in _imports(path):
            if target.startswith("public ") or groups.get(target, -1) > groups[me]:
                inversions.add((me, target))
    assert inversions <= KNOWN_INVERSIONS, f"new layering inversions: {sorted(inversions - KNOWN_INVERSIONS)}"
    # and the test itself sees the known ones (it would pass vacuously if the parser broke)
    assert ("table", "library") in inversions and len(groups) > 40
