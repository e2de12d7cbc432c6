"""The JAX stage of rmflow (data loader, model, loss, step, checkpoint, eval, export).

It reads the shards and manifest written by `rmflow preprocess` through `schemas` and
never imports apache_beam. Importing it applies rmflow's XLA settings (``trainer.backend``).
"""

from rmflow.trainer.backend import configure_xla

configure_xla()
