"""Multi-process (multi-host) start-up: ``jax.distributed.initialize`` from the config or the
usual environment variables, before anything touches a JAX backend.

``distributed`` (train config): ``auto`` joins a cluster when a coordinator is named (the
``coordinator_address`` option or ``JAX_COORDINATOR_ADDRESS``), else runs as one process;
``on`` always calls ``jax.distributed.initialize`` (on a TPU VM slice, SLURM, Open MPI or
Kubernetes JAX finds coordinator and process id itself); ``off`` never does. The process id
is never in the config (it differs per process): JAX_PROCESS_ID or the cluster's own. On CPU,
processes talk through Gloo (JAX's CPU collectives).
"""

from __future__ import annotations

import os

import jax
from rmflow.schemas.errors import RmflowError

MODES = ("auto", "on", "off")


class DistributedError(RmflowError, RuntimeError):
    """The processes could not form a cluster; says which setting to check."""


def initialize(mode: str = "auto", coordinator_address: str = "", num_processes: int = 0) -> bool:
    """Join the cluster (once per process); True when running as several processes."""
    if jax.distributed.is_initialized():
        return jax.process_count() > 1
    env = os.environ
    address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS", "")
    if mode == "off" or (mode == "auto" and not address):
        return False
    count = num_processes or int(env.get("JAX_NUM_PROCESSES", "0") or 0) or None
    pid = int(env["JAX_PROCESS_ID"]) if env.get("JAX_PROCESS_ID", "") != "" else None
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes; ignored by GPU/TPU
    try:
        jax.distributed.initialize(coordinator_address=address or None, num_processes=count, process_id=pid)
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError/ValueError with a cryptic text
        raise DistributedError(
            f"jax.distributed.initialize failed ({type(e).__name__}: {e}). Check mesh.coordinator_address "
            f"({address or 'unset'}), mesh.num_processes ({count or 'unset'}) and JAX_PROCESS_ID ({pid}) on every "
            "process, or set mesh.distributed=off for one process") from e
    return jax.process_count() > 1


def is_primary() -> bool:
    """The process that writes the run's own files (every process takes part in checkpoints)."""
    return jax.process_index() == 0
