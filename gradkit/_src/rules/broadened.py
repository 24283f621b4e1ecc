"""The BROADENED rules: ``eigh`` and ``svd`` derivatives with Lorentzian-broadened ``1/gap`` factors.

JAX differentiates a symmetric eigendecomposition ``A = V diag(w) V^T`` with
nondegenerate perturbation theory,

    dw = diag(V^T dA V),    dV = V (F o (V^T dA V)),    F_ij = 1 / (w_j - w_i),

and a singular value decomposition with the same kind of factors,
``1/(s_j^2 - s_i^2)`` and ``1/s``. Where two eigenvalues (singular values)
coincide the factor is ``1/0``: forward mode gives ``inf``, reverse mode
``0 * inf = NaN``. Within a degenerate subspace the eigenvectors are not
functions of ``A`` at all (any rotation of them is as good), so no derivative
of them exists there; what does exist is the derivative of any loss that does
not depend on that choice.

These rules replace every ``1/x`` by its Lorentzian broadening

    1/x  ->  x / (x^2 + eps * scale^2),

the technique of differentiable tensor-network codes (Liao, Liu, Wang and
Xiang, "Differentiable programming tensor networks", PRX 2019). It equals
``1/x`` to relative ``eps * scale^2 / x^2`` where the gap ``|x|`` is large
against ``sqrt(eps) * scale``, is 0 at ``x = 0`` and never exceeds
``1 / (2 sqrt(eps) scale)``. ``scale`` is the spectrum's own: ``max |w|`` for
``eigh``, the largest singular value for ``svd`` (per matrix of a batch), so
``eps`` is *relative*: scaling ``A`` by any ``c`` scales the derivative
exactly as it should, and one ``eps`` means "gaps below ``sqrt(eps)`` of the
spectrum are degeneracies" for a matrix of norm ``1e-8`` or ``1e8`` alike (an
absolute ``eps`` would broaden every gap of a small matrix and none of a large
one). Each rule is linear in the tangent, so it serves forward mode and, by
JAX's transposition, reverse mode.

``svd``: ``1/(s_j^2 - s_i^2) = 1/((s_j - s_i)(s_j + s_i))`` is split into its
two factors, and only the singular one is broadened:

    dU = U (G o sym(dS) + H o asym(dS)),   dV = V (G o sym(dS) - H o asym(dS)),
    G_ij = 1/(s_j - s_i) broadened,   H_ij = 1/(s_j + s_i),   dS = U^T dA V,

which is JAX's formula, term for term, where the spectrum is separated. At a
repeated singular value ``H`` stays finite and exact, so the derivative of the
*relative* rotation of ``U`` and ``V`` (the polar factor ``U V^T``, the Kabsch
rotation) survives, where broadening ``1/(s_j^2 - s_i^2)`` whole would lose
it. ``H`` and the ``1/s`` of a non-square matrix are broadened too, for the
pairs of zero singular values of a rank-deficient one.

``full_matrices=True`` of a non-square matrix (JAX refuses it): the extra
columns ``U_perp`` span the complement of the range, an arbitrary basis of
it; they get ``dU_perp = -U (S^-1 V^T dA^T U_perp)`` (``S^-1`` broadened), the
gauge ``U_perp^T dU_perp = 0``, so losses of their span are exact.

What the answer means at a degeneracy. Inside a cluster of equal values the
broadened factor is ~0 where the exact one is ``1/0``. A loss's cotangent
there is ``F_ij (X_ij - X_ji)`` (``X = V^T dL/dV``): for a loss that sees the
cluster only as a whole (the spectrum, a projector onto the whole cluster,
the polar factor) ``X_ij - X_ji`` is 0 at and near the degeneracy, and 0 is
the exact limit. For ``tr(f(A) M)``, ``f(A) = V f(w) V^T``, it is ``(f(w_j) -
f(w_i)) (V^T M V)_ij``, whose limit with ``1/(w_j - w_i)`` is ``f'(w) (V^T M
V)_ij``: finite, and dropped by the broadening. Second derivatives at a degeneracy differentiate
a first derivative that is itself such a function, so they are not the limit
either (``gradkit.tables`` says this to users).

``eps`` defaults per dtype. A computed gap of a degenerate pair is
round-off, about ``u * scale`` (``u`` the machine epsilon), and the broadened
factor turns the round-off asymmetry of the incoming cotangent (also ``~u``)
into an error of about ``u^2 / eps``; a separated gap ``g`` (relative to the
scale) gets a bias of ``eps / g^2`` in its term. float64: ``1e-12``, the
tensor-network codes' value (degenerate error ``~1e-19``, bias ``1e-8`` at
``g = 1%``); float32: ``1e-9`` (both about ``1e-5`` at ``g = 1%``; ``1e-12`` in
float32 leaves percent errors at a degeneracy). An ``eps`` given explicitly is
used as given, for every dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.typing import ArrayLike, DTypeLike

from gradkit._src.core.rule import JvpRuleFn, OpView, Tangents
from gradkit._src.errors import GradkitError, describe

DEFAULT_EPS = {64: 1e-12, 32: 1e-9}  # by the dtype's bits (see the module docstring)

_HIGHEST = lax.Precision.HIGHEST


def _mm(a: ArrayLike, b: ArrayLike) -> jax.Array:
    return jnp.matmul(a, b, precision=_HIGHEST)


def _t(a: ArrayLike) -> jax.Array:
    return jnp.swapaxes(a, -1, -2)


def effective_eps(eps: float | None, dtype: DTypeLike) -> float:
    """``eps`` if given, else the dtype's default (see the module docstring)."""
    if eps is not None:
        return float(eps)
    return DEFAULT_EPS[64] if jnp.finfo(dtype).bits >= 64 else DEFAULT_EPS[32]


def lorentzian(x: jax.Array, scale: ArrayLike, eps: float) -> jax.Array:
    """``x / (x^2 + eps * scale^2)``, computed in units of ``scale`` (no overflow, no underflow).

    ``scale`` must be positive; the result is 0 where ``x`` is 0. Differentiated
    again (second order), its derivative is the Lorentzian's own outside the
    peak, ``|x| > sqrt(eps) * scale``, and 0 inside it, where it is 0 too at the
    edge: the Lorentzian's ``1/eps`` slope at ``x = 0`` would otherwise multiply
    round-off (a diagonal ``w_i - w_i``, a cluster's cotangent asymmetry) by
    ``1e12``.
    """
    e = jnp.asarray(eps, jnp.result_type(x))
    xh = x / scale
    xh = jnp.where(xh * xh < e, lax.stop_gradient(xh), xh)
    return xh / (xh * xh + e) / scale


def _scale(values: jax.Array) -> jax.Array:
    """The spectrum's scale per matrix, ``max |values|`` over the last axis (1 for a zero spectrum)."""
    if values.shape[-1] == 0:
        return jnp.ones(values.shape[:-1] + (1,), values.dtype)
    m = lax.stop_gradient(jnp.max(jnp.abs(values), axis=-1, keepdims=True))  # a unit, not differentiated
    return jnp.where(m > 0, m, jnp.ones_like(m))


def _where(label: str, op: OpView) -> str:
    return f"rule {label} for op '{op.name}' at {op.source}"


def _check_real(label: str, op: OpView, x: ArrayLike) -> None:
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise GradkitError(
            f"{_where(label, op)}: the input is {describe(x)}; the broadened rules differentiate real "
            "symmetric eigendecompositions and real SVDs only (a complex Hermitian matrix has a phase gauge "
            "per eigenvector that this rule does not fix). Fix: leave this op out of the table for this "
            f"function (gk.override(f, {{k: v for k, v in gk.tables.BROADENED.items() if k != '{op.name}'}})), "
            "or write a gk.jvp_rule for the complex case.")


def _check_full_subset(label: str, op: OpView, k: int, what: str) -> None:
    subset = op.params.get("subset_by_index")
    if subset is not None and tuple(int(i) for i in subset) != (0, k):
        raise GradkitError(
            f"{_where(label, op)}: subset_by_index={tuple(subset)} asks for part of the {what}, but the "
            f"derivative of any of its vectors needs all {k} of them (a sum over every gap). Fix: decompose in "
            "full (subset_by_index=None) and slice the result, or leave this op out of the table.")


# --------------------------------------------------------------------------- eigh


def eigh_jvp(eps: float | None, label: str) -> JvpRuleFn:
    """The JVP rule of the ``eigh`` primitive (outputs ``(V, w)``) with broadened ``1/(w_j - w_i)``."""

    def rule(op: OpView, tangents: Tangents) -> tuple[jax.Array, jax.Array] | None:
        (a,), (da,) = op.inputs, tangents
        _check_real(label, op, a)
        n = int(np.shape(a)[-1])
        _check_full_subset(label, op, n, "eigendecomposition")
        if da is None:
            return None
        v, w = op.outputs
        p = _mm(_mm(_t(v), da), v)  # V^T dA V
        e = effective_eps(eps, w.dtype)
        f = lorentzian(w[..., None, :] - w[..., :, None], _scale(w)[..., None], e)  # F_ij ~ 1/(w_j - w_i)
        dv = _mm(v, f * p)
        dw = jnp.diagonal(p, axis1=-2, axis2=-1)
        return dv, dw

    return rule


# --------------------------------------------------------------------------- svd


def svd_jvp(eps: float | None, label: str) -> JvpRuleFn:
    """The JVP rule of the ``svd`` primitive (outputs ``(s, U, Vt)`` or ``(s,)``) with broadened gap factors."""

    def rule(op: OpView, tangents: Tangents) -> jax.Array | tuple[jax.Array, jax.Array, jax.Array] | None:
        (a,), (da,) = op.inputs, tangents
        _check_real(label, op, a)
        m, n = (int(d) for d in np.shape(a)[-2:])
        k = min(m, n)
        compute_uv = bool(op.params.get("compute_uv", True))
        full = bool(op.params.get("full_matrices", False))
        if compute_uv:
            _check_full_subset(label, op, k, "singular value decomposition")
        if da is None:
            return None
        if compute_uv:
            s, u, vt = op.outputs
        else:  # the singular values alone: their derivative needs the vectors (as JAX's own rule does)
            u, s, vt = jax.lax.linalg.svd(a, full_matrices=False, compute_uv=True,
                                          subset_by_index=op.params.get("subset_by_index"),
                                          algorithm=op.params.get("algorithm"))
        u1, v1 = u[..., :, :k], _t(vt[..., :k, :])
        ds_mat = _mm(_mm(_t(u1), da), v1)  # dS = U1^T dA V1
        ds: jax.Array = jnp.diagonal(ds_mat, axis1=-2, axis2=-1)
        if not compute_uv:
            return ds
        e = effective_eps(eps, s.dtype)
        scale = _scale(s)
        si, sj = s[..., :, None], s[..., None, :]
        g = lorentzian(sj - si, scale[..., None], e)  # 1/(s_j - s_i): the degenerate factor
        h = lorentzian(sj + si, scale[..., None], e)  # 1/(s_j + s_i): singular only for two zero values
        sym, asym = 0.5 * (ds_mat + _t(ds_mat)), 0.5 * (ds_mat - _t(ds_mat))
        du = _mm(u1, g * sym + h * asym)
        dv = _mm(v1, g * sym - h * asym)
        sinv = lorentzian(s, scale, e)[..., None, :]  # 1/s, as a row scaling
        if m > k:
            du = du + (_mm(da, v1) - _mm(u1, ds_mat)) * sinv
        if n > k:
            dv = dv + (_mm(_t(da), u1) - _mm(v1, _t(ds_mat))) * sinv
        if full and m > k:  # U = [U1, U_perp]; the gauge U_perp^T dU_perp = 0
            u_perp = u[..., :, k:]
            du = jnp.concatenate([du, -_mm(u1, _t(sinv) * _mm(_t(v1), _mm(_t(da), u_perp)))], axis=-1)
        if full and n > k:  # V = [V1, V_perp]; the gauge V_perp^T dV_perp = 0
            v_perp = _t(vt[..., k:, :])
            dv = jnp.concatenate([dv, -_mm(v1, _t(sinv) * _mm(_t(u1), _mm(da, v_perp)))], axis=-1)
        return ds, du, _t(dv)

    return rule


BUILDERS: dict[str, Callable[[float | None, str], JvpRuleFn]] = {

    "eigh": eigh_jvp, "svd": svd_jvp}
