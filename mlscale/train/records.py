"""What a run records: the records component the training loop calls.

On the record-keeping ranks (``Strategy.keeps_records``) ``Records`` keeps what happened since the last
metrics line and, every ``--log-every`` steps, shares it among them (loss, step times, each step's own work),
flags stragglers, and (the rank that writes records) appends a line to ``metrics.jsonl``, writes TensorBoard
scalars (``--log tensorboard``) and updates the progress bar or lines on the console. It measures the
throughput after the warm-up steps and the memory of the training state, and at the end assembles
``report.json`` from its own records and what the trainer tells it (``TrainerFacts``).

Each record the ranks share is a typed value that packs itself into floats for the collective
(``Strategy.share``) and is read back from them: ``to_floats`` / ``from_floats`` are the one place that
knows the positions.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlscale.config import TrainConfig
from mlscale.errors import MlscaleError
from mlscale.lineage import code_version
from mlscale.rundir import RunDir
from mlscale.train.dist import JOB_START_ENV, DistEnv
from mlscale.train.memory import MEMORY_KEYS, peak_memory_mb
from mlscale.train.plan import JobPlan
from mlscale.train.progress import Progress
from mlscale.train.recovery import recovery_summary
from mlscale.train.stragglers import StragglerDetector
from mlscale.train.strategy import StepResult, StepRow, Strategy
from mlscale.train.timing import StepTimes, now

NAN = float("nan")
NO_PROGRESS_ENV = "MLSCALE_NO_PROGRESS"  # set by a launcher that shows the job's progress itself


@dataclass(frozen=True)
class RankWindow:
    """One rank's steps since the previous metrics line: its loss (the mean and the last; ``None`` where it
    computed none, a pipeline stage before the last), the medians of its step times, and each step's own
    work (for straggler detection)."""

    rank: int
    loss_mean: float | None
    loss_last: float | None
    times: StepTimes
    own_ms: tuple[float, ...] = ()

    @classmethod
    def of(cls, rank: int, rows: Sequence[StepRow]) -> RankWindow:
        """The window of ``rank``'s ``rows``: losses left on the device come to the host here, together."""
        seen = [row.loss for row in rows if row.loss is not None]
        loss_mean = loss_last = None
        if seen:
            losses = torch.stack([torch.as_tensor(loss, dtype=torch.float64) for loss in seen])
            loss_mean, loss_last = torch.stack([losses.mean(), losses[-1]]).tolist()
        return cls(rank, loss_mean, loss_last, StepTimes.medians([row.times for row in rows]),
                   tuple(row.times.own_ms for row in rows))

    def to_floats(self) -> list[float]:
        seen = self.loss_mean is not None
        return [float(self.rank), float(seen), self.loss_mean if seen else NAN, self.loss_last if seen else NAN,
                *self.times.to_floats(), *self.own_ms]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankWindow:
        seen, times_end = bool(values[1]), 4 + StepTimes.WIDTH
        return cls(int(values[0]), values[2] if seen else None, values[3] if seen else None,
                   StepTimes.from_floats(values[4:times_end]), tuple(values[times_end:]))


@dataclass(frozen=True)
class RankTimings:
    """One rank's median step times over the measured steps (after warm-up), for ``report.json``."""

    rank: int
    medians: StepTimes

    def to_floats(self) -> list[float]:
        return [float(self.rank), *self.medians.to_floats()]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankTimings:
        return cls(int(values[0]), StepTimes.from_floats(values[1:]))


@dataclass(frozen=True)
class RankMemory:
    """One rank's training state in MB (``MEMORY_KEYS``, those it measured) and its process's peak."""

    rank: int
    state: dict[str, float] = field(default_factory=dict)
    peak_mb: float = NAN

    def to_floats(self) -> list[float]:
        return [float(self.rank), *(self.state.get(key, NAN) for key in MEMORY_KEYS), self.peak_mb]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> RankMemory:
        state = {key: value for key, value in zip(MEMORY_KEYS, values[1:]) if not math.isnan(value)}
        return cls(int(values[0]), state, values[1 + len(MEMORY_KEYS)])

    def as_report(self) -> dict[str, float]:
        peak = {} if math.isnan(self.peak_mb) else {"peak_mb": self.peak_mb}
        return {"rank": self.rank, **self.state, **peak}


class TensorBoardLog:
    """``--log tensorboard``: the metrics lines as TensorBoard scalars (torch.utils.tensorboard), in
    ``RUN_DIR/tensorboard`` beside ``metrics.jsonl``: train/loss, train/lr, train/samples_per_s, the
    per-rank step timings (time/<rank>/<key>) and eval/<metric>."""

    def __init__(self, directory: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise MlscaleError("--log tensorboard needs the tensorboard package: pip install "
                               "'mlscale[tensorboard]'") from None
        self.writer = SummaryWriter(log_dir=str(directory))

    def write(self, step: int, loss: float, lr: float, samples_per_s: float, shared: list[RankWindow],
              evaluated: list[dict[str, float]]) -> None:
        self.writer.add_scalar("train/loss", loss, step)
        self.writer.add_scalar("train/lr", lr, step)
        self.writer.add_scalar("train/samples_per_s", samples_per_s, step)
        for window in shared:
            for key, value in window.times.as_dict().items():
                self.writer.add_scalar(f"time/rank{window.rank}/{key}", value, step)
        for metrics in evaluated:
            for key, value in metrics.items():
                if key != "step":
                    self.writer.add_scalar(f"eval/{key}", value, int(metrics["step"]))

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Window:
    """What happened since the last log line."""

    start: float = field(default_factory=now)
    rows: list[StepRow] = field(default_factory=list)
    samples: int = 0


INPUT_BOUND_SHARE = 0.10  # data wait past this share of a step: the input pipeline, not the model, sets the pace


def input_bound(per_rank: Sequence[dict[str, float]], config: TrainConfig, suffix: str = "_p50",
                cacheable: bool = True) -> dict[str, Any]:
    """Whether the run waits on its input: the largest share of a step a data rank spent waiting for its
    batch, the rank, and what to try (the options this run did not use yet; ``cacheable``: its samples are
    the same every epoch, so a cache can keep them)."""
    shares = {int(row["rank"]): row[f"data_wait_ms{suffix}"] / row[f"step_ms{suffix}"]
              for row in per_rank if row.get(f"step_ms{suffix}")}
    if not shares:
        return {"bound": False, "data_wait_share": 0.0}
    rank = max(shares, key=lambda r: shares[r])
    verdict: dict[str, Any] = {"bound": shares[rank] > INPUT_BOUND_SHARE, "data_wait_share": round(shares[rank], 4),
                               "rank": rank}
    if verdict["bound"]:
        verdict["advice"] = input_advice(config, cacheable)
    return verdict


def input_advice(config: TrainConfig, cacheable: bool = True) -> str:
    data = config.data
    if data.data_workers == 0:
        return "load in parallel: --data-workers auto"
    if data.data_cache == "none" and cacheable:
        return ("keep what is decoded: --data-cache memory|disk (deterministic samples), or give the data workers "
                "more cores")
    return "give the data workers more cores (fewer training processes per host), or make samples cheaper to read"


def by_rank(rows: list[StepRow]) -> dict[int, list[StepRow]]:
    grouped: dict[int, list[StepRow]] = {}
    for row in rows:
        grouped.setdefault(row.rank, []).append(row)
    return grouped


@dataclass(frozen=True)
class TrainerFacts:
    """What only the trainer knows at the end, for ``report.json``."""

    steps: int
    samples_seen: int
    eval: dict[str, float]
    checkpoint: dict[str, Any]
    data: dict[str, Any]
    features: Any  # trained on a feature service: its list and statistics
    resumed_from_step: int | None
    resumed_from_world_size: int | None
    epochs: float
    mixed_precision: dict[str, Any] | None
    data_fingerprint: str


class Records:
    """The records of one process; the trainer calls ``open`` before its loop, ``add`` after each applied
    step (record keepers only), ``log`` every ``--log-every`` steps, ``close`` after the loop, then
    ``share_final`` and ``write_report``."""

    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: RunDir, strategy: Strategy,
                 plan: JobPlan) -> None:
        self.config, self.env, self.run_dir, self.strategy, self.plan = config, env, run_dir, strategy, plan
        assert plan.total_steps is not None, "a worker's plan has the job's length"
        self.total_steps = plan.total_steps
        self.stragglers = StragglerDetector(threshold=config.records.straggler_threshold)
        self.memory: dict[str, float] | None = None  # this rank's training state, measured after its first step
        self.pending_eval: list[dict[str, float]] = []  # --eval-every: for the next metrics line
        self.tensorboard: TensorBoardLog | None = None
        self.progress: Progress | None = None
        self.final_loss = NAN  # the mean over ranks of each one's last loss, at the latest metrics line
        self.loop_start = now()
        self.window = _Window()
        # Throughput and timing medians leave out the first steps (warm-up), unless that is all.
        self.warm, self.start_step = 0, 0
        self.measure_from: tuple[float, int] | None = None  # (when, step) the measured steps began
        self.measure_end: float | None = None  # when training ended (its last metrics line written)
        self.measured: dict[int, list[StepTimes]] = {}  # rank -> step times (floats only: no device tensors)
        self.measured_samples = 0

    # -- the loop ---------------------------------------------------------------------------------
    def open(self, step: int) -> None:
        """The loop begins at ``step``: TensorBoard and the console's progress open (the job's first
        process), and the warm-up steps count from here."""
        config = self.config
        self.loop_start = now()
        if "tensorboard" in config.records.log and self.env.member == 0:
            self.tensorboard = TensorBoardLog(self.run_dir.tensorboard)
        if self.env.member == 0 and config.records.progress and not os.environ.get(NO_PROGRESS_ENV):
            self.progress = Progress(self.total_steps, step)
        self.warm = min(config.records.warmup_steps_for_throughput, max(0, self.total_steps - step - 1))
        self.start_step = step
        self.measure_from = (now(), step) if self.warm == 0 else None
        self.window = _Window()

    def add(self, result: StepResult, step: int) -> None:
        """An applied step, on a record keeper: its rows and samples, for the next metrics line and (after
        the warm-up) the throughput and timing medians of the report."""
        self.window.rows.extend(result.rows)
        self.window.samples += result.samples
        if self.measure_from is not None:
            for row in result.rows:
                self.measured.setdefault(row.rank, []).append(row.times)
            self.measured_samples += result.samples
        elif step - self.start_step >= self.warm:
            self.measure_from = (now(), step)

    def leave_out(self, seconds: float) -> None:
        """Time that was not training (an evaluation): left out of the throughput."""
        self.window.start += seconds
        if self.measure_from is not None:
            self.measure_from = (self.measure_from[0] + seconds, self.measure_from[1])

    def evaluated(self, step: int, metrics: dict[str, float]) -> None:
        """``--eval-every``'s held-out metrics at ``step``: on the console now, in the next metrics line."""
        if self.strategy.writes_records:
            self.pending_eval.append({"step": step, **metrics})
            self.say(f"eval at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    def say(self, text: str) -> None:
        """A console line from rank 0 (above the progress bar when there is one)."""
        if self.progress is not None:
            self.progress.note(text)
        elif self.strategy.writes_records:
            print(text, file=sys.stderr, flush=True)

    def log(self, step: int, epoch: int, since: int) -> None:
        """The steps after ``since``, up to ``step``: loss and timings shared among record keepers (a
        collective), stragglers flagged, and a metrics line from the rank that writes records."""
        window, self.window = self.window, _Window()
        summaries = [RankWindow.of(rank, rows) for rank, rows in sorted(by_rank(window.rows).items())]
        shared = self.strategy.share(RankWindow, summaries)
        if not shared:
            self.final_loss = NAN
            return
        flagged = self.stragglers.observe(step, {r.rank: r.own_ms for r in shared})
        # By role (a rank may see no loss: early pipeline stages), so that a diverged (NaN) loss still shows.
        with_loss = [r for r in shared if r.loss_mean is not None and r.loss_last is not None]
        loss = sum(r.loss_mean for r in with_loss) / len(with_loss) if with_loss else math.nan
        if self.strategy.writes_records:
            samples_per_s = window.samples / (now() - window.start)
            evaluated, self.pending_eval = self.pending_eval, []
            self.run_dir.append_metrics({
                "step": step,
                "epoch": epoch,
                "loss": loss,
                "lr": self.strategy.lr(),
                "samples_per_s": samples_per_s,
                "time": time.time(),
                "elapsed_s": now() - self.loop_start,
                "per_rank": [{"rank": r.rank, **r.times.as_dict(),
                              "straggler_score": round(self.stragglers.scores.get(r.rank, 1.0), 3)}
                             for r in shared],
                "stragglers": flagged,
                **self.strategy.log_fields(step, since),
                **({"eval": evaluated} if evaluated else {}),
            })
            if self.tensorboard is not None:
                self.tensorboard.write(step, loss, self.strategy.lr(), samples_per_s, shared, evaluated)
        if self.progress is not None:
            waiting = input_bound([{"rank": r.rank, **r.times.as_dict()} for r in shared], self.config, suffix="")
            notes = [self.stragglers.describe_now()] + \
                [f"input-bound: data wait {waiting['data_wait_share']:.0%} of the step"] * waiting["bound"]
            self.progress.update(step, loss, window.samples / (now() - window.start), "  ".join(n for n in notes if n))
        self.final_loss = sum(r.loss_last for r in with_loss) / len(with_loss) if with_loss else math.nan

    def training_ended(self) -> None:
        """The last step is trained and recorded: what follows (the final checkpoint, the report's
        collectives, gathering the model, evaluating it) is no training time, left out of the throughput."""
        self.measure_end = now()

    def close(self) -> None:
        """The loop has ended (or failed): the progress bar and TensorBoard's files are closed."""
        if self.progress is not None:
            self.progress.close()
        if self.tensorboard is not None:
            self.tensorboard.close()

    # -- the end ----------------------------------------------------------------------------------
    def share_final(self, reads_data: bool) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
        """Every record keeper's median step times and memory, for the report (collectives among them);
        ``reads_data``: this rank reads data (and has step times to report even if none were measured)."""
        if self.measure_end is None:  # (a loop that ended without its last step)
            self.measure_end = now()
        own = [RankTimings(rank, StepTimes.medians(self.measured[rank])) for rank in sorted(self.measured)] \
            or ([RankTimings(self.env.rank, StepTimes())] if reads_data else [])
        per_rank = [{"rank": r.rank, **r.medians.as_dict("_p50")} for r in self.strategy.share(RankTimings, own)]
        memory = RankMemory(self.env.rank, dict(self.memory or {}), peak_memory_mb(self.env.device))
        memories = [row.as_report() for row in self.strategy.share(RankMemory, [memory]) if "state_mb" in row.state]
        return per_rank, memories

    def samples_per_s(self) -> float:
        """Samples a second over the measured steps (after the warm-up)."""
        start, end, samples = self.measure_from, self.measure_end, self.measured_samples
        return samples / (end - start[0]) if start and end is not None and samples else 0.0

    def write_report(self, per_rank: list[dict[str, float]], memory: list[dict[str, float]],
                     trainer: TrainerFacts) -> dict[str, Any]:
        """``report.json`` (the rank that holds the final model), written atomically; returned."""
        config, env = self.config, self.env
        job_start = float(os.environ.get(JOB_START_ENV, time.time()))
        strategy_report = self.strategy.report()
        report = {
            "status": "completed",
            "task": config.task,
            "strategy": config.strategy,
            "world_size": self.plan.processes,
            "workers": self.plan.data_shards,
            "steps": trainer.steps,
            "samples_seen": trainer.samples_seen,
            "samples_per_s": self.samples_per_s(),
            "final_loss": self.final_loss,
            "eval": trainer.eval,
            "restarts": env.attempt,
            "recovery": {**recovery_summary(self.run_dir), **strategy_report.pop("recovery", {})},
            "checkpoint": trainer.checkpoint,
            "per_rank": per_rank,
            "data": {**trainer.data, "input_bound": input_bound(per_rank, config,
                                                                cacheable=not trainer.data.get("per_epoch"))},
            "features": trainer.features,
            "memory": memory,
            "stragglers": sorted(self.stragglers.first_flagged),
            "straggler_detection": self.stragglers.summary(),
            **strategy_report,
            "wall_s": time.time() - job_start,
            "model_uri": None,
            "run_dir": str(self.run_dir.path),
            "resumed_from_step": trainer.resumed_from_step,
            "resumed_from_world_size": trainer.resumed_from_world_size,
            "epochs": trainer.epochs,
            "dtype": config.compute.dtype,
            "precision": config.compute.precision,
            "mixed_precision": trainer.mixed_precision,
            "device": str(env.device),
            "torch": torch.__version__,
            "data_fingerprint": trainer.data_fingerprint,
            "code_version": code_version(),
        }
        self.run_dir.write_report(report)
        return report
