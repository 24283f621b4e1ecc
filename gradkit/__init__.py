"""gradkit: declarative gradient overrides for JAX.

A rule table maps op names to gradient rules; :func:`override` applies it to
any pure function, inside jit, scan, while, cond, remat and vmap. Everything
under ``gradkit._src`` is private.
"""

from gradkit._src.compat import register_source_exclusion as _register_source_exclusion
from gradkit._src.custom_gradient import custom_gradient as custom_gradient
from gradkit._src.custom_gradient import custom_jvp as custom_jvp
from gradkit._src.dispatch import override as override
from gradkit._src.errors import GradkitError as GradkitError
from gradkit._src.named import op as op
from gradkit._src.rule import OpView as OpView
from gradkit._src.rule import Rule as Rule
from gradkit._src.rule import jvp_rule as jvp_rule
from gradkit._src.rule import vjp_rule as vjp_rule
from gradkit._src.table import RuleTable as RuleTable

__version__ = "0.1.0"

_register_source_exclusion()

__all__ = [
    "GradkitError",
    "OpView",
    "Rule",
    "RuleTable",
    "custom_gradient",
    "custom_jvp",
    "jvp_rule",
    "op",
    "override",
    "vjp_rule",
]
