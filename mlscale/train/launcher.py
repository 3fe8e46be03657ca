"""Starting a training job: in this process, under an external torchrun, or as N local workers
through torch's elastic launcher (the API behind torchrun).

``fit(config)`` is the Python API; ``mlscale train`` is one of its callers.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from mlscale.common.io import atomic_write
from mlscale.config import TrainConfig, flatten, merged, validated
from mlscale.data.dataset import MapData
from mlscale.data.loader import check_a_batch_fits
from mlscale.data.parquet import ParquetData, check_shardable
from mlscale.data.tensors import TensorData
from mlscale.errors import UsageError, WorkerFailed
from mlscale.rundir import RunDir
from mlscale.tasks import make_task
from mlscale.train.checkpoint import Checkpointer
from mlscale.train.dist import LOCAL_HOST, member_from_environ, private_environment, stores_listening_on, under_launcher
from mlscale.train.plan import JobPlan
from mlscale.train.planner import plan_job
from mlscale.train.recovery import KNOCK_ON
from mlscale.train.replica_groups import launch_replica_groups
from mlscale.train.strategies import strategy_for
from mlscale.train.trainer import JOB_START_ENV
from mlscale.train.warm import worker_command
from mlscale.train.worker import run_worker, save_traceback

_TIMEOUT = re.compile(r"timed out|timeout", re.I)


def fit(config: TrainConfig, *, keep_group: bool = False) -> dict[str, Any]:
    """Run a training job to the end; returns ``report.json`` (its keys: docs/architecture.md) as a dict.

    With ``resume``, the run's saved configuration is the base and only the fields given explicitly
    (``--steps``, ``--workers``...) override it. ``keep_group``: under an external torchrun, leave the
    process group up at the end instead of destroying it (``mlscale train`` does, then exits the process
    without teardown: tearing a gloo group down aborted about one exit in fifteen here)."""
    if config.resume and config.run_dir is not None:
        # Under torchrun every rank does this; rank 0 rewrites config.json atomically with the same
        # merge, so a rank reading it before or after the rewrite gets the same configuration.
        config = resumed_config(config)
    # fail fast, with exit 2, on a bad task; the text task tokenizes here, once, in --data-workers processes
    task = make_task(config.task, config.task_options, data_workers=config.data.data_workers)
    data = task.train_data()
    plan = plan_job(config, data=data)  # the one place the job's layout and length are worked out
    check_job(config, plan, data, task.build_model, task.tp_plan, eval_data=task.eval_data())
    if config.run_dir is None:
        config = config.model_copy(update={"run_dir": default_run_dir(config.task)})
    run_dir = RunDir(config.run_dir)
    if under_launcher():
        os.environ.setdefault(JOB_START_ENV, str(time.time()))  # torchrun's ranks: whoever set it first
    else:
        os.environ[JOB_START_ENV] = str(time.time())  # this call starts the job (a second fit() starts another)
    if under_launcher():
        return _run_here(config, plan, run_dir, rank=member_from_environ(plan.replica_groups), keep_group=keep_group)
    with _unchanged_unless_it_trains(run_dir):
        _prepare(config, plan, run_dir)
        if plan.fault_tolerance == "per-step":
            try:
                launch_replica_groups(config, run_dir, plan.total_steps)
            except WorkerFailed as exc:
                _write_failed_report(config, plan, run_dir, exc.rank, str(exc).splitlines()[0])
                raise
        elif plan.world == 1:
            return _run_here(config, plan, run_dir, rank=0)
        else:
            _launch_local(config, plan, run_dir)
    return run_dir.read_report()


def check_only(config: TrainConfig) -> str:
    """What ``fit`` checks before a worker starts, for a job of ``$WORLD_SIZE`` processes when set (the
    torchrun variable: how a Kubernetes Job's check container sizes it), else of ``--workers``.
    Returns a one-line summary; a mistake is a ``UsageError``."""
    task = make_task(config.task, config.task_options, data_workers=config.data.data_workers)
    given = os.environ.get("WORLD_SIZE", "")
    data = task.train_data()
    plan = plan_job(config, world=int(given) if given.isdigit() and int(given) > 0 else None, data=data)
    check_job(config, plan, data, task.build_model, task.tp_plan, eval_data=task.eval_data())
    return (f"ok: task {config.task}, strategy {config.strategy}, {plan.processes} process(es), "
            f"{len(data):,} training samples")


def resumed_config(config: TrainConfig) -> TrainConfig:
    """The run's saved configuration with the explicitly given fields of ``config`` on top."""
    run_dir = RunDir(config.run_dir or "")
    if not run_dir.config_path.exists():
        return config  # _prepare says there is nothing to resume
    saved = run_dir.read_config()
    given = config.given()
    saved = flatten(saved)
    for length, other in (("steps", "epochs"), ("epochs", "steps")):  # a new length replaces the saved one
        if given.get(length) is not None:
            saved.pop(other, None)
    # Under another strategy (a 2-D fsdp x tp run resumed by ddp), the saved options of the old one go.
    both = flatten(merged(saved, given))
    job = validated({key: both[key] for key in ("strategy", "fault_tolerance") if key in both})
    left = job.inapplicable() - set(given)
    return validated(merged({key: value for key, value in saved.items() if key not in left}, given, {"resume": True}))


@contextlib.contextmanager
def _unchanged_unless_it_trains(run_dir: RunDir) -> Iterator[None]:
    """A start that fails before its first checkpoint leaves the run directory's files as they were:
    ``config.json`` (rewritten by ``_prepare`` for the workers to read) and ``report.json`` (a failed
    job writes one) are put back. Once training has checkpointed, the failure is part of the run."""
    files = (run_dir.config_path, run_dir.report_path, run_dir.plan_path)
    kept = {path: path.read_bytes() for path in files if path.exists()}
    newest = Checkpointer(run_dir.checkpoints).latest()
    try:
        yield
    except BaseException:
        if kept and Checkpointer(run_dir.checkpoints).latest() == newest:
            for path, data in kept.items():
                atomic_write(path, lambda tmp, data=data: tmp.write_bytes(data))
            for path in files:
                if path not in kept:
                    path.unlink(missing_ok=True)
        raise


def check_job(config: TrainConfig, plan: JobPlan, data: TensorData | ParquetData | MapData,
              build_model: Callable[[], Any] | None = None, tp_plan: dict[str, str] | None = None,
              eval_data: TensorData | MapData | None = None) -> None:
    """Everything about the job that can be checked before a worker starts: a mistake is one line and
    exit 2 here, not a worker's traceback later."""
    strategy, world = strategy_for(config), plan.world
    strategy.check(config, world)
    if "tensorboard" in config.records.log:
        try:
            import torch.utils.tensorboard as _tensorboard  # noqa: F401 (whether it imports)
        except ImportError:
            raise UsageError("bad value log='tensorboard': needs the tensorboard package (pip install "
                             "'mlscale[tensorboard]')") from None
    for split in (data, eval_data):
        if isinstance(split, MapData):
            split.check()  # its first and last items, collated
    if config.data.data_threads:
        if config.data.data_workers != 0:
            raise UsageError(f"bad value data-threads={config.data.data_threads}: items are read by threads or by "
                             "--data-workers processes, not both; choose one")
        if not isinstance(data, MapData):
            raise UsageError(f"bad value data-threads={config.data.data_threads}: threads read a Dataset's items; "
                             "this task's data is in memory or Parquet (use --data-workers)")
    strategy.check_data(config, data)
    named = _named_inputs(data)
    if build_model is not None and (strategy.checks_model(config) or named):  # (a model may import a large library)
        try:
            with torch.device("meta"):  # the structure only: no memory for the weights
                model = build_model()
        except Exception:  # a factory that cannot build on the meta device: the workers will check
            model = None
        if model is not None and named:
            check_takes(model, named)
        if model is not None and strategy.checks_model(config):
            strategy.check_model(config, model, world, tp_plan)
    groups, workers = plan.replica_groups, plan.data_shards
    if config.per_step and isinstance(data, ParquetData):
        raise UsageError("bad value fault-tolerance='per-step': Parquet data is not built for it yet (a replica "
                         "takes the batch of the quorum's step from its shard); use in-memory data, or restart")
    if config.records.log_sample_ids and isinstance(data, ParquetData):
        raise UsageError("bad value log-sample-ids=True: Parquet data is read by row group, not by data set "
                         "index, and its ids are not logged yet; use in-memory data")
    if isinstance(data, ParquetData):
        check_shardable(data, workers, plan.step_batch, config.seed)
    else:
        check_a_batch_fits(len(data), workers, plan.step_batch, source=f"task {config.task!r}")
    for fault in config.recovery.faults:
        if fault.aims_at_rank and fault.rank >= world * groups:
            raise UsageError(f"bad value fault={fault.spec!r}: rank {fault.rank} does not exist with {world * groups} "
                             f"process(es) (ranks 0..{world * groups - 1})")
        if fault.rejoin_by and not (config.per_step and config.recovery.max_restarts):
            raise UsageError(f"bad value fault={fault.spec!r}: rejoin_by waits for the killed rank's replacement, "
                             "which needs --fault-tolerance per-step and --max-restarts 1 or more")
    if config.compute.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("bad value device='cuda': no CUDA device is available here (torch "
                         f"{torch.__version__}); use --device cpu or auto")


def _named_inputs(data: Any) -> list[str]:
    """The names of a Dataset's inputs when its items' inputs are a dict (else none)."""
    if not isinstance(data, MapData):
        return []
    inputs = data.item(0)[0]
    return list(inputs) if isinstance(inputs, dict) else []


def check_takes(model: Any, names: list[str]) -> None:
    """Refuse dict inputs whose keys the model's ``forward`` does not take (unless it takes ``**kwargs``)."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    unknown = [name for name in names if name not in parameters]
    if unknown:
        takes = ", ".join(name for name, p in parameters.items() if p.kind is not inspect.Parameter.VAR_POSITIONAL)
        raise UsageError(f"the Dataset's inputs name {', '.join(map(repr, unknown))}, which "
                         f"{type(model).__name__}.forward does not take (it takes: {takes}); the model is called "
                         "model(**inputs) with a dict")


def default_run_dir(task: str) -> str:
    """``runs/<time>-<task>``; under torchrun ``runs/<run id>``, the same on every rank and host."""
    safe_task = re.sub(r"[^A-Za-z0-9_.-]+", "-", task)
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return f"runs/{os.environ['TORCHELASTIC_RUN_ID']}-{safe_task}"
    return f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{safe_task}"


def _prepare(config: TrainConfig, plan: JobPlan, run_dir: RunDir) -> None:
    checkpoints = Checkpointer(run_dir.checkpoints)
    has_checkpoint = checkpoints.latest() is not None or bool(checkpoints.legacy_files())  # legacy: refused later
    if config.resume and not has_checkpoint:
        raise UsageError(f"bad value run-dir={config.run_dir!r}: nothing to resume (no checkpoint in it)")
    failed_at_start = (not has_checkpoint and run_dir.report_path.exists()
                       and run_dir.read_report().get("status") == "failed")  # nothing to keep: start again
    if not config.resume and not failed_at_start and (has_checkpoint or run_dir.report_path.exists()):
        raise UsageError(f"bad value run-dir={config.run_dir!r}: it already holds a run; "
                         "add --resume to continue it or choose another --run-dir")
    run_dir.write_config(config.model_dump(mode="json"))
    plan.write(run_dir.plan_path)


def _run_here(config: TrainConfig, plan: JobPlan, run_dir: RunDir, rank: int,
              keep_group: bool = False) -> dict[str, Any]:
    if rank == 0 and under_launcher():
        run_dir.write_config(config.model_dump(mode="json"))
        plan.write(run_dir.plan_path)
    try:
        return run_worker(config, run_dir, plan, destroy_group=not keep_group)
    except (KeyboardInterrupt, UsageError):
        raise
    except Exception as exc:
        path = save_traceback(run_dir, rank, exc)
        raise WorkerFailed(f"worker rank {rank} failed: {type(exc).__name__}: {exc}\n"
                           f"  traceback: {path}", rank=rank) from None


def _launch_local(config: TrainConfig, plan: JobPlan, run_dir: RunDir) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    for name, value in private_environment(LOCAL_HOST).items():  # the workers listen on loopback only
        os.environ.setdefault(name, value)
    # The zygote first, while this process may still be forked (one thread: the agent's store has none yet).
    with worker_command(run_dir.warm_starts_path) as command:
        _quiet_elastic_logs()
        _cheap_rendezvous_event_names()
        _run_agent(config, plan, run_dir, command)


def _run_agent(config: TrainConfig, plan: JobPlan, run_dir: RunDir, command: tuple[str, ...]) -> None:
    """torch's elastic agent, in this process, starting ``python COMMAND RUN_DIR`` for each worker and
    restarting them all on a failure (up to ``--max-restarts``)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=plan.world,
        run_id=f"mlscale-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d", rdzv_endpoint="localhost:0", rdzv_configs={"timeout": 120},
        max_restarts=config.recovery.max_restarts, monitor_interval=0.1, start_method="spawn",
        local_addr=LOCAL_HOST,  # what the workers are told to connect to: the stores listen there only
        logs_specs=DefaultLogsSpecs(log_dir=str(run_dir.elastic_logs)),
    )
    try:
        with stores_listening_on(LOCAL_HOST):  # the agent's, in this process
            elastic_launch(launch, sys.executable)(*command, str(run_dir.path))
    except ChildFailedError as exc:
        rank, how = _root_cause(exc, config.recovery.collective_timeout_s)
        _write_failed_report(config, plan, run_dir, rank, how)
        raise WorkerFailed(_failure_paragraph(config, run_dir, rank, how), rank=rank) from None


def _failure_paragraph(config: TrainConfig, run_dir: RunDir, rank: int, how: str) -> str:
    """What a user needs after a failed job: who failed and how, what was tried, how to go on."""
    lines = [f"training failed: worker rank {rank} {how}."]
    lines.append(f"  restarts used: {config.recovery.max_restarts} of {config.recovery.max_restarts} (--max-restarts).")
    latest = Checkpointer(run_dir.checkpoints).latest()
    if latest is not None:
        lines.append(f"  last good checkpoint: {latest}")
        lines.append(f"  resume with: mlscale train --run-dir {run_dir.path} --resume")
    else:
        lines.append("  no checkpoint was written (see --checkpoint-every).")
    where = run_dir.traceback_path(rank)
    if where.exists():
        lines.append(f"  traceback: {where}")
    return "\n".join(lines)


def _quiet_elastic_logs() -> None:
    """The agent logs every failure of every rank; we report the root cause ourselves, once."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _cheap_rendezvous_event_names() -> None:
    """torch's rendezvous names each event it records after its caller, found with ``inspect.stack()``:
    that builds source context for every frame, 1.6 s of CPU per job on 2 cores (18 calls, more on
    every restart; profiled, torch 2.13), for a name nobody reads. The same name, from the frame itself."""
    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name  # inspect.stack()[depth] is the same frame
        except ValueError:
            return "no_method_name"

    dynamic_rendezvous.get_method_name = get_method_name


def _failure_message(failure: Any) -> str:
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", str(message))
    return str(message)


def _signal_name(failure: Any) -> str:
    try:
        return signal.Signals(-failure.exitcode).name
    except ValueError:
        return f"signal {-failure.exitcode}"


def _root_cause(exc: Any, timeout_s: float) -> tuple[int, str]:
    """The rank whose failure started it, and how it failed, in words.

    In order: a rank killed by a signal other than the agent's own SIGTERM (SIGKILL, SIGSEGV, the OOM
    killer); a rank that was still running when every other rank had timed out waiting for it (a
    hang); the earliest error that is not a knock-on communication error; the earliest of all.
    """
    failures = sorted(exc.failures.items(), key=lambda item: (item[1].timestamp, item[0]))
    for rank, failure in failures:
        if failure.exitcode < 0 and -failure.exitcode not in (signal.SIGTERM, signal.SIGINT):
            return rank, f"was killed by {_signal_name(failure)}"
    reported = [(r, f) for r, f in failures if not _terminated_by_agent(f)]
    silent = [r for r, f in failures if _terminated_by_agent(f)]
    if reported and silent and all(_TIMEOUT.search(_failure_message(f)) for _, f in reported):
        return silent[0], (f"stopped responding: the other ranks timed out after {timeout_s:g} s "
                           "waiting for it (--collective-timeout)")
    for rank, failure in reported:
        if not KNOCK_ON.search(_failure_message(failure)):
            return rank, f"failed: {_failure_message(failure)}"
    rank, failure = failures[0]
    return rank, f"failed: {_failure_message(failure)}"


def _terminated_by_agent(failure: Any) -> bool:
    return failure.exitcode == -signal.SIGTERM and failure.error_file == "<N/A>"  # no error written


def _write_failed_report(config: TrainConfig, plan: JobPlan, run_dir: RunDir, rank: int, message: str) -> None:
    run_dir.write_report({
        "status": "failed", "task": config.task, "strategy": config.strategy,
        "world_size": plan.processes,
        "workers": config.workers,
        "error": {"rank": rank, "message": message},
        "restarts": config.recovery.max_restarts,
        "wall_s": time.time() - float(os.environ.get(JOB_START_ENV, time.time())),
        "model_uri": None,
    })
