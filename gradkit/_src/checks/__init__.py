"""Gradient checks: gk.check_grads, gk.compare, finite differences and report text."""
