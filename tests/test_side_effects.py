"""No lasting side effects: after any gradkit use, JAX is as it was.

Checked directly: JAX's global differentiation/batching rule dicts, every
``jax.config`` value, the trace context ``jax.jit`` caches on, and the
gradients (bits) of plain functions, both in this process (after successful
and failing uses) and in a fresh interpreter before and after ``import gradkit``.

The one thing importing gradkit adds to JAX's rule dicts is the rules of its
own primitive (``compat.safe_scale_p``, used by the SAFE rules): an extension,
allowed by key; any other entry added, replaced or removed is an error.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk
from gradkit._src import compat


def plain_functions():
    """Plain JAX functions whose gradients gradkit must never change (NaN, inf, custom rules...)."""
    return {
        "sqrt_at_0": (lambda x: jnp.sum(jnp.sqrt(x)), jnp.array([0.0, 4.0])),
        "guarded_sqrt": (lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0)), jnp.array([0.0, 4.0])),
        "relu_at_0": (lambda x: jnp.sum(jax.nn.relu(x)), jnp.array([0.0, -1.0, 2.0])),
        "logsumexp": (lambda x: jax.nn.logsumexp(x * 100.0), jnp.array([1.0, 2.0, 3.0])),
        "softplus": (lambda x: jnp.sum(jax.nn.softplus(x)), jnp.array([-100.0, 0.0, 100.0])),
        "sin_scan": (lambda x: jnp.sum(lax.scan(lambda c, z: (jnp.sin(c) + z, None), x[0], x)[0]),
                     jnp.array([0.3, 0.5, 0.7])),
        "sort": (lambda x: jnp.sum(jnp.sort(x) * jnp.arange(3.0)), jnp.array([3.0, 1.0, 2.0])),
        "pow": (lambda x: jnp.sum(x ** 3 + jnp.exp(x)), jnp.array([0.5, 1.5])),
    }


def plain_gradient_bits():
    out = {}
    for name, (fn, x) in plain_functions().items():
        for jit in (False, True):
            g = (jax.jit(jax.grad(fn)) if jit else jax.grad(fn))(x)
            out[f"{name}/{'jit' if jit else 'eager'}"] = np.asarray(g).tobytes().hex()
    return out


def registries():
    from jax._src.interpreters import batching  # the pre-0.10 dict of (non-fancy) batching rules

    regs = compat.rule_registries_snapshot()
    plain = batching.primitive_batchers
    regs["plain_batchers"] = dict(plain) if isinstance(plain, dict) else {}
    return regs


def jax_state():
    return {
        "registries": registries(),
        "config": dict(jax.config.values),
        "trace_context": compat.trace_context(),
    }


def use_gradkit_every_way():
    """Successful and failing uses of every public entry point."""
    sqrt_rule = gk.vjp_rule(lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),))
    jvp_sin = gk.jvp_rule(lambda op, t: t[0] * 2.0 * jnp.cos(op.inputs[0]))
    x = jnp.array([0.0, 1.0, 4.0])

    @gk.op("side_effect_probe")
    def probe(x, *, k=1.0):
        return jnp.sin(x) * k

    fn = lambda x: jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0) + probe(x, k=2.0) + jnp.sin(x))
    table = gk.RuleTable({"sqrt": sqrt_rule}) | {"sin": jvp_sin, "side_effect_probe": gk.vjp_rule(lambda op, g: g)}
    f = gk.override(fn, table)
    f(x), jax.grad(f)(x), jax.jit(jax.grad(f))(x), jax.vmap(jax.grad(f))(jnp.stack([x, x]))
    jax.jvp(gk.override(lambda x: jnp.sum(jnp.sin(x)), {"sin": jvp_sin}), (x,), (x,))
    jax.hessian(gk.override(lambda x: jnp.sum(jnp.sin(x)), {"sin": jvp_sin}))(x)
    f.rewritten_jaxpr(x)
    safe = gk.override(fn, gk.tables.SAFE | gk.tables.STABLE)  # safe_scale in every mode
    jax.grad(safe)(x), jax.jvp(safe, (x,), (x,)), jax.hessian(safe)(x), jax.vmap(jax.grad(safe))(jnp.stack([x, x]))
    with jax.numpy_dtype_promotion("standard"):
        gk.override(lambda x: x * 2, {})(jnp.arange(3))
    failing = [
        lambda: jax.grad(gk.override(fn, {"sqrt": gk.vjp_rule(lambda op, g: (g, g))}))(x),  # bad rule
        lambda: jax.jit(jax.grad(gk.override(fn, {"sqrt": gk.vjp_rule(lambda op, g: 1 / 0)})))(x),  # raises
        lambda: jax.grad(gk.override(fn, {"sin": gk.jvp_rule(lambda op, t: t[0] ** 2)}))(x),  # nonlinear
        lambda: jax.jvp(gk.override(fn, {"sqrt": sqrt_rule}), (x,), (x,)),  # VJP rule in forward mode
        lambda: gk.override(lambda x: jnp.sin(x) if x[0] > 0 else x, {})(x),  # control flow
        lambda: gk.override(fn, {"sqrtt": sqrt_rule}, strict=True)(x),  # strict
        lambda: gk.override(lambda x, c: x, {})(x, {1}),  # unhashable static
        lambda: gk.RuleTable({"sin": 3}),  # bad table
    ]
    for bad in failing:
        with pytest.raises(Exception):
            bad()


def registry_changes(before, after):
    """Entries changed or removed, and entries added by anything but JAX itself.

    (JAX registers some primitives lazily when its own modules are first
    imported; gradkit must never add, replace or remove one, except the rules
    of its own primitives.)
    """
    out = []
    for name, b in before.items():
        a = after[name]
        out += [f"{name}[{k}] changed or removed" for k in b if a.get(k) is not b[k]]
        out += [f"{name}[{k}] added by {getattr(v, '__module__', '?')}" for k, v in a.items()
                if k not in b and k not in compat.OWN_PRIMITIVES
                and not str(getattr(v, "__module__", "")).startswith("jax")]
    return out


def test_gradkit_registers_rules_for_its_own_primitive_only():
    regs = registries()
    own = {k for reg in regs.values() for k in reg if k in compat.OWN_PRIMITIVES}
    assert own == set(compat.OWN_PRIMITIVES) == {compat.safe_scale_p, compat.masked_scale_p}
    assert compat.safe_scale_p in regs["primitive_jvps"] and compat.safe_scale_p in regs["primitive_transposes"]
    assert compat.safe_scale_p in regs["primitive_batchers"] or compat.safe_scale_p in regs["plain_batchers"]
    # every other rule in those dicts belongs to JAX (or to another library, never to gradkit)
    for reg in regs.values():
        for k, v in reg.items():
            if k not in compat.OWN_PRIMITIVES:
                assert not str(getattr(v, "__module__", "")).startswith("gradkit"), (k, v)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_jax_state_and_plain_gradients_unchanged_in_process():
    before, bits = jax_state(), plain_gradient_bits()
    use_gradkit_every_way()
    after = jax_state()
    assert registry_changes(before["registries"], after["registries"]) == []
    assert {k: v for k, v in after["config"].items() if k in before["config"]} == before["config"]
    assert after["trace_context"] == before["trace_context"]
    assert plain_gradient_bits() == bits


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
def test_plain_gradients_unchanged_by_import_and_use_in_a_fresh_process():
    # Before gradkit is ever imported vs after import and heavy use, in one
    # fresh interpreter: catches import-time side effects too.
    code = PROBE.format(test_file=json.dumps(__file__), repo=json.dumps(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["gradkit_imported_before"] is False
    assert report["bits_after"] == report["bits_before"]
    assert report["registry_changes"] == [] and report["config_changes"] == []
    assert report["own_registered"] == ["gradkit_masked_scale", "gradkit_safe_scale"]


# The fresh-process probe: plain_functions/plain_gradient_bits are exec'd from
# this file's source *without* importing gradkit, measured, then gradkit is
# imported and used every way, and everything is measured again.
PROBE = """
import ast, json, sys
sys.path.insert(0, {repo})
import jax, numpy as np
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")
import jax.numpy as jnp
from jax import lax
from jax._src.interpreters import ad, batching

src = open({test_file}).read()
tree = ast.parse(src)
keep = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in ("plain_functions", "plain_gradient_bits")]
ns = dict(jax=jax, jnp=jnp, lax=lax, np=np)
exec(compile(ast.Module(body=keep, type_ignores=[]), "probe", "exec"), ns)

def registries():
    plain = batching.primitive_batchers
    return dict(jvps=dict(ad.primitive_jvps), transposes=dict(ad.primitive_transposes),
                batchers=dict(getattr(batching, "fancy_primitive_batchers", {{}})),
                plain_batchers=dict(plain) if isinstance(plain, dict) else {{}})

def diff(before, after, own=()):
    # Entries changed or removed, and entries added by anything but JAX itself (or for gradkit's own
    # primitives: `own`, known only after the import).
    out = []
    for name, b in before.items():
        a = after[name]
        out += [f"{{name}}[{{k}}] changed" for k in b if a.get(k) is not b[k]]
        out += [f"{{name}}[{{k}}] added by {{getattr(v, '__module__', '?')}}" for k, v in a.items()
                if k not in b and k not in own and not str(getattr(v, "__module__", "")).startswith("jax")]
    return out

imported_before = "gradkit" in sys.modules
bits_before, regs_before, config_before = ns["plain_gradient_bits"](), registries(), dict(jax.config.values)
import pytest  # noqa: F401  (use_gradkit_every_way uses pytest.raises)
import gradkit  # noqa: F401
import importlib.util
spec = importlib.util.spec_from_file_location("side_effects_probe", {test_file})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.use_gradkit_every_way()
print(json.dumps({{
    "gradkit_imported_before": imported_before,
    "bits_before": bits_before,
    "bits_after": ns["plain_gradient_bits"](),
    # Importing gradkit imports jax.extend, which makes JAX register its own
    # `check` primitive and pallas config flags: additions by JAX are fine.
    "registry_changes": diff(regs_before, registries(), gradkit._src.compat.OWN_PRIMITIVES),
    "own_registered": sorted(p.name for p in gradkit._src.compat.OWN_PRIMITIVES
                             if p in ad.primitive_jvps and p in ad.primitive_transposes),
    "config_changes": [k for k, v in config_before.items() if jax.config.values.get(k) != v],
}}))
"""


def test_failed_trace_leaves_no_trace_state_behind():
    # A rule that raises mid-trace under jit: the next plain trace is clean
    # (no leaked tracer, no leftover source-info context).
    bad = gk.override(lambda x: jnp.sum(jnp.sin(x)), {"sin": gk.vjp_rule(lambda op, g: {}["x"])})
    with pytest.raises(KeyError):
        jax.jit(jax.grad(bad))(jnp.ones(3))
    jaxpr = jax.make_jaxpr(jax.grad(lambda x: jnp.sum(jnp.sin(x))))(jnp.ones(3))
    assert "custom_vjp" not in str(jaxpr) and "gradkit" not in str(jaxpr)
    np.testing.assert_array_equal(jax.grad(lambda x: jnp.sum(jnp.sin(x)))(jnp.ones(3)), np.cos(np.ones(3, np.float32)))


@gk.op("leak_probe")
def _leak_probe(x, *, k=1.0):
    return jnp.sin(x) * k


@pytest.mark.slow  # over 4 s on 2 cores: the slow set (CI runs it)
@pytest.mark.parametrize("mode", ["vjp", "jvp"])
def test_no_leaked_tracers_under_jax_checking_leaks(mode):
    # The rewritten program's custom_vjp/custom_jvp closures outlive the trace
    # that made them (JAX keeps them with the compiled program): they must not
    # hold that trace's tracers.
    rule = gk.vjp_rule(lambda op, g: (g * 2.0,)) if mode == "vjp" else gk.jvp_rule(lambda op, t: t[0] * 2.0)
    table = {"sin": rule, "leak_probe": rule}
    x = jnp.array([0.5, 1.0, 4.0])
    programs = [
        lambda x: jnp.sum(jnp.sin(x) * 2.0),
        lambda x: jnp.sum(lax.scan(lambda c, z: (jnp.sin(c) + z, None), x, jnp.stack([x, x]))[0]),
        lambda x: jnp.sum(_leak_probe(x, k=2.0)),
    ]
    from budget import checking_leaks  # here: the fresh-process probe loads this file without tests/ on its path

    with checking_leaks():
        for fn in programs:
            f = gk.override(fn, table)
            f(x), jax.grad(f)(x), jax.jit(jax.grad(f))(x), jax.vmap(jax.grad(f))(jnp.stack([x, x]))
            if mode == "jvp":
                jax.jvp(f, (x,), (x,))
