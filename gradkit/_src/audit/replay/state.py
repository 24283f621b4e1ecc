"""What the replay keeps: where an equation runs, the values of a jaxpr evaluation, and births.

It also says what a handler sees of the replay that runs it (:class:`Runner`),
so that the handlers (``leaf``, ``control``) import the replay's types from
here, never the replay (:class:`gradkit._src.audit.replay.replay.Replay`),
which imports them: the package imports one way, ``state`` → ``leaf`` →
``control`` → ``replay``.

A *birth* is an equation, pass and kind (``log``, forward, inf) at which
non-finite elements appeared from finite ones (for an inf) or NaN-free ones
(for a NaN). It aggregates over loop iterations; for each element it was born
at, it knows the iterations, and it keeps the values of its first few
occurrences so that a report can show them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, TypedDict

import jax
import numpy as np
from jax.typing import ArrayLike

from gradkit._src import compat
from gradkit._src.audit.provenance import Label, Provenance
from gradkit._src.core.dispatch import op_name

# A cotangent and its labels; None is a zero cotangent.
Ct = tuple[jax.Array | np.ndarray, Label | None] | None


class Values(TypedDict, total=False):
    """The values an :class:`Occurrence` keeps (its fields): the backward pass adds the cotangents."""

    invals: list[ArrayLike]
    outvals: list[ArrayLike]
    out_cts: list[jax.Array | np.ndarray]
    in_cts: list[ArrayLike | None]

_KEEP_OCCURRENCES = 32  # values kept per birth (a scan can repeat one for every iteration)


@dataclasses.dataclass
class Context:
    """Where an equation runs: inside a scan iteration, a cond branch, a jit function."""

    kind: str  # "scan" | "while" | "cond" | "jit"
    eqn: compat.JaxprEqn
    index: int = 0  # scan/while: the iteration; cond: the branch taken
    size: int = 0  # scan: length; cond: number of branches; while: 0 (not known up front)
    name: str = ""

    def static(self) -> tuple[str, int, int | None]:
        """What tells two places apart: the equation, and for a cond the branch (not the iteration)."""
        return (self.kind, id(self.eqn), self.index if self.kind == "cond" else None)


def loop_indices(ctx: Sequence[Context]) -> tuple[int, ...]:
    return tuple(c.index for c in ctx if c.kind in ("scan", "while"))


@dataclasses.dataclass
class Occurrence:
    """The values around one occurrence of a birth.

    ``invals``/``outvals`` are the equation's operands and results; for a
    backward birth ``out_cts`` are the incoming cotangents and ``in_cts`` the
    operands' cotangents (``None`` where not differentiated). ``masks`` holds,
    per position (output for a forward birth, operand for a backward one),
    the elements born here.
    """

    loops: tuple[int, ...]
    invals: list[ArrayLike]
    outvals: list[ArrayLike]
    out_cts: list[jax.Array | np.ndarray] | None = None
    in_cts: list[ArrayLike | None] | None = None
    masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def iteration(self) -> int | None:
        return self.loops[-1] if self.loops else None


@dataclasses.dataclass
class Birth:
    """Where non-finite values first appeared, aggregated over loop iterations."""

    key: int
    eqn: compat.JaxprEqn
    phase: str  # "forward" | "backward"
    kind: str  # "nan" | "inf"
    ctx: tuple[Context, ...]  # of the first occurrence
    occurrences: list[Occurrence] = dataclasses.field(default_factory=list)
    iterations: list[int] = dataclasses.field(default_factory=list)
    # (position, flat element) -> the innermost loop iterations it was born in
    elements: dict[tuple[int, int], list[int | None]] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        """The op's table name (a gradkit rule's wrapper reports the op it overrides)."""
        return compat.rule_target(self.eqn) or op_name(self.eqn)

    @property
    def is_rule(self) -> bool:
        """The equation is a gradkit rule applied by a table (its backward is the rule)."""
        return compat.rule_target(self.eqn) is not None

    def occurrence(self, ctx: Sequence[Context], values: Values) -> Occurrence | None:
        """The stored occurrence for ``ctx`` (made from ``values`` if new); ``None`` past the keep limit."""
        loops = loop_indices(ctx)
        for occ in self.occurrences:
            if occ.loops == loops:
                return occ
        if len(self.occurrences) >= _KEEP_OCCURRENCES:
            return None
        occ = Occurrence(loops, **values)
        self.occurrences.append(occ)
        return occ


@dataclasses.dataclass
class Frame:
    """Forward values of one jaxpr evaluation, kept for the backward pass."""

    jaxpr: compat.Jaxpr
    env: dict[compat.Var, ArrayLike]
    labels: dict[compat.Var, Label | None]
    active: dict[compat.Var, bool]
    ctx: tuple[Context, ...]
    # per equation: what its handler kept (a scan: one frame per iteration)
    subs: dict[int, Frame | list[Frame | None]] = dataclasses.field(default_factory=dict)

    def read(self, atom: compat.Atom) -> ArrayLike:
        return compat.read_atom(self.env, atom)

    def label(self, atom: compat.Atom) -> Label | None:
        return None if isinstance(atom, compat.Literal) else self.labels.get(atom)

    def is_active(self, atom: compat.Atom) -> bool:
        return not isinstance(atom, compat.Literal) and self.active.get(atom, False)

    def outputs(self) -> list[ArrayLike]:
        return [self.read(a) for a in self.jaxpr.outvars]

    def output_labels(self) -> list[Label | None]:
        return [self.label(a) for a in self.jaxpr.outvars]


class Runner(Protocol):
    """What a handler sees of the replay that runs it (:class:`~gradkit._src.audit.replay.replay.Replay`).

    A handler of an equation that holds a program runs it through ``forward``
    and ``backward``; a leaf records its births with ``record``.
    """

    prov: Provenance
    max_while: int
    cotangent_births: bool

    def forward(self, jaxpr: compat.Jaxpr, consts: Sequence[ArrayLike], args: Sequence[ArrayLike],
                active: Sequence[bool], labels: Sequence[Label | None] | None = None,
                ctx: tuple[Context, ...] = ()) -> Frame: ...

    def backward(self, frame: Frame, out_cts: Sequence[Ct]) -> list[Ct]: ...

    def add_ct(self, a: Ct, b: Ct) -> Ct: ...

    def record(self, eqn: compat.JaxprEqn, phase: str, kind: str, ctx: tuple[Context, ...], pos: int,
               mask: np.ndarray, label: Label, values: Values) -> None: ...


class Handler(Protocol):
    """How the replay runs one kind of equation forward and backward (see :mod:`.control`, :mod:`.leaf`)."""

    def forward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, invals: list[ArrayLike],
                act_in: list[bool], labels: list[Label | None]) -> tuple[list[ArrayLike], list[Label | None]]: ...

    def backward(self, rp: Runner, frame: Frame, idx: int, eqn: compat.JaxprEqn, out_cts: list[Ct]) -> list[Ct]: ...
