"""Per-element provenance of non-finite values: which birth each NaN/inf element came from.

Every non-finite element the replay computes carries a *label*: an id of a
set of *atoms*, an atom being one element of one birth (the ``k``-th output
element of a forward ``log`` that gave ``-inf``, the ``j``-th cotangent
element of a backward ``sqrt`` that gave ``inf``). A label array has the
value's shape; 0 (the empty set) marks finite elements. Labels are closed
under ancestry: a NaN born from an inf carries the inf's atom too.

How labels move through an equation depends on what its output elements
read:

* element-wise ops (the table below): element ``e`` of the output reads
  element ``e`` of every operand, so labels travel element by element;
* copying ops (reshape, slice, gather, concatenate, pad…): each output
  element is a copy of one operand element; where from is found by running
  the op itself on the operands' element numbers;
* anything else (reductions, ``dot_general``, sorts…): every non-finite
  output element gets the union of all operand labels (an over-estimate).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat

Label = np.ndarray  # int32 set ids, the value's shape; ``None`` stands for all-finite

# Ops whose output element e reads only element e of each operand (operands of
# the output's shape, or scalars broadcast to it).
ELEMENTWISE = frozenset({
    "abs", "acos", "acosh", "add", "asin", "asinh", "atan", "atan2", "atanh", "bessel_i0e", "bessel_i1e",
    "cbrt", "ceil", "clamp", "complex", "conj", "convert_element_type", "copy", "copy_p", "cos", "cosh",
    "digamma", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "floor", "ge", "gt", "igamma",
    "igammac", "imag", "integer_pow", "is_finite", "le", "lgamma", "log", "log1p", "logistic", "lt", "max",
    "min", "mul", "ne", "neg", "nextafter", "not", "and", "or", "xor", "polygamma", "pow", "real",
    "reduce_precision", "rem", "round", "rsqrt", "select_n", "sign", "sin", "sinh", "sqrt", "square",
    "stop_gradient", "sub", "tan", "tanh", "zeta", "regularized_incomplete_beta", "random_gamma_grad",
})

# Element-wise ops whose VJP reads only the incoming cotangent, not the forward values.
READS_COTANGENT_ONLY = frozenset({"add", "sub", "neg", "select_n", "convert_element_type", "copy", "copy_p",
                                  "reduce_precision", "real", "imag", "complex", "conj"})

# Ops whose output elements are copies of operand elements: the operands
# that hold data (the others are indices or sizes; pad's padding value is
# marked as "no source").
COPYING: dict[str, tuple[int, ...] | None] = {  # None: every operand holds data
    "reshape": (0,), "transpose": (0,), "broadcast_in_dim": (0,), "squeeze": (0,), "expand_dims": (0,),
    "rev": (0,), "slice": (0,), "dynamic_slice": (0,), "gather": (0,), "pad": (0,),
    "concatenate": None, "dynamic_update_slice": (0, 1),
}

_MAX_ATOMS = 10_000  # per birth: elements beyond it share one atom (element -1)


def is_elementwise(eqn: compat.JaxprEqn) -> bool:
    """``eqn`` is element-wise and single-output (its operands are of the output's shape or scalars)."""
    if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1:
        return False
    shape = compat.struct_of(eqn.outvars[0].aval).shape
    return all(compat.struct_of(a.aval).shape in (shape, ()) for a in eqn.invars)


# Whose element an atom is: a birth's key (its index in the replay), or ``("input", leaf)`` for an audited input.
AtomKey = int | tuple[str, int]


class Provenance:
    """The interned label sets and atoms of one replay."""

    def __init__(self) -> None:
        self.sets: list[frozenset[int]] = [frozenset()]
        self._set_ids: dict[frozenset[int], int] = {frozenset(): 0}
        self.atoms: list[tuple[AtomKey, int, int]] = []  # (birth key, position, flat element)
        self.causes: list[int] = []  # per atom: the set id of the atoms it came from
        self._atom_ids: dict[tuple[AtomKey, int, int], int] = {}

    def intern(self, s: frozenset[int]) -> int:
        sid = self._set_ids.get(s)
        if sid is None:
            sid = self._set_ids[s] = len(self.sets)
            self.sets.append(s)
        return sid

    def union_ids(self, ids: ArrayLike) -> int:
        """The set id of the union of the sets ``ids`` name."""
        u = np.unique(np.asarray(ids, dtype=np.int32))
        u = u[u != 0]
        if u.size == 0:
            return 0
        if u.size == 1:
            return int(u[0])
        return self.intern(frozenset().union(*(self.sets[i] for i in u)))

    def union_all(self, labels: Sequence[Label | None]) -> int:
        """One set id for every label of every array."""
        parts = [np.ravel(lb) for lb in labels if lb is not None]
        return self.union_ids(np.concatenate(parts)) if parts else 0

    def combine(self, parts: Sequence[Label | None], shape: tuple[int, ...], where: np.ndarray) -> Label:
        """Element-wise union of ``parts`` (each of ``shape`` or a scalar) at ``where``; 0 elsewhere."""
        out = np.zeros(shape, np.int32)
        cols = [np.broadcast_to(p, shape)[where] for p in parts if p is not None]
        cols = [c for c in cols if c.any()]
        if not cols:
            return out
        if len(cols) == 1:
            out[where] = cols[0]
            return out
        rows, inverse = np.unique(np.stack(cols, axis=1), axis=0, return_inverse=True)
        ids = np.array([self.union_ids(r) for r in rows], np.int32)
        out[where] = ids[np.asarray(inverse).reshape(-1)]
        return out

    def born(self, label: Label, key: AtomKey, pos: int, mask: np.ndarray) -> list[int]:
        """Adds a new atom at each ``mask`` element of ``label`` (in place); returns the elements' flat indices."""
        flat = np.flatnonzero(mask)
        lab = label.reshape(-1)
        for n, e in enumerate(flat):
            elem = int(e) if n < _MAX_ATOMS else -1
            a = self._atom_ids.get((key, pos, elem))
            if a is None:
                a = self._atom_ids[(key, pos, elem)] = len(self.atoms)
                self.atoms.append((key, pos, elem))
                self.causes.append(int(lab[e]))
            lab[e] = self.intern(self.sets[int(lab[e])] | {a})
        return [int(e) for e in flat]

    def atoms_of(self, labels: Sequence[Label | None]) -> set[int]:
        """Every atom in ``labels``."""
        sid = self.union_all(labels)
        return set(self.sets[sid])


def sources(eqn: compat.JaxprEqn, invals: Sequence[ArrayLike]) -> tuple[np.ndarray, list[int], list[int]] | None:
    """For a copying op: the flat source of each output element, over the data operands laid end to end.

    Returns ``(source per output element, or -1), data operand positions, their
    offsets``, or ``None`` when ``eqn`` is not a copying op (or the trick fails).
    """
    data = COPYING.get(eqn.primitive.name, ())
    if data == () or len(eqn.outvars) != 1:
        return None
    data = tuple(range(len(invals))) if data is None else data
    vals = list(invals)
    offsets, n = [], 0
    for k in data:
        size = int(np.size(invals[k]))
        offsets.append(n)
        vals[k] = (np.arange(size, dtype=np.int32) + n).reshape(np.shape(invals[k]))
        n += size
    if eqn.primitive.name == "pad":
        vals[1] = np.int32(-1)
    try:
        src = np.asarray(compat.bind(eqn, vals)[0]).reshape(-1).astype(np.int64)
    except Exception:  # an op that does not take integers: fall back to the union
        return None
    src = np.where((src >= 0) & (src < n), src, -1)
    return src, list(data), offsets
