"""What ``gradkit audit`` audits: the user's file loaded, the functions it names with their inputs, the table.

A file is imported as ``import`` would (registered in ``sys.modules`` while it
runs, its folder on ``sys.path``); the inputs come from ``--arg`` specs
(:mod:`gradkit._src.cli.inputs`), ``--args-from FILE.py:MAKE`` or the file's
``GRADKIT_INPUTS``; the table is a ``gradkit.tables`` name or a TOML file.
Every problem is a :class:`~gradkit._src.cli.inputs.UsageError`: one
``[gradkit]`` line, exit code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import re
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING

from gradkit._src.cli.inputs import UsageError, materialize, parse_spec

if TYPE_CHECKING:  # imported where used: the command starts without loading JAX
    import numpy as np

    from gradkit._src.core.table import RuleTable

__all__ = ["audit_targets", "first_line", "library_tables", "load_file", "named_table", "user_line"]


def load_file(path: str) -> types.ModuleType:
    if not os.path.exists(path):
        raise UsageError(f"no such file: {path}")
    if not path.endswith(".py") or os.path.isdir(path):
        raise UsageError(f"{path} is not a Python file (expected FILE.py or FILE.py:FUNC)")
    name = _module_name(path)
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs, as `import` does: dataclasses, typing.get_type_hints and pickle look the
    # module up in sys.modules while the file executes (a @dataclass under `from __future__ import
    # annotations` fails without it).
    sys.modules[name] = module
    folder = os.path.dirname(os.path.abspath(path))
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SystemExit:
        sys.modules.pop(name, None)
        raise UsageError(f"{path} called sys.exit() while being imported; guard its script part with "
                         "`if __name__ == '__main__':`") from None
    except Exception as e:
        sys.modules.pop(name, None)
        line = user_line(e, path)
        raise UsageError(f"error while importing {path}{line}: {type(e).__name__}: {first_line(str(e))}") from None
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)
    return module


def _module_name(path: str) -> str:
    """A module name for the file that no other loaded module uses (two model.py files may be audited)."""
    base = "_gradkit_target_" + re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    name, k = base, 1
    while name in sys.modules:
        k += 1
        name = f"{base}_{k}"
    return name


def user_line(e: BaseException, path: str) -> str:
    tb = e.__traceback__
    line = ""
    while tb is not None:
        if os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
            line = f":{tb.tb_lineno}"
        tb = tb.tb_next
    return line


def first_line(msg: str) -> str:
    lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def _declared(module: types.ModuleType, path: str) -> dict[str, object]:
    decl = getattr(module, "GRADKIT_INPUTS", None)
    if callable(decl):
        try:
            decl = decl()
        except Exception as e:
            raise UsageError(f"{path}: GRADKIT_INPUTS() raised {type(e).__name__}: {first_line(str(e))}") from None
    if decl is None:
        decl = {}
    if not isinstance(decl, dict):
        raise UsageError(f"{path}: GRADKIT_INPUTS must be a dict from function name to a tuple of inputs "
                         f"(or a function returning one), got {type(decl).__name__}")
    out = dict(decl)
    for name, obj in vars(module).items():
        if callable(obj) and hasattr(obj, "gradkit_inputs") and name not in out:
            out[name] = obj.gradkit_inputs
    return out


def audit_targets(args: argparse.Namespace,
             loading: Callable[[str], None]) -> list[tuple[str, Callable[..., object], tuple[object, ...]]]:
    """(label, function, inputs) for every requested target; ``loading(path)`` before a file is imported."""
    import numpy as np

    rng = np.random.RandomState(args.seed)
    plan: list[tuple[str, str, str | None]] = []
    for target in args.targets:
        path, _, func = target.partition(":") if not re.match(r"^[A-Za-z]:\\", target) else (target, "", "")
        if ":" in func:
            raise UsageError(f"cannot read target {target!r}: expected FILE.py or FILE.py:FUNC")
        plan.append((target, path, func or None))
    if args.arg and args.args_from:
        raise UsageError("give the inputs either with --arg (one array per parameter) or with --args-from "
                         "(a function returning them all), not both")
    if args.arg and (len(plan) != 1 or plan[0][2] is None):
        raise UsageError("--arg gives the inputs of one function: name it as FILE.py:FUNC (one target)")
    if args.args_from and (len(plan) != 1 or plan[0][2] is None):
        raise UsageError("--args-from gives the inputs of one function: name it as FILE.py:FUNC (one target)")
    builder = _builder_target(args.args_from, plan[0][1]) if args.args_from else None
    for path in [p for _, p, _ in plan] + ([builder[0]] if builder else []):
        if not os.path.exists(path):  # fail fast on missing files before importing anything heavy
            raise UsageError(f"no such file: {path}")
    out: list[tuple[str, Callable[..., object], tuple[object, ...]]] = []
    modules: dict[str, types.ModuleType] = {}

    def load(path: str) -> types.ModuleType:  # each file once, whether it holds targets, the input builder or both
        key = os.path.realpath(path)
        if key not in modules:
            loading(path)
            modules[key] = load_file(path)
        return modules[key]

    for _target, path, func in plan:
        module = load(path)
        declared = _declared(module, path)
        names = [func] if func else list(declared)
        if not names:
            raise UsageError(f"{path} declares no inputs to audit: name a function (gradkit audit {path}:FUNC "
                             "--arg SPEC …) or declare GRADKIT_INPUTS = {'func': (x, ...)} in the file")
        for name in names:
            fn = getattr(module, name, None)
            if fn is None or not callable(fn):
                funcs = _functions(module)
                hint = f" (functions: {', '.join(funcs)})" if funcs else ""
                raise UsageError(f"{path} has no function {name!r}{hint}")
            inputs: tuple[object, ...]
            if args.arg:
                inputs = tuple(parse_spec(s, rng) for s in args.arg)
                _check_arity(fn, len(inputs), name, "--arg given")
            elif builder is not None:
                inputs = _built_inputs(load(builder[0]), *builder, args.seed, rng)
                _check_arity(fn, len(inputs), name, f"inputs returned by {builder[0]}:{builder[1]}")
            elif name in declared:
                decl = declared[name]
                if callable(decl):
                    decl = decl()
                if not isinstance(decl, (tuple, list)):
                    decl = (decl,)
                inputs = tuple(materialize(v, rng, f"{path}: GRADKIT_INPUTS[{name!r}]") for v in decl)
            else:
                params = _params(fn)
                raise UsageError(f"no inputs for {name}: give --arg SPEC once per parameter ({', '.join(params)}), "
                                 f"e.g. --arg 'f32[128]:uniform(-1,1)', or --args-from FILE.py:FUNC (a function "
                                 f"returning them), or declare GRADKIT_INPUTS in {path}")
            out.append((f"{path}:{name}", fn, inputs))
    return out


def _params(fn: Callable[..., object]) -> list[str]:
    try:
        return [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return []


def _check_arity(fn: Callable[..., object], n: int, name: str, given: str) -> None:
    try:
        sig = inspect.signature(fn)
        sig.bind(*range(n))
    except TypeError:
        params = _params(fn)
        raise UsageError(f"{name} takes {len(params)} input(s) ({', '.join(params)}) but {n} {given}") from None
    except ValueError:
        pass


def _builder_target(spec: str, target_path: str) -> tuple[str, str]:
    """``--args-from FILE.py:FUNC`` (or ``FUNC``, a function in the audited file) as (path, function name)."""
    path, sep, func = spec.rpartition(":")
    if not sep:  # a bare name: a function in the target's own file
        path, func = (target_path, spec) if not spec.endswith(".py") else (spec, "")
    if not func.isidentifier():
        raise UsageError(f"cannot read --args-from {spec!r}: expected FILE.py:FUNC, the function in FILE.py that "
                         "returns the tuple of inputs (or FUNC alone, for one in the audited file)")
    if not path.endswith(".py"):
        raise UsageError(f"--args-from {spec!r}: {path} is not a Python file (expected FILE.py:FUNC)")
    return path, func


def _built_inputs(module: types.ModuleType, path: str, func: str, seed: int,
                  rng: np.random.RandomState) -> tuple[object, ...]:
    """The inputs ``--args-from FILE.py:FUNC`` builds: ``FUNC()``, or ``FUNC(key)`` with ``jax.random.key(seed)``."""
    where = f"--args-from {path}:{func}"
    fn = getattr(module, func, None)
    if fn is None or not callable(fn):
        funcs = _functions(module)
        hint = f" (functions: {', '.join(funcs)})" if funcs else ""
        raise UsageError(f"{where}: {path} has no function {func!r}{hint}")
    try:
        sig: inspect.Signature | None = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    required = [] if sig is None else [
        p for p in sig.parameters.values() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if len(required) > 1 or any(p.kind == p.KEYWORD_ONLY for p in required):
        raise UsageError(f"{where}: {func} must take no parameter or one, a PRNG key (gradkit calls {func}() or "
                         f"{func}(jax.random.key(seed))), but it requires {', '.join(p.name for p in required)}")
    try:
        if required:
            import jax

            result = fn(jax.random.key(seed))
        else:
            result = fn()
    except Exception as e:
        line = user_line(e, path)
        raise UsageError(f"{where}: {func}() raised {type(e).__name__}: {first_line(str(e))}"
                         + (f" (at {path}{line})" if line else "") + "; fix it, or run it alone to see the "
                         "traceback") from None
    if not isinstance(result, (tuple, list)):
        raise UsageError(f"{where}: {func} must return a tuple (or list) of the audited function's inputs, one per "
                         f"parameter, got {type(result).__name__}; for a function of one input, return (value,)")
    return tuple(materialize(v, rng, f"{where}: input {k}") for k, v in enumerate(result))


def _functions(module: types.ModuleType) -> list[str]:
    return sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_")
                  and not n.isupper() and getattr(v, "__module__", None) == module.__name__)


def named_table(spec: str | None) -> tuple[RuleTable | None, str]:
    if spec is None:
        return None, ""
    from gradkit._src.core.table import RuleTable

    if spec.endswith(".toml"):
        if not os.path.exists(spec):
            raise UsageError(f"no such table file: {spec}")
        from gradkit._src.errors import GradkitError

        try:
            return RuleTable.from_toml(spec), spec
        except GradkitError as e:
            raise UsageError(str(e).removeprefix("[gradkit] ")) from None
    tables = library_tables()
    key = spec.removeprefix("gradkit.tables.").removeprefix("tables.")
    if key not in tables:
        known = ", ".join(tables)
        raise UsageError(f"unknown table {spec!r}: give a name from gradkit.tables ({known}) or a .toml file")
    return tables[key], f"gradkit.tables.{key}"


def library_tables() -> dict[str, RuleTable]:
    from gradkit._src.core.table import RuleTable
    from gradkit._src.rules import tables

    return {n: v for n, v in vars(tables).items() if isinstance(v, RuleTable) and not n.startswith("_")}
