"""TensorBoard event files through tensorboardX, without importing PyTorch.

tensorboardX imports torch at import time when it is installed (only to accept torch
tensors, which rmflow never logs). In a JAX training process that costs resident memory for
nothing (figures: docs/benchmarks.md), and most users have torch installed. So tensorboardX is imported with torch hidden, unless torch is already
imported by the caller.
"""

from __future__ import annotations

import sys


def summary_writer(logdir: str, *, purge_step: int | None = None):
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
        try:
            import tensorboardX  # noqa: F401
        finally:
            del sys.modules["torch"]
    from tensorboardX import SummaryWriter

    return SummaryWriter(logdir, purge_step=purge_step)
