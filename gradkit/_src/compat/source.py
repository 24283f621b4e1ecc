"""Source lines: which user line made an equation, and how gradkit's own frames are skipped."""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from typing import Any

from jax._src import source_info_util as _siu
from jax._src import traceback_util as _tbu

from gradkit._src.compat.jaxprs import JaxprEqn

# gradkit/ itself: its frames are not the user's.
_GRADKIT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def register_source_exclusion() -> None:
    """Make JAX attribute equations to the user's frame, not to gradkit's.

    This is JAX's registration hook for libraries (Flax and Equinox use it too);
    it changes only which frame a traceback or source line points at.
    """
    _siu.register_exclusion(_GRADKIT_DIR)
    _tbu.register_exclusion(_GRADKIT_DIR)


@contextlib.contextmanager
def source_of(eqn: JaxprEqn) -> Iterator[None]:
    """Equations created inside keep ``eqn``'s user source line and name stack."""
    name_stack = _siu.current_name_stack() + eqn.source_info.name_stack
    with _siu.user_context(eqn.source_info.traceback, name_stack=name_stack):
        yield


def name_scopes(eqn: JaxprEqn) -> tuple[str, ...]:
    """The scope names on ``eqn``'s name stack, outermost first, relative to the equation holding it.

    ``jax.named_scope("enc")`` gives ``("enc",)``; Flax linen's module path
    ``Model/enc/Dense_0`` gives ``("Model", "enc", "Dense_0")`` (a name with
    ``/`` is split there); Equinox records ``("eqx.nn.MLP", "eqx.nn.Linear")``;
    gradkit's module-path entries read ``(".enc", ".lin")`` (``core.scope``).
    Transform entries (``vmap()``, ``jvp()``) are not scopes and are left out.
    An equation inside a sub-program (a scan body, a jitted function) carries
    its stack relative to the enclosing equation: the caller prepends that
    equation's scopes.
    """
    out: list[str] = []
    for entry in eqn.source_info.name_stack.stack:
        if isinstance(entry, _siu.Scope):
            out.extend(part for part in entry.name.split("/") if part)
    return tuple(out)


# The equations whose bodies are being rewritten, outermost first (see call_site).
_CALL_SITES: contextvars.ContextVar[tuple[JaxprEqn, ...]] = contextvars.ContextVar("gradkit_call_sites", default=())


@contextlib.contextmanager
def call_site(eqn: JaxprEqn) -> Iterator[None]:
    """While a body of ``eqn`` is rewritten, :func:`source_line` of its equations can fall back to ``eqn``'s line.

    JAX keeps only the frames of the body's own trace for an equation inside
    a library's jitted function (``jax.nn.softplus``'s ``logaddexp``): no
    user frame. The user's line is then the line that called the library.
    """
    token = _CALL_SITES.set((*_CALL_SITES.get(), eqn))
    try:
        yield
    finally:
        _CALL_SITES.reset(token)


def _user_frame(eqn: JaxprEqn, sites: tuple[JaxprEqn, ...]) -> Any:
    """The user frame of ``eqn``, inside the bodies of the call equations ``sites`` (outermost first).

    A jitted library function's body is traced once and cached: on JAX 0.8 its
    equations keep the frames of that first trace, so their user frame is
    the line that first called the function, maybe another function's. When
    the user frame is a call of one of the enclosing ``sites`` (the library
    function it calls is the site's), the site's own frame, from the current
    trace, is the user's line.
    """
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is not None:
        if sites:
            callee = library_callee(eqn)
            name = callee[1].rsplit(".", 1)[-1] if callee is not None else None
            for k in range(len(sites) - 1, -1, -1):
                if name is not None and sites[k].params.get("name") == name:
                    return _user_frame(sites[k], sites[:k])
        return frame
    for caller in reversed(sites):
        frame = _siu.user_frame(caller.source_info.traceback)
        if frame is not None:
            return frame
    return None


def source_line(eqn: JaxprEqn | None) -> str:
    """``file:line (function)`` of the user code that created ``eqn``.

    For an equation made inside library code whose trace kept no user frame,
    the line of the innermost enclosing call that has one (while its body is
    rewritten, :func:`call_site`).
    """
    if eqn is None:
        return "unknown source line"
    frame = _user_frame(eqn, _CALL_SITES.get())
    if frame is None:
        return "unknown source line"
    return f"{frame.file_name}:{frame.start_line} ({frame.function_name})"


def source_span(eqn: JaxprEqn) -> tuple[str, int, str, int, int] | None:
    """``(file, line, function, start column, end column)`` of the user code that created ``eqn``.

    The columns (Python 3.11+, else -1) tell apart two calls on one line, e.g.
    ``exp`` and ``log1p`` in ``jnp.log1p(jnp.exp(x))``; used by ``gk.audit`` to
    underline the call in its report.
    """
    frame = _siu.user_frame(eqn.source_info.traceback)
    if frame is None:
        return None
    start = getattr(frame, "start_column", -1)
    end = getattr(frame, "end_column", -1) if getattr(frame, "end_line", frame.start_line) == frame.start_line else -1
    return frame.file_name, frame.start_line, frame.function_name, start, end


def library_callee(eqn: JaxprEqn) -> tuple[str, str] | None:
    """``(file, function)`` of the library function the user's line called to create ``eqn``.

    For a ``log`` made inside ``jax.nn.logsumexp`` this is ``(".../special.py",
    "logsumexp")``: ``gk.audit`` uses it to suggest the stable replacement of
    the function the user actually wrote. JAX's own plumbing (jit wrappers,
    tracing) is skipped. ``None`` when no user frame is known.
    """
    tb = eqn.source_info.traceback
    frames: list[Any] = list(tb.frames) if tb is not None else []
    is_user = getattr(_siu, "is_user_filename", None)
    if is_user is None:  # pragma: no cover - a JAX without it: no library attribution
        return None
    for i, fr in enumerate(frames):
        if is_user(fr.file_name):
            for inner in reversed(frames[:i]):
                if (os.path.basename(inner.file_name) not in _PLUMBING
                        and inner.function_name.rsplit(".", 1)[-1] not in _WRAPPERS):
                    return inner.file_name, inner.function_name
            return None
    return None


_WRAPPERS = frozenset({"wrapper", "wrapped", "inner", "memoized_fun", "cache_miss",
                       "reraise_with_filtered_traceback", "__call__"})


_PLUMBING = frozenset({
    "traceback_util.py", "api.py", "pjit.py", "api_util.py", "linear_util.py", "core.py", "partial_eval.py",
    "source_info_util.py", "dispatch.py", "custom_derivatives.py", "contextlib.py", "functools.py",
    "interpreters.py", "ad.py", "batching.py", "util.py", "config.py", "array_methods.py", "profiler.py",
})
