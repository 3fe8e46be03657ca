"""mlscale: take a PyTorch model from one worker to many, then serve it.

The Python API is the real interface; the ``mlscale`` command is one of its users::

    from mlscale import TrainConfig, train
    report = fit(TrainConfig(task="digits", workers=2, epochs=5, run_dir="runs/demo"))
"""

from mlscale.config import TrainConfig, build_config
from mlscale.errors import MlscaleError, UsageError, WorkerFailed
from mlscale.tasks import Task, TensorData
from mlscale.train.launcher import fit

__all__ = ["MlscaleError", "Task", "TensorData", "TrainConfig", "UsageError", "WorkerFailed", "build_config", "fit"]
__version__ = "0.1.0"
