"""The worker entry point: one process of a training job.

Started by our launcher as ``python -m mlscale.train RUN_DIR`` (reading ``RUN_DIR/config.json`` and ``plan.json``),
or in-process for a single worker and under an external torchrun. A failing worker writes its error
for the elastic agent (which picks the root cause by time) and its traceback to ``RUN_DIR/logs``,
and prints nothing, so the user sees one error instead of one traceback per rank.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from mlscale.config import TrainConfig
from mlscale.errors import MlscaleError, first_line
from mlscale.rundir import RunDir
from mlscale.train.dist import init_distributed, member_from_environ, shutdown_distributed
from mlscale.train.memory import is_out_of_memory, memory_limit
from mlscale.train.plan import JobPlan
from mlscale.train.recovery import record_failure
from mlscale.train.strategy import JobFinished
from mlscale.train.trainer import Trainer


class MemoryLimitExceeded(MlscaleError):
    """A process needed more memory than ``--memory-limit-mb`` gives it."""


def run_worker(config: TrainConfig, run_dir: RunDir, plan: JobPlan, destroy_group: bool = True) -> dict[str, Any]:
    """Join the group, train, leave. Returns the report on rank 0 and ``{}`` elsewhere."""
    env = init_distributed(config.compute.device, config.recovery.collective_timeout_s, replicas=config.replica_groups)
    try:
        with memory_limit(config.compute.memory_limit_mb, env.device) as cap:
            report = Trainer(config, env, run_dir, plan, before_model=cap.arm).run()
    except JobFinished as exc:
        print(f"mlscale: {exc}; leaving", file=sys.stderr, flush=True)
        return {}  # its peers are gone: no barrier to wait at
    except Exception as exc:
        if config.compute.memory_limit_mb is not None and is_out_of_memory(exc):
            raise MemoryLimitExceeded(
                f"rank {env.rank} ran out of its {config.compute.memory_limit_mb:g} MB (--memory-limit-mb): "
                f"{first_line(exc)} One process cannot hold this model's training state (parameters, gradients, "
                "optimizer state, activations) within the limit: shard it over N processes with --strategy fsdp "
                "--workers N, or split the model with --strategy pipeline --stages P --workers P") from exc
        raise
    shutdown_distributed(destroy=destroy_group)
    return report


def save_traceback(run_dir: RunDir, rank: int, exc: BaseException) -> Path:
    path = run_dir.traceback_path(rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(traceback.format_exception(exc)))
    return path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    run_dir = RunDir(args[0])
    rank = int(os.environ.get("RANK", 0))
    try:
        config = TrainConfig(**run_dir.read_config())
        rank = member_from_environ(config.replica_groups)
        run_worker(config, run_dir, JobPlan.read(run_dir.plan_path), destroy_group=False)
    except BaseException as exc:  # reported to the agent, then exit 1

        save_traceback(run_dir, rank, exc)
        record_failure(run_dir, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)), rank, exc)
        ErrorHandler().record_exception(exc)
        leave(1)
    leave(0)
    return 0  # not reached


def leave(code: int) -> None:
    """Exit without tearing down the process groups. Measured here (torch 2.13, gloo, 3 workers on 2
    busy cores): about 1 run in 15 aborted at exit with "terminate called without an active exception"
    while a group was torn down; after a collective timed out, a group's pending work can also throw on
    teardown ("terminate called after throwing ... std::runtime_error"), turning a clean, recorded
    failure into a SIGABRT that hides its cause. All work and the error are on disk by now."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or a pipe whose reader went away
            stream.flush()
    os._exit(code)


