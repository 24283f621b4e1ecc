"""The guard: gk.guard, a device check per call and an audit of the call that went bad."""
