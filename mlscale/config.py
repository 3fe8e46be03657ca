"""The typed run configuration: one model for file values and CLI overrides, validated once.

A configuration is built from (in increasing priority) the defaults below, a TOML/JSON file and CLI
overrides. Any bad value raises ``UsageError`` with one line that names the key and the value, so the
CLI can exit 2 without a traceback.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from mlscale.errors import UsageError, describe_validation_error

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class TrainConfig(BaseModel):
    """Everything that determines a training run; written to ``RUN_DIR/config.json``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    task: str = Field("digits", description="built-in task name or 'package.module:factory'")
    task_options: dict[str, Any] = Field(default_factory=dict)
    workers: int = Field(1, ge=1, description="worker processes on this machine")
    strategy: str = "ddp"
    sync: Literal["bsp", "ssp", "async"] = Field(
        "bsp", description="parameter server consistency: bulk synchronous, stale synchronous or asynchronous")
    staleness: int = Field(3, ge=0, description="ssp: how many steps a worker may run ahead of the slowest")
    ps_servers: int = Field(1, ge=1, description="parameter server processes (parameters sharded by size)")
    backup_workers: int = Field(0, ge=0, description="bsp: apply the first workers-b gradients of a step")
    stages: int = Field(2, ge=1, description="pipeline: stages the model is split into")
    microbatches: int = Field(4, ge=1, description="pipeline: microbatches each batch is cut into")
    schedule: Literal["gpipe", "1f1b"] = Field("1f1b", description="pipeline: the order of forwards and backwards")
    memory_limit_mb: float | None = Field(None, gt=0, description="cap on each process's memory for training state")
    steps: int | None = Field(None, ge=1)
    epochs: float | None = Field(None, gt=0)
    batch_size: int = Field(32, ge=1, description="samples per data-parallel replica per micro-step")
    grad_accum: int = Field(1, ge=1, description="micro-steps per optimizer step, synchronised once")
    compile: bool = Field(False, description="torch.compile the model's forward (ddp)")
    clip_grad_norm: float | None = Field(None, gt=0, description="clip the gradients' global L2 norm to this")
    eval_every: int = Field(0, ge=0, description="held-out metrics every N steps (0: at the end only)")
    compress: Literal["none", "fp16", "bf16", "powersgd"] = Field(
        "none", description="ddp: gradient compression of the all-reduce (a DDP communication hook)")
    bucket_mb: float = Field(25.0, gt=0, description="ddp: gradient bucket size in MB (DDP's bucket_cap_mb)")
    lr: float = Field(0.05, gt=0)
    optimizer: Literal["sgd", "adam"] = "sgd"
    momentum: float = Field(0.9, ge=0, lt=1)
    weight_decay: float = Field(0.0, ge=0)
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    warmup_steps: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, lt=2**32, description="seeds the weights, the data order and every random draw")
    dtype: Literal["float32", "float64"] = "float32"
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    run_dir: str | None = Field(None, description="default: runs/<time>-<task>")
    resume: bool = False
    checkpoint_every: int = Field(0, ge=0, description="0: only at the end")
    keep_checkpoints: int = Field(3, ge=1)
    async_checkpoint: bool = Field(True, description="write checkpoints on a background thread")
    max_restarts: int = Field(0, ge=0)
    fault_tolerance: Literal["restart", "per-step"] = Field(
        "restart", description="restart: a failure restarts every worker from the newest checkpoint; per-step: "
        "each worker is a torchft replica group, the healthy ones go on and a replacement recovers from a peer")
    lighthouse: str | None = Field(None, description="per-step: the torchft lighthouse's address (default: "
                                   "mlscale starts one for the job on this machine)")
    min_replicas: int = Field(1, ge=1, description="per-step: the fewest replica groups that may commit a step")
    group_size: int = Field(1, ge=1, description="per-step: processes per replica group (fsdp shards the model "
                            "over them: HSDP); --workers counts the groups")
    heartbeat_timeout_ms: int = Field(1000, ge=50, description="per-step: how long the lighthouse mlscale starts "
                                      "waits for a silent replica before leaving it out of the quorum")
    faults: list[str] = Field(default_factory=list)
    data_workers: int | Literal["auto"] = Field(0, description="input pipeline worker processes (auto: measured)")
    data_prefetch: int = Field(2, ge=1, description="batches each data worker prepares ahead")
    data_cache: Literal["none", "memory", "disk"] = Field(
        "none", description="keep samples as the epochs make them: in shared memory, or on disk in the run directory")
    log_every: int = Field(10, ge=1)
    log: list[Literal["tensorboard"]] = Field(default_factory=list,
                                              description="also write metrics as TensorBoard event files")
    progress: bool = Field(True, description="rank 0 shows a progress bar or periodic lines")
    collective_timeout_s: float = Field(300.0, gt=0)
    warmup_steps_for_throughput: int = Field(5, ge=0)
    straggler_threshold: float = Field(1.5, gt=1, description="flag a rank this many times slower than the fastest")
    simulated_compute_ms: float = Field(0.0, ge=0, description="benchmarks: a fixed extra compute time per step")

    @field_validator("faults")
    @classmethod
    def _faults_parse(cls, specs: list[str]) -> list[str]:
        from mlscale.train.faults import parse_fault

        for spec in specs:
            parse_fault(spec)
        return specs

    @property
    def step_batch(self) -> int:
        """Samples per data-parallel replica per optimizer step: ``batch_size x grad_accum``."""
        return self.batch_size * self.grad_accum

    @field_validator("data_cache", mode="before")
    @classmethod
    def _cache_from_flag(cls, value: Any) -> Any:
        if isinstance(value, bool):  # run directories of earlier versions saved a flag
            return "memory" if value else "none"
        return value

    @field_validator("data_workers")
    @classmethod
    def _workers_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError("must be 0 or more, or 'auto'")
        return value

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either steps or epochs, not both")
        return self

    @model_validator(mode="after")
    def _per_step_options(self) -> TrainConfig:
        options = ("lighthouse", "min_replicas", "heartbeat_timeout_ms", "group_size")  # saved with their defaults
        given = [name for name in options if getattr(self, name) != type(self).model_fields[name].default]
        if given and not self.per_step:
            raise ValueError(f"{given[0].replace('_', '-')} is an option of per-step fault tolerance: add "
                             "--fault-tolerance per-step")
        if self.lighthouse and "heartbeat_timeout_ms" in given:
            raise ValueError("heartbeat-timeout-ms sets the lighthouse mlscale starts; with --lighthouse, give it to "
                             "that lighthouse (torchft_lighthouse --heartbeat_timeout_ms)")
        return self

    @property
    def per_step(self) -> bool:
        """Per-step fault tolerance: every worker is a replica group of its own."""
        return self.fault_tolerance == "per-step"

    @property
    def replica_groups(self) -> int:
        """Replica groups of the job: ``workers`` under per-step fault tolerance, else the one job."""
        return self.workers if self.per_step else 1


_CLI_NAMES = {"task_options": "task-opt", "faults": "fault", "collective_timeout_s": "collective-timeout"}


def describe_error(error: ValidationError) -> str:
    """One line for a bad configuration, in the flags' spelling."""
    return describe_validation_error(error, _CLI_NAMES)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or JSON file into a dict, turning every read problem into a ``UsageError``."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise UsageError(f"cannot read config file {str(path)!r}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"config file {str(path)!r} is not valid {path.suffix[1:] or 'TOML'}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"config file {str(path)!r} must hold a table of keys")
    return data


def build_config(file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Defaults < file < overrides (``None`` overrides are ignored); validated, else ``UsageError``."""
    values: dict[str, Any] = read_config_file(file) if file else {}
    values.update({key: value for key, value in overrides.items() if value is not None})
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        raise UsageError(describe_error(exc)) from None
