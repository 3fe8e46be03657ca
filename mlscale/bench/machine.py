"""What a benchmark ran on, stated in every result file."""

from __future__ import annotations

import os
import platform

import torch


def machine_info() -> dict[str, object]:
    return {
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
    }
