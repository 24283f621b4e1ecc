"""The static plan of a model's program for LRP's gradient form: which equations take a rule, by dataflow.

Used by :mod:`~gradkit._src.compat.gform` (which runs the plan). Reads a
jaxpr's equations and shapes only, never values. A value is *varying* when it
depends on the attributed input (``stop_gradient`` cuts the dependence). The
plan finds, in order of precedence:

* **softmax**: a ``div`` of an ``exp`` by the broadcast ``reduce_sum`` of that
  same ``exp`` (``jax.nn.softmax``, which JAX inlines, or the same written
  out): it keeps its gradient, and its ``exp`` is no activation;
* **activation**: a maximal region of element-wise equations whose only
  varying input is one tensor ``x`` shaped like its output, whose
  intermediates are used only inside it, and which ends in a nonlinearity
  (``tanh``, ``logistic``, ``erf``, a product of two values of the region as
  in ``x * sigmoid(x)`` or GELU's ``x * cdf``, a ``jax.nn`` activation
  function by the name its ``jit``/``custom_jvp`` carries, ...). Regions that
  feed a reduction (``x²`` before a mean, the ``exp`` of a logsumexp) or
  start at a statistic are not activations;
* **normalizer**: a ``mul``/``div`` whose other varying operand is a
  *statistic* (computed from a reduction of varying values by element-wise
  ops and broadcasts only: RMSNorm's ``rsqrt(mean(x²) + eps)``, LayerNorm's
  ``1/√(var + eps)``), the divisor of a ``div``;
* **product**: a ``mul`` or ``dot_general`` of two varying floating operands
  (``q·kᵀ``, ``A·v``, ``act(g)·u``). Its operands that come out of a softmax
  or an activation (through layout ops and scalings by constants) are its
  *gates*. A fused attention kernel (``jax.nn.dot_product_attention``'s
  cuDNN ``custom_vjp``, opaque) is one product site of its q, k and v.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from gradkit._src.compat.jaxprs import JaxprEqn, eqn_name, is_custom_derivative, is_jit, is_literal, jaxpr_parts
from gradkit._src.compat.layer_scan import ACTIVATION_FUNCTIONS, is_varying

__all__ = ["GPlan", "Site"]

# Element-wise primitives a region may hold (operands other than the region's values are constants).
_ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "neg", "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc",
    "erf_inv", "sqrt", "rsqrt", "cbrt", "integer_pow", "pow", "square", "abs", "sign", "max", "min", "select_n",
    "convert_element_type", "copy", "copy_p", "sin", "cos", "tan", "atan", "atanh", "asinh", "sinh", "cosh",
    "clamp", "ge", "gt", "le", "lt", "eq", "ne", "floor", "ceil", "round", "reduce_precision",
})
# Element-wise primitives that are nonlinear in their one varying operand: a region may end at one.
_NONLINEAR = frozenset({
    "exp", "exp2", "log", "log1p", "expm1", "tanh", "logistic", "erf", "erfc", "erf_inv", "sqrt", "rsqrt", "cbrt",
    "pow", "square", "abs", "max", "min", "sin", "cos", "tan", "atan", "atanh", "asinh", "sinh", "cosh", "clamp",
})
_REDUCTIONS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "argmax", "argmin", "reduce_prod"})
# Ops a statistic stays a statistic through (besides element-wise ones).
_SPREAD = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy",
                     "copy_p", "transpose"})
# Ops a gate (a softmax's or an activation's output) stays a gate through, with constant other operands.
_CARRY_GATE = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "convert_element_type",
                         "copy", "copy_p", "slice", "dynamic_slice", "gather", "concatenate", "pad", "rev",
                         "reduce_precision", "optimization_barrier", "mul", "div", "select_n", "neg"})
#: ``custom_vjp`` functions that are a fused ``softmax(q·kᵀ)·v`` with q, k, v first (cuDNN's, in jax.nn).
FUSED_ATTENTION = frozenset({"_dot_product_attention"})
_CALLS = frozenset({"closed_call", "core_call", "checkpoint", "remat", "remat2"})
_PASS = frozenset({"convert_element_type", "copy", "copy_p", "reshape", "squeeze", "expand_dims", "transpose",
                   "reduce_precision"})


@dataclass
class Site:
    """Equations that take one rule: ``kind``, the equations (indices, the last one defines the output).

    ``inputs``: the region's input (activations), or the equation's operands
    (products, normalizers: ``eqns`` is one equation). ``gates``: per
    operand, whether it comes out of a softmax or an activation (products);
    ``normalizer``: which operand is the statistic (normalizers);
    ``fused``: a fused attention kernel ``softmax(q·kᵀ)·v`` whose first three
    operands are q, k and v.
    """

    kind: str
    eqns: list[int]
    inputs: list[Any]
    name: str = ""
    gates: tuple[bool, ...] = ()
    normalizer: int = -1
    fused: bool = False


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def _fits(shape: tuple[int, ...], out: tuple[int, ...]) -> bool:
    """``shape`` broadcasts to ``out`` as an element-wise operand does (a scalar, or size-1 axes)."""
    return not shape or (len(shape) == len(out) and all(n in (1, m) for n, m in zip(shape, out)))


def _is_float(atom: Any) -> bool:
    dtype = getattr(atom.aval, "dtype", None)
    return dtype is not None and bool(jnp.issubdtype(dtype, jnp.inexact))  # bfloat16 too (NumPy's is not)


def _activation_call(eqn: JaxprEqn) -> str | None:
    """The name of a ``jax.nn`` activation a ``jit``/``custom_jvp`` equation calls, else None."""
    if not (is_jit(eqn) or is_custom_derivative(eqn)) or len(eqn.outvars) != 1:
        return None
    name = eqn_name(eqn)
    return name[3:] if name.startswith("fn:") and name[3:] in ACTIVATION_FUNCTIONS else None


def stops_gradient(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name == "stop_gradient"


def _statistics(jaxpr: Any, varying: set[Any], stat_in: Sequence[bool]) -> set[Any]:
    """Varying values computed from a reduction by element-wise ops and broadcasts only (also out of a ``jit``)."""
    stat: set[Any] = {v for v, s in zip(jaxpr.invars, stat_in) if s}
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        dyn = [a for a in eqn.invars if is_varying(a, varying)]
        if not dyn or stops_gradient(eqn):
            continue
        if (is_jit(eqn) or prim in _CALLS) and len(eqn.outvars) >= 1:
            inner, _ = jaxpr_parts(eqn.params["jaxpr"])
            flags = [is_varying(a, varying) for a in eqn.invars]
            inner_varying = {v for v, f in zip(inner.invars, flags) if f}
            for e in inner.eqns:
                if not stops_gradient(e) and any(is_varying(a, inner_varying) for a in e.invars):
                    inner_varying.update(e.outvars)
            inner_stat = _statistics(inner, inner_varying, [not is_literal(a) and a in stat for a in eqn.invars])
            stat.update(v for v, a in zip(eqn.outvars, inner.outvars) if not is_literal(a) and a in inner_stat)
        elif len(eqn.outvars) != 1:
            continue
        elif prim in _REDUCTIONS or prim in ("psum", "pmean"):
            stat.add(eqn.outvars[0])
        elif (prim in _ELEMENTWISE or prim in _SPREAD) and all(a in stat for a in dyn):
            stat.add(eqn.outvars[0])
    return stat


class GPlan:
    """One jaxpr's gradient-form plan: its sites (by last equation), the equations deferred into them."""

    def __init__(self, jaxpr: Any, varying_in: Sequence[bool], gates_in: Sequence[bool] = (),
                 stats_in: Sequence[bool] = (), normalizing_out: Sequence[bool] = ()) -> None:
        self.eqns = list(jaxpr.eqns)
        self.varying: set[Any] = {v for v, d in zip(jaxpr.invars, varying_in) if d}
        self.producer: dict[Any, int] = {}
        self.users: dict[Any, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            if not stops_gradient(eqn) and any(is_varying(a, self.varying) for a in eqn.invars):
                self.varying.update(eqn.outvars)
            for v in eqn.outvars:
                self.producer[v] = i
            for a in eqn.invars:
                if not is_literal(a):
                    self.users.setdefault(a, []).append(i)
        self.outs = {a for a in jaxpr.outvars if not is_literal(a)}
        # outputs the caller (this is a jit body) uses as a statistic that normalizes a value
        self.normalizing = {a for a, n in zip(jaxpr.outvars, normalizing_out) if n and not is_literal(a)}
        self.sites: dict[int, Site] = {}
        self.deferred: set[int] = set()
        self.softmax: set[int] = set()  # the div (and exp) equations of softmaxes
        self.stat = _statistics(jaxpr, self.varying, stats_in)
        taken = self._find_softmax()
        self._find_regions(taken)
        self.gates: set[Any] = {v for v, g in zip(jaxpr.invars, gates_in) if g}
        for i, eqn in enumerate(self.eqns):
            if i in self.deferred:
                continue
            if i in self.sites:  # an activation region's output is a gate
                self.gates.add(eqn.outvars[0])
                continue
            if i in self.softmax and eqn.primitive.name == "div":
                self.gates.add(eqn.outvars[0])
                continue
            self._classify(i, eqn)
        self.out_gates = [not is_literal(a) and a in self.gates for a in jaxpr.outvars]

    # ------------------------------------------------------------------ helpers

    def _var(self, a: Any) -> bool:
        return is_varying(a, self.varying)

    def _back(self, v: Any, through: frozenset[str]) -> tuple[Any, int | None]:
        """Follow ``v`` back through single-operand ops in ``through``; the var reached and its producer."""
        j = self.producer.get(v)
        while j is not None and self.eqns[j].primitive.name in through and len(self.eqns[j].invars) == 1:
            v = self.eqns[j].invars[0]
            j = self.producer.get(v)
        return v, j

    def _find_softmax(self) -> set[int]:
        taken: set[int] = set()
        for i, eqn in enumerate(self.eqns):
            if eqn.primitive.name != "div" or not all(self._var(a) for a in eqn.invars):
                continue
            num, j = self._back(eqn.invars[0], _PASS)
            if j is None or self.eqns[j].primitive.name != "exp":
                continue
            den, k = self._back(eqn.invars[1], _PASS | {"broadcast_in_dim"})
            if k is None or self.eqns[k].primitive.name != "reduce_sum":
                continue
            src = self._unmask(self.eqns[k].invars[0])
            if src is num:
                self.softmax.update((i, j))
                taken.add(j)
        return taken

    def _unmask(self, v: Any) -> Any:
        """``v`` followed back through layout ops and masks (a ``select_n``/``where`` or a product with one
        varying operand): ``jax.nn.softmax(..., where=)`` sums the masked ``exp``."""
        while True:
            v, j = self._back(v, _PASS)
            if j is None:
                return v
            e = self.eqns[j]
            dyn = [a for a in e.invars if self._var(a)]
            masking = e.primitive.name in ("select_n", "mul") or (is_jit(e) and eqn_name(e) == "fn:_where")
            if not masking or len(dyn) != 1 or (e.primitive.name == "select_n" and e.invars[0] is dyn[0]):
                return v
            v = dyn[0]

    def feeds_statistic(self, v: Any) -> bool:
        """``v`` is reduced to a statistic that then normalizes or shifts a varying value (``x²`` before the
        mean of an RMSNorm, the ``exp`` of a logsumexp)."""
        todo, seen = [v], set()
        while todo:
            w = todo.pop()
            if w in self.normalizing:
                return True
            for u in self.users.get(w, []):
                e = self.eqns[u]
                if u in seen:
                    continue
                seen.add(u)
                if e.primitive.name in _REDUCTIONS or e.primitive.name in _PASS:
                    todo.extend(e.outvars)
                elif w in self.stat and e.primitive.name in _SPREAD | _ELEMENTWISE:
                    if any(self._var(a) and a not in self.stat for a in e.invars):
                        return True
                    todo.extend(e.outvars)
                elif w in self.stat and (is_jit(e) or e.primitive.name in _CALLS):
                    todo.extend(o for o in e.outvars if o in self.stat)
        return False

    # ------------------------------------------------------------------ activations

    def _region_op(self, i: int, shape: tuple[int, ...] | None) -> bool:
        eqn = self.eqns[i]
        if len(eqn.outvars) != 1 or (shape is not None and _shape(eqn.outvars[0]) != shape):
            return False
        if eqn.primitive.name in _ELEMENTWISE:
            return all(_shape(a) in ((), _shape(eqn.outvars[0])) for a in eqn.invars if self._var(a))
        name = _activation_call(eqn)
        dyn = [a for a in eqn.invars if self._var(a)]
        return name is not None and len(dyn) == 1 and _shape(dyn[0]) == _shape(eqn.outvars[0])

    def _nonlinear_end(self, i: int) -> bool:
        eqn = self.eqns[i]
        prim = eqn.primitive.name
        dyn = [k for k, a in enumerate(eqn.invars) if self._var(a)]
        if _activation_call(eqn) is not None:
            return True
        if prim in ("mul", "div"):
            return len(dyn) == 2 or (prim == "div" and dyn == [1])
        if prim == "integer_pow":
            return eqn.params.get("y") != 1
        if prim == "select_n":
            return 0 in dyn
        return prim in _NONLINEAR and bool(dyn)

    def _cone(self, end: int, stop: Any | None) -> tuple[list[int], set[Any]] | None:
        """The region equations back from ``end`` (stopping at var ``stop``), and the varying leaves reached."""
        shape = _shape(self.eqns[end].outvars[0])
        eqns: set[int] = set()
        leaves: set[Any] = set()
        todo = [end]
        while todo:
            i = todo.pop()
            if i in eqns:
                continue
            eqns.add(i)
            for a in self.eqns[i].invars:
                if not self._var(a):
                    continue
                j = self.producer.get(a)
                if a is stop or j is None or j in self.deferred or j in self.sites or j in self.softmax \
                        or not self._region_op(j, shape):
                    leaves.add(a)
                else:
                    todo.append(j)
        return sorted(eqns), leaves

    def _find_regions(self, taken: set[int]) -> None:
        for end in range(len(self.eqns) - 1, -1, -1):
            if end in taken or end in self.deferred or end in self.sites:
                continue
            eqn = self.eqns[end]
            if not eqn.outvars or not _is_float(eqn.outvars[0]) or not self._var(eqn.outvars[0]):
                continue
            if not self._region_op(end, None) or not self._nonlinear_end(end):
                continue
            found = self._cone(end, None)
            assert found is not None
            full, _ = found
            # the latest var every path back from ``end`` passes through: the region's input
            candidates = sorted({a for j in full for a in self.eqns[j].invars if self._var(a)},
                                key=lambda a: self.producer.get(a, -1), reverse=True)
            for x in candidates:
                if _shape(x) != _shape(eqn.outvars[0]) or not _is_float(x) or x in self.stat:
                    continue
                sub = self._cone(end, x)
                assert sub is not None
                eqns_, leaves = sub
                if leaves != {x}:
                    continue
                if not self._closed(eqns_, end) or not any(self._nonlinear_end(j) for j in eqns_):
                    break
                if self.feeds_statistic(eqn.outvars[0]):
                    break
                name = next((n for j in eqns_ if (n := _activation_call(self.eqns[j]))), "") or \
                    self.eqns[end].primitive.name
                self.sites[end] = Site("activation", eqns_, [x], name=name)
                self.deferred.update(j for j in eqns_ if j != end)
                break

    def _closed(self, eqns: list[int], end: int) -> bool:
        """The region's intermediates are used inside it only."""
        inside = set(eqns)
        for j in eqns:
            if j == end:
                continue
            for v in self.eqns[j].outvars:
                if v in self.outs or any(u not in inside for u in self.users.get(v, [])):
                    return False
        return True

    # ------------------------------------------------------------------ normalizers, products, gates

    def _classify(self, i: int, eqn: JaxprEqn) -> None:
        prim = eqn.primitive.name
        dyn = [k for k, a in enumerate(eqn.invars) if self._var(a) and _is_float(a)]
        if prim in ("mul", "div") and len(eqn.invars) == 2 and len(dyn) == 2 and i not in self.softmax:
            a, b = eqn.invars
            out = _shape(eqn.outvars[0])
            stats = [a in self.stat and _fits(_shape(a), out), b in self.stat and _fits(_shape(b), out)]
            if stats == [False, True] or (prim == "mul" and stats == [True, False]):
                k = stats.index(True)
                self.sites[i] = Site("normalizer", [i], [a, b], name=prim, normalizer=k)
                return
            if prim == "mul" and a is not b and not any(stats):
                self.sites[i] = Site("product", [i], [a, b], name=prim,
                                     gates=(a in self.gates, b in self.gates))
                return
        if prim == "dot_general" and len(dyn) == 2:
            a, b = eqn.invars
            self.sites[i] = Site("product", [i], [a, b], name=prim, gates=(a in self.gates, b in self.gates))
            return
        if (is_custom_derivative(eqn) and eqn_name(eqn)[3:] in FUSED_ATTENTION and len(eqn.invars) >= 3
                and all(self._var(a) and _is_float(a) for a in eqn.invars[:3])):
            self.sites[i] = Site("product", [i], list(eqn.invars), name=eqn_name(eqn), gates=(False,) * 3, fused=True)
            return
        if (is_jit(eqn) or prim in _CALLS) and any(self._var(a) for a in eqn.invars):
            inner, _ = jaxpr_parts(eqn.params["jaxpr"])
            sub = GPlan(inner, [self._var(a) for a in eqn.invars],
                        [not is_literal(a) and a in self.gates for a in eqn.invars])
            self.gates.update(v for v, g in zip(eqn.outvars, sub.out_gates) if g)
            return
        self._carry_gate(eqn)

    def _carry_gate(self, eqn: JaxprEqn) -> None:
        prim = eqn.primitive.name
        if prim not in _CARRY_GATE or len(eqn.outvars) != 1:
            return
        dyn = [k for k, a in enumerate(eqn.invars) if self._var(a)]
        if len(dyn) != 1 or eqn.invars[dyn[0]] not in self.gates:
            return
        if prim == "div" and dyn != [0]:
            return
        if prim == "select_n" and dyn == [0]:
            return
        if prim in ("pad", "dynamic_slice", "gather") and dyn != [0]:
            return
        self.gates.add(eqn.outvars[0])
