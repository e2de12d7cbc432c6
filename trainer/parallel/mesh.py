"""The device mesh: named axes ``data``, ``fsdp``, ``tensor``, ``expert`` and ``context``, its shape
from the config.

``data`` replicates the parameters and splits the batch; ``fsdp`` splits the batch and shards
the parameters and optimizer state (each device holds 1/n, gathered per layer when used);
``tensor`` shards attention heads and MLP columns within a layer; ``expert`` splits the batch
and shards a mixture of experts' experts (each device holds 1/n of them; the rest of the model
is replicated over it, as over ``data``). Batches are split over ``data`` x ``fsdp`` x ``expert``
(``BATCH_AXES``). ``context`` splits each row's tokens: each device holds the activations of its
share of the row, and attention gathers the row's keys and values
(``trainer.modeling.attention.context_attention``); the parameters are replicated over it. One
size may be -1: it takes the devices left over. A shape of three or four sizes leaves the axes
after it at 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType, Mesh
from rmflow.schemas.errors import RmflowError

AXES = ("data", "fsdp", "tensor", "expert", "context")
BATCH_AXES = ("data", "fsdp", "expert")


class MeshError(RmflowError, ValueError):
    """The mesh shape does not fit the devices; the message says how to fix it."""


def mesh_shape(requested: Sequence[int], n_devices: int) -> tuple[int, ...]:
    """``requested`` (one entry per axis, or the first three or four: the axes after them 1; at
    most one -1) resolved against ``n_devices``, as long as given."""
    if len(requested) not in range(3, len(AXES) + 1):
        raise MeshError(f"mesh shape {tuple(requested)} needs one size per axis {AXES}")
    if any(s == 0 or s < -1 for s in requested) or list(requested).count(-1) > 1:
        raise MeshError(f"mesh shape {tuple(requested)}: sizes are positive, and at most one is -1 (the rest)")
    fixed = math.prod(s for s in requested if s != -1)
    if -1 in requested:
        if n_devices % fixed:
            raise MeshError(f"mesh shape {tuple(requested)}: {n_devices} devices are not a multiple of {fixed}")
        return tuple(n_devices // fixed if s == -1 else s for s in requested)
    if fixed != n_devices:
        raise MeshError(f"mesh shape {tuple(requested)} holds {fixed} devices, but there are {n_devices}; "
                        "use -1 for one axis to take the rest")
    return tuple(requested)


def make_mesh(requested: Sequence[int] = (-1, 1, 1), devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A mesh over all devices (of every process), axes typed explicitly (Auto: the compiler
    propagates shardings from the parameters' and the batch's)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(requested, len(devices))
    shape = tuple(shape) + (1,) * (len(AXES) - len(shape))
    return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devices)


def batch_shards(mesh: Mesh | Mapping[str, int]) -> int:
    """How many pieces a batch is split into (rows per micro-batch are a multiple of this), for a
    mesh or a mesh's shape (axis -> size)."""
    shape = mesh.shape if isinstance(mesh, Mesh) else mesh
    return math.prod(shape.get(a, 1) for a in BATCH_AXES)
