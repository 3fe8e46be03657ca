"""The training loop. It knows the task and the strategy's small interface, nothing about which
strategy runs it, and writes everything through ``RunDir``.

Per step it measures wall time split into data wait, compute and exposed communication (the part of
communication the backward pass did not hide); the strategy measures communication busy time.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from mlscale.config import TrainConfig
from mlscale.data import Position, ShardLoader, steps_per_epoch
from mlscale.errors import MlscaleError
from mlscale.lineage import code_version, data_fingerprint
from mlscale.rundir import RunDir
from mlscale.tasks import make_task
from mlscale.train.checkpoint import Checkpointer, capture_rng, restore_rng
from mlscale.train.dist import DistEnv, all_gather_floats, all_gather_objects
from mlscale.train.faults import FaultInjector
from mlscale.train.progress import Progress
from mlscale.train.recovery import Heartbeat, RecoveryTracker, recovery_summary
from mlscale.train.stragglers import flag_stragglers
from mlscale.train.strategies import strategy_class
from mlscale.train.timing import median, now

JOB_START_ENV = "MLSCALE_JOB_START"
TIMING_KEYS = ("step_ms", "compute_ms", "comm_ms", "comm_exposed_ms", "data_wait_ms")


def total_steps(config: TrainConfig, train_size: int, world: int) -> int:
    if config.steps is not None:
        return config.steps
    epochs = config.epochs if config.epochs is not None else 10.0
    return max(1, math.ceil(epochs * steps_per_epoch(train_size, world, config.batch_size)))


def build_optimizer(config: TrainConfig, params: Any) -> torch.optim.Optimizer:
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def lr_factor(config: TrainConfig, total: int) -> Any:
    """Linear warm-up, then constant or cosine decay to zero at ``total``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        if config.lr_schedule == "constant":
            return 1.0
        progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


@dataclass
class _Window:
    """What happened since the last log line."""

    start: float = field(default_factory=now)
    losses: list[torch.Tensor] = field(default_factory=list)
    timings: list[tuple[float, ...]] = field(default_factory=list)


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: RunDir) -> None:
        self.config, self.env, self.run_dir = config, env, run_dir
        self.task = make_task(config.task, config.task_options)
        self.dtype = getattr(torch, config.dtype)
        self.train_data = self.task.train.to(self.dtype)
        self.strategy = strategy_class(config.strategy)(env)
        self.faults = FaultInjector(config.faults, env.rank, first_attempt=env.attempt == 0 and not config.resume,
                                    log_path=run_dir.logs / "faults.jsonl")

        torch.manual_seed(config.seed)  # the same initial weights on every rank
        model = self.task.build_model().to(dtype=self.dtype, device=env.device)
        self._seed_rank_rngs()
        self.model = self.strategy.wrap(model)
        self.optimizer = build_optimizer(config, self.model.parameters())
        self.total_steps = total_steps(config, len(self.train_data), env.world_size)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_factor(config, self.total_steps))
        self.scaler = torch.amp.GradScaler(env.device.type, enabled=config.precision == "fp16")
        self.checkpointer = Checkpointer(run_dir.checkpoints, keep=config.keep_checkpoints,
                                         async_save=config.async_checkpoint,
                                         write_hook=self.faults.during_checkpoint_write)
        self.checkpoint_stalls_ms: list[float] = []

        self.step, self.samples_seen, position = 0, 0, Position()
        self.resumed_from: int | None = None
        self.resumed_world_size: int | None = None
        if config.resume or env.attempt > 0:
            position = self._restore()
        self.heartbeat = Heartbeat(run_dir.path / "heartbeat", env.attempt, env.rank)
        self.recovery: RecoveryTracker | None = None
        self.progress: Progress | None = None
        if env.attempt > 0 and env.is_main:
            self.recovery = RecoveryTracker(run_dir.path, run_dir.path / "heartbeat", run_dir.logs / "faults.jsonl",
                                            attempt=env.attempt, resumed_from=self.step)
        self.loader = ShardLoader(self.train_data, rank=env.rank, world=env.world_size,
                                  batch_size=config.batch_size, seed=config.seed, position=position)
        self.global_batch = config.batch_size * env.world_size

    # -- state --------------------------------------------------------------------------------
    def _seed_rank_rngs(self) -> None:
        seed = self.config.seed * 1000 + self.env.rank + 1
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def _restore(self) -> Position:
        found = self.checkpointer.load_latest()
        if found is None:
            if self.checkpointer.steps():  # checkpoints exist but none loads: never start over silently
                raise MlscaleError(f"no checkpoint in {self.run_dir.checkpoints} loads (all "
                                   f"{len(self.checkpointer.steps())} are damaged); the run cannot resume")
            return Position()  # a failure before the first checkpoint: the run starts from step 0
        _, state = found
        self.strategy.unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        rngs = state["rng"]
        if len(rngs) == self.env.world_size:
            restore_rng(rngs[self.env.rank])
        self.step, self.samples_seen = state["step"], state["samples_seen"]
        self.resumed_from, self.resumed_world_size = self.step, state["world_size"]
        old_batch = state.get("global_batch", self.config.batch_size * state["world_size"])
        if self.env.is_main and old_batch != self.config.batch_size * self.env.world_size:
            print(f"mlscale: resuming step {self.step} of a {state['world_size']}-worker run on "
                  f"{self.env.world_size}: global batch {old_batch} -> {self.config.batch_size * self.env.world_size}"
                  f" (--batch-size {old_batch // self.env.world_size} keeps it)", file=sys.stderr)
        return Position(**state["position"])

    def _checkpoint(self, final: bool = False) -> None:
        """Save a checkpoint; the time the training thread was held goes into the stall statistics
        (not for the final one, after which there is no training left to stall)."""
        start = now()
        rngs = all_gather_objects(self.env, capture_rng())
        if not self.env.is_main:
            return
        self._save_checkpoint(rngs)
        if not final:
            self.checkpoint_stalls_ms.append((now() - start) * 1e3)

    def _save_checkpoint(self, rngs: list[object]) -> None:
        self.checkpointer.save(self.step, {
            "step": self.step,
            "samples_seen": self.samples_seen,
            "position": self.loader.position.as_dict(),
            "world_size": self.env.world_size,
            "global_batch": self.global_batch,
            "model": self.strategy.unwrap(self.model).state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "rng": rngs,
        })

    # -- the loop -----------------------------------------------------------------------------
    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.precision == "fp32":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.precision == "bf16" else torch.float16
        return torch.autocast(self.env.device.type, dtype=dtype)

    def _train_step(self, window: _Window) -> None:
        device = self.env.device
        start = now()
        inputs, targets = next(self.loader)
        inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        data_end = now()
        self.faults.before_step(self.step + 1)
        with self._autocast():
            loss = self.task.loss_fn(self.model(inputs), targets)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        backward_end = now()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        end = now()
        comm_ms, exposed_ms = self.strategy.comm_times(backward_end)
        data_ms, step_ms = (data_end - start) * 1e3, (end - start) * 1e3
        window.losses.append(loss.detach())
        window.timings.append((step_ms, step_ms - data_ms - exposed_ms, comm_ms, exposed_ms, data_ms))
        self.step += 1
        self.samples_seen += self.global_batch
        self.heartbeat.beat(self.step)
        if self.recovery is not None:
            event = self.recovery.first_step_done()
            self._say(self.recovery.resumed_notice(event))
            self.recovery = None

    def _say(self, text: str) -> None:
        """A console line from rank 0 (above the progress bar when there is one)."""
        if self.progress is not None:
            self.progress.note(text)
        elif self.env.is_main:
            print(text, file=sys.stderr, flush=True)

    def _log(self, window: _Window, progress: Progress | None) -> float:
        """Gather loss and timings from all ranks; rank 0 writes a metrics line. Returns the loss."""
        medians = [median(t[i] for t in window.timings) for i in range(len(TIMING_KEYS))]
        last_loss = window.losses[-1].float().item()
        mean_loss = torch.stack(window.losses).float().mean().item()
        rows = all_gather_floats(self.env, [mean_loss, last_loss, *medians])
        elapsed = now() - window.start
        loss = sum(r[0] for r in rows) / len(rows)
        if self.env.is_main:
            samples_per_s = len(window.timings) * self.global_batch / elapsed
            self.run_dir.append_metrics({
                "step": self.step,
                "epoch": self.loader.position.epoch,
                "loss": loss,
                "lr": self.scheduler.get_last_lr()[0],
                "samples_per_s": samples_per_s,
                "time": time.time(),
                "per_rank": [{"rank": rank, **dict(zip(TIMING_KEYS, row[2:]))} for rank, row in enumerate(rows)],
            })
            if progress is not None:
                progress.update(self.step, loss, samples_per_s)
        return sum(r[1] for r in rows) / len(rows)

    def run(self) -> dict[str, Any]:
        """Train to ``total_steps``, checkpoint, evaluate, and (rank 0) write the report."""
        config = self.config
        progress = self.progress = Progress(self.total_steps, self.step) if self.env.is_main else None
        if self.recovery is not None:
            self._say(self.recovery.restart_notice(config.max_restarts))
        # Throughput and timing medians leave out the first steps (warm-up), unless that is all.
        warm = min(config.warmup_steps_for_throughput, max(0, self.total_steps - self.step - 1))
        start_step = self.step
        measure_from = (now(), self.step) if warm == 0 else None
        all_timings: list[tuple[float, ...]] = []
        window, final_loss = _Window(), float("nan")
        try:
            while self.step < self.total_steps:
                self._train_step(window)
                if measure_from is not None:
                    all_timings.append(window.timings[-1])
                elif self.step - start_step == warm:
                    measure_from = (now(), self.step)
                if self.step % config.log_every == 0 or self.step == self.total_steps:
                    final_loss = self._log(window, progress)
                    window = _Window()
                if config.checkpoint_every and self.step % config.checkpoint_every == 0:
                    self._checkpoint(final=self.step == self.total_steps)
        finally:
            if progress is not None:
                progress.close()
        if not config.checkpoint_every or self.step % config.checkpoint_every:
            self._checkpoint(final=True)
        self.checkpointer.wait()
        self.heartbeat.close()
        return self._finish(final_loss, all_timings, measure_from)

    # -- the end ------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        model = self.strategy.unwrap(self.model)
        data = self.task.eval.to(self.dtype)
        model.eval()
        with torch.no_grad():
            outputs = torch.cat([model(data.inputs[i:i + 1024].to(self.env.device)).cpu()
                                 for i in range(0, len(data), 1024)])
        model.train()
        return self.task.metrics_fn(outputs, data.targets)

    def _finish(self, final_loss: float, timings: list[tuple[float, ...]],
                measure_from: tuple[float, int] | None) -> dict[str, Any]:
        end = now()
        medians = [median(t[i] for t in timings) for i in range(len(TIMING_KEYS))]
        rows = all_gather_floats(self.env, medians)
        per_rank = [{"rank": rank, **{f"{key}_p50": value for key, value in zip(TIMING_KEYS, row)}}
                    for rank, row in enumerate(rows)]
        if not self.env.is_main:
            return {}
        measured_steps = self.step - measure_from[1] if measure_from else 0
        samples_per_s = measured_steps * self.global_batch / (end - measure_from[0]) if measured_steps else 0.0
        self.run_dir.write_final_model(self.strategy.unwrap(self.model),
                                       metadata={"task": self.config.task, "step": str(self.step)})
        job_start = float(os.environ.get(JOB_START_ENV, time.time()))
        report = {
            "status": "completed",
            "task": self.config.task,
            "strategy": self.config.strategy,
            "world_size": self.env.world_size,
            "steps": self.step,
            "samples_seen": self.samples_seen,
            "samples_per_s": samples_per_s,
            "final_loss": final_loss,
            "eval": self.evaluate(),
            "restarts": self.env.attempt,
            "recovery": recovery_summary(self.run_dir.path),
            "checkpoint": {
                "async": self.config.async_checkpoint,
                "saves_during_training": len(self.checkpoint_stalls_ms),
                "stall_ms_p50": median(self.checkpoint_stalls_ms),
                "stall_ms_max": max(self.checkpoint_stalls_ms, default=0.0),
                "write_ms_p50": median(self.checkpointer.write_ms),
            },
            "per_rank": per_rank,
            "stragglers": flag_stragglers(per_rank),
            "wall_s": time.time() - job_start,
            "model_uri": None,
            "run_dir": str(self.run_dir.path),
            "resumed_from_step": self.resumed_from,
            "resumed_from_world_size": self.resumed_world_size,
            "epochs": self.samples_seen / len(self.train_data),
            "dtype": self.config.dtype,
            "precision": self.config.precision,
            "device": str(self.env.device),
            "torch": torch.__version__,
            "data_fingerprint": data_fingerprint(self.task.train, self.task.eval),
            "code_version": code_version(),
        }
        self.run_dir.write_report(report)
        return report
