"""Real-looking losses whose gradients break, for ``gradkit audit``.

Each function is finite where it is usually evaluated and breaks on inputs a
training run does reach: a confident logit, a padded row, a duplicated point, a
zero-initialised head. ``GRADKIT_INPUTS`` (bottom) gives each one the inputs
that break it, so the whole file audits with one command::

    gradkit audit examples/unstable_losses.py

Every finding names the primitive and the line below, and the fix it suggests
(a stable function from ``gradkit.stable`` or a rule table from
``gradkit.tables``) is re-run by the audit and checked against float64 finite
differences. Four of the fixes, written out, are the ``*_fixed`` functions at
the end; the two where-guarded logs need no code change:
``gk.override(gaussian_nll, gk.tables.SAFE)``.
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


def logistic_loss(logits, labels):
    """Binary cross-entropy written out: softplus(z) - y*z, with softplus as log(1 + exp(z))."""
    softplus = jnp.log1p(jnp.exp(logits))  # exp overflows for logits > 88.7 (float32)
    return jnp.mean(softplus - labels * logits)


def gaussian_nll(mu, sigma, y):
    """Heteroscedastic regression NLL over a padded batch: sigma == 0 marks padding."""
    valid = sigma > 0
    z = (y - mu) / jnp.where(valid, sigma, 1.0)  # the division is guarded twice ("double where")…
    nll = jnp.where(valid, jnp.log(sigma) + 0.5 * z**2, 0.0)  # …but log(sigma) only once
    return jnp.sum(nll) / jnp.sum(valid.astype(nll.dtype))


def log_spectral_distance(amplitude, target_log_power):
    """Distance between log power spectra; silent bins (amplitude 0) are floored at -30."""
    power = amplitude**2
    log_power = jnp.where(power > 0, jnp.log(power), -30.0)
    return jnp.mean((log_power - target_log_power) ** 2)


def pair_distance_loss(anchors, positives):
    """Mean Euclidean distance between paired embeddings; a pair can be the same point."""
    distance = jnp.linalg.norm(anchors - positives, axis=-1)
    return jnp.mean(distance)


def angle_loss(pred_xy, target_angle):
    """Cosine loss on the angle of a predicted 2-D vector (a zero-initialised head predicts (0, 0))."""
    angle = jnp.arctan2(pred_xy[:, 1], pred_xy[:, 0])
    return jnp.mean(1.0 - jnp.cos(angle - target_angle))


def masked_log_partition(scores, mask):
    """Attention-style log-partition with an additive -inf mask; padded rows are all masked."""
    masked = scores + jnp.where(mask, 0.0, -jnp.inf)
    lse = jax.nn.logsumexp(masked, axis=-1)
    row_valid = jnp.any(mask, axis=-1)
    return jnp.sum(jnp.where(row_valid, lse, 0.0))


def path_length(points):
    """Length of a trajectory, segment by segment in a scan; the trajectory pauses (repeats a point)."""
    def step(total, segment):
        start, end = segment
        return total + jnp.sqrt(jnp.sum((end - start) ** 2)), None

    total, _ = lax.scan(step, jnp.zeros((), points.dtype), (points[:-1], points[1:]))
    return total


# --------------------------------------------------------------------------- the inputs that break them


def _inputs():
    rng = np.random.RandomState(0)
    f32 = np.float32
    logits = rng.uniform(-5, 5, 128).astype(f32)
    logits[[7, 40, 99]] = [95.0, 100.0, 120.0]  # a few confident predictions
    labels = (rng.uniform(size=128) > 0.5).astype(f32)
    sigma = rng.uniform(0.5, 2.0, 16).astype(f32)
    sigma[12:] = 0.0  # padding
    amplitude = rng.uniform(0.1, 1.0, 64).astype(f32)
    amplitude[::16] = 0.0  # silent bins
    anchors = rng.normal(size=(8, 4)).astype(f32)
    positives = anchors + 0.1 * rng.normal(size=(8, 4)).astype(f32)
    positives[3] = anchors[3]  # a duplicated pair
    pred_xy = rng.normal(size=(6, 2)).astype(f32)
    pred_xy[2] = 0.0  # the head still outputs zeros for this sample
    scores = rng.normal(size=(4, 6)).astype(f32)
    mask = rng.uniform(size=(4, 6)) > 0.3
    mask[3] = False  # a padded query
    points = np.cumsum(rng.normal(size=(10, 3)), axis=0).astype(f32)
    points[5] = points[4]  # a pause
    return {
        "logistic_loss": (logits, labels),
        "gaussian_nll": (rng.normal(size=16).astype(f32), sigma, rng.normal(size=16).astype(f32)),
        "log_spectral_distance": (amplitude, rng.normal(-2.0, 1.0, 64).astype(f32)),
        "pair_distance_loss": (anchors, positives),
        "angle_loss": (pred_xy, rng.uniform(-3, 3, 6).astype(f32)),
        "masked_log_partition": (scores, mask),
        "path_length": (points,),
    }


# ``gradkit audit FILE.py`` audits every function named here, at these inputs
# (a callable is called once; values may also be spec strings like "f32[128]:uniform(-1,1)").
GRADKIT_INPUTS = _inputs


# --------------------------------------------------------------------------- the fixed versions


def logistic_loss_fixed(logits, labels):
    import gradkit.stable

    return jnp.mean(gradkit.stable.log1pexp(logits) - labels * logits)


def pair_distance_loss_fixed(anchors, positives):
    import gradkit.stable

    return jnp.mean(gradkit.stable.safe_norm(anchors - positives, axis=-1))


def angle_loss_fixed(pred_xy, target_angle):
    import gradkit.stable

    angle = gradkit.stable.safe_arctan2(pred_xy[:, 1], pred_xy[:, 0])
    return jnp.mean(1.0 - jnp.cos(angle - target_angle))


def masked_log_partition_fixed(scores, mask):
    import gradkit.stable

    masked = scores + jnp.where(mask, 0.0, -jnp.inf)
    lse = gradkit.stable.logsumexp(masked, axis=-1)
    return jnp.sum(jnp.where(jnp.any(mask, axis=-1), lse, 0.0))


if __name__ == "__main__":
    import gradkit as gk

    for name, args in _inputs().items():
        print(gk.audit(globals()[name], *args), end="\n\n")
