"""Boolean forms of the operations the liveness passes (core/liveness.py) move masks through.

At run time a mask is a boolean array. A contraction's masks need a matrix
product only where both operands' masks vary; with one side live everywhere
(a weight matrix, a varying operand), the answer is a reduction: ``any`` over
the other side's contracted (up) or free (down) dimensions, broadcast back.
Structural operations (reshape, broadcast, transpose, slices, ...) apply to
the masks as they are, and their transposes are written out (a broadcast's is
an ``any`` over the broadcast dimensions), so no mask goes through a float
copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradkit._src import compat
from gradkit._src.core import walk


def _shape(atom: compat.Atom) -> tuple[int, ...]:
    return tuple(walk.shaped(atom.aval).shape)


def dot_dims(eqn: compat.JaxprEqn) -> tuple[list[int], list[int], list[int], list[int], list[int], list[int]]:
    """``dot_general``'s contracting, batch and free dimensions of each operand (lhs then rhs, each kind);
    the output's dimensions are the batch ones, the lhs's free ones, the rhs's free ones."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    na, nb = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lf = [i for i in range(na) if i not in lc and i not in lb]
    rf = [i for i in range(nb) if i not in rc and i not in rb]
    return list(lc), list(rc), list(lb), list(rb), lf, rf


def _any(x: jax.Array, axes: Sequence[int]) -> jax.Array:
    return jnp.any(x, axis=tuple(axes)) if axes else x


def _spread(red: jax.Array, target: Sequence[int], shape: tuple[int, ...]) -> jax.Array:
    """``red``, whose axes are the dimensions ``target`` of ``shape``, broadcast over the others."""
    perm = tuple(int(i) for i in np.argsort(target))
    if perm != tuple(range(len(perm))):
        red = jnp.transpose(red, perm)
    return lax.broadcast_in_dim(red, shape, tuple(sorted(target)))


def _dot(eqn: compat.JaxprEqn, x: jax.Array, y: jax.Array) -> jax.Array:
    return lax.dot_general(x, y, eqn.params["dimension_numbers"], precision=lax.Precision.HIGHEST,
                           preferred_element_type=jnp.float32)


def dot_up(eqn: compat.JaxprEqn, x: jax.Array | None, y: jax.Array | None) -> jax.Array:
    """Where some contracted term of the lhs mask ``x`` and the rhs mask ``y`` is live (``None``: live
    everywhere; not both)."""
    lc, rc, lb, rb, lf, rf = dot_dims(eqn)
    out = _shape(eqn.outvars[0])
    nb, nl = len(lb), len(lf)
    if y is None:
        assert x is not None
        rest = [i for i in range(x.ndim) if i not in lc]
        return _spread(_any(x, lc), [lb.index(i) if i in lb else nb + lf.index(i) for i in rest], out)
    if x is None:
        rest = [i for i in range(y.ndim) if i not in rc]
        return _spread(_any(y, rc), [rb.index(i) if i in rb else nb + nl + rf.index(i) for i in rest], out)
    return _dot(eqn, x.astype(jnp.float32), y.astype(jnp.float32)) > 0


def dot_back(eqn: compat.JaxprEqn, d: jax.Array | None, other: jax.Array | None, side: int) -> jax.Array:
    """Where operand ``side`` (0: lhs, 1: rhs) enters some term that meets a live output element (``d``) and
    a factor of the other operand that is not a masking zero (``other``); ``None``: live everywhere (not
    both)."""
    lc, rc, lb, rb, lf, rf = dot_dims(eqn)
    if side:  # the rhs: the same with the operands' roles swapped (the output keeps its order)
        lc, rc, lb, rb, lf, rf = rc, lc, rb, lb, rf, lf
    out = _shape(eqn.outvars[0])
    mine = _shape(eqn.invars[side])
    nb, nl, nr = len(lb), len(lf), len(rf)
    own = list(range(nb, nb + nl)) if not side else list(range(nb + nr, nb + nr + nl))  # in the output
    others = list(range(nb + nl, nb + nl + nr)) if not side else list(range(nb, nb + nr))
    if other is None:
        assert d is not None
        rest = [p for p in range(len(out)) if p not in others]
        return _spread(_any(d, others), [lb[p] if p < nb else lf[own.index(p)] for p in rest], mine)
    if d is None:
        rest = [i for i in range(other.ndim) if i not in rf]
        return _spread(_any(other, rf), [lb[rb.index(i)] if i in rb else lc[rc.index(i)] for i in rest], mine)
    x = other.astype(jnp.float32)

    def dot(p: jax.Array) -> jax.Array:
        return _dot(eqn, *((p, x) if not side else (x, p)))

    (ct,) = jax.linear_transpose(dot, jax.ShapeDtypeStruct(mine, jnp.float32))(d.astype(jnp.float32))
    back: jax.Array = ct > 0
    return back


# Structural primitives applied to boolean masks as they are (the rest go through float32).
BOOLEAN = frozenset({"reshape", "broadcast_in_dim", "transpose", "squeeze", "expand_dims", "rev", "slice",
                     "concatenate", "dynamic_slice", "reduce_sum"})


def structural(eqn: compat.JaxprEqn, args: Sequence[Any]) -> jax.Array:
    """A structural op of :data:`BOOLEAN` on masks (``args``: the masks, and the op's index operands)."""
    if eqn.primitive.name == "reduce_sum":
        return _any(args[0], eqn.params["axes"])
    out: jax.Array = compat.bind_primitive(eqn.primitive, list(args), dict(eqn.params))[0]
    return out


def transpose_structural(eqn: compat.JaxprEqn, d: jax.Array) -> list[Any] | None:
    """Where each operand of a one-operand structural op reaches a live output element (``d``); ``None``
    where it has no boolean form here."""
    name = eqn.primitive.name
    if len(eqn.invars) != 1:
        return None
    shape = _shape(eqn.invars[0])
    rest: list[Any] = [False] * (len(eqn.invars) - 1)
    if name in ("squeeze", "expand_dims") or (name == "reshape" and eqn.params.get("dimensions") is None):
        return [jnp.reshape(d, shape), *rest]
    if name == "transpose":
        return [jnp.transpose(d, tuple(int(i) for i in np.argsort(eqn.params["permutation"]))), *rest]
    if name == "rev":
        return [lax.rev(d, tuple(eqn.params["dimensions"])), *rest]
    if name == "reduce_sum":
        summed = set(eqn.params["axes"])
        return [lax.broadcast_in_dim(d, shape, tuple(i for i in range(len(shape)) if i not in summed)), *rest]
    if name == "broadcast_in_dim" and len(eqn.invars) == 1:
        dims = tuple(eqn.params["broadcast_dimensions"])
        out = d.shape
        axes = [i for i in range(len(out)) if i not in dims] + [dims[k] for k, n in enumerate(shape)
                                                                if n != out[dims[k]]]
        red = jnp.any(d, axis=tuple(sorted(axes)), keepdims=True) if axes else d
        return [jnp.reshape(red, shape), *rest]
    return None
