"""``gk.guard``: ``jax.value_and_grad`` that explains the first NaNs, at the cost of one reduction per step.

How it works, and why this way:

* **Finite calls.** Inside a compiled step the guard adds one check of the
  loss and the gradient leaves (``any(~isfinite(x))``, fused by XLA) and a
  ``lax.cond`` on it. Nothing leaves the device, and the step computes what
  the unguarded step computes, bit for bit, the optimizer update fused with
  the gradients included: each result is ``select(ok, x, x)``, which keeps
  JAX from dropping the check while XLA folds it to ``x``, so nothing stands
  between the gradients and whatever reads them. (XLA:CPU contracts
  multiply-adds into fused multiply-adds according to the code around them:
  the ``select(ok, x, barrier(x))`` this replaces changed an Adam step's
  parameters by up to 7.5e-9.) In ``"skip"`` mode the zeroing ``select``
  stays, and a fused update can differ in the last bits (``tests/test_guard_fused.py``).
* **Bad calls.** The false branch of the ``cond`` is a host callback that
  receives exactly that call's inputs (the only transfer off the device): a
  pure callback, which XLA keeps by its custom call's side-effect flag
  (:func:`gradkit._src.compat.kept_callback`; a JAX effect, as
  ``io_callback`` has, costs each call of the step 0.2-0.5 ms of dispatch).
  Under ``vmap`` the reporter is a ``custom_vmap``
  function (:mod:`gradkit._src.guard.host`), so the callback still runs only
  when some batch element is bad, once, and audits the bad elements only.
  What happens on the host — counting, the capped audits on a worker thread
  on the CPU, one report per birth place, the step index — is
  :mod:`gradkit._src.guard.audits`. Calls made outside any trace (eager)
  are checked on the host and audited in the calling thread.
* **The raise.** ``"raise"`` mode's :class:`NonFiniteGradientError` is
  raised in the host callback, and JAX cannot pass an exception through a
  compiled program: it reaches the caller as JAX's own error with the
  report in its text. The guard gets its own exception back wherever a call
  passes gradkit's code — its own call, the step :meth:`Guard.wrap` wraps,
  ``with guard:`` — by one mechanism (:mod:`gradkit._src.guard.delivery`).
  ``wrap`` is the idiom: it also numbers the steps.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.checks.describe import def_source, fn_name
from gradkit._src.core.args import Split, partition
from gradkit._src.errors import GradkitError
from gradkit._src.guard.audits import MAX_REPORTS, Auditor, Loss, key_impl, on_host
from gradkit._src.guard.delivery import converting, unwrap
from gradkit._src.guard.host import all_finite, depend, report_if_bad
from gradkit._src.guard.report import GuardReport, NonFiniteGradientError

__all__ = ["Guard", "GuardReport", "NonFiniteGradientError", "guard"]

MODES = ("raise", "skip", "report")

_P = ParamSpec("_P")
_R = TypeVar("_R")


def guard(loss_fn: Callable[..., object], *, argnums: int | Sequence[int] = 0, has_aux: bool = False,
          on_nonfinite: str = "raise", max_reports: int = MAX_REPORTS) -> Guard:
    """``jax.value_and_grad(loss_fn, argnums, has_aux)`` that audits its first non-finite steps.

    Use it where you use ``jax.value_and_grad``: eagerly, inside your
    ``jax.jit`` training step, under ``vmap``, with sharded inputs and inside
    ``shard_map``. While the loss and the gradients are finite it returns
    exactly what ``jax.value_and_grad`` returns and adds one fused finiteness
    check to the compiled step, which otherwise compiles as it does without
    the guard: a training step with the optimizer update fused in follows the
    unguarded trajectory bit for bit (``"raise"`` and ``"report"``; in
    ``"skip"`` mode the zeroing ``select`` sits in the fused update, which can
    then round differently in the last bits: up to 6e-8 after five Adam
    steps). When the loss or a gradient leaf is NaN or inf, the call is
    counted in :attr:`Guard.bad_calls` and, if it is one of
    the first ``max_reports`` bad calls, exactly that call's inputs are
    copied to the host and :func:`gradkit.audit` explains where the NaN was
    born and what fixes it; the report goes to :attr:`Guard.reports`. Then:

    * ``"raise"``: the step raises :class:`NonFiniteGradientError`, whose
      first line says where the NaN was born, which step it was and the
      loss, with the report below it (past the cap: the loss and a line
      saying the call was not audited). Call your jitted step through
      :meth:`Guard.wrap` (``step = guarded.wrap(jax.jit(step))``): JAX cannot
      carry an exception out of a compiled program, and a plain ``jax.jit``
      call delivers JAX's own ``INTERNAL: CpuCallback error …`` with the
      report inside it.
    * ``"skip"``: the gradients come back as zeros (an SGD/Adam update with
      them is a no-op, as with ``optax.apply_if_finite``) and training goes on.
    * ``"report"``: the values come back unchanged.

    What the guard keeps is bounded: at most ``max_reports`` audits in its
    life (an audit re-runs the loss op by op on the CPU, far dearer than a
    step), each from a host copy of the call's inputs that is dropped as soon
    as the audit has run; a report keeps the audit's text and the offending
    element values, not the arguments. An audit that finds its NaN born at
    the same places as an earlier report (same ops, same source lines) makes
    no new report but counts in that one's :attr:`GuardReport.repeats`. Bad
    calls past the cap are only counted: they copy nothing, and reading
    :attr:`Guard.reports` never waits for more than the capped audits.

    The audit runs on the CPU device from host copies, never on the device
    the step is using. Under ``vmap`` only the bad batch elements are audited
    (at most 4 per call, each counting against ``max_reports``). Inside
    ``shard_map`` each device audits its own shard: a loss with collectives
    (``psum``) cannot be re-run outside the map, and its report says so.

    Args:
      loss_fn: returns a scalar loss (``(loss, aux)`` with ``has_aux``).
      argnums: which positional arguments to differentiate, as in ``jax.value_and_grad``.
      has_aux: ``loss_fn`` returns ``(loss, aux)``; only the loss is checked.
      on_nonfinite: ``"raise"`` (default), ``"skip"`` or ``"report"``.
      max_reports: how many bad calls (batch elements, under ``vmap``) to
        audit, the first ones (default 4; 0 only counts them).

    Returns:
      A :class:`Guard`: call it as ``jax.value_and_grad(loss_fn)`` inside your
      step, call the step through ``guard.wrap(step)``; read ``.reports`` and
      ``.bad_calls``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> def loss(w, x):
      ...     return jnp.sum(jnp.sqrt(w * x))
      >>> g = gk.guard(loss, on_nonfinite="skip")
      >>> step = g.wrap(jax.jit(lambda w, x: g(w, x)[1]))
      >>> step(jnp.ones(2), jnp.ones(2)).tolist()
      [0.5, 0.5]
      >>> step(jnp.ones(2), jnp.array([1.0, 0.0])).tolist()  # d sqrt at 0: inf -> skipped
      [0.0, 0.0]
      >>> r = g.reports[0]
      >>> r.audit.findings[0].op, str(r.audit.findings[0].root.elements[0]), r.call
      ('sqrt', '(w * x)[1] = 0', 2)

      In ``"raise"`` mode the wrapped step raises the guard's error:

      >>> g = gk.guard(loss)
      >>> step = g.wrap(jax.jit(lambda w, x: g(w, x)[1]))
      >>> try:
      ...     step(jnp.ones(2), jnp.array([1.0, 0.0]))
      ... except gk.NonFiniteGradientError as e:
      ...     print(str(e).splitlines()[0].split(",")[0])
      [gradkit] guard(loss): NaN/inf born at `sqrt`

      Three bad calls with ``max_reports=2``: two audits, which find the same
      birth place (one report, one repeat); the third call is only counted.

      >>> g = gk.guard(loss, on_nonfinite="skip", max_reports=2)
      >>> step = jax.jit(lambda w, x: g(w, x)[1])
      >>> for _ in range(3):
      ...     _ = step(jnp.ones(2), jnp.array([1.0, 0.0]))
      >>> g.bad_calls, len(g.reports), g.reports[0].repeats
      (3, 1, 1)
    """
    return Guard(loss_fn, argnums=argnums, has_aux=has_aux, on_nonfinite=on_nonfinite, max_reports=max_reports)


def _check_argnums(argnums: object, name: str) -> int | tuple[int, ...]:
    if isinstance(argnums, int) and not isinstance(argnums, bool):
        return argnums
    if isinstance(argnums, (tuple, list)) and argnums and \
            all(isinstance(a, int) and not isinstance(a, bool) for a in argnums):
        return tuple(argnums)
    raise GradkitError(f"guard({name}): argnums must be an int or a non-empty tuple of ints, as in "
                       f"jax.value_and_grad, got {argnums!r}.")


class Guard:
    """A guarded ``jax.value_and_grad``; made by :func:`guard`.

    Call it as you would call ``jax.value_and_grad(loss_fn, argnums, has_aux)``,
    inside your training step, and call the step through :meth:`wrap`: the
    wrapped step raises the guard's :class:`NonFiniteGradientError` itself
    (``"raise"`` mode) and numbers the steps in the reports.

    Attributes:
      fn: the guarded loss function.
      argnums, has_aux, on_nonfinite, max_reports: as given to :func:`guard`.
      step_errors: what a compiled step called without :meth:`wrap` raises in
        ``"raise"`` mode: JAX's own types (``jax.errors.JaxRuntimeError``,
        ``ValueError``; see ``compat.CALLBACK_ERRORS``),
        plus :class:`NonFiniteGradientError`.
    """

    step_errors: tuple[type[BaseException], ...] = (*compat.CALLBACK_ERRORS, NonFiniteGradientError)

    def __init__(self, fn: Callable[..., object], *, argnums: int | Sequence[int] = 0, has_aux: bool = False,
                 on_nonfinite: str = "raise", max_reports: int = MAX_REPORTS):
        if not callable(fn):
            raise GradkitError(f"guard: expected a loss function, got {type(fn).__name__} {fn!r}.")
        name = fn_name(fn)
        if on_nonfinite not in MODES:
            raise GradkitError(
                f"guard({name}): unknown on_nonfinite={on_nonfinite!r}; use 'raise' (stop the step with the "
                "report), 'skip' (zero gradients, keep training) or 'report' (values unchanged).")
        if not isinstance(has_aux, bool):
            raise GradkitError(f"guard({name}): has_aux must be True or False, got {has_aux!r}.")
        if not isinstance(max_reports, (int, np.integer)) or isinstance(max_reports, bool) or max_reports < 0:
            raise GradkitError(f"guard({name}): max_reports must be an int >= 0 (how many bad calls to audit; "
                               f"0 only counts them), got {max_reports!r}.")
        self.fn = fn
        self.argnums = _check_argnums(argnums, name)
        self.has_aux = has_aux
        self.on_nonfinite = on_nonfinite
        self.max_reports = int(max_reports)
        self._name = name
        self._source = def_source(fn)
        self._auditor = Auditor(Loss(fn, self.argnums, has_aux, name), on_nonfinite, self.max_reports)
        functools.update_wrapper(self, fn, updated=())

    def __repr__(self) -> str:
        return f"gk.guard({self._name}, on_nonfinite={self.on_nonfinite!r}, max_reports={self.max_reports})"

    @property
    def reports(self) -> list[GuardReport]:
        """The reports of the audited bad calls, oldest first, one per birth place of the NaN.

        At most ``max_reports`` (see :attr:`GuardReport.repeats` for audits
        that shared one). Waits for the steps already dispatched to run their
        callbacks (``jax.effects_barrier``) and for the audits in flight, of
        which there are never more than ``max_reports``. On jax 0.8 with
        sharded inputs the barrier can return before a step's callback has
        started: use the step's results first (``float(loss)``,
        ``block_until_ready``), as a training loop does.
        """
        self._sync()
        return self._auditor.reports()

    @property
    def bad_calls(self) -> int:
        """How many guarded calls had a non-finite loss or gradient, audited or not, compiled calls included.

        A ``vmap``-ed call with bad elements counts once; inside ``shard_map``
        each device whose shard is bad counts its own. Waits, as
        :attr:`reports` does, for the callbacks of the steps already
        dispatched, but not for their audits.
        """
        self._sync()
        return self._auditor.bad_calls()

    @property
    def calls(self) -> int:
        """How many eager (host-visible) calls were guarded; compiled calls are not counted."""
        return self._auditor.calls

    def _sync(self) -> None:
        """Waits for the host callbacks of the steps already dispatched."""
        try:
            jax.effects_barrier()
        except Exception:
            pass
        self._auditor.wait_for_callbacks()  # jax 0.8 with sharded inputs returns from the barrier mid-callback

    # ------------------------------------------------------------------ the step boundary

    def wrap(self, step: Callable[_P, _R]) -> Callable[_P, _R]:
        """``step`` (your jitted training step) raising the guard's own :class:`NonFiniteGradientError`.

        The way to call a guarded step. A compiled step can only fail with
        the error JAX makes of the host callback's (``INTERNAL: CpuCallback
        error …``, the report inside it); the wrapped step re-raises the
        guard's exception in its place, from the step's call, with JAX's
        error as its ``__context__`` (any guard's exception: a step may hold
        several). It also counts the calls, so that a report knows its step
        (:attr:`GuardReport.call`).

        In ``"raise"`` mode the wrapped step waits for its results
        (``jax.block_until_ready``) before it returns: on a GPU or TPU the
        callback's error otherwise arrives at the first use of the results,
        after the call (seen on an H200). In ``"skip"`` and ``"report"``
        modes it returns at once, as the step does; on an accelerator a
        report then knows its step only if the step had finished when its
        call returned.

        Use it as a decorator over ``@jax.jit`` (or ``nnx.jit``,
        ``eqx.filter_jit``, a ``shard_map``-ed step): the wrapped function
        keeps the step's name and docstring, and ``__wrapped__`` is the step.
        ``with guard:`` around calls of an unwrapped step re-raises the
        guard's error the same way, without the count.

        Examples:
          >>> import jax, jax.numpy as jnp, gradkit as gk
          >>> g = gk.guard(lambda w, x: jnp.sum(jnp.log(w * x)))
          >>> @g.wrap
          ... @jax.jit
          ... def step(w, x):
          ...     value, grad = g(w, x)
          ...     return w - 0.1 * grad, value
          >>> w, _ = step(jnp.ones(2), jnp.ones(2))
          >>> try:
          ...     step(w, jnp.array([1.0, 0.0]))
          ... except gk.NonFiniteGradientError as e:
          ...     print(type(e).__name__, e.reports[0].call, e.reports[0].audit.findings[0].op)
          NonFiniteGradientError 2 log
        """
        if not callable(step):
            raise GradkitError(f"guard({self._name}).wrap: expected the step function, got {type(step).__name__}.")

        wait = self.on_nonfinite == "raise"
        auditor = self._auditor

        @functools.wraps(step)
        def guarded_step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            if any(isinstance(x, compat.Tracer) for x in jax.tree_util.tree_leaves((args, kwargs))):
                with converting():  # called inside a trace: no step of its own to count or wait for
                    return step(*args, **kwargs)
            with auditor.stepping() as returned, converting():
                out = step(*args, **kwargs)
                if wait:
                    out = jax.block_until_ready(out)
                returned(out)
                return out

        return guarded_step

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> Literal[False]:
        """Re-raises a guard's :class:`NonFiniteGradientError` in place of the error JAX made of it."""
        error = unwrap(exc)
        if error is None:
            return False
        # JAX's traceback: where in the block it raised (the step's call, or the first use of its results)
        raise error.with_traceback(tb) from None

    # ------------------------------------------------------------------ the call

    def _checked(self, *args: object, **kwargs: object) -> object:
        out = self.fn(*args, **kwargs)
        loss = out
        where = f"{self._name}" + (f" (defined at {self._source})" if self._source else "")
        if self.has_aux:
            if not (isinstance(out, (tuple, list)) and len(out) == 2):
                raise GradkitError(f"guard({self._name}, has_aux=True): {where} must return (loss, aux), got "
                                   f"{type(out).__name__}.")
            loss = out[0]
        shape, dtype = np.shape(loss), getattr(loss, "dtype", None)
        if shape != ():
            raise GradkitError(
                f"guard({self._name}): the loss must be a scalar, but {where} returned shape {shape}. Reduce it "
                "(jnp.mean / jnp.sum), or return (loss, aux) with has_aux=True.")
        if dtype is not None and not jnp.issubdtype(dtype, jnp.floating):
            raise GradkitError(f"guard({self._name}): the loss must be a real floating-point scalar, but {where} "
                               f"returned {dtype}.")
        return out

    def __call__(self, *args: object, **kwargs: object) -> tuple[Any, Any]:
        with converting():  # an eager vmap runs the callback inside this call
            return self._call(args, kwargs)

    def _call(self, args: tuple[object, ...], kwargs: dict[str, object]) -> tuple[Any, Any]:
        value, grads = jax.value_and_grad(self._checked, self.argnums, self.has_aux)(*args, **kwargs)
        loss = value[0] if self.has_aux else value
        leaves = [loss, *jax.tree_util.tree_leaves(grads)]
        split, dyn = partition((args, kwargs))
        if not any(isinstance(x, compat.Tracer) for x in [*leaves, *dyn]):
            return self._eager(value, grads, leaves, split, dyn)
        keys = [key_impl(x) for x in dyn]
        moved = [lax.stop_gradient(jax.random.key_data(x) if k is not None else x) for x, k in zip(dyn, keys)]
        host = functools.partial(on_host, weakref.ref(self._auditor), split, tuple(keys))
        ok = report_if_bad(host, all_finite(leaves), [lax.stop_gradient(loss), *moved])
        # Every result depends on the callback's flag, else XLA drops the (pure) callback.
        zero = self.on_nonfinite == "skip"
        grads = jax.tree_util.tree_map(lambda g: depend(ok, g, zero), grads)
        loss = depend(ok, loss)
        return ((loss, value[1]) if self.has_aux else loss), grads

    def _eager(self, value: object, grads: object, leaves: list[jax.Array], split: Split,
               dyn: list[ArrayLike]) -> tuple[Any, Any]:
        call = self._auditor.eager_call()
        if bool(_all_finite_jit(leaves)):
            return value, grads
        error = self._auditor.eager(call, leaves[0], split, dyn)
        if self.on_nonfinite == "raise":
            raise error
        if self.on_nonfinite == "skip":
            grads = jax.tree_util.tree_map(jnp.zeros_like, grads)
        return value, grads


_all_finite_jit = jax.jit(all_finite)
