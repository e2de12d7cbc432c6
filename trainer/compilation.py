"""JAX's persistent compilation cache: a rerun, a resumed run, eval and scoring compile nothing
that an earlier process on this machine compiled already.

Every executable XLA compiles for rmflow (train and eval steps for each batch shape, however
short its compile) is written to the cache folder, keyed by JAX on the program, its shapes, the
XLA flags, the device and the jax/jaxlib versions, so a changed model or setting never reads
a stale entry. ``compilation_cache`` in the train config picks the folder:

* ``auto`` (the default): ``RMFLOW_COMPILATION_CACHE`` when set, else JAX's own
  ``JAX_COMPILATION_CACHE_DIR`` when set, else ``$XDG_CACHE_HOME/rmflow/jax`` (``~/.cache``);
* ``off``: no persistent cache (``RMFLOW_COMPILATION_CACHE=off`` does the same for ``auto``);
* a folder: that folder.

On GPUs, XLA's per-fusion autotuning results are kept in the same folder
(``jax_persistent_cache_enable_xla_caches``), so fusions tuned once are never tuned again.

JAX treats its cache as trusted code: keep it in a folder only you can write to (the default
is in your home directory).
"""

from __future__ import annotations

import os

OFF = ("off", "none", "false", "0")
XLA_CACHES = "xla_gpu_per_fusion_autotune_cache_dir"  # XLA's own caches kept in the cache folder


def cache_folder(setting: str, environ=os.environ) -> str | None:
    """The cache folder a ``compilation_cache`` setting names, or None for no cache."""
    if setting.strip().lower() in OFF or not setting.strip():
        return None
    if setting != "auto":
        return os.path.abspath(os.path.expanduser(setting))
    for var in ("RMFLOW_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        value = environ.get(var, "").strip()
        if value:
            return None if value.lower() in OFF else os.path.abspath(os.path.expanduser(value))
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "rmflow", "jax")


def use_compilation_cache(setting: str, environ=os.environ) -> str | None:
    """Point this process's JAX at the cache folder (created if missing) and cache every
    compilation, however short; returns the folder, or None when the setting turns it off
    (then nothing is read or written). Calling it again with another folder switches."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    folder = cache_folder(setting, environ)
    current = jax.config.jax_compilation_cache_dir
    if folder is None:
        if current:
            jax.config.update("jax_compilation_cache_dir", None)
            cc.reset_cache()
        return None
    os.makedirs(folder, exist_ok=True)
    if current != folder:
        jax.config.update("jax_compilation_cache_dir", folder)
        cc.reset_cache()  # a cache opened on another folder is closed; the next compile opens this one
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    # On GPUs, XLA's autotuning results too, per fusion, beside the executables: a program with
    # the fusions of one compiled before (another batch shape's, a rerun's) tunes none of them again
    jax.config.update("jax_persistent_cache_enable_xla_caches", XLA_CACHES)
    return folder
