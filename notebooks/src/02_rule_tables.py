# %% [markdown]
# # 02 · Rule tables
#
# A **rule** is one gradient override; a **table** maps op names to rules;
# `gk.override(f, table)` applies the table to every matching op inside `f`,
# at any depth (jit, scan, cond, while, checkpoint, shard_map, vmap).
#
# This notebook writes rules in both modes, makes a composite function a named
# op, merges tables, loads one from TOML, uses `strict=True`, and looks at the
# program after the rewrite.

# %%
import jax
import jax.numpy as jnp
from jax import lax

import gradkit as gk

# %% [markdown]
# ## A reverse-mode rule
#
# `gk.vjp_rule(fn)`: `fn(op, g)` gets a view of the matched op (`op.inputs`,
# `op.outputs`, `op.params`, `op.source`) and the output cotangent `g`, and
# returns one cotangent per input. Here: a `sqrt` whose gradient is exactly 0
# wherever the incoming cotangent is 0 — which is what `jnp.where` sends into
# the branch it did not select.

# %%
def loss(x):
    return jnp.sum(jnp.where(x > 0, jnp.sqrt(x), 0.0))

safe_sqrt = gk.vjp_rule(lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),))
x = jnp.array([0.0, 1.0, 4.0])
print("plain JAX:", jax.grad(loss)(x))
print("override: ", jax.grad(gk.override(loss, {"sqrt": safe_sqrt}))(x))

# %% [markdown]
# The rule applies inside control flow too — here inside a `scan` body and a
# `cond` branch, under `jax.jit`:

# %%
def rnn(x):
    def body(c, xi):
        return c + jnp.where(xi > 0, jnp.sqrt(xi), 0.0), None
    c, _ = lax.scan(body, 0.0, x)
    return lax.cond(c > 0, lambda c: c, lambda c: -c, c)

print("plain JAX:", jax.jit(jax.grad(rnn))(x))
print("override: ", jax.jit(jax.grad(gk.override(rnn, {"sqrt": safe_sqrt})))(x))

# %% [markdown]
# ## A forward-mode rule
#
# `gk.jvp_rule(fn)`: `fn(op, tangents)` returns the output tangent. It must be
# linear in the tangents; JAX transposes it for reverse mode, so one rule serves
# `jvp`, `jacfwd`, `hessian` and `grad`.

# %%
jvp_sqrt = gk.jvp_rule(lambda op, t: jnp.where(op.outputs[0] == 0, 0.0, t[0] * 0.5 / op.outputs[0]))
f = gk.override(jnp.sqrt, {"sqrt": jvp_sqrt})
print("jacfwd at 0:", jax.jacfwd(f)(0.0), " grad at 4:", jax.grad(f)(4.0), " hessian at 4:", jax.hessian(f)(4.0))

# %% [markdown]
# ## Named ops
#
# `@gk.op("name")` makes a composite function one equation that a table can
# target. Unmatched, it is just the function under `jax.jit`.

# %%
@gk.op("log1pexp")
def log1pexp(x):
    return jnp.log1p(jnp.exp(x))

print(jax.make_jaxpr(lambda x: log1pexp(x) * 2)(1.0).pretty_print(use_color=False))
sigmoid_grad = gk.vjp_rule(lambda op, g: (g * jax.nn.sigmoid(op.inputs[0]),))
print("plain JAX at 100:", jax.grad(log1pexp)(100.0))
print("override at 100: ", jax.grad(gk.override(log1pexp, {"log1pexp": sigmoid_grad}))(100.0))

# %% [markdown]
# ## Tables: merge, fingerprint, strict mode
#
# Tables are immutable and merge with `|` (right wins). Their fingerprint keys
# the dispatcher's cache. `strict=True` raises when a rule matched nothing —
# a typo guard that lists near misses.

# %%
mine = gk.RuleTable({"sqrt": safe_sqrt, "log1pexp": sigmoid_grad})
table = gk.tables.SAFE | mine
print(len(gk.tables.SAFE), "SAFE rules;", len(table), "after the merge; fingerprint", table.fingerprint)

try:
    gk.override(loss, {"sqrtt": safe_sqrt}, strict=True)(x)
except gk.GradkitError as e:
    print(e)

# %% [markdown]
# ## Tables from configuration
#
# A table can be declared in a dict or a TOML file that names library rules and
# their parameters. Nothing in a config is imported or evaluated.

# %%
import pathlib, tempfile

path = pathlib.Path(tempfile.mkdtemp()) / "rules.toml"
path.write_text('''
sqrt = "safe"
log = { rule = "clamped_log", eps = 1e-30 }
round = "straight_through"
''')
from_toml = gk.RuleTable.from_toml(path)
print(sorted(from_toml))
g = jax.grad(gk.override(lambda x: jnp.sum(jnp.log(x) + jnp.round(x * 3)), from_toml))(jnp.array([0.0, 2.0]))
print("log at 0 is clamped, round passes the gradient straight through:", g)

try:
    gk.RuleTable.from_dict({"log": {"rule": "os.system"}})
except gk.GradkitError as e:
    print(str(e)[:200], "...")

# %% [markdown]
# ## The gradient before and after a rule, over a range of inputs
#
# Left: the named op `log1pexp` — plain autodiff overflows to NaN past
# x ≈ 88.7 in float32, the rule keeps the derivative σ(x). Right: `round` from
# the TOML table — plain autodiff gives 0 everywhere (nothing to learn from),
# the straight-through rule passes the gradient through as 1.

# %%
import matplotlib.pyplot as plt
import numpy as np

def grad_over(f, grid):
    return np.asarray(jax.vmap(jax.grad(f))(grid))

def quantize(x):
    return jnp.round(x * 3) / 3

xs, us = jnp.linspace(-10.0, 120.0, 651), jnp.linspace(-1.0, 1.0, 201)
panels = [
    ("log1pexp(x), a named op", np.asarray(xs), grad_over(log1pexp, xs),
     grad_over(gk.override(log1pexp, {"log1pexp": sigmoid_grad}), xs), "override: sigmoid_grad rule"),
    ("round(3x) / 3", np.asarray(us), grad_over(quantize, us),
     grad_over(gk.override(quantize, from_toml), us), "override: the TOML table"),
]
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
for ax, (title, grid, plain, fixed, how) in zip(axes, panels):
    ax.plot(grid, fixed, lw=3, alpha=0.6, label=how)
    ax.plot(grid, np.where(np.isfinite(plain), plain, np.nan), "--", label="plain JAX")
    bad = ~np.isfinite(plain)
    if bad.any():
        ax.axvspan(grid[bad].min(), grid[-1], color="tab:red", alpha=0.1, label="plain gradient is NaN")
    ax.set_title(f"gradient of {title}")
    ax.set_xlabel("x")
    ax.set_ylim(-0.1, 1.2)
    ax.legend(loc="center left")
plt.tight_layout()
plt.show()
print("non-finite gradients on the grid: plain", int((~np.isfinite(panels[0][2])).sum()),
      "| with the rule", int((~np.isfinite(panels[0][3])).sum()))

# %% [markdown]
# ## What the rewrite produces
#
# Each matched op becomes a `custom_vjp_call` (or `custom_jvp_call`) whose
# primal is the original op, so the forward pass is unchanged; everything else
# is left as it was.

# %%
print(gk.override(loss, {"sqrt": safe_sqrt}).rewritten_jaxpr(x).pretty_print(use_color=False))
