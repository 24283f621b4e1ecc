"""Every access gradkit makes to JAX internals lives in this package, and every JAX version branch.

A JAX upgrade that moves one of these names is a change here only (checked on
jax 0.8.0, 0.10.2 and 0.12.0.1; CI runs the oldest and the newest). The rest of
gradkit imports ``gradkit._src.compat`` and nothing from ``jax._src``.

* :mod:`~gradkit._src.compat.jaxprs` — jaxprs and equations:
  ``jax.extend.core``'s ``Jaxpr``/``ClosedJaxpr``/``JaxprEqn``/``Literal``
  (from jax 0.11 ``ClosedJaxpr`` is an alias of ``Jaxpr``, which carries its
  consts: :func:`jaxpr_parts` and :func:`replace_eqns` hide the difference);
  tracing at exact abstract values (``partial_eval.trace_to_jaxpr_dynamic``,
  which keeps weak types, shardings and varying manual axes); one ``jit``
  equation per overridden function (:func:`trace_jit`); binding an equation
  (``get_bind_params`` returned ``(subfuns, params)`` before jax 0.9.2);
  the two namespaces of table keys (:func:`eqn_name`); the context a
  ``shard_map`` body is traced in (:func:`body_context`; ``manual_axes``
  became ``newly_manual_axes`` in jax 0.9); the operand layouts of ``scan``
  (jax 0.12 keeps them in a ``FlatTree``), ``while`` and ``cond``; the
  config that changes what tracing produces (``trace_context``).
* :mod:`~gradkit._src.compat.source` — the user's source line of an
  equation (``source_info_util``), the scopes on its name stack
  (:func:`name_scopes`), and the registration that makes JAX's tracebacks
  skip gradkit's frames (what Flax and Equinox do too).
* :mod:`~gradkit._src.compat.primitive` — ``safe_scale``, the one primitive
  gradkit defines, with its own JVP, transpose, batching and lowering rules.
  Registering rules for gradkit's own primitive is extension; no rule of a
  JAX primitive is touched (``tests/test_side_effects.py`` checks it).
* :mod:`~gradkit._src.compat.layers` — a model's dense/conv layers (with their
  bias add and a folded BatchNorm), pooling, activations and residual sums
  found by dataflow in its traced program (the static plan:
  :mod:`~gradkit._src.compat.layer_scan`), and that program run with each
  layer computed by a callback (LRP's rules).
* :mod:`~gradkit._src.compat.gform` — the same program run for LRP's
  gradient form (AttnLRP): activations, normalizers and products of two
  input-dependent values found by dataflow (the plan:
  :mod:`~gradkit._src.compat.gform_scan`), each computed by a callback.
* :mod:`~gradkit._src.compat.callbacks` — the logger JAX reports a failing
  host callback on (``gk.guard``'s raise mode keeps its own exception off it),
  and the error types JAX raises in place of a callback's exception.
"""

# Explicit: `compat.X` is one of these, and this list says which module holds it.
from gradkit._src.compat.callbacks import (
    CALLBACK_ERRORS,
    CALLBACK_LOGGER,
    kept_callback,
    kept_callback_p,
)
from gradkit._src.compat.gform import GSite, run_gradient_form
from gradkit._src.compat.jaxprs import (
    CONCRETIZATION_ERRORS,
    CUSTOM_VJP_PRIMITIVES,
    FUNCTION_PREFIX,
    JAX_VERSION,
    NAMED_OP_PREFIX,
    AbstractValue,
    ArrayImpl,
    Atom,
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Primitive,
    ShapedArray,
    Tracer,
    Var,
    add_note,
    aval_of,
    bind,
    bind_primitive,
    body_context,
    call_equation,
    cond_layout,
    detach_consts,
    eqn_name,
    eval_jaxpr,
    eval_open,
    float0_zeros,
    is_custom_derivative,
    is_forward_mode_of_custom_vjp_error,
    is_forward_mode_tracer,
    is_jaxpr,
    is_jit,
    is_literal,
    is_loop,
    is_opaque,
    is_shard_map,
    is_weakly_typed,
    jaxpr_parts,
    primitive_by_name,
    read_atom,
    register_cache,
    replace_eqns,
    rule_registries_snapshot,
    rule_target,
    rule_wrapper_name,
    scan_layout,
    single_equation,
    staged,
    struct_like,
    struct_of,
    trace,
    trace_avals,
    trace_context,
    trace_jit,
    type_key,
    typed_like,
    while_layout,
)
from gradkit._src.compat.layers import (
    ACTIVATION_FUNCTIONS,
    LAYER_KINDS,
    STRUCTURAL,
    Layer,
    run_layers,
)
from gradkit._src.compat.primitive import (
    OWN_PRIMITIVES,
    masked_scale,
    masked_scale_p,
    match_varying,
    safe_scale,
    safe_scale_p,
)
from gradkit._src.compat.source import (
    call_site,
    library_callee,
    name_scopes,
    register_source_exclusion,
    source_line,
    source_of,
    source_span,
)

__all__ = [
    # callbacks
    "CALLBACK_ERRORS", "CALLBACK_LOGGER", "kept_callback", "kept_callback_p",
    # jaxprs
    "AbstractValue", "ArrayImpl", "Atom", "ClosedJaxpr", "Literal", "Primitive", "ShapedArray", "Var",
    "CONCRETIZATION_ERRORS", "CUSTOM_VJP_PRIMITIVES", "FUNCTION_PREFIX", "JAX_VERSION", "Jaxpr",
    "JaxprEqn", "NAMED_OP_PREFIX", "Tracer", "add_note", "aval_of", "bind", "bind_primitive", "body_context",
    "call_equation", "cond_layout", "detach_consts", "eqn_name", "eval_jaxpr", "eval_open", "float0_zeros",
    "is_custom_derivative", "is_forward_mode_of_custom_vjp_error", "is_forward_mode_tracer", "is_jaxpr",
    "is_jit", "is_literal", "is_loop", "is_opaque", "is_shard_map", "is_weakly_typed", "typed_like", "jaxpr_parts",
    "primitive_by_name", "read_atom", "register_cache", "replace_eqns", "rule_registries_snapshot",
    "rule_target", "rule_wrapper_name", "scan_layout", "single_equation", "staged", "struct_like", "struct_of", "trace",
    "trace_avals", "trace_context", "trace_jit", "type_key", "while_layout",
    # gradient form
    "GSite", "run_gradient_form",
    # layers
    "ACTIVATION_FUNCTIONS", "LAYER_KINDS", "STRUCTURAL", "Layer", "run_layers",
    # primitive
    "OWN_PRIMITIVES", "match_varying", "safe_scale", "safe_scale_p", "masked_scale", "masked_scale_p",
    # source
    "call_site", "library_callee", "name_scopes", "register_source_exclusion", "source_line", "source_of",
    "source_span",
]
