# %% [markdown]
# # 04 · Checking gradients: `check_grads` and `compare`
#
# `gk.check_grads` tests a function's derivatives against float64 finite
# differences and reports numbers per input, order and mode. `gk.compare` puts
# a custom gradient next to a reference and explains the gap. Three classic
# discrepancies: a rule that is itself a finite difference, a rule with a wrong
# branch, and a rule computed in a different precision.

# %%
import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import gradkit as gk

# %%
print(gk.check_grads(lambda x: jnp.sum(gk.stable.log1pexp(x) * jnp.sin(x)), (jnp.linspace(-3.0, 3.0, 7),), order=2))

# %% [markdown]
# ## 1. A finite difference inside a rule

# %%
h = 1e-2
fd_sin = gk.override(jnp.sin, {"sin": gk.vjp_rule(lambda op, g: (g * (jnp.sin(op.inputs[0] + h) - op.outputs[0]) / h,))})
xs = jnp.linspace(-3.0, 3.0, 9)
c1 = gk.compare(lambda x: jnp.sum(fd_sin(x)), lambda x: jnp.sum(jnp.sin(x)), (xs,))
print(c1)

# %% [markdown]
# ## 2. A branch that is wrong on one side

# %%
bad_abs = gk.custom_gradient(lambda x: (jnp.abs(x), lambda g: g * jnp.where(x > 0, 1.0, 1.0)))
c2 = gk.compare(lambda x: jnp.sum(bad_abs(x)), lambda x: jnp.sum(jnp.abs(x)), (jnp.linspace(-2.0, 2.0, 8),))
print(c2)

# %% [markdown]
# ## 3. A float64 forward pass whose rule computes in float32
#
# The numbers are close — to float32's precision, which is far from float64's.

# %%
def f32_rule(op, g):
    x = op.inputs[0]
    return (g * jnp.cos(x.astype(jnp.float32)).astype(x.dtype),)

low = gk.override(jnp.sin, {"sin": gk.vjp_rule(f32_rule)})
with jax.enable_x64(True):
    c3 = gk.compare(lambda x: jnp.sum(low(x)), lambda x: jnp.sum(jnp.sin(x)),
                    (jnp.linspace(-3.0, 3.0, 9, dtype=jnp.float64),))
print(c3)

# %% [markdown]
# ## Error against the input

# %%
grid = jnp.linspace(-3.0, 3.0, 301)
exact = np.cos(np.asarray(grid, np.float64))
errs = {
    "finite-difference rule (h=1e-2)": jax.vmap(jax.grad(fd_sin))(grid),
    "float32 rule on a float64 forward": None,
    "autodiff": jax.vmap(jax.grad(jnp.sin))(grid),
}
fig, ax = plt.subplots(figsize=(7, 3.5))
with jax.enable_x64(True):
    grid64 = jnp.linspace(-3.0, 3.0, 301, dtype=jnp.float64)
    errs["float32 rule on a float64 forward"] = np.asarray(jax.vmap(jax.grad(low))(grid64))
for name, g in errs.items():
    ax.semilogy(grid, np.abs(np.asarray(g, np.float64) - exact) + 1e-12, label=name)
ax.set_xlabel("x"); ax.set_ylabel("|grad - cos(x)|"); ax.legend(); ax.set_title("gradient error of sin")
plt.tight_layout(); plt.show()
