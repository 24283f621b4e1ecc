"""Step-by-step replay of a reverse-mode gradient, watching for non-finite values.

The forward program (a jaxpr) is evaluated equation by equation with concrete
values; the backward pass then walks the equations in reverse and applies each
one's own VJP. What to do with an equation is looked up by primitive name in
:data:`gradkit._src.audit.replay.control.HANDLERS` (``scan``, ``cond``, ``while``);
a call (``jit``, ``checkpoint``…) runs its body in place; every other
equation, ``custom_jvp``/``custom_vjp`` functions included (their own rule is
the derivative), is a leaf (:mod:`gradkit._src.audit.replay.leaf`).

As JAX's autodiff does, only active values (:mod:`gradkit._src.audit.activity`)
carry cotangents, so the replay does the same arithmetic as ``jax.grad``.

Every non-finite element carries the births it came from
(:mod:`gradkit._src.audit.provenance`), so each non-finite gradient element leads
back to the elements of the equations where its NaN or inf was born.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.activity import ZERO_DERIVATIVE, active_outs, call_body
from gradkit._src.audit.provenance import Label, Provenance
from gradkit._src.audit.replay.control import CALL, HANDLERS
from gradkit._src.audit.replay.leaf import LEAF
from gradkit._src.audit.replay.state import Birth, Context, Ct, Frame, Handler, Values, loop_indices
from gradkit._src.checks.describe import nonfinite_mask

__all__ = ["Birth", "Context", "Frame", "Replay"]


class Replay:
    """Forward then backward, equation by equation; collects :class:`Birth` records.

    Attributes:
      births: every birth, by ``(equation, pass, kind, place)``.
      prov: the labels and atoms (elements of births) of this replay.
      const_label: the labels of a constant of the program (``None``: finite, or not tracked);
        the audit labels the non-finite elements of held (not differentiated) inputs this way,
        which the traced program holds as constants.
      cotangent_births: a backward non-finite element is also born where the cotangents it reads are finite,
        whatever the forward values it reads (``0 × nan``): set by the audit, between the forward and the
        backward pass, when the inputs hold NaN/inf on purpose (the value is finite), so that the
        equation where they enter the gradient is a birth of its own.
    """

    def __init__(self, max_births: int = 200, max_while: int = 1000,
                 const_label: Callable[[ArrayLike], Label | None] | None = None) -> None:
        self.births: dict[tuple[int, str, str, tuple[tuple[str, int, int | None], ...]], Birth] = {}
        self.by_key: list[Birth] = []
        self.prov = Provenance()
        self.max_births = max_births
        self.max_while = max_while
        # The labels of a program constant (at any depth) that is a non-finite input: see audit.investigate.
        self.const_label = const_label
        self.cotangent_births = False
        self._handlers: dict[int, tuple[compat.JaxprEqn, Handler]] = {}

    def handler(self, eqn: compat.JaxprEqn) -> Handler:
        hit = self._handlers.get(id(eqn))
        if hit is None or hit[0] is not eqn:
            h = HANDLERS.get(eqn.primitive.name) or (CALL if call_body(eqn) is not None else LEAF)
            hit = self._handlers[id(eqn)] = (eqn, h)
        return hit[1]

    # ------------------------------------------------------------------ births

    def record(self, eqn: compat.JaxprEqn, phase: str, kind: str, ctx: tuple[Context, ...], pos: int, mask: np.ndarray,
               label: Label, values: Values) -> None:
        """Notes that the ``mask`` elements of position ``pos`` were born here; adds their atoms to ``label``."""
        key = (id(eqn), phase, kind, tuple(c.static() for c in ctx))
        b = self.births.get(key)
        if b is None:
            if len(self.births) >= self.max_births:
                return
            b = self.births[key] = Birth(len(self.by_key), eqn, phase, kind, ctx)
            self.by_key.append(b)
        loops = loop_indices(ctx)
        it = loops[-1] if loops else None
        if it is not None and it not in b.iterations:
            b.iterations.append(it)
        occ = b.occurrence(ctx, values)
        if occ is not None:
            occ.masks[pos] = occ.masks[pos] | mask if pos in occ.masks else mask.copy()
        for e in self.prov.born(label, b.key, pos, mask):
            its = b.elements.setdefault((pos, e), [])
            if it not in its:
                its.append(it)

    # ------------------------------------------------------------------ forward

    def forward(self, jaxpr: compat.Jaxpr, consts: Sequence[ArrayLike], args: Sequence[ArrayLike],
                active: Sequence[bool], labels: Sequence[Label | None] | None = None,
                ctx: tuple[Context, ...] = ()) -> Frame:
        """Evaluates ``jaxpr``; returns its :class:`Frame` (values, labels, activity, what handlers kept)."""
        frame = Frame(jaxpr, {}, {}, {}, ctx)
        for v, x in zip(jaxpr.constvars, consts):
            frame.env[v], frame.active[v] = x, False
            frame.labels[v] = None if self.const_label is None else self.const_label(x)
        labels = labels if labels is not None else [None] * len(args)
        for v, x, a, lb in zip(jaxpr.invars, args, active, labels):
            frame.env[v], frame.active[v], frame.labels[v] = x, a, lb
        for idx, eqn in enumerate(jaxpr.eqns):
            invals = [frame.read(a) for a in eqn.invars]
            act_in = [frame.is_active(a) for a in eqn.invars]
            l_in = [frame.label(a) for a in eqn.invars]
            outs, l_out = self.handler(eqn).forward(self, frame, idx, eqn, invals, act_in, l_in)
            for v, x, a, lb in zip(eqn.outvars, outs, active_outs(eqn, act_in), l_out):
                frame.env[v], frame.active[v], frame.labels[v] = x, a, lb
        return frame

    # ------------------------------------------------------------------ backward

    def add_ct(self, a: Ct, b: Ct) -> Ct:
        """The sum of two cotangents, with the labels of its non-finite elements."""
        if a is None:
            return b
        if b is None:
            return a
        total = a[0] + b[0]
        bad = nonfinite_mask(total)
        if bad is None or not bad.any() or (a[1] is None and b[1] is None):
            return total, None
        label = self.prov.combine([a[1], b[1]], np.shape(total), bad)
        return total, label if label.any() else None

    def backward(self, frame: Frame, out_cts: Sequence[Ct]) -> list[Ct]:
        """Cotangents of ``frame.jaxpr``'s inputs given its outputs' (None = zero)."""
        jaxpr = frame.jaxpr
        ct: dict[compat.Var, Ct] = {}

        def put(v: compat.Atom, c: Ct) -> None:
            if c is not None and not isinstance(v, compat.Literal) and frame.is_active(v):
                ct[v] = self.add_ct(ct.get(v), c)

        for v, c in zip(jaxpr.outvars, out_cts):
            put(v, c)
        for idx in range(len(jaxpr.eqns) - 1, -1, -1):
            eqn = jaxpr.eqns[idx]
            outs = [None if isinstance(v, compat.Literal) else ct.get(v) for v in eqn.outvars]
            if all(c is None for c in outs) or eqn.primitive.name in ZERO_DERIVATIVE:
                continue
            for v, c in zip(eqn.invars, self.handler(eqn).backward(self, frame, idx, eqn, outs)):
                put(v, c)
        return [None if compat.is_literal(v) else ct.get(v) for v in jaxpr.invars]
