"""Parallelism: the device mesh (``mesh``), sharding rules keyed on parameter names (``rules``)."""

from rmflow.trainer.parallel.mesh import AXES, BATCH_AXES, MeshError, batch_shards, make_mesh, mesh_shape
from rmflow.trainer.parallel.rules import RULES, describe, param_name, shardings, spec_for

__all__ = ["AXES", "BATCH_AXES", "RULES", "MeshError", "batch_shards", "describe", "make_mesh", "mesh_shape",
           "param_name", "shardings", "spec_for"]
