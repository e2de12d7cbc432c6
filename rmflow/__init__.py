"""rmflow: reward-model training workflow (CLI and the workflow chaining the stages), and its
Python API: ``from rmflow import RewardModel``.
"""

__version__ = "0.1.0"
__all__ = ["RewardModel", "__version__"]


def __getattr__(name: str):
    if name == "RewardModel":  # imported on first use: the CLI starts without loading JAX
        from rmflow.scoring.api import RewardModel

        return RewardModel
    raise AttributeError(f"module 'rmflow' has no attribute {name!r}")
