"""The JAX stage of rmflow (data loader, model, loss, step, checkpoint, eval, export).

It reads the shards and manifest written by `rmflow preprocess` through `schemas` and
never imports apache_beam. Importing it changes nothing in the process: the entry points that
start JAX (the CLI, ``trainer.train.run``, ``rmflow.RewardModel.load``) apply rmflow's XLA
settings first (``trainer.backend.configure_xla``).
"""
