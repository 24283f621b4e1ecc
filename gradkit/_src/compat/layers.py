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
import jax.numpy as jnp
import numpy as np

from gradkit._src.compat.jaxprs import (
    JaxprEqn,
    Tracer,
    bind,
    eqn_name,
    is_jit,
    is_literal,
    jaxpr_parts,
    read_atom,
)
from gradkit._src.compat.layer_scan import (
    ACTIVATION_FUNCTIONS,
    LAYOUT,
    Plan,
    Unit,
    is_float,
    is_varying,
    literal_scalar,
    region_apply,
    run_scan,
    run_switch,
)
from gradkit._src.compat.source import call_site, source_line
from gradkit._src.errors import GradkitError

__all__ = ["ACTIVATION_FUNCTIONS", "LAYER_KINDS", "STRUCTURAL", "Layer", "run_layers"]

#: the kinds of layer :func:`run_layers` finds.
LAYER_KINDS = ("dense", "conv", "avg_pool", "max_pool", "activation", "sum")
#: ops that only move, copy or select values: on the relevance path they keep their gradient, which is right.
STRUCTURAL = frozenset({"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "slice",
                        "dynamic_slice", "gather", "concatenate", "pad", "convert_element_type", "copy", "copy_p",
                        "rev", "reduce_precision", "optimization_barrier", "sharding_constraint"})
_CALLS = frozenset({"checkpoint", "remat", "remat2", "closed_call", "core_call"})  # entered like jit
# Ops whose output is nonnegative when the operands named by _SIGN_OPERANDS (default: all) are.
_KEEPS_SIGN = LAYOUT | {"reduce_window_max", "reduce_window_sum", "broadcast_in_dim", "reduce_max", "reduce_sum",
                        "slice", "pad", "concatenate", "rev", "gather", "dynamic_slice", "select_n", "add", "mul",
                        "div", "max", "min"}
_SIGN_OPERANDS: dict[str, slice] = {"gather": slice(0, 1), "dynamic_slice": slice(0, 1), "select_n": slice(1, None)}
_NONNEGATIVE = frozenset({"abs", "exp", "logistic", "sqrt", "rsqrt", "square"})
_HINTS = {
    "add": "an add of a constant off a dense/conv layer has no rule",
    "sub": "a subtraction has no rule (a per-channel affine map right after a dense/conv layer is folded into it)",
    "mul": "a scaling by a constant off a dense/conv layer has no rule (right after one it is folded into it)",
    "div": "a division by a constant off a dense/conv layer has no rule (right after one it is folded into it)",
    "reduce_sum": "a sum or mean is the 'avg_pool' kind when its input has no other use",
}


@dataclass(frozen=True, eq=False)
class Layer:
    """One layer of the running program, as :func:`run_layers` hands it to its callback.

    ``apply(x, *params)`` computes the layer's output from an input ``x``
    shaped like its input and parameters shaped like :attr:`params`; for a
    dense or conv layer ``params`` is ``(weight,)`` or ``(weight, bias)`` and
    ``apply(x, w)`` (no bias argument) is the linear part alone; with a folded
    affine map (BatchNorm) these are the folded weight and bias. A ``"sum"``
    layer's input is its two operands stacked on a new last axis.
    """

    kind: str
    name: str
    index: int
    params: tuple[Any, ...]
    apply: Callable[..., Any] = field(repr=False)
    source: str | None = None
    nonnegative_input: bool = False


def _nonnegative_after(eqn: JaxprEqn, nn: list[bool]) -> bool:
    prim = eqn.primitive.name
    if eqn_name(eqn) in ("fn:relu", "fn:relu6") or prim in _NONNEGATIVE:
        return True
    if prim == "max":
        return any(nn)
    if prim in _KEEPS_SIGN:
        picked = nn[_SIGN_OPERANDS.get(prim, slice(None))]
        return bool(picked) and all(picked)
    return False


def _varying_outs(jaxpr: Any, flags: Sequence[bool]) -> list[bool]:
    varying = {v for v, d in zip(jaxpr.invars, flags) if d}
    for eqn in jaxpr.eqns:
        if any(is_varying(a, varying) for a in eqn.invars):
            varying.update(eqn.outvars)
    return [is_varying(a, varying) for a in jaxpr.outvars]



class _Runner:
    def __init__(self, handle: Callable[[Layer, Any], Any], canonize: bool,
                 unruled: list[tuple[str, str, str]] | None) -> None:
        self.handle = handle
        self.canonize = canonize
        self.unruled = unruled
        self.count = 0

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], varying: Sequence[bool],
            nonneg: Sequence[bool], batch: int | None = None) -> list[Any]:
        prog = Plan(jaxpr, varying, canonize=self.canonize, batch=batch)
        env: dict[Any, Any] = {}
        pos: set[Any] = set()
        constvars = set(jaxpr.constvars)
        checked: dict[Any, bool] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a, n in zip(jaxpr.invars, args, nonneg):
            env[v] = a
            if n:
                pos.add(v)
        read = lambda a: read_atom(env, a)

        def is_nonneg(a: Any) -> bool:
            if is_literal(a):
                val = np.asarray(a.val)
                return val.dtype != object and bool(np.all(val >= 0))
            if a in pos:
                return True
            if a in constvars and a not in checked:  # a concrete constant: look at it (once)
                val = env[a]
                checked[a] = (not isinstance(val, Tracer) and np.issubdtype(np.asarray(val).dtype, np.number)
                              and bool(np.all(np.asarray(val) >= 0)))
            return checked.get(a, False)

        for i, eqn in enumerate(prog.eqns):
            if i in prog.deferred:
                continue
            if i in prog.batch_stats:
                raise GradkitError(
                    f"attribution.lrp: the model computes statistics over the batch axis from the input "
                    f"(a {eqn.primitive.name} over axis 0 at {source_line(eqn)}): BatchNorm in training mode. "
                    f"LRP explains a model in eval mode: use nn.BatchNorm(use_running_average=True) (Flax linen), "
                    f"model.eval() or use_running_average=True (Flax NNX), eqx.nn.inference_mode(model) (Equinox).")
            nn = [is_nonneg(a) for a in eqn.invars]
            if i in prog.regions:
                env[eqn.outvars[0]] = self._region(prog, i, read, pos)
                continue
            if i in prog.units:
                out, nn_out = self._unit(prog, prog.units[i], read, is_nonneg)
                env[eqn.outvars[0]] = out
                if nn_out:
                    pos.add(eqn.outvars[0])
                continue
            if i in prog.sums:
                env[eqn.outvars[0]] = self._sum(eqn, [read(a) for a in eqn.invars], all(nn))
                if all(nn):
                    pos.add(eqn.outvars[0])
                continue
            if i in prog.activations:
                k = next(k for k, a in enumerate(eqn.invars) if is_varying(a, prog.varying))
                env[eqn.outvars[0]] = self._activation(eqn, k, [read(a) for a in eqn.invars], nn[k])
                if _nonnegative_after(eqn, nn):
                    pos.add(eqn.outvars[0])
                continue
            invals = [read(a) for a in eqn.invars]
            flags = [is_varying(a, prog.varying) for a in eqn.invars]
            prim = eqn.primitive.name
            if any(flags) and (is_jit(eqn) or prim in _CALLS):
                inner, inner_consts = jaxpr_parts(eqn.params["jaxpr"])
                with call_site(eqn):  # a library's jitted body has no user line: its caller's
                    outs = self.run(inner, inner_consts, invals, flags, nn, batch)
            elif any(flags[1:]) and prim == "cond":
                with call_site(eqn):
                    outs = self._cond(eqn, invals, flags, nn)
            elif any(flags) and prim == "scan":
                with call_site(eqn):
                    outs = self._scan(eqn, invals, flags, nn)
            else:
                if any(f and is_float(a) for f, a in zip(flags, eqn.invars)):
                    self._check_ruled(eqn)
                outs = bind(eqn, invals)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
            if len(eqn.outvars) == 1 and _nonnegative_after(eqn, nn):
                pos.add(eqn.outvars[0])
        return [read(a) for a in jaxpr.outvars]

    def _check_ruled(self, eqn: JaxprEqn) -> None:
        prim = eqn.primitive.name
        if self.unruled is None or not any(is_float(v) for v in eqn.outvars):
            return
        if prim in STRUCTURAL and not (prim == "pad" and literal_scalar(eqn.invars[1]) != 0.0):
            return
        name = eqn_name(eqn)
        hint = _HINTS.get(prim, "no layer kind covers it")
        if name.startswith("fn:"):
            hint = f"a function that is not one of the activations {sorted(ACTIVATION_FUNCTIONS)[:3]}..."
        self.unruled.append((name, source_line(eqn), hint))

    def _cond(self, eqn: JaxprEqn, invals: list[Any], flags: list[bool], nn: list[bool]) -> list[Any]:
        return run_switch(eqn, invals, lambda jx, cs, ops: self.run(jx, cs, ops, flags[1:], nn[1:]))

    def _scan(self, eqn: JaxprEqn, invals: list[Any], flags: list[bool], nn: list[bool]) -> list[Any]:
        return run_scan(eqn, invals, flags, _varying_outs, self.run, nn)

    def _layer(self, kind: str, eqn: JaxprEqn, params: tuple[Any, ...], apply: Callable[..., Any],
               nonneg: bool) -> Layer:
        layer = Layer(kind=kind, name=eqn_name(eqn), index=self.count, params=params, apply=apply,
                      source=source_line(eqn), nonnegative_input=nonneg)
        self.count += 1
        return layer

    def _sum(self, eqn: JaxprEqn, invals: list[Any], nonneg: bool) -> Any:
        shape = tuple(getattr(eqn.outvars[0].aval, "shape", ()))
        stacked = jnp.stack([jnp.broadcast_to(v, shape) for v in invals], axis=-1)

        def apply(sv: Any) -> Any:
            return bind(eqn, [sv[..., 0], sv[..., 1]])[0]

        return self.handle(self._layer("sum", eqn, (), apply, nonneg), stacked)

    def _unit(self, prog: Plan, u: Unit, read: Callable[[Any], Any],
              is_nonneg: Callable[[Any], bool]) -> tuple[Any, bool]:
        eqn = prog.eqns[u.head]
        k = next(k for k, a in enumerate(eqn.invars) if is_varying(a, prog.varying))
        x = read(eqn.invars[k])
        nonneg = is_nonneg(eqn.invars[k])
        chain_eqns = [prog.eqns[j] for j in u.chain]
        tail = [prog.eqns[j] for j in u.tail]
        if u.kind in ("dense", "conv"):
            return self._linear(u, eqn, k, x, nonneg, chain_eqns, tail, read), False
        if u.kind == "avg_pool" and tail:
            scale = tail[0]
            v = chain_eqns[-1].outvars[0] if chain_eqns else eqn.outvars[0]
            first = scale.invars[0] is v
            d_atom = scale.invars[1 if first else 0]

            def apply_pool(xv: Any, dv: Any) -> Any:
                (s,) = bind(eqn, [xv])
                for c in chain_eqns:
                    (s,) = bind(c, [s])
                return bind(scale, [s, dv] if first else [dv, s])[0]

            out = self.handle(self._layer(u.kind, eqn, (read(d_atom),), apply_pool, nonneg), x)
            return out, nonneg and is_nonneg(d_atom)

        def apply_one(xv: Any) -> Any:
            return bind(eqn, [xv])[0]

        return self.handle(self._layer(u.kind, eqn, (), apply_one, nonneg), x), nonneg

    def _linear(self, u: Unit, eqn: JaxprEqn, k: int, x: Any, nonneg: bool, chain_eqns: list[JaxprEqn],
                tail: list[JaxprEqn], read: Callable[[Any], Any]) -> Any:
        w = read(eqn.invars[1 - k])
        v = chain_eqns[-1].outvars[0] if chain_eqns else eqn.outvars[0]

        def linear(xv: Any, wv: Any) -> Any:
            (z,) = bind(eqn, [xv, wv] if k == 0 else [wv, xv])
            for c in chain_eqns:
                (z,) = bind(c, [z])
            return z

        if not u.folded:
            params: tuple[Any, ...] = (w,)
            bias_first = False
            if u.bias:
                bias_first = tail[0].invars[1] is v
                params = (w, read(tail[0].invars[0] if bias_first else tail[0].invars[1]))

            def apply(xv: Any, wv: Any, bv: Any = None) -> Any:
                z = linear(xv, wv)
                if bv is not None:
                    (z,) = bind(tail[0], [bv, z] if bias_first else [z, bv])
                return z

            return self.handle(self._layer(u.kind, eqn, params, apply, nonneg), x)
        w_f, b_f = self._fold(u, w, v, tail, read)

        def apply_folded(xv: Any, wv: Any, bv: Any = None) -> Any:
            z = linear(xv, wv)
            return z if bv is None else z + bv

        return self.handle(self._layer(u.kind, eqn, (w_f, b_f), apply_folded, nonneg), x)

    @staticmethod
    def _fold(u: Unit, w: Any, v: Any, tail: list[JaxprEqn], read: Callable[[Any], Any]) -> tuple[Any, Any]:
        """The weight and bias of the layer with its affine tail folded in: ``W' = W·s``, ``b' = A(b)``."""
        out: Any = tail[-1].outvars[0].aval
        s: Any = 1.0
        t: Any = 0.0
        ops = tail
        if u.bias:
            t = read(tail[0].invars[0] if tail[0].invars[1] is v else tail[0].invars[1])
            v, ops = tail[0].outvars[0], tail[1:]
        for e in ops:
            first = e.invars[0] is v
            c = read(e.invars[1 if first else 0])
            prim = e.primitive.name
            if prim == "add":
                t = t + c
            elif prim == "sub":
                s, t = (s, t - c) if first else (-s, c - t)
            elif prim == "mul":
                s, t = s * c, t * c
            else:  # div, by a constant (the plan checked)
                s, t = s / c, t / c
            v = e.outvars[0]
        nd = len(out.shape)
        w_axes, p_axes = u.channels
        s_full = jnp.broadcast_to(jnp.asarray(s, out.dtype), out.shape)
        t_full = jnp.broadcast_to(jnp.asarray(t, out.dtype), out.shape)
        s_ch = s_full[tuple(slice(None) if a in p_axes else 0 for a in range(nd))]
        order = sorted(p_axes)
        s_ch = jnp.transpose(s_ch, [order.index(p) for p in p_axes])
        w_shape = [w.shape[d] if d in w_axes else 1 for d in range(w.ndim)]
        w_f = w * s_ch.reshape(w_shape).astype(w.dtype)
        b_f = t_full[tuple(slice(None) if a in p_axes else slice(0, 1) for a in range(nd))]
        return w_f, b_f

    def _region(self, prog: Plan, last: int, read: Callable[[Any], Any], pos: set[Any]) -> Any:
        first, x_var, name = prog.regions[last]
        eqns = prog.eqns[first:last + 1]
        apply = region_apply(eqns, x_var, read)

        layer = Layer(kind="activation", name="fn:" + name, index=self.count, params=(), apply=apply,
                      source=source_line(eqns[0]), nonnegative_input=x_var in pos)
        self.count += 1
        return self.handle(layer, read(x_var))

    def _activation(self, eqn: JaxprEqn, k: int, invals: list[Any], nonneg: bool) -> Any:
        consts = list(invals)

        def apply(xv: Any) -> Any:
            vals = list(consts)
            vals[k] = xv
            return bind(eqn, vals)[0]

        return self.handle(self._layer("activation", eqn, (), apply, nonneg), invals[k])


def run_layers(fn: Callable[[Any], Any], x: Any, handle: Callable[[Layer, Any], Any], *, canonize: bool = True,
               unruled: list[tuple[str, str, str]] | None = None) -> tuple[Any, Any]:
    """Runs ``fn(x)`` with each layer computed by ``handle(layer, layer_input)`` instead.

    ``fn`` is traced once at ``x``'s type (``jax.make_jaxpr``); its program is
    then evaluated in the current trace (so under ``jit``, ``vmap``, ``vjp``)
    with every layer (see the module doc) handed to ``handle``, which must
    return what ``layer.apply(layer_input, *layer.params)`` returns (with any
    derivative it likes). Layers come in program order; ``layer.index``
    counts them. ``canonize`` folds per-channel affine maps into the layer
    before them; ``unruled``, when given, collects ``(op, source line, hint)``
    for each op on the input's path that is neither a layer nor structural.
    Returns ``(outputs as a flat list, output tree structure)``.
    """
    closed, shape = jax.make_jaxpr(fn, return_shape=True)(x)
    jaxpr, consts = jaxpr_parts(closed)
    batch = x.shape[0] if np.ndim(x) >= 2 else None
    outs = _Runner(handle, canonize, unruled).run(jaxpr, consts, [x], [True], [False], batch)
    return outs, jax.tree_util.tree_structure(shape)
