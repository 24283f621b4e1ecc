"""``audit(..., sweep=True)``: edge-value inputs that break a gradient that is finite where audited.

Each differentiated input is set to 0, ±1e-30, ±1, ±100, ±1e4 and ±1e30
(where its dtype holds them), everywhere and in its first element only; the
probes whose gradient is non-finite are reported, the first few with the op
and line where the NaN is born.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src.audit_program import Program
from gradkit._src.audit_report import Finding, Probe
from gradkit._src.describe import fmt_index

_EDGE = [("0", 0.0), ("1e-30", 1e-30), ("-1e-30", -1e-30), ("1", 1.0), ("-1", -1.0), ("100", 100.0),
         ("-100", -100.0), ("1e4", 1e4), ("-1e4", -1e4), ("1e30", 1e30), ("-1e30", -1e30)]
_LOCATED = 8  # probes located with a replay; the rest are listed

Locate = Callable[[Program], tuple[Finding, ...]]


def sweep(prog: Program, progress: Callable[[int, int, str], None] | None,
          locate: Locate) -> tuple[tuple[Probe, ...], int]:
    """The probes that break the gradient, and how many probes were tried.

    ``locate`` finds where the NaN is born for one probe (the audit's own
    investigation, without fixes).
    """
    flat = prog.flat()

    def run(*d: Any) -> tuple[Any, Any]:
        out, vjp = jax.vjp(flat, *d)
        g = vjp([jnp.ones_like(o) for o in out])
        fin = lambda xs: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))
        return fin(out), fin(g)
    run_j = jax.jit(run)
    plan = []
    for pos, name in enumerate(prog.dyn_names):
        x = np.asarray(prog.dyn[pos])
        for label, v in _EDGE:
            if float(jnp.finfo(x.dtype).max) < abs(v):
                continue
            everywhere = " (all elements)" if x.size > 1 else ""
            plan.append((pos, f"{name} = {label}{everywhere}", np.full(x.shape, v, x.dtype)))
            if x.size > 1:
                one = x.copy()
                one.reshape(-1)[0] = v
                plan.append((pos, f"{name}{fmt_index((0,) * x.ndim)} = {label} (one element)", one))
    broken = []
    for k, (pos, label, val) in enumerate(plan):
        if progress is not None:
            progress(k, len(plan), label)
        d = list(prog.dyn)
        d[pos] = jnp.asarray(val)
        vf, gf = run_j(*d)
        if not bool(gf):
            broken.append((pos, label, d, bool(vf)))
    if progress is not None:
        progress(len(plan), len(plan), "done")
    probes: list[Any] = []
    for pos, label, d, vf in broken:
        op = where = ""
        if len(probes) < _LOCATED:
            try:
                findings = locate(prog.at(d))
            except Exception:  # locating is a courtesy: the probe is reported either way
                findings = ()
            if findings:
                op, where = findings[0].op, findings[0].location
        probes.append(Probe(prog.dyn_names[pos], label, vf, False, op, where))
    return tuple(probes), len(plan)
