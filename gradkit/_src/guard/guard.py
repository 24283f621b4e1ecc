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
* **Where the audit runs.** JAX work started from inside a host callback can
  deadlock when it needs the device stream the callback is blocking (GPU,
  TPU). The callback therefore only copies the inputs to host memory; the
  audit runs on a worker thread, **on the CPU device**, from those copies: it
  never queues work behind the blocked step. In ``"skip"`` and ``"report"``
  modes the callback returns at once and the audit finishes in the
  background (reading :attr:`Guard.reports` waits for the audits in flight). In ``"raise"``
  mode the callback waits for the audit (at most ``_WAIT_S`` seconds, so a
  stall can never hang the step for good) and raises with the report in the
  message. Calls made outside any trace (eager) are checked on the host and
  audited in the calling thread.
* **Bounded.** An audit re-runs the loss op by op (and checks its fix with
  finite differences), far dearer than a step, and its inputs are a copy of
  the step's. So a guard audits at most ``max_reports`` bad calls, the first
  ones; later bad calls are counted (:attr:`Guard.bad_calls`) and copy
  nothing (the callback still receives the step's inputs, as every bad call
  does, and drops them at once). The host copies live only until their audit
  has run: a report keeps the audit's text and the few offending element
  values, never the arguments. Audits whose NaN was born at the same places
  (op and source line) share one report, which counts the others
  (:attr:`GuardReport.repeats`).
* **Call index.** Counting the calls of a compiled step would take a host
  round trip on every step, which the finite path must not pay; eager calls
  are counted, traced ones report ``call=None``.

The raise mode's exception is :class:`NonFiniteGradientError` (a
:class:`GradkitError` and a ``FloatingPointError``, as ``jax_debug_nans``
raises), whose first line says where the NaN was born. An eager call raises
it as is. Inside a ``jax.jit``-ed step it is raised in the host callback,
and JAX cannot pass an exception through a compiled program: it reaches the
caller as ``jax.errors.JaxRuntimeError`` (a step's first call) or
``ValueError`` (later calls, JAX's C++ dispatch path), ``INTERNAL:
CpuCallback error calling callback:`` and the callback's stack before the
report. There is no hook in JAX to change that type or text at a plain
``jax.jit`` call (JAX issue 26102; Equinox's ``error_if`` likewise needs its
own ``filter_jit``), so the guard keeps each exception its callbacks raise
and hands it back where Python code of gradkit sees JAX's: ``with guard:``
around the steps (or a step called through :meth:`Guard.wrap`) re-raises the
guard's own :class:`NonFiniteGradientError` in place of JAX's error,
wherever in the block JAX raises it (the step's call on the CPU; the first
use of its results on an accelerator). :attr:`Guard.step_errors` lists
JAX's types, for code without the block.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import types
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, ParamSpec, TypeVar, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.audit import audit
from gradkit._src.audit.report import AuditReport
from gradkit._src.checks.describe import def_source, fmt, fn_name, one_line
from gradkit._src.core.args import Split, partition
from gradkit._src.errors import GradkitError
from gradkit._src.guard.host import Levels, all_finite, bad_elements, bad_indices, depend, report_if_bad

__all__ = ["Guard", "GuardReport", "NonFiniteGradientError", "guard"]

MODES = ("raise", "skip", "report")
_WAIT_S = 300.0  # raise mode: longest wait for the audit inside the callback
_AUDITS_PER_CALL = 4  # bad batch elements audited per call at most (the rest are listed in the note)
MAX_REPORTS = 4  # default of guard(max_reports=): audits per guard
_LISTED = 8  # unaudited batch indices named in a report's note
_KEPT_ERRORS = 8  # raised by callbacks, kept for `with guard:` to re-raise (the latest ones)
_UNWRAP_HINT = ("[gradkit] JAX delivers an error raised inside a compiled step as its own, with the callback's "
                "stack first; run the steps inside `with guard:` (your gk.guard object) or call the step through "
                "guard.wrap(step) to get this gradkit.NonFiniteGradientError itself.")


_P = ParamSpec("_P")
_R = TypeVar("_R")

class NonFiniteGradientError(GradkitError, FloatingPointError):
    """The loss or a gradient of a guarded call is NaN or inf (``on_nonfinite="raise"``).

    A :class:`GradkitError` and a ``FloatingPointError`` (what ``jax_debug_nans``
    raises). The first line of the message says where the NaN or inf was born
    (source line, op, what it did) and which call it was; the audit's full
    report follows.

    Raised as is by an eager call. Inside a compiled step it is raised in the
    host callback, and JAX delivers it as ``jax.errors.JaxRuntimeError`` or
    ``ValueError`` (see :attr:`Guard.step_errors`) whose message contains
    this one's; run the steps inside ``with guard:`` (or through
    :meth:`Guard.wrap`) to get this exception itself.

    Attributes:
      reports: the :class:`GuardReport` of each audited bad element of the call;
        empty when the call was not audited (the guard had run its ``max_reports`` audits).

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> g = gk.guard(lambda w, x: jnp.sum(jnp.sqrt(w * x)))
      >>> step = jax.jit(lambda w, x: g(w, x)[1])
      >>> try:
      ...     with g:
      ...         step(jnp.ones(2), jnp.array([1.0, 0.0]))
      ... except gk.NonFiniteGradientError as e:
      ...     print(str(e).splitlines()[0].split(",")[0])  # then the source line, and what `sqrt` did
      [gradkit] guard(<lambda>): NaN/inf born at `sqrt`
    """

    def __init__(self, message: str, reports: Sequence[GuardReport] = ()):
        super().__init__(message)
        self.reports = tuple(reports)


@dataclasses.dataclass(frozen=True)
class GuardReport:
    """One non-finite guarded call (one batch element of it, under ``vmap``), audited.

    A report holds text and small values only (the audit, with the few input
    elements where the NaN was born): not the call's arguments, which the
    guard copies for the audit and drops when it has run.

    Attributes:
      call: the call's index (1 for the first guarded call), for calls the host
        sees (eager); ``None`` inside a compiled step, whose calls are not counted.
      batch_index: the element's index under ``vmap`` (outermost axis first); ``()`` otherwise.
      loss: the loss value there, as text (``"nan"``, ``"0.6931"``).
      audit: the :func:`audit` of the loss at exactly these inputs (``None`` if it could not run).
      note: what else to know (elements not audited, an audit that failed or found nothing).
      repeats: how many later audits found their NaN born at the same places
        (the same ops at the same source lines) and so made no report of their own.
    """

    call: int | None
    batch_index: tuple[int, ...]
    loss: str
    audit: AuditReport | None
    note: str = ""
    repeats: int = 0

    @property
    def headline(self) -> str:
        """The report in one line (which call, which element, the loss)."""
        where = f"call {self.call}" if self.call is not None else "a compiled call"
        element = f", batch element {self.batch_index}" if self.batch_index else ""
        return f"non-finite loss or gradient at {where}{element}: loss = {self.loss}"

    def __str__(self) -> str:
        lines = [self.headline]
        if self.audit is not None:
            lines.append(str(self.audit))
        if self.note:
            lines.append(f"note: {self.note}")
        if self.repeats:
            lines.append(f"repeats: {self.repeats} later audit(s) found the same birth place")
        return "\n".join(lines)


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
      first line says where the NaN was born, with the report below it (past
      the cap: the loss and a line saying the call was not audited). Inside a
      compiled step JAX wraps it in its own ``jax.errors.JaxRuntimeError`` or
      ``ValueError`` (``INTERNAL: CpuCallback error …`` and the callback's
      stack first); run the steps inside ``with guard:``, or call the step
      through ``guard.wrap(step)``, to get :class:`NonFiniteGradientError`
      itself, or catch ``guard.step_errors``.
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
      A :class:`Guard`: call it as ``jax.value_and_grad(loss_fn)``; read
      ``.reports`` and ``.bad_calls``; ``with guard:`` around the steps.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> def loss(w, x):
      ...     return jnp.sum(jnp.sqrt(w * x))
      >>> g = gk.guard(loss, on_nonfinite="skip")
      >>> step = jax.jit(lambda w, x: g(w, x)[1])
      >>> step(jnp.ones(2), jnp.ones(2)).tolist()
      [0.5, 0.5]
      >>> step(jnp.ones(2), jnp.array([1.0, 0.0])).tolist()  # d sqrt at 0: inf -> skipped
      [0.0, 0.0]
      >>> r = g.reports[0]
      >>> r.audit.findings[0].op, str(r.audit.findings[0].root.elements[0])
      ('sqrt', '(w * x)[1] = 0')

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

    Call it as you would call ``jax.value_and_grad(loss_fn, argnums, has_aux)``.
    Used as a context manager around the steps (``with guard:``), it turns
    the error JAX makes of a compiled step's raise into the guard's own
    :class:`NonFiniteGradientError` (see :meth:`wrap`).

    Attributes:
      fn: the guarded loss function.
      argnums, has_aux, on_nonfinite, max_reports: as given to :func:`guard`.
      step_errors: what a compiled step raises in ``"raise"`` mode, for
        ``except guard.step_errors``: ``jax.errors.JaxRuntimeError`` (a step's
        first call) and ``ValueError`` (what JAX's fast C++ dispatch path, which
        later calls take, makes of a failed host callback), plus
        :class:`NonFiniteGradientError` for eager calls.
    """

    step_errors: tuple[type[BaseException], ...] = (jax.errors.JaxRuntimeError, ValueError, NonFiniteGradientError)

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
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no host callback is running
        self._in_callback = 0
        self._reports: list[GuardReport] = []
        self._report_of: dict[tuple[Hashable, ...], int] = {}  # birth places -> index in _reports
        self._pending: list[concurrent.futures.Future[GuardReport]] = []  # audits in flight (max_reports at most)
        self._raised: collections.deque[NonFiniteGradientError] = collections.deque(maxlen=_KEPT_ERRORS)
        self._calls = 0
        self._bad_calls = 0
        self._audits = 0  # audits started, max_reports at most
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
        while True:
            with self._lock:
                pending = [f for f in self._pending if not f.done()]
                self._pending = pending
            if not pending:
                break
            concurrent.futures.wait(pending)
        with self._lock:
            return list(self._reports)

    @property
    def bad_calls(self) -> int:
        """How many guarded calls had a non-finite loss or gradient, audited or not, compiled calls included.

        A ``vmap``-ed call with bad elements counts once; inside ``shard_map``
        each device whose shard is bad counts its own. Waits, as
        :attr:`reports` does, for the callbacks of the steps already
        dispatched, but not for their audits.
        """
        self._sync()
        with self._lock:
            return self._bad_calls

    @property
    def calls(self) -> int:
        """How many eager (host-visible) calls were guarded; compiled calls are not counted."""
        return self._calls

    def _sync(self) -> None:
        """Waits for the host callbacks of the steps already dispatched."""
        try:
            jax.effects_barrier()
        except Exception:
            pass
        with self._idle:  # some JAX versions (0.8, sharded inputs) return from the barrier mid-callback
            self._idle.wait_for(lambda: self._in_callback == 0, timeout=_WAIT_S)

    # ------------------------------------------------------------------ JAX's error -> the guard's own

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: types.TracebackType | None) -> Literal[False]:
        """Re-raises the guard's :class:`NonFiniteGradientError` in place of the error JAX made of it."""
        error = self._unwrap(exc)
        if error is None:
            return False
        # JAX's traceback: where in the block it raised (the step's call, or the first use of its results)
        raise error.with_traceback(tb) from None

    def wrap(self, step: Callable[_P, _R]) -> Callable[_P, _R]:
        """``step`` (your jitted training step) raising the guard's own :class:`NonFiniteGradientError`.

        A compiled step can only fail with the error JAX makes of the host
        callback's (``JaxRuntimeError``/``ValueError``, ``INTERNAL: CpuCallback
        error …``); the wrapped step calls ``step`` inside ``with self:``,
        which re-raises the guard's exception instead, from the step's call.
        In ``"raise"`` mode the wrapped step waits for its results
        (``jax.block_until_ready``) before it returns: on a GPU or TPU the
        callback's error otherwise arrives at the first use of the results,
        after the call (seen on an H200). That wait gives up overlapping
        the next step's dispatch with this one; to keep it, call the step
        unwrapped with ``with guard:`` around the loop, which re-raises the
        guard's error wherever in the block JAX raises it.

        Examples:
          >>> import jax, jax.numpy as jnp, gradkit as gk
          >>> g = gk.guard(lambda w, x: jnp.sum(jnp.log(w * x)))
          >>> step = g.wrap(jax.jit(lambda w, x: g(w, x)))
          >>> try:
          ...     step(jnp.ones(2), jnp.array([1.0, 0.0]))
          ... except gk.NonFiniteGradientError as e:
          ...     print(type(e).__name__, len(e.reports), e.reports[0].audit.findings[0].op)
          NonFiniteGradientError 1 log
        """
        if not callable(step):
            raise GradkitError(f"guard({self._name}).wrap: expected the step function, got {type(step).__name__}.")

        wait = self.on_nonfinite == "raise"

        @functools.wraps(step)
        def guarded_step(*args: _P.args, **kwargs: _P.kwargs) -> _R:
            with self:
                out = step(*args, **kwargs)
                return jax.block_until_ready(out) if wait else out

        return guarded_step

    def _unwrap(self, exc: BaseException | None) -> NonFiniteGradientError | None:
        """The exception a callback of this guard raised, if ``exc`` is the error JAX made of it."""
        if exc is None or isinstance(exc, NonFiniteGradientError) or not isinstance(exc, Exception):
            return None
        text = str(exc)
        with self._lock:
            for error in self._raised:
                if str(error) in text:
                    self._raised.remove(error)
                    return error
        return None

    def _deliver(self, error: NonFiniteGradientError) -> NonFiniteGradientError:
        """What the callback raises: ``error``, kept for :meth:`__exit__`, with a line on how to get it unwrapped."""
        with self._lock:
            self._raised.append(error)
        return NonFiniteGradientError(f"{error}\n{_UNWRAP_HINT}", error.reports)

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
        value, grads = jax.value_and_grad(self._checked, self.argnums, self.has_aux)(*args, **kwargs)
        loss = value[0] if self.has_aux else value
        leaves = [loss, *jax.tree_util.tree_leaves(grads)]
        split, dyn = partition((args, kwargs))
        if not any(isinstance(x, compat.Tracer) for x in [*leaves, *dyn]):
            return self._eager(value, grads, leaves, split, dyn)
        keys = [_key_impl(x) for x in dyn]
        moved = [lax.stop_gradient(jax.random.key_data(x) if k is not None else x) for x, k in zip(dyn, keys)]
        host = functools.partial(_host, weakref.ref(self), split, tuple(keys))
        ok = report_if_bad(host, all_finite(leaves), [lax.stop_gradient(loss), *moved])
        # Every result depends on the callback's flag, else XLA drops the (pure) callback.
        zero = self.on_nonfinite == "skip"
        grads = jax.tree_util.tree_map(lambda g: depend(ok, g, zero), grads)
        loss = depend(ok, loss)
        return ((loss, value[1]) if self.has_aux else loss), grads

    def _eager(self, value: object, grads: object, leaves: list[jax.Array], split: Split,
               dyn: list[ArrayLike]) -> tuple[Any, Any]:
        with self._lock:
            self._calls += 1
            call = self._calls
        if bool(_all_finite_jit(leaves)):
            return value, grads
        number, audits = self._admit(1)
        reports = []
        if audits:
            report, key = self._audit(call, (), _host_copy(leaves[0]), split, [_host_copy(x) for x in dyn])
            self._keep(report, key)
            reports.append(report)
            text = str(report)
        else:
            text = self._unaudited(call, (), leaves[0], number)
        if self.on_nonfinite == "raise":
            raise NonFiniteGradientError(_message(self._name, reports, text), reports)
        if self.on_nonfinite == "skip":
            grads = jax.tree_util.tree_map(jnp.zeros_like, grads)
        return value, grads

    # ------------------------------------------------------------------ the bad path (host)

    def _admit(self, wanted: int) -> tuple[int, int]:
        """Counts a bad call; returns its number among the bad calls and how many audits it may start."""
        with self._lock:
            self._bad_calls += 1
            audits = max(0, min(wanted, self.max_reports - self._audits))
            self._audits += audits
            return self._bad_calls, audits

    def _unaudited(self, call: int | None, index: tuple[int, ...], loss: ArrayLike, number: int) -> str:
        headline = GuardReport(call, index, _fmt_loss(loss), None).headline
        return (f"{headline}. Not audited: this guard audits its first max_reports={self.max_reports} bad "
                f"call(s) (read guard.reports); this is bad call {number}.")

    def _on_bad(self, split: Split, keys: tuple[Hashable | None, ...], levels: Levels, ok: np.ndarray, loss: np.ndarray,
                leaves: Sequence[np.ndarray]) -> NonFiniteGradientError | None:
        """In the callback: count the call, copy the bad elements to audit and queue their audits.

        Returns what the step is to raise (raise mode: after waiting for the
        audits), else None.
        """
        indices = bad_indices(ok)
        if not indices:
            return None
        number, audits = self._admit(min(len(indices), _AUDITS_PER_CALL))
        if not audits:
            if self.on_nonfinite != "raise":
                return None
            (loss_i,), = bad_elements(levels, indices[:1], [loss])
            text = self._unaudited(None, indices[0], loss_i, number)
            return NonFiniteGradientError(_message(self._name, (), text))
        rest = indices[audits:]
        note = (f"{len(rest)} more bad batch element(s) in this call were not audited: "
                + ", ".join(map(str, rest[:_LISTED])) + (", ..." if len(rest) > _LISTED else "") + ".") if rest else ""
        futures = self._submit(split, keys, levels, indices[:audits], [loss, *leaves], note)
        del loss, leaves  # the queued audits hold the only copies, until they have run
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + futures
        if self.on_nonfinite != "raise":
            return None
        done, _ = concurrent.futures.wait(futures, timeout=_WAIT_S)
        reports = [f.result() for f in futures if f in done]
        text = "\n".join(str(r) for r in reports) if reports else (
            f"the audit did not finish within {_WAIT_S:.0f} s; it goes on in the background: read guard.reports.")
        return NonFiniteGradientError(_message(self._name, reports, text), reports)

    def _submit(self, split: Split, keys: tuple[Hashable | None, ...], levels: Levels,
                indices: Sequence[tuple[int, ...]], leaves: Sequence[np.ndarray],
                note: str) -> list[concurrent.futures.Future[GuardReport]]:
        """Queues the audit of each element at ``indices``, from host copies of its leaves."""
        futures = []
        for k, (index, (loss_i, *leaves_i)) in enumerate(zip(indices, bad_elements(levels, indices, leaves))):
            dyn = [_wrap_key(x, i) if i is not None else x for x, i in zip(leaves_i, keys)]
            futures.append(_executor().submit(self._audit_and_keep, None, index, loss_i, split, dyn,
                                              note if k == 0 else ""))
        return futures

    def _audit_and_keep(self, call: int | None, index: tuple[int, ...], loss: np.ndarray, split: Split,
                        dyn: Sequence[ArrayLike], note: str) -> GuardReport:
        report, key = self._audit(call, index, loss, split, dyn, note)
        self._keep(report, key)
        return report

    def _keep(self, report: GuardReport, key: tuple[Hashable, ...]) -> None:
        """Adds ``report``, or counts it in the earlier report whose NaN was born at the same places."""
        with self._lock:
            i = self._report_of.get(key)
            if i is None:
                self._report_of[key] = len(self._reports)
                self._reports.append(report)
            else:
                self._reports[i] = dataclasses.replace(self._reports[i], repeats=self._reports[i].repeats + 1)

    def _audit(self, call: int | None, index: tuple[int, ...], loss: ArrayLike, split: Split,
               dyn: Sequence[ArrayLike], note: str = "") -> tuple[GuardReport, tuple[Hashable, ...]]:
        """The report of the loss at ``dyn`` (host copies), and the key of where its NaN was born."""
        args, kwargs = split.combine(dyn)
        fn = self.fn
        has_aux = self.has_aux

        @functools.wraps(fn)
        def scalar_loss(*a: object) -> object:
            out = fn(*a, **kwargs)
            return cast(Sequence[object], out)[0] if has_aux else out  # (loss, aux): checked by _checked

        result: AuditReport | None = None
        failure = ""
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                result = audit(scalar_loss, *args, argnums=self.argnums)
        except Exception as e:
            failure = f"the audit could not run: {type(e).__name__}: {one_line(str(e))}"
            note = _join(note, failure + (" (a loss with collectives such as psum cannot be re-run outside its "
                                          "shard_map)" if "axis name" in str(e) else ""))
        if result is not None and result.finite and not _nonfinite(loss):
            note = _join(note, "the audit, re-running the loss op by op on the CPU at these inputs, found the "
                               "gradient finite: the NaN/inf came from elsewhere (inside shard_map, another "
                               "device's shard summed in by the gradient of a replicated input: mark it varying "
                               "with jax.lax.pcast(x, axis, to='varying') (jax.lax.pvary on older JAX) to keep "
                               "gradients per device), or from the device or XLA's fusion "
                               "of the compiled step.")
        if result is None:
            key: tuple[Hashable, ...] = ("no audit", failure)
        elif result.findings:
            key = ("born at", *sorted({(f.op, f.location) for f in result.findings}))
        else:
            key = ("no finding", _nonfinite(loss))
        return GuardReport(call, index, _fmt_loss(loss), result, note), key


def _host(ref: weakref.ref[Guard], split: Split, keys: tuple[Hashable | None, ...], levels: Levels,
          ok: np.ndarray, loss: np.ndarray, *leaves: np.ndarray) -> BaseException | None:
    g = ref()
    if g is None:
        return None
    with g._idle:
        g._in_callback += 1
    try:
        error = g._on_bad(split, keys, levels, ok, loss, leaves)
        return None if error is None else g._deliver(error)
    finally:
        with g._idle:
            g._in_callback -= 1
            g._idle.notify_all()


def _message(name: str, reports: Sequence[GuardReport], text: str) -> str:
    """The exception's message: where the NaN/inf was born, in one line, then ``text`` (the reports)."""
    for r in reports:
        findings = r.audit.findings if r.audit is not None else ()
        if findings:
            f = findings[0]
            more = f" (and {len(findings) - 1} more birth place(s) below)" if len(findings) > 1 else ""
            where = f"call {r.call}" if r.call is not None else "a compiled call"
            element = f", batch element {r.batch_index}" if r.batch_index else ""
            return (f"guard({name}): NaN/inf born at `{f.op}`, {f.location}: {one_line(f.message)}{more} "
                    f"({where}{element}, loss = {r.loss})\n{text}")
    return f"guard({name}): {text}"


def _key_impl(x: ArrayLike) -> Hashable | None:
    """The PRNG implementation of a typed key array (its data crosses to the host), else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_impl(x)
    return None


def _wrap_key(data: np.ndarray, impl: Hashable) -> jax.Array:
    """Key data back as a key array, on the CPU device the audit runs on."""
    return jax.random.wrap_key_data(jax.device_put(data, jax.devices("cpu")[0]), impl=impl)


def _host_copy(x: ArrayLike) -> ArrayLike:
    if _key_impl(x) is not None:
        return x
    return np.array(x, copy=True) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x


def _fmt_loss(loss: ArrayLike) -> str:
    a = np.asarray(loss)
    return fmt(a.reshape(-1)[0]) if a.size == 1 else str(a)


def _nonfinite(loss: ArrayLike) -> bool:
    a = np.asarray(loss)
    return a.dtype.kind in "fc" and not bool(np.all(np.isfinite(a)))


def _join(a: str, b: str) -> str:
    return f"{a} {b}".strip()


_all_finite_jit = jax.jit(all_finite)

_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for every guard's audits (they run one at a time, in order)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradkit-guard")
        return _EXECUTOR


class _DropGuardErrors(logging.Filter):
    """JAX logs a failing callback's traceback before raising it; the raise already carries the report."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, NonFiniteGradientError)


logging.getLogger(compat.CALLBACK_LOGGER).addFilter(_DropGuardErrors())
