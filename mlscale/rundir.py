"""The run directory (its layout is a contract: docs/architecture.md): the one writer and reader of
config.json, metrics.jsonl, final weights and report.json, and the one place that names every other path
in it (heartbeats, logs, recovery events, caches, plots), so every part reads the same layout.

It lives outside ``train`` because training writes it and others (the registry, plots, the demo) read
it: a lower part never imports a higher one. Torch is needed only to write the final weights
(``mlscale.weights``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlscale.common.io import append_jsonl, atomic_write_json, read_jsonl

if TYPE_CHECKING:
    from torch import nn


class RunDir:
    def __init__(self, path: str | Path | RunDir) -> None:
        self.path = path.path if isinstance(path, RunDir) else Path(path)

    config_path = property(lambda self: self.path / "config.json")
    plan_path = property(lambda self: self.path / "plan.json")  # the job plan (mlscale.train.plan)
    metrics_path = property(lambda self: self.path / "metrics.jsonl")
    report_path = property(lambda self: self.path / "report.json")
    checkpoints = property(lambda self: self.path / "checkpoints")
    logs = property(lambda self: self.path / "logs")
    final_model_path = property(lambda self: self.path / "final" / "model.safetensors")

    # -- recovery: heartbeats, failures, injected faults, restarts ----------------------------------
    heartbeats = property(lambda self: self.path / "heartbeat")
    recovery_path = property(lambda self: self.path / "recovery.jsonl")  # one event per restart
    faults_path = property(lambda self: self.logs / "faults.jsonl")  # injected faults, as they fire
    failures_path = property(lambda self: self.logs / "failures.jsonl")  # one line per worker error
    elastic_logs = property(lambda self: self.logs / "elastic")  # the elastic agent's files
    warm_starts_path = property(lambda self: self.logs / "warm_starts.jsonl")  # workers a zygote forked

    def heartbeat_path(self, attempt: int, rank: int) -> Path:
        """Rank ``rank``'s heartbeat in restart ``attempt`` (its last completed step and the time)."""
        return self.heartbeats / f"attempt{attempt}-rank{rank}"

    def heartbeat_paths(self, attempt: int) -> list[Path]:
        """Every rank's heartbeat file of ``attempt``, sorted by name."""
        return sorted(self.heartbeats.glob(f"attempt{attempt}-rank*"))

    def traceback_path(self, rank: int) -> Path:
        """The traceback of a failed worker, by its number in the job."""
        return self.logs / f"rank{rank}.traceback.txt"

    def rejoined_path(self, rank: int) -> Path:
        """Where the replacement of a rank killed with ``--fault ...:rejoin_by`` says it is up."""
        return self.logs / "rejoined" / f"rank{rank}.json"

    # -- per-step fault tolerance (replica groups) ---------------------------------------------------
    finished_path = property(lambda self: self.logs / "finished.json")  # the quorum committed the last step

    def replica_log(self, group: int, rank: int = 0) -> Path:
        """``logs/replica<g>.jsonl`` for rank 0 of replica group g (its only rank under ddp), else
        ``logs/replica<g>-rank<r>.jsonl``."""
        return self.logs / (f"replica{group}.jsonl" if rank == 0 else f"replica{group}-rank{rank}.jsonl")

    def replica_logs(self) -> dict[tuple[int, int], Path]:
        """Every replica log there is, by (replica group, rank in it), in name order."""
        found = {}
        for path in sorted(self.logs.glob("replica*.jsonl")):
            group, _, rank = path.stem.removeprefix("replica").partition("-rank")
            found[int(group), int(rank or 0)] = path
        return found

    def torchft_log(self, group: int, rank: int = 0) -> Path:
        """torchft's warnings and errors in a replica group's process (beside its replica log)."""
        return self.replica_log(group, rank).with_suffix(".torchft.log")

    def agent_log(self, group: int) -> Path:
        """The output of replica group ``group``'s torchrun agent."""
        return self.logs / "agents" / f"replica{group}.log"

    def ready_dir(self, launch: str) -> Path:
        """Where every process of a launch says it is up, before the first quorum."""
        return self.logs / "ready" / launch

    def ready_path(self, launch: str, member: int) -> Path:
        return self.ready_dir(launch) / f"member{member}"

    # -- what training and its tools keep beside the records -----------------------------------------
    tensorboard = property(lambda self: self.path / "tensorboard")  # --log tensorboard: event files
    training_plot_path = property(lambda self: self.path / "plots" / "training.png")  # drawn unless --no-plot
    serving_plot_path = property(lambda self: self.path / "plots" / "serving.png")  # mlscale demo
    serving_path = property(lambda self: self.path / "serving.json")  # mlscale demo: its serving figures

    sample_ids = property(lambda self: self.path / "sample_ids")  # --log-sample-ids
    sample_attempts_path = property(lambda self: self.sample_ids / "attempts.jsonl")  # one line a start

    # --data-cache-mb: copies of objects read from object storage, shared by the host's ranks
    object_cache = property(lambda self: self.path / "data-cache" / "objects")
    bad_samples = property(lambda self: self.path / "bad_samples")  # --bad-samples skip: what was left out

    def bad_samples_path(self, rank: int) -> Path:
        """Rank ``rank``'s samples that could not be read, one JSON line each (``--bad-samples skip``)."""
        return self.bad_samples / f"rank{rank}.jsonl"

    def sample_ids_path(self, rank: int) -> Path:
        """``--log-sample-ids``: the data set indices rank ``rank`` trained, a line a step."""
        return self.sample_ids / f"rank{rank}.jsonl"

    def data_cache(self, member: int) -> Path:
        """``--data-cache disk``: the samples process ``member`` read, by row."""
        return self.path / "data-cache" / f"rank{member}"

    def write_config(self, config: dict[str, Any]) -> None:
        atomic_write_json(self.config_path, config)

    def read_config(self) -> dict[str, Any]:
        return json.loads(self.config_path.read_text())

    def append_metrics(self, record: dict[str, Any]) -> None:
        """One line of metrics.jsonl; a line torn by a killed run is cut off first (a resumed run)."""
        append_jsonl(self.metrics_path, record)

    def read_metrics(self) -> list[dict[str, Any]]:
        """metrics.jsonl's records; a torn last line (a run killed while writing it) is skipped."""
        return read_jsonl(self.metrics_path)

    def write_final_model(self, model: nn.Module, metadata: dict[str, str] | None = None) -> None:
        """Every state-dict name, ties included, loadable ``strict=True`` (``mlscale.weights``)."""
        from mlscale.weights import save_weights

        save_weights(model, self.final_model_path, metadata)

    def write_report(self, report: dict[str, Any]) -> None:
        atomic_write_json(self.report_path, report)

    def read_report(self) -> dict[str, Any]:
        return json.loads(self.report_path.read_text())
