"""The training loop. It knows the task and the Strategy interface, nothing about which
strategy runs it, and writes everything through ``RunDir``: checkpoints and the final model itself,
metrics lines, TensorBoard, the console and ``report.json`` through its records (``records.py``).

Per step it measures wall time split into data wait, compute and exposed communication (the part of
communication the backward pass did not hide); the strategy measures communication busy time.
"""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from mlscale.common.io import append_jsonl, read_jsonl
from mlscale.config import TrainConfig
from mlscale.data import Position, ShardLoader
from mlscale.data.batches import call_model, rows, take, to_device
from mlscale.data.dataset import MapData
from mlscale.data.parquet import ParquetData, ParquetLoader, check_resumable
from mlscale.data.pipeline import DatasetLoader, PipelineLoader, StreamLoader, autotune_workers, describe_choice
from mlscale.data.threads import ThreadLoader
from mlscale.errors import MlscaleError
from mlscale.lineage import data_fingerprint
from mlscale.rundir import RunDir
from mlscale.tasks import TensorData, make_task
from mlscale.tasks.outputs import concat, to_cpu
from mlscale.train.checkpoint import Checkpointer, capture_rng, restore_rng
from mlscale.train.dist import JOB_START_ENV, DistEnv, broadcast_int
from mlscale.train.faults import FaultInjector
from mlscale.train.materialize import MB, build_on_meta, parameter_bytes
from mlscale.train.memory import host_memory
from mlscale.train.plan import JobPlan
from mlscale.train.records import NO_PROGRESS_ENV as NO_PROGRESS_ENV  # a public name of this module too
from mlscale.train.records import Records, TrainerFacts
from mlscale.train.recovery import Heartbeat, RecoveryTracker
from mlscale.train.sample_ids import SampleIdLog, agreed_attempt
from mlscale.train.strategies import strategy_for
from mlscale.train.strategy import Batch, Learner, Setup, StepResult, StepStart
from mlscale.train.timing import median, now


def build_optimizer(config: TrainConfig, params: Any) -> torch.optim.Optimizer:
    if config.optim.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.optim.lr, weight_decay=config.optim.weight_decay)
    optim = config.optim
    return torch.optim.SGD(params, lr=optim.lr, momentum=optim.momentum, weight_decay=optim.weight_decay)


def lr_factor(config: TrainConfig, total: int) -> Any:
    """Linear warm-up, then constant or cosine decay to zero at ``total``."""

    def factor(step: int) -> float:
        if step < config.optim.warmup_steps:
            return (step + 1) / config.optim.warmup_steps
        if config.optim.lr_schedule == "constant":
            return 1.0
        progress = (step - config.optim.warmup_steps) / max(1, total - config.optim.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return factor


EVAL_BATCH = 1024
BAD_SAMPLES_SHOWN = 100


def bad_samples(run_dir: RunDir) -> dict[str, Any]:
    """``--bad-samples skip``'s record for the report: how many samples were left out, over every rank and
    attempt, and the first ``BAD_SAMPLES_SHOWN`` of them (rank, step, index, epoch, error)."""
    notes = [{"rank": int(path.stem.removeprefix("rank")), **line}
             for path in sorted(run_dir.bad_samples.glob("rank*.jsonl")) for line in read_jsonl(path)]
    notes.sort(key=lambda note: (note.get("step", 0), note["rank"]))
    return {"count": len(notes), "samples": notes[:BAD_SAMPLES_SHOWN]}


def _eval_batches(data: TensorData | MapData) -> Any:
    """The held-out split in batches of ``EVAL_BATCH`` rows, in order."""
    for start in range(0, len(data), EVAL_BATCH):
        indices = torch.arange(start, min(start + EVAL_BATCH, len(data)))
        yield data.batch(indices) if isinstance(data, MapData) else (take(data.inputs, indices), data.targets[indices])


class Trainer:
    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: RunDir, plan: JobPlan,
                 before_model: Callable[[], None] = lambda: None) -> None:
        """``before_model``: called just before the model is built (``--memory-limit-mb`` is armed there)."""
        self.config, self.env, self.run_dir, self.plan = config, env, run_dir, plan
        self.task = make_task(config.task, config.task_options)
        self.dtype = getattr(torch, config.compute.dtype)
        self.train_data = self.task.train_data().to(self.dtype)
        if isinstance(self.train_data, MapData):
            self.train_data = self.train_data.skipping(config.data.bad_samples == "skip")
            keep_objects = getattr(self.train_data.dataset, "use_object_cache", None)
            if config.data.data_cache_mb and callable(keep_objects):
                keep_objects(run_dir.object_cache, config.data.data_cache_mb * 2**20)
        strategy_type = strategy_for(config)
        self.shard = plan.shard_of(env.rank, env.replica)  # None: reads no data
        self.shards = plan.data_shards
        data_ranks = plan.data_ranks()
        self.strategy = strategy_type(env, config, plan)
        self.faults = FaultInjector(config.recovery.faults, env.member,
                                    first_attempt=env.attempt == 0 and not config.resume,
                                    run_dir=run_dir, data_ranks=data_ranks, seed=config.seed,
                                    fresh=not config.resume, hold_s=config.recovery.collective_timeout_s,
                                    started=float(os.environ.get(JOB_START_ENV, 0)))
        assert plan.total_steps is not None, "a worker's plan has the job's length"
        self.total_steps, self.global_batch = plan.total_steps, plan.global_batch
        self.checkpointer = self._make_checkpointer(plan.checkpoint_ranks)
        self.checkpoint_stalls_ms: list[float] = []
        self.records = Records(config, env, run_dir, self.strategy, plan)

        self.step, self.samples_seen = 0, 0
        self.data_workers = 0  # what the input pipeline runs with (--data-workers auto: measured)
        self.eval_data: TensorData | MapData | None = None
        self.learners: list[Learner] = []  # the update rules the strategy asked for (one, or a shard's)
        self.positions = {shard: Position() for shard in range(self.shards)}
        self.resumed_from: int | None = None
        self.resumed_world_size: int | None = None
        # A restarted process resumes from the newest checkpoint; under per-step fault tolerance a live
        # peer's state then replaces it at the first quorum (when every group was lost, it is all there is).
        restarted = env.attempt > 0 and not strategy_type.recovers_live
        found = self._latest_checkpoint() if config.resume or env.attempt > 0 else None
        if found is not None:
            self.step = found[1]["step"]
        self.local_steps = self.step  # steps this rank has computed (equal to global steps under ddp)
        self.logged_step = self.step
        self.redo_batch: Batch | None = None  # the batch of a step the strategy discarded, to train again
        before_model()
        torch.manual_seed(config.seed)  # the same initial weights on every rank
        on_meta = strategy_type.splits_model and env.distributed
        model = build_on_meta(self._build_plain) if on_meta else self._build_plain().to(env.device)
        weight_init = self._weight_init(model) if on_meta else "full"
        self._seed_rank_rngs()
        sample_inputs = to_device(self.task.example_inputs(self.plan.step_batch, self.dtype), env.device)
        self.strategy.setup(Setup(model=model, build_model=self._build_plain,
                                  make_learner=self._make_learner, loss_fn=self.task.loss_fn,
                                  total_steps=self.total_steps, start_step=self.step, global_batch=self.global_batch,
                                  weight_init=weight_init, full_weights=self._full_weights, tp_plan=self.task.tp_plan,
                                  sample_inputs=sample_inputs,
                                  ready=self.faults.ready))
        if found is not None:
            self._restore(*found)
            if env.distributed:  # nobody saves (and prunes) before every rank has read its part
                dist.barrier()
        self.heartbeat = Heartbeat(run_dir, env.attempt, env.member)
        self.recovery: RecoveryTracker | None = None
        if restarted and env.is_main:
            self.recovery = RecoveryTracker(run_dir, attempt=env.attempt, resumed_from=self.step)
        self.loader: ShardLoader | StreamLoader | None = None
        self.loader = None if self.shard is None else self._make_loader()
        self.sample_ids: SampleIdLog | None = None
        if config.records.log_sample_ids:
            attempt = agreed_attempt(run_dir, env.rank, env.world_size, env.device)
            # One writer per data shard: the first rank reading it (tensor-parallel peers and pipeline stages
            # of a replica train the same batch).
            first = self.shard is not None and plan.rank_shards.index(plan.rank_shards[env.rank]) == env.rank
            self.sample_ids = SampleIdLog(run_dir, env.rank, attempt) if first else None

    def _build_plain(self) -> torch.nn.Module:
        return self.task.build_model().to(dtype=self.dtype)

    def _full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights as one process builds them (seeded, without touching the random
        state the run goes on with): what --weight-init full streams to the shards from rank 0."""
        with torch.random.fork_rng(devices=[]), host_memory():
            torch.manual_seed(self.config.seed)
            return self._build_plain().state_dict()

    def _weight_init(self, model: torch.nn.Module) -> str:
        """--weight-init auto: ``full`` unless the model's weights alone exceed --memory-limit-mb."""
        how, limit = self.config.model.weight_init, self.config.compute.memory_limit_mb
        weights = parameter_bytes(model)
        if how == "auto":
            how = "sharded" if limit is not None and weights > limit * MB else "full"
        if self.env.is_main:
            where = ("rank 0 builds the whole model and streams it to the shards" if how == "full" else
                     "each rank initialises its own shards (the model's own init)")
            print(f"mlscale: model built on the meta device ({weights / MB:,.1f} MB of weights); {where} "
                  f"(--weight-init {how})", file=sys.stderr, flush=True)
        return how

    def _make_loader(self) -> ShardLoader | StreamLoader:
        """In-memory batches (``ShardLoader``), or the input pipeline when the task transforms samples,
        ``--data-workers`` asks for worker processes, or the data is Parquet (streamed by row group,
        ``ParquetLoader``); for in-memory data the same batches and positions either way."""
        config, shard = self.config, self.shard
        assert shard is not None
        plain = dict(rank=shard, world=self.shards, step_batch=self.plan.step_batch, seed=config.seed)
        streamed = isinstance(self.train_data, ParquetData)
        if config.data.data_threads and isinstance(self.train_data, MapData):
            self.data_workers = 0
            return ThreadLoader(self.train_data, position=self.positions[shard], threads=config.data.data_threads,
                                prefetch=config.data.data_prefetch, **plain)
        if config.data.data_workers == 0 and self.task.transform is None and not streamed:
            return ShardLoader(self.train_data, position=self.positions[shard], **plain)
        loader_type = ParquetLoader if streamed else DatasetLoader if isinstance(self.train_data, MapData) \
            else PipelineLoader
        # One cache per process (ranks that read the same shard, under tp or pipeline, keep their own),
        # valid for this task, its options and dtype only.
        cache_dir = self.run_dir.data_cache(self.env.member)
        cache_key = json.dumps([config.task, config.task_options, config.compute.dtype], sort_keys=True, default=str)

        def make(workers: int, cache: str = config.data.data_cache) -> StreamLoader:
            return loader_type(self.train_data, position=self.positions[shard], workers=workers,
                               prefetch=config.data.data_prefetch, transform=self.task.transform, cache=cache,
                               cache_dir=cache_dir, cache_key=cache_key, pin_memory=self.env.device.type == "cuda",
                               **plain)

        workers = config.data.data_workers if self.loader is None else self.data_workers  # measured once
        if workers == "auto":  # timed without the cache: a candidate must not read what another made
            workers, timings = autotune_workers(lambda n: make(n, cache="none"), prefetch=config.data.data_prefetch)
            if self.env.is_main:
                print(describe_choice(workers, timings), file=sys.stderr, flush=True)
        self.data_workers = int(workers)
        return make(self.data_workers)

    # -- state --------------------------------------------------------------------------------
    def _make_learner(self, params: Any) -> Learner:
        """The update rule a strategy applies to the parameters it updates (all of them, or a shard)."""
        optimizer = build_optimizer(self.config, params)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor(self.config, self.total_steps))
        learner = Learner(optimizer=optimizer, scheduler=schedule,
                          scaler=torch.amp.GradScaler(self.env.device.type,
                                                      enabled=self.config.compute.precision == "fp16"),
                          precision=self.config.compute.precision, device_type=self.env.device.type)
        learner.clip_grad_norm = self.config.optim.clip_grad_norm
        self.learners.append(learner)
        return learner

    def _seed_rank_rngs(self) -> None:
        # By data shard, not rank: the worker reading shard i draws the same numbers under every strategy.
        position = self.shard if self.shard is not None else self.shards + self.env.rank
        seed = self.config.seed * 1000 + position + 1
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def _make_checkpointer(self, writers: list[int]) -> Checkpointer:
        """Checkpoint ranks write together, on a gloo group of their own (a background save's collectives
        must not interleave with training's); other ranks only read."""
        group = None
        if self.env.distributed:  # also for one writer: async_save needs a CPU group, the default may be nccl
            timeout = timedelta(seconds=self.config.recovery.collective_timeout_s)
            group = dist.new_group(ranks=writers, backend="gloo", timeout=timeout)  # called on every rank
        writer = self.env.rank in writers
        # Under a CPU memory limit an async save's copy of the state would count against it: write in place.
        async_save = self.config.checkpoint.async_checkpoint and not (self.config.compute.memory_limit_mb and
                                                           self.env.device.type == "cpu")
        return Checkpointer(self.run_dir.checkpoints, keep=self.config.checkpoint.keep_checkpoints,
                            async_save=async_save, write_hook=self.faults.during_checkpoint_write,
                            rank=writers.index(self.env.rank) if writer else None, group=group,
                            collective=writer and group is not None,
                            # under per-step, a partial checkpoint may be a live former leader's
                            clean_leftovers=not self.strategy.recovers_live)

    def _latest_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        """Rank 0 picks the checkpoint and tells the others, so that every rank resumes from the same
        one even when a shared file system shows them different listings."""
        found, error = None, None
        if self.env.is_main:
            try:
                found = self._pick_checkpoint()
            except MlscaleError as exc:
                error = exc
        chosen = broadcast_int(self.env, -2 if error else found[0] if found else -1)
        if error is not None:
            raise error
        if chosen == -2:
            raise MlscaleError("rank 0 found no checkpoint to resume from (see its message)")
        if chosen < 0:
            return None
        return found if found is not None else (chosen, self.checkpointer.trainer_state(chosen))

    def _pick_checkpoint(self) -> tuple[int, dict[str, Any]] | None:
        legacy = self.checkpointer.legacy_files()
        if legacy and not self.checkpointer.steps():
            raise MlscaleError(f"{self.run_dir.checkpoints} holds single-file checkpoints ({legacy[-1].name}) of an "
                               "older mlscale, which wrote one file from rank 0; this version writes sharded "
                               "checkpoints and cannot resume them")
        found = self.checkpointer.latest_complete()
        if found is None and self.checkpointer.steps():  # checkpoints exist but none is whole: never start over
            raise MlscaleError(f"no checkpoint in {self.run_dir.checkpoints} is complete (all "
                               f"{len(self.checkpointer.steps())} are damaged); the run cannot resume")
        return found  # None: a failure before the first checkpoint, the run starts from step 0

    def _restore(self, step: int, saved: dict[str, Any]) -> None:
        state = self.checkpointer.load(step, self.strategy.state_template())
        self.strategy.load_train_state(state)
        if state.meta["own"] and saved["world_size"] == self.env.world_size and "rng" in state.meta:
            restore_rng(state.meta["rng"])
        self.samples_seen = saved["samples_seen"]
        self.resumed_from, self.resumed_world_size = self.step, saved["world_size"]
        positions = saved["positions"]
        check_resumable(self.train_data, Position(**saved["position"]), saved["workers"], self.shards)
        if len(positions) == self.shards:
            self.positions = {shard: Position(**where) for shard, where in enumerate(positions)}
        else:  # the same position on every shard, as data parallelism leaves it
            self.positions = {shard: Position(**saved["position"]) for shard in range(self.shards)}
        old_batch = saved["global_batch"]
        if self.env.is_main and old_batch != self.global_batch:
            print(f"mlscale: resuming step {self.step} of a {saved['workers']}-worker run on "
                  f"{self.shards}: global batch {old_batch} -> {self.global_batch}"
                  f" (--batch-size {old_batch // (self.shards * self.plan.grad_accum)} keeps it)", file=sys.stderr)

    def _checkpoint(self, final: bool = False) -> None:
        """Save a checkpoint; the time the training thread was held goes into the stall statistics
        (not for the final one, after which there is no training left to stall)."""
        if self.checkpointer.rank is None or not self.strategy.saves_checkpoints:
            return  # this rank holds no state of its own, or another replica group writes it
        start = now()
        state = self.strategy.train_state()
        state.meta["rng"] = capture_rng()
        self.checkpointer.save(self.step, state, trainer={
            "step": self.step,
            "samples_seen": self.samples_seen,
            "position": self.positions[0].as_dict(),
            "positions": [self.positions[shard].as_dict() for shard in range(self.shards)],
            "world_size": self.plan.processes,
            "workers": self.plan.data_shards,
            "global_batch": self.global_batch,
        })
        if not final:
            self.checkpoint_stalls_ms.append((now() - start) * 1e3)

    # -- the loop -----------------------------------------------------------------------------
    def _next_batch(self) -> Batch | None:
        start = now()
        if self.loader is None:
            return None
        inputs, targets = next(self.loader)
        for note in self.loader.last_bad:  # --bad-samples skip: left out of this batch, kept on record
            append_jsonl(self.run_dir.bad_samples_path(self.env.rank),
                         {"step": self.step + 1, **note, "epoch": self.loader.position.epoch})
        device = self.env.device
        inputs, targets = to_device(inputs, device, non_blocking=True), to_device(targets, device, non_blocking=True)
        return Batch(inputs, targets, self.loader.position, start, (now() - start) * 1e3, self.loader.last_ids)

    def _jump(self, start: StepStart) -> None:
        """Go on from where the peer that sent this process the job's state was: its step, its data
        position (every shard's: positions are global), its count of samples and of logged steps."""
        assert start.position is not None
        self.step = self.logged_step = self.local_steps = start.step
        self.samples_seen = start.samples_seen if start.samples_seen is not None else self.samples_seen
        self.positions = dict.fromkeys(range(self.shards), start.position)
        if self.loader is not None:
            if isinstance(self.loader, StreamLoader):
                self.loader.close()
            self.loader = self._make_loader()

    def _next_or_same_batch(self) -> Batch | None:
        """The next batch; the discarded step's again (timed afresh) when the strategy redoes it."""
        start = self.strategy.begin_step(None if self.shard is None else self.positions[self.shard], self.samples_seen)
        redo, self.redo_batch = self.redo_batch, None
        if start is not None and start.position is not None:
            self._jump(start)  # the state came from a peer: so does the place in the data
        elif redo is not None:
            return Batch(redo.inputs, redo.targets, redo.position, now(), 0.0, redo.ids)
        return self._next_batch()

    def _train_step(self) -> StepResult:
        # A data rank counts its own steps (under async ps the global step can jump past a straggler's);
        # a rank without data counts global steps.
        own_step = (self.local_steps if self.loader is not None else self.step) + 1
        self.faults.stop_if_due(own_step)
        self.faults.hold(own_step)  # rejoin_by: a killed peer's replacement is up first (not timed)
        batch = self._next_or_same_batch()
        self.faults.during_step(own_step)
        if self.faults.poisons(own_step):
            for learner in self.learners:
                learner.poison_next = True
        self.local_steps += 1
        if batch is not None and self.config.compute.simulated_compute_ms and not self.strategy.simulates_compute:
            time.sleep(self.config.compute.simulated_compute_ms / 1e3)
        result = self.strategy.step(batch)
        if not result.applied:
            self.local_steps -= 1  # redone: the same step of this rank again
            self.redo_batch = batch
            return result
        if self.records.memory is None:  # after the first step, when gradients and optimizer state exist
            self.records.memory = self.strategy.memory()
        self.step = result.step
        self.samples_seen += result.samples
        self.positions.update(result.positions)
        if self.sample_ids is not None and batch is not None:
            self.sample_ids.write(self.step, batch.ids)
        self.heartbeat.beat(self.step)
        if self.recovery is not None:
            event = self.recovery.first_step_done()
            self.records.say(self.recovery.resumed_notice(event))
            self.recovery = None
        return result

    def _evaluate_now(self) -> float:
        """``--eval-every``: held-out metrics now, for the records; the seconds it took."""
        start = now()
        model = self.strategy.evaluator()
        if model is not None:
            self.records.evaluated(self.step, self.evaluate(model))
        return now() - start

    def run(self) -> dict[str, Any]:
        """Train to the end, checkpoint, evaluate, and (rank 0) write the report."""
        config, keeps_records, records = self.config, self.strategy.keeps_records, self.records
        records.open(self.step)
        if self.recovery is not None:
            records.say(self.recovery.restart_notice(config.recovery.max_restarts))
        done = self.step >= self.total_steps
        try:
            while not done:
                result = self._train_step()
                done = result.done
                if not keeps_records or not result.applied:
                    continue
                records.add(result, self.step)
                if config.records.eval_every and self.step % config.records.eval_every == 0 and not done:
                    records.leave_out(self._evaluate_now())  # not training time: left out of the throughput
                if self.step % config.records.log_every == 0 or done:
                    records.log(self.step, self.positions[0].epoch, self.logged_step)
                    self.logged_step = self.step
                if done:
                    records.training_ended()
                if config.checkpoint.checkpoint_every and self.step % config.checkpoint.checkpoint_every == 0:
                    self._checkpoint(final=done)
        except BaseException:
            # The process is about to exit: a checkpoint still being written is worth finishing.
            self.checkpointer.finish_in_flight(min(30.0, config.recovery.collective_timeout_s))
            raise
        finally:
            if isinstance(self.loader, StreamLoader):
                self.loader.close()  # its worker processes
            records.close()
        if keeps_records and (not config.checkpoint.checkpoint_every or self.step % config.checkpoint.checkpoint_every):
            self._checkpoint(final=True)
        self.checkpointer.wait()
        self.heartbeat.close()
        report = self._finish() if keeps_records else {}
        self.strategy.close()
        return report

    # -- the end ------------------------------------------------------------------------------
    def _data_report(self) -> dict[str, Any]:
        report: dict[str, Any] = {"workers": self.data_workers, "threads": self.config.data.data_threads,
                                  "prefetch": self.config.data.data_prefetch,
                                  "cache": self.config.data.data_cache, "transform": self.task.transform is not None,
                                  "source": "memory"}
        if isinstance(self.train_data, MapData):
            report["bad_samples"] = bad_samples(self.run_dir)
            report.update(source="dataset", dataset=type(self.train_data.dataset).__name__,
                          per_epoch=self.train_data.per_epoch,
                          collate=type(self.task.collate).__name__ if self.task.collate else "stack")
        if isinstance(self.train_data, ParquetData):
            report.update(source="parquet", files=len(self.train_data.files),
                          row_groups=len(self.train_data.groups), rows=len(self.train_data))
        cache = getattr(getattr(self.loader, "samples", None), "cache", None)
        if cache is not None:
            report["cache_mb"] = round(cache.size_mb, 3)
        return report

    def _eval_data(self) -> TensorData | MapData:
        """The held-out split as the model sees it: transformed as the training samples are (once)."""
        if self.eval_data is None:
            data = self.task.eval_data().to(self.dtype)
            if self.task.transform is not None and isinstance(data, TensorData):
                data = TensorData(torch.stack([self.task.transform(x) for x in data.inputs]), data.targets)
            self.eval_data = data
        return self.eval_data

    def evaluate(self, model: torch.nn.Module) -> dict[str, float]:
        """Held-out metrics, in batches of ``EVAL_BATCH``. In-memory data: the task's metrics of all the
        outputs at once. A Dataset's batches are collated as in training (padded per batch, so outputs of
        two batches may not concatenate): the row-weighted mean of each batch's metrics (exact for means,
        such as accuracy and loss; the same when the held-out split fits in one batch)."""
        data = self._eval_data()
        device = next(model.parameters()).device  # a split model is assembled on the CPU
        model.eval()
        with torch.no_grad():
            parts = [(to_cpu(call_model(model, to_device(inputs, device))), targets)
                     for inputs, targets in _eval_batches(data)]
        model.train()
        if isinstance(data, TensorData) or len(parts) == 1:
            return self.task.metrics_fn(concat([out for out, _ in parts]), concat([t for _, t in parts]))
        total, sums = 0, {}
        for output, targets in parts:
            n = rows(targets)
            for key, value in self.task.metrics_fn(output, targets).items():
                sums[key] = sums.get(key, 0.0) + value * n
            total += n
        return {key: value / total for key, value in sums.items()}

    def _finish(self) -> dict[str, Any]:
        """The report's shared rows (collectives among record keepers), then on the rank that holds the
        final model: its weights, its held-out metrics and ``report.json``."""
        per_rank, memory = self.records.share_final(reads_data=self.shard is not None)
        with host_memory():  # the trained model, whole on rank 0's CPU, is no longer training state
            model = self.strategy.full_model()
            if model is None:
                return {}
            self.run_dir.write_final_model(model, metadata={"task": self.config.task, "step": str(self.step)})
            held_out = self.evaluate(model)
        return self.records.write_report(per_rank, memory, TrainerFacts(
            steps=self.step,
            samples_seen=self.samples_seen,
            eval=held_out,
            checkpoint={
                "async": self.config.checkpoint.async_checkpoint,
                "saves_during_training": len(self.checkpoint_stalls_ms),
                "stall_ms_p50": median(self.checkpoint_stalls_ms),
                "stall_ms_max": max(self.checkpoint_stalls_ms, default=0.0),
                "write_ms_p50": median(self.checkpointer.write_ms),
            },
            data=self._data_report(),
            features=self.task.info.get("features"),
            resumed_from_step=self.resumed_from,
            resumed_from_world_size=self.resumed_world_size,
            epochs=self.samples_seen / len(self.train_data),
            mixed_precision=self.learners[0].precision_report() if self.learners else None,
            data_fingerprint=data_fingerprint(self.task.train, self.task.eval),
        ))
