"""Scoped rules inside Flax NNX and Equinox models, by the modules' attribute paths (core/module_paths.py).

Each case runs one model twice: through ``gk.override`` with a rule scoped
to a path, and as the same model (same parameters) whose modules inside that
path compute ``sin`` with the rule written by hand, a ``jax.custom_vjp``.
Values and gradients must agree.
"""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_scoped_rules import _sin_scaled  # the hand-written reference: sin with derivative k cos

import gradkit as gk
from gradkit._src import compat
from gradkit._src.core import module_paths, walk
from gradkit._src.core.scope import show

SIN2 = _sin_scaled(2.0)  # the hand-written rule
X2 = gk.vjp_rule(lambda op, g: (g * jnp.cos(op.inputs[0]) * 2.0,), name="sin_x2")  # the same rule, for gradkit
X3 = gk.vjp_rule(lambda op, g: (g * jnp.cos(op.inputs[0]) * 3.0,), name="sin_x3")


class Block(nnx.Module):
    def __init__(self, path, inside, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.act = SIN2 if inside(path) else jnp.sin

    def __call__(self, x):
        return self.act(self.lin(x))


class Encoder(nnx.Module):
    def __init__(self, path, inside, rngs):
        self.first = Block(f"{path}.first", inside, rngs)
        self.inner = Block(f"{path}.inner", inside, rngs)
        self.act = SIN2 if inside(path) else jnp.sin  # the encoder's own op, between its submodules

    def __call__(self, x):
        return self.inner(self.act(self.first(x)) * 0.9)


def _stack(n, path, inside, rngs):
    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(r):
        return Block(path, inside, r)

    return make(rngs)


class Model(nnx.Module):
    """Nested modules, one module under two paths, nnx.List and nnx.Dict, a vmapped ensemble, nnx.remat, and a
    stack of layers run by nnx.scan."""

    def __init__(self, inside=lambda path: False):
        rngs = nnx.Rngs(0)
        self.enc = Encoder("enc", inside, rngs)
        self.shared = Block("shared", inside, rngs)
        self.alias = self.shared
        self.layers = nnx.List([Block(f"layers.{i}", inside, rngs) for i in range(3)])
        self.heads = nnx.Dict({"cls": Block("heads.cls", inside, rngs), "reg": Block("heads.reg", inside, rngs)})
        self.ens = _stack(2, "ens", inside, rngs)
        self.ckpt = Block("ckpt", inside, rngs)
        self.stack = _stack(3, "stack", inside, rngs)

    def __call__(self, x):
        h = self.enc(x)
        h = self.shared(h) + self.alias(0.5 * h)
        for layer in self.layers:
            h = layer(h)
        h = self.heads["cls"](h) + self.heads["reg"](h)
        h = h + nnx.vmap(lambda m, v: m(v), in_axes=(0, None))(self.ens, h).mean(0)
        h = nnx.remat(lambda m, v: m(v))(self.ckpt, h)
        h, _ = nnx.scan(lambda c, m: (m(c), None), in_axes=(nnx.Carry, 0))(h, self.stack)
        return jnp.sum(h ** 2)


def loss(model, x):
    return model(x)


X = jnp.array([0.3, -0.7, 1.1], jnp.float32)


def _assert_close(a, b, structure=True):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb or not structure  # (Equinox: the static fields differ, the rule written by hand among them)
    assert len(la) == len(lb)
    for u, v in zip(la, lb):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=2e-5, atol=1e-6)


def _value_and_grads(f, model):
    value, (g_model, g_x) = nnx.value_and_grad(f, argnums=(0, 1))(model, X)
    return value, nnx.state(g_model), g_x


def _rule_scopes(f, *args):
    """The scope path of each rule-carrying equation of the program a call runs (NNX: via .trace)."""
    traced = f.trace(*args)
    body = getattr(traced, "traced", traced).jaxpr
    return sorted(show(s) for e, s in walk.scoped_equations(body) if compat.rule_target(e) is not None)


def check(scope, inside, table=None):
    """gk.override with the rule scoped to ``scope`` equals the model whose modules at ``inside`` (paths) use the
    hand-written rule, in value and in every gradient."""
    table = gk.RuleTable({"sin": X2}).within(scope) if table is None else table
    got = _value_and_grads(gk.override(loss, table), Model())
    want = _value_and_grads(loss, Model(lambda path: path in inside))
    _assert_close(got, want)
    return got


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_the_reference_is_not_the_plain_model():
    # the check below could fail: the hand-written rule changes the gradient where it applies
    plain, ruled = _value_and_grads(loss, Model()), _value_and_grads(loss, Model(lambda p: p == "enc.inner"))
    np.testing.assert_array_equal(plain[0], ruled[0])
    assert not np.allclose(plain[2], ruled[2])


# --------------------------------------------------------------------------- paths, nested, both spellings


@pytest.mark.parametrize("scope, inside", [
    ("enc", {"enc", "enc.first", "enc.inner"}),  # the encoder's own op and everything below it
    ("enc.inner", {"enc.inner"}),
    ("enc/inner", {"enc.inner"}),  # '/' and '.' separate components alike
    ("/enc.first", {"enc.first"}),  # anchored at the function's top: the model is the top
    ("enc.*", {"enc.first", "enc.inner"}),
])
def test_nested_paths(scope, inside):
    check(scope, inside)


@pytest.mark.parametrize("bad", ["a..b", "layers.", ".enc", "a/.b", "a|b"])
def test_malformed_dotted_scopes(bad):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\] RuleTable.within: malformed scope .* by '/' or '\.'"):
        gk.RuleTable({"sin": X2}).within(bad)


def test_both_spellings_are_one_scope():
    dotted, slashed = gk.RuleTable({"sin": X2}).within("enc.inner"), gk.RuleTable({"sin": X2}).within("enc/inner")
    assert list(dotted) == ["enc.inner::sin"]  # a key keeps the spelling it was written in
    check("enc.inner", {"enc.inner"}, dotted | slashed)  # the same rule twice: no conflict
    clash = gk.RuleTable({"sin": X3}).within("enc/inner") | dotted
    with pytest.raises(gk.GradkitError, match="equally specific"):
        gk.override(loss, clash)(Model(), X)


def test_a_model_inside_an_argument():
    # the dict key starts the path; a floating scope does not need it
    def loss_of(parts, x):
        return parts["net"](x)

    want = _value_and_grads(loss, Model(lambda path: path == "enc.inner"))
    for scope in ("net.enc.inner", "enc.inner"):
        f = gk.override(loss_of, gk.RuleTable({"sin": X2}).within(scope), strict=True)
        value, (g_parts, g_x) = nnx.value_and_grad(f, argnums=(0, 1))({"net": Model()}, X)
        _assert_close((value, nnx.state(g_parts["net"]), g_x), want)


def test_a_submodule_under_two_paths_is_inside_either():
    # self.alias is self.shared: one module, called twice; either path scopes both calls
    check("shared", {"shared"})
    check("alias", {"shared"})
    assert _rule_scopes(gk.override(loss, gk.RuleTable({"sin": X2}).within("alias")), Model(), X) == \
        ["alias|shared", "alias|shared"]


# --------------------------------------------------------------------------- containers, transforms


@pytest.mark.parametrize("scope, inside", [
    ("layers.1", {"layers.1"}),  # an nnx.List entry
    ("layers", {"layers.0", "layers.1", "layers.2"}),
    ("heads.reg", {"heads.reg"}),  # an nnx.Dict entry
])
def test_list_and_dict_entries(scope, inside):
    check(scope, inside)


def test_vmapped_module():
    check("ens", {"ens"})
    # one module for the whole ensemble: an index inside it matches nothing, which strict=True names
    with pytest.raises(gk.GradkitError, match=r"scope 'ens\.0' \(rules for sin\) matches no equation"):
        gk.override(loss, gk.RuleTable({"sin": X2}).within("ens.0"), strict=True)(Model(), X)


def test_remat_module():
    check("ckpt", {"ckpt"})


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_scanned_stack_has_a_path_and_an_index_inside_it_is_an_error():
    check("stack", {"stack"})
    scopes = _rule_scopes(gk.override(loss, gk.RuleTable({"sin": X2}).within("stack")), Model(), X)
    assert scopes == ["stack"]  # one body, one rule-carrying sin for all three layers
    for scope in ("stack.1", "stack.1.lin", "/stack.0"):
        f = gk.override(loss, gk.RuleTable({"sin": X2}).within(scope))  # not strict: refused all the same
        with pytest.raises(gk.GradkitError) as e:
            f(Model(), X)
        msg = str(e.value)
        assert msg.startswith(f"[gradkit] override(loss): the entry '{scope}::sin' scopes index ")
        assert "inside 'stack', which a loop body runs" in msg and "nnx.scan" in msg
        assert "Scope the whole stack ('stack'" in msg
    # a List's index is a path of its own: no error
    check("layers.2", {"layers.2"})


# --------------------------------------------------------------------------- strict, state, inertness


def test_strict_names_the_paths_it_found():
    f = gk.override(loss, gk.RuleTable({"sin": X2}).within("encoder.inner"), strict=True)
    with pytest.raises(gk.GradkitError) as e:
        f(Model(), X)
    msg = str(e.value)
    assert "scope 'encoder.inner' (rules for sin) matches no equation; did you mean 'enc.inner'" in msg, msg
    # shallow paths first: the model's structure, then what lies below
    assert "Module paths of its arguments: alias, ckpt, enc, ens, shared, stack, alias.lin, ckpt.lin, enc.first, " \
        "enc.inner, ens.lin, heads.cls, heads.reg, layers.0, layers.1, layers.2, shared.lin, stack.lin, " \
        "enc.first.lin, enc.inner.lin, heads.cls.lin, heads.reg.lin, layers.0.lin, layers.1.lin, layers.2.lin " \
        "(a module's ops are inside its path while it runs)" in msg, msg
    jax.block_until_ready(gk.override(loss, gk.RuleTable({"sin": X2}).within("enc.inner"), strict=True)(Model(), X))


def test_strict_says_to_pass_a_closed_over_model():
    model = Encoder("enc", lambda p: False, nnx.Rngs(0))
    f = gk.override(lambda x: jnp.sum(model(x)), gk.RuleTable({"sin": X2}).within("inner"), strict=True)
    with pytest.raises(gk.GradkitError, match=r"No module among its arguments: .* not closed over"):
        f(X)
    gk.override(lambda m, x: jnp.sum(m(x)), gk.RuleTable({"sin": X2}).within("inner"), strict=True)(model, X)


class Normed(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(1)
        self.enc = Block("enc", lambda p: False, rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return jnp.sum(self.drop(self.bn(self.enc(x[None]))) ** 2)


def test_state_changes_are_kept_and_no_path_is_left_behind():
    model, ref = Normed(), Normed()
    before = nnx.graphdef(model)
    f = gk.override(loss, gk.RuleTable({"sin": X2}).within("enc"))
    step = nnx.jit(loss)
    for _ in range(2):
        np.testing.assert_array_equal(f(model, X), step(ref, X))  # the forward pass is jax.jit's, bit for bit
    assert nnx.graphdef(model) == before  # no attribute added to the caller's modules
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(ref))):
        np.testing.assert_array_equal(jax.random.key_data(a) if jnp.issubdtype(a.dtype, jax.dtypes.prng_key)
                                      else a, jax.random.key_data(b) if jnp.issubdtype(b.dtype, jax.dtypes.prng_key)
                                      else b)
    assert not any(module_paths.TAG in vars(m) for _, m in nnx.iter_graph(model) if isinstance(m, nnx.Module))


def _path_entries(jaxpr):
    return {s for _, s in walk.scoped_equations(jaxpr) if any(e.startswith(".") for e in s)}


def test_outside_gradkit_the_hook_does_nothing():
    model = Model()
    gk.override(loss, gk.RuleTable({"sin": X2}).within("enc"))(model, X)  # the classes' methods are wrapped now
    assert module_paths._WRAPS in vars(Block.__call__)
    graphdef, state = nnx.split(model)
    plain = jax.make_jaxpr(lambda s, x: loss(nnx.merge(graphdef, s), x))(state, X)
    assert not _path_entries(plain.jaxpr)
    # an unscoped table: no paths either, and the program is jax.jit's
    g = gk.override(loss, gk.RuleTable({"sin": X2}))
    traced = g.trace(model, X)
    assert not _path_entries(getattr(traced, "traced", traced).jaxpr)


def test_another_thread_tracing_meanwhile_gets_no_paths():
    inside, done = threading.Event(), threading.Event()

    class Slow(nnx.Module):
        def __init__(self):
            self.enc = Block("enc", lambda p: False, nnx.Rngs(0))

        def __call__(self, x):
            y = self.enc(x)
            inside.set()
            assert done.wait(30)
            return jnp.sum(y)

    errors = []

    def scoped():
        try:
            gk.override(loss, gk.RuleTable({"sin": X2}).within("enc"))(Slow(), X)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=scoped)
    t.start()
    try:
        assert inside.wait(30)  # the other thread is inside gradkit's trace, in a module call
        model = Model()
        graphdef, state = nnx.split(model)
        plain = jax.make_jaxpr(lambda s, x: loss(nnx.merge(graphdef, s), x))(state, X)
        assert not _path_entries(plain.jaxpr)
    finally:
        done.set()
        t.join(60)
    assert not errors, errors


# --------------------------------------------------------------------------- Equinox


def test_equinox_attribute_paths():
    eqx = pytest.importorskip("equinox")

    class EqxBlock(eqx.Module):
        lin: eqx.nn.Linear
        act: object = eqx.field(static=True)

        def __call__(self, x):
            return self.act(self.lin(x))

    class Stack(eqx.Module):
        layers: tuple

        def __call__(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    class Net(eqx.Module):
        encoder: Stack
        decoder: Stack

        def __call__(self, x):
            return jnp.sum(self.decoder(self.encoder(x)) ** 2)

    def make(inside):
        keys = iter(jax.random.split(jax.random.key(0), 4))
        stack = lambda name: Stack(tuple(
            EqxBlock(eqx.nn.Linear(3, 3, key=next(keys)), SIN2 if f"{name}.layers.{i}" in inside else jnp.sin)
            for i in range(2)))
        return Net(stack("encoder"), stack("decoder"))

    def value_and_grads(f, net):
        return jax.value_and_grad(f, argnums=(0, 1))(net, X)

    for scope, inside in [("encoder.layers.0", {"encoder.layers.0"}), ("decoder", {"decoder.layers.0",
                                                                                      "decoder.layers.1"})]:
        f = gk.override(loss, gk.RuleTable({"sin": X2}).within(scope), strict=True)
        _assert_close(value_and_grads(f, make(set())), value_and_grads(loss, make(inside)), structure=False)
    # beside Equinox's own type names: a rule within eqx.nn.Linear reaches every Linear, at its path
    f = gk.override(loss, gk.RuleTable({"add": gk.vjp_rule(lambda op, g: (g, g))}).within("eqx.nn.Linear"))
    scopes = _rule_scopes(f, make(set()), X)
    assert scopes == sorted(f"{s}/layers.{i}/lin/eqx.nn.Linear" for s in ("decoder", "encoder") for i in range(2))
