"""SAFE's rewrite of a program: each singular equation masked where dataflow finds its paths masked.

For a table whose rules carry a ``masked`` binder (SAFE's rules of singular
primitives), each program body — the function's own, and each loop, branch
or ``shard_map`` body — is rewritten in three steps:

1. **flatten**: ``jit`` calls are inlined (not gradkit's named ops, nor a
   function the table names), so ``jnp.where``, ``jnp.clip`` and
   ``jnp.linalg.norm`` are seen through; bodies of other sub-programs are
   rewritten the same way, on their own;
2. **find** (:mod:`gradkit._src.core.liveness`, statically): the matched
   equations a mask can reach. None: the body stays as it was — JAX's own
   equations, bit for bit;
3. **mask**: the body is traced again: the values the masks read (a
   ``where``'s predicate, a ``max``'s operands, a constant factor) are
   computed apart, behind ``stop_gradient``; the masks are computed from them
   (the up and down passes); each matched equation a mask reaches is bound
   with its masks (``rule.fn.masked``), everything else as it was. XLA
   computes each value once (the copies are the same operations).

The rewritten body replaces the old one as one ``jit`` equation with the
same inputs and outputs, so its kind (open or closed) and its place stay.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import numpy as np

from gradkit._src import compat
from gradkit._src.core import liveness, splice, walk

# (eqn, enclosing scopes) -> the masked binder of the rule the table gives it, or None
Match = Callable[[compat.JaxprEqn, tuple[str, ...]], Callable[..., list[Any]] | None]
Keep = Callable[[compat.JaxprEqn], bool]


def rewrite(jaxpr: Any, match: Match, keep: Keep, names: frozenset[str], outer: tuple[str, ...] = ()) -> Any:
    """``jaxpr`` (open or closed, the same kind back) with masked SAFE equations; itself if none is."""
    core, consts = compat.jaxpr_parts(jaxpr)
    if not _may_mask(jaxpr, names):
        return jaxpr
    if core.constvars and not consts:  # an open body with free constants: left to JAX's rules
        return jaxpr
    changed = [False]

    def sub(program: Any, eqn: compat.JaxprEqn) -> Any:
        new = rewrite(program, match, keep, names, outer + compat.name_scopes(eqn))
        changed[0] = changed[0] or new is not program
        return new

    def flat_fn(*args: Any) -> list[Any]:
        return _inline(core, consts, args, keep, sub)

    avals = [v.aval for v in core.invars]
    flat = compat.trace_avals(flat_fn, avals, "gradkit_safe")
    fj, fc = compat.jaxpr_parts(flat)
    binders = {i: b for i, eqn in enumerate(fj.eqns) if (b := match(eqn, outer)) is not None}
    known = _constants(fj)
    up_s = liveness.up_pass(fj, None, known.__contains__)
    down_s = liveness.down_pass(fj, None, up_s, known.__contains__)
    # Reached by a mask: dead somewhere (statically everywhere, as behind a product by a literal 0, or
    # where runtime values say) on an input some varying path reaches; elsewhere JAX's equation stays.
    used = _used(fj)  # an output nothing differentiable reads gets a symbolic zero cotangent: nothing to mask
    reached = {i: b for i, b in binders.items() if fj.eqns[i].outvars[0] in used and
               any(d is not False and not isinstance(a, compat.Literal) and up_s.get(a, False) is not False
                   for a, d in zip(fj.eqns[i].invars, liveness.dead(fj.eqns[i], up_s, down_s, True)))}
    if not reached:
        return _place(jaxpr, core, flat) if changed[0] else jaxpr

    # Only the liveness the static passes left open (DYN) on the way to a reached equation is computed.
    need_up, need_down = liveness.demand(fj, up_s, down_s, [fj.eqns[i] for i in reached])

    def masked_fn(*args: Any) -> list[Any]:
        values = _Values(fj, fc, args)
        with jax.numpy_dtype_promotion("standard"):  # gradkit's own arithmetic, whatever the user's setting
            up = liveness.up_pass(fj, values, known.__contains__, up_s, need_up)
            down = liveness.down_pass(fj, values, up, known.__contains__, down_s, need_down)
        env: dict[Any, Any] = dict(zip(fj.constvars, fc))
        env.update(zip(fj.invars, args))
        for i, eqn in enumerate(fj.eqns):
            ins = [compat.read_atom(env, a) for a in eqn.invars]
            with compat.source_of(eqn):
                if i in reached:
                    with jax.numpy_dtype_promotion("standard"):
                        dead = [d if not isinstance(d, bool) else (None if not d else True)
                                for d in liveness.dead(eqn, up, down, False)]
                    outs = reached[i](eqn, ins, [_as_mask(d, x) for d, x in zip(dead, ins)])
                else:
                    outs = compat.bind(eqn, ins)
            for v, o in zip(eqn.outvars, outs):
                env[v] = o
        return [compat.read_atom(env, a) for a in fj.outvars]

    return _place(jaxpr, core, compat.trace_avals(masked_fn, avals, "gradkit_safe"))


# Where a mask can start: a selection, or a value that is constant for differentiation.
_MASK_SITES = frozenset({"select_n", "max", "min", "clamp", "reduce_max", "reduce_min", "reduce_prod",
                         "stop_gradient"})


def _may_mask(jaxpr: Any, names: frozenset[str]) -> bool:
    """A cheap look before the analysis: some matched primitive, and some place a mask can start — a
    selection, a ``stop_gradient``, a boolean converted to a number, a literal 0 or a closed-over constant
    as a factor. None: nothing to mask, and the program is not traced again."""
    matched = site = False
    for eqn, j in walk.equations(jaxpr):
        name = eqn.primitive.name
        matched = matched or name in names
        if not site:
            if name in _MASK_SITES:
                site = True
            elif name == "convert_element_type":
                a = eqn.invars[0]
                site = not isinstance(a, compat.Literal) and walk.shaped(a.aval).dtype == np.dtype(bool)
            elif name in ("mul", "dot_general"):
                site = any((isinstance(a, compat.Literal) and not bool(np.all(np.asarray(a.val) != 0)))
                           or (not isinstance(a, compat.Literal) and a in j.constvars) for a in eqn.invars)
        if matched and site:
            return True
    return False


def _used(jaxpr: compat.Jaxpr) -> set[Any]:
    """The variables some path of inexact values leads from to the program's outputs (masked or not)."""
    def inexact(a: Any) -> bool:
        return bool(jax.numpy.issubdtype(walk.shaped(a.aval).dtype, jax.numpy.inexact))

    used = {v for v in jaxpr.outvars if not isinstance(v, compat.Literal) and inexact(v)}
    for eqn in reversed(jaxpr.eqns):
        if eqn.primitive.name != "stop_gradient" and any(v in used for v in eqn.outvars if inexact(v)):
            used.update(a for a in eqn.invars if not isinstance(a, compat.Literal) and inexact(a))
    return used


def _constants(jaxpr: compat.Jaxpr) -> dict[Any, Any]:
    """The values the program computes from literals alone, finite, nonzero and normal (splice's rule)."""
    known: dict[Any, Any] = {}
    for eqn in jaxpr.eqns:
        if eqn.invars and len(eqn.outvars) == 1:
            c = splice.constant_value(eqn, known)
            if c is not None:
                known[eqn.outvars[0]] = c
    return known


def _as_mask(d: Any, x: Any) -> Any:
    if d is None:
        return None
    if d is True:
        return jax.numpy.ones(jax.numpy.shape(x), bool)
    return d


class _Values:
    """The values the masks read, computed apart from the program (behind ``stop_gradient``), once each."""

    def __init__(self, jaxpr: compat.Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> None:
        self._env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
        self._env.update((v, jax.lax.stop_gradient(a)) for v, a in zip(jaxpr.invars, args))
        self._producer = {v: i for i, eqn in enumerate(jaxpr.eqns) for v in eqn.outvars}
        self._eqns = jaxpr.eqns

    def __call__(self, atom: compat.Atom) -> Any:
        if isinstance(atom, compat.Literal):
            return atom.val
        if atom in self._env:
            return self._env[atom]
        need: set[int] = set()
        stack: list[Any] = [atom]
        while stack:
            v = stack.pop()
            if isinstance(v, compat.Literal) or v in self._env:
                continue
            i = self._producer[v]
            if i in need:
                continue
            if self._eqns[i].effects:
                raise liveness.Unknown
            need.add(i)
            stack.extend(self._eqns[i].invars)
        for i in sorted(need):
            eqn = self._eqns[i]
            with compat.source_of(eqn):
                outs = compat.bind(eqn, [compat.read_atom(self._env, a) for a in eqn.invars])
            for v, o in zip(eqn.outvars, outs):
                self._env[v] = o
        return self._env[atom]


def _inline(core: compat.Jaxpr, consts: Sequence[Any], args: Sequence[Any], keep: Keep,
            sub: Callable[[Any, compat.JaxprEqn], Any]) -> list[Any]:
    env: dict[Any, Any] = dict(zip(core.constvars, consts))
    env.update(zip(core.invars, args))
    for eqn in core.eqns:
        ins = [compat.read_atom(env, a) for a in eqn.invars]
        with compat.source_of(eqn):
            if (compat.is_jit(eqn) and not str(eqn.params.get("name", "")).startswith(compat.NAMED_OP_PREFIX)
                    and not keep(eqn) and not eqn.effects):
                inner, inner_consts = compat.jaxpr_parts(eqn.params["jaxpr"])
                with compat.call_site(eqn):
                    outs = _inline(inner, inner_consts, ins, keep, sub)
            else:
                if walk.enters(eqn) and walk.has_subprograms(eqn):
                    with compat.body_context(eqn), compat.call_site(eqn):
                        params = walk.map_subprograms(eqn.params, functools.partial(_sub_of, sub, eqn))
                    if params is not None:
                        eqn = eqn.replace(params=params)
                outs = compat.bind(eqn, ins)
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [compat.read_atom(env, a) for a in core.outvars]


def _sub_of(sub: Callable[[Any, compat.JaxprEqn], Any], eqn: compat.JaxprEqn, program: Any) -> Any:
    return sub(program, eqn)


def _place(jaxpr: Any, core: compat.Jaxpr, new: Any) -> Any:
    """``jaxpr`` whose equations are one ``jit`` call of ``new`` (same inputs, outputs and kind)."""
    nj, nc = compat.jaxpr_parts(new)

    def call(*args: Any) -> list[Any]:
        env: dict[Any, Any] = dict(zip(nj.constvars, nc))
        env.update(zip(nj.invars, args))
        for e in nj.eqns:
            with compat.source_of(e):
                outs = compat.bind(e, [compat.read_atom(env, a) for a in e.invars])
            env.update(zip(e.outvars, outs))
        return [compat.read_atom(env, a) for a in nj.outvars]

    produced = {v for eqn in core.eqns for v in eqn.outvars}
    seen: set[Any] = set()
    keep_idx = []
    for k, v in enumerate(core.outvars):
        if not isinstance(v, compat.Literal) and v in produced and v not in seen:
            seen.add(v)
            keep_idx.append(k)

    def picked(*args: Any) -> list[Any]:
        outs = call(*args)
        return [outs[k] for k in keep_idx]

    if not keep_idx:  # every output an input or a constant: no derivative to mask
        return jaxpr
    with jax.disable_jit(False):  # one jit equation, also under jax.disable_jit() (as compat.trace_jit)
        closed = compat.trace_avals(jax.jit(picked), [v.aval for v in core.invars], "gradkit_safe")
    eqn = compat.single_equation(closed)
    if eqn is None:  # pragma: no cover - a jit trace is one equation
        return jaxpr
    placed = eqn.replace(invars=list(core.invars), outvars=[cast(compat.Var, core.outvars[k]) for k in keep_idx])
    return compat.replace_eqns(jaxpr, [placed])
