"""A model's program run for LRP's gradient form: each rule site (see ``gform_scan.py``) computed by a callback.

The gradient form carries a *modified gradient* backward (relevance is the
input times it, at the end), so every op keeps JAX's own derivative except at
the sites :class:`~gradkit._src.compat.gform_scan.GPlan` finds (activations,
normalizers, products of two input-dependent values), which the callback
computes with any derivative it likes. ``jit``, ``checkpoint``/``remat``,
``cond``/``switch`` and ``scan`` bodies are entered; ``custom_jvp`` and
``custom_vjp`` functions (other than ``jax.nn`` activations) keep their own
derivative, their insides unseen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax

from gradkit._src.compat.gform_scan import GPlan, Site
from gradkit._src.compat.jaxprs import (
    bind,
    eqn_name,
    is_custom_derivative,
    is_jit,
    is_literal,
    jaxpr_parts,
    read_atom,
)
from gradkit._src.compat.layer_scan import is_varying, region_apply, run_scan, run_switch
from gradkit._src.compat.source import call_site, source_line

__all__ = ["GSite", "run_gradient_form"]

_CALLS = frozenset({"closed_call", "core_call"})
_REMAT = frozenset({"checkpoint", "remat", "remat2"})


@dataclass(frozen=True, eq=False)
class GSite:
    """One rule site of the running program, as :func:`run_gradient_form` hands it to its callback.

    ``kind``: ``"activation"`` (``apply(x)``: the element-wise region),
    ``"normalizer"`` or ``"product"`` (``apply(a, b)``: the op on its two
    input-dependent operands). ``gates`` (products): per operand, whether it
    comes out of a softmax or an activation. ``normalizer``: which operand is
    the statistic (a normalizer's ``σ``). ``fused``: the product is a fused
    attention kernel ``softmax(q·kᵀ)·v`` (``apply(q, k, v, *rest)``). ``name``: the op (or the ``jax.nn``
    function) and ``source`` the user's line.
    """

    kind: str
    name: str
    index: int
    apply: Callable[..., Any] = field(repr=False)
    source: str | None = None
    gates: tuple[bool, ...] = ()
    normalizer: int = -1
    fused: bool = False


def _varying_outs(jaxpr: Any, flags: Sequence[bool]) -> list[bool]:
    plan = GPlan(jaxpr, flags)
    return [is_varying(a, plan.varying) for a in jaxpr.outvars]


class _Runner:
    def __init__(self, handle: Callable[[GSite, list[Any]], Any]) -> None:
        self.handle = handle
        self.count = 0
        self.kinds: dict[str, int] = {}
        self.opaque: list[tuple[str, str]] = []

    def run(self, jaxpr: Any, consts: Sequence[Any], args: Sequence[Any], varying: Sequence[bool],
            gates: Sequence[bool], stats: Sequence[bool] = (), normalizing: Sequence[bool] = ()
            ) -> tuple[list[Any], list[bool]]:
        plan = GPlan(jaxpr, varying, gates, stats, normalizing)
        env: dict[Any, Any] = {}
        for v, c in zip(jaxpr.constvars, consts):
            env[v] = c
        for v, a in zip(jaxpr.invars, args):
            env[v] = a
        read = lambda a: read_atom(env, a)
        for i, eqn in enumerate(plan.eqns):
            if i in plan.deferred:
                continue
            if i in plan.sites:
                env[eqn.outvars[0]] = self._site(plan, plan.sites[i], read)
                continue
            invals = [read(a) for a in eqn.invars]
            flags = [is_varying(a, plan.varying) for a in eqn.invars]
            prim = eqn.primitive.name
            in_gates = [not is_literal(a) and a in plan.gates for a in eqn.invars]
            in_stats = [not is_literal(a) and a in plan.stat for a in eqn.invars]
            if any(flags) and (is_jit(eqn) or prim in _CALLS or prim in _REMAT):
                inner, inner_consts = jaxpr_parts(eqn.params["jaxpr"])
                with call_site(eqn):
                    norm = [v in plan.stat and plan.feeds_statistic(v) for v in eqn.outvars]
                    if prim in _REMAT:
                        outs = self._remat(eqn, inner, inner_consts, invals, flags, in_gates, in_stats)
                    else:
                        outs, _ = self.run(inner, inner_consts, invals, flags, in_gates, in_stats, norm)
            elif any(flags[1:]) and prim == "cond":
                with call_site(eqn):
                    outs = self._cond(eqn, invals, flags, in_gates)
            elif any(flags) and prim == "scan":
                with call_site(eqn):
                    outs = self._scan(eqn, invals, flags, in_gates)
            else:
                if any(flags) and is_custom_derivative(eqn):  # its own derivative: its inside is unseen
                    self.opaque.append((eqn_name(eqn), source_line(eqn)))
                outs = bind(eqn, invals)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [read(a) for a in jaxpr.outvars], plan.out_gates

    def _remat(self, eqn: Any, inner: Any, inner_consts: Sequence[Any], invals: list[Any], flags: list[bool],
               gates: list[bool], stats: list[bool]) -> list[Any]:
        def body(*ops: Any) -> list[Any]:
            return self.run(inner, inner_consts, list(ops), flags, gates, stats)[0]

        policy = eqn.params.get("policy")
        prevent_cse = eqn.params.get("prevent_cse", True)
        return list(jax.checkpoint(body, policy=policy, prevent_cse=prevent_cse)(*invals))

    def _cond(self, eqn: Any, invals: list[Any], flags: list[bool], gates: list[bool]) -> list[Any]:
        return run_switch(eqn, invals, lambda jx, cs, ops: self.run(jx, cs, ops, flags[1:], gates[1:])[0])

    def _scan(self, eqn: Any, invals: list[Any], flags: list[bool], gates: list[bool]) -> list[Any]:
        return run_scan(eqn, invals, flags, _varying_outs,
                        lambda jx, cs, ops, fl, gt: self.run(jx, cs, ops, fl, gt)[0], gates)

    def _site(self, plan: GPlan, site: Site, read: Callable[[Any], Any]) -> Any:
        eqns = [plan.eqns[j] for j in site.eqns]
        last = plan.eqns[site.eqns[-1]]
        self.kinds[site.kind] = self.kinds.get(site.kind, 0) + 1
        if site.kind == "activation":
            (x_var,) = site.inputs
            apply = region_apply(eqns, x_var, read)
            g = GSite("activation", site.name, self.count, apply, source_line(eqns[0]))
            self.count += 1
            return self.handle(g, [read(x_var)])

        def apply2(*ops: Any) -> Any:
            return bind(last, list(ops))[0]

        g = GSite(site.kind, site.name, self.count, apply2, source_line(last), site.gates, site.normalizer, site.fused)
        self.count += 1
        return self.handle(g, [read(a) for a in last.invars])


def run_gradient_form(fn: Callable[[Any], Any], x: Any, handle: Callable[[GSite, list[Any]], Any],
                      opaque: list[tuple[str, str]] | None = None) -> tuple[list[Any], Any, dict[str, int]]:
    """Runs ``fn(x)`` (``x`` a pytree of arrays) with each gradient-form rule site computed by ``handle``.

    ``handle(site, operands)`` must return what ``site.apply(*operands)``
    returns, with the derivative its rule wants. ``fn`` is traced once at
    ``x``'s type; its program is then evaluated in the current trace (under
    ``jit``, ``vmap``, ``vjp``). Returns ``(outputs as a flat list, output
    tree structure, how many sites of each kind ran in the traced program)``.
    ``opaque``, when given, collects ``(function, source line)`` of each
    ``custom_jvp``/``custom_vjp`` function on the input's path that keeps its
    own derivative (its products and nonlinearities take no rule).
    """
    leaves, tree = jax.tree_util.tree_flatten(x)
    closed, shape = jax.make_jaxpr(lambda *ls: fn(jax.tree_util.tree_unflatten(tree, list(ls))),
                                   return_shape=True)(*leaves)
    jaxpr, consts = jaxpr_parts(closed)
    runner = _Runner(handle)
    outs, _ = runner.run(jaxpr, consts, leaves, [True] * len(leaves), [False] * len(leaves))
    if opaque is not None:
        opaque.extend(runner.opaque)
    return outs, jax.tree_util.tree_structure(shape), dict(runner.kinds)
