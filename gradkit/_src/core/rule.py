"""Rule: one gradient override, a frozen value; OpView: what a rule sees."""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Hashable, Mapping
from typing import Any, Literal, Protocol, overload

import jax

from gradkit._src.errors import GradkitError, callable_name

Mode = Literal["vjp", "jvp"]
# A JVP rule's tangents as the library's rules take them: one per input, None where the input has none.
Tangents = tuple["jax.Array | None", ...]


class VjpFn(Protocol):
    """A reverse-mode rule: the operation and its output cotangent(s) in, one cotangent per input out.

    ``g`` is one array for a single-output operation, else a tuple; return a
    tuple with one entry per input (``None`` for "no gradient").
    """

    def __call__(self, op: OpView, g: Any, /) -> object: ...


class JvpFn(Protocol):
    """A forward-mode rule: the operation and one tangent per input (``None``: zero) in, the output tangent(s) out.

    It must be linear in the tangents; reverse mode is its transpose.
    """

    def __call__(self, op: OpView, tangents: tuple[Any, ...], /) -> object: ...


@dataclasses.dataclass(frozen=True)
class OpView:
    """Read-only view of one matched operation, handed to a rule.

    Attributes:
      name: the name the table matched (``"sqrt"``, a named op's name, a
        custom function's name).
      inputs: the operation's inputs, a tuple. For a primitive, one array per
        operand; for a named op, its positional arguments (pytrees).
      outputs: the operation's outputs, a tuple (one entry for a single output).
      params: the primitive's static parameters (e.g. ``axes`` of
        ``reduce_sum``); for a named op, its keyword arguments.
      source: the user's source line that created the operation.
    """

    name: str
    inputs: tuple[Any, ...]
    outputs: tuple[Any, ...]
    params: Mapping[str, Any]
    source: str = "unknown source line"


@dataclasses.dataclass(frozen=True)
class Rule:
    """One gradient override.

    Build it with :func:`vjp_rule` or :func:`jvp_rule` rather than directly.

    Attributes:
      fn: ``fn(op, g) -> cotangents`` (``mode="vjp"``) or
        ``fn(op, tangents) -> output tangents`` (``mode="jvp"``).
      mode: ``"vjp"`` (reverse mode only) or ``"jvp"`` (forward mode; reverse
        mode by JAX's transposition, so ``fn`` must be linear in the tangents).
      name: shown in error messages; defaults to ``fn``'s qualified name.
      key: what the rule's fingerprint is made of. Library rules use
        ``(rule name, parameters)`` so equal configs fingerprint equally.
    """

    fn: VjpFn | JvpFn
    mode: Mode = "vjp"
    name: str = ""
    key: tuple[Hashable, ...] = ()

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise GradkitError(
                f"rule {self.name or '<unnamed>'}: expected a callable `fn(op, g)`, got "
                f"{type(self.fn).__name__}. Pass a function to gk.vjp_rule / gk.jvp_rule.")
        if self.mode not in ("vjp", "jvp"):
            raise GradkitError(f"rule {self.name or callable_name(self.fn, module=True)}: mode must be 'vjp' or 'jvp', "
                               f"got {self.mode!r}.")
        if not self.name:
            object.__setattr__(self, "name", callable_name(self.fn, module=True))
        if not self.key:
            object.__setattr__(self, "key", ("fn", callable_name(self.fn, module=True), id(self.fn)))

    def __call__(self, op: OpView, x: Any) -> object:
        return self.fn(op, x)


@overload
def vjp_rule(fn: VjpFn, *, name: str | None = None) -> Rule: ...
@overload
def vjp_rule(fn: None = None, *, name: str | None = None) -> Callable[[VjpFn], Rule]: ...


def vjp_rule(fn: VjpFn | None = None, *, name: str | None = None) -> Rule | Callable[[VjpFn], Rule]:
    """Makes a reverse-mode rule: ``fn(op, g)`` returns one cotangent per input.

    ``g`` is the cotangent of the output (a tuple for several outputs; ``None``
    for an integer output). Return a tuple with one entry per input in
    ``op.inputs`` (a bare value is accepted when there is one input). ``None``
    anywhere means "no gradient" (zeros); integer inputs need nothing.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> safe_sqrt = gk.vjp_rule(
      ...     lambda op, g: (jnp.where(g == 0, 0.0, g * 0.5 / op.outputs[0]),))
      >>> f = gk.override(lambda x: jnp.where(x > 0, jnp.sqrt(x), 0.0), {"sqrt": safe_sqrt})
      >>> float(jax.grad(f)(0.0))
      0.0
    """
    if fn is None:
        return lambda f: vjp_rule(f, name=name)
    return Rule(fn=fn, mode="vjp", name=name or "")


@overload
def jvp_rule(fn: JvpFn, *, name: str | None = None) -> Rule: ...
@overload
def jvp_rule(fn: None = None, *, name: str | None = None) -> Callable[[JvpFn], Rule]: ...


def jvp_rule(fn: JvpFn | None = None, *, name: str | None = None) -> Rule | Callable[[JvpFn], Rule]:
    """Makes a forward-mode rule: ``fn(op, tangents)`` returns the output tangents.

    ``tangents`` has one entry per input in ``op.inputs`` (``None`` for inputs
    with no tangent, such as integers and constants). The result must be linear
    in ``tangents``: reverse mode (``grad``) is obtained by transposing it, and
    forward mode, ``jacfwd`` and ``hessian`` work through the op.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> # d sqrt(x) = dx / (2 sqrt(x)), but 0 where sqrt(x) == 0
      >>> rule = gk.jvp_rule(lambda op, t: jnp.where(
      ...     op.outputs[0] == 0, 0.0, t[0] * 0.5 / op.outputs[0]))
      >>> f = gk.override(jnp.sqrt, {"sqrt": rule})
      >>> float(jax.jacfwd(f)(0.0)), float(jax.grad(f)(4.0))
      (0.0, 0.25)
    """
    if fn is None:
        return lambda f: jvp_rule(f, name=name)
    return Rule(fn=fn, mode="jvp", name=name or "")


# A library JVP rule function: ``fn(op, tangents)`` -> the output tangent(s).
JvpRuleFn = Callable[[OpView, Tangents], object]


def freeze_params(params: Mapping[str, object]) -> Mapping[str, object]:
    return types.MappingProxyType(dict(params))
