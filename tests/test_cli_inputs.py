"""Inputs of `gradkit audit`: pytrees from `--args-from`, spec validation, inputs a function cannot run on.

The command-line behaviour runs through the installed `gradkit` console script in a subprocess (as a
user types it); the finer cases of spec parsing run in-process.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from gradkit.cli import UsageError, main, parse_spec

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
SCRIPT = shutil.which("gradkit", path=os.path.dirname(sys.executable))  # the console script of this venv
GUIDE = os.path.join(ROOT, "docs", "guide-diagnose.md")  # the CLI guide, moved out of the README
FLAX_COMMAND = "gradkit audit examples/flax_attention.py:loss --args-from examples/flax_attention.py:make_inputs"


def gradkit(*args, cwd=ROOT):
    assert SCRIPT is not None, "the gradkit console script is not installed in this venv (pip install -e .)"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([SCRIPT, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def one_error_line(p):
    """Exit 2 with exactly one `[gradkit]` line on stderr (a run with --quiet) and nothing on stdout."""
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("[gradkit] "), p.stderr
    assert "Traceback" not in p.stderr and p.stdout == ""
    return lines[0]


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A two-layer model whose parameters are a dict pytree, and input builders of every kind."""
    path = tmp_path_factory.mktemp("cli_inputs") / "model.py"
    path.write_text(textwrap.dedent("""\
        import jax
        import jax.numpy as jnp
        import numpy as np


        def loss(params, x):
            h = jnp.tanh(x @ params["layer1"]["w"] + params["layer1"]["b"][None, :])
            return jnp.mean((h @ params["layer2"]["w"]) ** 2)


        def guarded(params, x):
            h = x @ params["layer1"]["w"]
            return jnp.sum(jnp.where(h > 0, jnp.sqrt(h), 0.0))


        def make_inputs(key):
            k1, k2, k3 = jax.random.split(key, 3)
            params = {"layer1": {"w": jax.random.normal(k1, (4, 8)), "b": jnp.zeros(8)},
                      "layer2": {"w": jax.random.normal(k2, (8, 1))}}
            return params, jax.random.normal(k3, (16, 4))


        def fixed_inputs():
            params = {"layer1": {"w": np.full((4, 8), -1.0, np.float32), "b": np.zeros(8, np.float32)},
                      "layer2": {"w": np.ones((8, 1), np.float32)}}
            return [params, "f32[16,4]:uniform(0,1)"]


        def not_a_tuple(key):
            return {"params": 1}


        def raises():
            raise RuntimeError("dataset not found")


        def two_params(key, n):
            return ()
        """))
    return str(path)


# --------------------------------------------------------------------------- the guide's Flax block


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_guide_flax_command_runs_as_written():
    """docs/guide-diagnose.md's CLI block audits a Flax linen model from the terminal; the report names the NaN's
    birth."""
    pytest.importorskip("flax")  # in the `test` extra: CI's newest-JAX run always has it
    with open(GUIDE, encoding="utf-8") as f:
        guide = f.read()
    blocks = re.findall(r"```bash\n(.*?)```", guide, re.S)
    (line,) = [ln for b in blocks for ln in b.splitlines() if ln.startswith("gradkit audit examples/flax_attention")]
    assert line == FLAX_COMMAND  # as written: no prompt, no comment, runnable from the repository root
    with open(os.path.join(ROOT, "examples", "flax_attention.py"), encoding="utf-8") as f:
        softmax_line = next(i for i, text in enumerate(f, 1) if "jax.nn.softmax(scores" in text)
    # the line number the guide promises is the example's softmax line
    assert f"`examples/flax_attention.py:{softmax_line}`" in guide

    p = gradkit(*shlex.split(line)[1:])
    assert p.returncode == 1, (p.stdout, p.stderr)  # a finding remains
    out = p.stdout
    assert out.startswith("gradkit audit: examples/flax_attention.py\n")
    assert out.count("\nFINDING  loss(") == 1
    (born,) = re.findall(r"^\s*born at\s+(.*)$", out, re.M)
    assert born.startswith(f"examples/flax_attention.py:{softmax_line}  ") and "softmax" in born, born
    assert "(forward pass)" in born  # -inf - -inf in the padded example's rows, not a backward formula
    assert "params" in out.split("\nFINDING  loss(")[1].splitlines()[0]  # the parameter pytree was an input
    assert out.rstrip().endswith("1 function audited: 0 ok, 1 with non-finite gradients")
    assert "Traceback" not in p.stderr and not [ln for ln in p.stderr.splitlines()
                                                if ln.startswith("[gradkit] ") and "auditing loss" not in ln]


# --------------------------------------------------------------------------- --args-from


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_args_from_passes_a_pytree_and_a_key_from_seed(model_file):
    p = gradkit("audit", f"{model_file}:loss", "--args-from", f"{model_file}:make_inputs", "--json", "-q")
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    (fn,) = json.loads(p.stdout)["functions"]
    assert fn["target"] == f"{model_file}:loss" and fn["finite"] is True
    assert "layer1" in json.dumps(fn) and "layer2" in json.dumps(fn)  # the pytree's leaves were inputs
    # the inputs are make_inputs(jax.random.key(seed)), --seed 0 by default, and another seed gives others
    other = json.loads(gradkit("audit", f"{model_file}:loss", "--args-from", f"{model_file}:make_inputs",
                               "--json", "-q", "--seed", "1").stdout)["functions"][0]
    import importlib.util

    import jax

    spec = importlib.util.spec_from_file_location("cli_inputs_model", model_file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for seed, doc in [(0, fn), (1, other)]:
        expected = float(module.loss(*module.make_inputs(jax.random.key(seed))))
        (shown,) = re.findall(r"finite \((.*)\)", doc["value"])
        assert float(shown) == pytest.approx(expected, rel=1e-4), (seed, doc["value"], expected)
    assert other["value"] != fn["value"]


def test_args_from_without_a_key_list_and_spec_strings(model_file):
    # MAKE() with no parameter; a list is accepted; a spec string in it is an input like --arg's
    p = gradkit("audit", f"{model_file}:guarded", "--args-from", "fixed_inputs", "-q")  # MAKE in FUNC's file
    assert p.returncode == 1, p.stderr  # h = -(sum of x) < 0 everywhere: sqrt masked by where, NaN gradient
    assert "FINDING  guarded(" in p.stdout and "x: f32[16,4]" in p.stdout
    assert "`sqrt`" in p.stdout


@pytest.mark.parametrize("extra, message", [
    (("--arg", "f32[4]", "--args-from", "make_inputs"),
     "give the inputs either with --arg (one array per parameter) or with --args-from"),
    (("--args-from", "nope"), "has no function 'nope' (functions: fixed_inputs, guarded, loss, make_inputs"),
    (("--args-from", "raises"), "raises() raised RuntimeError: dataset not found (at {path}:{line}); fix it"),
    (("--args-from", "not_a_tuple"), "not_a_tuple must return a tuple (or list) of the audited function's "
                                     "inputs, one per parameter, got dict"),
    (("--args-from", "two_params"), "two_params must take no parameter or one, a PRNG key"),
    (("--args-from", "{path}"), "cannot read --args-from '{path}': expected FILE.py:FUNC"),
    (("--args-from", "fixed_inputs", "--arg", "f32[1]"), "give the inputs either with --arg"),
])
def test_args_from_usage_errors(model_file, extra, message, capsys, monkeypatch):
    # in-process (the console script's own path runs in the subprocess tests around): one import of JAX saved
    # per case
    with open(model_file) as f:
        raise_line = next(i for i, text in enumerate(f, 1) if "dataset not found" in text)
    extra = tuple(a.format(path=model_file) for a in extra)
    monkeypatch.chdir(ROOT)
    rc = main(["audit", f"{model_file}:loss", *extra, "-q"])
    out, err = capsys.readouterr()
    line = one_error_line(subprocess.CompletedProcess([], rc, out, err))
    assert message.format(path=model_file, line=raise_line) in line, line


def test_args_from_checks_the_count_and_needs_one_function(model_file, capsys):
    assert main(["audit", "examples/unstable_losses.py:path_length", "--args-from", f"{model_file}:make_inputs"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and (f"path_length takes 1 input(s) (points) but 2 inputs returned by "
                                     f"{model_file}:make_inputs") in err, err
    assert main(["audit", model_file, "--args-from", "make_inputs"]) == 2
    assert "--args-from gives the inputs of one function: name it as FILE.py:FUNC" in capsys.readouterr().err
    assert main(["audit", f"{model_file}:loss", "--args-from", "missing.py:make"]) == 2
    assert capsys.readouterr().err == "[gradkit] no such file: missing.py\n"


# --------------------------------------------------------------------------- specs


def test_spec_errors_through_the_command():
    line = one_error_line(gradkit("audit", "examples/unstable_losses.py:path_length", "--arg",
                                  "f32[10,3]:bernoulli(2)", "-q"))
    assert "bernoulli(p) needs a probability p in [0, 1], got 2" in line
    # float32[…] is the long spelling of f32[…], listed in --help
    p = gradkit("audit", "examples/unstable_losses.py:angle_loss", "--arg", "float32[6,2]:uniform(1,2)",
                "--arg", "float32[6]:zeros", "-q")
    assert p.returncode == 0, p.stderr
    assert "ok       angle_loss(pred_xy: f32[6,2], target_angle: f32[6])" in p.stdout


def test_help_documents_inputs_specs_and_exit_codes():
    p = gradkit("audit", "--help")
    assert p.returncode == 0
    text = " ".join(p.stdout.split())
    assert "f32 (float32)" in text and "bernoulli(p) (p in [0,1])" in text
    assert "--args-from FILE.py:MAKE" in text and "MAKE(key), key = jax.random.key(--seed)" in text
    assert "GRADKIT_INPUTS in the file: a dict from function name to its tuple of inputs" in text
    assert "0 every gradient is finite 1 a finding remains" in text
    assert "2 a usage error" in text and "starting with [gradkit]" in text


def test_parse_spec_validates_values_and_spellings():
    rng = np.random.RandomState(0)
    for short, long in [("f16", "float16"), ("bf16", "bfloat16"), ("f32", "float32"), ("f64", "float64"),
                        ("i32", "int32"), ("i64", "int64")]:
        a = parse_spec(f"{short}[3]:ones", rng)
        b = parse_spec(f"{long}[3]:ones", rng)
        assert a.dtype == b.dtype and a.dtype.name == long and a.tolist() == b.tolist() == [1, 1, 1]
    assert parse_spec("F32[2]:zeros", rng).dtype == np.float32
    assert parse_spec("bool[4]:bernoulli(0)", rng).tolist() == [False] * 4
    assert parse_spec("bool[4]:bernoulli(1)", rng).tolist() == [True] * 4
    assert np.isinf(parse_spec("f32[2]:full(-inf)", rng)).all()  # edge values stay possible
    assert np.isnan(parse_spec("f32[2]:full(nan)", rng)).all()
    assert parse_spec("i32[50]:randint(3,4)", rng).tolist() == [3] * 50
    for bad, msg in [
        ("bool[8]:bernoulli(2)", "bernoulli(p) needs a probability p in [0, 1], got 2"),
        ("bool[8]:bernoulli(-0.1)", "bernoulli(p) needs a probability p in [0, 1], got -0.1"),
        ("bool[8]:bernoulli(nan)", "bernoulli's arguments must be finite numbers"),
        ("f32[8]:normal(0,-1)", "normal(mean,std) needs std >= 0, got -1"),
        ("f32[8]:uniform(1,0)", "uniform(lo,hi) needs lo <= hi"),
        ("f32[8]:uniform(0,inf)", "uniform's arguments must be finite numbers; for inf or nan everywhere use full"),
        ("i32[8]:randint(3,3)", "randint(lo,hi) needs integers lo < hi (hi is excluded)"),
        ("i32[8]:randint(0,2.5)", "randint(lo,hi) needs integers lo < hi"),
        ("float8[3]", "unknown dtype 'float8' (use f16 (or float16), bf16 (bfloat16), f32 (float32)"),
    ]:
        with pytest.raises(UsageError, match=re.escape(msg)):
            parse_spec(bad, rng)


# --------------------------------------------------------------------------- inputs a function cannot run on


def test_inputs_the_function_cannot_take_are_one_line_on_stderr(tmp_path):
    """A bool spec where a float goes, or a shape the function cannot trace: one [gradkit] line, exit 2."""
    line = one_error_line(gradkit("audit", "examples/unstable_losses.py:path_length", "--arg", "bool[10,3]", "-q"))
    assert line.startswith("[gradkit] examples/unstable_losses.py:path_length could not be audited: ")
    assert "no floating-point input" in line and "check that the --arg inputs fit path_length's parameters" in line
    path = tmp_path / "shapes.py"
    path.write_text("import jax.numpy as jnp\n\ndef loss(x):\n    return jnp.sum(x @ jnp.ones((5, 2)))\n")
    p = gradkit("audit", f"{path}:loss", "--arg", "f32[3]")  # with progress: it precedes the error line
    assert p.returncode == 2 and p.stdout == "", p.stdout
    lines = p.stderr.strip().splitlines()
    assert lines[:-1] == ["[gradkit] auditing loss (1/1)…"], p.stderr
    assert lines[-1].startswith(f"[gradkit] {path}:loss could not be audited: ")
    assert "TypeError: dot_general requires contracting dimensions to have the same shape" in lines[-1]
    assert f"(raised at {path}:4)" in lines[-1] and "Traceback" not in p.stderr


def test_json_keeps_the_error_in_the_document_and_says_it_on_stderr(tmp_path, capsys):
    path = tmp_path / "half.py"
    path.write_text(textwrap.dedent("""\
        import jax.numpy as jnp

        def fine(x):
            return jnp.sum(x ** 2)

        def broken(x):
            return jnp.sum(x @ jnp.ones((5, 2)))

        GRADKIT_INPUTS = {"fine": ("f32[3]",), "broken": ("f32[3]",)}
        """))
    assert main(["audit", str(path), "--json", "-q"]) == 2
    cap = capsys.readouterr()
    doc = json.loads(cap.out)
    assert doc["ok"] is False and [f.get("function") for f in doc["functions"]] == ["fine", None]
    broken = doc["functions"][1]
    assert broken["target"] == f"{path}:broken" and "contracting dimensions" in broken["error"]
    (line,) = cap.err.splitlines()
    assert line.startswith(f"[gradkit] {path}:broken could not be audited: ") and "contracting dimensions" in line
