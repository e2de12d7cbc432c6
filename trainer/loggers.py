"""Where training metrics go besides ``metrics.jsonl`` (always written): ``report_to``.

``tensorboard``: event files in RUN/tensorboard (tensorboardX, without PyTorch). ``wandb``:
a Weights & Biases run with the same metrics at the same steps and the resolved config; its id
is kept in RUN/wandb_id so a resumed training run continues the same W&B run. W&B reads its
usual environment (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline, WANDB_API_KEY ...); the
project defaults to ``wandb_project``. Only process 0 reports.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from rmflow.schemas.train_config import TrainConfig
from rmflow.trainer.errors import TrainError
from rmflow.trainer.tensorboard import summary_writer

WANDB_ID_FILE = "wandb_id"


def check_available(cfg: TrainConfig) -> None:
    """Before anything is written: every reporter asked for can be imported."""
    if "wandb" in cfg.logging.report_to:
        try:
            import wandb  # noqa: F401
        except ImportError as e:

            raise TrainError("logging.report_to includes wandb, which is not installed: pip install 'rmflow[wandb]'") from e


class Reporters:
    def __init__(self, cfg: TrainConfig, run_dir: str, *, purge_step: int | None):
        self.tensorboard = summary_writer(os.path.join(run_dir, "tensorboard"), purge_step=purge_step) \
            if "tensorboard" in cfg.logging.report_to else None
        self.wandb = _wandb_run(cfg, run_dir) if "wandb" in cfg.logging.report_to else None

    def log(self, record: dict[str, Any], step: int) -> None:
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        if self.tensorboard is not None:
            for k, v in scalars.items():
                self.tensorboard.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(cfg: TrainConfig, run_dir: str):
    import wandb

    id_path = os.path.join(run_dir, WANDB_ID_FILE)
    if os.path.exists(id_path):
        with open(id_path) as f:
            run_id = f.read().strip()
    else:
        run_id = uuid.uuid4().hex[:16]
        with open(id_path, "w") as f:
            f.write(run_id + "\n")
    return wandb.init(project=os.environ.get("WANDB_PROJECT") or cfg.logging.wandb_project,
                      name=os.path.basename(cfg.output.rstrip("/")), id=run_id, resume="allow",
                      config=cfg.to_dict(), dir=run_dir, settings=wandb.Settings(console="off"))
