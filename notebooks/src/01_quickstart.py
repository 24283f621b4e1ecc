# %% [markdown]
# # 01 · Quickstart: the log1pexp story
#
# `log(1 + exp(x))` (softplus) is everywhere: logistic losses, smooth ReLUs,
# positive parameterisations. Written naively, its gradient is NaN for
# `x > 88.7` in float32: `exp` overflows to `inf`, and the chain rule then
# multiplies `0 · inf`. This notebook shows three ways gradkit fixes it:
# a TensorFlow-style `custom_gradient`, the stable library function, and a rule
# table applied to unchanged code with `gk.override`.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt

import gradkit as gk

def naive(x):
    return jnp.log1p(jnp.exp(x))

print("naive gradient at 100:", jax.grad(naive)(100.0))

# %% [markdown]
# ## 1. `gk.custom_gradient`: write the gradient as a closure
#
# The gradient function may use anything the forward pass computed (here `e`);
# gradkit turns it into a residual. The seed formula `1 - 1/(1 + e)` is the
# sigmoid, written as TensorFlow's documentation writes it.

# %%
@gk.custom_gradient
def log1pexp_tf(x):
    e = jnp.exp(x)
    def grad(upstream):
        return upstream * (1 - 1 / (1 + e))
    return jnp.log1p(e), grad

print("custom_gradient at 100:", jax.grad(log1pexp_tf)(100.0))

# %% [markdown]
# ## 2. `gk.stable.log1pexp`: the stable function
#
# It never evaluates `exp` of a large number, and its derivative is
# `sigmoid(x)` computed stably, so it is also accurate for `x ≪ 0`, where
# `1 - 1/(1 + e)` cancels to 0.

# %%
print("stable at 100:", jax.grad(gk.stable.log1pexp)(100.0), " value:", gk.stable.log1pexp(100.0))
print("at -30: seed formula", jax.grad(log1pexp_tf)(-30.0), " stable", jax.grad(gk.stable.log1pexp)(-30.0),
      " exact", float(jnp.exp(-30.0)))

# %% [markdown]
# ## 3. `gk.override`: fix code you do not want to edit
#
# When the naive softplus sits inside a guarded branch — forward finite, gradient
# NaN — a rule table fixes it without touching the code. Make the composite a
# named op (or use `gk.tables.SAFE` for the guard family).

# %%
@gk.op("log1pexp")
def softplus_op(x):
    return jnp.log1p(jnp.exp(x))

def model_loss(x):
    return jnp.sum(jnp.where(x > 30.0, x, softplus_op(x)))  # the guard keeps the forward finite

table = gk.RuleTable({"log1pexp": gk.vjp_rule(lambda op, g: (g * jax.nn.sigmoid(op.inputs[0]),))})
xs = jnp.array([-5.0, 0.0, 50.0, 100.0])
print("plain:   ", jax.grad(model_loss)(xs))
print("override:", jax.jit(jax.grad(gk.override(model_loss, table)))(xs))

# %% [markdown]
# ## The picture over [-120, 120]

# %%
x = jnp.linspace(-120.0, 120.0, 2001)
grad = lambda f: jax.vmap(jax.grad(f))(x)
fig, axes = plt.subplots(1, 2, figsize=(11, 3.5))
axes[0].plot(x, naive(x), label="naive log(1+exp(x))", lw=3, alpha=0.5)
axes[0].plot(x, gk.stable.log1pexp(x), "--", label="gk.stable.log1pexp")
axes[0].set_title("value (naive overflows to inf past 88.7)")
axes[0].legend()
g_naive = grad(naive)
axes[1].plot(x, jnp.where(jnp.isfinite(g_naive), g_naive, jnp.nan), label="naive (0, then NaN, past ~88)", lw=3, alpha=0.5)
axes[1].plot(x, grad(gk.stable.log1pexp), "--", label="gk.stable.log1pexp")
axes[1].plot(x, grad(log1pexp_tf), ":", label="custom_gradient")
axes[1].set_title("gradient")
axes[1].legend()
plt.tight_layout()
plt.show()
print("non-finite gradients: naive", int((~jnp.isfinite(g_naive)).sum()),
      "| stable", int((~jnp.isfinite(grad(gk.stable.log1pexp))).sum()),
      "| custom_gradient", int((~jnp.isfinite(grad(log1pexp_tf))).sum()))
