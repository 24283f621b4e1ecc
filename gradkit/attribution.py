"""Gradient-based attribution on unmodified models: saliency, gradient × input, Guided Backprop, DeconvNet.

Each method explains one output of a model (a class) at an input, as a map
shaped like the input; Guided Backprop and DeconvNet are rule tables
(:data:`GUIDED_BACKPROP`, :data:`DECONVNET`) over ``jax.nn.relu``, so they
reach every ReLU of a Flax or Equinox model without editing it.

Examples:
  >>> import jax, jax.numpy as jnp, gradkit as gk
  >>> f = lambda x: jax.nn.relu(x @ jnp.eye(2)) @ jnp.array([[1.0], [-1.0]])
  >>> gk.attribution.guided_backprop(f, jnp.array([1.0, 2.0])).tolist()
  [1.0, 0.0]
"""

from gradkit._src.attribution.attribution import DECONVNET as DECONVNET
from gradkit._src.attribution.attribution import GUIDED_BACKPROP as GUIDED_BACKPROP
from gradkit._src.attribution.attribution import deconvnet as deconvnet
from gradkit._src.attribution.attribution import gradient as gradient
from gradkit._src.attribution.attribution import gradient_x_input as gradient_x_input
from gradkit._src.attribution.attribution import guided_backprop as guided_backprop

__all__ = ["DECONVNET", "GUIDED_BACKPROP", "deconvnet", "gradient", "gradient_x_input", "guided_backprop"]
