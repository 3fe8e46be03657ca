"""The typed run configuration: every training option declared once, grouped by the part that owns it.

A configuration is built from (in increasing priority) the defaults below, a TOML/JSON file and CLI
overrides. ``mlscale train``'s flags, their help and defaults are generated from these models
(``mlscale.cli.train``): one name from the file to the flag (``stages`` is ``--stages`` and
``[pipeline] stages``). A file may use the nested form (``[pipeline] stages = 4``) or the flat one
(``stages = 4``, what earlier versions wrote to ``config.json``). An option that belongs to another
strategy or fault-tolerance mode than the job's is refused, from its declaration (``only``), with one
line naming both. Any bad value raises ``UsageError`` naming the key and the value, so the CLI exits 2.

This module imports nothing from the parts above it: a registry read of a run's configuration imports
no trainer.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    ValidationError,
    field_validator,
    model_validator,
)

from mlscale.errors import UsageError, describe_validation_error
from mlscale.faultspec import Fault, parse_fault

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# --strategy's names and their help (torch-free, for --help); mlscale.train.strategies.STRATEGIES maps the
# same names, in the same order, to their classes (a test holds them equal)
STRATEGY_HELP = {
    "ddp": "full replicas, gradients all-reduced",
    "fsdp": "parameters, gradients and optimizer state sharded over the workers",
    "tp": "tensor-parallel transformer blocks",
    "pipeline": "the model's blocks split into stages",
    "ps": "parameter server",
}
ONLY_DDP = {"strategy": ("ddp",), "fault_tolerance": ("restart",)}


def option(default: Any = None, help: str = "", *, metavar: str | None = None, flag: str | None = None,
           only: dict[str, tuple[str, ...]] | None = None, why: str | None = None, **constraints: Any) -> Any:
    """A declared option: its default, its help (the flag's, without the default: that is added), and
    for the command line its ``metavar`` and ``flag`` (default ``--field-name``). ``only``: the values
    of other options it applies under (``{"strategy": ("ddp",)}``); given under others, it is refused, with
    ``why`` when the reason helps the user on."""
    extra = {key: value for key, value in (("metavar", metavar), ("flag", flag), ("only", only), ("why", why))
             if value}
    if callable(default):
        return Field(default_factory=default, description=help, json_schema_extra=extra, **constraints)
    return Field(default, description=help, json_schema_extra=extra, **constraints)


class Options(BaseModel):
    """A group of options. ``only``: what every option of the group applies under; ``title``: the
    group's heading in ``mlscale train --help``."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
    title: ClassVar[str] = ""
    only: ClassVar[dict[str, tuple[str, ...]]] = {}
    why: ClassVar[str] = ""  # added to a refusal of one of the group's options


class OptimOptions(Options):
    title = "optimizer"

    lr: float = option(0.05, "peak learning rate", gt=0)
    optimizer: Literal["sgd", "adam"] = option("sgd", "the update rule")
    momentum: float = option(0.9, "sgd: momentum", ge=0, lt=1)
    weight_decay: float = option(0.0, "L2 penalty on the weights (sgd) or decoupled decay (adam)", ge=0)
    lr_schedule: Literal["constant", "cosine"] = option("cosine", "the learning rate over the steps after warm-up")
    warmup_steps: int = option(0, "steps of linear warm-up to --lr", ge=0, metavar="K")
    clip_grad_norm: float | None = option(
        None, "clip the gradients' global L2 norm to X before each update (after unscaling under fp16)", gt=0,
        metavar="X", only={"strategy": ("ddp", "fsdp")},
        why="the others hold the gradients on several ranks without their global norm")
    optimizer_in_backward: bool = option(
        False, "fsdp: update each parameter's shard inside the backward pass, as soon as its gradient is reduced, "
        "and free that gradient at once: a block's gradients at a time instead of the whole model's (FSDP2's "
        "post-accumulate-grad hooks, torchtune's optimizer-in-backward). The same update as after the backward "
        "pass; not with --clip-grad-norm (it needs every gradient first), --grad-accum or fp16",
        only={"strategy": ("fsdp",)},
        why="ddp all-reduces the gradients after their hooks, tp and pipeline are not built for it")


class DataOptions(Options):
    title = "input pipeline"

    data_workers: int | Literal["auto"] = option(
        0, "DataLoader worker processes that load (and transform) batches ahead of training (0: in the training "
        "process); auto: measures 0, 1, 2, 4... and says what it picked. The batches and the resume position are "
        "the same with any number", metavar="N|auto")
    data_prefetch: int = option(2, "batches each data worker prepares ahead", ge=1, metavar="B")
    data_threads: int = option(
        0, "read a Dataset's items in T threads of the training process instead of worker processes: faster where "
        "__getitem__ releases the GIL (Pillow decoding, file reads, Rust tokenizers), no gain for pure-Python code; "
        "not with --data-workers", ge=0, metavar="T")
    data_cache: Literal["none", "memory", "disk"] = option(
        "none", "keep samples as the epochs make them (transformed; for Parquet data also decoded), so that later "
        "epochs skip that work: memory (shared memory; what the flag alone means) or disk (files in "
        "RUN_DIR/data-cache, for data larger than memory, found again by a resumed run)")

    data_cache_mb: int = option(
        0, "keep local copies of the objects a Dataset reads from object storage (s3://...), at most this many MB, "
        "in RUN_DIR/data-cache/objects (shared by a host's ranks, least recently used first out): later epochs "
        "read them instead; 0: read every time", ge=0, metavar="MB")
    bad_samples: Literal["stop", "skip"] = option(
        "stop", "a sample of a Dataset that cannot be read or decoded (a corrupt image, a file gone): stop: exit 1 "
        "naming it, the rank and the error (the last checkpoint kept); skip: train its batch without it and list it "
        "in report.json data.bad_samples and RUN_DIR/bad_samples/")

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


class ComputeOptions(Options):
    title = "numerics and device"

    dtype: Literal["float32", "float64"] = option("float32", "dtype of the weights and the data")
    precision: Literal["fp32", "bf16", "fp16"] = option(
        "fp32", "autocast for compute, the weights stay fp32 (master weights); fp16 adds a dynamic loss scaler")
    device: Literal["auto", "cpu", "cuda"] = option("auto", "auto: cuda if available")
    memory_limit_mb: float | None = option(
        None, "cap every process's memory for training (model, gradients, optimizer state, activations) at MB "
        "above what it holds when it starts; a process over it fails with a clear message. Shows what fits on "
        "one device and what needs fsdp or pipeline (fsdp and tp build the model on the meta device: see "
        "--weight-init); on a CPU, checkpoints are then written in place", gt=0, metavar="MB")
    simulated_compute_ms: float = option(
        0.0, "add MS of simulated compute to every step: benchmarks of the algorithms on few cores", ge=0,
        metavar="MS")


class CheckpointOptions(Options):
    title = "checkpoints"

    checkpoint_every: int = option(0, "checkpoint every K steps (0: only at the end)", ge=0, metavar="K")
    keep_checkpoints: int = option(3, "keep the newest K checkpoints", ge=1, metavar="K")
    async_checkpoint: bool = option(True, "write checkpoints on a background thread", flag="--no-async-checkpoint")


class RecoveryOptions(Options):
    title = "fault tolerance"

    fault_tolerance: Literal["restart", "per-step"] = option(
        "restart", "restart: a failed worker stops the job, every worker restarts from the newest checkpoint. "
        "per-step (ddp, or fsdp as HSDP; torchft): every worker is a replica group, the healthy ones go on without "
        "the failed one, and its replacement (--max-restarts per group) receives the current state from a live "
        "peer", only={"strategy": ("ddp", "fsdp")})
    max_restarts: int = option(
        0, "restart the worker group up to R times after a failure, resuming from the newest checkpoint "
        "(per-step: restart a failed replica group's worker up to R times)", ge=0, metavar="R")
    collective_timeout_s: float = option(
        300.0, "seconds a collective may wait for a peer before the job treats it as hung", gt=0, metavar="S",
        flag="--collective-timeout")
    faults: list[Annotated[Fault, BeforeValidator(parse_fault), PlainSerializer(str, return_type=str)]] = option(
        list, "inject a failure (repeatable): kill:rank=R:step=K (before step K), kill_in_step:rank=R:step=K (in "
        "the middle of it; per-step: add :rejoin_by=J and the others wait before step J, at most "
        "--collective-timeout, until R's replacement is up), hang:rank=R:step=K, slow:rank=R:delay_ms=D (add :p=P "
        "to be slow on a fraction P of steps; rank=any: a random worker each step), kill_during_checkpoint:step=K, "
        "inf_grad:rank=R:step=K (ddp, fsdp, tp)", metavar="SPEC", flag="--fault")

    @property
    def per_step(self) -> bool:
        return self.fault_tolerance == "per-step"


class TorchftOptions(Options):
    title = "per-step fault tolerance (--fault-tolerance per-step)"
    only = {"fault_tolerance": ("per-step",)}

    lighthouse: str | None = option(
        None, "the torchft lighthouse to join, e.g. http://host:29510 (across hosts: run torchft_lighthouse, one "
        "torchrun per host with its REPLICA_GROUP_ID); default: mlscale starts one for the job", metavar="ADDR")
    min_replicas: int = option(1, "the fewest replica groups that may commit a step", ge=1, metavar="N")
    group_size: int = option(
        1, "processes per replica group; with --strategy fsdp the model is sharded over each group's P processes "
        "and the groups replicate it (HSDP); --workers counts the groups", ge=1, metavar="P")
    heartbeat_timeout_ms: int = option(
        1000, "how long the lighthouse mlscale starts waits for a silent replica group before leaving it out of "
        "the quorum: shorter finds failures sooner, too short drops a busy one", ge=50, metavar="MS")


class DDPOptions(Options):
    title = "data parallel (--strategy ddp)"
    only = ONLY_DDP
    why = "a DDP communication hook or bucket size; other strategies and per-step fault tolerance do not all-reduce " \
        "through DDP"

    compress: Literal["none", "fp16", "bf16", "powersgd"] = option(
        "none", "gradient compression of the all-reduce (a DDP communication hook): fp16 or bf16 (gradients cast "
        "to 16 bits: half the bytes) or powersgd (rank-2 PowerSGD with error feedback after 10 plain steps); "
        "bytes sent are in report.json communication")
    bucket_mb: float = option(
        25.0, "gradient bucket size of the all-reduce (DDP's bucket_cap_mb): smaller buckets start communicating "
        "earlier, larger ones send fewer messages", gt=0, metavar="MB")
    compile: bool = option(
        False, "torch.compile the model (in place: weights and checkpoints unchanged); the first steps pay for "
        "compiling, report.json has the step times with and without that (`compile`)",
        why="built for ddp here; other strategies run their model uncompiled")


class PSOptions(Options):
    title = "parameter server (--strategy ps)"
    only = {"strategy": ("ps",)}

    sync: Literal["bsp", "ssp", "async"] = option(
        "bsp", "bsp: every step waits for all workers; ssp: bounded staleness; async: every gradient applied as it "
        "arrives")
    staleness: int = option(3, "ssp: no worker runs more than S steps ahead of the slowest", ge=0, metavar="S")
    ps_servers: int = option(
        1, "server processes holding the parameters, sharded by size; they come on top of --workers", ge=1,
        metavar="S")
    backup_workers: int = option(
        0, "bsp: a step applies the first workers-B gradients and drops the late ones", ge=0, metavar="B")


def _comma_separated(value: Any) -> Any:
    """``--split-points a,b`` (or the flag repeated, or a list in a file): the names, in order."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return value
    return [name.strip() for item in items for name in str(item).split(",") if name.strip()]


class PipelineOptions(Options):
    title = "pipeline (--strategy pipeline)"
    only = {"strategy": ("pipeline",)}

    stages: int = option(
        2, "stages the model is split into (torch.export traces it; any model it can export): at its repeated "
        "blocks, the largest ModuleList/ModuleDict/Sequential of modules of one type wherever it is "
        "(transformer.h, model.layers), balanced by parameter count; what runs before the blocks goes to the "
        "first stage, what runs after to the last. A weight tied across stages (an embedding shared with the "
        "output head) is held by each and kept in step (gradients summed). Refused in one line: a model torch "
        "cannot export (use fsdp), one with no repeated blocks and no --split-points. --workers must be a "
        "multiple: workers / P data-parallel replicas", ge=1, metavar="P")
    split_points: Annotated[list[str], BeforeValidator(_comma_separated)] = option(
        list, "split here instead: the P-1 modules where stages 1..P-1 begin, in the order the model runs "
        "them (e.g. transformer.h.2 for 2 stages)", metavar="FQN,...")
    microbatches: int = option(
        4, "microbatches each batch is cut into; must divide --batch-size. The idle share of each stage, the "
        "bubble, is (P-1)/(M+P-1)", ge=1, metavar="M")
    schedule: Literal["gpipe", "1f1b"] = option(
        "1f1b", "1f1b: one forward, one backward, holds at most P microbatches' activations; gpipe: all forwards, "
        "then all backwards")


class ModelOptions(Options):
    title = "the model: how it is built and split"

    tp: int = option(
        1, "fsdp: split every block over T ranks too (tensor parallelism inside FSDP2's sharding, a 2-D mesh of "
        "workers / T x T, as torchtitan does); --workers must be a multiple of T. The other combinations: "
        "pipeline x data parallel (--strategy pipeline --workers k x P) and HSDP (fsdp --fault-tolerance "
        "per-step); pipeline x tp and pipeline x fsdp are refused", ge=1, metavar="T",
        only={"strategy": ("fsdp",)})
    weight_init: Literal["auto", "full", "sharded"] = option(
        "auto", "fsdp and tp build the model on the meta device (no memory) and give each rank only what it "
        "holds. full: rank 0 builds the whole model with --seed and streams it out, tensor by tensor (the weights "
        "of one process, so every strategy starts from the same ones); sharded: each rank initialises its own "
        "part by the model's own init (init_weights, else each module's reset_parameters): for a model whose "
        "weights do not fit in one process. auto: full unless the weights exceed --memory-limit-mb",
        only={"strategy": ("fsdp", "tp")})
    offload: Literal["none", "cpu"] = option(
        "none", "fsdp on GPUs: cpu keeps the sharded parameters, gradients and optimizer state in host memory "
        "(FSDP2's CPUOffloadPolicy; the optimizer steps on the CPU), copying each block to the GPU just before "
        "it runs: GPU memory for the blocks in flight and the activations only, at the cost of the copies",
        only={"strategy": ("fsdp",)})
    activation_checkpointing: Literal["none", "full", "selective"] = option(
        "none", "recompute the blocks' activations in the backward pass instead of keeping them: full: every "
        "block; selective: every K-th block (--ac-every). Less activation memory for about one more forward",
        only={"strategy": ("ddp", "fsdp", "tp")})
    ac_every: int = option(2, "selective activation checkpointing: every K-th block", ge=1, metavar="K")


class RecordsOptions(Options):
    title = "records"

    log_every: int = option(10, "metrics line every K steps", ge=1, metavar="K")
    log: list[Literal["tensorboard"]] = option(
        list, "also write the metrics to SINK: tensorboard (event files in RUN_DIR/tensorboard; needs "
        "mlscale[tensorboard]; view with `tensorboard --logdir RUN_DIR`)", metavar="SINK",
        only={"fault_tolerance": ("restart",)})
    progress: bool = option(True, "a progress bar or periodic progress lines on rank 0 (failures and restarts are "
                            "reported either way)", flag="--no-progress")
    eval_every: int = option(
        0, "held-out metrics every N steps, on the console and in metrics.jsonl (`eval`); 0: at the end only", ge=0,
        metavar="N", only={"strategy": ("ddp", "fsdp", "tp")})
    log_sample_ids: bool = option(
        False, "write the data set indices each rank trains, one JSON line a step, to RUN_DIR/sample_ids/rankR.jsonl "
        '({"step", "attempt", "ids"}: a step redone after a restart or a resume appears again with a higher '
        "attempt, and the later one counts): proof that every sample of an epoch was trained once",
        only={"strategy": ("ddp", "fsdp", "tp", "pipeline"), "fault_tolerance": ("restart",)})
    warmup_steps_for_throughput: int = option(5, "steps left out of samples/s (warm-up)", ge=0, metavar="K")
    straggler_threshold: float = option(
        1.5, "flag a rank whose compute + data wait is X times the fastest rank's", gt=1, metavar="X")


# group field name -> its model, in the order of the help
GROUPS: dict[str, type[Options]] = {
    "optim": OptimOptions, "data": DataOptions, "compute": ComputeOptions, "checkpoint": CheckpointOptions,
    "recovery": RecoveryOptions, "torchft": TorchftOptions, "ddp": DDPOptions, "ps": PSOptions,
    "pipeline": PipelineOptions, "model": ModelOptions, "records": RecordsOptions,
}
GROUP_OF = {name: group for group, model in GROUPS.items() for name in model.model_fields}


class TrainConfig(BaseModel):
    """Everything that determines a training run; written to ``RUN_DIR/config.json`` (nested form)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    task: str = option("digits", "built-in task (digits, digits-cnn, synthetic, tinylm, parquet, features), a "
                       "factory declared with @mlscale.declare_task (package.module:factory) or an installed "
                       "mlscale.tasks entry point")
    task_options: dict[str, Any] = option(dict, "option passed to the task factory (repeatable), e.g. hidden=256",
                                          metavar="KEY=VALUE", flag="--task-opt")
    workers: int = option(
        1, "processes: data-parallel replicas under ddp and fsdp, ranks splitting one replica under tp, stages x "
        "replicas under pipeline, workers besides the servers under ps; replica groups under per-step",
        metavar="N", ge=1)
    strategy: str = option("ddp", "; ".join(f"{name}: {text}" for name, text in STRATEGY_HELP.items()))
    steps: int | None = option(None, "optimizer steps to run", metavar="K", ge=1)
    epochs: float | None = option(None, "passes over the training data (default when --steps is not given: 10)",
                                  metavar="E", gt=0)
    batch_size: int = option(32, "samples per data-parallel replica per micro-step: a pipeline or tp replica of "
                             "several processes still takes this many", metavar="B", ge=1)
    grad_accum: int = option(1, "gradient accumulation: K micro-steps of --batch-size samples per optimizer step, "
                             "gradients synchronised once, on the last; trains like --batch-size x K", ge=1,
                             metavar="K", only={"strategy": ("ddp", "fsdp", "tp")},
                             why="a pipeline accumulates over its --microbatches already, parameter server "
                             "workers push every gradient: raise --microbatches or --batch-size instead")
    seed: int = option(0, "seeds the weights, the data order and every random draw", metavar="S", ge=0, lt=2**32)
    run_dir: str | None = option(None, "where config, metrics, checkpoints and report go (default: "
                                 "runs/<time>-<task>)", metavar="DIR")
    resume: bool = option(False, "continue from the latest checkpoint of --run-dir")

    optim: OptimOptions = Field(default_factory=OptimOptions)
    data: DataOptions = Field(default_factory=DataOptions)
    compute: ComputeOptions = Field(default_factory=ComputeOptions)
    checkpoint: CheckpointOptions = Field(default_factory=CheckpointOptions)
    recovery: RecoveryOptions = Field(default_factory=RecoveryOptions)
    torchft: TorchftOptions = Field(default_factory=TorchftOptions)
    ddp: DDPOptions = Field(default_factory=DDPOptions)
    ps: PSOptions = Field(default_factory=PSOptions)
    pipeline: PipelineOptions = Field(default_factory=PipelineOptions)
    model: ModelOptions = Field(default_factory=ModelOptions)
    records: RecordsOptions = Field(default_factory=RecordsOptions)

    @model_validator(mode="before")
    @classmethod
    def _nest_flat_keys(cls, values: Any) -> Any:
        return nest(values) if isinstance(values, dict) else values

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, name: str) -> str:
        if name not in STRATEGY_HELP:
            raise ValueError(f"unknown strategy (known: {', '.join(STRATEGY_HELP)})")
        return name

    @model_validator(mode="after")
    def _one_length(self) -> TrainConfig:
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give either steps or epochs, not both")
        return self

    @model_validator(mode="after")
    def _options_apply(self) -> TrainConfig:
        """Refuse an option given (not at its default) under a strategy or mode it does not apply to."""
        for name, value, default, only, why in self._declared():
            if value == default:
                continue
            for key, allowed in only.items():
                actual = self.value_of(key)
                if actual not in allowed:
                    raise UsageError(f"bad value {cli_name(name)}={_shown(value)!r}: an option of --{cli_name(key)} "
                                     f"{' or '.join(allowed)}, not of --{cli_name(key)} {actual}"
                                     + (f" ({why})" if why else ""))
        if self.torchft.lighthouse and self.torchft.heartbeat_timeout_ms != 1000:
            raise ValueError("heartbeat-timeout-ms sets the lighthouse mlscale starts; with --lighthouse, give it to "
                             "that lighthouse (torchft_lighthouse --heartbeat_timeout_ms)")
        inf_grad = [fault for fault in self.recovery.faults if fault.kind == "inf_grad"]
        if inf_grad and self.strategy not in ("ddp", "fsdp", "tp"):
            raise UsageError(f"bad value fault={inf_grad[0].spec!r}: --strategy {self.strategy} runs its backward "
                             "passes itself (ddp, fsdp and tp take this fault)")
        return self

    def _declared(self) -> list[tuple[str, Any, Any, dict[str, tuple[str, ...]], str]]:
        """(name, value, default, only, why) of every option."""
        rows = []
        for model, owner in [(self, None), *((getattr(self, group), group) for group in GROUPS)]:
            group_only = type(model).only if owner else {}
            for name, field in type(model).model_fields.items():
                if name in GROUPS and owner is None:
                    continue
                extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
                default = field.default_factory() if field.default_factory else field.default
                why = extra.get("why") or (type(model).why if owner else "")
                rows.append((name, getattr(model, name), default, {**group_only, **extra.get("only", {})}, why))
        return rows

    def inapplicable(self) -> set[str]:
        """The options (flat names) that do not apply to this configuration's strategy and mode, whatever
        their value: what a run resumed under another strategy leaves behind of its saved one."""
        return {name for name, _, _, only, _ in self._declared()
                if any(self.value_of(key) not in allowed for key, allowed in only.items())}

    def given(self) -> dict[str, Any]:
        """The options set explicitly (not left at their defaults), by flat name: what a resumed run
        takes over its saved configuration."""
        values = {name: getattr(self, name) for name in self.model_fields_set if name not in GROUPS}
        for group in GROUPS:
            model = getattr(self, group)
            values.update({name: getattr(model, name) for name in model.model_fields_set})
        return values

    def value_of(self, name: str) -> Any:
        """An option's value by its (flat) name, wherever its group is."""
        group = GROUP_OF.get(name)
        return getattr(getattr(self, group), name) if group else getattr(self, name)

    def flat(self) -> dict[str, Any]:
        """Every option by its flat name (JSON values): what a table of the run shows."""
        return flatten(self.model_dump(mode="json"))

    @property
    def step_batch(self) -> int:
        """Samples per data-parallel replica per optimizer step: ``batch_size x grad_accum``."""
        return self.batch_size * self.grad_accum

    @property
    def per_step(self) -> bool:
        """Per-step fault tolerance: every worker is a replica group of its own."""
        return self.recovery.per_step

    @property
    def replica_groups(self) -> int:
        """Replica groups of the job: ``workers`` under per-step fault tolerance, else the one job."""
        return self.workers if self.per_step else 1


def cli_name(name: str) -> str:
    """An option's name as its flag spells it, without the dashes."""
    if name in _FLAGS:
        return _FLAGS[name]
    return name.replace("_", "-")


def _shown(value: Any) -> Any:
    if isinstance(value, list):  # a repeatable flag: the values given, as they were spelled
        return str(value[0]) if len(value) == 1 else [str(item) for item in value]
    return value


def nest(values: dict[str, Any]) -> dict[str, Any]:
    """Flat keys (``stages``) moved into their groups (``pipeline.stages``); nested ones kept."""
    nested: dict[str, Any] = {}
    for key, value in values.items():
        group = GROUP_OF.get(key)
        if group is None:
            if key in GROUPS and isinstance(value, dict):
                nested[key] = {**nested.get(key, {}), **value}
            else:
                nested[key] = value
        else:
            nested.setdefault(group, {})
            if isinstance(nested[group], dict):
                nested[group][key] = value
    return nested


def flatten(values: dict[str, Any]) -> dict[str, Any]:
    """The inverse of ``nest``: a configuration dict (either form) by flat names."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in GROUPS and isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


_FLAGS = {"task_options": "task-opt", "faults": "fault", "collective_timeout_s": "collective-timeout"}


def describe_error(error: ValidationError) -> str:
    """One line for a bad configuration, in the flags' spelling (a nested key by its flat name)."""
    first = error.errors()[0]
    loc = first["loc"]
    if len(loc) >= 2 and loc[0] in GROUPS and first["type"] != "extra_forbidden":
        loc = loc[1:]
    names = {name: cli_name(name) for name in _FLAGS}
    return describe_validation_error(_Relocated(error, loc), names)


class _Relocated:
    """A validation error whose first location is a group's field seen by its flat name."""

    def __init__(self, error: ValidationError, loc: tuple[Any, ...]) -> None:
        self._error, self._loc = error, loc

    def errors(self) -> list[dict[str, Any]]:
        first = dict(self._error.errors()[0])
        first["loc"] = self._loc
        return [first]


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


def merged(*layers: dict[str, Any]) -> dict[str, Any]:
    """Configuration dicts (either form) merged, later layers first; ``None`` values are not given."""
    values: dict[str, Any] = {}
    for layer in layers:
        for key, value in nest({k: v for k, v in layer.items() if v is not None}).items():
            if key in GROUPS and isinstance(value, dict) and isinstance(values.get(key), dict):
                values[key] = {**values[key], **value}
            else:
                values[key] = value
    return values


def validated(values: dict[str, Any]) -> TrainConfig:
    """A ``TrainConfig`` from a dict (either form), else a one-line ``UsageError``."""
    try:
        return TrainConfig(**values)
    except ValidationError as exc:
        raise UsageError(describe_error(exc)) from None


def build_config(file: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Defaults < file < overrides (``None`` overrides are ignored); validated, else ``UsageError``."""
    return validated(merged(read_config_file(file) if file else {}, overrides))
