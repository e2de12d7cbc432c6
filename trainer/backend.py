"""XLA settings rmflow applies itself, before JAX starts its backend.

XLA:CPU's experimental YNNPACK fusions are turned off: the train step is faster and its
temporaries smaller without them (the figures, and the flags tried and not adopted:
docs/benchmarks.md, "XLA flags on CPU").

XLA aborts the process on a flag it does not know, so a flag is only added for the jaxlib
versions it was verified on, never when the user's XLA_FLAGS already sets it, and not at all
with RMFLOW_XLA_DEFAULTS=1 in the environment.

Importing rmflow changes nothing: the entry points that start JAX (the CLI, ``train.run``,
``rmflow.RewardModel.load``) call ``configure_xla`` first. A program that starts JAX itself
before calling them calls it first too, to compute as the CLI does.
"""

from __future__ import annotations

import os

# flag -> (value, jaxlib version prefixes it was verified on)
CPU_FLAGS = {"--xla_cpu_experimental_ynn_fusion_type": ("", ("0.10.",))}


def configure_xla(environ=os.environ) -> list[str]:
    """Add rmflow's XLA flags to XLA_FLAGS; returns the flags added. A flag for one backend is
    ignored by the others. Takes effect only if JAX's backend has not started yet."""
    if environ.get("RMFLOW_XLA_DEFAULTS"):  # keep XLA's own defaults (to compare, or to debug)
        return []
    try:
        from importlib.metadata import version

        jaxlib = version("jaxlib")
    except Exception:  # noqa: BLE001 - no jaxlib metadata: add nothing
        return []
    current = environ.get("XLA_FLAGS", "")
    added = [f"{flag}={value}" for flag, (value, versions) in CPU_FLAGS.items()
             if jaxlib.startswith(versions) and flag not in current]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added
