"""What ``gk.guard`` tells the user: :class:`GuardReport` and :class:`NonFiniteGradientError`.

A report holds text and small values only: the audit, the step's index and
the loss. Its :attr:`~GuardReport.headline` and the exception's first line
are the same sentence: where the NaN/inf was born (op, the user's source
line, what the op did), then which step (and batch element) and the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jax.typing import ArrayLike

from gradkit._src.audit.report import AuditReport
from gradkit._src.checks.describe import fmt, one_line
from gradkit._src.errors import GradkitError

__all__ = ["GuardReport", "NonFiniteGradientError", "fmt_loss", "message", "nonfinite"]


class NonFiniteGradientError(GradkitError, FloatingPointError):
    """The loss or a gradient of a guarded call is NaN or inf (``on_nonfinite="raise"``).

    A :class:`GradkitError` and a ``FloatingPointError`` (what ``jax_debug_nans``
    raises). The first line of the message is the first report's
    :attr:`GuardReport.headline`: where the NaN or inf was born (op, source
    line, what the op did), which step it was and the loss; the audit's full
    report follows.

    A guarded call raises it from the first Python code of gradkit it
    passes: the guard's own call (eager, or under an eager ``vmap``), or the
    step :meth:`Guard.wrap` wraps, your ``jax.jit``-ed training step. JAX
    cannot carry an exception out of a compiled program (JAX issue 26102):
    a plain ``jax.jit`` call of a step that fails gets JAX's
    ``INTERNAL: CpuCallback error …`` with this message inside it, so wrap
    the step. JAX's error stays reachable as ``__context__``.

    Attributes:
      reports: the :class:`GuardReport` of each audited bad element of the call;
        empty when the call was not audited (the guard had run its ``max_reports`` audits).

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> g = gk.guard(lambda w, x: jnp.sum(jnp.sqrt(w * x)))
      >>> step = g.wrap(jax.jit(lambda w, x: g(w, x)[1]))
      >>> try:
      ...     step(jnp.ones(2), jnp.array([1.0, 0.0]))
      ... except gk.NonFiniteGradientError as e:
      ...     print(str(e).splitlines()[0].split(",")[0])  # then the source line, what `sqrt` did, the step
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
      call: the index of the step that went bad (1 for the first), where the
        guard knows it: a call of the guard itself outside any trace (eager),
        or a call of the step :meth:`Guard.wrap` wraps that had finished when
        it returned (``"raise"`` mode waits for it; the CPU runs a program
        with host callbacks to the end inside its call) and that no other
        wrapped call overlapped. ``None`` otherwise: a compiled step called
        without ``wrap``, or dispatched asynchronously on an accelerator in
        ``"skip"``/``"report"`` mode (counting those steps on the device
        would cost every step a host round trip).
      batch_index: the element's index under ``vmap`` (outermost axis first); ``()`` otherwise.
      loss: the loss value there, as text (``"nan"``, ``"0.6931"``).
      audit: the :func:`audit` of the loss at exactly these inputs (``None`` if it could not run).
      note: what else to know (elements not audited, an audit that failed or found nothing).
      repeats: how many later audits found their NaN born at the same places
        (the same ops at the same source lines) and so made no report of their own.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> def loss(w, x):
      ...     return jnp.sum(jnp.sqrt(w * x))
      >>> g = gk.guard(loss, on_nonfinite="skip")
      >>> step = g.wrap(jax.jit(lambda w, x: g(w, x)[1]))
      >>> for x in (jnp.ones(2), jnp.array([1.0, 0.0])):
      ...     _ = step(jnp.ones(2), x)
      >>> r = g.reports[0]
      >>> r.call, r.headline.split(",")[0], r.headline.endswith("(step 2, loss = 1)")
      (2, 'NaN/inf born at `sqrt`', True)
    """

    call: int | None
    batch_index: tuple[int, ...]
    loss: str
    audit: AuditReport | None
    note: str = ""
    repeats: int = 0

    @property
    def where(self) -> str:
        """The step and the batch element, as text (``"step 301, batch element (3,)"``, ``"a compiled step"``)."""
        step = f"step {self.call}" if self.call is not None else "a compiled step"
        return step + (f", batch element {self.batch_index}" if self.batch_index else "")

    @property
    def headline(self) -> str:
        """The report in one line, which says where the NaN/inf was born (op, line, what it did), step and loss.

        ``NaN/inf born at `log`, train.py:42: `log` of 0 gave -inf for 24 of 64
        elements (step 301, loss = 0.6931)``; when the audit found no birth
        place (it could not run, or found the gradient finite at these inputs:
        see :attr:`note`): ``non-finite loss or gradient at step 301: loss = nan``.
        """
        findings = self.audit.findings if self.audit is not None else ()
        if not findings:
            return f"non-finite loss or gradient at {self.where}: loss = {self.loss}"
        f = findings[0]
        more = f" (and {len(findings) - 1} more birth place(s) below)" if len(findings) > 1 else ""
        return f"NaN/inf born at `{f.op}`, {f.location}: {one_line(f.message)}{more} ({self.where}, loss = {self.loss})"

    def __str__(self) -> str:
        lines = [self.headline]
        if self.audit is not None:
            lines.append(str(self.audit))
        if self.note:
            lines.append(f"note: {self.note}")
        if self.repeats:
            lines.append(f"repeats: {self.repeats} later audit(s) found the same birth place")
        return "\n".join(lines)


def message(name: str, reports: Sequence[GuardReport], text: str) -> str:
    """The exception's message: the headline of the first report that found a birth place, then ``text``.

    ``text`` is the reports' text (or why there is none); a leading copy of
    that headline is not repeated.
    """
    for r in reports:
        if r.audit is not None and r.audit.findings:
            head = r.headline
            body = text[len(head):].lstrip("\n") if text.startswith(head) else text
            return f"guard({name}): {head}\n{body}"
    return f"guard({name}): {text}"


def fmt_loss(loss: ArrayLike) -> str:
    """The loss as a report shows it."""
    a = np.asarray(loss)
    return fmt(a.reshape(-1)[0]) if a.size == 1 else str(a)


def nonfinite(loss: ArrayLike) -> bool:
    """Is some element of a float or complex ``loss`` NaN or inf."""
    a = np.asarray(loss)
    return a.dtype.kind in "fc" and not bool(np.all(np.isfinite(a)))
