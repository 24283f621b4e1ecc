"""Host callbacks: what gk.guard needs to know about how JAX reports a failing callback."""

__all__ = ["CALLBACK_LOGGER"]

#: The logger JAX reports a failing host callback on (``jax/_src/callback.py``, before it re-raises):
#: gk.guard's raise mode filters out its own exception there, since the raise carries the report.
CALLBACK_LOGGER: str = "jax._src.callback"
