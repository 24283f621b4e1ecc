"""The audited function as a flat program: differentiated leaves in, floating-point outputs out.

Shared by the audit's investigation, its fixes (re-runs) and its sweep. The
arguments are split once (:mod:`gradkit._src.core.args`): the floating-point
leaves of the differentiated arguments are dynamic, everything else is held.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src.checks.describe import fn_name, is_float, leaf_names
from gradkit._src.core.args import Split
from gradkit._src.errors import GradkitError


@dataclasses.dataclass(frozen=True)
class Program:
    """``fn`` at ``args``, with the differentiated leaves (``dyn``) split from the rest.

    Attributes:
      fn: the function (the audited one, or a fixed version of it).
      split: where the differentiated leaves go among all leaves.
      dyn: the values of the differentiated leaves.
      names: a readable name per leaf (all leaves, in order).
    """

    fn: Callable[..., object]
    split: Split
    dyn: list[ArrayLike]
    names: list[str]

    @property
    def dyn_names(self) -> list[str]:
        return [self.names[i] for i in self.split.dyn_pos]

    def leaves(self) -> list[object]:
        return self.split.leaves(self.dyn)

    def call(self, dyn: Sequence[ArrayLike]) -> list[jax.Array]:
        """The floating-point output leaves of ``fn`` with ``dyn`` as the differentiated leaves."""
        out = self.fn(*self.split.combine(dyn))
        return [jnp.asarray(v) for v in jax.tree_util.tree_leaves(out)
                if jnp.issubdtype(jnp.asarray(v).dtype, jnp.inexact)]

    def flat(self) -> Callable[..., list[jax.Array]]:
        return lambda *d: self.call(d)

    def with_fn(self, fn: Callable[..., object]) -> Program:
        return dataclasses.replace(self, fn=fn)

    def at(self, dyn: Sequence[ArrayLike]) -> Program:
        return dataclasses.replace(self, dyn=list(dyn))

    def cast(self, f: Callable[[Any], Any]) -> Program:  # to_f64: held leaves of any type, and arrays
        """Every leaf (held or differentiated) mapped by ``f``: to float64 for finite differences."""
        statics = tuple(None if x is None else f(x) for x in self.split.statics)
        return dataclasses.replace(self, split=dataclasses.replace(self.split, statics=statics),
                                   dyn=[f(x) for x in self.dyn])


def make_program(fn: Callable[..., object], args: Sequence[object], argnums: int | Sequence[int] | None) -> Program:
    """Splits ``args``: the float leaves of the ``argnums`` arguments (default: all) are differentiated."""
    leaves, treedef = jax.tree_util.tree_flatten(tuple(args))
    leaves = [jnp.asarray(x) if isinstance(x, (float, complex)) else x for x in leaves]
    names = leaf_names(fn, args)
    top = set(range(len(args))) if argnums is None else ({argnums} if isinstance(argnums, int) else set(argnums))
    owner = [k for k, a in enumerate(args) for _ in jax.tree_util.tree_leaves(a)]
    dyn_pos = tuple(i for i, x in enumerate(leaves) if owner[i] in top and is_inexact(x))
    if not dyn_pos:
        raise GradkitError(f"audit({fn_name(fn)}): no floating-point input to differentiate, real or complex "
                           f"(inputs: {', '.join(names) or 'none'}). Pass float or complex arrays, or fix "
                           "argnums.")
    split = Split(treedef, dyn_pos, tuple(None if i in dyn_pos else x for i, x in enumerate(leaves)))
    return Program(fn, split, [leaves[i] for i in dyn_pos], names)


def is_inexact(x: object) -> bool:
    """A floating-point or complex array (or Python float/complex): what the audit differentiates.

    A complex input gets the gradient ``jax.grad`` gives a real loss of it
    (see :func:`gradient`); a PRNG key, an integer or a boolean is held.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, (float, complex))
    return bool(jnp.issubdtype(dtype, jnp.inexact)) or is_float(x)


# The audit compiles a program per route it re-runs (and per input it differentiates) and runs each once:
# XLA's LLVM optimisation passes cost more than they save there (a Flax attention model's audit: 198
# compilations, 36 s → 28 s on 2 CPU cores). Values agree with jax.jit's within a few roundings (the
# passes vectorise reductions, which can reorder a sum); every comparison the audit makes has a tolerance.
RUN_ONCE = {"xla_backend_optimization_level": 0}


def gradient(flat: Callable[..., list[jax.Array]], dyn: Sequence[ArrayLike],
             ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(outputs, gradient of the sum of the outputs) — what ``jax.grad`` would give.

    The cotangent of every output element is 1: for a real output that is
    ``jax.grad`` of the sum (complex inputs included); for a complex output it
    is the gradient of the sum of its real parts, which for a holomorphic
    function is ``jax.grad(..., holomorphic=True)``.
    """
    def run(*d: jax.Array) -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
        out, vjp = jax.vjp(flat, *d)
        return out, vjp([jnp.ones_like(o) for o in out])
    out, g = jax.jit(run).lower(*dyn).compile(RUN_ONCE)(*dyn)
    return [np.asarray(o) for o in out], [np.asarray(x) for x in g]


def describe_input(name: str, x: object) -> str:
    """``x: f32[3,4]``."""
    dtype = getattr(x, "dtype", None)
    dtype = np.asarray(x).dtype if dtype is None else dtype  # a PRNG key refuses np.asarray: it has a dtype
    dt = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16", "int32": "i32",
          "int64": "i64", "bool": "bool", "complex64": "c64", "complex128": "c128"}.get(str(dtype), str(dtype))
    return f"{name}: {dt}[{','.join(map(str, np.shape(x)))}]"
