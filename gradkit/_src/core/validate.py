"""Checks what a rule returned against what the op needs, and normalises it.

Every check raises :class:`GradkitError` naming the rule, the op and the user's
source line, and saying what was expected and what was got. :func:`check_leaf`
and :func:`match_leaves` also check what a ``custom_gradient`` / ``custom_jvp``
closure returned (``function_gradients.call``), named by its function.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from gradkit._src import compat
from gradkit._src.core import args as args_lib
from gradkit._src.core.rule import OpView, Rule
from gradkit._src.errors import GradkitError, describe


def is_float0(x: object) -> bool:
    return getattr(x, "dtype", None) == jax.dtypes.float0


def has_tangent_space(x: object) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        return isinstance(x, (float, complex))
    return jnp.issubdtype(dtype, jnp.inexact)


def _a(what: str) -> str:
    return f"an {what}" if what[:1] in "aeiou" else f"a {what}"


def _where(rule: Rule, op: OpView) -> str:
    return f"rule {rule.name} for op '{op.name}' at {op.source}"


def align(rule: Rule, op: OpView, value: object, like: Sequence[object], what: str) -> list[object]:
    """Matches ``value`` (one entry per element of ``like``) to ``like``'s leaves.

    Returns one entry per leaf of ``like``: the rule's value or ``None``.
    ``None`` may stand for any subtree. A bare value is accepted for a single
    entry.
    """
    if len(like) == 1 and not isinstance(value, (tuple, list)):
        value = (value,)
    elif len(like) == 1 and isinstance(value, list) and not isinstance(like[0], list):
        value = tuple(value)
        if len(value) != 1:
            value = (value,)
    if not isinstance(value, (tuple, list)):
        raise GradkitError(
            f"{_where(rule, op)} must return a tuple with one {what} per input "
            f"({len(like)} here), got {describe(value)}. Return a tuple such as (ct_x, ct_y); "
            "use None for inputs with no gradient.")
    if len(value) != len(like):
        raise GradkitError(
            f"{_where(rule, op)} returned {len(value)} {what}s for {len(like)} inputs. Return exactly one "
            f"per input of op.inputs, in order (None for no gradient).")
    out: list[object] = []
    for i, (v, ref) in enumerate(zip(value, like)):
        out.extend(_align_one(rule, op, v, ref, what, f"input {i}"))
    return out


def _align_one(rule: Rule, op: OpView, value: object, ref: object, what: str, where: str) -> list[object]:
    if value is not None and not isinstance(value, (tuple, list, dict)) and len(jax.tree_util.tree_leaves(ref)) == 1 \
            and jax.tree_util.tree_leaves(ref)[0] is ref:
        # A single array input and no container: the value is its one leaf, and
        # check_leaf says what is wrong with it (no tree_map over, e.g., a generator).
        return [value]
    return match_leaves(value, ref, _where(rule, op), what, where)


def match_leaves(value: object, ref: object, where: str, what: str, label: str) -> list[object]:
    """``value``'s entries aligned with ``ref``'s leaves; ``None`` stands for any subtree.

    ``where`` (what is being checked: the rule and op, or the function) and
    ``label`` (which input) go into the error message.
    """
    ref_leaves = jax.tree_util.tree_leaves(ref)
    if value is None:
        return [None] * len(ref_leaves)
    got: list[object] = []

    def visit(v: object, r: object) -> None:
        r_leaves = jax.tree_util.tree_leaves(r)
        if v is None:
            got.extend([None] * len(r_leaves))
        elif len(r_leaves) == 1 and r_leaves[0] is r:
            got.append(v)
        else:
            raise GradkitError(
                f"{where}: the {what} for {label} has a leaf {describe(v)} where the input has a subtree "
                f"{jax.tree_util.tree_structure(r)}. Match the input's structure, or use None for the whole "
                "subtree.")

    try:
        jax.tree_util.tree_map(visit, value, ref, is_leaf=lambda x: x is None)
    except GradkitError:
        raise
    except (ValueError, TypeError) as e:
        raise GradkitError(
            f"{where}: the {what} for {label} has structure "
            f"{jax.tree_util.tree_structure(value, is_leaf=lambda x: x is None)} but the input has "
            f"{jax.tree_util.tree_structure(ref)}. Return the same structure (None allowed anywhere).") from e
    return got


Cast = Literal["weak", "real"]
Absent = Literal["zeros", "none"]


def spec(shape: Sequence[int], dtype: DTypeLike) -> str:
    """``float32[3,4]``: a leaf's dtype and shape, as error messages write them."""
    return f"{jnp.dtype(dtype)}[{','.join(map(str, shape))}]"


def check_leaf(value: object, primal: ArrayLike | None, *, where: str, leaf: str, what: str, cast: Cast,
               absent: Absent) -> jax.Array | np.ndarray | None:
    """Checks one cotangent/tangent leaf against its primal; returns it as a JAX value of the primal's dtype.

    The one checker for what a rule (``check_all``) or a ``custom_gradient`` /
    ``custom_jvp`` closure returned for one leaf. Errors read ``{where}
    returned ... for {leaf}``: ``where`` names the rule and op, or the
    function and its closure; ``leaf`` names the leaf (``leaf 0``, or an
    argument's name).
    ``what`` is ``cotangent``, ``gradient`` or ``output tangent`` (the last
    is checked against an output, the others against an input).

    ``cast``, which values of another dtype are cast to the primal's:

    * ``"weak"`` (rules): only weakly typed ones (a Python ``int``/``float``,
      ``jnp.asarray(0.5)``), which have no dtype of their own; a Python
      ``bool`` and any other dtype are errors.
    * ``"real"`` (``custom_gradient``, documented): any boolean, integer or
      floating value (e.g. a float64 gradient for a float32 argument).

    Under both, a complex value for a real primal is an error, and a shape
    other than the primal's is one. ``absent``, what ``None`` and a primal
    with no tangent space (integer, boolean: whatever was returned for it)
    become: ``"zeros"``, zeros of the primal's shape and dtype (``float0``
    zeros for no tangent space), or ``"none"``, ``None``.
    """
    shape = tuple(np.shape(primal))
    dtype = jnp.result_type(primal)
    ref = "output" if what.startswith("output") else "input"
    if not jnp.issubdtype(dtype, jnp.inexact):
        # Integer and boolean values have no tangent space: whatever was
        # returned, JAX needs float0 zeros here (or no value at all).
        return np.zeros(shape, dtype=jax.dtypes.float0) if absent == "zeros" else None
    if value is None:
        return jnp.zeros(shape, dtype) if absent == "zeros" else None
    real = not jnp.issubdtype(dtype, jnp.complexfloating)
    if args_lib.is_number(value):
        if isinstance(value, bool) and cast == "weak":
            # True/False as a gradient is almost always a bug (a comparison
            # returned by mistake); JAX would silently read it as 1.0/0.0.
            raise GradkitError(
                f"{where} returned a Python bool as the {what} for {leaf} ({spec(shape, dtype)}). "
                f"Return a number or an array of the {ref}'s dtype.")
        if isinstance(value, complex) and real:
            raise GradkitError(
                f"{where} returned a Python complex as the {what} for {leaf}, whose {ref} is real ({dtype}); "
                "the imaginary part would be lost. Return a real value.")
        if shape != ():
            raise GradkitError(
                f"{where} returned a Python {type(value).__name__} as the {what} for {leaf}, which is "
                f"{spec(shape, dtype)}. Return an array of that shape, e.g. jnp.full_like(x, value).")
        return jnp.asarray(value, dtype)
    vshape = getattr(value, "shape", None)
    vdtype = getattr(value, "dtype", None)
    if vshape is None or vdtype is None:
        raise GradkitError(
            f"{where} returned {describe(value)} as the {what} for {leaf}; expected an array "
            f"{spec(shape, dtype)} or None.")
    if tuple(vshape) != shape:
        hint = (" It looks broadcast: sum it over the broadcast axes (e.g. jnp.sum(g, axis=...))."
                if _broadcasts_to(shape, tuple(vshape)) else f" Broadcast or reduce it to the {ref}'s shape.")
        raise GradkitError(
            f"{where} returned {_a(what)} of shape {tuple(vshape)} for {leaf}, expected {shape} "
            f"({spec(shape, dtype)}, the {ref}'s shape).{hint}")
    if vdtype == dtype:
        return jnp.asarray(value)
    if real and jnp.issubdtype(vdtype, jnp.complexfloating):
        raise GradkitError(
            f"{where} returned {_a(what)} of dtype {vdtype} for {leaf}, expected {dtype} (shape {shape}): "
            f"it is complex and the {ref} is real. Return a real value, e.g. jnp.real(g).")
    if _cast_ok(value, vdtype, cast):
        return jnp.asarray(value).astype(dtype)
    raise GradkitError(
        f"{where} returned {_a(what)} of dtype {vdtype} for {leaf}, expected {dtype} (shape {shape}). "
        f"Compute it in the {ref}'s dtype or cast with .astype({dtype}).")


def _broadcasts_to(shape: tuple[int, ...], vshape: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``vshape``: the value was broadcast and wants a sum."""
    try:
        return np.broadcast_shapes(shape, vshape) == vshape
    except ValueError:
        return False


def _cast_ok(value: object, vdtype: DTypeLike, cast: Cast) -> bool:
    """Whether a (non-complex-for-real) value of ``vdtype`` may be cast under ``cast``.

    ``"weak"``: a weakly typed value (e.g. ``jnp.asarray(0.5)``, or ``g * 0 + 1.0``
    under x64) has no dtype of its own: it takes the primal's, like a Python
    scalar. ``"real"``: any boolean, integer or floating value.
    """
    if cast == "weak" and not compat.is_weakly_typed(value):
        return False
    kinds = (jnp.integer, jnp.floating, jnp.complexfloating) if cast == "weak" else (
        jnp.bool_, jnp.integer, jnp.floating, jnp.complexfloating)
    return any(jnp.issubdtype(vdtype, k) for k in kinds)


def check_all(rule: Rule, op: OpView, values: Sequence[object], primals: Sequence[ArrayLike | None],
              what: str) -> list[ArrayLike]:
    """A rule's leaves, checked: only weakly typed values are cast, ``None`` is zeros."""
    where = _where(rule, op)
    out: list[ArrayLike] = []
    for i, (v, p) in enumerate(zip(values, primals)):
        checked = check_leaf(v, p, where=where, leaf=f"leaf {i}", what=what, cast="weak", absent="zeros")
        assert checked is not None  # absent="zeros"
        out.append(checked)
    return out


def checked_call(rule: Rule, op: OpView, arg: Any) -> object:  # Any: a VJP rule's g or a JVP rule's tangents

    """Calls the rule; an exception inside it keeps its type, with a ``[gradkit]`` note naming the op."""
    try:
        return rule.fn(op, arg)
    except GradkitError:
        raise
    except Exception as e:
        hint = ""
        if isinstance(e, compat.CONCRETIZATION_ERRORS):
            hint = (" Rules are traced, like jax.jit functions: op.inputs, op.outputs and the incoming values "
                    "are abstract, so Python `if`, `float()` and NumPy calls on them fail. Use jnp.where, "
                    "lax.cond or jnp functions instead.")
        compat.add_note(e, (
            f"[gradkit] raised inside {_where(rule, op)}, called with op (inputs "
            f"{', '.join(describe(x) for x in jax.tree_util.tree_leaves(op.inputs))}) and the incoming "
            f"{'cotangent' if rule.mode == 'vjp' else 'tangents'}.{hint}"))
        raise
