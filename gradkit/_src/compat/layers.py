"""A model's layers, found by dataflow in its traced program, and the program run with each layer replaced.

Used by LRP (``gk.attribution.lrp``), which needs a whole layer as one unit:
a ``dot_general`` or ``conv_general_dilated`` whose other operand does not
depend on the attributed input (the weight), followed — through layout ops
(``transpose``, ``reshape``, …) each used once — by an ``add`` of a value that
does not depend on it either (the bias). Nothing is named: the same dataflow
finds the layers of plain JAX, Flax linen and Equinox models.

Kinds (:attr:`Layer.kind`):

* ``"dense"``: a ``dot_general`` (``x @ W``, ``W @ x``, ``jnp.einsum``) and its bias add;
* ``"conv"``: a ``conv_general_dilated`` and its bias add;
* ``"avg_pool"``: a ``reduce_window_sum`` and its division (or product) by a
  constant (Flax's ``avg_pool``, ``reduce_window(add) / n``);
* ``"max_pool"``: a ``reduce_window_max``;
* ``"activation"``: an element-wise nonlinearity: a ``jax.nn`` activation
  function (``relu``, ``silu``, …, by the name its ``custom_jvp``/``jit``
  carries; ``gelu``, which JAX inlines, as the run of equations its
  ``jax.nn`` function made), ``tanh``, ``logistic``, or ``max(x, c)`` with a
  literal ``c``.

``jit`` calls that are not activations are entered (a layer inside a jitted
helper is found); other higher-order primitives (``scan``, ``cond``,
``custom_vjp`` functions) run as they are, their insides unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from gradkit._src.compat.jaxprs import (
    JaxprEqn,
    bind,
    eqn_name,
    is_jit,
    is_literal,
    jaxpr_parts,
    read_atom,
)
from gradkit._src.compat.source import source_line

__all__ = ["ACTIVATION_FUNCTIONS", "LAYER_KINDS", "Layer", "run_layers"]

#: the kinds of layer :func:`run_layers` finds.
LAYER_KINDS = ("dense", "conv", "avg_pool", "max_pool", "activation")

#: ``jax.nn`` functions (by the name their ``custom_jvp`` / ``jit`` equation carries) that are activations.
ACTIVATION_FUNCTIONS = frozenset({
    "relu", "relu6", "gelu", "silu", "swish", "elu", "celu", "selu", "leaky_relu", "softplus", "sigmoid",
    "hard_tanh", "hard_sigmoid", "hard_silu", "hard_swish", "soft_sign", "mish", "squareplus", "sparse_plus",
    "tanh", "log_sigmoid",
})
#: ``jax.nn`` activations JAX inlines (no ``jit`` or ``custom_jvp`` names them): the run of equations made inside
#: the function (by their traceback) is one activation.
_INLINED_ACTIVATIONS = frozenset({"gelu"})
_LINEAR = {"dot_general": "dense", "conv_general_dilated": "conv"}
_LAYOUT = frozenset({"transpose", "reshape", "squeeze", "expand_dims", "convert_element_type", "copy", "copy_p"})
_ELEMENTWISE_ACTIVATIONS = frozenset({"tanh", "logistic"})
# Ops whose output is nonnegative when their (one varying) input is.
_KEEPS_SIGN = _LAYOUT | {"reduce_window_max", "reduce_window_sum", "broadcast_in_dim", "reduce_max", "reduce_sum",
                         "slice", "pad", "concatenate", "rev", "gather", "dynamic_slice"}


@dataclass(frozen=True, eq=False)
class Layer:
    """One layer of the running program, as :func:`run_layers` hands it to its callback.

    ``apply(x, *params)`` computes the layer's output from an input ``x``
    shaped like its input and parameters shaped like :attr:`params`; for a
    dense or conv layer ``params`` is ``(weight,)`` or ``(weight, bias)`` and
    ``apply(x, w)`` (no bias argument) is the linear part alone.
    """

    kind: str
    name: str
    index: int
    params: tuple[Any, ...]
    apply: Callable[..., Any] = field(repr=False)
    source: str | None = None
    nonnegative_input: bool = False


def _is_varying(atom: Any, varying: set[Any]) -> bool:
    return not is_literal(atom) and atom in varying


def _literal_scalar(atom: Any) -> float | None:
    if not is_literal(atom):
        return None
    val = np.asarray(atom.val)
    numeric = np.issubdtype(val.dtype, np.floating) or np.issubdtype(val.dtype, np.integer)
    return float(val) if val.shape == () and numeric else None


class _Program:
    """One jaxpr's static plan: which equations form a layer unit, which are deferred into one."""

    def __init__(self, jaxpr: Any, varying_in: Sequence[bool]) -> None:
        self.jaxpr = jaxpr
        self.eqns = list(jaxpr.eqns)
        self.varying: set[Any] = {v for v, d in zip(jaxpr.invars, varying_in) if d}
        users: dict[Any, list[int]] = {}
        for i, eqn in enumerate(self.eqns):
            if any(_is_varying(a, self.varying) for a in eqn.invars):
                self.varying.update(eqn.outvars)
            for a in eqn.invars:
                if not is_literal(a):
                    users.setdefault(a, []).append(i)
        outs = {a for a in jaxpr.outvars if not is_literal(a)}
        self.units: dict[int, tuple[str, int, list[int], int | None]] = {}  # last eqn -> (kind, head, chain, add)
        self.deferred: set[int] = set()
        self.activations: set[int] = set()
        self.regions: dict[int, tuple[int, Any, str]] = {}  # last eqn -> (first eqn, input, name): inlined activations
        self._find_inlined_activations(users, outs)

        in_region = {k for last, (first, _, _) in self.regions.items() for k in range(first, last + 1)}

        def only_user(v: Any) -> int | None:  # a layer unit does not reach into an inlined activation
            u = users.get(v, [])
            return u[0] if len(u) == 1 and v not in outs and u[0] not in in_region else None

        for i, eqn in enumerate(self.eqns):
            if i in self.deferred or i in self.regions:
                continue
            prim = eqn.primitive.name
            dyn = [k for k, a in enumerate(eqn.invars) if _is_varying(a, self.varying)]
            if prim in _LINEAR and len(dyn) == 1 and len(eqn.invars) == 2:
                chain: list[int] = []
                v = eqn.outvars[0]
                j = only_user(v)
                add = None
                while j is not None:
                    e = self.eqns[j]
                    if e.primitive.name in _LAYOUT and len(e.invars) == 1:
                        chain.append(j)
                        v = e.outvars[0]
                        j = only_user(v)
                        continue
                    if e.primitive.name == "add" and len(e.invars) == 2:
                        other = e.invars[1] if e.invars[0] is v else e.invars[0]
                        if not _is_varying(other, self.varying) and e.invars[0] is not e.invars[1]:
                            add = j
                    break
                if add is None:
                    chain = []
                    self.units[i] = (_LINEAR[prim], i, [], None)
                else:
                    self.units[add] = (_LINEAR[prim], i, chain, add)
                    self.deferred.update([i, *chain])
            elif prim == "reduce_window_sum" and dyn == [0]:
                chain = []  # layout ops between the sum and its division (Equinox's AvgPool2d: squeeze, transpose)
                v = eqn.outvars[0]
                j = only_user(v)
                while j is not None and self.eqns[j].primitive.name in _LAYOUT and len(self.eqns[j].invars) == 1:
                    chain.append(j)
                    v = self.eqns[j].outvars[0]
                    j = only_user(v)
                e = None if j is None else self.eqns[j]
                if (e is not None and e.primitive.name in ("div", "mul") and e.invars[0] is v
                        and not _is_varying(e.invars[1], self.varying)):
                    assert j is not None
                    self.units[j] = ("avg_pool", i, chain, j)
                    self.deferred.update([i, *chain])
                else:
                    self.units[i] = ("avg_pool", i, [], None)
            elif prim == "reduce_window_max" and dyn == [0]:
                self.units[i] = ("max_pool", i, [], None)
            elif len(dyn) == 1 and len(eqn.outvars) == 1 and _is_activation(eqn, dyn[0]):
                self.activations.add(i)


    def _find_inlined_activations(self, users: dict[Any, list[int]], outs: set[Any]) -> None:
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
            used_after = {v for v in defined if v in outs or any(u > j for u in users.get(v, []))}
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
        return len(eqn.invars) == 2 and _literal_scalar(eqn.invars[1 - k]) is not None
    name = eqn_name(eqn)
    return name.startswith("fn:") and name[3:] in ACTIVATION_FUNCTIONS and len(eqn.invars) == 1


def _nonnegative_after(eqn: JaxprEqn, ins_nonneg: list[bool], varying: set[Any]) -> bool:
    prim = eqn.primitive.name
    name = eqn_name(eqn)
    if name in ("fn:relu", "fn:relu6") or prim == "abs":
        return True
    if prim == "max":
        return any((c := _literal_scalar(a)) is not None and c >= 0 for a in eqn.invars)
    dyn = [k for k, a in enumerate(eqn.invars) if _is_varying(a, varying)]
    if not dyn or not all(ins_nonneg[k] for k in dyn):
        return False
    if prim in _KEEPS_SIGN:
        return True
    if prim in ("div", "mul"):
        return all(ins_nonneg[k] or ((c := _literal_scalar(a)) is not None and c > 0)
                   for k, a in enumerate(eqn.invars))
    return False


class _Runner:
    def __init__(self, handle: Callable[[Layer, Any], Any]) -> None:
        self.handle = handle
        self.count = 0

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], varying: Sequence[bool],
            nonneg: Sequence[bool]) -> list[Any]:
        prog = _Program(jaxpr, varying)
        env: dict[Any, Any] = {}
        pos: set[Any] = set()
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a, n in zip(jaxpr.invars, args, nonneg):
            env[v] = a
            if n:
                pos.add(v)
        read = lambda a: read_atom(env, a)
        for i, eqn in enumerate(prog.eqns):
            if i in prog.deferred:
                continue
            ins_nonneg = [not is_literal(a) and a in pos for a in eqn.invars]
            if i in prog.regions:
                env[eqn.outvars[0]] = self._region(prog, i, read, pos)
                continue
            if i in prog.units:
                kind, head, chain, last = prog.units[i]
                out, nn = self._unit(prog, kind, head, chain, last, read, pos)
                env[eqn.outvars[0]] = out
                if nn:
                    pos.add(eqn.outvars[0])
                continue
            if i in prog.activations:
                k = next(k for k, a in enumerate(eqn.invars) if _is_varying(a, prog.varying))
                out = self._activation(eqn, k, [read(a) for a in eqn.invars], ins_nonneg[k])
                env[eqn.outvars[0]] = out
                if _nonnegative_after(eqn, ins_nonneg, prog.varying):
                    pos.add(eqn.outvars[0])
                continue
            invals = [read(a) for a in eqn.invars]
            if is_jit(eqn) and any(_is_varying(a, prog.varying) for a in eqn.invars):
                inner, inner_consts = jaxpr_parts(eqn.params["jaxpr"])
                outs = self.run(inner, inner_consts, invals, [_is_varying(a, prog.varying) for a in eqn.invars],
                                ins_nonneg)
            else:
                outs = bind(eqn, invals)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
            if len(eqn.outvars) == 1 and _nonnegative_after(eqn, ins_nonneg, prog.varying):
                pos.add(eqn.outvars[0])
        return [read(a) for a in jaxpr.outvars]

    def _layer(self, kind: str, eqn: JaxprEqn, params: tuple[Any, ...], apply: Callable[..., Any],
               nonneg: bool) -> Layer:
        layer = Layer(kind=kind, name=eqn_name(eqn), index=self.count, params=params, apply=apply,
                      source=source_line(eqn), nonnegative_input=nonneg)
        self.count += 1
        return layer

    def _unit(self, prog: _Program, kind: str, head: int, chain: list[int], last: int | None,
              read: Callable[[Any], Any], pos: set[Any]) -> tuple[Any, bool]:
        eqn = prog.eqns[head]
        k = next(k for k, a in enumerate(eqn.invars) if _is_varying(a, prog.varying))
        x = read(eqn.invars[k])
        nonneg = not is_literal(eqn.invars[k]) and eqn.invars[k] in pos
        chain_eqns = [prog.eqns[j] for j in chain]
        tail = None if last is None else prog.eqns[last]
        if kind in ("dense", "conv"):
            w = read(eqn.invars[1 - k])
            params: tuple[Any, ...] = (w,)
            src = eqn.outvars[0] if not chain_eqns else chain_eqns[-1].outvars[0]
            bias_first = False
            if tail is not None:
                bias_first = tail.invars[1] is src
                params = (w, read(tail.invars[0] if bias_first else tail.invars[1]))

            def apply(xv: Any, wv: Any, bv: Any = None) -> Any:
                (z,) = bind(eqn, [xv, wv] if k == 0 else [wv, xv])
                for c in chain_eqns:
                    (z,) = bind(c, [z])
                if bv is not None:
                    assert tail is not None
                    (z,) = bind(tail, [bv, z] if bias_first else [z, bv])
                return z

            layer = self._layer(kind, eqn, params, apply, nonneg)
            return self.handle(layer, x), False
        if kind == "avg_pool" and tail is not None:
            d = read(tail.invars[1])

            def apply_pool(xv: Any, dv: Any) -> Any:
                (s,) = bind(eqn, [xv])
                for c in chain_eqns:
                    (s,) = bind(c, [s])
                return bind(tail, [s, dv])[0]

            c = _literal_scalar(tail.invars[1])
            positive = c is not None and c > 0
            return self.handle(self._layer(kind, eqn, (d,), apply_pool, nonneg), x), nonneg and positive

        def apply_one(xv: Any) -> Any:
            return bind(eqn, [xv])[0]

        return self.handle(self._layer(kind, eqn, (), apply_one, nonneg), x), nonneg

    def _region(self, prog: _Program, last: int, read: Callable[[Any], Any], pos: set[Any]) -> Any:
        first, x_var, name = prog.regions[last]
        eqns = prog.eqns[first:last + 1]
        defined = {v for e in eqns for v in e.outvars}
        consts = {a: read(a) for e in eqns for a in e.invars if not is_literal(a) and a not in defined}

        def apply(xv: Any) -> Any:
            local = dict(consts)
            local[x_var] = xv
            for e in eqns:
                local.update(zip(e.outvars, bind(e, [read_atom(local, a) for a in e.invars])))
            return local[eqns[-1].outvars[0]]

        layer = Layer(kind="activation", name="fn:" + name, index=self.count, params=(), apply=apply,
                      source=source_line(eqns[0]), nonnegative_input=x_var in pos)
        self.count += 1
        return self.handle(layer, consts[x_var])

    def _activation(self, eqn: JaxprEqn, k: int, invals: list[Any], nonneg: bool) -> Any:
        consts = list(invals)

        def apply(xv: Any) -> Any:
            vals = list(consts)
            vals[k] = xv
            return bind(eqn, vals)[0]

        return self.handle(self._layer("activation", eqn, (), apply, nonneg), invals[k])


def run_layers(fn: Callable[[Any], Any], x: Any, handle: Callable[[Layer, Any], Any]) -> tuple[Any, Any]:
    """Runs ``fn(x)`` with each layer computed by ``handle(layer, layer_input)`` instead.

    ``fn`` is traced once at ``x``'s type (``jax.make_jaxpr``); its program is
    then evaluated in the current trace (so under ``jit``, ``vmap``, ``vjp``)
    with every layer (see the module doc) handed to ``handle``, which must
    return what ``layer.apply(layer_input, *layer.params)`` returns (with any
    derivative it likes). Layers come in program order; ``layer.index``
    counts them. Returns ``(outputs as a flat list, output tree structure)``.
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(x)
    jaxpr, consts = jaxpr_parts(closed)
    outs = _Runner(handle).run(jaxpr, consts, [x], [True], [False])
    return outs, jax.tree_util.tree_structure(shape)
