"""Attribution on unmodified models: saliency, gradient × input, Guided Backprop, DeconvNet, LRP.

Each method explains one output of a model (a class) at an input, as a map
shaped like the input; Guided Backprop and DeconvNet are rule tables
(:data:`GUIDED_BACKPROP`, :data:`DECONVNET`) over ``jax.nn.relu``, so they
reach every ReLU of a Flax or Equinox model without editing it. :func:`lrp`
is Layer-wise Relevance Propagation with Zennit's rules and composites, on the
layers it finds by dataflow in the model's program. :func:`perturbation_curve`
measures how faithful a map is: the model's output as the inputs it ranks
highest are removed.

Examples:
  >>> import jax, jax.numpy as jnp, gradkit as gk
  >>> f = lambda x: jax.nn.relu(x @ jnp.eye(2)) @ jnp.array([[1.0], [-1.0]])
  >>> gk.attribution.guided_backprop(f, jnp.array([1.0, 2.0])).tolist()
  [1.0, 0.0]
"""

from gradkit._src.attribution.attn_lrp import hold_gate as hold_gate
from gradkit._src.attribution.attn_lrp import identity as identity
from gradkit._src.attribution.attn_lrp import stop_gradient as stop_gradient
from gradkit._src.attribution.attn_lrp import uniform as uniform
from gradkit._src.attribution.attribution import DECONVNET as DECONVNET
from gradkit._src.attribution.attribution import GUIDED_BACKPROP as GUIDED_BACKPROP
from gradkit._src.attribution.attribution import deconvnet as deconvnet
from gradkit._src.attribution.attribution import gradient as gradient
from gradkit._src.attribution.attribution import gradient_x_input as gradient_x_input
from gradkit._src.attribution.attribution import guided_backprop as guided_backprop
from gradkit._src.attribution.lrp import ATTN_LRP as ATTN_LRP
from gradkit._src.attribution.lrp import CP_LRP as CP_LRP
from gradkit._src.attribution.lrp import EPSILON_ALPHA2_BETA1 as EPSILON_ALPHA2_BETA1
from gradkit._src.attribution.lrp import EPSILON_ALPHA2_BETA1_FLAT as EPSILON_ALPHA2_BETA1_FLAT
from gradkit._src.attribution.lrp import EPSILON_GAMMA_BOX as EPSILON_GAMMA_BOX
from gradkit._src.attribution.lrp import EPSILON_PLUS as EPSILON_PLUS
from gradkit._src.attribution.lrp import EPSILON_PLUS_FLAT as EPSILON_PLUS_FLAT
from gradkit._src.attribution.lrp import FORMS as FORMS
from gradkit._src.attribution.lrp import KINDS as KINDS
from gradkit._src.attribution.lrp import STRUCTURAL_OPS as STRUCTURAL_OPS
from gradkit._src.attribution.lrp import Composite as Composite
from gradkit._src.attribution.lrp import LrpReport as LrpReport
from gradkit._src.attribution.lrp import lrp as lrp
from gradkit._src.attribution.lrp_rules import LrpRule as LrpRule
from gradkit._src.attribution.lrp_rules import alpha_beta as alpha_beta
from gradkit._src.attribution.lrp_rules import epsilon as epsilon
from gradkit._src.attribution.lrp_rules import flat as flat
from gradkit._src.attribution.lrp_rules import gamma as gamma
from gradkit._src.attribution.lrp_rules import gradient_rule as gradient_rule
from gradkit._src.attribution.lrp_rules import norm as norm
from gradkit._src.attribution.lrp_rules import pass_through as pass_through
from gradkit._src.attribution.lrp_rules import w_square as w_square
from gradkit._src.attribution.lrp_rules import zbox as zbox
from gradkit._src.attribution.lrp_rules import zplus as zplus
from gradkit._src.attribution.perturbation import PerturbationCurve as PerturbationCurve
from gradkit._src.attribution.perturbation import perturbation_curve as perturbation_curve

__all__ = [
    "ATTN_LRP",
    "CP_LRP",
    "Composite",
    "DECONVNET",
    "EPSILON_ALPHA2_BETA1",
    "EPSILON_ALPHA2_BETA1_FLAT",
    "EPSILON_GAMMA_BOX",
    "EPSILON_PLUS",
    "EPSILON_PLUS_FLAT",
    "GUIDED_BACKPROP",
    "FORMS",
    "KINDS",
    "LrpReport",
    "LrpRule",
    "PerturbationCurve",
    "STRUCTURAL_OPS",
    "alpha_beta",
    "deconvnet",
    "epsilon",
    "flat",
    "gamma",
    "gradient",
    "gradient_rule",
    "gradient_x_input",
    "guided_backprop",
    "hold_gate",
    "identity",
    "lrp",
    "norm",
    "pass_through",
    "perturbation_curve",
    "stop_gradient",
    "uniform",
    "w_square",
    "zbox",
    "zplus",
]
