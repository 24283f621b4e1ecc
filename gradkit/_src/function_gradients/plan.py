"""custom_gradient / custom_jvp: the user's function as a jax.custom_vjp or jax.custom_jvp.

Each trace of a decorated function's named op builds one :class:`Plan`: the
function traced for its outputs, and again for its closure (the residuals),
both closure-converted (:mod:`gradkit._src.function_gradients.closure`). Then:

* ``custom_jvp`` functions: ``jax.custom_jvp`` with ``jvp_fn``.
* ``custom_gradient``, mode ``"both"`` (the default), ``grad_fn`` linear in
  upstream: ``jax.custom_jvp`` whose rule is ``grad_fn`` transposed, so one
  rule serves ``jvp``/``jacfwd``/``hessian`` and (transposed back) ``grad``.
* ``custom_gradient`` otherwise (mode ``"vjp"``, a ``grad_fn`` that clips,
  branches on or squares upstream, or raises): ``jax.custom_vjp``, reverse
  mode only; :attr:`Plan.forward_problem` says why, for the error that
  forward mode then gets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gradkit._src import compat
from gradkit._src.core import named
from gradkit._src.errors import GradkitError
from gradkit._src.function_gradients import closure as cl
from gradkit._src.function_gradients.call import Call, Kind, as_tangent, is_multi, is_zero, zero_tangent

SymbolicZero = jax.custom_derivatives.SymbolicZero


def _strip_tracebacks(e: BaseException) -> BaseException:
    """Drops the frames an exception holds (they hold tracers), keeping its message and chain."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


@dataclasses.dataclass(frozen=True, eq=False)
class Plan:
    """The user's function traced once, for one trace of the named op.

    Holds jaxprs and no tracer, nor the user's function, which may close
    over one (the custom_vjp / custom_jvp functions keep the plan alive
    inside the program, so it must not keep the trace's values); it keeps
    the signature alive, for the dispatcher to read the program. The
    op is called with (differentiated leaves, captured by primal, captured by
    residuals); the bound leaves (a method's ``self``) are captured.
    """

    sig: named.Signature
    where: str  # what error messages call the function
    kind: Kind  # "jvp" for custom_jvp, else the custom_gradient's mode
    n_dyn: int  # differentiated leaves
    bound: bool  # a method: `self` is closed over
    n_primal: int
    n_residual: int
    primal: cl.JaxprFn
    residuals: cl.JaxprFn | None  # dyn -> what the closure captured (None: see `error`)
    closure: cl.ClosureStatic | None
    error: BaseException | None  # raised when differentiated, not on a forward-only call
    forward_problem: str | None  # why forward mode is unavailable (custom_gradient only)

    @classmethod
    def of(cls, call: Call, mode: Kind, all_dyn: Sequence[jax.Array]) -> tuple[Plan, list[jax.Array]]:
        """The plan and the tracers to pass after the differentiated leaves."""
        nb = call.n_bound_dyn
        bound = list(all_dyn[:nb])
        structs = [compat.struct_like(x) for x in all_dyn[nb:]]
        primal, cap_p = cl.JaxprFn.trace(lambda *d: call.run([*bound, *d])[2], structs)
        # Shapes only, no tracer: the plan outlives this trace.
        box: list[tuple[cl.ClosureStatic, list[jax.ShapeDtypeStruct]]] = []

        def residuals(*d: jax.Array) -> list[jax.Array]:
            outputs, closure, out = call.run([*bound, *d])
            if call.info.kind == "jvp":
                converted = cl.close_jvp_fn(call, closure, d, outputs, out)
            else:
                converted = cl.close_grad_fn(call, closure, d, outputs, out, is_multi(outputs))
            box.append((converted.static, [compat.struct_like(o, weak_type=False) for o in out]))
            return converted.captured

        res_fn: cl.JaxprFn | None = None
        cap_r: list[jax.Array] = []
        error: BaseException | None = None
        try:
            res_fn, cap_r = cl.JaxprFn.trace(residuals, structs)
        except Exception as e:  # e.g. a grad_fn that raises on purpose: only differentiation fails
            error = _strip_tracebacks(e)
        static = box[-1][0] if res_fn is not None else None
        problem: str | None = None
        if mode == "vjp":
            problem = "it has mode='vjp' (reverse mode only)"
        elif mode == "both":
            if static is None or res_fn is None:
                problem = f"its grad_fn raised {type(error).__name__}: {error}"
            else:
                # The residuals' avals (weak types kept): the outputs of the residual jaxpr.
                res_avals = [compat.struct_of(v.aval) for v in res_fn.jaxpr.outvars]
                reason = cl.forward_problem(static, res_avals, box[-1][1])
                if reason is not None:
                    problem = f"its grad_fn is not linear in the upstream gradients: {reason}"
        info = call.info
        kind: Kind = "jvp" if info.kind == "jvp" else mode
        plan = cls(call.sig, info.where, kind, call.n_dyn, call.bound > 0, len(cap_p), len(cap_r), primal,
                   res_fn, static, error, problem)
        return plan, [*cap_p, *cap_r]

    @property
    def n_captured(self) -> int:
        return self.n_primal + self.n_residual

    def split(self, args: Sequence[jax.Array]) -> tuple[list[jax.Array], list[jax.Array], list[jax.Array]]:
        args = list(args)
        n, n_p = self.n_dyn, self.n_primal
        return args[:n], args[n:n + n_p], args[n + n_p:]

    def check(self, perturbed: Sequence[bool]) -> None:
        if self.error is not None:
            raise self.error
        if any(perturbed[self.n_dyn:]):
            what = ("closes over a traced value that is being differentiated (a value computed outside the "
                    "function, not passed as an argument)")
            if self.bound:
                what += ", or holds one in `self`"
            raise GradkitError(
                f"{self.where} {what}. Its {self.closure_name} only defines derivatives for the function's "
                "arguments: pass that value as an argument (and give its gradient), or wrap it in "
                "jax.lax.stop_gradient if it needs none.")

    def run_primal(self, *args: jax.Array) -> list[jax.Array]:
        dyn, cap_p, _ = self.split(args)
        return self.primal(cap_p, dyn)

    def closure_at(self, args: Sequence[jax.Array]) -> cl.Closure:
        dyn, _, cap_r = self.split(args)
        assert self.residuals is not None and self.closure is not None
        return cl.Closure(self.closure, self.residuals(cap_r, dyn))

    @property
    def closure_name(self) -> str:
        return "jvp_fn" if self.kind == "jvp" else "grad_fn"

    def function(self) -> Callable[..., Sequence[jax.Array | np.ndarray]]:
        """The op as a jax.custom_jvp or jax.custom_vjp of (differentiated leaves, captured values)."""
        name = f"{'custom_jvp' if self.kind == 'jvp' else 'custom_gradient'}[{self.sig.name}]"
        if self.kind == "jvp" or (self.forward_problem is None and self.error is None):
            return _custom_jvp(self, name)
        return _custom_vjp(self, name)

    def forward_error(self) -> GradkitError:
        return GradkitError(
            f"{self.where} was differentiated in forward mode (jax.jvp, jacfwd, hessian, linearize), but "
            f"{self.forward_problem}. Forward mode of a custom_gradient function is its grad_fn transposed, "
            "which needs grad_fn to be linear in the upstream gradients, as every true gradient is. Use "
            "reverse mode (jax.grad, vjp, jacrev); or keep grad_fn linear in upstream (no clipping, "
            "branching on or squaring it: clip the gradient outside the function); or write the derivative "
            "with gk.custom_jvp.")


def _custom_vjp(plan: Plan, op_name: str) -> Callable[..., list[jax.Array]]:
    def op(*args: jax.Array) -> list[jax.Array]:
        return plan.run_primal(*args)

    op.__name__ = op.__qualname__ = op_name
    prim = jax.custom_vjp(op)

    def fwd(*args: jax.custom_derivatives.CustomVJPPrimal) -> tuple[list[jax.Array], cl.Closure]:
        plan.check([a.perturbed for a in args])
        vals = [a.value for a in args]
        out = prim(*vals)  # the custom function again: its rule holds at the next order too
        return out, plan.closure_at(vals)

    def bwd(closure: cl.Closure, cts: Sequence[jax.Array | SymbolicZero]) -> tuple[jax.Array | None, ...]:
        none = [None] * plan.n_captured
        if all(is_zero(c) for c in cts):
            return (*([None] * plan.n_dyn), *none)
        dense = [jnp.zeros(c.shape, c.dtype) if isinstance(c, SymbolicZero) else c for c in cts]
        return (*closure(dense), *none)

    prim.defvjp(fwd, bwd, symbolic_zeros=True)
    return prim


def _custom_jvp(plan: Plan, op_name: str) -> Callable[..., Sequence[jax.Array | np.ndarray]]:
    def op(*args: jax.Array) -> Sequence[jax.Array | np.ndarray]:
        return plan.run_primal(*args)

    op.__name__ = op.__qualname__ = op_name
    prim = jax.custom_jvp(op)

    def jvp(primals: tuple[jax.Array, ...], tangents: tuple[jax.Array | SymbolicZero, ...],
            ) -> tuple[Sequence[jax.Array | np.ndarray], list[jax.Array | np.ndarray]]:
        plan.check([not isinstance(t, SymbolicZero) for t in tangents])
        out = prim(*primals)  # the custom function again: its rule holds at the next order too
        closure = plan.closure_at(primals)
        dyn, t_dyn = list(primals[:plan.n_dyn]), list(tangents[:plan.n_dyn])
        if plan.kind != "jvp":
            return out, cl.transposed(closure, dyn, out, t_dyn)
        t_out = closure([as_tangent(t, x) for t, x in zip(t_dyn, dyn)])
        return out, [zero_tangent(o) if t is None else t for t, o in zip(t_out, out)]

    prim.defjvp(jvp, symbolic_zeros=True)
    return prim
