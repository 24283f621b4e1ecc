"""The host side of ``gk.guard``: count the bad calls, audit the first ones, keep one report per birth place.

An :class:`Auditor` belongs to one guard and holds everything it learns:
its counts, the capped audits in flight and their reports, and the index of
the step running now. The compiled step's callback (:func:`on_host`) reaches
it through a weak reference, so a dropped guard's callbacks do nothing.

* **Bounded.** An audit re-runs the loss op by op (and checks its fix with
  finite differences), far dearer than a step, and its inputs are a copy of
  the step's. So a guard audits at most ``max_reports`` bad calls, the first
  ones; later bad calls are counted and copy nothing. The host copies live
  only until their audit has run: a report keeps the audit's text and the
  few offending element values, never the arguments. Audits whose NaN was
  born at the same places (op and source line) share one report, which
  counts the others (:attr:`GuardReport.repeats`).
* **Where the audit runs.** JAX work started from inside a host callback can
  deadlock when it needs the device stream the callback is blocking (GPU,
  TPU). The callback therefore only copies the inputs to host memory; the
  audit runs on a worker thread, **on the CPU device**, from those copies. In
  ``"raise"`` mode the callback waits for it (at most :data:`WAIT_S`).
* **The step index.** Counting the calls of a compiled step on the device
  would cost every step a host round trip. The guard counts the calls it
  sees instead: its own eager calls, and the calls of the step ``Guard.wrap``
  wraps (:meth:`Auditor.stepping`). A callback that runs inside such a call
  belongs to it when every earlier wrapped call had finished when it
  returned (its results were ready) and no other wrapped call is running;
  otherwise the step is unknown (``None``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.audit import audit
from gradkit._src.audit.report import AuditReport
from gradkit._src.checks.describe import one_line
from gradkit._src.core.args import Split
from gradkit._src.guard.delivery import deliver
from gradkit._src.guard.host import Levels, bad_elements, bad_indices
from gradkit._src.guard.report import GuardReport, NonFiniteGradientError, fmt_loss, message, nonfinite

__all__ = ["MAX_REPORTS", "WAIT_S", "Auditor", "host_copy", "key_impl", "on_host"]

WAIT_S = 300.0  # raise mode: longest wait for the audit inside the callback
AUDITS_PER_CALL = 4  # bad batch elements audited per call at most (the rest are listed in the note)
MAX_REPORTS = 4  # default of guard(max_reports=): audits per guard
LISTED = 8  # unaudited batch indices named in a report's note
# What a wrapped step raises when its program failed in a guard's callback: it ran to its end.
_FAILED_AT_ITS_END: tuple[type[BaseException], ...] = (NonFiniteGradientError, *compat.CALLBACK_ERRORS)


@dataclasses.dataclass(frozen=True)
class Loss:
    """What an audit needs of the guarded loss function."""

    fn: Callable[..., object]
    argnums: int | tuple[int, ...]
    has_aux: bool
    name: str


class Auditor:
    """One guard's bad path on the host (see the module docstring)."""

    def __init__(self, loss: Loss, on_nonfinite: str, max_reports: int):
        self.loss = loss
        self.on_nonfinite = on_nonfinite
        self.max_reports = max_reports
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # notified when no host callback is running
        self._in_callback = 0
        self._reports: list[GuardReport] = []
        self._report_of: dict[tuple[Hashable, ...], int] = {}  # birth places -> index in _reports
        self._pending: list[concurrent.futures.Future[GuardReport]] = []  # audits in flight (max_reports at most)
        self.calls = 0  # eager calls of the guard
        self._bad_calls = 0
        self._audits = 0  # audits started, max_reports at most
        self._steps = 0  # calls of wrapped steps
        self._running = 0  # wrapped calls running now
        self._step: int | None = None  # the wrapped call running now, if the callbacks it sees are its own
        self._settled = True  # every wrapped call so far had finished when it returned

    # ------------------------------------------------------------------ the step index

    @contextlib.contextmanager
    def stepping(self) -> Iterator[Callable[[object], None]]:
        """Around one call of a wrapped step; yields ``returned(out)``, to call with the step's results."""
        with self._lock:
            self._steps += 1
            self._running += 1
            self._step = self._steps if self._settled and self._running == 1 else None
        finished: bool | None = None  # did the call's own work finish inside it (None: nothing known)

        def returned(out: object) -> None:
            nonlocal finished
            leaves = jax.tree_util.tree_leaves(out)
            if any(isinstance(x, compat.Tracer) for x in leaves):
                return
            arrays = [cast(Any, x) for x in leaves if isinstance(x, compat.ArrayImpl)]  # host values: done
            finished = bool(arrays) and all(x.is_ready() for x in arrays)

        try:
            yield returned
        except _FAILED_AT_ITS_END:
            finished = True  # the program's failure came back: it ran to its end
            raise
        finally:
            with self._lock:
                self._running -= 1
                if finished is False:
                    self._settled = False
                elif finished and not self._running:
                    self._settled = True
                self._step = None

    def current_step(self) -> int | None:
        """The wrapped call a callback running now belongs to, if that is certain."""
        with self._lock:
            return self._step if self._running == 1 else None

    def eager_call(self) -> int:
        """Counts an eager call of the guard; returns its step index (the wrapped step's, inside one)."""
        with self._lock:
            self.calls += 1
            step = self._step if self._running == 1 else None
            return step if step is not None else self.calls

    # ------------------------------------------------------------------ what the guard reads

    def reports(self) -> list[GuardReport]:
        """The reports, once the audits in flight have run."""
        while True:
            with self._lock:
                pending = [f for f in self._pending if not f.done()]
                self._pending = pending
            if not pending:
                break
            concurrent.futures.wait(pending)
        with self._lock:
            return list(self._reports)

    def bad_calls(self) -> int:
        with self._lock:
            return self._bad_calls

    def wait_for_callbacks(self) -> None:
        """Waits until no host callback of this guard is running (at most :data:`WAIT_S`)."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_callback == 0, timeout=WAIT_S)

    # ------------------------------------------------------------------ a bad call

    def admit(self, wanted: int) -> tuple[int, int]:
        """Counts a bad call; returns its number among the bad calls and how many audits it may start."""
        with self._lock:
            self._bad_calls += 1
            audits = max(0, min(wanted, self.max_reports - self._audits))
            self._audits += audits
            return self._bad_calls, audits

    def unaudited(self, call: int | None, index: tuple[int, ...], loss: ArrayLike, number: int) -> str:
        headline = GuardReport(call, index, fmt_loss(loss), None).headline
        return (f"{headline}. Not audited: this guard audits its first max_reports={self.max_reports} bad "
                f"call(s) (read guard.reports); this is bad call {number}.")

    def eager(self, call: int, loss: ArrayLike, split: Split, dyn: Sequence[ArrayLike]) -> NonFiniteGradientError:
        """An eager bad call: counted, audited in this thread if the cap allows; what ``"raise"`` raises."""
        number, audits = self.admit(1)
        reports = []
        if audits:
            report, key = self.audit(call, (), host_copy(loss), split, [host_copy(x) for x in dyn])
            self.keep(report, key)
            reports.append(report)
            text = str(report)
        else:
            text = self.unaudited(call, (), loss, number)
        return NonFiniteGradientError(message(self.loss.name, reports, text), reports)

    def on_bad(self, split: Split, keys: tuple[Hashable | None, ...], levels: Levels, ok: np.ndarray, loss: np.ndarray,
               leaves: Sequence[np.ndarray]) -> NonFiniteGradientError | None:
        """In the callback: count the call, copy the bad elements to audit and queue their audits.

        Returns what the step is to raise (raise mode: after waiting for the
        audits), else None.
        """
        indices = bad_indices(ok)
        if not indices:
            return None
        step = self.current_step()
        number, audits = self.admit(min(len(indices), AUDITS_PER_CALL))
        if not audits:
            if self.on_nonfinite != "raise":
                return None
            (loss_i,), = bad_elements(levels, indices[:1], [loss])
            text = self.unaudited(step, indices[0], loss_i, number)
            return NonFiniteGradientError(message(self.loss.name, (), text))
        rest = indices[audits:]
        note = (f"{len(rest)} more bad batch element(s) in this call were not audited: "
                + ", ".join(map(str, rest[:LISTED])) + (", ..." if len(rest) > LISTED else "") + ".") if rest else ""
        futures = self.submit(step, split, keys, levels, indices[:audits], [loss, *leaves], note)
        del loss, leaves  # the queued audits hold the only copies, until they have run
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()] + futures
        if self.on_nonfinite != "raise":
            return None
        done, _ = concurrent.futures.wait(futures, timeout=WAIT_S)
        reports = [f.result() for f in futures if f in done]
        text = "\n".join(str(r) for r in reports) if reports else (
            f"the audit did not finish within {WAIT_S:.0f} s; it goes on in the background: read guard.reports.")
        return NonFiniteGradientError(message(self.loss.name, reports, text), reports)

    def submit(self, step: int | None, split: Split, keys: tuple[Hashable | None, ...], levels: Levels,
               indices: Sequence[tuple[int, ...]], leaves: Sequence[np.ndarray],
               note: str) -> list[concurrent.futures.Future[GuardReport]]:
        """Queues the audit of each element at ``indices``, from host copies of its leaves."""
        futures = []
        for k, (index, (loss_i, *leaves_i)) in enumerate(zip(indices, bad_elements(levels, indices, leaves))):
            dyn = [_wrap_key(x, i) if i is not None else x for x, i in zip(leaves_i, keys)]
            futures.append(_executor().submit(self.audit_and_keep, step, index, loss_i, split, dyn,
                                              note if k == 0 else ""))
        return futures

    def audit_and_keep(self, call: int | None, index: tuple[int, ...], loss: np.ndarray, split: Split,
                       dyn: Sequence[ArrayLike], note: str) -> GuardReport:
        report, key = self.audit(call, index, loss, split, dyn, note)
        self.keep(report, key)
        return report

    def keep(self, report: GuardReport, key: tuple[Hashable, ...]) -> None:
        """Adds ``report``, or counts it in the earlier report whose NaN was born at the same places."""
        with self._lock:
            i = self._report_of.get(key)
            if i is None:
                self._report_of[key] = len(self._reports)
                self._reports.append(report)
            else:
                self._reports[i] = dataclasses.replace(self._reports[i], repeats=self._reports[i].repeats + 1)

    def audit(self, call: int | None, index: tuple[int, ...], loss: ArrayLike, split: Split,
              dyn: Sequence[ArrayLike], note: str = "") -> tuple[GuardReport, tuple[Hashable, ...]]:
        """The report of the loss at ``dyn`` (host copies), and the key of where its NaN was born."""
        args, kwargs = split.combine(dyn)
        fn = self.loss.fn
        has_aux = self.loss.has_aux

        @functools.wraps(fn)
        def scalar_loss(*a: object) -> object:
            out = fn(*a, **kwargs)
            return cast(Sequence[object], out)[0] if has_aux else out  # (loss, aux): checked by the guard

        result: AuditReport | None = None
        failure = ""
        try:
            with jax.default_device(jax.devices("cpu")[0]):
                result = audit(scalar_loss, *args, argnums=self.loss.argnums)
        except Exception as e:
            failure = f"the audit could not run: {type(e).__name__}: {one_line(str(e))}"
            note = _join(note, failure + (" (a loss with collectives such as psum cannot be re-run outside its "
                                          "shard_map)" if "axis name" in str(e) else ""))
        if result is not None and result.finite and not nonfinite(loss):
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
            key = ("no finding", nonfinite(loss))
        return GuardReport(call, index, fmt_loss(loss), result, note), key


def on_host(ref: weakref.ref[Auditor], split: Split, keys: tuple[Hashable | None, ...], levels: Levels,
            ok: np.ndarray, loss: np.ndarray, *leaves: np.ndarray) -> BaseException | None:
    """The host function of a guarded step's callback (see :func:`gradkit._src.guard.host.report_if_bad`)."""
    auditor = ref()
    if auditor is None:
        return None
    with auditor._idle:
        auditor._in_callback += 1
    try:
        error = auditor.on_bad(split, keys, levels, ok, loss, leaves)
        return None if error is None else deliver(error)
    finally:
        with auditor._idle:
            auditor._in_callback -= 1
            auditor._idle.notify_all()


def key_impl(x: ArrayLike) -> Hashable | None:
    """The PRNG implementation of a typed key array (its data crosses to the host), else None."""
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key):
        return jax.random.key_impl(x)
    return None


def host_copy(x: ArrayLike) -> ArrayLike:
    """An eager call's value, copied to the host for its audit (a key array stays as it is)."""
    if key_impl(x) is not None:
        return x
    return np.array(x, copy=True) if isinstance(x, (jax.Array, np.ndarray, np.generic)) else x


def _wrap_key(data: np.ndarray, impl: Hashable) -> jax.Array:
    """Key data back as a key array, on the CPU device the audit runs on."""
    return jax.random.wrap_key_data(jax.device_put(data, jax.devices("cpu")[0]), impl=impl)


def _join(a: str, b: str) -> str:
    return f"{a} {b}".strip()


_EXECUTOR: concurrent.futures.ThreadPoolExecutor | None = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread for every guard's audits (they run one at a time, in order)."""
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gradkit-guard")
        return _EXECUTOR
