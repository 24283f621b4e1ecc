"""The replay of one plain equation: bind it forward, apply its own VJP backward, find births.

Forward, the equation is bound to concrete values. Backward, ``jax.vjp`` of
that single equation (with its active float operands as the variables) gives
the operands' cotangents: the same arithmetic ``jax.grad`` does.

Each non-finite result element is either inherited (it reads a NaN/inf) or
born here. For an element-wise op this is decided element by element, from
the elements it reads: a NaN is born where none of them is NaN, an inf where
all of them are finite. The backward of an element-wise op reads the incoming
cotangent and the forward operands and results at the same element. For other
ops the test is on whole arrays. When the replay's ``cotangent_births`` is set
(the audited inputs hold NaN/inf on purpose), a backward element is born
wherever the cotangents it reads are finite, whatever the forward values. Labels (:mod:`gradkit._src.audit.provenance`)
record which births every non-finite element came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.activity import is_float_aval
from gradkit._src.audit.provenance import COPYING, READS_COTANGENT_ONLY, Label, Provenance, is_elementwise, sources
from gradkit._src.audit.replay.state import Context, Ct, Frame, Runner, Values
from gradkit._src.checks.describe import nonfinite_mask


def mask_of(x: object, kind: str = "any") -> np.ndarray | None:
    """``nonfinite_mask`` of any value an equation reads or makes; ``None`` for one that is not inexact.

    PRNG key arrays (``key<fry>``) and ``float0`` cotangents are decided by
    their dtype, without converting them to NumPy (which a key refuses).
    """
    dtype = getattr(x, "dtype", None)
    if dtype is not None and not jnp.issubdtype(dtype, jnp.inexact):
        return None
    return nonfinite_mask(x, kind)


def _nf(x: ArrayLike, kind: str) -> np.ndarray:
    """``nonfinite_mask`` of a value that is inexact here (its mask is never ``None``)."""
    m = mask_of(x, kind)
    return np.zeros(np.shape(x), bool) if m is None else m


def _masks(values: Sequence[ArrayLike], shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Where any of ``values`` (each of ``shape`` or a scalar) is NaN (``"nan"``) or non-finite (``"any"``)."""
    out = np.zeros(shape, bool)
    for v in values:
        m = _nf(v, kind)
        if m is not None and np.shape(m) in (shape, ()):
            out |= np.broadcast_to(m, shape)
    return out


def _any(values: Sequence[object], kind: str) -> bool:
    return any(m is not None and bool(m.any()) for m in (mask_of(v, kind) for v in values))


def _zeros_ct(aval: Any) -> jax.Array | np.ndarray:  # an aval with a shape and dtype
    if is_float_aval(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return compat.float0_zeros(tuple(aval.shape))


def _scatter_union(prov: Provenance, src: np.ndarray, label: np.ndarray, offset: int, size: int) -> np.ndarray:
    """Labels of a copied operand's elements: the union of the labels of the copies made of each."""
    out = np.zeros(size, np.int32)
    lab = label.reshape(-1)
    sel = (lab != 0) & (src >= offset) & (src < offset + size)
    if not sel.any():
        return out
    pairs = np.unique(np.stack([src[sel] - offset, lab[sel]], axis=1), axis=0)
    for e in np.unique(pairs[:, 0]):
        out[e] = prov.union_ids(pairs[pairs[:, 0] == e, 1])
    return out


def _integer_fill(eqn: compat.JaxprEqn) -> compat.JaxprEqn:
    """``eqn`` to bind to element indices (:func:`sources`): a ``gather``'s fill value made ``-1``.

    ``sources`` binds a copying op to integer operands; a ``gather`` in
    ``FILL_OR_DROP`` mode (``x.at[i].get(mode="fill")``, ``take_along_axis``
    out of bounds) fills with NaN by default, and JAX converts that fill to
    the integer dtype with NumPy (a ``RuntimeWarning: invalid value encountered
    in cast``, and an arbitrary integer that could read as an element's index).
    ``-1`` is what ``sources`` reads as "no source", as for ``pad``'s padding value.
    """
    if eqn.primitive.name == "gather" and eqn.params.get("fill_value") is not None:
        return eqn.replace(params={**eqn.params, "fill_value": -1})
    return eqn


class Leaf:
    """The handler of any equation the replay does not enter."""

    # ------------------------------------------------------------------ forward

    def forward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, invals: list[ArrayLike],
                act_in: list[bool], labels: list[Label | None]) -> tuple[list[ArrayLike], list[Label | None]]:
        with compat.source_of(eqn):
            outs = compat.bind(eqn, invals)
        return outs, self.forward_labels(rp, frame.ctx, eqn, invals, labels, outs)

    def forward_labels(self, rp: Runner, ctx: tuple[Context, ...], eqn: compat.JaxprEqn, invals: list[ArrayLike],
                       labels: list[Label | None], outs: list[ArrayLike]) -> list[Label | None]:
        bad = [mask_of(o) for o in outs]
        if not any(m is not None and m.any() for m in bad):
            return [None] * len(outs)
        prov: Provenance = rp.prov
        values: Values = {"invals": list(invals), "outvals": list(outs)}
        if is_elementwise(eqn):
            shape = np.shape(outs[0])
            if eqn.primitive.name == "select_n":  # element e is a copy of the case it selects
                which = np.broadcast_to(np.asarray(invals[0]).astype(np.int64), shape)
                cases = [np.zeros(shape, np.int32) if lb is None else np.broadcast_to(lb, shape) for lb in labels[1:]]
                chosen = np.take_along_axis(np.stack(cases), which[None], 0)[0]
                label = np.where(bad[0], chosen, 0).astype(np.int32)
            else:
                label = prov.combine(labels, shape, _nf(outs[0], "any"))
            born = {"nan": _nf(outs[0], "nan") & ~_masks(invals, shape, "nan"),
                    "inf": _nf(outs[0], "inf") & ~_masks(invals, shape, "any")}
            self._births(rp, eqn, "forward", ctx, 0, label, born, values)
            return [label]
        src = sources(_integer_fill(eqn), invals)
        if src is not None:
            source, data, offsets = src
            flat = [np.zeros(np.size(invals[k]), np.int32) if labels[k] is None else cast(Label, labels[k]).reshape(-1)
                    for k in data]
            every = np.concatenate(flat) if flat else np.zeros(0, np.int32)
            copied = np.where(source >= 0, every[np.maximum(source, 0)] if every.size else 0, 0)
            shape = np.shape(outs[0])
            label = np.where(bad[0], copied.reshape(shape), 0).astype(np.int32)
            orphan = (source < 0).reshape(shape)  # a padding or fill value, not a copy
            born = {"nan": _nf(outs[0], "nan") & orphan, "inf": _nf(outs[0], "inf") & orphan}
            self._births(rp, eqn, "forward", ctx, 0, label, born, values)
            return [label]
        sid = prov.union_all(labels)
        in_nan, in_nf = _any(invals, "nan"), _any(invals, "any")
        result: list[Label | None] = []
        for j, (o, m) in enumerate(zip(outs, bad)):
            if m is None or not m.any():
                result.append(None)
                continue
            label = np.where(m, sid, 0).astype(np.int32)
            born = {"nan": _nf(o, "nan") & (not in_nan), "inf": _nf(o, "inf") & (not in_nf)}
            self._births(rp, eqn, "forward", ctx, j, label, born, values)
            result.append(label)
        return result

    @staticmethod
    def _births(rp: Runner, eqn: compat.JaxprEqn, phase: str, ctx: tuple[Context, ...], pos: int, label: np.ndarray,
                born: dict[str, np.ndarray], values: Values) -> None:
        for kind in ("nan", "inf"):
            if born[kind].any():
                rp.record(eqn, phase, kind, ctx, pos, born[kind], label, values)

    # ------------------------------------------------------------------ backward

    def backward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, out_cts: list[Ct]) -> list[Ct]:
        invals = [frame.read(a) for a in eqn.invars]
        dyn = tuple(k for k, a in enumerate(eqn.invars) if frame.is_active(a) and is_float_aval(a.aval))
        if not dyn:
            return [None] * len(eqn.invars)

        def f(*d: jax.Array) -> list[jax.Array]:
            vals = list(invals)
            for k, x in zip(dyn, d):
                vals[k] = x
            return compat.bind(eqn, vals)

        cts = [c[0] if c is not None else _zeros_ct(v.aval) for c, v in zip(out_cts, eqn.outvars)]
        with compat.source_of(eqn):
            _, vjp = jax.vjp(f, *[invals[k] for k in dyn])
            got = vjp(cts)
        outvals = [frame.read(v) for v in eqn.outvars]
        ct_labels = [None if c is None else c[1] for c in out_cts]
        in_labels = [frame.label(a) for a in eqn.invars]
        out_labels = [frame.label(v) for v in eqn.outvars]
        in_cts: list[ArrayLike | None] = [None] * len(invals)
        for k, g in zip(dyn, got):
            in_cts[k] = g
        values: Values = {"invals": invals, "outvals": outvals, "out_cts": cts, "in_cts": in_cts}
        prov: Provenance = rp.prov
        elementwise = is_elementwise(eqn)
        copying = sources(_integer_fill(eqn), invals) if eqn.primitive.name in COPYING else None
        result: list[Ct] = [None] * len(invals)
        for k, g in zip(dyn, got):
            bad = mask_of(g)
            if bad is None or not bad.any():
                result[k] = (g, None)
                continue
            shape = np.shape(g)
            if elementwise and shape == np.shape(outvals[0]):
                # what element e of the cotangent is computed from
                linear = eqn.primitive.name in READS_COTANGENT_ONLY
                reads = cts if linear or rp.cotangent_births else cts + invals + outvals
                label = prov.combine(ct_labels if linear else ct_labels + in_labels + out_labels, shape, bad)
                born = {"nan": _nf(g, "nan") & ~_masks(reads, shape, "nan"),
                        "inf": _nf(g, "inf") & ~_masks(reads, shape, "any")}
            elif copying is not None and k in copying[1]:
                source, data, offsets = copying
                off = offsets[data.index(k)]
                ct_label = ct_labels[0] if ct_labels[0] is not None else np.zeros(np.shape(cts[0]), np.int32)
                label = _scatter_union(prov, source, ct_label, off, int(np.size(g))).reshape(shape)
                label = np.where(bad, label, 0).astype(np.int32)
                born = {"nan": _nf(g, "nan") & (not _any(cts, "nan")),
                        "inf": _nf(g, "inf") & (not _any(cts, "any"))}
            else:
                reads = cts if rp.cotangent_births else cts + invals + outvals
                sid = prov.union_all(ct_labels + in_labels + out_labels)
                label = np.where(bad, sid, 0).astype(np.int32)
                born = {"nan": _nf(g, "nan") & (not _any(reads, "nan")),
                        "inf": _nf(g, "inf") & (not _any(reads, "any"))}
            self._births(rp, eqn, "backward", frame.ctx, k, label, born, values)
            result[k] = (g, label if label.any() else None)
        return result


LEAF = Leaf()
