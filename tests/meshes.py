"""Devices for the sharding tests.

conftest.py gives every run 8 virtual CPU devices. On a machine whose default
backend has fewer devices (one GPU), the meshes are built from those CPU
devices, so the sharding tests still run there while everything else runs on
the accelerator (``JAX_PLATFORMS=cuda,cpu``).
"""

from __future__ import annotations

import math
from typing import Any

import jax


def mesh_devices(n: int) -> list[Any]:
    """The first ``n`` devices of the default backend, or of the CPU when it has fewer."""
    devices = jax.devices()
    if len(devices) < n:
        devices = jax.devices("cpu")
    assert len(devices) >= n, f"the sharding tests need {n} devices; conftest.py asks for 8 CPU devices"
    return list(devices[:n])


def make_mesh(shape: tuple[int, ...], names: tuple[str, ...], **kwargs: Any) -> jax.sharding.Mesh:
    """``jax.make_mesh`` on ``mesh_devices``."""
    kwargs.setdefault("devices", mesh_devices(math.prod(shape)))
    return jax.make_mesh(shape, names, **kwargs)


def on_mesh_backend(tree: Any) -> Any:
    """``tree`` committed to the first mesh device: single-device references computed on the meshes' backend."""
    return jax.device_put(tree, mesh_devices(1)[0])


def mesh_backend() -> Any:
    """A context in which eager references run on the first mesh device (``jax.default_device``)."""
    return jax.default_device(mesh_devices(1)[0])
