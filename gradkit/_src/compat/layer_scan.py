"""The static plan of a model's program for LRP: which equations form a layer, which are folded into one.

Used by :mod:`~gradkit._src.compat.layers` (which runs the plan). Everything
here reads a jaxpr's equations and shapes only, never values. See that
module's doc for the kinds of layer; this one also finds:

* **folds** (canonization): after a dense or conv layer (and its bias add),
  a chain of element-wise ``add``/``sub``/``mul``/``div`` with an operand
  that does not depend on the input and varies only along the layer's output
  channels (BatchNorm in eval mode, however written) becomes part of the
  layer, whose weight and bias the runner then folds;
* **residual sums**: an ``add`` of two values that both depend on the input;
* **batch statistics**: a sum over the batch axis of a value that depends on
  the input (BatchNorm in training mode), which LRP cannot explain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src.compat.jaxprs import (
    JaxprEqn,
    bind,
    cond_layout,
    eqn_name,
    is_literal,
    jaxpr_parts,
    read_atom,
    scan_layout,
)

__all__ = ["AFFINE", "LAYOUT", "Plan", "Unit", "literal_scalar"]

LINEAR = {"dot_general": "dense", "conv_general_dilated": "conv"}
LAYOUT = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p"})
AFFINE = frozenset({"add", "sub", "mul", "div"})
# Element-wise ops on constants whose result varies along the union of their operands' axes.
_ELEMENTWISE_CONST = frozenset({"add", "sub", "mul", "div", "rsqrt", "sqrt", "neg", "abs", "exp", "log", "max",
                                "min", "integer_pow", "pow", "square", "convert_element_type", "copy", "copy_p"})
_POOL_SUMS = frozenset({"reduce_window_sum", "reduce_sum"})
_ELEMENTWISE_ACTIVATIONS = frozenset({"tanh", "logistic"})
_INLINED_ACTIVATIONS = frozenset({"gelu"})

#: ``jax.nn`` functions (by the name their ``custom_jvp`` / ``jit`` equation carries) that are activations.
ACTIVATION_FUNCTIONS = frozenset({
    "relu", "relu6", "gelu", "silu", "swish", "elu", "celu", "selu", "leaky_relu", "softplus", "sigmoid",
    "hard_tanh", "hard_sigmoid", "hard_silu", "hard_swish", "soft_sign", "mish", "squareplus", "sparse_plus",
    "tanh", "log_sigmoid",
})


@dataclass
class Unit:
    """Equations run as one layer: ``head`` (the dot/conv/reduction), layout ``chain``, affine ``tail``.

    For dense/conv: ``bias`` says ``tail[0]`` is the bias add; ``folded`` that
    the rest of ``tail`` is a per-channel affine map folded into the layer;
    ``channels`` pairs the weight's output axes with the axes of the unit's
    output they become. For ``avg_pool``: ``tail`` is the division or product
    by a constant (or empty).
    """

    kind: str
    head: int
    chain: list[int] = field(default_factory=list)
    tail: list[int] = field(default_factory=list)
    bias: bool = False
    folded: bool = False
    channels: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())


def is_varying(atom: Any, varying: set[Any]) -> bool:
    return not is_literal(atom) and atom in varying


def literal_scalar(atom: Any) -> float | None:
    if not is_literal(atom):
        return None
    val = np.asarray(atom.val)
    numeric = np.issubdtype(val.dtype, np.floating) or np.issubdtype(val.dtype, np.integer)
    return float(val) if val.shape == () and numeric else None


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def is_float(atom: Any) -> bool:
    """``atom`` holds floating-point values (bfloat16 too: NumPy's ``issubdtype`` does not say so)."""
    dtype = getattr(atom.aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))


def map_axes(eqn: JaxprEqn, axes: Sequence[int]) -> list[int] | None:
    """Where the axes ``axes`` of a layout op's input go in its output; ``None`` when they do not stay whole."""
    prim = eqn.primitive.name
    if prim in ("convert_element_type", "copy", "copy_p"):
        return list(axes)
    if prim == "transpose":
        perm = list(eqn.params["permutation"])
        return [perm.index(a) for a in axes]
    if prim in ("squeeze", "reshape", "expand_dims"):
        old, new = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
        old_big = [i for i, n in enumerate(old) if n != 1]
        new_big = [i for i, n in enumerate(new) if n != 1]
        if [old[i] for i in old_big] != [new[i] for i in new_big] or any(a not in old_big for a in axes):
            return None
        return [new_big[old_big.index(a)] for a in axes]
    return None


def _head_channels(eqn: JaxprEqn, k: int) -> tuple[list[int], list[int]] | None:
    """``(weight axes, output axes)`` of a dense/conv layer's output channels; ``k`` is the input's operand."""
    if eqn.primitive.name == "conv_general_dilated":
        if eqn.params.get("batch_group_count", 1) != 1:
            return None
        dn = eqn.params["dimension_numbers"]
        return [dn.rhs_spec[0]], [dn.out_spec[1]]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    w_contract, w_batch = (rc, rb) if k == 0 else (lc, lb)
    w_ndim = len(_shape(eqn.invars[1 - k]))
    x_ndim = len(_shape(eqn.invars[k]))
    x_contract, x_batch = (lc, lb) if k == 0 else (rc, rb)
    free_w = [d for d in range(w_ndim) if d not in w_contract and d not in w_batch]
    n_b = len(w_batch)
    n_free_x = x_ndim - len(x_contract) - len(x_batch)
    start = n_b + (n_free_x if k == 0 else 0)  # output: batch dims, lhs free dims, rhs free dims
    return free_w, [start + i for i in range(len(free_w))]


class Plan:
    """One jaxpr's static plan: its units, the equations deferred into them, activations, residual sums."""

    def __init__(self, jaxpr: Any, varying_in: Sequence[bool], *, canonize: bool = True,
                 batch: int | None = None) -> None:
        self.jaxpr = jaxpr
        self.eqns = list(jaxpr.eqns)
        self.varying: set[Any] = {v for v, d in zip(jaxpr.invars, varying_in) if d}
        self.producer: dict[Any, int] = {}
        users: dict[Any, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            if any(is_varying(a, self.varying) for a in eqn.invars):
                self.varying.update(eqn.outvars)
            for v in eqn.outvars:
                self.producer[v] = i
            for a in eqn.invars:
                if not is_literal(a):
                    users.setdefault(a, []).append(i)
        self.users = users
        self.outs = {a for a in jaxpr.outvars if not is_literal(a)}
        self.units: dict[int, Unit] = {}  # last equation -> unit
        self.deferred: set[int] = set()
        self.activations: set[int] = set()
        self.sums: set[int] = set()
        self.batch_stats: list[int] = []  # sums over the batch axis of varying values
        self.regions: dict[int, tuple[int, Any, str]] = {}  # last eqn -> (first eqn, input, name): inlined activations
        self._const_axes_memo: dict[Any, frozenset[int] | None] = {}
        self._find_inlined_activations()
        self.in_region = {k for last, (first, _, _) in self.regions.items() for k in range(first, last + 1)}

        for i, eqn in enumerate(self.eqns):
            if i in self.deferred or i in self.regions or i in self.units:
                continue
            prim = eqn.primitive.name
            dyn = [k for k, a in enumerate(eqn.invars) if is_varying(a, self.varying)]
            if prim in LINEAR and len(dyn) == 1 and len(eqn.invars) == 2:
                self._linear(i, eqn, dyn[0], canonize)
            elif prim in _POOL_SUMS and dyn == [0]:
                if prim == "reduce_sum" and batch is not None and self._over_batch(eqn, batch):
                    self.batch_stats.append(i)
                elif prim == "reduce_window_sum" or self._only_use(eqn.invars[0]):
                    self._pool(i, eqn)
            elif prim in ("psum", "pmean") and dyn and batch is not None and 0 in eqn.params.get("axes", ()):
                self.batch_stats.append(i)  # a collective over the batch axis (Equinox's BatchNorm under vmap)
            elif prim in ("reduce_window_max", "reduce_max") and dyn == [0]:
                self.units[i] = Unit("max_pool", i)
            elif prim == "add" and len(dyn) == 2 and all(is_float(a) for a in eqn.invars):
                self.sums.add(i)
            elif len(dyn) == 1 and len(eqn.outvars) == 1 and _is_activation(eqn, dyn[0]):
                self.activations.add(i)

    # ------------------------------------------------------------------ helpers

    def only_user(self, v: Any) -> int | None:
        """The one equation using ``v`` (a layer does not reach into an inlined activation or the outputs)."""
        u = self.users.get(v, [])
        return u[0] if len(u) == 1 and v not in self.outs and u[0] not in self.in_region else None

    def _only_use(self, v: Any) -> bool:
        return not is_literal(v) and self.only_user(v) is not None

    def _over_batch(self, eqn: JaxprEqn, batch: int) -> bool:
        """A sum over the batch axis that keeps a feature axis (a normalization over all axes of one example,
        under a ``vmap`` of LRP, is not one) of a value used elsewhere too (not a pooling)."""
        shape = _shape(eqn.invars[0])
        axes = tuple(eqn.params.get("axes", ()))
        return (len(shape) >= 2 and shape[0] == batch and 0 in axes and len(axes) < len(shape)
                and not self._only_use(eqn.invars[0]))

    def _layout_chain(self, v: Any) -> tuple[list[int], Any, int | None]:
        chain: list[int] = []
        j = self.only_user(v)
        while j is not None and self.eqns[j].primitive.name in LAYOUT and len(self.eqns[j].invars) == 1:
            chain.append(j)
            v = self.eqns[j].outvars[0]
            j = self.only_user(v)
        return chain, v, j

    def const_axes(self, atom: Any) -> frozenset[int] | None:
        """The axes along which a constant operand may vary (in its own shape); ``None``: unknown."""
        if is_literal(atom) or not _shape(atom):
            return frozenset()
        if atom in self._const_axes_memo:
            return self._const_axes_memo[atom]
        shape = _shape(atom)
        big = frozenset(i for i, n in enumerate(shape) if n != 1)
        res: frozenset[int] | None = big
        j = self.producer.get(atom)
        if j is not None:
            e = self.eqns[j]
            prim = e.primitive.name
            if prim == "broadcast_in_dim" and len(e.invars) == 1:
                inner = self.const_axes(e.invars[0])
                dims = e.params["broadcast_dimensions"]
                res = None if inner is None else frozenset(int(dims[a]) for a in inner) & big
            elif prim in ("reshape", "squeeze", "expand_dims") and len(e.invars) == 1:
                inner = self.const_axes(e.invars[0])
                mapped = None if inner is None else map_axes(e, sorted(inner))
                res = big if mapped is None else frozenset(mapped)
            elif prim in _ELEMENTWISE_CONST:
                acc: set[int] = set()
                for a in e.invars:
                    if not _shape(a):
                        continue
                    if len(_shape(a)) != len(shape):
                        acc = set(big)
                        break
                    inner = self.const_axes(a)
                    if inner is None:
                        acc = set(big)
                        break
                    acc |= inner
                res = frozenset(acc) & big
        self._const_axes_memo[atom] = res
        return res

    # ------------------------------------------------------------------ layers

    def _linear(self, i: int, eqn: JaxprEqn, k: int, canonize: bool) -> None:
        chain, v, j = self._layout_chain(eqn.outvars[0])
        tail: list[int] = []
        bias = False
        if j is not None:
            e = self.eqns[j]
            if e.primitive.name == "add" and len(e.invars) == 2 and e.invars[0] is not e.invars[1]:
                other = e.invars[1] if e.invars[0] is v else e.invars[0]
                if not is_varying(other, self.varying):
                    tail, bias = [j], True
        if not tail:
            chain = []  # layout ops stay outside a layer without bias (as before); a fold may take them back
        folded = False
        channels: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
        if canonize:
            found = self._fold(i, eqn, k, tail, bias)
            if found is not None:
                chain, tail, channels = found
                folded = len(tail) > int(bias)
        last = tail[-1] if tail else i
        self.units[last] = Unit(LINEAR[eqn.primitive.name], i, chain, tail, bias, folded, channels)
        if tail:
            self.deferred.update([i, *chain, *tail[:-1]])

    def _fold(self, i: int, eqn: JaxprEqn, k: int, tail: list[int],
              bias: bool) -> tuple[list[int], list[int], tuple[tuple[int, ...], tuple[int, ...]]] | None:
        """The layout chain, affine tail and channel axes of a per-channel affine map after a layer, or None."""
        head = _head_channels(eqn, k)
        if head is None:
            return None
        w_axes, axes_ = head
        chain, v, j = self._layout_chain(eqn.outvars[0])
        axes: list[int] | None = axes_
        for c in chain:
            axes = None if axes is None else map_axes(self.eqns[c], axes)
        if axes is None:
            return None
        chans = frozenset(axes)
        new_tail: list[int] = []
        ndim = len(_shape(v))
        while j is not None:
            e = self.eqns[j]
            if e.primitive.name not in AFFINE or len(e.invars) != 2 or e.invars[0] is e.invars[1]:
                break
            pos = 0 if e.invars[0] is v else 1
            other = e.invars[1 - pos]
            if is_varying(other, self.varying) or (e.primitive.name == "div" and pos != 0):
                break
            if _shape(other) and len(_shape(other)) != ndim:
                break
            ax = self.const_axes(other)
            if ax is None or not ax <= chans:
                break
            new_tail.append(j)
            v = e.outvars[0]
            j = self.only_user(v)
        if bias and (not new_tail or new_tail[0] != tail[0]):
            return None  # the bias is not per-channel: keep the unfolded layer
        if len(new_tail) <= int(bias):
            return None
        return chain, new_tail, (tuple(w_axes), tuple(axes))

    def _pool(self, i: int, eqn: JaxprEqn) -> None:
        chain, v, j = self._layout_chain(eqn.outvars[0])
        while j is not None and _adds_unit_axes(self.eqns[j]):  # a mean with keepdims=True: the sum's axes back
            chain.append(j)
            more, v, j = self._layout_chain(self.eqns[j].outvars[0])
            chain += more
        e = None if j is None else self.eqns[j]
        if e is not None and e.primitive.name in ("div", "mul") and len(e.invars) == 2:
            pos = 0 if e.invars[0] is v else 1
            if (e.invars[pos] is v and not is_varying(e.invars[1 - pos], self.varying)
                    and (e.primitive.name == "mul" or pos == 0)):
                assert j is not None
                self.units[j] = Unit("avg_pool", i, chain, [j])
                self.deferred.update([i, *chain])
                return
        self.units[i] = Unit("avg_pool", i)

    def _find_inlined_activations(self) -> None:
        tags = [_inlined_activation(eqn) for eqn in self.eqns]
        i = 0
        while i < len(self.eqns):
            if tags[i] is None:
                i += 1
                continue
            j = i
            while j + 1 < len(self.eqns) and tags[j + 1] == tags[i]:
                j += 1
            run = range(i, j + 1)
            defined = {v for k in run for v in self.eqns[k].outvars}
            ins = {a for k in run for a in self.eqns[k].invars if not is_literal(a) and a not in defined}
            dyn = [a for a in ins if a in self.varying]
            out = self.eqns[j].outvars[0]
            used_after = {v for v in defined if v in self.outs or any(u > j for u in self.users.get(v, []))}
            if (len(dyn) == 1 and used_after == {out} and len(self.eqns[j].outvars) == 1
                    and getattr(out.aval, "shape", None) == getattr(dyn[0].aval, "shape", None)):
                self.regions[j] = (i, dyn[0], str(tags[i]))
                self.deferred.update(range(i, j))
            i = j + 1


def _inlined_activation(eqn: JaxprEqn) -> str | None:
    tb = eqn.source_info.traceback
    frames: Sequence[Any] = tb.frames if tb is not None else ()
    for frame in frames:
        if (frame.function_name in _INLINED_ACTIVATIONS
                and frame.file_name.replace("\\", "/").endswith("jax/_src/nn/functions.py")):
            return str(frame.function_name)
    return None


def _is_activation(eqn: JaxprEqn, k: int) -> bool:
    if getattr(eqn.outvars[0].aval, "shape", None) != getattr(eqn.invars[k].aval, "shape", None):
        return False
    prim = eqn.primitive.name
    if prim in _ELEMENTWISE_ACTIVATIONS:
        return True
    if prim == "max":
        return len(eqn.invars) == 2 and literal_scalar(eqn.invars[1 - k]) is not None
    name = eqn_name(eqn)
    return name.startswith("fn:") and name[3:] in ACTIVATION_FUNCTIONS and len(eqn.invars) == 1


def _adds_unit_axes(eqn: JaxprEqn) -> bool:
    """``eqn`` is a ``broadcast_in_dim`` that only inserts axes of size 1 (a reshape: ``keepdims=True``)."""
    if eqn.primitive.name != "broadcast_in_dim" or len(eqn.invars) != 1:
        return False
    return int(np.prod(_shape(eqn.invars[0]))) == int(np.prod(_shape(eqn.outvars[0])))


def run_switch(eqn: JaxprEqn, invals: list[Any], run: Callable[[Any, Any, list[Any]], list[Any]]) -> list[Any]:
    """A ``cond`` equation rebuilt as ``lax.switch`` over its branches, each evaluated by ``run(jaxpr, consts,
    operands)`` (a runner that replaces the branch's layers or sites)."""
    def branch(closed: Any) -> Callable[..., list[Any]]:
        jx, cs = jaxpr_parts(closed)
        return lambda *ops: run(jx, cs, list(ops))

    return list(jax.lax.switch(invals[0], [branch(b) for b in cond_layout(eqn).branches], *invals[1:]))


def run_scan(eqn: JaxprEqn, invals: list[Any], flags: Sequence[bool],
             varying_outs: Callable[[Any, Sequence[bool]], list[bool]],
             run: Callable[..., list[Any]], *per_operand: Sequence[bool]) -> list[Any]:
    """A ``scan`` equation rebuilt as ``lax.scan`` with its body evaluated by ``run(jaxpr, consts, operands,
    body_flags, *per_operand)``.

    ``flags`` says which operands depend on the input; a carry that depends on it in one iteration does in
    the next (``varying_outs(body, flags)``, iterated to a fixed point). Each of ``per_operand`` (a flag per
    operand, e.g. "non-negative") is passed on with the carries' entries False: unknown after one iteration.
    """
    lay = scan_layout(eqn)
    jx, cs = jaxpr_parts(lay.body)
    nc, nk = lay.num_consts, lay.num_carry
    carry_flags = list(flags[nc:nc + nk])
    body_flags = [*flags[:nc], *carry_flags, *flags[nc + nk:]]
    for _ in range(nk + 1):
        new = [a or b for a, b in zip(carry_flags, varying_outs(jx, body_flags)[:nk])]
        if new == carry_flags:
            break
        carry_flags = new
        body_flags = [*flags[:nc], *carry_flags, *flags[nc + nk:]]
    masked = [[*o[:nc], *([False] * nk), *o[nc + nk:]] for o in per_operand]
    consts = invals[:nc]

    def body(carry: list[Any], xs: list[Any]) -> tuple[list[Any], list[Any]]:
        outs = run(jx, cs, [*consts, *carry, *xs], body_flags, *masked)
        return outs[:nk], outs[nk:]

    carry, ys = jax.lax.scan(body, list(invals[nc:nc + nk]), list(invals[nc + nk:]), length=lay.length,
                             reverse=lay.reverse, unroll=eqn.params.get("unroll", 1))
    return [*carry, *ys]


def region_apply(eqns: Sequence[JaxprEqn], x_var: Any, read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """The run of equations ``eqns`` (an inlined activation) as a function of its one varying input ``x_var``;
    its other operands are read now, with ``read``."""
    defined = {v for e in eqns for v in e.outvars}
    consts = {a: read(a) for e in eqns for a in e.invars if not is_literal(a) and a not in defined}

    def apply(xv: Any) -> Any:
        local = dict(consts)
        local[x_var] = xv
        for e in eqns:
            local.update(zip(e.outvars, bind(e, [read_atom(local, a) for a in e.invars])))
        return local[eqns[-1].outvars[0]]

    return apply
