"""The ready tables behind :mod:`gradkit.tables` (SAFE, STABLE, F32_BACKWARD, BROADENED, ...).

Each is marked as shipped (``core.table.shipped``): ``strict=True`` checks it as
one unit, through ``|`` and ``.within``. A table of ops the user names
(:func:`upcast_backward`) is the user's own entries, checked one by one.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as _jnp
from jax.typing import DTypeLike

from gradkit._src.core.table import RuleTable, shipped
from gradkit._src.rules import library as _lib
from gradkit._src.rules import upcast as _up

SAFE: RuleTable = shipped(RuleTable(_lib.ready_table("safe", "SAFE")), "gk.tables.SAFE")

STRAIGHT_THROUGH: RuleTable = shipped(RuleTable(
    {name: _lib.make_rule("straight_through", name) for name in ("round", "floor", "ceil", "sign")}),
    "gk.tables.STRAIGHT_THROUGH")

STABLE: RuleTable = shipped(RuleTable(_lib.ready_table("stable", "STABLE")), "gk.tables.STABLE")

STABLE_FUNCTIONS: RuleTable = shipped(RuleTable(_lib.ready_table("stable", "STABLE_FUNCTIONS")),
                                      "gk.tables.STABLE_FUNCTIONS")


# Chosen by measurement: benchmarks/bench_f32_backward.py --ablation (see the module docstring). "add":
# an add that broadcasts a bias sums its cotangent over the batch, in bfloat16 unless upcast.
_F32_BACKWARD_OPS = ("fn:log_softmax", "fn:logsumexp", "fn:softmax", "fn:standardize", "exp", "log", "rsqrt",
                     "tanh", "logistic", "add")


def upcast_backward(*op_names: str, dtype: DTypeLike = _jnp.float32) -> RuleTable:
    """A table computing the named ops' derivatives in ``dtype`` (float32) for low-precision programs.

    Each rule upcasts the op's inputs and tangents, re-evaluates the op in
    ``dtype`` (a primitive, or the program of a ``jax.jit``/``custom_jvp``
    function keyed ``"fn:<name>"``), takes JAX's derivative there and casts the
    tangent back to the op's dtype. The forward pass is unchanged, bit for
    bit; every mode (``grad``, ``jvp``, ``jacfwd``, ``hessian``) goes through
    the rules. Ops whose inputs are already ``dtype`` or wider are
    differentiated as before (in their own precision).

    Args:
      *op_names: primitive names (``"exp"``, ``"tanh"``) and ``"fn:<name>"``
        keys of jitted functions (``"fn:log_softmax"``).
      dtype: the precision of the derivative: ``jnp.float32`` (default) or ``jnp.float64``.

    Returns:
      A :class:`~gradkit.RuleTable`; combine it with others with ``|``.

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> f = lambda x: jnp.tanh(x)
      >>> x = jnp.bfloat16(3.0)
      >>> float(jax.grad(f)(x)), float(jax.grad(gk.override(f, gk.tables.upcast_backward("tanh")))(x))
      (0.0078125, 0.0098876953125)
    """
    return RuleTable(_up.upcast_table(list(op_names), dtype))


F32_BACKWARD: RuleTable = shipped(upcast_backward(*_F32_BACKWARD_OPS), "gk.tables.F32_BACKWARD")


def broadened(eps: float | None = None) -> RuleTable:
    """A table of ``eigh`` and ``svd`` derivatives with Lorentzian-broadened ``1/gap`` factors.

    Every ``1/x`` of a gap (``1/(w_j - w_i)`` of ``eigh``; ``1/(s_j - s_i)``
    and ``1/s`` of ``svd``) becomes ``x / (x^2 + eps * scale^2)``: ``1/x`` where
    the gap is large against ``sqrt(eps) * scale``, 0 where it is 0, never
    above ``1 / (2 sqrt(eps) scale)``. See the module docstring for when the
    answer at a degeneracy is the true gradient and when it is not.

    Args:
      eps: the broadening, *relative* to the spectrum's scale squared (``scale``
        is ``max |w|`` or the largest singular value, per matrix), so scaling
        the matrix scales the derivative exactly, and one ``eps`` serves a
        matrix of any norm (an absolute one would broaden every gap of a
        small matrix and none of a large one). ``None`` (default): ``1e-12``
        in float64 (the tensor-network codes' value), ``1e-9`` in float32,
        where the round-off gap of a degenerate pair (``~1e-7`` of the scale)
        would be amplified to percent errors by ``1e-12``.

    Returns:
      A :class:`~gradkit.RuleTable` with JVP rules for ``"eigh"`` and ``"svd"``
      (every mode; reverse mode by JAX's transposition).

    Examples:
      >>> import jax, jax.numpy as jnp, gradkit as gk
      >>> def rotation(a):  # the rotation nearest to a (Kabsch): the polar factor u @ vt
      ...     u, s, vt = jnp.linalg.svd(a, full_matrices=False)
      ...     return (u @ vt)[0, 1]
      >>> jax.grad(rotation)(jnp.eye(2))  # s = (1, 1): 1/(s_j^2 - s_i^2) = inf
      Array([[nan, nan],
             [nan, nan]], dtype=float32)
      >>> jax.grad(gk.override(rotation, gk.tables.broadened(eps=1e-8)))(jnp.eye(2))
      Array([[ 0. ,  0.5],
             [-0.5,  0. ]], dtype=float32)
    """
    extra = {} if eps is None else {"eps": eps}
    table = RuleTable({key: _lib.make_rule("broadened", key, {"op": r.op, **extra},
                                           where=f"gk.tables.broadened(eps={eps!r})")
                       for r in _lib.BROADENED_FAMILY.values() for key in r.keys})
    return shipped(table, "gk.tables.broadened()" if eps is None else f"gk.tables.broadened(eps={eps!r})")


BROADENED: RuleTable = shipped(broadened(), "gk.tables.BROADENED")


def library() -> Mapping[str, _lib.LibraryRule]:
    """The named rules a config can use, by name (each has ``name``, ``doc``, ``params``, ``signature()``).

    Examples:
      >>> import gradkit as gk
      >>> gk.tables.library()["clamped_log"].signature()
      'clamped_log(eps: float (optional))'
    """
    return dict(_lib.LIBRARY)


def describe(table: Mapping[str, object]) -> dict[str, str]:
    """One line per entry of a table: what its rule does (for docs and ``gradkit rules``).

    Examples:
      >>> import gradkit as gk
      >>> gk.tables.describe(gk.tables.SAFE)["log"]
      'safe: 1/x: inf at 0'
      >>> gk.tables.describe(gk.tables.STABLE_FUNCTIONS)["fn:softplus"]
      "stable: jax.nn.softplus / gk.op('softplus'): d = sigmoid(x)"
    """
    table = table if isinstance(table, RuleTable) else RuleTable(table)
    out = {}
    for name, rule in table.items():
        key = rule.key
        if len(key) == 3 and key[0] == "gradkit" and key[1] in _lib.LIBRARY and isinstance(key[2], tuple):
            params = dict(key[2])
            family = _lib.FAMILIES.get(key[1])
            if family is not None and params.get("op") in family:
                extra = ", ".join(f"{k}={v!r}" for k, v in params.items() if k != "op")
                label = f"{key[1]}({extra})" if extra else key[1]
                out[name] = f"{label}: {family[params['op']].doc}"
            elif key[1] == "straight_through":
                out[name] = "straight_through: identity gradient"
            else:
                args = ", ".join(f"{k}={v!r}" for k, v in params.items())
                out[name] = f"{key[1]}({args}): {_lib.LIBRARY[key[1]].doc}" if args else \
                    f"{key[1]}: {_lib.LIBRARY[key[1]].doc}"
        else:
            out[name] = rule.name or type(rule).__name__
    return out
