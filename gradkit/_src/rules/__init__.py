"""The rule library: SAFE, STABLE, upcast, BROADENED, the estimators and the ready tables."""
