"""Shared functions and helpers of the bad-input tests (tests/test_bad_*.py).

Every bad-input case gets a clear `[gradkit]` error or the right result.

The contract (issue 8): under bad input gradkit raises a `GradkitError` whose
message names the rule, the op and the user's source line, or it does what a
JAX user would expect; never a crash deep inside JAX, never a silently wrong
gradient, never a change to what the program computes. Where JAX's own error
is the right one (control flow on traced values, deleted buffers, grad of a
non-scalar) it surfaces unchanged in type, with a gradkit note where gradkit is
the reason it happens.

Cases already covered by test_validation.py / test_dispatch.py are not repeated.
"""

import contextlib
import re

import jax
import jax.numpy as jnp

import gradkit as gk

X = jnp.array([0.5, 1.0, 2.0], jnp.float32)
THIS_FILE = re.escape(__file__.rsplit("/", 1)[-1])


def loss(x):
    return jnp.sum(jnp.sin(x) * 2.0)  # the line every rule error must point at


LOSS_LINE = loss.__code__.co_firstlineno + 1


def binary_loss(x):
    return jnp.sum(jnp.sin(x) * jnp.cos(x))  # a `mul` with two array inputs


BINARY_LINE = binary_loss.__code__.co_firstlineno + 1


@gk.op("affine")
def affine(params, x):
    return params["w"] * x + params["b"]


def affine_loss(x):
    return jnp.sum(affine({"w": jnp.float32(2.0), "b": jnp.float32(1.0)}, x))  # named-op call line


AFFINE_LINE = affine_loss.__code__.co_firstlineno + 1


@contextlib.contextmanager
def x64():
    """float64 on for a block (jax.enable_x64 since 0.8; jax.experimental before)."""
    enable = getattr(jax, "enable_x64", None)
    if enable is None:  # pragma: no cover - older JAX
        from jax.experimental import enable_x64 as enable
    with enable(True):
        yield


def notes(e):
    return str(e) + "\n".join(getattr(e, "__notes__", []))


def hand_sin(rule_fn):
    """``jnp.sin`` as a hand-written jax.custom_vjp carrying ``rule_fn`` (the reference)."""

    @jax.custom_vjp
    def s(x):
        return jnp.sin(x)

    s.defvjp(lambda x: (jnp.sin(x), (x, jnp.sin(x))),
             lambda res, g: tuple(rule_fn(gk.OpView("sin", (res[0],), (res[1],), {}), g)))
    return s
