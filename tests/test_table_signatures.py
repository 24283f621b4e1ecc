"""Every primitive a shipped table names, under every signature JAX accepts for it (issue 39).

For each primitive that a ready table of :mod:`gradkit.tables` names (SAFE,
STABLE, STRAIGHT_THROUGH, F32_BACKWARD, BROADENED) and the opt-in SAFE rules
(``exp``, ``dot_general``), the cases are built from the ``lax`` wrapper's
signature (``inspect``): one case per value of each keyword parameter
(``accuracy``, ``out_dtype``, ``out_sharding``, ``preferred_element_type``,
``rounding_method``, ...), and one per operand form (float32, float64,
bfloat16, a weakly typed operand, a rank-0 or size-1 operand that broadcasts,
a literal, integer and boolean operands that carry no tangent, mixed dtypes).
A wrapper parameter or an equation parameter the test does not know fails
``test_every_parameter_is_known``: a new JAX parameter shows up as a failing
case, not as an untested signature.

Each case is checked in value, ``vjp`` and ``jvp`` against its table's own
oracle. The cases of one primitive share one compiled program, each
transform of each case on its own parameters; a case that fails there is
judged again as a user compiles it, each transform its own program
(:func:`_run`, :func:`_alone`):

* SAFE: plain JAX, bit for bit (the points are not singular), but for the
  last-bit differences tables.py documents: JAX's atanh' up to 0.10, a jvp
  that sums two products, a quotient by an operand broadcast along a size-1
  dimension (1 ULP), the sign of a zero from a 0/1 indicator in bfloat16;
* the opt-in SAFE ``exp``/``dot_general``: plain JAX within a few ULP (XLA
  may round the last bit differently, tables.py says);
* STABLE: the exact derivative within 2 ULP (test_stable.py's bound), the
  value bit for bit;
* STRAIGHT_THROUGH: the identity's derivative (the estimator's definition);
* F32_BACKWARD: for bfloat16 operands, JAX's derivative of the op computed in
  float32 and cast back; float32 and wider: plain JAX bit for bit;
* BROADENED: plain JAX's derivative at a separated spectrum (relative bias
  eps/gap^2); complex operands and a partial ``subset_by_index`` are its
  documented ``[gradkit]`` errors.

Wherever a rule cannot serve a signature, the answer must be JAX's own, never
a ``[gradkit] internal`` error. ``-m slow`` runs every operand form with
every parameter value; the default run takes each once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import zlib
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import mpmath as mp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P
from meshes import make_mesh

import gradkit as gk
from gradkit import tables

F0 = jax.dtypes.float0
BF16 = np.dtype(ml_dtypes.bfloat16)
HAS_OUT_DTYPE = "out_dtype" in inspect.signature(lax.mul).parameters

# --------------------------------------------------------------------------- what the test knows

# The primitives of each table (test_tables_cover_their_primitives checks these against gradkit.tables).
TABLES: dict[str, dict[str, object]] = {
    "SAFE": dict(tables.SAFE),
    "SAFE_OPT_IN": dict(gk.RuleTable({"exp": "safe", "dot_general": "safe"})),
    "STABLE": dict(tables.STABLE),
    "STRAIGHT_THROUGH": dict(tables.STRAIGHT_THROUGH),
    "F32_BACKWARD": {k: v for k, v in tables.F32_BACKWARD.items() if not k.startswith("fn:")},
    "BROADENED": dict(tables.BROADENED),
}

ACCURACY = ("accuracy",)
# Per primitive: the lax wrapper, its operands (the leading parameters of its signature), and the
# parameters of its traced equation, over JAX 0.8 to 0.12 (a key JAX dropped may stay listed).
WRAPPERS: dict[str, tuple[Callable[..., object], int, tuple[str, ...]]] = {
    **{n: (getattr(lax, n), 1, ACCURACY) for n in ("sqrt", "rsqrt", "cbrt", "log", "log1p", "exp", "expm1",
                                                     "tanh", "logistic")},
    **{n: (getattr(lax, n), 1, ()) for n in ("acos", "asin", "acosh", "atanh", "lgamma", "digamma", "erf_inv",
                                               "square", "floor", "ceil", "sign")},
    "round": (lax.round, 1, ("rounding_method",)),
    "integer_pow": (lax.integer_pow, 1, ("y",)),
    **{n: (getattr(lax, n), 2, ()) for n in ("div", "rem", "atan2", "pow", "max", "min", "add")},
    "mul": (lax.mul, 2, ("out_dtype",)),
    "reduce_max": (lax.reduce_max, 1, ("axes", "out_sharding")),
    "reduce_min": (lax.reduce_min, 1, ("axes", "out_sharding")),
    "dot_general": (lax.dot_general, 2, ("dimension_numbers", "precision", "preferred_element_type",
                                         "out_sharding")),
    "eigh": (lax.linalg.eigh, 1, ("lower", "sort_eigenvalues", "subset_by_index", "algorithm")),
    "svd": (lax.linalg.svd, 1, ("full_matrices", "compute_uv", "subset_by_index", "algorithm")),
}

# The values each wrapper parameter takes in the cases (the first is the base case's). A wrapper
# parameter missing here fails test_every_parameter_is_known.
SHARDED = "sharded"  # out_sharding: a sharded output on an Explicit mesh (the operand sharded to match)
PARAM_VALUES: dict[str, tuple[object, ...]] = {
    "accuracy": (None, lax.AccuracyMode.HIGHEST, lax.Tolerance(atol=1e-6, rtol=1e-6, ulps=2)),
    "rounding_method": (lax.RoundingMethod.AWAY_FROM_ZERO, lax.RoundingMethod.TO_NEAREST_EVEN),
    "y": (2, 3, -2, 1, 0),
    "axes": ((1,), (0,), (0, 1), ()),
    "out_sharding": (None, SHARDED),
    "out_dtype": (None,),  # the dtype combinations are operand forms (MUL_OUT_DTYPE below)
    "dimension_numbers": ((((1,), (0,)), ((), ())), (((2,), (1,)), ((0,), (0,)))),
    "precision": (None, lax.Precision.HIGHEST, (lax.Precision.DEFAULT, lax.Precision.HIGHEST)),
    "preferred_element_type": (None, np.float32),
    "lower": (True, False),
    "symmetrize_input": (True, False),
    "sort_eigenvalues": (True, False),
    "subset_by_index": (None, (0, 3), (0, 2)),
    "implementation": (None,),
    "full_matrices": (True, False),
    "compute_uv": (True, False),
    # (JACOBI and POLAR: not on the CPU; the test runs there)
    "algorithm": (None, lax.linalg.SvdAlgorithm.QR, lax.linalg.SvdAlgorithm.DEFAULT),
}

# Inputs away from every singularity: (low, high) per operand.
DOMAIN: dict[str, tuple[tuple[float, float], ...]] = {
    **{n: ((0.5, 3.0),) for n in ("sqrt", "rsqrt", "cbrt", "log", "log1p", "lgamma", "digamma")},
    **{n: ((-0.8, 0.8),) for n in ("acos", "asin", "atanh", "erf_inv")},
    "acosh": ((1.5, 3.0),), "integer_pow": ((0.5, 2.0),),
    **{n: ((-3.0, 3.0),) for n in ("square", "exp", "expm1", "tanh", "logistic", "round", "floor", "ceil", "sign",
                                   "reduce_max", "reduce_min", "eigh", "svd")},
    "div": ((-2.0, 2.0), (0.5, 2.0)), "rem": ((0.5, 3.0), (0.7, 1.3)), "atan2": ((0.5, 2.0), (0.5, 2.0)),
    "pow": ((0.5, 2.0), (-1.5, 1.5)),
    **{n: ((-2.0, 2.0), (-2.0, 2.0)) for n in ("max", "min", "mul", "add", "dot_general")},
}

INT_OK = {"square", "sign", "integer_pow", "reduce_max", "reduce_min", "div", "rem", "max", "min", "mul", "add",
          "dot_general"}
BOOL_OK = {"max", "min"}
NO_BF16 = {"eigh", "svd"}  # (LAPACK has no bfloat16 kernels)


# --------------------------------------------------------------------------- cases


@dataclasses.dataclass(frozen=True)
class Operand:
    """One operand: its dtype and shape, a weakly typed scalar (``weak``) or a Python literal (``literal``)."""

    dtype: np.dtype
    shape: tuple[int, ...]
    weak: bool = False
    literal: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    prim: str
    id: str
    operands: tuple[Operand, ...]
    kwargs: tuple[tuple[str, object], ...]
    x64: bool = False
    mesh: bool = False
    standard: bool = False  # traced under jax_numpy_dtype_promotion="standard" (JAX's own pow JVP needs it)

    @property
    def name(self) -> str:
        return f"{self.prim}[{self.id}]"


def _dt(name: str) -> np.dtype:
    return np.dtype(name) if name != "bfloat16" else BF16


def _needs_x64(ops: tuple[Operand, ...], kwargs: dict[str, object]) -> bool:
    return any(o.dtype in (np.dtype("float64"), np.dtype("int64"), np.dtype("complex128")) for o in ops) or any(
        v is not None and not isinstance(v, (str, bool, tuple, int)) and _is_dtype(v) and np.dtype(v).itemsize == 8
        for v in kwargs.values())


def _is_dtype(v: object) -> bool:
    try:
        np.dtype(v)  # type: ignore[call-overload]
    except TypeError:
        return False
    return True


def _operand_forms(prim: str) -> list[tuple[str, tuple[Operand, ...]]]:
    """The operand forms of ``prim``: (id, operands)."""
    _, arity, _ = WRAPPERS[prim]
    f32, f64, i32 = np.dtype("float32"), np.dtype("float64"), np.dtype("int32")
    if prim == "eigh":
        return [("f32", (Operand(f32, (3, 3)),)), ("f64", (Operand(f64, (3, 3)),)),
                ("batched", (Operand(f32, (2, 3, 3)),)), ("c64", (Operand(np.dtype("complex64"), (3, 3)),))]
    if prim == "svd":
        return [("f32", (Operand(f32, (3, 3)),)), ("f64", (Operand(f64, (3, 3)),)), ("tall", (Operand(f32, (4, 3)),)),
                ("wide", (Operand(f32, (2, 3)),)), ("batched", (Operand(f32, (2, 3, 3)),))]
    if prim == "dot_general":
        return [("f32", (Operand(f32, (2, 3)), Operand(f32, (3, 4)))),
                ("f64", (Operand(f64, (2, 3)), Operand(f64, (3, 4)))),
                ("bf16", (Operand(BF16, (2, 3)), Operand(BF16, (3, 4)))),
                ("int", (Operand(i32, (2, 3)), Operand(i32, (3, 4)))),
                ("f32_int", (Operand(f32, (2, 3)), Operand(i32, (3, 4))))]
    shape = (2, 3)
    forms: list[tuple[str, tuple[Operand, ...]]] = []
    if arity == 1:
        forms += [("f32", (Operand(f32, shape),)), ("f64", (Operand(f64, shape),)),
                  ("scalar", (Operand(f32, ()),))]
        if prim not in NO_BF16:
            forms.append(("bf16", (Operand(BF16, shape),)))
        if prim not in ("reduce_max", "reduce_min"):
            forms.append(("weak", (Operand(f32, (), weak=True),)))
        if prim in INT_OK:
            forms.append(("int", (Operand(i32, shape),)))
        return forms
    forms += [("f32", (Operand(f32, shape), Operand(f32, shape))),
              ("f64", (Operand(f64, shape), Operand(f64, shape))),
              ("bf16", (Operand(BF16, shape), Operand(BF16, shape))),
              ("rank0_lhs", (Operand(f32, ()), Operand(f32, shape))),
              ("rank0_rhs", (Operand(f32, shape), Operand(f32, ()))),
              ("size1_lhs", (Operand(f32, (1, 3)), Operand(f32, shape))),
              ("size1_rhs", (Operand(f32, shape), Operand(f32, (2, 1)))),
              ("weak_rhs", (Operand(f32, shape), Operand(f32, (), weak=True))),
              ("weak_lhs", (Operand(f32, (), weak=True), Operand(f32, shape))),
              ("literal_rhs", (Operand(f32, shape), Operand(f32, (), literal=True))),
              ("literal_lhs", (Operand(f32, (), literal=True), Operand(f32, shape))),
              ("f64_weak", (Operand(f64, shape), Operand(f64, (), weak=True)))]
    if prim in INT_OK:
        forms.append(("int", (Operand(i32, shape), Operand(i32, shape))))
    if prim in BOOL_OK:
        forms.append(("bool", (Operand(np.dtype(bool), shape), Operand(np.dtype(bool), shape))))
    if prim == "pow":
        forms += [("int_exponent", (Operand(f32, shape), Operand(i32, shape))),
                  ("int_exponent_rank0", (Operand(f32, shape), Operand(i32, ())))]
    return forms


# Operand forms of the slow run only (-m slow): float64 (its own compilation context) and more shapes of
# what the default forms already cover. The float64 cases that mix dtypes (out_dtype, preferred_element_type)
# are in the default run.
FULL_ONLY = {"f64", "f64_weak", "batched", "wide", "int_exponent_rank0", "rank0_lhs", "weak_lhs"}


# lax.mul's out_dtype (JAX 0.10+): mixed operand dtypes, widening and narrowing results.
MUL_OUT_DTYPE: list[tuple[str, tuple[str, str], str]] = [
    ("f32*f64->f64", ("float32", "float64"), "float64"),
    ("f64*f32->f64", ("float64", "float32"), "float64"),
    ("f32*f32->f64", ("float32", "float32"), "float64"),
    ("f64*f64->f32", ("float64", "float64"), "float32"),
    ("bf16*bf16->f32", ("bfloat16", "bfloat16"), "float32"),
    ("bf16*f32->f32", ("bfloat16", "float32"), "float32"),
    ("i32*f32->f32", ("int32", "float32"), "float32"),
    ("f32*i32->f64", ("float32", "int32"), "float64"),
    ("f32*f64->f64_rank0", ("float32", "float64"), "float64"),
]


def _wrapper_params(prim: str) -> list[inspect.Parameter]:
    fn, arity, _ = WRAPPERS[prim]
    return list(inspect.signature(fn).parameters.values())[arity:]


def _base_kwargs(prim: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for p in _wrapper_params(prim):
        if p.default is inspect.Parameter.empty:
            out[p.name] = PARAM_VALUES[p.name][0]
    return out


def _valid(prim: str, ops: tuple[Operand, ...], kwargs: dict[str, object]) -> bool:
    """Whether JAX accepts the combination (the wrapper would raise otherwise)."""
    ints = [o.dtype.kind in "iub" for o in ops]
    if prim == "integer_pow" and ints[0] and kwargs.get("y", 2) < 0:
        return False
    if prim == "dot_general":
        batched = kwargs.get("dimension_numbers", PARAM_VALUES["dimension_numbers"][0])[1][0] != ()
        if batched and ops[0].shape != (2, 3, 4):
            return False
        if kwargs.get("preferred_element_type") is not None and any(ints):
            return False
        if kwargs.get("out_sharding") is not None and batched:
            return False
    if prim in ("reduce_max", "reduce_min"):
        axes = kwargs.get("axes", ())
        if any(a >= len(ops[0].shape) for a in axes):
            return False
    if kwargs.get("out_sharding") == SHARDED and ops[0].shape != (2, 3):
        return False
    if prim == "svd" and kwargs.get("subset_by_index") == (0, 3) and min(ops[0].shape[-2:]) < 3:
        return False
    return True


def _fixup(prim: str, ops: tuple[Operand, ...], kwargs: dict[str, object]) -> tuple[Operand, ...]:
    """Operands a parameter needs: a batched dot_general's shapes."""
    dims = kwargs.get("dimension_numbers")
    if prim == "dot_general" and dims is not None and dims[1][0] != ():
        return (dataclasses.replace(ops[0], shape=(2, 3, 4)), dataclasses.replace(ops[1], shape=(2, 4, 5)))
    return ops


def cases_of(prim: str, full: bool = False) -> list[Case]:
    """The cases of ``prim``: its operand forms at the base parameters, and each parameter value on the base form.

    ``full``: every parameter value on every operand form.
    """
    params = _wrapper_params(prim)
    base = _base_kwargs(prim)
    forms = [f for f in _operand_forms(prim) if full or f[0] not in FULL_ONLY]
    out: list[Case] = []

    def add(form_id: str, ops: tuple[Operand, ...], kwargs: dict[str, object], label: str) -> None:
        ops = _fixup(prim, ops, kwargs)
        if prim == "svd" and kwargs.get("subset_by_index") is not None:
            kwargs = {**kwargs, "full_matrices": False}  # JAX's requirement
        if not _valid(prim, ops, kwargs):
            return
        mesh = kwargs.get("out_sharding") == SHARDED
        case_id = f"{form_id}{label}"
        # JAX's own pow JVP mixes an integer exponent into a float (refused under the tests' strict promotion)
        standard = prim == "pow" and ops[1].dtype.kind == "i"
        out.append(Case(prim, case_id, ops, tuple(kwargs.items()), _needs_x64(ops, kwargs), mesh, standard))

    for form_id, ops in forms:
        add(form_id, ops, base, "")
    for p in params:
        for value in PARAM_VALUES[p.name]:
            if p.default is not inspect.Parameter.empty and value is p.default or value == base.get(p.name, p.default):
                continue
            kwargs = {**base, p.name: value}
            for form_id, ops in (forms if full else forms[:1]):
                add(form_id, ops, kwargs, f",{p.name}={_short(value)}")
    if prim == "mul" and HAS_OUT_DTYPE:
        for label, (a, b), res in MUL_OUT_DTYPE:
            shape_b = () if label.endswith("rank0") else (2, 3)
            ops = (Operand(_dt(a), (2, 3)), Operand(_dt(b), shape_b))
            kwargs = {"out_dtype": _dt(res)}
            out.append(Case(prim, f"out_dtype:{label}", ops, tuple(kwargs.items()), _needs_x64(ops, kwargs)))
    if prim == "dot_general":
        for label, (a, b), pref in [("bf16@bf16->f32", ("bfloat16", "bfloat16"), "float32"),
                                    ("f32@f32->f64", ("float32", "float32"), "float64"),
                                    ("bf16@f32->f32", ("bfloat16", "float32"), "float32"),
                                    ("i32@i32->f32", ("int32", "int32"), "float32")]:
            ops = (Operand(_dt(a), (2, 3)), Operand(_dt(b), (3, 4)))
            kwargs = {**base, "preferred_element_type": _dt(pref)}
            out.append(Case(prim, f"preferred:{label}", ops, tuple(kwargs.items()), _needs_x64(ops, kwargs)))
    return out


def _short(v: object) -> str:
    if isinstance(v, type) or _is_dtype(v) and not isinstance(v, (int, tuple, str)) and v is not None:
        return np.dtype(v).name  # type: ignore[call-overload]
    if isinstance(v, lax.Tolerance):
        return "Tolerance"
    return str(v).replace(" ", "")


# --------------------------------------------------------------------------- inputs


def _values(case: Case) -> list[object]:
    """The operands' values (NumPy, or a Python float for a weakly typed one), from a seed of the case."""
    rng = np.random.default_rng(zlib.crc32(case.name.encode()))
    dom = DOMAIN[case.prim]
    vals: list[object] = []
    for k, o in enumerate(case.operands):
        lo, hi = dom[min(k, len(dom) - 1)]
        if o.dtype.kind == "b":
            v = rng.random(o.shape) < 0.5
        elif o.dtype.kind in "iu":
            lo_i, hi_i = (1, 4) if (case.prim in ("div", "rem") and k == 1) else (-2, 3)  # no integer / 0
            v = rng.integers(lo_i, hi_i, o.shape).astype(o.dtype)
        else:
            v = rng.uniform(lo, hi, o.shape)
            if case.prim in ("eigh", "svd"):
                v = _separated(case, rng, o.shape, complex_=o.dtype.kind == "c")
            v = np.asarray(v, o.dtype)
        if o.weak or o.literal:
            v = float(np.asarray(v, np.float64))
        vals.append(v)
    return vals


def _separated(case: Case, rng: np.random.Generator, shape: tuple[int, ...], complex_: bool = False) -> np.ndarray:
    """A matrix with a well separated spectrum (eigenvalues +-1, 2, 3, ...; singular values 1, 2, 3, ...)."""
    m, n = shape[-2:]
    batch = shape[:-2]
    out = np.empty(shape, complex if complex_ else float)
    for idx in np.ndindex(*batch):
        z = rng.normal(size=(m, m)) + (1j * rng.normal(size=(m, m)) if complex_ else 0)
        q1, _ = np.linalg.qr(z)
        if case.prim == "eigh":
            out[idx] = q1 @ np.diag(np.arange(1.0, m + 1) * (-1) ** np.arange(m)) @ np.conj(q1.T)
        else:
            q2, _ = np.linalg.qr(rng.normal(size=(n, n)))
            s = np.zeros((m, n))
            k = min(m, n)
            s[:k, :k] = np.diag(np.arange(k, 0, -1.0))
            out[idx] = q1 @ s @ q2.T
    return out


def op_function(case: Case) -> tuple[Callable[..., object], list[object]]:
    """The op as a function of its dynamic operands (literals closed over), and those operands' values."""
    fn, _, _ = WRAPPERS[case.prim]
    kwargs = dict(case.kwargs)
    vals = _values(case)
    sharded = kwargs.get("out_sharding") == SHARDED
    if sharded:
        axes = kwargs.get("axes")
        kwargs["out_sharding"] = P("x") if case.prim != "dot_general" else P("x", None)
        if axes is not None and 0 in axes:
            kwargs["out_sharding"] = P()
    literal = {k: v for k, (o, v) in enumerate(zip(case.operands, vals)) if o.literal}
    dynamic = [v for k, v in enumerate(vals) if k not in literal]

    def op(*xs: object) -> object:
        it = iter(xs)
        args = [literal[k] if k in literal else next(it) for k in range(len(case.operands))]
        return fn(*args, **kwargs)

    op.__name__ = f"op_{case.prim}"
    return op, dynamic


def _as_jax(v: object, case: Case, first: bool = True) -> object:
    if isinstance(v, float):
        return jnp.asarray(v)  # weakly typed
    a = jnp.asarray(v)
    if case.mesh and first:  # the first operand sharded over its rows
        a = jax.device_put(a, jax.sharding.NamedSharding(_mesh(), P("x", None)))
    return a


@functools.cache
def _mesh() -> jax.sharding.Mesh:
    return make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))


def _context(case: Case) -> contextlib.ExitStack:
    """The configuration a case runs under: x64, its mesh, JAX's standard dtype promotion."""
    stack = contextlib.ExitStack()
    if case.x64:
        stack.enter_context(jax.enable_x64(True))
    if case.mesh:
        stack.enter_context(jax.set_mesh(_mesh()) if hasattr(jax, "set_mesh") else jax.sharding.use_mesh(_mesh()))
    if case.standard:
        stack.enter_context(jax.numpy_dtype_promotion("standard"))
    return stack


def _directions(case: Case, args: list[object], out_struct: object, table: str) -> tuple[list[object], object]:
    """Tangents of the float operands and cotangents of the float outputs.

    Where the oracle is plain JAX, any numbers (a product by them rounds, so an operation done in another
    dtype or order shows); where it is a derivative's definition (STABLE, STRAIGHT_THROUGH), powers of two,
    by which a product is exact.
    """
    rng = np.random.default_rng(zlib.crc32(case.name.encode()) + 1)
    exact = table in ("STABLE", "STRAIGHT_THROUGH")
    pick = np.array([0.5, 1.0, 2.0, -1.0, -0.25, 4.0])

    def draw(shape: tuple[int, ...]) -> np.ndarray:
        return rng.choice(pick, size=shape) if exact else rng.uniform(-2.0, 2.0, size=shape)

    def direction(shape: tuple[int, ...], dtype: np.dtype) -> object:
        v = draw(shape)
        if np.dtype(dtype).kind == "c":
            v = v + 1j * draw(shape)
        return np.asarray(v, dtype)

    ts = [jnp.asarray(direction(np.shape(a), jnp.result_type(a))) if _inexact(a) else None for a in args]
    ts = [jnp.asarray(t, jnp.result_type(a)) if t is not None else None for t, a in zip(ts, args)]  # weak types

    def cotangent(s: jax.ShapeDtypeStruct) -> object:
        if not jnp.issubdtype(s.dtype, jnp.inexact):
            return None
        ct = jnp.asarray(direction(s.shape, s.dtype))
        if case.mesh:  # the output's type, sharding included
            ct = jax.device_put(ct, jax.sharding.NamedSharding(_mesh(), s.sharding.spec))
        return ct

    return ts, jax.tree_util.tree_map(cotangent, out_struct)


def _inexact(a: object) -> bool:
    return bool(jnp.issubdtype(jnp.result_type(a), jnp.inexact))


def _value(g: Callable[..., object], args: list[object], ts: list[object], cts: object) -> object:
    return g(*args)


def _vjp(g: Callable[..., object], args: list[object], ts: list[object], cts: object) -> list[object]:
    """The cotangents of the float operands (``None`` for the others)."""
    out, pull = jax.vjp(g, *args)
    ct_full = jax.tree_util.tree_map(lambda o, c: c if c is not None else np.zeros(np.shape(o), F0), out, cts,
                                     is_leaf=lambda x: x is None)
    return [gr if t is not None else None for gr, t in zip(pull(ct_full), ts)]


def _jvp(g: Callable[..., object], args: list[object], ts: list[object], cts: object) -> object:
    """The output tangents of the float outputs (``None`` for the others)."""
    t_full = [t if t is not None else np.zeros(np.shape(a), F0) for a, t in zip(args, ts)]
    _, t_out = jax.jvp(g, tuple(args), tuple(t_full))
    return jax.tree_util.tree_map(lambda x: x if jnp.issubdtype(x.dtype, jnp.inexact) else None, t_out)


TRANSFORMS = {"value": _value, "vjp": _vjp, "jvp": _jvp}


# --------------------------------------------------------------------------- running a group of cases


@dataclasses.dataclass
class Prepared:
    case: Case
    op: Callable[..., object]
    args: list[object]
    ts: list[object]
    cts: object


def _prepare(case: Case, table: str) -> Prepared:
    op, vals = op_function(case)
    args = [_as_jax(v, case, k == 0) for k, v in enumerate(vals)]
    struct = jax.eval_shape(op, *args)
    ts, cts = _directions(case, args, struct, table)
    return Prepared(case, op, args, ts, cts)


Side = tuple[list["Prepared"], list[Callable[..., object]]]  # cases, and the function each is run with


def _run(sides: list[Side]) -> list[list[dict[str, object]]]:
    """Value, vjp and jvp of every case on every side (plain JAX, the table, a reference): one compiled program.

    One program for the lot: a compilation is most of the time a case costs. Each (side, transform, case)
    reads its own parameters of it, so XLA fuses and reuses nothing across them. It may still round a
    computation otherwise than in the program a user compiles (XLA:CPU compiles digamma's polygamma to
    other bits in a larger program, in plain JAX as much as under a table): a case that differs here is
    judged again with each transform alone (:func:`_alone`).
    """
    names = list(TRANSFORMS)

    def program(inputs: list[list[list[tuple[list[object], list[object], object]]]]) -> list[list[list[object]]]:
        return [[[TRANSFORMS[n](f, a, t, c) for f, (a, t, c) in zip(fns, ins)] for n, ins in zip(names, per_t)]
                for (_, fns), per_t in zip(sides, inputs)]

    inputs = [[[(p.args, p.ts, p.cts) for p in preps] for _ in names] for preps, _ in sides]
    out = jax.tree_util.tree_map(np.asarray, jax.jit(program)(inputs))
    return [[{n: out[s][k][i] for k, n in enumerate(names)} for i in range(len(preps))]
            for s, (preps, _) in enumerate(sides)]


def _alone(p: Prepared, fn: Callable[..., object]) -> dict[str, object]:
    """Value, vjp and jvp of one case, each its own compiled program: what a user's jit(f), jit(grad(f)),
    jit(jvp(f)) compute."""
    return {n: jax.tree_util.tree_map(np.asarray, jax.jit(functools.partial(tr, fn))(p.args, p.ts, p.cts))
            for n, tr in TRANSFORMS.items()}


# --------------------------------------------------------------------------- oracles


def _bits_equal(a: object, b: object) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def _ulps(got: np.ndarray, want: np.ndarray, dtype: np.dtype) -> float:
    """max |got - want| in ULPs of ``want`` in ``dtype`` (``want`` exact or wider)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    if got.size == 0:
        return 0.0
    fi = ml_dtypes.finfo(dtype)
    spacing = np.maximum(np.abs(want), float(fi.tiny)) * float(fi.eps)
    spacing = 2.0 ** np.floor(np.log2(spacing))  # the ULP of the binade of |want|
    return float(np.max(np.abs(got - want) / spacing))


def _leaves(tree: object) -> list[object]:
    return [x for x in jax.tree_util.tree_leaves(tree) if x is not None]


def _compare_bits(case: Case, got: dict[str, object], want: dict[str, object], what: tuple[str, ...],
                  ulps: float = 0.0) -> list[str]:
    bad = []
    for k in what:
        g, w = _leaves(got[k]), _leaves(want[k])
        if len(g) != len(w):
            bad.append(f"{case.name} {k}: {len(g)} results, JAX has {len(w)}")
            continue
        for i, (a, b) in enumerate(zip(g, w)):
            if _bits_equal(a, b):
                continue
            if ulps and a.dtype == b.dtype and a.shape == b.shape and a.dtype.kind in "fc" and np.all(np.isfinite(b)):
                parts = [(a.real, b.real), (a.imag, b.imag)] if a.dtype.kind == "c" else [(a, b)]
                err = max(_ulps(x, y, np.finfo(a.dtype).dtype if a.dtype.kind == "c" else a.dtype) for x, y in parts)
                if err <= ulps:
                    continue
                bad.append(f"{case.name} {k}[{i}]: {err:.2f} ULP from JAX's (bound {ulps})")
                continue
            bad.append(f"{case.name} {k}[{i}]: {_describe(a)} != JAX's {_describe(b)}")
    return bad


def _describe(a: np.ndarray) -> str:
    a = np.asarray(a)
    flat = a.reshape(-1)[:4]
    return f"{a.dtype}{list(a.shape)} {flat.tolist()}"


def _stable_derivative(prim: str, x: np.ndarray) -> np.ndarray:
    """The exact derivative of ``prim`` at ``x`` (mpmath, 40 digits), as float64."""
    mp.mp.dps = 40
    d = {"logistic": lambda v: mp.exp(-v) / (1 + mp.exp(-v)) ** 2, "tanh": lambda v: 1 / mp.cosh(v) ** 2,
         "expm1": mp.exp}[prim]
    flat = [float(d(mp.mpf(float(v)))) for v in np.asarray(x, np.float64).reshape(-1)]
    return np.asarray(flat).reshape(np.shape(x))


def check_stable(p: Prepared, got: dict[str, object], want: dict[str, object]) -> list[str]:
    """Value bit for bit; each derivative within 2 ULP of the exact one (a power-of-two direction scales exactly)."""
    case = p.case
    bad = _compare_bits(case, got, want, ("value",))
    x = np.asarray(p.args[0])
    dtype = np.dtype(jnp.result_type(p.args[0]))
    d = _stable_derivative(case.prim, x)
    for k, direction, result in (("vjp", p.cts, got["vjp"][0]), ("jvp", p.ts[0], got["jvp"])):
        exact = np.asarray(direction, np.float64) * d
        err = _ulps(result, exact, dtype)
        bound = 2.0 if dtype != BF16 else 1.0  # bfloat16: the float32 derivative, rounded once
        if err > bound:
            bad.append(f"{case.name} {k}: {err:.2f} ULP from the exact derivative (bound {bound})")
    return bad


def check_straight_through(p: Prepared, got: dict[str, object], want: dict[str, object]) -> list[str]:
    """Value bit for bit; the identity's derivative: the (co)tangent cast to the operand's (output's) dtype."""
    case = p.case
    bad = _compare_bits(case, got, want, ("value",))
    if p.ts[0] is None:  # an integer operand (sign): no tangent
        return bad + ([f"{case.name} jvp: {got['jvp']}"] if _leaves(got["jvp"]) else [])
    ct, t = np.asarray(p.cts), np.asarray(p.ts[0])
    if not _bits_equal(got["vjp"][0], ct.astype(np.asarray(got["vjp"][0]).dtype)):
        bad.append(f"{case.name} vjp: {_describe(got['vjp'][0])}, not the cotangent {_describe(ct)}")
    if not _bits_equal(got["jvp"], t.astype(np.asarray(got["value"]).dtype)):
        bad.append(f"{case.name} jvp: {_describe(got['jvp'])}, not the tangent {_describe(t)}")
    return bad


def _low(p: Prepared) -> bool:
    return any(_inexact(a) and jnp.finfo(jnp.result_type(a)).bits < 32 for a in p.args)


def f32_reference(preps: list[Prepared]) -> Side:
    """The cases with operands and directions upcast to float32, run with JAX's own derivative."""
    ups, fns = [], []
    for p in preps:
        def up(x: object) -> object:
            return x if x is None or not _inexact(x) or jnp.finfo(jnp.result_type(x)).bits >= 32 else \
                jnp.asarray(x, jnp.float32)

        ups.append(dataclasses.replace(p, args=[up(a) for a in p.args], ts=[up(t) for t in p.ts],
                                       cts=jax.tree_util.tree_map(up, p.cts)))
        fns.append(p.op)
    return ups, fns


def _cast_like(ref: dict[str, object], got: dict[str, object]) -> dict[str, object]:
    """``ref``'s derivatives in ``got``'s dtypes (a float32 reference rounded once to bfloat16)."""
    def cast(r: object, g: object) -> object:
        return None if r is None or g is None else np.asarray(r).astype(np.asarray(g).dtype)

    is_none = lambda x: x is None
    return {k: jax.tree_util.tree_map(cast, ref[k], got[k], is_leaf=is_none) for k in ("vjp", "jvp")}


# The oracle of each table: (per-case check, tolerance in ULP against plain JAX where it is the oracle).
def _safe_ulps(case: Case) -> float:
    if case.prim == "atanh" and _atanh_two_quotients():
        return 2.5  # tables.py: where XLA merges two of JAX's own quotients (JAX up to 0.10's atanh')
    return 0.0


@functools.cache
def _atanh_two_quotients() -> bool:
    jvp = jax.make_jaxpr(lambda x, t: jax.jvp(jnp.arctanh, (x,), (t,)))(0.5, 1.0)
    return any(e.primitive.name == "mul" for e in jvp.eqns)


def _two_terms(p: Prepared) -> bool:
    """The jvp of a two-operand primitive whose operands both carry a tangent: a sum of two products."""
    return len(p.args) == 2 and all(t is not None for t in p.ts)


def check_safe(p: Prepared, got: dict[str, object], want: dict[str, object], alone: bool) -> list[str]:
    """Plain JAX bit for bit (JAX's atanh' up to 0.10: 2.5 ULP, tables.py).

    ``alone``: compiled as a user compiles each transform. There, a sum of two products (the jvp of
    atan2 or div with both operands varying) may differ in the last bit: XLA contracts one product and
    the sum into a fused multiply-add, which one depending on how it fused the program (tables.py), so it
    is within 2 eps of the two terms' magnitudes, each term computed by plain JAX alone.
    """
    case = p.case
    bad = _compare_bits(case, got, want, ("value", "vjp", "jvp"), ulps=_safe_ulps(case))
    if alone and bad and _low(p) and _equal_up_to_zero_sign(got, want):
        # XLA folds JAX's t * convert(b) (reduce_max's 0/1 indicator) into select(b, t, 0), as SAFE writes it,
        # in float32 and float64; in bfloat16 the multiply is done in float32 between two converts and
        # stays one: t * 0 is -0 for a negative t there. The sign of a zero only.
        return []
    if alone and bad and _broadcast_divisor(p) and _within_ulps(got, want, ("vjp",), 1.0):
        # XLA:CPU computes JAX's quotient by an operand broadcast along a size-1 dimension as a product by
        # its reciprocal (two roundings); SAFE's masked quotient divides (tables.py): the last bit (in the
        # jvp, a term of the sum below).
        bad = [b for b in bad if " vjp" not in b]
    if not (alone and _two_terms(p) and bad and all(" jvp" in b for b in bad)):
        return bad
    terms = []
    for k in range(2):
        ts = [t if j == k else jnp.zeros_like(t) for j, t in enumerate(p.ts)]
        terms.append(np.asarray(jax.jit(functools.partial(_jvp, p.op))(p.args, ts, p.cts), np.float64))
    g, w = np.asarray(got["jvp"], np.float64), np.asarray(want["jvp"], np.float64)
    eps = float(np.finfo(np.asarray(want["jvp"]).dtype).eps)
    if np.all(np.abs(g - w) <= 2 * eps * (np.abs(terms[0]) + np.abs(terms[1]))):
        return []
    return bad


def _equal_up_to_zero_sign(got: dict[str, object], want: dict[str, object]) -> bool:
    pairs = [(a, b) for k in ("value", "vjp", "jvp") for a, b in zip(_leaves(got[k]), _leaves(want[k]))]
    return all(np.asarray(a).dtype == np.asarray(b).dtype and np.array_equal(a, b, equal_nan=True) for a, b in pairs)


def _broadcast_divisor(p: Prepared) -> bool:
    """A div whose divisor broadcasts along a size-1 dimension (not a rank-0 one)."""
    return p.case.prim == "div" and 0 < np.ndim(p.args[-1]) and np.size(p.args[-1]) < np.size(p.args[0])


def _within_ulps(got: dict[str, object], want: dict[str, object], what: tuple[str, ...], ulps: float) -> bool:
    for k in what:
        for a, b in zip(_leaves(got[k]), _leaves(want[k])):
            if _ulps(a, b, np.asarray(b).dtype) > ulps:
                return False
    return True


def check(table: str, p: Prepared, got: dict[str, object], want: dict[str, object],
          ref32: dict[str, object] | None, alone: bool = False) -> list[str]:
    case = p.case
    all3 = ("value", "vjp", "jvp")
    if table == "SAFE":
        return check_safe(p, got, want, alone)
    if table == "SAFE_OPT_IN":
        return _compare_bits(case, got, want, all3, ulps=4.0)
    if table == "STABLE":
        if p.ts[0] is None:
            return _compare_bits(case, got, want, all3)
        return check_stable(p, got, want)
    if table == "STRAIGHT_THROUGH":
        return check_straight_through(p, got, want)
    if table == "F32_BACKWARD":
        if ref32 is None:  # float32 and wider: unchanged
            return _compare_bits(case, got, want, all3)
        return _compare_bits(case, got, want, ("value",)) + _compare_bits(case, got, _cast_like(ref32, got),
                                                                          ("vjp", "jvp"), ulps=1.0)
    if table == "BROADENED":
        bad = _compare_bits(case, got, want, ("value",))
        for k in ("vjp", "jvp"):
            for a, b in zip(_leaves(got[k]), _leaves(want[k])):
                tol = 1e-4 if np.asarray(a).dtype in (np.float32, np.complex64) else 1e-9
                if not np.allclose(a, b, rtol=tol, atol=tol * np.max(np.abs(b), initial=1.0)):
                    bad.append(f"{case.name} {k}: {_describe(a)} vs JAX's {_describe(b)}")
        return bad
    raise AssertionError(table)


def _partial_spectrum(case: Case) -> bool:
    subset = dict(case.kwargs).get("subset_by_index")
    return subset is not None and tuple(subset) != (0, min(case.operands[0].shape[-2:]))


def _broadened_declines(case: Case) -> bool:
    """BROADENED's documented errors: complex operands, part of a spectrum (tables.py)."""
    return case.operands[0].dtype.kind == "c" or _partial_spectrum(case)


def _internal(e: BaseException) -> bool:
    return str(e).startswith("[gradkit] internal")


# --------------------------------------------------------------------------- the tests

GROUPS = [(t, prim) for t, rules in TABLES.items() for prim in sorted(rules)]


def _groups_of(cases: list[Case]) -> dict[tuple[bool, bool, bool], list[Case]]:
    out: dict[tuple[bool, bool, bool], list[Case]] = {}
    for c in cases:
        out.setdefault((c.x64, c.mesh, c.standard), []).append(c)
    return out


def _each(sides: list[Side]) -> tuple[list[list[dict[str, object] | None]], list[list[BaseException | None]]]:
    """Every side's results in one program, with each case's error where it has one.

    Where the program fails, a case that fails to trace (JAX's own refusal, a rule's error) is found by
    tracing it alone, abstractly, and left out; a failure only the compilation finds is found case by case.
    """
    try:
        return _run(sides), [[None] * len(preps) for preps, _ in sides]  # type: ignore[return-value]
    except Exception:
        pass
    errors: list[list[BaseException | None]] = []
    for preps, fns in sides:
        errors.append([])
        for p, f in zip(preps, fns):
            try:
                jax.eval_shape(lambda a, t, c, f=f: {n: tr(f, a, t, c) for n, tr in TRANSFORMS.items()},
                               p.args, p.ts, p.cts)
                errors[-1].append(None)
            except Exception as e:
                errors[-1].append(e)
    live = [([p for p, e in zip(preps, errs) if e is None], [f for f, e in zip(fns, errs) if e is None])
            for (preps, fns), errs in zip(sides, errors)]
    results: list[list[dict[str, object] | None]] = [[None] * len(errs) for errs in errors]
    try:
        ran = _run(live)
        for res, errs, out in zip(results, errors, ran):
            for i, r in zip([i for i, e in enumerate(errs) if e is None], out):
                res[i] = r
    except Exception:
        for (preps, fns), res, errs in zip(sides, results, errors):
            for i, (p, f) in enumerate(zip(preps, fns)):
                if errs[i] is None:
                    try:
                        res[i] = _run([([p], [f])])[0][0]
                    except Exception as e:
                        errs[i] = e
    return results, errors


def _error(p: Prepared, e: BaseException) -> str:
    return f"{p.case.name}: {type(e).__name__}: {str(e)[:400]}"


def _run_table_case_group(table: str, cases: list[Case]) -> list[str]:
    """Every case of one primitive under ``table``: the failures, one line each."""
    rules = {c.prim: TABLES[table][c.prim] for c in cases[:1]}
    failures: list[str] = []
    for group in _groups_of(cases).values():
        with _context(group[0]):
            preps = [_prepare(c, table) for c in group]
            sides: list[Side] = [(preps, [p.op for p in preps]),
                                 (preps, [gk.override(p.op, rules, strict=True) for p in preps])]
            low = [i for i, p in enumerate(preps) if table == "F32_BACKWARD" and _low(p)]
            if low:
                sides.append(f32_reference([preps[i] for i in low]))
            results, errs = _each(sides)
            (plain, over), (refused, errors) = results[:2], errs[:2]
            ref32 = dict(zip(low, results[2])) if low else {}
            for i, p in enumerate(preps):
                got, error, jax_error = over[i], errors[i], refused[i]
                if error is not None:
                    failures += _judge_error(table, p, error, jax_error)
                elif jax_error is not None:  # the table serves what JAX refuses (BROADENED's full_matrices)
                    failures += _judge_served(p, got, jax_error)
                else:
                    bad = check(table, p, got, plain[i], ref32.get(i))
                    if bad:  # judged again as a user compiles it: each transform of the case alone (_run)
                        ref = None
                        if i in ref32:
                            ups, fns = sides[2]
                            ref = _alone(ups[low.index(i)], fns[low.index(i)])
                        bad = check(table, p, _alone(p, sides[1][1][i]), _alone(p, p.op), ref, alone=True)
                    failures += bad
    return failures


def _judge_error(table: str, p: Prepared, error: BaseException, jax_error: BaseException | None) -> list[str]:
    """An error under the table is right only where JAX raises one too, or where the table documents it."""
    if isinstance(error, gk.GradkitError):
        if _internal(error):
            return [_error(p, error)]
        if table == "BROADENED" and _broadened_declines(p.case):
            return []
    if jax_error is not None and type(error) is type(jax_error):
        return []
    return [_error(p, error) + (f" (JAX: {type(jax_error).__name__})" if jax_error else " (JAX serves it)")]


def _judge_served(p: Prepared, got: dict[str, object], jax_error: BaseException) -> list[str]:
    """Where JAX's own derivative refuses (svd's full_matrices on a non-square matrix): the value is JAX's, the
    derivatives finite."""
    value = jax.tree_util.tree_map(np.asarray, jax.jit(p.op)(*p.args))
    bad = _compare_bits(p.case, got, {"value": value}, ("value",))
    if not all(np.all(np.isfinite(x)) for k in ("vjp", "jvp") for x in _leaves(got[k])):
        bad.append(f"{p.case.name}: non-finite derivatives where JAX raises {type(jax_error).__name__}")
    return bad


@pytest.mark.parametrize("table,prim", GROUPS, ids=[f"{t}-{p}" for t, p in GROUPS])
def test_every_signature_under_its_table(table, prim):
    failures = _run_table_case_group(table, cases_of(prim))
    assert not failures, "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("table,prim", GROUPS, ids=[f"{t}-{p}" for t, p in GROUPS])
def test_every_signature_under_its_table_every_form(table, prim):
    """Every parameter value on every operand form."""
    failures = _run_table_case_group(table, cases_of(prim, full=True))
    assert not failures, "\n".join(failures)


def test_tables_cover_their_primitives():
    """The test's tables are gradkit's: a primitive added to a table gets cases here."""
    for name, rules in TABLES.items():
        assert set(rules) <= set(WRAPPERS), (name, sorted(set(rules) - set(WRAPPERS)))
    shipped = {k for t in (tables.SAFE, tables.STABLE, tables.STRAIGHT_THROUGH, tables.F32_BACKWARD,
                           tables.BROADENED) for k in t if not k.startswith("fn:")}
    assert shipped <= set(WRAPPERS)


@pytest.mark.parametrize("prim", sorted(WRAPPERS))
def test_every_parameter_is_known(prim):
    """The wrapper's parameters and the traced equation's are the test's: a new one fails here."""
    fn, arity, eqn_params = WRAPPERS[prim]
    unknown = [p.name for p in _wrapper_params(prim) if p.name not in PARAM_VALUES]
    assert not unknown, f"lax.{prim} has parameters {unknown} this test does not know: add their values"
    for case in cases_of(prim):
        with _context(case):
            op, vals = op_function(case)
            jaxpr = jax.make_jaxpr(op)(*[_as_jax(v, case, k == 0) for k, v in enumerate(vals)])
        eqns = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == prim]
        assert eqns, f"{case.name}: no {prim} equation in {jaxpr}"
        for e in eqns:
            new = sorted(set(e.params) - set(eqn_params))
            assert not new, f"{case.name}: the {prim} equation has parameters {new} this test does not know"
