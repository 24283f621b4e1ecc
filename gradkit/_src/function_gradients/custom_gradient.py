"""Function-level gradients: TensorFlow-style ``custom_gradient`` and ``custom_jvp``.

The decorated function returns its outputs together with a closure that
computes the derivative (``grad_fn(*upstream)`` for reverse mode,
``jvp_fn(*tangents)`` for forward mode). The data path::

    @custom_gradient fn ──call──▶ named op: one ``jit`` equation named after fn
                                   (a table can retarget it, like any gk.op)
                                   └─▶ per traced signature (derivative.Plan):
                                       jax.custom_jvp  (custom_jvp; custom_gradient
                                                        whose grad_fn is linear)
                                       jax.custom_vjp  (mode="vjp", or a grad_fn
                                                        that is not linear)

* When the named op is traced, ``fn`` is traced twice to jaxprs: once for
  the outputs, once for the closure, which is itself traced over abstract
  upstream (or tangent) values. Every tracer either captures becomes an
  explicit input (:mod:`gradkit._src.function_gradients.closure`), so nothing leaks.
* An exception in the closure (e.g. a grad_fn that raises on purpose) is
  kept and raised, with its own type, when the function is differentiated,
  not on a forward call.
* The rule's primal output is computed by calling the custom function again,
  so the custom derivative applies at every order (``grad(grad(g ∘ f))``);
  XLA merges the duplicate forward computation.

Positional array arguments (JAX or NumPy arrays, tracers) are differentiable.
Every other leaf (Python numbers included) and every keyword argument is
static: part of the cache key, free for Python control flow, no gradient.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, TypeVar, overload

import jax
import jax.numpy as jnp

from gradkit._src import compat
from gradkit._src.core import args as args_lib
from gradkit._src.core import named
from gradkit._src.core.cache import LRU
from gradkit._src.core.rule import OpView, Rule
from gradkit._src.errors import GradkitError
from gradkit._src.function_gradients import closure as cl
from gradkit._src.function_gradients.call import Call, FnInfo, Kind, as_tangent, inexact, is_array, is_multi, is_number
from gradkit._src.function_gradients.plan import Plan

F = TypeVar("F", bound=Callable[..., object])
Mode = Literal["both", "vjp"]


# --------------------------------------------------------------------------- the decorated function


class _Entry:
    """One call key's compiled op, and the plan its trace made (for the forward-mode error)."""

    def __init__(self, sig: named.Signature, call: Call) -> None:
        self.sig = sig
        self.call = call
        self.plan: Plan | None = None
        self.jitted: Callable[..., list[jax.Array]] = lambda *_: []


class _Decorated:
    """What ``@custom_gradient`` / ``@custom_jvp`` return: the function, callable like it.

    A descriptor like a plain function, so it works as a method; defined in a
    class body (``__set_name__``), its first argument is ``self``, bound as
    TensorFlow binds it: not differentiated, no gradient expected for it.
    """

    def __init__(self, info: FnInfo, mode: Kind) -> None:
        functools.update_wrapper(self, info.fn)
        self._info = info
        self._mode = mode
        self._cache: LRU[Hashable, _Entry] = LRU(f"{info.decorator}({info.name})")
        self.gradkit_op_name = info.name
        pos, _ = info.params
        if pos and pos[0] == "self":
            info.method = True

    def __set_name__(self, owner: type, name: str) -> None:
        self._info.method = True

    def __get__(self, instance: object, owner: type | None = None) -> _Decorated | types.MethodType:
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"<gradkit {self._info.decorator} function {self._info.name}>"

    @functools.cached_property
    def rule(self) -> Rule:
        """The function's derivative as a table :class:`Rule`, to retarget another op to it."""
        return _make_rule(self._info, self._mode)

    def __call__(self, *args: object, **kwargs: object) -> Any:
        info = self._info
        for k, v in kwargs.items():
            if any(is_array(x) for x in jax.tree_util.tree_leaves(v)):
                raise GradkitError(
                    f"{info.where} got an array in keyword argument `{k}`; keyword arguments are static (no "
                    f"gradient, part of the cache key). Pass arrays positionally: {info.name}(..., {k}).")
        bound = 1 if info.method else 0
        if bound and not args:
            raise GradkitError(f"{info.where} is a method: call it on an instance, `obj.{info.name}(...)`.")
        sig, dyn = named.Signature.of(info.name, args, kwargs, dynamic=is_array)
        try:
            # Static values and the arrays' whole types: one entry (plan, output
            # structure) per trace of its jit, never shared between traces.
            key = args_lib.call_key(sig.key, dyn)
        except TypeError as e:
            what = ("`self` is keyed by its hash, so make the class hashable or a pytree (register it with "
                    "jax.tree_util)" if bound and _unhashable(args[0]) else
                    "use a tuple instead of a list, or pass an array")
            raise GradkitError(
                f"{info.where} got an unhashable static argument ({e}). Non-array arguments and keyword "
                f"arguments are static and must be hashable: {what}.") from None
        entry = self._cache.get(key)
        if entry is None:
            entry = self._cache.setdefault(key, self._new_entry(sig, bound))
        named.pin(entry.sig)
        try:
            flat = entry.jitted(*dyn)
        except TypeError as e:
            if entry.plan is not None and entry.plan.forward_problem is not None \
                    and compat.is_forward_mode_of_custom_vjp_error(e):
                raise entry.plan.forward_error() from e
            raise
        if entry.plan is not None and entry.plan.forward_problem is not None \
                and any(compat.is_forward_mode_tracer(x) for x in dyn):
            # jax.jvp inside an enclosing jit: JAX would only fail when compiling that jit.
            raise entry.plan.forward_error()
        return entry.sig.outputs(flat)

    def _new_entry(self, sig: named.Signature, bound: int) -> _Entry:
        entry = _Entry(sig, Call(self._info, sig, bound))
        mode = self._mode

        def body(all_dyn: list[jax.Array]) -> object:
            # Runs while the named op's jit traces: the traced dynamic leaves.
            plan, captured = Plan.of(entry.call, mode, all_dyn)
            entry.plan = plan
            out = plan.function()(*all_dyn[entry.call.n_bound_dyn:], *captured)
            return entry.call.outputs(out)

        named.register(sig)
        entry.jitted = named.compile_op(sig, body)
        return entry


def _unhashable(x: object) -> bool:
    try:
        args_lib.static_key(x)
    except TypeError:
        return True
    return False


# --------------------------------------------------------------------------- the function's own Rule


def _make_rule(info: FnInfo, mode: Kind) -> Rule:
    """The decorated function's derivative as a table Rule, for retargeting another op to it."""
    rule_name = f"{info.decorator}[{info.name}]"

    def prepare(op: OpView) -> tuple[Call, list[jax.Array], object, Callable[..., object], list[jax.Array]]:
        if info.method:
            raise GradkitError(
                f"{info.where} is a method: its `.rule` would need an instance for `self`. Wrap the call in "
                "a function of the op's inputs, decorated with gk.custom_gradient, and use that one's `.rule`.")
        sig, dyn = named.Signature.of(info.name, tuple(op.inputs), info.accepted(op.params))
        call = Call(info, sig)
        outputs, closure, out = call.run(dyn)
        return call, dyn, outputs, closure, out

    def to_outputs(call: Call, outputs: object, flat: Sequence[object]) -> tuple[object, ...]:
        structured = call.outputs(flat)
        return tuple(structured) if is_multi(outputs) else (structured,)

    if mode == "vjp":
        def vjp_fn(op: OpView, g: object) -> tuple[object, ...]:
            call, dyn, outputs, grad_fn, out = prepare(op)
            assert call.out_tree is not None  # set by call.run
            try:
                cts = call.out_tree.flatten_up_to(g)
            except (ValueError, TypeError) as e:
                raise GradkitError(
                    f"{info.where} used as the rule for op '{op.name}' at {op.source}: the op's output "
                    f"cotangent has the structure {jax.tree_util.tree_structure(g)}, but '{info.name}' "
                    f"returns {call.out_tree}. Retarget it only to ops with the same inputs and outputs.") from e
            grads = call.gradients(grad_fn, dyn, cts, is_multi(outputs))
            return tuple(call.sig.split.scatter(grads))

        return Rule(fn=vjp_fn, mode="vjp", name=rule_name)

    def jvp_fn(op: OpView, tangents: Sequence[object]) -> tuple[object, ...]:
        call, dyn, outputs, closure, out = prepare(op)
        t_leaves = jax.tree_util.tree_structure(tuple(op.inputs)).flatten_up_to(tuple(tangents))  # type: ignore[attr-defined]
        t_dyn = [t_leaves[p] if is_array(t_leaves[p]) or is_number(t_leaves[p]) else None
                 for p in call.sig.split.dyn_pos]
        t_out: Sequence[object]
        if mode == "both":
            converted = cl.close_grad_fn(call, closure, dyn, outputs, out, is_multi(outputs))
            try:
                t_out = cl.transposed(converted, dyn, out, t_dyn)
            except GradkitError:
                raise
            except Exception as e:
                raise GradkitError(
                    f"{info.where}: its `.rule` serves forward mode by transposing grad_fn, and JAX cannot "
                    f"transpose it ({type(e).__name__}: {e}): grad_fn is not linear in upstream. Decorate the "
                    "function with mode='vjp' for a reverse-mode rule.") from e
            t_out = [t if inexact(o.dtype) else None for t, o in zip(t_out, out)]
        else:
            t_dyn = [as_tangent(t, x) if inexact(jnp.result_type(x)) else None for t, x in zip(t_dyn, dyn)]
            result = info.call_closure(closure, call.user_tangents(t_dyn), "tangent")
            t_out = call.tangents_out(result, outputs, out)
        return to_outputs(call, outputs, t_out)

    return Rule(fn=jvp_fn, mode="jvp", name=rule_name)


# --------------------------------------------------------------------------- decorators


def _decorate(fn: object, name: str | None, kind: Kind) -> _Decorated:
    decorator = "custom_jvp" if kind == "jvp" else "custom_gradient"
    if not callable(fn):
        raise GradkitError(f"gk.{decorator} decorates a function, got {type(fn).__name__}.")
    if name is None:
        name = getattr(fn, "__name__", None) or type(fn).__name__
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise GradkitError(
            f"gk.{decorator}: the name must be a non-empty string without surrounding spaces, got {name!r}.")
    return _Decorated(FnInfo(fn, name, "jvp" if kind == "jvp" else "vjp"), kind)


@overload
def custom_gradient(fn: F, *, name: str | None = None, mode: Mode = "both") -> F: ...
@overload
def custom_gradient(fn: None = None, *, name: str | None = None, mode: Mode = "both") -> Callable[[F], F]: ...


def custom_gradient(fn=None, *, name=None, mode="both"):
    """Defines a function's gradient with a closure, as TensorFlow's ``tf.custom_gradient`` does.

    The decorated function returns its outputs and a function ``grad_fn``:
    ``return y, grad_fn`` (one output) or ``return y1, y2, grad_fn`` /
    ``return (y1, y2), grad_fn`` (several). ``grad_fn`` receives one upstream
    gradient per output (``grad_fn(dy)``, ``grad_fn(dy1, dy2)``), each shaped
    like its output (``None`` for integer outputs), and returns one gradient
    per positional argument: a bare value for one argument, else a tuple. It
    may close over any value computed in the forward pass; those become
    residuals (closure conversion), so there is no leaked tracer under
    ``jit``, ``vmap``, ``scan`` or ``checkpoint``. ``grad_fn`` runs only
    when the function is differentiated: an exception in it (e.g. a
    deliberate ``raise``) does not affect forward calls, and reaches the
    caller of ``jax.grad`` with its own type.

    * Forward mode: ``jax.jvp``, ``jacfwd`` and ``hessian`` work too, as
      TensorFlow's forward accumulator does: the JVP is ``grad_fn``
      transposed (``v ↦ Jᵀv`` gives ``t ↦ Jt``), which needs ``grad_fn`` to
      be linear in the upstream gradients, as every true gradient is. That
      is checked when the function is traced (abstractly, no computation). A
      ``grad_fn`` that is not linear (clips, branches on or squares
      ``upstream``, or adds a term that does not depend on it) still serves
      reverse mode exactly, through ``jax.custom_vjp``; forward mode then
      raises a :class:`GradkitError` naming the function and the reason
      (when the forward-mode transformation is applied outside an enclosing
      ``jax.jit``, JAX's own ``TypeError`` about ``custom_vjp`` may come
      first). ``mode="vjp"`` opts out: reverse mode only, always through
      ``jax.custom_vjp``.
    * Methods: decorated in a class body, ``self`` is bound first, as in
      TensorFlow: ``grad_fn`` returns gradients for the other arguments
      only. ``self`` is not differentiated; arrays it holds are closed over,
      like other values the function closes over. A ``self`` that is a
      pytree passes its arrays in at each call; any other ``self`` is keyed
      by its hash (identity for most classes), like a static argument, so
      arrays stored on it are read when that signature is first traced.
    * Pytrees: an argument or output may be any pytree of arrays; its
      gradient has the same structure. ``None`` means "no gradient" (zeros)
      for any argument, any subtree or any leaf.
    * Static arguments: positional arguments that are not arrays (Python
      numbers, strings, ...) and all keyword arguments are static: usable in
      Python control flow, part of the cache key (each new value traces
      again, like a ``jax.jit`` static argument; ``-0.0`` and ``0.0`` are
      different values, and every NaN is one), no gradient (what ``grad_fn``
      returns for them is ignored).
    * Closures: the function may also close over values of an enclosing
      ``jit``, ``vmap`` or ``scan`` (a temperature, a scale). Their
      derivative is not defined by ``grad_fn``, so differentiating with
      respect to such a value is a :class:`GradkitError`: pass it as an
      argument instead.
    * Checks: a wrong number of gradients, a structure or shape that does
      not match the argument, is a :class:`GradkitError` naming the function.
      A gradient of another floating dtype (e.g. computed in float64 for a
      float32 argument) is cast to the argument's dtype, so parameters are
      never promoted; a complex gradient for a real argument is an error.
    * Higher order: ``grad_fn`` written with JAX operations is itself
      differentiated, so ``jax.grad(jax.grad(f))`` works, and the rule also
      holds for the outputs at higher orders. TensorFlow's nested form, where
      ``grad_fn`` returns ``(grads, grad_grad_fn)``, is rejected: call
      another ``custom_gradient`` function inside ``grad_fn`` instead.
    * Tables: the function is a named op (``name``, default the function's
      name), so ``gk.override(f, {name: rule})`` retargets it; its own rule
      is available as ``.rule``, a :class:`Rule` for another op's name: a
      JVP rule (``grad_fn`` transposed, both modes), or with ``mode="vjp"``
      a VJP rule (any ``grad_fn``).

    Args:
      fn: the function; returns ``(outputs, grad_fn)``.
      name: the op name tables use; defaults to ``fn.__name__``.
      mode: ``"both"`` (the default: reverse mode, and forward mode when
        ``grad_fn`` is linear) or ``"vjp"`` (reverse mode only).

    Returns:
      A function with ``fn``'s signature that returns only the outputs.
      Usable as ``@custom_gradient`` or ``@custom_gradient(name=..., mode=...)``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> @gk.custom_gradient
      ... def log1pexp(x):
      ...     e = jnp.exp(x)
      ...     def grad(upstream):
      ...         return upstream * (1 - 1 / (1 + e))
      ...     return jnp.log1p(e), grad
      >>> float(jax.grad(log1pexp)(100.0)), float(jax.grad(lambda x: jnp.log1p(jnp.exp(x)))(100.0))
      (1.0, nan)
      >>> @gk.custom_gradient
      ... def cube(x):
      ...     return x ** 3, lambda g: g * 3 * x ** 2
      >>> float(jax.hessian(cube)(2.0)), float(jax.jacfwd(cube)(2.0))
      (12.0, 12.0)
      >>> class Scale:
      ...     def __init__(self, s):
      ...         self.s = s
      ...     @gk.custom_gradient
      ...     def mul(self, a, b):
      ...         return a * b * self.s, lambda g: (g * b * self.s, g * a * self.s)
      >>> jax.grad(Scale(2.0).mul, argnums=(0, 1))(3.0, 4.0)
      (Array(8., dtype=float32, weak_type=True), Array(6., dtype=float32, weak_type=True))
    """
    if mode not in ("vjp", "both"):
        raise GradkitError(f"gk.custom_gradient: mode must be 'both' (the default) or 'vjp', got {mode!r}.")
    if fn is None:
        return lambda f: _decorate(f, name, mode)
    if isinstance(fn, str):
        raise GradkitError(
            f"gk.custom_gradient({fn!r}): pass the op name as a keyword, @gk.custom_gradient(name={fn!r}).")
    return _decorate(fn, name, mode)


@overload
def custom_jvp(fn: F, *, name: str | None = None) -> F: ...
@overload
def custom_jvp(fn: None = None, *, name: str | None = None) -> Callable[[F], F]: ...


def custom_jvp(fn=None, *, name=None):
    """Defines a function's derivative with a forward-mode (JVP) closure; serves both modes.

    The forward-mode twin of :func:`custom_gradient`: the decorated function
    returns its outputs and ``jvp_fn``; ``jvp_fn`` receives one tangent per
    positional argument, structured like the argument (``None`` for static
    arguments and integer leaves), and returns the output tangents: a bare
    value for one output, a tuple for several, ``None`` anywhere for zero.
    ``jvp_fn`` may close over forward values. ``jvp``, ``jacfwd`` and
    ``hessian`` use it directly; ``grad``/``vjp`` transpose it, so it must be
    linear in the tangents. Tangents of another floating dtype are cast to
    the output's dtype. An exception raised in ``jvp_fn`` keeps its type.
    Static arguments, methods (``self`` bound, no tangent for it), pytrees,
    tables (``.rule``) and higher orders work as for :func:`custom_gradient`.

    Compared with ``jax.custom_jvp``: no separate rule function, no
    ``nondiff_argnums``, and the rule shares forward intermediates through
    its closure.

    Args:
      fn: the function; returns ``(outputs, jvp_fn)``.
      name: the op name tables use; defaults to ``fn.__name__``.

    Returns:
      A function with ``fn``'s signature that returns only the outputs.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> @gk.custom_jvp
      ... def safe_norm(x):
      ...     n = jnp.sqrt(jnp.sum(x * x))
      ...     unit = jnp.where(n == 0, 0.0, x / jnp.where(n == 0, 1.0, n))
      ...     return n, lambda t: jnp.sum(unit * t)
      >>> zero = jnp.zeros(2)
      >>> jax.grad(safe_norm)(zero).tolist(), jax.jacfwd(safe_norm)(zero).tolist()
      ([0.0, 0.0], [0.0, 0.0])
    """
    if fn is None:
        return lambda f: _decorate(f, name, "jvp")
    if isinstance(fn, str):
        raise GradkitError(f"gk.custom_jvp({fn!r}): pass the op name as a keyword, @gk.custom_jvp(name={fn!r}).")
    return _decorate(fn, name, "jvp")
