"""mlscale: take a PyTorch model from one worker to many, then serve it.

The Python API is the real interface; the ``mlscale`` command is one of its users::

    from mlscale import TrainConfig, fit
    report = fit(TrainConfig(task="digits", workers=2, epochs=5, run_dir="runs/demo"))

The training names are imported on first use: ``mlscale serve`` of an ONNX model never loads torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlscale.common.lazy import lazy_names
from mlscale.errors import MlscaleError, UsageError, WorkerFailed

if TYPE_CHECKING:
    from mlscale.config import TrainConfig, build_config
    from mlscale.data.collate import PadCollate
    from mlscale.data.hf_datasets import HFDataset
    from mlscale.data.parquet import ParquetData
    from mlscale.tasks import Task, TensorData, declare_task
    from mlscale.train.launcher import fit

__all__ = ["HFDataset", "MlscaleError", "PadCollate", "ParquetData", "Task", "TensorData", "TrainConfig",
           "UsageError", "WorkerFailed", "build_config", "declare_task", "fit"]
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_names(__name__, {
    "TrainConfig": "mlscale.config", "build_config": "mlscale.config", "Task": "mlscale.tasks",
    "TensorData": "mlscale.tasks", "ParquetData": "mlscale.data.parquet", "declare_task": "mlscale.tasks",
    "fit": "mlscale.train.launcher", "PadCollate": "mlscale.data.collate", "HFDataset": "mlscale.data.hf_datasets"})
