"""A removable singularity patched at one point: ``jnp.where(x == c, patch, expr)``, and what to write instead.

Such a ``where`` fixes the *value* at ``x == c`` but not the derivative: at
that point the program's derivative is the derivative of the branch it takes
(the patch; a constant has derivative 0), which is what JAX's forward mode
and ``gk.tables.SAFE`` give. That is the function's derivative only when the
patch's derivative happens to equal the expression's limit (``sin(x)/x`` at
0: both 0); for ``expm1(x)/x`` at 0 it is 0 where the limit is 1/2. A
removable singularity needs the expression's Taylor polynomial on a small
interval around the point, with the expression itself guarded there (the
"double where"). :func:`point_mask_advice` finds the pattern by dataflow —
the equation where the NaN/inf was born feeds, through element-wise
equations, a case of a ``select_n`` whose predicate is ``x == c`` or
``x != c`` for a constant ``c`` — and words the change.
"""

from __future__ import annotations

from gradkit._src import compat
from gradkit._src.audit.patterns import source_text
from gradkit._src.core import walk

__all__ = ["point_mask_advice"]

# how far (in equations) the audit follows the born value towards a select, and a predicate to its comparison
_DEPTH = 8
# element-wise or layout equations a value may pass on the way from its birth to the select
_THROUGH = frozenset({"neg", "mul", "div", "add", "sub", "convert_element_type", "broadcast_in_dim", "reshape",
                      "squeeze", "expand_dims", "copy", "copy_p", "exp", "log", "sin", "cos", "sqrt", "integer_pow",
                      "pow", "abs", "expm1", "log1p", "tanh", "logistic"})


class _Graph:
    """One jaxpr's dataflow with its ``jit`` calls seen through (``jnp.where`` is a ``jit`` of a ``select_n``).

    Each variable of an inner jaxpr that stands for an outer one (a call's
    operand, a call's result) is replaced by it, so producers and users cross
    call boundaries: ``prod`` maps a variable to ``(equation, operands)``,
    ``users`` a variable to the equations that read it, with their operands.
    """

    def __init__(self, jaxpr: compat.Jaxpr) -> None:
        self.prod: dict[compat.Atom, tuple[compat.JaxprEqn, list[compat.Atom]]] = {}
        self.users: dict[compat.Atom, list[tuple[compat.JaxprEqn, list[compat.Atom]]]] = {}
        self.consts: set[compat.Var] = set(jaxpr.constvars)
        self._alias: dict[compat.Var, compat.Atom] = {}
        self._add(jaxpr)

    def canon(self, atom: compat.Atom) -> compat.Atom:
        while not compat.is_literal(atom) and atom in self._alias:
            atom = self._alias[atom]
        return atom

    def _add(self, jaxpr: compat.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            ins = [self.canon(a) for a in eqn.invars]
            if compat.is_jit(eqn):
                inner, _ = compat.jaxpr_parts(eqn.params["jaxpr"])
                self.consts.update(inner.constvars)
                self._alias.update(zip(inner.invars, ins))
                self._add(inner)
                self._alias.update(zip(eqn.outvars, (self.canon(o) for o in inner.outvars)))
                continue
            for a in ins:
                if not compat.is_literal(a):
                    self.users.setdefault(a, []).append((eqn, ins))
            for v in eqn.outvars:
                self.prod[v] = (eqn, ins)

    def constant(self, atom: compat.Atom, depth: int = _DEPTH) -> bool:
        """``atom`` depends on no input: a literal, a constant, or made from those."""
        if compat.is_literal(atom) or atom in self.consts:
            return True
        src = self.prod.get(atom)
        if src is None or depth == 0:
            return False
        return all(self.constant(a, depth - 1) for a in src[1])

    def point_predicate(self, pred: compat.Atom) -> compat.JaxprEqn | None:
        """The ``eq``/``ne`` comparison of a varying value with a constant that ``pred`` is, else ``None``."""
        for _ in range(_DEPTH):
            src = None if compat.is_literal(pred) else self.prod.get(pred)
            if src is None:
                return None
            eqn, ins = src
            name = eqn.primitive.name
            if name in ("eq", "ne") and len(ins) == 2:
                return eqn if self.constant(ins[0]) != self.constant(ins[1]) else None
            if name not in ("not", "convert_element_type", "broadcast_in_dim", "reshape"):
                return None
            pred = ins[0]
        return None


def point_mask_advice(closed: compat.ClosedJaxpr | compat.Jaxpr, eqn: compat.JaxprEqn, line: str) -> str:
    """The code change for a singularity patched at one point by ``where(x == c, …)`` (``""`` when there is none).

    ``eqn`` is the equation where the NaN/inf was born; ``line`` its source location, as the report shows it.
    """
    holder = next((j for e, j in walk.equations(closed) if e is eqn), None)
    if holder is None:
        return ""
    graph = _Graph(holder)
    frontier = [graph.canon(v) for v in eqn.outvars]
    for _ in range(_DEPTH):
        nxt: list[compat.Atom] = []
        for v in frontier:
            for user, ins in graph.users.get(v, ()):
                name = user.primitive.name
                if name == "select_n" and v in ins[1:]:
                    cmp = graph.point_predicate(ins[0])
                    if cmp is not None:
                        return _advice(user, cmp, line)
                elif name in _THROUGH:
                    nxt.extend(user.outvars)
        frontier = nxt
    return ""


def _advice(select: compat.JaxprEqn, cmp: compat.JaxprEqn, line: str) -> str:
    text = source_text(select)
    where = f"`{text}`" if text else "The `where`"
    test = source_text(cmp)
    point = f" where `{test}`" if test else " at one point"
    return (f"{where} patches the value only{point}: there the gradient is the derivative of the branch it takes "
            f"(the patch; 0 for a constant), not the limit of the expression's derivative, in JAX's forward mode "
            f"and under gk.tables.SAFE alike. A removable singularity patched at one point needs a Taylor branch: "
            f"near = jnp.abs(x - c) < delta; jnp.where(near, taylor(x - c), expr(jnp.where(near, c + 1, x))), "
            f"with taylor the expression's Taylor polynomial at c (for expm1(x)/x at 0: 1 + x/2 + x**2/6) and "
            f"delta small enough that its first dropped term is below the dtype's precision (at {line}).")
