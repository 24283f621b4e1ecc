"""Checks what a rule returned against what the op needs, and normalises it.

Every check raises :class:`GradkitError` naming the rule, the op and the user's
source line, and saying what was expected and what was got.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike, DTypeLike

from gradkit._src import compat
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


def check_leaf(rule: Rule, op: OpView, value: object, primal: ArrayLike | None, what: str,
               index: int) -> jax.Array | np.ndarray:
    """Checks one cotangent/tangent leaf against its primal; returns a JAX value.

    ``None`` becomes zeros (``float0`` zeros for integer and boolean primals).
    """
    shape = tuple(np.shape(primal))
    dtype = jnp.result_type(primal)
    if not jnp.issubdtype(dtype, jnp.inexact):
        # Integer and boolean values have no tangent space: whatever the rule
        # said, JAX needs float0 zeros here.
        return np.zeros(shape, dtype=jax.dtypes.float0)
    if value is None:
        return jnp.zeros(shape, dtype)
    if isinstance(value, (bool, int, float, complex)) and not isinstance(value, np.generic):
        if isinstance(value, bool):
            # True/False as a gradient is almost always a bug (a comparison
            # returned by mistake); JAX would silently read it as 1.0/0.0.
            raise GradkitError(
                f"{_where(rule, op)} returned a Python bool as the {what} for leaf {index} "
                f"({dtype}[{','.join(map(str, shape))}]). Return a number or an array of the input's dtype.")
        if isinstance(value, complex) and not jnp.issubdtype(dtype, jnp.complexfloating):
            raise GradkitError(
                f"{_where(rule, op)} returned a Python complex as the {what} for leaf {index}, whose input is "
                f"real ({dtype}); the imaginary part would be lost. Return a real value.")
        if shape != ():
            raise GradkitError(
                f"{_where(rule, op)} returned a Python {type(value).__name__} as the {what} for "
                f"leaf {index}, which is {dtype}[{','.join(map(str, shape))}]. Return an array of that shape, "
                "e.g. jnp.full_like(x, value).")
        return jnp.asarray(value, dtype)
    vshape = getattr(value, "shape", None)
    vdtype = getattr(value, "dtype", None)
    if vshape is None or vdtype is None:
        raise GradkitError(
            f"{_where(rule, op)} returned {describe(value)} as the {what} for leaf {index}; expected an "
            f"array {dtype}[{','.join(map(str, shape))}] or None.")
    if tuple(vshape) != shape:
        raise GradkitError(
            f"{_where(rule, op)} returned {_a(what)} of shape {tuple(vshape)} for leaf {index}, "
            f"expected {shape} (dtype {dtype}) to match the input. Broadcast or reduce it to the input's shape.")
    if vdtype != dtype and _weak_cast_ok(value, vdtype, dtype):
        # A weakly typed value (e.g. jnp.asarray(0.5), or `g * 0 + 1.0` under
        # x64) has no dtype of its own: it takes the input's, like a Python scalar.
        return jnp.asarray(value).astype(dtype)
    if vdtype != dtype:
        raise GradkitError(
            f"{_where(rule, op)} returned {_a(what)} of dtype {vdtype} for leaf {index}, expected {dtype} "
            f"(shape {shape}). Compute it in the input's dtype or cast with .astype({dtype}).")
    return jnp.asarray(value)


def check_all(rule: Rule, op: OpView, values: Sequence[object], primals: Sequence[ArrayLike | None],
              what: str) -> list[ArrayLike]:
    return [check_leaf(rule, op, v, p, what, i) for i, (v, p) in enumerate(zip(values, primals))]


def _weak_cast_ok(value: object, vdtype: DTypeLike, dtype: DTypeLike) -> bool:
    """Whether ``value`` is weakly typed and casting it to ``dtype`` loses no kind of information."""
    if not compat.is_weakly_typed(value):
        return False
    if jnp.issubdtype(vdtype, jnp.complexfloating):
        return bool(jnp.issubdtype(dtype, jnp.complexfloating))
    return bool(jnp.issubdtype(vdtype, jnp.integer) or jnp.issubdtype(vdtype, jnp.floating))


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
