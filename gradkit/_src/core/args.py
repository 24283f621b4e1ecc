"""One split of call arguments into dynamic leaves (traced) and static leaves.

Every place that calls a user function with some leaves traced and the
others fixed (the dispatcher, named ops, ``custom_gradient``, the checks and
the audit) flattens the arguments once with :func:`partition`, traces or
differentiates the dynamic leaves, and rebuilds the arguments with
:meth:`Split.combine`. The cache key of a static leaf is defined once, in
:func:`static_key`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Hashable, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from gradkit._src import compat

T = TypeVar("T")


def is_array(x: object) -> bool:
    """A JAX or NumPy array, a NumPy scalar, or a tracer."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, compat.Tracer))


def is_number(x: object) -> bool:
    """A Python number (``bool``, ``int``, ``float``, ``complex``), not a NumPy scalar."""
    return isinstance(x, (bool, int, float, complex)) and not isinstance(x, np.generic)


def array_or_number(x: object) -> bool:
    """Dynamic for ops whose inputs may be concrete Python scalars (a rule's ``op.inputs``)."""
    return is_array(x) or is_number(x)


def static_key(x: object) -> Hashable:
    """The cache key of a static leaf: its type and value.

    Keyed by type as well as value: ``1``, ``1.0`` and ``True`` are equal in
    Python but trace to different programs. Floats are keyed by their bits, so
    ``-0.0`` and ``0.0`` (equal in Python, different under ``1 / x``) get
    their own entries, and every NaN hits one entry (``nan != nan`` would miss
    the cache on every call). Raises ``TypeError`` for an unhashable value.
    """
    if isinstance(x, float):
        return (type(x), x.hex())
    if isinstance(x, complex):
        return (type(x), x.real.hex(), x.imag.hex())
    hash(x)
    return (type(x), x)


@dataclasses.dataclass(frozen=True, eq=False)
class Split:
    """Where the dynamic leaves of a pytree go, and what the static leaves are.

    Attributes:
      treedef: the pytree structure.
      dyn_pos: the flat positions of the dynamic leaves, in order.
      statics: one entry per leaf: the static value, ``None`` at dynamic positions.
    """

    treedef: jax.tree_util.PyTreeDef
    dyn_pos: tuple[int, ...]
    statics: tuple[object, ...]

    @property
    def num_leaves(self) -> int:
        return len(self.statics)

    def leaves(self, dyn: Sequence[object], fill: object = None) -> list[object]:
        """All leaves: ``dyn`` at the dynamic positions, the statics (or ``fill``) elsewhere."""
        out = list(self.statics) if fill is None else [fill] * len(self.statics)
        for i, x in zip(self.dyn_pos, dyn):
            out[i] = x
        return out

    def combine(self, dyn: Sequence[object]) -> Any:  # the caller's pytree (jax.tree_util is untyped)
        """The pytree with ``dyn`` at the dynamic positions and the static leaves elsewhere."""
        return jax.tree_util.tree_unflatten(self.treedef, self.leaves(dyn))

    def scatter(self, per_dyn: Sequence[object], fill: object = None) -> Any:  # the same structure, other leaves
        """A pytree of the same structure with ``per_dyn`` at the dynamic positions, ``fill`` elsewhere.

        For gradients or tangents: ``None`` for the static leaves.
        """
        out = [fill] * len(self.statics)
        for i, x in zip(self.dyn_pos, per_dyn):
            out[i] = x
        return jax.tree_util.tree_unflatten(self.treedef, out)

    @functools.cached_property
    def key(self) -> Hashable:
        """Hashable: the structure, the dynamic positions and the static values (:func:`static_key`).

        Raises ``TypeError`` if a static leaf is unhashable.
        """
        dyn = set(self.dyn_pos)
        return (self.treedef, self.dyn_pos,
                tuple(None if i in dyn else static_key(x) for i, x in enumerate(self.statics)))


def call_key(static: Hashable, dyn: Sequence[object]) -> tuple[Hashable, ...]:
    """The one cache key of a call: what a traced program depends on, and nothing else.

    ``static`` is the call's structure and static values (:attr:`Split.key`,
    plus a named op's keyword arguments); then the JAX config that changes
    tracing (``compat.trace_context``: x64, promotion, the abstract mesh, the
    axis environment, ...) and, per dynamic leaf, its whole abstract type
    (``compat.type_key``: shape, dtype, weak type, sharding, varying manual
    axes, memory space). The dispatcher, named ops and ``custom_gradient``
    all key on it, so two calls share a program exactly when ``jax.jit``
    would share a trace. Raises ``TypeError`` if a static value is unhashable.
    """
    return (static, compat.trace_context(), *map(compat.type_key, dyn))


def partition(tree: object, dynamic: Callable[[object], bool] = is_array) -> tuple[Split, list[Any]]:
    """Splits ``tree`` into its :class:`Split` and its dynamic leaves (those where ``dynamic`` holds).

    Examples:
      >>> import jax.numpy as jnp
      >>> from gradkit._src.core.args import partition
      >>> split, dyn = partition((jnp.ones(2), "mean", {"scale": 2.0}))
      >>> split.dyn_pos, split.statics[1:]
      ((0,), ('mean', 2.0))
      >>> split.combine([jnp.zeros(2)])[1]
      'mean'
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return partition_leaves(leaves, treedef, dynamic)


def partition_leaves(leaves: Sequence[T], treedef: jax.tree_util.PyTreeDef,
                     dynamic: Callable[[object], bool] = is_array) -> tuple[Split, list[T]]:


    """:func:`partition` of a pytree already flattened to ``leaves`` and ``treedef``."""
    dyn_pos = tuple(i for i, x in enumerate(leaves) if dynamic(x))
    dset = set(dyn_pos)
    statics = tuple(None if i in dset else x for i, x in enumerate(leaves))
    return Split(treedef, dyn_pos, statics), [leaves[i] for i in dyn_pos]
