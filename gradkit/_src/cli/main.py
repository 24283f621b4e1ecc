"""The ``gradkit`` command behind :mod:`gradkit.cli`: argument parsing and the subcommands.

What ``audit`` audits (the file, its functions and inputs, the table) is :mod:`gradkit._src.cli.targets`'s.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, TypedDict

from gradkit._src.cli.inputs import SPEC_HELP, UsageError
from gradkit._src.cli.targets import audit_targets, first_line, library_tables, load_file, named_table, user_line

if TYPE_CHECKING:  # imported where used: the command starts without loading JAX
    from gradkit._src.audit.report import AuditReport

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE = 0, 1, 2


# --------------------------------------------------------------------------- commands


class _Progress:
    """Progress on stderr, so stdout stays the report: one rewritten line on a terminal, else a line per step.

    Piped or redirected runs (CI logs, ``| tee``) still show what is running; ``--quiet`` silences it.
    """

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.tty = sys.stderr.isatty()

    def step(self, message: str, *, tty_only: bool = False) -> None:
        if self.quiet or (tty_only and not self.tty):
            return
        if self.tty:
            sys.stderr.write(f"\r[gradkit] {message}\033[K")
        else:
            sys.stderr.write(f"[gradkit] {message}\n")
        sys.stderr.flush()

    def clear(self) -> None:
        if self.tty and not self.quiet:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()

    def sweep(self, label: str) -> Callable[[int, int, str], None] | None:
        """The ``progress`` callback of ``audit(sweep=True)``: every probe on a terminal, else each quarter."""
        if self.quiet:
            return None
        state = {"last": -1}

        def show(done: int, total: int, what: str) -> None:
            if self.tty:
                sys.stderr.write(f"\r[gradkit] sweep {label}: {done}/{total} probes {what[:50]}\033[K")
                sys.stderr.flush()
                return
            step = 4 * done // max(total, 1)
            if step != state["last"]:
                state["last"] = step
                sys.stderr.write(f"[gradkit] sweep {label}: {done}/{total} probes\n")
                sys.stderr.flush()
        return show


def cmd_audit(args: argparse.Namespace) -> int:
    progress = _Progress(args.quiet)
    try:
        # on a terminal only: a usage error after it stays one line in a log
        targets = audit_targets(args, lambda path: progress.step(f"loading {path}…", tty_only=True))
        table, table_name = named_table(args.table)
    finally:  # a usage error then starts its own line on a terminal
        progress.clear()
    from gradkit._src.audit.audit import audit
    from gradkit._src.errors import GradkitError

    reports: list[tuple[str, AuditReport]] = []
    errors: list[tuple[str, str]] = []
    for k, (label, fn, inputs) in enumerate(targets):
        path, name = label.rsplit(":", 1)
        progress.step(f"auditing {name} ({k + 1}/{len(targets)})…")
        try:
            rep = audit(fn, *inputs, table=table, fix=not args.no_fix, sweep=args.sweep,
                        progress=progress.sweep(name) if args.sweep else None)
            reports.append((label, rep))
        except GradkitError as e:
            msg = _one_line(str(e).removeprefix("[gradkit] "))
            # the user's exception it replaced, if any, still knows the line in the file that raised it
            line = user_line(e.__context__, path) if e.__context__ is not None else ""
            errors.append((label, msg + (f" (raised at {path}{line})" if line else "")))
        except Exception as e:  # the user's function failed on these inputs
            line = user_line(e, path)
            errors.append((label, f"{name} failed on the given inputs: {type(e).__name__}: {first_line(str(e))}"
                                  + (f" (raised at {path}{line})" if line else "")))
    progress.clear()
    findings = sum(1 for _, r in reports if not r.ok)
    if args.json:
        doc = {"gradkit_version": _version(), "table": table_name or None,
               "ok": not findings and not errors,
               "functions": [dict(r.to_dict(), target=label) for label, r in reports]
               + [{"target": label, "error": msg} for label, msg in errors]}
        print(json.dumps(doc, indent=2))
    elif reports:  # a function that could not be audited has no report: its one line goes to stderr below
        files = sorted({label.rsplit(":", 1)[0] for label, _, _ in targets})
        print(f"gradkit audit: {', '.join(files)}" + (f" (table {table_name})" if table_name else "") + "\n")
        for _, r in reports:
            print(r.text(verbose=args.verbose) + "\n")
        n = len(reports) + len(errors)
        summary = f"{n} function{'s' if n != 1 else ''} audited: {n - findings - len(errors)} ok"
        partial = sum(1 for _, r in reports if not r.ok and r.finite and not r.sweep)
        if findings - partial:
            summary += f", {findings - partial} with non-finite gradients"
        if partial:
            summary += f", {partial} with a partial sweep (inputs not varied)"
        if errors:
            summary += f", {len(errors)} could not be audited (see stderr)"
        print(summary)
    if errors:  # exit 2: one [gradkit] line each on stderr, after the report, as for any usage error
        sys.stdout.flush()
        source = ("the --arg inputs" if args.arg else f"the inputs from --args-from {args.args_from}"
                  if args.args_from else "the inputs declared in the file (GRADKIT_INPUTS)")
        for label, msg in errors:
            name = label.rsplit(":", 1)[1]
            sys.stderr.write(f"[gradkit] {label} could not be audited: {msg.rstrip('. ')}; check that {source} "
                             f"fit {name}'s parameters (dtype, shape, structure)\n")
        sys.stderr.flush()
        return EXIT_USAGE
    return EXIT_FINDINGS if findings else EXIT_OK


def _one_line(msg: str) -> str:
    return " ".join(ln.strip() for ln in msg.strip().splitlines() if ln.strip())


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gradkit")
    except metadata.PackageNotFoundError:  # pragma: no cover (run from a source tree, not installed)
        return "unknown"



class Catalog(TypedDict):
    """:func:`rule_catalog`: per table its rows (op, rule, mode, fixes); the named rules (rule, signature, doc)."""

    tables: dict[str, list[dict[str, str]]]
    library: list[dict[str, str]]

def rule_catalog() -> Catalog:
    """The ready tables (op, rule kind, what it fixes) and the named rules a config can use."""
    from gradkit._src.rules import tables

    out: Catalog = {"tables": {}, "library": []}
    for tname, tbl in library_tables().items():
        desc = tables.describe(tbl)
        rows = []
        for op in sorted(tbl):
            kind, _, what = desc.get(op, "").partition(": ")
            rows.append({"op": op, "rule": kind or tbl[op].name, "mode": tbl[op].mode, "fixes": what or kind})
        out["tables"][f"gradkit.tables.{tname}"] = rows
    for name, lr in tables.library().items():
        out["library"].append({"rule": name, "signature": lr.signature(), "doc": lr.doc.strip()})
    return out


def cmd_rules(args: argparse.Namespace) -> int:
    cat = rule_catalog()
    if args.json:
        print(json.dumps(cat, indent=2))
        return EXIT_OK
    for tname, rows in cat["tables"].items():
        print(f"{tname}  ({len(rows)} rules; apply with gk.override(fn, {tname}))")
        width = max(len(r["op"]) for r in rows)
        for r in rows:
            print(f"  {r['op']:<{width}}  {r['mode']}  {r['rule']:<16} {r['fixes']}")
        print()
    if cat["library"]:
        print("Named rules for gk.RuleTable.from_dict / from_toml (e.g. {\"log\": {\"rule\": \"clamped_log\", "
              "\"eps\": 1e-30}}):")
        width = max(len(r["signature"]) for r in cat["library"])
        for r in cat["library"]:
            print(f"  {r['signature']:<{width}}  {r['doc'].splitlines()[0] if r['doc'] else ''}")
        print()
    print("See which rules fire on your code: gradkit audit FILE.py --table SAFE")
    return EXIT_OK


_DEMO_SOURCE = """\
import jax
import jax.numpy as jnp


def softplus(x):
    return jnp.log1p(jnp.exp(x))


def guarded_log(x):
    return jnp.where(x > 0, jnp.log(x), 0.0)


def norm(x):
    return jnp.linalg.norm(x)


def angle(p):
    return jnp.arctan2(p[1], p[0])


def log_partition(scores):
    return jax.nn.logsumexp(scores)


def loss(logits):
    return jnp.mean(jnp.log1p(jnp.exp(logits)))
"""


def cmd_demo(args: argparse.Namespace) -> int:
    import tempfile

    import jax
    import jax.numpy as jnp

    from gradkit._src import stable as st
    from gradkit._src.audit.audit import audit

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "gradkit_demo.py")
        with open(path, "w") as f:
            f.write(_DEMO_SOURCE)
        m = load_file(path)
        cases = [
            ("log(1 + exp(x)) at x = 100", m.softplus, st.log1pexp, jnp.float32(100.0), "gk.stable.log1pexp"),
            ("where(x > 0, log(x), 0) at x = 0", m.guarded_log, lambda x: jnp.where(x > 0, st.safe_log(x), 0.0),
             jnp.float32(0.0), "gk.stable.safe_log"),
            ("jnp.linalg.norm(x) at x = 0", m.norm, st.safe_norm, jnp.zeros(3, jnp.float32),
             "gk.stable.safe_norm"),
            ("arctan2(y, x) at the origin", m.angle, lambda p: st.safe_arctan2(p[1], p[0]),
             jnp.zeros(2, jnp.float32), "gk.stable.safe_arctan2"),
            ("logsumexp of an all -inf row", m.log_partition, st.logsumexp, jnp.full(3, -jnp.inf, jnp.float32),
             "gk.stable.logsumexp"),
        ]
        print("gradkit demo: the classic NaN gradients, naive JAX vs gradkit\n")
        print(f"  {'case':<34} {'jax.grad, naive':<20} {'with gradkit':<22} using")
        for title, naive, fixed, x, how in cases:
            g0 = _show(jax.grad(lambda v, f=naive: jnp.sum(f(v)))(x))
            g1 = _show(jax.grad(lambda v, f=fixed: jnp.sum(f(v)))(x))
            print(f"  {title:<34} {g0:<20} {g1:<22} {how}")
        print("\nWhere is a NaN born? gk.audit replays the backward pass equation by equation and tries the fix:\n")
        cwd = os.getcwd()
        os.chdir(tmp)  # so the report names gradkit_demo.py, not a temporary path
        try:
            report = audit(m.loss, jnp.array([0.0, 1.0, 100.0], dtype=jnp.float32))
            print(report)
        finally:
            os.chdir(cwd)
    example = _example_path()
    if example is not None:
        audit_cmd, what = f"gradkit audit {example}", "real-looking losses that break, and their fixes"
    else:  # installed from a wheel: the examples folder is in the source repository only
        audit_cmd = "gradkit audit model.py:loss --arg 'f32[128]:normal(0,1)'"
        what = "your own loss, at inputs you give"
    width = max(len(audit_cmd), len("gradkit rules")) + 3
    print(f"\nNext: {audit_cmd:<{width}}{what}")
    print(f"      {'gradkit rules':<{width}}the rule tables and what each rule fixes")
    return EXIT_OK


def _example_path() -> str | None:
    """The shipped example losses as a path that works from the current directory, if this is a source install.

    Relative when the example is below the current directory (``examples/unstable_losses.py`` in the
    repository), else absolute; quoted for the shell.
    """
    import shlex

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 3))  # gradkit/_src/cli/ -> root
    path = os.path.join(root, "examples", "unstable_losses.py")
    if not os.path.isfile(path):
        return None
    with contextlib.suppress(ValueError):  # ValueError: another drive (Windows)
        rel = os.path.relpath(path)
        if not rel.startswith(os.pardir):
            path = rel
    return shlex.quote(path)


def _show(g: object) -> str:
    import numpy as np

    a = np.asarray(g).reshape(-1)
    return ("[" + ", ".join(f"{v:.3g}" for v in a[:4]) + (", …" if a.size > 4 else "") + "]") if a.size > 1 \
        else f"{float(a[0]):.3g}"


# --------------------------------------------------------------------------- entry point


AUDIT_EPILOG = """\
inputs, one of three ways:
  --arg SPEC, once per parameter of FUNC (one array each; SPEC as above):
    gradkit audit model.py:loss --arg "f32[128]:normal(0,1)" --arg "bool[128]"
  --args-from FILE.py:MAKE, a function that returns the tuple of FUNC's
  inputs, pytrees allowed (a model's parameters). gradkit calls MAKE() when
  it takes no parameter, else MAKE(key), key = jax.random.key(--seed):
    def make_inputs(key):              # in model.py
        return model.init(key, x), x, labels
    gradkit audit model.py:loss --args-from model.py:make_inputs
  GRADKIT_INPUTS in the file: a dict from function name to its tuple of
  inputs, or a function without parameters returning that dict;
  `gradkit audit FILE.py` audits every function it names:
    GRADKIT_INPUTS = {"loss": (params, x, labels),
                      "nll": ("f32[16]:normal(0,1)", "f32[16]:zeros")}
  There each input is an array, a number, a pytree, or a SPEC string.

exit codes:
  0  every gradient is finite
  1  a finding remains (a non-finite gradient)
  2  a usage error: bad arguments or inputs, a file that cannot be read, a
     function that fails on its inputs. One line on stderr per problem,
     starting with [gradkit], says which and how to fix it.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, no usage dump
        raise UsageError(f"{message} (see gradkit {self.prog.split()[-1] if ' ' in self.prog else ''} --help)"
                         .replace("gradkit gradkit", "gradkit").replace("  --help", " --help"))


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="gradkit", description="Gradient diagnostics for JAX: audit, rules, demo.")
    p.add_argument("--version", action="version", version=f"gradkit {_version()}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="{audit,rules,demo}")
    a = sub.add_parser("audit", help="find where NaN/inf gradients are born in functions of a file",
                       description="Audit functions in FILE.py: where non-finite gradients are born, and what "
                                   "fixes them.",
                       epilog=AUDIT_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    a.add_argument("targets", nargs="+", metavar="FILE.py[:FUNC]",
                   help="a file (audits the functions its GRADKIT_INPUTS names) or one function in it")
    a.add_argument("--arg", action="append", default=[], metavar="SPEC",
                   help=f"an input of FUNC, once per positional parameter: {SPEC_HELP}")
    a.add_argument("--args-from", metavar="FILE.py:MAKE",
                   help="FUNC's inputs from a function: MAKE() or MAKE(key) returns the tuple of inputs, one per "
                        "parameter, pytrees allowed (a model's parameters); key is jax.random.key(--seed). "
                        "MAKE alone names a function in FUNC's own file")
    a.add_argument("--json", action="store_true", help="print a JSON report instead of text")
    a.add_argument("--sweep", action="store_true",
                   help="also probe every array input: edge values for floats (0, ±1e-30, ±100, ±1e30, …), mask "
                        "patterns for bools (all False, a row all False, …), index extremes for integers; at most "
                        "64 probes, listed per input (an input left unvaried makes the verdict SWEEP PARTIAL)")
    a.add_argument("-v", "--verbose", action="store_true",
                   help="list every input leaf and non-finite element (by default many leaves, such as a "
                        "model's parameters, are grouped by module path)")
    a.add_argument("--table", metavar="NAME|FILE.toml",
                   help="audit with this rule table applied (a gradkit.tables name such as SAFE, or a TOML "
                        "file) and report which rules fired")
    a.add_argument("--seed", type=int, default=0,
                   help="seed for random spec values and for the key given to --args-from (default 0)")
    a.add_argument("--no-fix", action="store_true", help="do not re-run the suggested fixes")
    a.add_argument("-q", "--quiet", action="store_true",
                   help="no progress on stderr (by default it shows what is running, also when piped)")
    a.set_defaults(run=cmd_audit)
    r = sub.add_parser("rules", help="the rule catalog: names, what each fixes, which table holds it")
    r.add_argument("--json", action="store_true", help="print the catalog as JSON")
    r.set_defaults(run=cmd_rules)
    d = sub.add_parser("demo", help="a short tour of the classic NaN gradients, naive vs gradkit")
    d.set_defaults(run=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the ``gradkit`` command; returns the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "command", None):
            parser.print_help()
            return EXIT_USAGE
        return int(args.run(args))
    except UsageError as e:
        sys.stdout.flush()
        sys.stderr.write(f"[gradkit] {e}\n")
        return EXIT_USAGE
    except KeyboardInterrupt:
        sys.stderr.write("[gradkit] interrupted\n")
        return 130
    except Exception as e:
        if os.environ.get("GRADKIT_DEBUG"):
            raise
        sys.stderr.write(f"[gradkit] internal error: {type(e).__name__}: {first_line(str(e))} "
                         "(set GRADKIT_DEBUG=1 for the traceback, and please report it)\n")
        return EXIT_USAGE

