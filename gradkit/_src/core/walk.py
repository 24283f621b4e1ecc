"""The one walker over jaxprs: sub-programs in equation params, at any depth.

A higher-order primitive keeps its sub-programs in its params: ``jit`` in
``jaxpr``, ``scan`` in ``jaxpr``, ``while`` in ``cond_jaxpr``/``body_jaxpr``,
``cond`` in the tuple ``branches``, ``custom_linear_solve`` in the NamedTuple
``jaxprs`` (with ``None`` entries), ``shard_map`` and ``checkpoint`` in an
open ``jaxpr``. The walker knows none of these names: it finds every jaxpr,
open or closed, inside any tuple, list, NamedTuple or dict of a param, and
rebuilds the container with the same type when one changes. So primitives
JAX adds later are covered too.

Used by the dispatcher (scan for op names, splice rules in), audit's fix
patcher, and the replay (calls it cannot unroll). What an open or closed
jaxpr is, per JAX version, is :mod:`gradkit._src.compat`'s business.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any, TypeVar, cast

from gradkit._src import compat
from gradkit._src.compat import Jaxpr, JaxprEqn

# A program a walk reads or rewrites: an open jaxpr or a closed one (the same class from jax 0.11 on).
P = TypeVar("P")

_LEAF_TYPES = (str, bytes, int, float, complex, bool, type(None))


def shaped(aval: compat.AbstractValue) -> compat.ShapedArray:
    """A variable's aval as the array type it is (JAX types ``Var.aval`` as the abstract base, with no shape)."""
    return cast(compat.ShapedArray, aval)


def _contains(x: object) -> bool:
    """Whether ``x`` is or holds a jaxpr (containers only are searched)."""
    if compat.is_jaxpr(x):
        return True
    if isinstance(x, (tuple, list)):
        return any(_contains(v) for v in x)
    if isinstance(x, dict):
        return any(_contains(v) for v in x.values())
    return False


def _iter(x: object) -> Iterator[object]:
    if compat.is_jaxpr(x):
        yield x
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from _iter(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _iter(v)


def subprograms(params: Mapping[str, object]) -> list[Any]:  # open or closed jaxprs, as JAX keeps them
    """Every jaxpr (open or closed) in ``params``, at any depth of tuple/list/NamedTuple/dict."""
    out: list[Any] = []
    for v in params.values():
        if not isinstance(v, _LEAF_TYPES):
            out.extend(_iter(v))
    return out


def has_subprograms(eqn: JaxprEqn) -> bool:
    return any(not isinstance(v, _LEAF_TYPES) and _contains(v) for v in eqn.params.values())


def _map(x: object, fn: Callable[[Any], object]) -> object:
    """``x`` with ``fn`` applied to each jaxpr inside; the same object if nothing changed."""
    if compat.is_jaxpr(x):
        return fn(x)
    if isinstance(x, (tuple, list)):
        items = [_map(v, fn) for v in x]
        if all(a is b for a, b in zip(items, x)):
            return x
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):  # NamedTuple
            make: Callable[..., object] = type(x)
            return make(*items)
        return type(x)(items)
    if isinstance(x, dict):
        new = {k: _map(v, fn) for k, v in x.items()}
        if all(new[k] is x[k] for k in x):
            return x
        return type(x)(new) if type(x) is not dict else new
    return x


def map_subprograms(params: Mapping[str, object], fn: Callable[[Any], object]) -> dict[str, object] | None:
    """``params`` with ``fn`` applied to every sub-program; ``None`` if ``fn`` changed none."""
    new: dict[str, object] | None = None
    for k, v in params.items():
        if isinstance(v, _LEAF_TYPES):
            continue
        nv = _map(v, fn)
        if nv is not v:
            if new is None:
                new = dict(params)
            new[k] = nv
    return new


def enters(eqn: JaxprEqn) -> bool:
    """Whether a walk looks inside ``eqn``'s sub-programs.

    Not inside a custom_jvp/custom_vjp function (its own rule defines its
    derivative) or an opaque kernel (``pallas_call``).
    """
    return not compat.is_custom_derivative(eqn) and not compat.is_opaque(eqn)


def equations(jaxpr: object, enter: Callable[[JaxprEqn], bool] = enters) -> Iterator[tuple[JaxprEqn, Jaxpr]]:
    """Every equation of ``jaxpr`` and of the sub-programs it enters: ``(eqn, the jaxpr holding it)``.

    A sub-program shared by several equations (a jitted function called
    twice) is visited once.
    """
    return ((eqn, j) for eqn, j, _ in _visit(jaxpr, enter, scoped=False))


def scoped_equations(jaxpr: object, enter: Callable[[JaxprEqn], bool] = enters
                     ) -> Iterator[tuple[JaxprEqn, tuple[str, ...]]]:
    """Every equation, as :func:`equations` finds them, with its whole name-stack scopes.

    An equation inside a sub-program carries its scopes relative to the
    equation that holds the sub-program (JAX traces sub-programs with a fresh
    name stack); here they are joined: a ``cos`` in a scan body under
    ``jax.named_scope("enc")`` has ``("enc", ...)``. A sub-program reached
    under two different scopes is visited under each.
    """
    return ((eqn, scopes) for eqn, _, scopes in _visit(jaxpr, enter, scoped=True))


def scope_origins(jaxpr: object, marked: Callable[[JaxprEqn], bool], enter: Callable[[JaxprEqn], bool] = enters
                  ) -> set[tuple[tuple[str, ...], tuple[bool, ...]]]:
    """Every distinct name stack of the program's equations (as :func:`scoped_equations` finds them), each
    scope with whether a ``marked`` equation holds it below the scope before it.

    With ``marked`` a loop (``compat.is_loop``), a ``layers`` scope entered
    inside a scan body that runs under ``Model`` is ``(("Model", "layers"),
    (False, True))``: one body traced for every iteration.
    """
    out: set[tuple[tuple[str, ...], tuple[bool, ...]]] = set()
    seen: set[tuple[int, tuple[str, ...], tuple[bool, ...], bool]] = set()
    stack: list[tuple[Jaxpr, tuple[str, ...], tuple[bool, ...], bool]] = [
        (compat.jaxpr_parts(jaxpr)[0], (), (), False)]
    while stack:
        j, scopes, flags, pending = stack.pop()
        if (id(j), scopes, flags, pending) in seen:
            continue
        seen.add((id(j), scopes, flags, pending))
        for eqn in j.eqns:
            own = compat.name_scopes(eqn)
            s = scopes + own
            f = flags + tuple(pending and i == 0 for i in range(len(own)))
            out.add((s, f))
            if enter(eqn):
                inner = (pending and not own) or marked(eqn)
                stack.extend((compat.jaxpr_parts(sub)[0], s, f, inner) for sub in subprograms(eqn.params))
    return out


def _visit(jaxpr: object, enter: Callable[[JaxprEqn], bool], scoped: bool
           ) -> Iterator[tuple[JaxprEqn, Jaxpr, tuple[str, ...]]]:
    """``(eqn, the jaxpr holding it, its scopes)``; the scopes are read only when ``scoped`` (else ``()``)."""
    seen: set[tuple[int, tuple[str, ...]]] = set()
    stack: list[tuple[Jaxpr, tuple[str, ...]]] = [(compat.jaxpr_parts(jaxpr)[0], ())]
    while stack:
        j, outer = stack.pop()
        if (id(j), outer) in seen:
            continue
        seen.add((id(j), outer))
        for eqn in j.eqns:
            scopes = outer + compat.name_scopes(eqn) if scoped else outer
            yield eqn, j, scopes
            if enter(eqn):
                stack.extend((compat.jaxpr_parts(s)[0], scopes) for s in subprograms(eqn.params))


class Rewrite:
    """Maps a jaxpr to one in which some equations are replaced, at any depth.

    ``replace(eqn)`` returns the equations to put in ``eqn``'s place, or
    ``None`` to keep it (and look inside it, where ``enter(eqn)``). Everything
    unchanged is shared with the input: an equation, a sub-program, the whole
    jaxpr when nothing matched. A sub-program shared by several equations is
    rewritten once.

    With ``scoped=True``, ``replace(eqn, outer)`` also gets the name-stack
    scopes of the equations that hold ``eqn``'s jaxpr (``()`` at the top; see
    :func:`scoped_equations`), and a sub-program shared by equations under
    different scopes is rewritten once per scope.
    """

    def __init__(self, replace: Callable[..., list[JaxprEqn] | None],
                 enter: Callable[[JaxprEqn], bool] = enters, *, scoped: bool = False) -> None:
        self._replace = replace
        self._enter = enter
        self._scoped = scoped
        self._memo: dict[Hashable, tuple[object, object]] = {}

    def __call__(self, jaxpr: P) -> P:
        return self._rewrite(jaxpr, ())

    def _rewrite(self, jaxpr: P, outer: tuple[str, ...]) -> P:
        memo_key: Hashable = (id(jaxpr), outer) if self._scoped else id(jaxpr)
        hit = self._memo.get(memo_key)
        if hit is not None and hit[0] is jaxpr:
            return cast(P, hit[1])  # this very jaxpr's rewrite: the same kind
        core, _ = compat.jaxpr_parts(jaxpr)
        eqns: list[JaxprEqn] = []
        changed = False
        for eqn in core.eqns:
            new = self._replace(eqn, outer) if self._scoped else self._replace(eqn)
            if new is not None:
                eqns.extend(new)
                changed = True
                continue
            if self._enter(eqn) and has_subprograms(eqn):
                inner = outer + compat.name_scopes(eqn) if self._scoped else outer
                # code traced for a shard_map body sees its mesh axes; a line in library code is the caller's
                with compat.body_context(eqn), compat.call_site(eqn):
                    params = map_subprograms(eqn.params, functools.partial(self._rewrite, outer=inner))
                if params is not None:
                    eqn = eqn.replace(params=params)
                    changed = True
            eqns.append(eqn)
        result: P = compat.replace_eqns(jaxpr, eqns) if changed else jaxpr  # the same kind, open or closed
        self._memo[memo_key] = (jaxpr, result)
        return result

