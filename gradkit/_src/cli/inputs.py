"""Example inputs for ``gradkit audit`` from spec strings: ``f32[128]:uniform(-1,1)`` and the like.

Private to the command line (``gradkit.cli`` re-exports what it needs); a bad spec is a :class:`UsageError`,
which the command reports as one ``[gradkit]`` line with exit code 2.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:  # numpy is imported when an input is built, not when the command starts
    import numpy as np
    from numpy.typing import DTypeLike

_T = TypeVar("_T")

DTYPE_HELP = ("f16 (or float16), bf16 (bfloat16), f32 (float32), f64 (float64), i32 (int32), i64 (int64) "
              "or bool")
SPEC_HELP = (
    "DTYPE[SHAPE][:VALUES], e.g. f32[128]:uniform(-1,1), f64[4,3]:normal(0,2), f32[]:100, "
    f"f32[3]:[0,1,2], i32[8]:randint(0,10), bool[8]:bernoulli(0.5). DTYPE is {DTYPE_HELP}; VALUES is "
    "uniform(lo,hi), normal(mean,std), linspace(lo,hi), randint(lo,hi) (hi excluded), bernoulli(p) (p in [0,1]), "
    "zeros, ones, full(v), a number or a list (default: normal(0,1) for floats, randint(0,10) for integers, "
    "bernoulli(0.5) for bool)")

_DTYPES = {"f16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "f32": "float32", "float32": "float32", "f64": "float64", "float64": "float64",
           "i32": "int32", "int32": "int32", "i64": "int64", "int64": "int64", "bool": "bool"}
_SPEC = re.compile(r"^\s*(?P<dtype>[A-Za-z0-9]+)\s*\[(?P<shape>[^\]]*)\]\s*(?::\s*(?P<values>.+?))?\s*$")
_CALL = re.compile(r"^(?P<name>[a-z_]+)\s*(?:\((?P<args>[^()]*)\))?$")


class UsageError(Exception):
    """A bad command line or input declaration: reported as one line, exit code 2."""


# --------------------------------------------------------------------------- input specs


def parse_spec(spec: str, rng: np.random.RandomState) -> np.ndarray:
    """An example input from ``DTYPE[SHAPE][:VALUES]`` (see ``SPEC_HELP``); a NumPy array."""
    import numpy as np

    text = spec.strip()
    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan", text):
        return np.asarray(float(text), dtype=np.float32)
    m = _SPEC.match(text)
    if not m:
        raise UsageError(f"cannot parse input spec {spec!r}: expected {SPEC_HELP}")
    dtype_name = _DTYPES.get(m["dtype"].lower())
    if dtype_name is None:
        raise UsageError(f"input spec {spec!r}: unknown dtype {m['dtype']!r} (use {DTYPE_HELP})")
    try:
        shape = tuple(int(d) for d in m["shape"].replace(" ", "").split(",") if d != "")
    except ValueError:
        raise UsageError(f"input spec {spec!r}: shape [{m['shape']}] must be integers separated by commas, "
                         "e.g. [4,3] (or [] for a scalar)") from None
    if any(d < 0 for d in shape):
        raise UsageError(f"input spec {spec!r}: negative dimension in shape [{m['shape']}]")
    dtype = _np_dtype(dtype_name)
    values = (m["values"] or "").strip()
    size = int(np.prod(shape)) if shape else 1
    kind = np.dtype(dtype).kind if dtype_name != "bfloat16" else "f"
    try:
        if not values:
            data = (rng.normal(size=shape) if kind == "f" else rng.randint(0, 10, size=shape) if kind == "i"
                    else rng.uniform(size=shape) > 0.5)
        elif values.startswith("["):
            flat = np.asarray(json.loads(values), dtype=np.float64 if kind != "b" else bool).reshape(-1)
            if flat.size != size:
                raise UsageError(f"input spec {spec!r}: {flat.size} values given for shape {list(shape)} "
                                 f"({size} elements)")
            data = flat.reshape(shape)
        else:
            data = _generate(values, shape, kind, rng, spec)
    except (ValueError, json.JSONDecodeError) as e:
        raise UsageError(f"input spec {spec!r}: cannot read values {values!r} ({e})") from None
    return np.asarray(data).astype(dtype)


def _np_dtype(name: str) -> DTypeLike:
    import numpy as np

    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _generate(values: str, shape: tuple[int, ...], kind: str, rng: np.random.RandomState,
              spec: str) -> np.ndarray:
    import numpy as np

    if re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?inf|nan|true|false", values.lower()):
        v = {"true": 1.0, "false": 0.0}.get(values.lower(), None)
        return np.full(shape, float(values) if v is None else v)
    m = _CALL.match(values.lower())
    if not m:
        raise UsageError(f"input spec {spec!r}: cannot read values {values!r}: expected {SPEC_HELP}")
    name = m["name"]
    args = [float(a) for a in (m["args"] or "").split(",") if a.strip()]
    need = {"uniform": 2, "normal": 2, "linspace": 2, "randint": 2, "bernoulli": 1, "full": 1, "zeros": 0,
            "ones": 0}
    if name not in need:
        raise UsageError(f"input spec {spec!r}: unknown generator {name!r} (use {', '.join(need)})")
    if len(args) != need[name]:
        raise UsageError(f"input spec {spec!r}: {name} takes {need[name]} argument(s), got {len(args)}")
    _check_args(name, args, spec)
    size = int(np.prod(shape)) if shape else 1
    if name == "uniform":
        return rng.uniform(args[0], args[1], size=shape)
    if name == "normal":
        return rng.normal(args[0], args[1], size=shape)
    if name == "linspace":
        return np.linspace(args[0], args[1], size).reshape(shape)
    if name == "randint":
        return rng.randint(int(args[0]), int(args[1]), size=shape)
    if name == "bernoulli":
        return rng.uniform(size=shape) < args[0]
    if name == "full":
        return np.full(shape, args[0])
    return np.zeros(shape) if name == "zeros" else np.ones(shape)


def _check_args(name: str, args: list[float], spec: str) -> None:
    """Generator arguments that would give a wrong or surprising input are usage errors, not silent values."""
    import math

    if name == "full":  # full(inf), full(nan): edge values on purpose
        return
    if not all(math.isfinite(a) for a in args):
        raise UsageError(f"input spec {spec!r}: {name}'s arguments must be finite numbers; for inf or nan "
                         "everywhere use full(inf) or full(nan), or list the values")
    if name == "bernoulli" and not 0.0 <= args[0] <= 1.0:
        raise UsageError(f"input spec {spec!r}: bernoulli(p) needs a probability p in [0, 1], got {args[0]:g}")
    if name == "normal" and args[1] < 0:
        raise UsageError(f"input spec {spec!r}: normal(mean,std) needs std >= 0, got {args[1]:g}")
    if name == "uniform" and args[0] > args[1]:
        raise UsageError(f"input spec {spec!r}: uniform(lo,hi) needs lo <= hi, got lo = {args[0]:g}, "
                         f"hi = {args[1]:g}")
    if name == "randint" and (int(args[0]) != args[0] or int(args[1]) != args[1] or args[0] >= args[1]):
        raise UsageError(f"input spec {spec!r}: randint(lo,hi) needs integers lo < hi (hi is excluded), "
                         f"got {args[0]:g}, {args[1]:g}")


def materialize(value: _T, rng: np.random.RandomState, where: str) -> _T | np.ndarray:
    """An input declared in a file: arrays and numbers as they are, spec strings parsed."""
    if isinstance(value, str):
        try:
            return parse_spec(value, rng)
        except UsageError as e:
            raise UsageError(f"{where}: {e}") from None
    return value
