"""Sphinx configuration for gradkit's documentation site.

Build (warnings are errors, so a broken cross-reference or a docstring that does not render fails):

    bash .ci/docs                # installs the `docs` extra, then builds into docs/_build/html

API pages come from the docstrings (autodoc + napoleon, Google style); the notebooks are rendered
with their stored outputs (myst-nb, never executed here). Needs only packages from PyPI.
"""

from __future__ import annotations

import builtins
import importlib
import pathlib
import shutil

from sphinx.util import logging
from sphinx.util.nodes import make_refnode

import gradkit  # the installed package (pip install -e ".[docs]"), as users import it

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent

project = "gradkit"
author = "gradkit developers"
copyright = "gradkit developers"
release = gradkit.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "myst_nb",
]

source_suffix = {".rst": "restructuredtext", ".md": "myst-nb", ".ipynb": "myst-nb"}
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store", "**.ipynb_checkpoints"]
root_doc = "index"

html_theme = "furo"
html_title = f"gradkit {release}"
html_static_path: list[str] = []

# --- API pages ------------------------------------------------------------------------------------
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_default_options = {"no-value": True}  # a table's repr is hundreds of rules long
autodoc_preserve_defaults = True  # defaults as written (`_REQUIRED`), not `<object object at 0x…>`
autodoc_inherit_docstrings = False  # Mapping.get's "D.get(k[,d]) -> D[k] …" is not a Google docstring
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False

# Every cross-reference must resolve: a typo in :func:`gradkit.stable.xlogy` fails the build. References
# into other projects (JAX, NumPy, the standard library) have no target here, since the build works
# offline (no intersphinx); they stay plain text.
nitpicky = True
_EXTERNAL = ("jax", "jaxlib", "numpy", "np", "jnp", "typing", "collections", "types", "dataclasses",
             "enum", "os", "pathlib", "optax", "ml_dtypes", "Array", "ArrayLike", "DTypeLike", "Callable",
             "Sequence", "Mapping", "Iterable", "Iterator", "Hashable", "Any", "PyTree", "TypeVar", "T")
nitpick_ignore_regex = [
    (r"py:.*", rf"({'|'.join(_EXTERNAL)})(\..*)?"),
    (r"py:.*", rf"({'|'.join(n for n in dir(builtins) if not n.startswith('_'))})"),
    (r"py:class", r"gradkit\._src\.[\w.]+\.[A-Z]\w*"),  # type variables and private classes in signatures
    (r"py:class", r"(gradkit\._src\.[\w.]+\.)?_[A-Z]\w*"),  # private type variables (ParamSpec _P, _R)
]

# --- notebooks: rendered with their stored outputs -------------------------------------------------
nb_execution_mode = "off"
nb_output_stderr = "show"
myst_enable_extensions = ["dollarmath"]
myst_heading_anchors = 3

# Public names: each must appear on an API page (checked after reading, below).
PUBLIC_MODULES = ["gradkit", "gradkit.stable", "gradkit.estimators", "gradkit.tables"]


def _public_names(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items()
                 if not n.startswith("_") and getattr(v, "__module__", module_name) == module_name]
    return [f"{module_name}.{n}" for n in names]


def _copy_notebooks(app) -> None:
    """The stored notebooks, copied under docs/ so they are pages of the site (the copies are git-ignored)."""
    out = HERE / "notebooks"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        shutil.copy2(nb, out / nb.name)


def _check_every_public_name_is_documented(app, env) -> None:
    documented = set(env.get_domain("py").objects)
    log = logging.getLogger("gradkit.docs")
    for module_name in PUBLIC_MODULES:
        for name in _public_names(module_name):
            if name not in documented:
                log.warning(f"public name {name} has no entry in the API reference (docs/api/)")


def _resolve_private_paths(app, env, node, contnode):
    """Docstrings live in private modules and say :func:`check_grads`: that is the public ``gradkit.check_grads``.

    An unresolved Python reference is retried as a name of the module it was written in, then under the
    public package, then (a bare name) as the one documented gradkit object of that name; one that still
    has no target is left to Sphinx, which warns (and -W fails the build).
    """
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"]
    module = node.get("py:module") or ""
    last = target.rsplit(".", 1)[-1]
    candidates = [f"{module}.{target}" if module else None, f"gradkit.{last}" if target.startswith(
        ("gradkit._src.", last)) else None]
    domain = env.get_domain("py")
    if "." not in target:  # a bare class name written in another class's docstring: its one documented match
        matches = [n for n in domain.objects if n.startswith("gradkit.") and n.endswith(f".{target}")]
        candidates += matches if len(matches) == 1 else []
    for name in filter(None, candidates):
        if name in domain.objects:
            entry = domain.objects[name]
            return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, name)
    return None


def setup(app):
    app.connect("builder-inited", _copy_notebooks)
    app.connect("missing-reference", _resolve_private_paths)
    app.connect("env-check-consistency", _check_every_public_name_is_documented)
