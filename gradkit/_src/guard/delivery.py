"""JAX's error back to the guard's own: how a guarded step's failure reaches ``except gk.NonFiniteGradientError``.

JAX cannot carry an exception out of a compiled program: what a host
callback raises reaches the caller as one of :data:`compat.CALLBACK_ERRORS
<gradkit._src.compat.CALLBACK_ERRORS>` whose text holds the exception's
message, and no hook changes that at a plain ``jax.jit`` call. So every
exception a guard's callback raises is first kept here (:func:`deliver`, the
latest :data:`KEPT` of all guards), and every boundary where a guarded call
passes gradkit's code — the guard's own call, the step ``Guard.wrap`` wraps,
``with guard:`` — runs :func:`converting`: a JAX error that carries a kept
exception's message is replaced by that exception, raised from the line that
failed, with JAX's error as its (suppressed) ``__context__``. One mechanism,
whichever guard raised: the text matched is the whole message of a kept
exception, which names its guard and its report.

JAX also logs a failing callback's traceback before raising; the guard's
raise already carries the report, so :class:`_DropGuardErrors` keeps it off
that logger.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator

from gradkit._src import compat
from gradkit._src.guard.report import NonFiniteGradientError

__all__ = ["HINT", "KEPT", "converting", "deliver", "unwrap"]

KEPT = 8  # exceptions raised by callbacks, kept for a boundary to re-raise (the latest ones, all guards)
HINT = ("[gradkit] JAX delivers an error raised inside a compiled step as its own, with the callback's stack "
        "first; call the step through your guard's wrap (step = guarded.wrap(jax.jit(step))) to get this "
        "gradkit.NonFiniteGradientError itself.")

_kept: collections.deque[NonFiniteGradientError] = collections.deque(maxlen=KEPT)
_lock = threading.Lock()


def deliver(error: NonFiniteGradientError) -> NonFiniteGradientError:
    """What a guard's callback raises: ``error``, kept for :func:`unwrap`, with a line on how to get it unwrapped.

    ``error`` itself is never raised by the callback, so no traceback frame
    of the callback (which held the step's inputs) stays on it.
    """
    with _lock:
        _kept.append(error)
    return NonFiniteGradientError(f"{error}\n{HINT}", error.reports)


def unwrap(exc: BaseException | None) -> NonFiniteGradientError | None:
    """The kept exception of a guard's callback, if ``exc`` is the error JAX made of it (it is then no longer kept)."""
    if not isinstance(exc, compat.CALLBACK_ERRORS) or isinstance(exc, NonFiniteGradientError):
        return None
    text = str(exc)
    with _lock:
        for error in reversed(_kept):
            if str(error) in text:
                _kept.remove(error)
                return error
    return None


@contextlib.contextmanager
def converting() -> Iterator[None]:
    """Re-raises a guard's :class:`NonFiniteGradientError` in place of the error JAX made of it; others pass."""
    try:
        yield
    except compat.CALLBACK_ERRORS as exc:
        error = unwrap(exc)
        if error is None:
            raise
        # JAX's traceback: the line that failed (the step's call, or the first use of its results);
        # JAX's error stays as __context__, not shown (it repeats the report after the callback's stack).
        raise error.with_traceback(exc.__traceback__) from None


class _DropGuardErrors(logging.Filter):
    """JAX logs a failing callback's traceback before raising it; the raise already carries the report."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, NonFiniteGradientError)


logging.getLogger(compat.CALLBACK_LOGGER).addFilter(_DropGuardErrors())
