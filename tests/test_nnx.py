"""Flax NNX modules through ``gk.override``: the state a function changes is kept, as ``nnx.jit`` keeps it.

Each case runs the same steps through ``nnx.jit`` and compares: state and
gradients bit for bit where no rule matches (an overridden function is a
jitted function). A change that cannot be written back raises a
``[gradkit]`` error; nothing is dropped silently.
"""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gradkit as gk
from gradkit._src.core import nnx_state

# A rule that matches nothing in these models: the override must then equal nnx.jit bit for bit.
UNMATCHED = gk.RuleTable({"acos": gk.vjp_rule(lambda op, g: (g,))})
X = jax.random.normal(jax.random.key(1), (8, 3))


class Net(nnx.Module):
    def __init__(self, seed=0):
        rngs = nnx.Rngs(seed, dropout=seed + 1)
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.out = nnx.Linear(4, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.lin(x)))))[..., 0]


def loss(model, x):
    return jnp.mean(model(x) ** 2)


def _bits(tree):
    """Every leaf as a NumPy array (PRNG keys as their key data); modules as their state."""
    if isinstance(tree, tuple):
        return tuple(_bits(t) for t in tree)
    if isinstance(tree, nnx.Pytree):
        tree = nnx.state(tree)
    leaf = lambda x: np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
    return jax.tree.map(leaf, tree)


def assert_same(a, b):
    la, ta = jax.tree.flatten(_bits(a))
    lb, tb = jax.tree.flatten(_bits(b))
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


# --------------------------------------------------------------------------- state is kept, as nnx.jit keeps it


def test_batchnorm_and_dropout_under_value_and_grad_equal_nnx_jit():
    model, ref = Net(), Net()
    f = gk.override(loss, UNMATCHED)
    ref_step = nnx.jit(lambda m, x: nnx.value_and_grad(loss)(m, x))
    means = []
    for _ in range(3):
        l, g = nnx.value_and_grad(f)(model, X)
        l_ref, g_ref = ref_step(ref, X)
        np.testing.assert_array_equal(l, l_ref)
        assert_same(g, g_ref)
        assert_same(model, ref)  # BatchNorm statistics, the dropout stream's counter, the parameters
        means.append(np.asarray(model.bn.mean[...]))
    assert not np.array_equal(means[0], means[1])  # the running statistics move every step
    assert int(model.drop.rngs.count[...]) == 3
    assert f.cache_info().traces == 1  # one trace, reused by every step


def test_plain_call_updates_batchnorm_statistics():
    model, ref = Net(), Net()
    f = gk.override(loss, UNMATCHED)
    for _ in range(2):
        np.testing.assert_array_equal(f(model, X), nnx.jit(loss)(ref, X))
    assert_same(model, ref)
    assert np.any(model.bn.mean[...] != 0)


def test_dropout_mask_differs_every_step_and_equals_nnx_jits():
    model, ref = Net(), Net()
    mask = lambda m: m.drop(jnp.ones(64))
    f = gk.override(mask, gk.tables.SAFE)
    masks = [np.asarray(f(model)) for _ in range(3)]
    ref_masks = [np.asarray(nnx.jit(mask)(ref)) for _ in range(3)]
    assert not np.array_equal(masks[0], masks[1]) and not np.array_equal(masks[1], masks[2])
    for m, r in zip(masks, ref_masks):
        np.testing.assert_array_equal(m, r)
    assert int(model.drop.rngs.count[...]) == 3


def test_rngs_as_keyword_argument_advance():
    noisy = lambda x, *, rngs: x + jax.random.normal(rngs.noise(), x.shape)
    f = gk.override(noisy, gk.tables.SAFE)
    rngs, ref = nnx.Rngs(noise=3), nnx.Rngs(noise=3)
    a, b = f(X, rngs=rngs), f(X, rngs=rngs)
    assert not np.array_equal(a, b)
    np.testing.assert_array_equal(a, nnx.jit(noisy)(X, rngs=ref))
    np.testing.assert_array_equal(b, nnx.jit(noisy)(X, rngs=ref))
    assert int(rngs.noise.count[...]) == 2


def test_variable_argument_is_updated():
    def accumulate(v, x):
        v[...] = v[...] + jnp.sum(x)
        return jnp.sum(x)
    v = nnx.BatchStat(jnp.float32(0.0))
    f = gk.override(accumulate, gk.tables.SAFE)
    f(v, X)
    f(v, X)
    np.testing.assert_allclose(v[...], 2 * jnp.sum(X), rtol=1e-6)


# --------------------------------------------------------------------------- the rules still apply


class SqrtModel(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.array([0.0, 4.0]))
        self.bn = nnx.BatchNorm(2, rngs=nnx.Rngs(0))

    def __call__(self, x):
        w = self.w[...]
        return jnp.sum(self.bn(x) ** 2 * jnp.where(w > 0, jnp.sqrt(w), 0.0)[None, :])


def test_safe_table_fixes_sqrt_at_zero_in_an_nnx_model_and_keeps_state():
    x = jax.random.normal(jax.random.key(2), (4, 2)) + 1.0
    call = lambda m, x: m(x)
    ref = SqrtModel()
    plain = nnx.jit(nnx.grad(call))(ref, x)
    assert np.isnan(plain.w[...][0]) and np.isfinite(plain.w[...][1])  # the NaN the table fixes
    model = SqrtModel()
    f = gk.override(call, gk.tables.SAFE)
    g = nnx.grad(f)(model, x)
    assert g.w[...][0] == 0.0
    np.testing.assert_allclose(g.w[...][1], plain.w[...][1], rtol=1e-6)
    assert np.any(model.bn.mean[...] != 0)  # the state is kept through the rewritten program
    assert_same(model.bn, ref.bn)
    info = f.cache_info()  # the function the user holds counts the NNX path's traces and rule replacements
    assert info.traces == 1 and info.replacements >= 1


def test_strict_is_honoured():
    f = gk.override(loss, {"sqrtt": gk.vjp_rule(lambda op, g: (g,))}, strict=True)
    with pytest.raises(gk.GradkitError, match="sqrtt"):
        f(Net(), X)


# --------------------------------------------------------------------------- inside nnx.jit, and whole train steps


def _optimizer(model):
    return nnx.Optimizer(model, optax.sgd(1e-2, momentum=0.9), wrt=nnx.Param)


def train_step(model, opt, x, loss_fn):
    l, g = nnx.value_and_grad(loss_fn)(model, x)
    opt.update(model, g)
    return l


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_inside_nnx_jit_train_step_equals_nnx_jit():
    model, ref = Net(), Net()
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    f = gk.override(loss, UNMATCHED)
    step = nnx.jit(lambda m, o, x: train_step(m, o, x, f))
    ref_step = nnx.jit(lambda m, o, x: train_step(m, o, x, loss))
    for _ in range(3):
        np.testing.assert_array_equal(step(model, opt, X), ref_step(ref, ref_opt, X))
    assert_same((model, opt), (ref, ref_opt))
    assert int(model.drop.rngs.count[...]) == 3 and int(opt.step[...]) == 3


def test_overridden_train_step_updates_model_and_optimizer():
    model, ref = Net(), Net()
    opt, ref_opt = _optimizer(model), _optimizer(ref)
    step = gk.override(lambda m, o, x: train_step(m, o, x, loss), UNMATCHED)
    ref_step = nnx.jit(lambda m, o, x: train_step(m, o, x, loss))
    for _ in range(3):
        np.testing.assert_array_equal(step(model, opt, X), ref_step(ref, ref_opt, X))
    assert_same((model, opt), (ref, ref_opt))


# --------------------------------------------------------------------------- graph semantics: identity, sharing, structure


def test_returned_nodes_are_the_callers_objects():
    f = gk.override(lambda m, x: (m(x).sum(), m, m.bn), gk.tables.SAFE)
    model = Net()
    _, m, bn = f(model, X)
    assert m is model and bn is model.bn


def test_one_module_passed_twice_equals_nnx_jit():
    both = lambda a, b, x: a(x).sum() + b(x).sum()
    model, ref = Net(), Net()
    np.testing.assert_array_equal(gk.override(both, UNMATCHED)(model, model, X), nnx.jit(both)(ref, ref, X))
    assert_same(model, ref)
    assert int(model.drop.rngs.count[...]) == 2


def test_new_attribute_is_kept():
    def remember(m, x):
        m.seen = nnx.BatchStat(jnp.sum(x))
        return jnp.sum(x)
    model = Net()
    gk.override(remember, gk.tables.SAFE)(model, X)
    np.testing.assert_allclose(model.seen[...], jnp.sum(X), rtol=1e-6)


# --------------------------------------------------------------------------- what cannot be kept is refused


def test_read_only_module_closed_over_by_jax_transforms_works():
    model = Net()
    model.eval()  # running averages, no dropout: nothing changes, nothing is written back
    f = gk.override(loss, UNMATCHED)
    np.testing.assert_array_equal(jax.jit(lambda x: f(model, x))(X), jax.jit(lambda x: loss(model, x))(X))
    assert jax.grad(lambda x: f(model, x))(X).shape == X.shape


@pytest.mark.parametrize("transform", [jax.jit, jax.grad], ids=["jit", "grad"])
def test_change_that_cannot_be_written_back_raises(transform):
    model = Net()  # train mode: BatchNorm and Dropout change it
    before = nnx.clone(model)
    f = gk.override(loss, UNMATCHED)
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] override\(loss\).*nnx\.jit"):
        transform(lambda x: f(model, x))(X)
    assert_same(model, before)  # nothing half-written


# --------------------------------------------------------------------------- jax.jit's stages, as nnx.jit's


def test_lower_and_compile_take_modules_as_nnx_jit_does():
    model, ref = Net(), Net()  # train mode: BatchNorm and Dropout change the state
    f = gk.override(loss, UNMATCHED)
    compiled = f.lower(model, X).compile()
    ref_compiled = nnx.jit(loss).lower(ref, X).compile()
    assert compiled.cost_analysis() is not None and "stablehlo" in f.lower(model, X).as_text()
    for _ in range(2):  # the compiled function writes the state back, as nnx.jit's does
        assert_same(compiled(model, X), ref_compiled(ref, X))
        assert_same(model, ref)


def test_trace_is_the_rewritten_program_and_eval_shape_changes_nothing():
    model = Net()
    before = nnx.clone(model)
    f = gk.override(loss, gk.tables.SAFE)
    assert f.eval_shape(model, X) == jax.ShapeDtypeStruct((), jnp.float32)
    traced = f.trace(model, X)
    jaxpr = str(getattr(traced, "traced", traced).jaxpr)  # flax's Traced wraps JAX's
    plain = str(nnx.jit(loss).trace(nnx.clone(before), X).traced.jaxpr)
    assert "gradkit_rule[rsqrt]" in jaxpr and "gradkit_rule" not in plain  # BatchNorm's rsqrt carries SAFE's rule
    assert_same(model, before)  # eval_shape and trace left the module as it was


# --------------------------------------------------------------------------- the non-NNX path


def test_non_nnx_arguments_take_the_plain_path(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("NNX path taken")
    monkeypatch.setattr(nnx_state.Route, "__init__", refuse)
    f = gk.override(lambda p, x: jnp.sum(jnp.sqrt(p["w"] * x)), gk.tables.SAFE)
    p = {"w": jnp.ones(3), "b": [jnp.zeros(2), (1.0, None)]}
    assert not nnx_state.has_graph_nodes((p, jnp.ones(3)), {"scale": 2.0})
    np.testing.assert_array_equal(jax.grad(f)(p, jnp.ones(3))["w"], jnp.full(3, 0.5))
    assert nnx_state.has_graph_nodes(({"model": Net()},), {})
    assert nnx_state.has_graph_nodes((), {"rngs": nnx.Rngs(0)})


def test_gradkit_never_imports_flax():
    code = ("import sys, jax.numpy as jnp, gradkit as gk\n"
            "f = gk.override(lambda x: jnp.sqrt(x), gk.tables.SAFE)\n"
            "f(jnp.ones(3)); f(x=jnp.ones(3))\n"
            "assert not any(m == 'flax' or m.startswith('flax.') for m in sys.modules), 'flax imported'\n")
    subprocess.run([sys.executable, "-c", code], check=True)
