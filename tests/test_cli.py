"""The `gradkit` command: the real console script in a subprocess (exit codes, --json, bad arguments).

Subprocesses pay JAX's import each time, so there are few of them; input-spec
parsing and the other commands are also tested in-process through `main()`.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gradkit.cli import UsageError, main, parse_spec

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPT = shutil.which("gradkit", path=os.path.dirname(sys.executable))  # the console script of this venv


def run(*args, module=False, cwd=ROOT):
    cmd = [sys.executable, "-m", "gradkit", *args] if module or SCRIPT is None else [SCRIPT, *args]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def in_process(capsys, monkeypatch):
    """``main(args)`` in this process, as a finished subprocess (its exit code, stdout, stderr): the command's
    own behaviour without another import of JAX."""
    monkeypatch.chdir(ROOT)

    def call(*args):
        rc = main(list(args))
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(list(args), rc, out, err)

    return call


@pytest.fixture(scope="module")
def finite_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli") / "model.py"
    path.write_text(textwrap.dedent("""\
        import jax.numpy as jnp

        def mse(pred, target):
            return jnp.mean((pred - target) ** 2)

        def guarded(x):
            return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))

        GRADKIT_INPUTS = {"mse": ("f32[8]:normal(0,1)", "f32[8]:zeros")}
        """))
    return str(path)


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_main_job_audits_the_examples_and_exits_1():
    start = time.time()
    p = run("audit", "examples/unstable_losses.py")
    elapsed = time.time() - start
    assert p.returncode == 1, p.stderr
    out = p.stdout
    assert out.startswith("gradkit audit: examples/unstable_losses.py\n")
    assert out.count("\nFINDING  ") == 7
    assert out.count("re-run    ") == 7
    with open(os.path.join(ROOT, "examples", "unstable_losses.py")) as f:
        line = next(i + 1 for i, text in enumerate(f) if "jnp.log1p(jnp.exp(logits))" in text)
    assert f"born at   examples/unstable_losses.py:{line}  `exp` (forward pass)" in out
    assert "inside scan at" in out
    assert out.rstrip().endswith("7 functions audited: 0 ok, 7 with non-finite gradients")
    assert "Traceback" not in p.stderr
    # stdout is a pipe here, yet progress still reaches stderr: one line per function, in order
    steps = re.findall(r"^\[gradkit\] auditing (\w+) \((\d)/7\)…$", p.stderr, re.M)
    assert [int(k) for _, k in steps] == list(range(1, 8))
    assert len({n for n, _ in steps}) == 7 and all(f"FINDING  {n}(" in out for n, _ in steps)
    assert elapsed < 120  # the README's main job: well under a minute on a normal machine


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_json_report_parses_and_exit_codes(finite_file):
    p = run("audit", "examples/unstable_losses.py:angle_loss", "--json", "--quiet")
    assert p.returncode == 1, p.stderr
    assert p.stderr == ""  # --quiet: no progress
    doc = json.loads(p.stdout)
    assert doc["ok"] is False
    (fn,) = doc["functions"]
    assert fn["target"] == "examples/unstable_losses.py:angle_loss" and fn["finite"] is False
    assert fn["findings"][0]["op"] == "atan2" and fn["findings"][0]["fix"]["verified"] is True
    # python -m gradkit on a file that declares its inputs, and a function given --arg inputs: finite -> exit 0
    p = run("audit", finite_file, "--json", module=True)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["ok"] is True and [f["function"] for f in doc["functions"]] == ["mse"]
    p = run("audit", f"{finite_file}:guarded", "--arg", "f32[4]:uniform(1,2)")
    assert p.returncode == 0, p.stderr
    assert "ok       guarded(x: f32[4])" in p.stdout


@pytest.mark.parametrize("args, message", [
    (("audit", "no/such/file.py"), "[gradkit] no such file: no/such/file.py"),
    (("audit", "examples/unstable_losses.py:angle_loss", "--arg", "f32[6,2", "--arg", "f32[6]"),
     "[gradkit] cannot parse input spec 'f32[6,2': expected DTYPE[SHAPE][:VALUES]"),
])
def test_bad_arguments_get_one_line_and_exit_2(args, message, in_process):
    p = in_process(*args)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), p.stderr
    assert p.stdout == ""


def test_rules_command_lists_the_tables(in_process):
    p = in_process("rules")
    assert p.returncode == 0, p.stderr
    assert "gradkit.tables.SAFE" in p.stdout and "gradkit.tables.STABLE" in p.stdout
    assert "gradkit.tables.STABLE_FUNCTIONS" in p.stdout
    assert any(line.split()[:3] == ["log", "jvp", "safe"] for line in p.stdout.splitlines())


# --------------------------------------------------------------------------- in-process


def test_in_process_errors(capsys, finite_file, monkeypatch):
    cases = [
        (["audit", "examples/unstable_losses.py:nope"], "has no function 'nope' (functions: angle_loss"),
        (["audit", "examples/unstable_losses.py:angle_loss", "--arg", "f32[3]"],
         "angle_loss takes 2 input(s) (pred_xy, target_angle) but 1 --arg given"),
        (["audit", "examples/unstable_losses.py", "--arg", "f32[3]"], "--arg gives the inputs of one function"),
        ([ "audit", f"{finite_file}:guarded"], "no inputs for guarded: give --arg SPEC once per parameter (x)"),
        (["audit", "README.md"], "README.md is not a Python file"),
        (["audit", "examples/unstable_losses.py", "--table", "NOPE"], "unknown table 'NOPE': give a name from"),
        (["audit"], "the following arguments are required"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ]
    monkeypatch.chdir(ROOT)
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("[gradkit] ") and message in err and err.count("\n") == 1, (argv, err)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_in_process_table_sweep_and_demo(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["audit", "examples/unstable_losses.py:gaussian_nll", "--table", "SAFE", "--sweep"]) == 1
    cap = capsys.readouterr()
    import gradkit.tables

    n = len(gradkit.tables.SAFE)
    assert f"rules     4 of {n} rules fired (div x2, integer_pow x1, log x1, mul x1); never matched: acos" in cap.out
    assert "gradient  finite for every input" in cap.out  # SAFE fixes it at the declared inputs…
    assert "probes break the gradient" in cap.out  # …but the sweep finds inputs that still break it
    assert "[gradkit] sweep gaussian_nll:" in cap.err  # progress goes to stderr
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "log(1 + exp(x)) at x = 100" in out and "gk.stable.log1pexp" in out
    assert "born at   gradkit_demo.py:26  `exp` (forward pass)" in out


def test_a_function_that_raises_is_reported_once(capsys, tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent("""\
        import jax.numpy as jnp

        def ok(x):
            return jnp.sum(x ** 2)

        def broken(x):
            return jnp.sum(x @ jnp.ones((5, 2)))  # (3,) @ (5, 2): a shape error

        def raises(x):
            raise ValueError("x must be sorted")  # line 10

        GRADKIT_INPUTS = {"ok": ("f32[3]",), "broken": ("f32[3]",), "raises": ("f32[3]",)}
        """))
    assert main(["audit", str(path), "--quiet"]) == 2
    cap = capsys.readouterr()
    # the report of the function that could be audited on stdout; one [gradkit] line per failure on stderr
    assert "ok       ok(x: f32[3])" in cap.out and "ERROR" not in cap.out
    assert cap.out.rstrip().endswith("3 functions audited: 1 ok, 2 could not be audited (see stderr)")
    errors = cap.err.splitlines()
    assert [e.split(" could not be audited: ")[0] for e in errors] == [f"[gradkit] {path}:broken",
                                                                       f"[gradkit] {path}:raises"], cap.err
    assert cap.err.count("contracting dimensions") == 1, cap.err
    assert cap.err.count("x must be sorted") == 1, cap.err
    assert "ValueError: x must be sorted (raised at " + f"{path}:10)" in errors[1]  # names the line
    assert f"(raised at {path}:7)" in errors[0]
    assert all("check that the inputs declared in the file (GRADKIT_INPUTS) fit" in e for e in errors)
    # without --quiet, stderr carries progress, then the errors once each
    assert main(["audit", str(path)]) == 2
    cap = capsys.readouterr()
    lines = cap.err.splitlines()
    assert lines[:3] == [f"[gradkit] auditing {n} ({k}/3)…" for k, n in enumerate(["ok", "broken", "raises"], 1)]
    assert lines[3:] == errors
    assert "contracting dimensions" not in cap.out and "x must be sorted" not in cap.out


def test_files_are_modules_while_they_run(capsys, tmp_path):
    """A dataclass under postponed annotations looks its module up in sys.modules while the class is made."""
    source = textwrap.dedent("""\
        from __future__ import annotations

        import dataclasses

        import jax.numpy as jnp


        @dataclasses.dataclass(frozen=True)
        class Config:
            scale: float = SCALE


        def loss(x):
            return jnp.sum(Config().scale * x ** 2)


        GRADKIT_INPUTS = {"loss": ("f32[3]:[1,2,3]",)}
        """)
    for k, scale in enumerate([2.0, 3.0]):  # two files of the same name: each keeps its own module
        folder = tmp_path / f"d{k}"
        folder.mkdir()
        (folder / "model.py").write_text(source.replace("= SCALE", f"= {scale}"))
    a, b = str(tmp_path / "d0" / "model.py"), str(tmp_path / "d1" / "model.py")
    assert main(["audit", a, b, "--json", "--quiet"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and [f["target"] for f in doc["functions"]] == [f"{a}:loss", f"{b}:loss"]
    # the value of sum(scale * x**2) at x = [1, 2, 3] is 14 * scale: each file ran with its own Config
    assert [f["value"] for f in doc["functions"]] == ["finite (28)", "finite (42)"]
    # a file that fails while importing leaves nothing behind in sys.modules
    bad = tmp_path / "bad_import.py"
    bad.write_text("import jax\nraise RuntimeError('boom')\n")
    before = set(sys.modules)
    assert main(["audit", str(bad)]) == 2
    assert f"error while importing {bad}:2: RuntimeError: boom" in capsys.readouterr().err
    assert not [m for m in set(sys.modules) - before if m.startswith("_gradkit_target_")]


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_demo_hint_works_from_any_directory(capsys, monkeypatch, tmp_path):
    from gradkit._src.cli import main as cli

    monkeypatch.chdir(tmp_path)
    assert main(["demo"]) == 0
    (hint,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Next: gradkit audit ")]
    cmd = shlex.split(hint.removeprefix("Next: ").split("   ")[0])
    assert os.path.isabs(cmd[2]) and os.path.samefile(cmd[2], os.path.join(ROOT, "examples", "unstable_losses.py"))
    assert main(cmd[1:2] + [cmd[2] + ":angle_loss", "--quiet"]) == 1  # runs from here: the finding is found
    assert "FINDING  angle_loss(" in capsys.readouterr().out
    # installed without the repository's examples folder: a command for the user's own file
    monkeypatch.setattr(cli, "_example_path", lambda: None)
    assert main(["demo"]) == 0
    (hint,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("Next: gradkit audit ")]
    cmd = shlex.split(hint.removeprefix("Next: ").split("   ")[0])
    (tmp_path / "model.py").write_text("import jax.numpy as jnp\n\ndef loss(x):\n    return jnp.sum(jnp.sqrt(x))\n")
    assert main(cmd[1:] + ["--quiet"]) == 1  # sqrt at normal(0,1) inputs: negative values give NaN gradients
    assert "FINDING  loss(x: f32[128])" in capsys.readouterr().out


def test_rules_lists_every_table_and_library_rule(capsys):
    import gradkit.tables
    from gradkit._src.core.table import RuleTable

    assert main(["rules", "--json"]) == 0
    cat = json.loads(capsys.readouterr().out)
    names = {n for n, v in vars(gradkit.tables).items() if isinstance(v, RuleTable) and not n.startswith("_")}
    assert set(cat["tables"]) == {f"gradkit.tables.{n}" for n in names} and {"SAFE", "STABLE"} <= names
    for n in names:
        table = getattr(gradkit.tables, n)
        assert [r["op"] for r in cat["tables"][f"gradkit.tables.{n}"]] == sorted(table)
    lib = gradkit.tables.library()
    assert {r["rule"]: r["signature"] for r in cat["library"]} == {k: v.signature() for k, v in lib.items()}
    assert all(r["doc"] for r in cat["library"])


def test_parse_spec():
    rng = np.random.RandomState(0)
    a = parse_spec("f32[128]:uniform(-1,1)", rng)
    assert a.dtype == np.float32 and a.shape == (128,) and a.min() >= -1 and a.max() <= 1
    assert parse_spec("f64[2,3]:full(2.5)", rng).tolist() == [[2.5] * 3] * 2
    assert parse_spec("f32[]:100", rng).shape == () and float(parse_spec("f32[]:100", rng)) == 100.0
    assert parse_spec("f32[3]:[0, 1e-30, -2]", rng).tolist() == pytest.approx([0, 1e-30, -2])
    assert parse_spec("f32[5]:linspace(0,1)", rng).tolist() == pytest.approx([0, 0.25, 0.5, 0.75, 1])
    assert parse_spec("i32[4]:randint(0,3)", rng).dtype == np.int32
    assert parse_spec("bool[6]:bernoulli(1)", rng).all()
    assert parse_spec("bf16[2]:ones", rng).dtype.name == "bfloat16"
    assert parse_spec("1.5", rng).dtype == np.float32
    for bad, msg in [("f32[3", "cannot parse"), ("x32[3]", "unknown dtype"), ("f32[a]", "shape [a]"),
                     ("f32[3]:[1,2]", "2 values given for shape [3]"), ("f32[3]:gamma(1)", "unknown generator"),
                     ("f32[3]:uniform(1)", "uniform takes 2 argument(s)")]:
        with pytest.raises(UsageError, match=re.escape(msg)):
            parse_spec(bad, rng)


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_in_process_verbose_lists_every_leaf(capsys, monkeypatch, tmp_path):
    path = tmp_path / "many.py"
    path.write_text(textwrap.dedent("""\
        import jax.numpy as jnp

        def loss(params):
            return sum(jnp.sum(jnp.sqrt(w - 1.0)) for w in params.values())  # sqrt'(0) = inf at w = 1

        def make():
            return ({f"layer{i:02d}": jnp.ones(2) for i in range(40)},)
        """))
    monkeypatch.chdir(tmp_path)
    assert main(["audit", "many.py:loss", "--args-from", "make", "-q"]) == 1
    short = capsys.readouterr().out
    assert main(["audit", "many.py:loss", "--args-from", "make", "-q", "--verbose"]) == 1
    full = capsys.readouterr().out
    assert "layer39" not in short and "layer39" in full  # grouped by default, every leaf with --verbose
    assert len(full.splitlines()) > len(short.splitlines())
