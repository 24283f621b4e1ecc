"""The stable functions (gk.stable) and the accurate kernels their derivatives use.

This namespace is what the rest of gradkit reads (the library's rules, the audit's patterns).
``__all__`` is its public part, the one list of names :mod:`gradkit.stable` re-exports;
``*_op``, the named ops behind the functions with static arguments, are here but not in it.
"""

from gradkit._src.stable.cardinal_sine import sinc
from gradkit._src.stable.logexp import log1mexp, log_cosh, log_sub_exp, logaddexp, softplus_inverse
from gradkit._src.stable.logistic import log1pexp, log_sigmoid, sigmoid, silu, softplus
from gradkit._src.stable.norms import hypot, normalize, safe_norm
from gradkit._src.stable.norms import normalize_op as normalize_op
from gradkit._src.stable.norms import safe_norm_op as safe_norm_op
from gradkit._src.stable.reduce import log_softmax, logsumexp, softmax
from gradkit._src.stable.reduce import log_softmax_op as log_softmax_op
from gradkit._src.stable.reduce import logsumexp_op as logsumexp_op
from gradkit._src.stable.reduce import softmax_op as softmax_op
from gradkit._src.stable.safe import (
    safe_arccos,
    safe_arcsin,
    safe_arctan2,
    safe_div,
    safe_log,
    safe_pow,
    safe_sqrt,
    xlog1py,
    xlogy,
)
from gradkit._src.stable.safe import safe_log_op as safe_log_op

__all__ = [
    "hypot",
    "log1mexp",
    "log1pexp",
    "log_cosh",
    "log_sigmoid",
    "log_softmax",
    "log_sub_exp",
    "logaddexp",
    "logsumexp",
    "normalize",
    "safe_arccos",
    "safe_arcsin",
    "safe_arctan2",
    "safe_div",
    "safe_log",
    "safe_norm",
    "safe_pow",
    "safe_sqrt",
    "sigmoid",
    "silu",
    "sinc",
    "softmax",
    "softplus",
    "softplus_inverse",
    "xlog1py",
    "xlogy",
]
