"""gradkit: declarative gradient overrides for JAX.

A rule table maps op names to gradient rules; :func:`override` applies it to
any pure function, inside jit, scan, while, cond, remat and vmap. Everything
under ``gradkit._src`` is private.
"""

from gradkit import attribution as attribution
from gradkit import estimators as estimators
from gradkit import stable as stable
from gradkit import tables as tables
from gradkit._src.audit.audit import AuditReport as AuditReport
from gradkit._src.audit.audit import audit as audit
from gradkit._src.checks.check import GradCheckReport as GradCheckReport
from gradkit._src.checks.check import check_grads as check_grads
from gradkit._src.checks.compare import Comparison as Comparison
from gradkit._src.checks.compare import compare as compare
from gradkit._src.compat import register_source_exclusion as _register_source_exclusion
from gradkit._src.core.dispatch import override as override
from gradkit._src.core.named import op as op
from gradkit._src.core.rule import OpView as OpView
from gradkit._src.core.rule import Rule as Rule
from gradkit._src.core.rule import jvp_rule as jvp_rule
from gradkit._src.core.rule import vjp_rule as vjp_rule
from gradkit._src.core.table import RuleTable as RuleTable
from gradkit._src.errors import GradkitError as GradkitError
from gradkit._src.errors import GradkitWarning as GradkitWarning
from gradkit._src.function_gradients.custom_gradient import custom_gradient as custom_gradient
from gradkit._src.function_gradients.custom_gradient import custom_jvp as custom_jvp
from gradkit._src.guard.guard import Guard as Guard
from gradkit._src.guard.guard import GuardReport as GuardReport
from gradkit._src.guard.guard import NonFiniteGradientError as NonFiniteGradientError
from gradkit._src.guard.guard import guard as guard

__version__ = "0.1.0"

_register_source_exclusion()

__all__ = [
    "AuditReport",
    "Comparison",
    "GradCheckReport",
    "GradkitError",
    "GradkitWarning",
    "Guard",
    "GuardReport",
    "NonFiniteGradientError",
    "OpView",
    "Rule",
    "RuleTable",
    "attribution",
    "audit",
    "check_grads",
    "compare",
    "custom_gradient",
    "custom_jvp",
    "estimators",
    "guard",
    "jvp_rule",
    "op",
    "override",
    "stable",
    "tables",
    "vjp_rule",
]
