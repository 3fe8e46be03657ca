"""What a benchmark ran on, stated in every result file."""

from __future__ import annotations

import os
import platform


def machine_info() -> dict[str, object]:
    import torch  # not at import: the CLI imports the benchmarks to build its parser

    return {
        "cpu_cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "backend": "nccl" if torch.cuda.is_available() else "gloo",
    }
