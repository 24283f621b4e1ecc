"""The replay of control flow and calls: one handler per kind of equation that holds a program.

* ``scan``: the body runs once per iteration, forward and then backward in
  reverse order, with the iteration in the context of everything born inside;
* ``cond``: the taken branch runs;
* ``while``: the body runs iteration by iteration forward (no cotangent flows
  through a while loop: JAX cannot reverse-differentiate one);
* a call (``jit``, ``checkpoint``, ``closed_call``…, found by
  :func:`gradkit._src.audit.activity.call_body`): its body runs in place.

Operand layouts come from :mod:`gradkit._src.compat` (``scan_layout``…).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.activity import call_body, scan_activity
from gradkit._src.audit.provenance import Label
from gradkit._src.audit.replay.leaf import LEAF
from gradkit._src.audit.replay.state import Context, Ct, Frame, Handler, Runner
from gradkit._src.core.dispatch import op_name

Labels = list[Label | None]


def _some(label: Label | None) -> Label | None:
    return label if label is not None and label.any() else None


def _slice(label: Label | None, i: int) -> Label | None:
    return None if label is None else _some(label[i])


def _stack(labels: Sequence[Label | None], shape: tuple[int, ...]) -> Label | None:
    if all(lb is None for lb in labels):
        return None
    return np.stack([np.zeros(shape, np.int32) if lb is None else lb for lb in labels])



def _row(x: ArrayLike, i: int) -> ArrayLike:
    """Row ``i`` of a scanned-over input (an array with a leading axis)."""
    assert isinstance(x, (jax.Array, np.ndarray))
    return x[i]


def _sub(frame: Frame, idx: int) -> Frame:
    """The frame a cond or call equation's forward kept."""
    sub = frame.subs[idx]
    assert isinstance(sub, Frame)
    return sub

class Scan:
    def forward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, invals: list[ArrayLike],
                act_in: list[bool], labels: Labels) -> tuple[list[ArrayLike], Labels]:
        lay = compat.scan_layout(eqn)
        body, bconsts = compat.jaxpr_parts(lay.body)
        nc, nk, n = lay.num_consts, lay.num_carry, lay.length
        body_act, _ = scan_activity(eqn, act_in)
        consts, carry, xs = invals[:nc], list(invals[nc:nc + nk]), invals[nc + nk:]
        l_consts, l_carry, l_xs = labels[:nc], list(labels[nc:nc + nk]), labels[nc + nk:]
        frames: list[Frame | None] = [None] * n
        ys: list[list[ArrayLike]] = [[] for _ in range(n)]
        l_ys: list[Labels] = [[] for _ in range(n)]
        for step in range(n):
            i = n - 1 - step if lay.reverse else step
            sub = rp.forward(body, bconsts, list(consts) + carry + [_row(x, i) for x in xs], body_act,
                             list(l_consts) + l_carry + [_slice(lb, i) for lb in l_xs],
                             frame.ctx + (Context("scan", eqn, i, n),))
            frames[i] = sub
            out, l_out = sub.outputs(), sub.output_labels()
            carry, l_carry = out[:nk], l_out[:nk]
            ys[i], l_ys[i] = out[nk:], l_out[nk:]
        frame.subs[idx] = frames
        stacked, l_stacked = [], []
        for k, v in enumerate(eqn.outvars[nk:]):
            st = compat.struct_of(v.aval)
            item = tuple(st.shape[1:])
            stacked.append(jnp.stack([ys[i][k] for i in range(n)]) if n else jnp.zeros(st.shape, st.dtype))
            l_stacked.append(_stack([l_ys[i][k] for i in range(n)], item) if n else None)
        return list(carry) + stacked, list(l_carry) + l_stacked

    def backward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, out_cts: list[Ct]) -> list[Ct]:
        frames = frame.subs[idx]
        assert isinstance(frames, list)  # what forward kept: one frame per iteration
        lay = compat.scan_layout(eqn)
        nc, nk, n = lay.num_consts, lay.num_carry, lay.length
        carry_ct = list(out_cts[:nk])
        ys_ct = out_cts[nk:]
        consts_ct: list[Ct] = [None] * nc
        n_xs = len(eqn.invars) - nc - nk
        xs_ct: list[list[jax.Array | np.ndarray | None]] = [[None] * n for _ in range(n_xs)]
        xs_lab: list[list[Label | None]] = [[None] * n for _ in range(n_xs)]
        for step in range(n):
            i = step if lay.reverse else n - 1 - step  # the forward order, reversed
            y_i = [None if c is None else (c[0][i], _slice(c[1], i)) for c in ys_ct]
            sub = frames[i]
            assert sub is not None  # every iteration ran forward
            in_ct = rp.backward(sub, carry_ct + y_i)
            for k in range(nc):
                consts_ct[k] = rp.add_ct(consts_ct[k], in_ct[k])
            carry_ct = list(in_ct[nc:nc + nk])
            for k in range(n_xs):
                c = in_ct[nc + nk + k]
                if c is not None:
                    xs_ct[k][i], xs_lab[k][i] = c
        xs_out: list[Ct] = []
        for k in range(n_xs):
            if all(v is None for v in xs_ct[k]):
                xs_out.append(None)
                continue
            aval = compat.struct_of(eqn.invars[nc + nk + k].aval)
            item = tuple(aval.shape[1:])
            slices = [v if v is not None else jnp.zeros(item, aval.dtype) for v in xs_ct[k]]
            xs_out.append((jnp.stack(slices), _stack(xs_lab[k], item)))
        return consts_ct + carry_ct + xs_out


class Cond:
    def forward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, invals: list[ArrayLike],
                act_in: list[bool], labels: Labels) -> tuple[list[ArrayLike], Labels]:
        branches = compat.cond_layout(eqn).branches
        k = int(np.clip(int(np.asarray(invals[0])), 0, len(branches) - 1))
        body, consts = compat.jaxpr_parts(branches[k])
        sub = rp.forward(body, consts, invals[1:], act_in[1:], labels[1:],
                         frame.ctx + (Context("cond", eqn, k, len(branches)),))
        frame.subs[idx] = sub
        return sub.outputs(), sub.output_labels()

    def backward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, out_cts: list[Ct]) -> list[Ct]:
        predicate: list[Ct] = [None]
        return predicate + rp.backward(_sub(frame, idx), out_cts)


class While:
    def forward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, invals: list[ArrayLike],
                act_in: list[bool], labels: Labels) -> tuple[list[ArrayLike], Labels]:
        """Runs the loop one iteration at a time (births inside get the iteration number).

        Nothing is kept for the backward pass. After ``rp.max_while``
        iterations the rest of the loop runs whole, from the current carry.
        """
        lay = compat.while_layout(eqn)
        body, bconsts = compat.jaxpr_parts(lay.body)
        nc, nb = lay.cond_nconsts, lay.body_nconsts
        c_in, b_in, carry = invals[:nc], invals[nc:nc + nb], list(invals[nc + nb:])
        l_b, l_carry = list(labels[nc:nc + nb]), list(labels[nc + nb:])
        off = [False] * (nb + len(carry))
        k = 0
        while True:
            with compat.source_of(eqn):
                pred = compat.eval_jaxpr(lay.cond, list(c_in) + carry)[0]
            if not bool(np.asarray(pred)):
                return carry, l_carry
            if k >= rp.max_while:
                rest_in = list(c_in) + list(b_in) + carry
                return LEAF.forward(rp, frame, idx, eqn, rest_in, [False] * len(rest_in),
                                    list(labels[:nc + nb]) + l_carry)
            sub = rp.forward(body, bconsts, list(b_in) + carry, off, l_b + l_carry,
                             frame.ctx + (Context("while", eqn, k, 0),))
            carry, l_carry = sub.outputs(), sub.output_labels()
            k += 1

    def backward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, out_cts: list[Ct]) -> list[Ct]:
        return LEAF.backward(rp, frame, idx, eqn, out_cts)  # JAX's own error for an active while loop


class Call:
    def forward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, invals: list[ArrayLike],
                act_in: list[bool], labels: Labels) -> tuple[list[ArrayLike], Labels]:
        body, consts = call_body(eqn)  # type: ignore[misc]  # Call is chosen only when there is one
        label = _jit_label(eqn)
        ctx = frame.ctx + ((Context("jit", eqn, name=label),) if label else ())
        sub = rp.forward(body, consts, invals, act_in, labels, ctx)
        frame.subs[idx] = sub
        return sub.outputs(), sub.output_labels()

    def backward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, out_cts: list[Ct]) -> list[Ct]:
        return rp.backward(_sub(frame, idx), out_cts)


def _jit_label(eqn: compat.JaxprEqn) -> str:
    """The name of a jitted library function (``logsumexp``), for "inside `logsumexp`"; else ""."""
    name = eqn.params.get("name", "") if compat.is_jit(eqn) else ""
    if not name or name.startswith("_") or name in ("<lambda>", "fn", "f"):
        return ""
    return op_name(eqn).removeprefix(compat.FUNCTION_PREFIX)


HANDLERS: dict[str, Handler] = {"scan": Scan(), "cond": Cond(), "while": While()}
CALL: Handler = Call()
