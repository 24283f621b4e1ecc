"""Step-by-step replay of a reverse-mode gradient, watching for non-finite values.

The forward program (a jaxpr) is evaluated equation by equation with concrete
values; the backward pass then walks the equations in reverse and applies each
one's own VJP (``jax.vjp`` of that single equation). Control flow is unrolled
with concrete values: a ``scan`` body runs once per iteration (forward and
backward), ``cond`` runs its taken branch, ``jit``/``checkpoint`` bodies are
entered. ``custom_jvp``/``custom_vjp`` functions (gradkit's rules among them)
are applied whole: their own rule is the derivative.

As JAX's autodiff does, only values that depend on the differentiated inputs
carry cotangents, and ops with a zero derivative (``stop_gradient``, ``sign``,
``round``…) stop them, so the replay does the same arithmetic as ``jax.grad``.

A *birth* is an equation whose inputs hold no NaN (and no inf, for an inf
birth) but whose output does. Every non-finite value carries the set of births
it came from, so the gradient's non-finite entries lead back to the equations
where they were born.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import compat

# Ops whose derivative is zero: JAX gives them symbolic-zero tangents, so
# nothing upstream of them is differentiated through them.
ZERO_DERIVATIVE = frozenset({
    "stop_gradient", "floor", "ceil", "round", "sign", "nextafter", "is_finite", "argmax", "argmin",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "iota", "population_count", "clz",
})
CALL_PRIMITIVES = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2"})



@dataclasses.dataclass
class Context:
    """Where an equation runs: inside a scan iteration, a cond branch, a jit function."""

    kind: str  # "scan" | "while" | "cond" | "jit"
    eqn: Any
    index: int = 0  # scan: data index of the iteration; cond: branch taken
    size: int = 0  # scan: length; cond: number of branches
    name: str = ""

    def static(self) -> tuple[Any, ...]:
        return (self.kind, id(self.eqn), self.index if self.kind == "cond" else None)


@dataclasses.dataclass
class Birth:
    """Where a non-finite value first appeared (aggregated over scan iterations)."""

    key: int
    eqn: Any
    phase: str  # "forward" | "backward"
    kind: str  # "nan" | "inf"
    ctx: tuple[Context, ...]
    causes: frozenset[int]
    invals: list[Any]
    outvals: list[Any]
    out_cts: list[Any] | None = None
    in_cts: list[Any] | None = None
    dyn: tuple[int, ...] = ()
    iterations: list[int] = dataclasses.field(default_factory=list)
    count: int = 0  # non-finite elements at the first occurrence
    total: int = 0

    @property
    def name(self) -> str:
        """The op's table name (a gradkit rule's wrapper reports the op it overrides)."""
        from gradkit._src.dispatch import op_name

        return compat.rule_target(self.eqn) or op_name(self.eqn)

    @property
    def is_rule(self) -> bool:
        """The equation is a gradkit rule applied by a table (its backward is the rule)."""
        return compat.rule_target(self.eqn) is not None


@dataclasses.dataclass
class Frame:
    """Forward values of one jaxpr evaluation, kept for the backward pass."""

    jaxpr: Any
    env: dict[Any, Any]
    taint: dict[Any, frozenset[int]]
    active: dict[Any, bool]
    ctx: tuple[Context, ...]
    subs: dict[int, Any] = dataclasses.field(default_factory=dict)


class ReplayError(Exception):
    """The replay met something it cannot evaluate step by step."""


# --------------------------------------------------------------------------- helpers


def nonfinite(x: Any) -> tuple[bool, bool]:
    """(has NaN, has ±inf) for an inexact array; (False, False) otherwise."""
    if x is None:
        return False, False
    a = np.asarray(x)
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        return False, False
    if a.dtype.itemsize < 4 or a.dtype.kind == "V":
        a = a.astype(np.float32)
    return bool(np.isnan(a).any()), bool(np.isinf(a).any())


def is_float_aval(aval: Any) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _zeros_ct(aval: Any) -> Any:
    if is_float_aval(aval):
        return jnp.zeros(aval.shape, aval.dtype)
    return compat.float0_zeros(tuple(aval.shape))


def _add(a: Any, b: Any) -> Any:
    return b if a is None else a + b


def _sub_jaxpr(eqn: Any) -> tuple[Any, tuple[Any, ...]]:
    p = eqn.params
    sub = p.get("jaxpr", None) or p.get("call_jaxpr", None)
    if isinstance(sub, compat.ClosedJaxpr):
        return sub.jaxpr, tuple(sub.consts)
    return sub, ()


def _closed(j: Any) -> tuple[Any, tuple[Any, ...]]:
    return (j.jaxpr, tuple(j.consts)) if isinstance(j, compat.ClosedJaxpr) else (j, ())


# --------------------------------------------------------------------------- activity (static)


def active_outs(eqn: Any, act_in: Sequence[bool]) -> list[bool]:
    """Which outputs of ``eqn`` depend differentiably on active inputs (as JAX's JVP decides)."""
    name = eqn.primitive.name
    floats = [is_float_aval(v.aval) for v in eqn.outvars]
    if not any(act_in) or name in ZERO_DERIVATIVE:
        return [False] * len(eqn.outvars)
    if name == "scan":
        return _scan_active(eqn, act_in)[1]
    if name == "cond":
        outs = [False] * len(eqn.outvars)
        for br in eqn.params["branches"]:
            j, _ = _closed(br)
            outs = [a or b for a, b in zip(outs, active_jaxpr(j, list(act_in[1:])))]
        return [a and f for a, f in zip(outs, floats)]
    if name == "while":
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        body, _ = _closed(p["body_jaxpr"])
        consts = list(act_in[nc:nc + nb])
        carry = list(act_in[nc + nb:])
        while True:
            new = [a or b for a, b in zip(carry, active_jaxpr(body, consts + carry))]
            if new == carry:
                break
            carry = new
        return [a and f for a, f in zip(carry, floats)]
    if name in CALL_PRIMITIVES and not compat.is_custom_derivative(eqn):
        j, _ = _sub_jaxpr(eqn)
        if j is not None:
            return [a and f for a, f in zip(active_jaxpr(j, list(act_in)), floats)]
    return floats


def _scan_active(eqn: Any, act_in: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """(body input activity at the fixpoint, scan output activity)."""
    p = eqn.params
    body, _ = _closed(p["jaxpr"])
    nc, nk = p["num_consts"], p["num_carry"]
    consts, carry, xs = list(act_in[:nc]), list(act_in[nc:nc + nk]), list(act_in[nc + nk:])
    while True:
        out = active_jaxpr(body, consts + carry + xs)
        new = [a or b for a, b in zip(carry, out[:nk])]
        if new == carry:
            break
        carry = new
    floats = [is_float_aval(v.aval) for v in eqn.outvars]
    outs = [a and f for a, f in zip(carry + out[nk:], floats)]
    return consts + carry + xs, outs


def active_jaxpr(jaxpr: Any, act_in: Sequence[bool]) -> list[bool]:
    act: dict[Any, bool] = {v: a for v, a in zip(jaxpr.invars, act_in)}
    for eqn in jaxpr.eqns:
        ins = [False if compat.is_literal(a) else act.get(a, False) for a in eqn.invars]
        for v, a in zip(eqn.outvars, active_outs(eqn, ins)):
            act[v] = a
    return [False if compat.is_literal(a) else act.get(a, False) for a in jaxpr.outvars]


# --------------------------------------------------------------------------- replay


class Replay:
    """Forward then backward, equation by equation; collects :class:`Birth` records."""

    def __init__(self, max_births: int = 200, max_while: int = 1000) -> None:
        self.births: dict[tuple[Any, ...], Birth] = {}
        self.max_births = max_births
        self.max_while = max_while
        self.steps = 0

    # ------------------------------------------------------------------ births

    def _record(self, eqn: Any, phase: str, kind: str, ctx: tuple[Context, ...], causes: frozenset[int],
                invals: list[Any], outvals: list[Any], count: int, total: int, **extra: Any) -> int:
        key = (id(eqn), phase, tuple(c.static() for c in ctx))
        it = next((c.index for c in reversed(ctx) if c.kind in ("scan", "while")), None)
        b = self.births.get(key)
        if b is None:
            if len(self.births) >= self.max_births:
                return -1
            b = Birth(len(self.births), eqn, phase, kind, ctx, causes, list(invals), list(outvals),
                      count=count, total=total, **extra)
            self.births[key] = b
        if it is not None and it not in b.iterations:
            b.iterations.append(it)
        return b.key

    # ------------------------------------------------------------------ forward

    def forward(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], active: Sequence[bool],
                taints: Sequence[frozenset[int]] | None = None, ctx: tuple[Context, ...] = ()) -> Frame:
        frame = Frame(jaxpr, {}, {}, {}, ctx)
        for v, x in zip(jaxpr.constvars, consts):
            frame.env[v], frame.active[v], frame.taint[v] = x, False, frozenset()
        taints = taints or [frozenset()] * len(args)
        for v, x, a, t in zip(jaxpr.invars, args, active, taints):
            frame.env[v], frame.active[v], frame.taint[v] = x, a, t
        for idx, eqn in enumerate(jaxpr.eqns):
            self.steps += 1
            invals = [compat.read_atom(frame.env, a) for a in eqn.invars]
            act_in = [False if compat.is_literal(a) else frame.active.get(a, False) for a in eqn.invars]
            t_in = [frozenset() if compat.is_literal(a) else frame.taint.get(a, frozenset()) for a in eqn.invars]
            outs, t_out = self._forward_eqn(frame, idx, eqn, invals, act_in, t_in)
            act_out = active_outs(eqn, act_in)
            for v, x, a, t in zip(eqn.outvars, outs, act_out, t_out):
                frame.env[v], frame.active[v], frame.taint[v] = x, a, t
        return frame

    def _forward_eqn(self, frame: Frame, idx: int, eqn: Any, invals: list[Any], act_in: list[bool],
                     t_in: list[frozenset[int]]) -> tuple[list[Any], list[frozenset[int]]]:
        name = eqn.primitive.name
        ctx = frame.ctx
        if name == "scan":
            return self._forward_scan(frame, idx, eqn, invals, act_in, t_in)
        if name == "cond":
            branches = eqn.params["branches"]
            k = int(np.clip(int(np.asarray(invals[0])), 0, len(branches) - 1))
            j, consts = _closed(branches[k])
            sub = self.forward(j, consts, invals[1:], act_in[1:], t_in[1:],
                               ctx + (Context("cond", eqn, k, len(branches)),))
            frame.subs[idx] = (k, sub)
            return self._outs(sub), self._out_taints(sub)
        if name == "while":
            return self._forward_while(frame, eqn, invals, t_in)
        if name in CALL_PRIMITIVES and not compat.is_custom_derivative(eqn):
            j, consts = _sub_jaxpr(eqn)
            if j is not None:
                label = _jit_label(eqn)
                c = ctx + ((Context("jit", eqn, name=label),) if label else ())
                sub = self.forward(j, consts, invals, act_in, t_in, c)
                frame.subs[idx] = sub
                return self._outs(sub), self._out_taints(sub)
        with compat.source_of(eqn):
            outs = compat.bind(eqn, invals)
        return outs, self._check_forward(eqn, ctx, invals, outs, t_in)

    @staticmethod
    def _outs(sub: Frame) -> list[Any]:
        return [compat.read_atom(sub.env, a) for a in sub.jaxpr.outvars]

    @staticmethod
    def _out_taints(sub: Frame) -> list[frozenset[int]]:
        return [frozenset() if compat.is_literal(a) else sub.taint.get(a, frozenset()) for a in sub.jaxpr.outvars]

    def _check_forward(self, eqn: Any, ctx: tuple[Context, ...], invals: list[Any], outs: list[Any],
                       t_in: list[frozenset[int]]) -> list[frozenset[int]]:
        flags_out = [nonfinite(o) for o in outs]
        if not any(n or i for n, i in flags_out):
            return [frozenset()] * len(outs)
        flags_in = [nonfinite(x) for x in invals]
        in_nan = any(n for n, _ in flags_in)
        in_nf = any(n or i for n, i in flags_in)
        out_nan = any(n for n, _ in flags_out)
        causes = frozenset().union(*[t for t, (n, i) in zip(t_in, flags_in) if n or i])
        kind = "nan" if out_nan and not in_nan else ("inf" if not in_nf else None)
        taint = causes
        if kind is not None:
            bad = [np.asarray(o) for o, (n, i) in zip(outs, flags_out) if n or i][0]
            count = _count_bad(bad, kind)
            key = self._record(eqn, "forward", kind, ctx, causes, invals, outs, count, int(bad.size))
            if key >= 0:
                taint = causes | {key}
        return [taint if (n or i) else frozenset() for n, i in flags_out]

    def _forward_scan(self, frame: Frame, idx: int, eqn: Any, invals: list[Any], act_in: list[bool],
                      t_in: list[frozenset[int]]) -> tuple[list[Any], list[frozenset[int]]]:
        p = eqn.params
        body, bconsts = _closed(p["jaxpr"])
        nc, nk, length, reverse = p["num_consts"], p["num_carry"], p["length"], p["reverse"]
        body_act, _ = _scan_active(eqn, act_in)
        consts, carry, xs = invals[:nc], list(invals[nc:nc + nk]), invals[nc + nk:]
        t_consts, t_carry, t_xs = t_in[:nc], list(t_in[nc:nc + nk]), t_in[nc + nk:]
        frames: list[Frame | None] = [None] * length
        ys: list[list[Any]] = [None] * length  # type: ignore[list-item]
        t_ys: list[frozenset[int]] = []
        for step in range(length):
            i = length - 1 - step if reverse else step
            x_i = [x[i] for x in xs]
            sub = self.forward(body, bconsts, list(consts) + carry + x_i, body_act,
                               list(t_consts) + t_carry + list(t_xs),
                               frame.ctx + (Context("scan", eqn, i, length),))
            frames[i] = sub
            out = self._outs(sub)
            t_out = self._out_taints(sub)
            carry, t_carry = out[:nk], t_out[:nk]
            ys[i] = out[nk:]
            t_ys = [a | b for a, b in zip(t_ys, t_out[nk:])] if t_ys else t_out[nk:]
        frame.subs[idx] = frames
        n_ys = len(eqn.outvars) - nk
        stacked = []
        for k in range(n_ys):
            aval = eqn.outvars[nk + k].aval
            stacked.append(jnp.stack([ys[i][k] for i in range(length)]) if length else jnp.zeros(aval.shape, aval.dtype))
        if not t_ys:
            t_ys = [frozenset()] * n_ys
        return carry + stacked, list(t_carry) + list(t_ys)

    def _forward_while(self, frame: Frame, eqn: Any, invals: list[Any],
                       t_in: list[frozenset[int]]) -> tuple[list[Any], list[frozenset[int]]]:
        """Runs the loop one iteration at a time (births inside get the iteration number).

        No cotangent flows through a while loop (JAX cannot reverse-differentiate
        one), so nothing is kept for the backward pass. After ``max_while``
        iterations the rest of the loop runs whole, from the current carry.
        """
        p = eqn.params
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cj, cconsts = _closed(p["cond_jaxpr"])
        bj, bconsts = _closed(p["body_jaxpr"])
        c_in, b_in, carry = invals[:nc], invals[nc:nc + nb], list(invals[nc + nb:])
        t_b, t_carry = list(t_in[nc:nc + nb]), list(t_in[nc + nb:])
        off = [False] * (nb + len(carry))
        k = 0
        while True:
            with compat.source_of(eqn):
                pred = compat.eval_jaxpr(compat.ClosedJaxpr(cj, cconsts), list(c_in) + carry)[0]
            if not bool(np.asarray(pred)):
                return carry, t_carry
            if k >= self.max_while:
                rest = compat.bind(eqn, list(c_in) + list(b_in) + carry)
                return rest, self._check_forward(eqn, frame.ctx, invals, rest, t_in)
            sub = self.forward(bj, bconsts, list(b_in) + carry, off, t_b + t_carry,
                               frame.ctx + (Context("while", eqn, k, 0),))
            carry, t_carry = self._outs(sub), self._out_taints(sub)
            k += 1

    # ------------------------------------------------------------------ backward

    def backward(self, frame: Frame, out_cts: Sequence[tuple[Any, frozenset[int]] | None]
                 ) -> list[tuple[Any, frozenset[int]] | None]:
        """Cotangents of ``frame.jaxpr``'s inputs given its outputs' (None = zero)."""
        jaxpr = frame.jaxpr
        ct: dict[Any, tuple[Any, frozenset[int]]] = {}

        def put(v: Any, val: Any, taint: frozenset[int]) -> None:
            if compat.is_literal(v) or not frame.active.get(v, False):
                return
            old = ct.get(v)
            ct[v] = (val, taint) if old is None else (old[0] + val, old[1] | taint)

        for v, c in zip(jaxpr.outvars, out_cts):
            if c is not None:
                put(v, c[0], c[1])
        for idx in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[idx]
            outs = [ct.get(v) if not compat.is_literal(v) else None for v in eqn.outvars]
            if all(c is None for c in outs):
                continue
            self.steps += 1
            in_cts = self._backward_eqn(frame, idx, eqn, outs)
            for v, c in zip(eqn.invars, in_cts):
                if c is not None:
                    put(v, c[0], c[1])
        return [None if compat.is_literal(v) else ct.get(v) for v in jaxpr.invars]

    def _backward_eqn(self, frame: Frame, idx: int, eqn: Any, outs: list[tuple[Any, frozenset[int]] | None]
                      ) -> list[tuple[Any, frozenset[int]] | None]:
        name = eqn.primitive.name
        if name in ZERO_DERIVATIVE:
            return [None] * len(eqn.invars)
        sub = frame.subs.get(idx)
        if name == "scan" and sub is not None:
            return self._backward_scan(frame, eqn, sub, outs)
        if name == "cond" and sub is not None:
            _, br = sub
            return [None] + self.backward(br, outs)
        if sub is not None and isinstance(sub, Frame):
            return self.backward(sub, outs)
        return self._backward_leaf(frame, eqn, outs)

    def _backward_scan(self, frame: Frame, eqn: Any, frames: list[Frame],
                       outs: list[tuple[Any, frozenset[int]] | None]) -> list[tuple[Any, frozenset[int]] | None]:
        p = eqn.params
        nc, nk, length, reverse = p["num_consts"], p["num_carry"], p["length"], p["reverse"]
        carry_ct = list(outs[:nk])
        ys_ct = outs[nk:]
        consts_ct: list[tuple[Any, frozenset[int]] | None] = [None] * nc
        n_xs = len(eqn.invars) - nc - nk
        xs_ct: list[list[Any]] = [[None] * length for _ in range(n_xs)]
        xs_taint: list[frozenset[int]] = [frozenset()] * n_xs
        for step in range(length):
            i = step if reverse else length - 1 - step  # reverse of the forward order
            y_i = [None if c is None else (c[0][i], c[1]) for c in ys_ct]
            in_ct = self.backward(frames[i], carry_ct + y_i)
            for k in range(nc):
                c = in_ct[k]
                if c is not None:
                    old = consts_ct[k]
                    consts_ct[k] = c if old is None else (old[0] + c[0], old[1] | c[1])
            carry_ct = list(in_ct[nc:nc + nk])
            for k in range(n_xs):
                c = in_ct[nc + nk + k]
                if c is not None:
                    xs_ct[k][i] = c[0]
                    xs_taint[k] = xs_taint[k] | c[1]
        xs_out: list[tuple[Any, frozenset[int]] | None] = []
        for k in range(n_xs):
            if all(v is None for v in xs_ct[k]):
                xs_out.append(None)
                continue
            aval = eqn.invars[nc + nk + k].aval
            slices = [v if v is not None else jnp.zeros(aval.shape[1:], aval.dtype) for v in xs_ct[k]]
            xs_out.append((jnp.stack(slices), xs_taint[k]))
        return consts_ct + carry_ct + xs_out

    def _backward_leaf(self, frame: Frame, eqn: Any, outs: list[tuple[Any, frozenset[int]] | None]
                       ) -> list[tuple[Any, frozenset[int]] | None]:
        invals = [compat.read_atom(frame.env, a) for a in eqn.invars]
        dyn = tuple(k for k, a in enumerate(eqn.invars)
                    if not compat.is_literal(a) and frame.active.get(a, False) and is_float_aval(a.aval))
        if not dyn:
            return [None] * len(eqn.invars)

        def f(*d: Any) -> list[Any]:
            vals = list(invals)
            for k, x in zip(dyn, d):
                vals[k] = x
            return compat.bind(eqn, vals)

        with compat.source_of(eqn):
            primal_out, vjp = jax.vjp(f, *[invals[k] for k in dyn])
            cts = [c[0] if c is not None else _zeros_ct(v.aval) for c, v in zip(outs, eqn.outvars)]
            got = vjp(cts)
        outvals = [compat.read_atom(frame.env, v) for v in eqn.outvars]
        # taint: non-finite incoming cotangents and non-finite forward values used by the rule
        t_ct = frozenset().union(*[c[1] for c in outs if c is not None and any(nonfinite(c[0]))])
        t_fwd = frozenset().union(*[frame.taint.get(a, frozenset()) for a in eqn.invars
                                    if not compat.is_literal(a)],
                                  *[frame.taint.get(v, frozenset()) for v in eqn.outvars])
        # the backward of this equation reads the incoming cotangents and the forward values
        fwd_flags = [nonfinite(v) for v in list(invals) + list(outvals)]
        ct_nan = any(nonfinite(c[0])[0] for c in outs if c is not None) or any(n for n, _ in fwd_flags)
        ct_nf = any(any(nonfinite(c[0])) for c in outs if c is not None) or any(n or i for n, i in fwd_flags)
        result: list[tuple[Any, frozenset[int]] | None] = [None] * len(eqn.invars)
        births: dict[int, int] = {}
        for k, g in zip(dyn, got):
            nan, inf = nonfinite(g)
            taint: frozenset[int] = frozenset()
            if nan or inf:
                taint = t_ct | t_fwd
                kind = "nan" if nan and not ct_nan else ("inf" if not ct_nf and not nan else None)
                # (a NaN from 0·inf, where the inf is a forward value, is born here: the inf was not NaN)
                if kind is not None:
                    if kind not in births:
                        key = self._record(eqn, "backward", kind, frame.ctx, taint, invals, outvals,
                                           _count_bad(np.asarray(g), kind), int(np.size(g)),
                                           out_cts=cts, in_cts=[None if j not in dyn else got[dyn.index(j)]
                                                                for j in range(len(invals))], dyn=dyn)
                        births[kind] = key
                    if births[kind] >= 0:
                        taint = taint | {births[kind]}
            result[k] = (g, taint)
        del primal_out
        return result


def _count_bad(a: np.ndarray, kind: str) -> int:
    a = np.asarray(a)
    if a.dtype.itemsize < 4:
        a = a.astype(np.float32)
    return int(np.isnan(a).sum()) if kind == "nan" else int((~np.isfinite(a)).sum())


def _jit_label(eqn: Any) -> str:
    from gradkit._src.dispatch import op_name

    name = eqn.params.get("name", "") if compat.is_jit(eqn) else ""
    if not name or name.startswith("_") or name in ("<lambda>", "fn", "f"):
        return ""
    return op_name(eqn).removeprefix(compat.FUNCTION_PREFIX)
