"""Scoped rules: RuleTable.within(scope), name-stack matching, precedence, strict mode, every transform."""

import random
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import gradkit as gk

jax.config.update("jax_enable_x64", False)


def _scaled(k):
    """A VJP rule for `sin` whose cotangent is JAX's times k: a marker of where it applied."""
    return gk.vjp_rule(lambda op, g: (g * jnp.cos(op.inputs[0]) * k,), name=f"sin_x{k}")


X2, X3, X5 = _scaled(2.0), _scaled(3.0), _scaled(5.0)


def _sin_scaled(k):
    """The reference: sin whose derivative is k cos, as a custom_vjp function (no gradkit involved)."""
    @jax.custom_vjp
    def f(x):
        return jnp.sin(x)

    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x) * k,))
    return f


def _rule_ops(fn, *args):
    """(op, scope path) of each rule-carrying equation in fn's rewritten program, at any depth."""
    from gradkit._src import compat
    from gradkit._src.core import walk

    body = fn.rewritten_jaxpr(*args)
    return sorted((compat.rule_target(e), "/".join(s)) for e, s in walk.scoped_equations(body)
                  if compat.rule_target(e) is not None)


def two_scopes(x):
    with jax.named_scope("enc"):
        a = jnp.sin(x)
    with jax.named_scope("dec"):
        b = jnp.sin(2.0 * x)
    return a + b


# --------------------------------------------------------------------------- the table


def test_within_keys_merge_and_toml(tmp_path):
    t = gk.RuleTable({"sin": X2}).within("enc")
    assert list(t) == ["enc::sin"] and t["enc::sin"] is X2 and t.scoped_ops == {"sin"}
    assert t.within("Model") == {"Model/**/enc::sin": X2}  # nested: enc anywhere inside Model
    assert gk.RuleTable({"sin": X2}).within("/dec").within("Model") == {"Model/dec::sin": X2}
    assert (t | gk.RuleTable({"enc::sin": X3}))["enc::sin"] is X3  # same key: the right side wins
    assert gk.tables.SAFE.within("dec").fingerprint != gk.tables.SAFE.fingerprint
    p = tmp_path / "rules.toml"
    p.write_text('sqrt = "safe"\n"Model/enc::log" = {rule = "clamped_log", eps = 1e-30}\n')
    toml = gk.RuleTable.from_toml(p)
    assert sorted(toml) == ["Model/enc::log", "sqrt"] and toml.scoped_ops == {"log"}
    assert gk.RuleTable({"sin": X2}).scoped_ops == frozenset()


@pytest.mark.parametrize("bad", ["", "a//b", "/", "a/ b", "a::b", 3])
def test_malformed_scopes_are_gradkit_errors(bad):
    with pytest.raises(gk.GradkitError, match=r"^\[gradkit\].*scope"):
        gk.RuleTable({"sin": X2}).within(bad)


def test_malformed_scoped_keys():
    with pytest.raises(gk.GradkitError, match="op name after '::'"):
        gk.RuleTable({"enc::": X2})
    with pytest.raises(gk.GradkitError, match="malformed scope"):
        gk.RuleTable({"::sin": X2})
    with pytest.raises(gk.GradkitError, match="'enc::sqrt': unknown rule 'saf'"):
        gk.RuleTable({"enc::sqrt": "saf"})


# --------------------------------------------------------------------------- matching


def test_named_scope_applies_only_inside():
    x = jnp.float32(0.3)
    ref = lambda x: _sin_scaled(2.0)(x) + jnp.sin(2.0 * x)
    g = jax.grad(gk.override(two_scopes, gk.RuleTable({"sin": X2}).within("enc")))(x)
    np.testing.assert_allclose(g, jax.grad(ref)(x), rtol=1e-6)
    assert _rule_ops(gk.override(two_scopes, gk.RuleTable({"sin": X2}).within("dec")), x) == [("sin", "dec")]


def test_safe_within_a_scope():
    def f(x):
        with jax.named_scope("enc"):
            a = jnp.sqrt(x)
        with jax.named_scope("dec"):
            b = jnp.sqrt(x)
        return jnp.where(x > 0, a, 0.0) + jnp.where(x > 0, b, 0.0)

    assert np.isnan(jax.grad(gk.override(f, gk.tables.SAFE.within("enc")))(0.0))  # dec's sqrt still NaN
    t = gk.tables.SAFE.within("enc") | gk.tables.SAFE.within("dec")
    assert float(jax.grad(gk.override(f, t))(0.0)) == 0.0


def nested(x):
    with jax.named_scope("Model"):
        with jax.named_scope("enc"):
            a = jnp.sin(x)
            with jax.named_scope("Dense_0"):
                b = jnp.sin(x * 2.0)
        with jax.named_scope("encoder"):
            c = jnp.sin(x * 3.0)
        with jax.named_scope("Conv_1"):
            d = jnp.sin(x * 4.0)
    with jax.named_scope("Conv_2"):
        e = jnp.sin(x * 5.0)
    return a + b + c + d + e


@pytest.mark.parametrize("scope, where", [
    ("enc", ["Model/enc", "Model/enc/Dense_0"]),  # a whole component, everything below it
    ("Model/enc", ["Model/enc", "Model/enc/Dense_0"]),
    ("enc/Dense_0", ["Model/enc/Dense_0"]),
    ("/enc", []),  # anchored at the top: Model/enc is not
    ("/Model/enc", ["Model/enc", "Model/enc/Dense_0"]),
    ("enc*", ["Model/enc", "Model/enc/Dense_0", "Model/encoder"]),
    ("*/Conv_*", ["Model/Conv_1"]),  # a Conv one level or more below the top
    ("Conv_?", ["Conv_2", "Model/Conv_1"]),
    ("Model/**/Dense_0", ["Model/enc/Dense_0"]),
    ("Model/**/enc", ["Model/enc", "Model/enc/Dense_0"]),  # ** is zero components too
    ("Model", ["Model/Conv_1", "Model/enc", "Model/enc/Dense_0", "Model/encoder"]),
    ("Dense", []),
    ("nowhere", []),
])
def test_scope_patterns(scope, where):
    f = gk.override(nested, gk.RuleTable({"sin": X2}).within(scope))
    assert _rule_ops(f, jnp.float32(0.5)) == [("sin", w) for w in sorted(where)]


# --------------------------------------------------------------------------- precedence


def test_scoped_beats_unscoped_either_order():
    x = jnp.float32(0.3)
    want = jax.grad(lambda x: _sin_scaled(3.0)(x) + _sin_scaled(2.0)(2.0 * x))(x)
    plain, scoped = gk.RuleTable({"sin": X2}), gk.RuleTable({"sin": X3}).within("enc")
    for t in (plain | scoped, scoped | plain):
        np.testing.assert_allclose(jax.grad(gk.override(two_scopes, t))(x), want, rtol=1e-6)


def test_more_specific_scope_wins_either_order():
    x = jnp.float32(0.5)
    outer, inner = gk.RuleTable({"sin": X2}).within("enc"), gk.RuleTable({"sin": X3}).within("enc/Dense_0")
    k = {"Model/enc": 2.0, "Model/enc/Dense_0": 3.0}
    s = _sin_scaled

    def ref(x):
        return s(k["Model/enc"])(x) + s(k["Model/enc/Dense_0"])(x * 2.0) + sum(
            jnp.sin(x * c) for c in (3.0, 4.0, 5.0))

    for t in (outer | inner, inner | outer):
        np.testing.assert_allclose(jax.grad(gk.override(nested, t))(x), jax.grad(ref)(x), rtol=1e-6)
    # literal beats wildcard at equal length; anchored beats floating at equal rank
    lit, wild = gk.RuleTable({"sin": X3}).within("Model/enc"), gk.RuleTable({"sin": X2}).within("Model/en*")
    anch, flo = gk.RuleTable({"sin": X5}).within("/Model"), gk.RuleTable({"sin": X2}).within("Model")
    for t in (lit | wild, wild | lit):
        assert gk.override(nested, t).table.rule_for("sin", ("Model", "enc"))[1] is X3
    for t in (anch | flo, flo | anch):
        assert gk.override(nested, t).table.rule_for("sin", ("Model", "encoder"))[1] is X5


def test_equal_rank_different_rules_is_an_error_same_rule_is_not():
    t = gk.RuleTable({"sin": X2}).within("enc") | gk.RuleTable({"sin": X3}).within("Dense_0")
    with pytest.raises(gk.GradkitError, match=r"'enc::sin' .*'Dense_0::sin'|'Dense_0::sin' .*'enc::sin'"):
        jax.grad(gk.override(nested, t))(jnp.float32(0.5))
    same = gk.tables.SAFE.within("enc") | gk.tables.SAFE.within("Dense_0")
    jax.grad(gk.override(nested, same))(jnp.float32(0.5))


# --------------------------------------------------------------------------- transforms and sub-programs


def _in_transforms(x):
    with jax.named_scope("enc"):
        def body(c, _):
            with jax.named_scope("step"):
                return c + jnp.sin(c) * 0.5, None
        y, _ = lax.scan(body, x, None, length=3)
        y = lax.fori_loop(0, 2, lambda i, c: c + jnp.sin(c) * 0.25, y)
        y = lax.cond(y > -10.0, lambda v: jnp.sin(v), lambda v: v, y)
        y = jax.checkpoint(lambda v: jnp.sin(v) + v)(y)
        y = jax.jit(lambda v: jnp.sin(v) * 2.0)(y)
        y = jax.vmap(lambda v: jnp.sin(v))(jnp.stack([y, 2.0 * y])).sum()
    with jax.named_scope("dec"):
        z = lax.scan(lambda c, _: (jnp.sin(c), None), y, None, length=2)[0]
    return z + jnp.sin(x)


def _in_transforms_ref(x, s):
    def body(c, _):
        return c + s(c) * 0.5, None
    y, _ = lax.scan(body, x, None, length=3)
    y = lax.fori_loop(0, 2, lambda i, c: c + s(c) * 0.25, y)
    y = lax.cond(y > -10.0, lambda v: s(v), lambda v: v, y)
    y = jax.checkpoint(lambda v: s(v) + v)(y)
    y = jax.jit(lambda v: s(v) * 2.0)(y)
    y = jax.vmap(lambda v: s(v))(jnp.stack([y, 2.0 * y])).sum()
    z = lax.scan(lambda c, _: (jnp.sin(c), None), y, None, length=2)[0]
    return z + jnp.sin(x)


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_scope_around_control_flow_and_inside_bodies():
    x = jnp.float32(0.4)
    f = gk.override(_in_transforms, gk.RuleTable({"sin": X2}).within("enc"))
    want = jax.grad(lambda x: _in_transforms_ref(x, _sin_scaled(2.0)))(x)
    np.testing.assert_allclose(jax.grad(f)(x), want, rtol=2e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(f))(x), want, rtol=2e-6)
    xs = jnp.array([0.1, 0.4, -0.3], jnp.float32)
    np.testing.assert_allclose(jax.vmap(jax.grad(f))(xs),
                               jax.vmap(jax.grad(lambda x: _in_transforms_ref(x, _sin_scaled(2.0))))(xs), rtol=2e-6)
    np.testing.assert_allclose(jax.grad(jax.checkpoint(f))(x), want, rtol=2e-6)
    # a scope inside a scan body: only the scan's sin
    step = gk.override(_in_transforms, gk.RuleTable({"sin": X2}).within("enc/step"))
    assert _rule_ops(step, x) == [("sin", "enc/step")]
    # the forward pass is jax.jit's, bit for bit
    assert np.array_equal(f(x), jax.jit(_in_transforms)(x))


def test_scope_inside_a_while_loop_forward_mode():
    cos2 = gk.jvp_rule(lambda op, t: t[0] * jnp.cos(op.inputs[0]) * 2.0, name="sin_jvp_x2")

    def f(x, sin):
        with jax.named_scope("loop"):
            y = lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] + sin(c[0]), c[1] + 1), (x, 0))[0]
        return y + sin(x)

    x = jnp.float32(0.3)
    got = jax.jvp(gk.override(lambda x: f(x, jnp.sin), gk.RuleTable({"sin": cos2}).within("loop")), (x,), (1.0,))

    @jax.custom_jvp
    def sin2(v):
        return jnp.sin(v)

    sin2.defjvp(lambda p, t: (jnp.sin(p[0]), t[0] * jnp.cos(p[0]) * 2.0))
    want = jax.jvp(lambda x: lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] + sin2(c[0]), c[1] + 1), (x, 0))[0]
                   + jnp.sin(x), (x,), (1.0,))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_one_function_called_in_two_scopes_is_rewritten_per_scope():
    shared = jax.jit(lambda v: jnp.sin(v))

    def f(x):
        with jax.named_scope("enc"):
            a = shared(x)
        with jax.named_scope("dec"):
            b = shared(2.0 * x)
        return a + b

    x = jnp.float32(0.3)
    g = jax.grad(gk.override(f, gk.RuleTable({"sin": X2}).within("dec")))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: jnp.sin(x) + _sin_scaled(2.0)(2.0 * x))(x), rtol=1e-6)
    g = jax.grad(gk.override(f, gk.RuleTable({"sin": X2}).within("enc")))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: _sin_scaled(2.0)(x) + jnp.sin(2.0 * x))(x), rtol=1e-6)


def test_scope_around_the_overridden_call_is_not_part_of_it():
    f = gk.override(lambda x: jnp.sin(x), gk.RuleTable({"sin": X2}).within("enc"))

    def g(x):
        with jax.named_scope("enc"):
            return f(x)

    x = jnp.float32(0.3)
    assert float(jax.grad(g)(x)) == float(jax.grad(jax.jit(jnp.sin))(x))


def test_named_ops_and_nested_overrides_in_scopes():
    softplus = gk.op("softplus")(lambda v: jnp.log1p(jnp.exp(v)))
    half = gk.vjp_rule(lambda op, g: (0.5 * g * jax.nn.sigmoid(op.inputs[0]),), name="half")

    def f(x):
        with jax.named_scope("enc"):
            a = softplus(x)
        return a + softplus(2.0 * x)

    x = jnp.float32(0.3)
    g = jax.grad(gk.override(f, gk.RuleTable({"softplus": half}).within("enc"), strict=True))(x)
    np.testing.assert_allclose(g, 0.5 * jax.nn.sigmoid(x) + 2.0 * jax.nn.sigmoid(2.0 * x), rtol=1e-6)
    # an inner overridden function is one jit equation of the outer program: its scopes join the caller's
    inner = gk.override(lambda v: jnp.sin(v), {})

    def outer(x):
        with jax.named_scope("enc"):
            a = inner(x)
        return a + inner(2.0 * x)

    g = jax.grad(gk.override(outer, gk.RuleTable({"sin": X2}).within("enc")))(x)
    np.testing.assert_allclose(g, jax.grad(lambda x: _sin_scaled(2.0)(x) + jnp.sin(2.0 * x))(x), rtol=1e-6)


def test_forward_mode_error_names_the_scoped_entry():
    f = gk.override(two_scopes, gk.RuleTable({"sin": X2}).within("enc"))
    with pytest.raises(gk.GradkitError, match=r"VJP rule \('enc::sin' at .*test_scoped_rules.py"):
        jax.jvp(f, (jnp.float32(0.3),), (jnp.float32(1.0),))


# --------------------------------------------------------------------------- no match is jax.jit


def test_no_match_is_jax_jit_bit_for_bit():
    x = jnp.float32(0.7)

    def loss(x):
        return _in_transforms(x) ** 2

    transforms = (lambda h: h, jax.grad, lambda h: jax.jacfwd(jax.grad(h)))
    # jax.jit's answers, computed once for the three tables (one trace and compilation of each)
    plain = jax.jit(loss)
    want = [np.asarray(transform(plain)(x)) for transform in transforms]
    tb = jax.jvp(plain, (x,), (jnp.ones_like(x),))
    for t in (gk.tables.SAFE.within("nowhere"), gk.RuleTable({"sin": X2}).within("enc/nope"),
              gk.RuleTable({"cos": X2}).within("enc")):
        f = gk.override(loss, t)
        assert _rule_ops(f, x) == []
        for transform, b in zip(transforms, want):
            assert np.array_equal(np.asarray(transform(f)(x)), b)
        ta = jax.jvp(f, (x,), (jnp.ones_like(x),))
        assert all(np.array_equal(a, b) for a, b in zip(ta, tb))


# --------------------------------------------------------------------------- strict mode


def test_strict_names_the_scope_and_near_misses():
    f = gk.override(nested, gk.RuleTable({"sin": X2}).within("Modle/enc"), strict=True)
    with pytest.raises(gk.GradkitError) as e:
        f(jnp.float32(0.5))
    msg = str(e.value)
    assert msg.startswith("[gradkit] override(nested, strict=True)") and "scope 'Modle/enc'" in msg
    assert "did you mean 'Model/enc'" in msg and "Scopes in the program: " in msg and "Model/encoder" in msg
    assert "drop strict=True" in msg


def test_strict_names_an_op_absent_from_its_scope():
    f = gk.override(two_scopes, gk.RuleTable({"sin": X2, "cos": X2}).within("enc"), strict=True)
    with pytest.raises(gk.GradkitError, match=r"'enc::cos': no 'cos' inside scope 'enc' \(not in the program"):
        f(jnp.float32(0.5))
    f = gk.override(two_scopes, gk.RuleTable({"mul": X2}).within("enc"), strict=True)
    with pytest.raises(gk.GradkitError, match=r"no 'mul' inside scope 'enc' \(it occurs in dec\)"):
        f(jnp.float32(0.5))


def test_strict_passes_when_every_scope_matches():
    t = gk.RuleTable({"sin": X2}).within("enc") | gk.RuleTable({"sin": X3}).within("*/Conv_*") | {"sin": X5}
    jax.grad(gk.override(nested, t, strict=True))(jnp.float32(0.5))
    jax.grad(gk.override(_in_transforms, gk.RuleTable({"sin": X2}).within("enc/step"), strict=True))(
        jnp.float32(0.5))


def enc_dec(x):
    with jax.named_scope("enc"):
        a = jnp.sin(x)
    with jax.named_scope("decoder"):
        b = jnp.sqrt(jnp.abs(a) + 1.0)
    return jnp.sum(b)


def _strict_error(f, table):
    with pytest.raises(gk.GradkitError) as e:
        gk.override(f, table, strict=True)(jnp.ones(3))
    return str(e.value)


def test_strict_shipped_table_within_the_right_scope_passes():
    # SAFE has dozens of rules and the decoder uses one (sqrt): a shipped table is one unit.
    x = jnp.ones(3)
    for table in (gk.tables.SAFE.within("decoder"), (gk.tables.SAFE | gk.tables.STABLE).within("decoder"),
                  gk.tables.SAFE.within("decoder") | gk.tables.STABLE.within("decoder"), gk.tables.SAFE):
        g = jax.grad(gk.override(enc_dec, table, strict=True))(x)
        np.testing.assert_array_equal(g, jax.grad(jax.jit(enc_dec))(x))


def test_strict_shipped_table_within_a_wrong_scope_names_the_scope():
    msg = _strict_error(enc_dec, gk.tables.SAFE.within("decodr"))
    assert msg.startswith("[gradkit] override(enc_dec, strict=True): checked 1 shipped table unit as a whole "
                          "(gk.tables.SAFE within scope 'decodr': a unit passes when some rule of it matches)"), msg
    assert "scope 'decodr' (rules for gk.tables.SAFE) matches no equation; did you mean 'decoder'?" in msg
    assert "fix the scope" in msg and "of yours" not in msg


def test_strict_shipped_table_in_a_scope_without_its_ops_does_not_blame_the_scope():
    msg = _strict_error(enc_dec, gk.tables.SAFE.within("enc"))  # enc holds only sin: no SAFE op there
    n = len(gk.tables.SAFE)
    assert f"gk.tables.SAFE within scope 'enc': none of its {n} rules matches an op inside the scope " \
           "(ops inside it: sin)" in msg, msg
    assert "fix the scope" not in msg and "matches no equation" not in msg
    # one unit per scope: the decoder's match does not hide the encoder's miss
    msg = _strict_error(enc_dec, gk.tables.SAFE.within("enc") | gk.tables.SAFE.within("decoder"))
    assert "2 shipped table units" in msg and "within scope 'enc': none" in msg and "'decoder': none" not in msg


def test_strict_user_entries_are_checked_one_by_one_and_named():
    table = gk.RuleTable({"sin": X2, "cos": X2}).within("enc") | {"sqrtt": X2}
    msg = _strict_error(enc_dec, table)
    assert "checked 3 entries of yours, one by one. These matched nothing:" in msg
    assert "'sqrtt' (did you mean 'sqrt'?)" in msg and "'enc::cos': no 'cos' inside scope 'enc'" in msg
    assert "'enc::sin'" not in msg and "fix the scope" not in msg


def test_strict_mixed_table_checks_the_users_entries_and_the_unit():
    x = jnp.ones(3)
    jax.grad(gk.override(enc_dec, gk.tables.SAFE.within("decoder") | {"sin": X2}, strict=True))(x)
    msg = _strict_error(enc_dec, gk.tables.SAFE.within("decoder") | {"cosh": X2})
    assert msg.startswith("[gradkit] override(enc_dec, strict=True): checked 1 entry of yours, one by one; "
                          "1 shipped table unit as a whole (gk.tables.SAFE within scope 'decoder': "), msg
    assert "  'cosh'" in msg and "\n  gk.tables.SAFE" not in msg  # the unit matched: only the user's entry fails
    # a rule of the shipped table taken into the user's own dict is the user's entry: checked on its own
    msg = _strict_error(enc_dec, {"log": gk.tables.SAFE["log"], "sqrt": gk.tables.SAFE["sqrt"]})
    assert "'log'" in msg and "'sqrt'" not in msg.split("These matched nothing:")[1].split("Ops in")[0]


def test_origin_is_carried_through_or_and_within_and_is_not_content():
    t = gk.tables.SAFE.within("dec") | gk.tables.STABLE
    assert t.origin("dec::sqrt") == "gk.tables.SAFE" and t.origin("tanh") == "gk.tables.STABLE"
    assert gk.RuleTable(t).origin("tanh") == "gk.tables.STABLE"
    assert t.within("Model").origin("Model/**/dec::sqrt") == "gk.tables.SAFE"
    mine = t | {"tanh": X2}  # the user's rule replaces the shipped one: the entry is the user's now
    assert mine.origin("tanh") is None and mine.origin("dec::sqrt") == "gk.tables.SAFE"
    assert gk.RuleTable(dict(gk.tables.SAFE)) == gk.tables.SAFE  # equal by content whatever the origin
    assert gk.RuleTable(dict(gk.tables.SAFE)).origin("sqrt") is None
    assert gk.tables.upcast_backward("tanh").origin("tanh") is None  # ops the user named: the user's entries
    assert gk.tables.broadened(eps=1e-6).origin("eigh") == "gk.tables.broadened(eps=1e-06)"


# --------------------------------------------------------------------------- Flax linen, Equinox


@pytest.mark.slow  # 2.5-4 s on 2 cores, an example test: the slow set (CI runs it)
def test_flax_linen_submodule():
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        act: object = None

        @nn.compact
        def __call__(self, x):
            h = (self.act or nn.relu)(nn.Dense(4)(x))
            return jnp.sqrt(1.0 + jnp.where(h > 0, h * h, 0.0))  # a mask: SAFE rewrites mul and sqrt

    class Model(nn.Module):
        enc_act: object = None

        @nn.compact
        def __call__(self, x):
            x = Block(self.enc_act, name="enc")(x)
            x = nn.Conv(4, (1,))(x[:, :, None])[:, :, 0]
            return Block(name="dec")(x).sum()

    guided = gk.vjp_rule(lambda op, g: (jnp.where((op.inputs[0] > 0) & (g > 0), g, 0.0),), name="guided_relu")

    @jax.custom_vjp
    def guided_relu(x):
        return jax.nn.relu(x)

    guided_relu.defvjp(lambda x: (jax.nn.relu(x), x), lambda x, g: (jnp.where((x > 0) & (g > 0), g, 0.0),))

    x = jax.random.normal(jax.random.key(0), (3, 5))
    params = Model().init(jax.random.key(1), x)
    f = gk.override(lambda p, x: Model().apply(p, x), gk.RuleTable({"fn:relu": guided}).within("enc"), strict=True)
    got = jax.grad(f, argnums=(0, 1))(params, x)
    want = jax.grad(lambda p, x: Model(enc_act=guided_relu).apply(p, x), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert _rule_ops(f, params, x) == [("fn:relu", "Model/enc")]
    # SAFE scoped to the decoder, a module path with a wildcard
    safe = gk.override(lambda p, x: Model().apply(p, x), gk.tables.SAFE.within("Model/d*"))
    assert _rule_ops(safe, params, x) == [("mul", "Model/dec"), ("sqrt", "Model/dec")]
    assert np.array_equal(safe(params, x), jax.jit(lambda p, x: Model().apply(p, x))(params, x))


def test_equinox_module_names():
    eqx = pytest.importorskip("equinox")
    mlp = eqx.nn.MLP(3, 2, 4, 2, key=jax.random.key(0))
    x = jnp.linspace(-1.0, 1.0, 3, dtype=jnp.float32)

    def loss(m, x):
        return jnp.sum(m(x))

    f = gk.override(loss, gk.RuleTable({"add": gk.vjp_rule(lambda op, g: (2.0 * g, 2.0 * g))}).within(
        "eqx.nn.Linear"), strict=True)
    ops = _rule_ops(f, mlp, x)  # each Linear's attribute path sits between the type names (module_paths)
    assert ops == [("add", f"eqx.nn.MLP/.layers.{i}/eqx.nn.Linear") for i in range(3)]
    assert np.array_equal(f(mlp, x), eqx.filter_jit(loss)(mlp, x))
    both = gk.override(loss, gk.RuleTable({"add": gk.vjp_rule(lambda op, g: (g, g))}).within(
        "eqx.nn.MLP/eqx.nn.Linear"), strict=True)  # the type names alone still match across the paths
    assert len(_rule_ops(both, mlp, x)) == 3


# --------------------------------------------------------------------------- differential


_NAMES = ["enc", "dec", "Dense_0", "Dense_1", "attn"]


def _ref_match(pattern, stack):
    """An independent matcher: the pattern as a regular expression over "/a/b/c/"."""
    anchored = pattern.startswith("/")
    parts = pattern.lstrip("/").split("/")
    rx = "".join("(?:[^/]+/)*" if p == "**" else re.escape(p).replace(r"\*", "[^/]*") + "/" for p in parts)
    return re.search(("^/" if anchored else "/") + rx, "/" + "".join(c + "/" for c in stack)) is not None


def _ref_rank(pattern):
    parts = [p for p in pattern.lstrip("/").split("/") if p != "**"]
    return len(parts), sum("*" not in p for p in parts), pattern.startswith("/")


def _random_pattern(rnd, paths):
    deep = [p for p in paths if p]
    if deep and rnd.random() < 0.6:  # a run of a path the program has, some components wildcarded
        path = rnd.choice(deep)
        i = rnd.randrange(len(path))
        run = [c if rnd.random() < 0.7 else rnd.choice(["*", c[:2] + "*"])
               for c in path[i:rnd.randint(i + 1, len(path))]]
        return ("/" if i == 0 and rnd.random() < 0.3 else "") + "/".join(run)
    n = rnd.randint(1, 3)
    parts = []
    for _ in range(n):
        r = rnd.random()
        parts.append("*" if r < 0.15 else rnd.choice(_NAMES)[:3] + "*" if r < 0.3 else
                     "**" if r < 0.4 and parts else rnd.choice(_NAMES))
    return ("/" if rnd.random() < 0.2 else "") + "/".join(parts)


@pytest.mark.parametrize("seed", range(24))
def test_differential_random_scopes(seed):
    rnd = random.Random(seed)
    paths = [tuple(rnd.choice(_NAMES) for _ in range(rnd.randint(0, 3))) for _ in range(5)]
    patterns = [_random_pattern(rnd, paths) for _ in range(rnd.randint(1, 3))]
    factors = [2.0, 3.0, 5.0][:len(patterns)]
    unscoped = rnd.random() < 0.5
    table = gk.RuleTable({"sin": X5} if unscoped else {})
    for pat, k in zip(patterns, factors):
        table = table | gk.RuleTable({"sin": _scaled(k)}).within(pat)

    # the reference: per equation, which entry applies, decided here by the documented rule
    entries = dict(zip(patterns, factors))  # one scope twice: the right operand of | replaced the left
    choice, conflict = [], False
    for path in paths:
        hits = sorted(((_ref_rank(p), k) for p, k in entries.items() if _ref_match(p, path)), reverse=True)
        if hits:
            best = [k for r, k in hits if r == hits[0][0]]
            conflict |= len(set(best)) > 1
            choice.append(best[0])
        else:
            choice.append(5.0 if unscoped else None)

    def program(x, sins):
        out = 0.0
        for i, (path, s) in enumerate(zip(paths, sins)):
            def block(v, s=s, i=i):
                return s(v * (i + 1.0))
            for name in reversed(path):
                block = jax.named_scope(name)(block)
            out = out + block(x)
        return out

    x = jnp.float32(0.37)
    f = gk.override(lambda x: program(x, [jnp.sin] * len(paths)), table)
    if conflict:
        with pytest.raises(gk.GradkitError, match="equally specific"):
            jax.grad(f)(x)
        return
    sins = [jnp.sin if k is None else _sin_scaled(k) for k in choice]
    np.testing.assert_allclose(jax.grad(f)(x), jax.grad(lambda x: program(x, sins))(x), rtol=1e-5, atol=1e-6)


def test_audit_coverage_counts_scoped_entries_where_they_apply():
    def f(x):
        with jax.named_scope("enc"):
            a = jnp.sqrt(x)
        return jnp.sum(a + jnp.sqrt(x * 2.0) + jnp.log1p(x))

    t = gk.RuleTable({"sqrt": "safe"}).within("enc") | gk.RuleTable({"log": "safe", "dec::log1p": "safe"})
    cov = gk.audit(f, jnp.array([0.0, 1.0]), table=t).coverage
    assert dict(cov.fired) == {"enc::sqrt": 1}  # the unscoped sqrt outside enc is not the table's
    assert set(cov.never) == {"log", "dec::log1p"}
