"""Activity analysis for the replay: which values carry a cotangent, as ``jax.grad`` decides.

Only values that depend differentiably on the differentiated inputs are
*active*; ops with a zero derivative (``stop_gradient``, ``sign``, ``round``…)
and integer values stop activity. The replay differentiates exactly the
active values, so it does the same arithmetic as JAX's autodiff (and sees the
same NaNs).

Control flow is looked up in a table by primitive name (``scan``, ``while``,
``cond``); any other equation whose one sub-program has the equation's own
inputs and outputs (``jit``, ``checkpoint``, ``closed_call``…) is a *call* and
is analysed through its body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax.numpy as jnp
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.core import walk

# Ops whose derivative is zero: JAX gives them symbolic-zero tangents, so
# nothing upstream of them is differentiated through them.
ZERO_DERIVATIVE = frozenset({
    "stop_gradient", "floor", "ceil", "round", "sign", "nextafter", "is_finite", "argmax", "argmin",
    "random_bits", "random_seed", "random_wrap", "random_unwrap", "iota", "population_count", "clz",
})


def is_float_aval(aval: object) -> bool:
    dtype = getattr(aval, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.inexact)


def _same_avals(a: Sequence[Any], b: Sequence[Any]) -> bool:  # atoms: JAX types their avals abstractly
    return len(a) == len(b) and all(tuple(x.aval.shape) == tuple(y.aval.shape) and x.aval.dtype == y.aval.dtype
                                    for x, y in zip(a, b))


def call_body(eqn: compat.JaxprEqn) -> tuple[compat.Jaxpr, list[ArrayLike]] | None:
    """``(body, consts)`` when ``eqn`` just calls one sub-program on its own operands; else ``None``.

    ``shard_map`` is not a call in this sense: its body sees per-device
    shards and collectives, so it is applied whole.
    """
    if not walk.enters(eqn) or compat.is_shard_map(eqn):
        return None
    subs = walk.subprograms(eqn.params)
    if len(subs) != 1:
        return None
    body, consts = compat.jaxpr_parts(subs[0])
    if not (_same_avals(body.invars, eqn.invars) and _same_avals(body.outvars, eqn.outvars)):
        return None
    return body, consts


# --------------------------------------------------------------------------- per-primitive rules


def scan_activity(eqn: compat.JaxprEqn, act_in: Sequence[bool]) -> tuple[list[bool], list[bool]]:
    """(the body's input activity at the fixpoint, the scan's output activity)."""
    lay = compat.scan_layout(eqn)
    body, _ = compat.jaxpr_parts(lay.body)
    nc, nk = lay.num_consts, lay.num_carry
    consts, carry, xs = list(act_in[:nc]), list(act_in[nc:nc + nk]), list(act_in[nc + nk:])
    while True:  # a carry becomes active once any iteration makes it so
        out = active_jaxpr(body, consts + carry + xs)
        new = [a or b for a, b in zip(carry, out[:nk])]
        if new == carry:
            break
        carry = new
    return consts + carry + xs, carry + out[nk:]


def _cond_activity(eqn: compat.JaxprEqn, act_in: Sequence[bool]) -> list[bool]:
    outs = [False] * len(eqn.outvars)
    for br in compat.cond_layout(eqn).branches:
        body, _ = compat.jaxpr_parts(br)
        outs = [a or b for a, b in zip(outs, active_jaxpr(body, list(act_in[1:])))]
    return outs


def _while_activity(eqn: compat.JaxprEqn, act_in: Sequence[bool]) -> list[bool]:
    lay = compat.while_layout(eqn)
    body, _ = compat.jaxpr_parts(lay.body)
    nc, nb = lay.cond_nconsts, lay.body_nconsts
    consts, carry = list(act_in[nc:nc + nb]), list(act_in[nc + nb:])
    while True:
        new = [a or b for a, b in zip(carry, active_jaxpr(body, consts + carry))]
        if new == carry:
            return carry
        carry = new


_RULES: dict[str, Callable[[compat.JaxprEqn, Sequence[bool]], list[bool]]] = {
    "scan": lambda eqn, act_in: scan_activity(eqn, act_in)[1],
    "cond": _cond_activity,
    "while": _while_activity,
}


def active_outs(eqn: compat.JaxprEqn, act_in: Sequence[bool]) -> list[bool]:
    """Which outputs of ``eqn`` depend differentiably on its active inputs."""
    floats = [is_float_aval(v.aval) for v in eqn.outvars]
    name = eqn.primitive.name
    if not any(act_in) or name in ZERO_DERIVATIVE:
        return [False] * len(eqn.outvars)
    rule = _RULES.get(name)
    if rule is not None:
        outs = rule(eqn, act_in)
    else:
        call = call_body(eqn)
        if call is None:
            return floats
        outs = active_jaxpr(call[0], act_in)
    return [a and f for a, f in zip(outs, floats)]


def active_jaxpr(jaxpr: compat.Jaxpr, act_in: Sequence[bool]) -> list[bool]:
    """The activity of ``jaxpr``'s outputs given its inputs'."""
    act: dict[compat.Var, bool] = dict(zip(jaxpr.invars, act_in))
    for eqn in jaxpr.eqns:
        ins = [False if isinstance(a, compat.Literal) else act.get(a, False) for a in eqn.invars]
        act.update(zip(eqn.outvars, active_outs(eqn, ins)))
    return [False if isinstance(a, compat.Literal) else act.get(a, False) for a in jaxpr.outvars]
