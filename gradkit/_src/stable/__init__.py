"""The stable functions (gk.stable) and the accurate kernels their derivatives use.

This namespace is what the rest of gradkit reads (the library's rules, the audit's patterns);
:mod:`gradkit.stable` re-exports its public part. ``*_op`` are the named ops behind the
functions with static arguments.
"""

from gradkit._src.stable.cardinal_sine import sinc
from gradkit._src.stable.logexp import log1mexp, log_cosh, log_sub_exp, logaddexp, softplus_inverse
from gradkit._src.stable.logistic import log1pexp, log_sigmoid, sigmoid, silu, softplus
from gradkit._src.stable.norms import hypot, normalize, normalize_op, safe_norm, safe_norm_op
from gradkit._src.stable.reduce import log_softmax, log_softmax_op, logsumexp, logsumexp_op, softmax, softmax_op
from gradkit._src.stable.safe import (
    safe_arccos,
    safe_arcsin,
    safe_arctan2,
    safe_div,
    safe_log,
    safe_log_op,
    safe_pow,
    safe_sqrt,
    xlog1py,
    xlogy,
)

__all__ = [
    "hypot",
    "log1mexp",
    "log1pexp",
    "log_cosh",
    "log_sigmoid",
    "log_softmax",
    "log_softmax_op",
    "log_sub_exp",
    "logaddexp",
    "logsumexp",
    "logsumexp_op",
    "normalize",
    "normalize_op",
    "safe_arccos",
    "safe_arcsin",
    "safe_arctan2",
    "safe_div",
    "safe_log",
    "safe_log_op",
    "safe_norm",
    "safe_norm_op",
    "safe_pow",
    "safe_sqrt",
    "sigmoid",
    "silu",
    "sinc",
    "softmax",
    "softmax_op",
    "softplus",
    "softplus_inverse",
    "xlog1py",
    "xlogy",
]
