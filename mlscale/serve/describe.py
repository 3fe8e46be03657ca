"""What the server says about itself and its models, once for both protocols: server and model
metadata, model configuration, statistics and the repository index, as the Open Inference Protocol
and its Triton extensions (model_configuration, statistics, model_repository) define them.

Each is a dict in the protocol's JSON mapping: HTTP sends it as JSON, gRPC parses it into the
protocol's message (the field names are the messages' own). Statistics come from the counters that
``/metrics`` exposes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlscale import __version__
from mlscale.serve.runtimes import RUNTIMES

if TYPE_CHECKING:
    from mlscale.serve.core import ServerState
    from mlscale.serve.metrics import ModelStats
    from mlscale.serve.models import ServedModel
    from mlscale.serve.runtime import TensorSpec

# The protocol extensions served, as Triton names them (the repository index is served, but not the
# model_repository extension's load and unload: it is not advertised).
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]
# runtime kind -> (Triton platform, Triton backend), from the one table of runtimes
BACKENDS = {kind: (runtime.platform, runtime.backend) for kind, runtime in RUNTIMES.items()}


def server_metadata() -> dict[str, Any]:
    return {"name": "mlscale", "version": __version__, "extensions": EXTENSIONS}


def platform(served: ServedModel) -> str:
    return BACKENDS[served.runtime.kind][0]


def tensor_metadata(spec: TensorSpec) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": list(spec.shape)}


def model_metadata(state: ServerState, served: ServedModel) -> dict[str, Any]:
    versions = sorted(str(s.current.number) for s in state.slots if s.current and s.current.name == served.name)
    return {"name": served.name, "versions": versions, "platform": platform(served),
            "inputs": [tensor_metadata(spec) for spec in served.inputs], "outputs": [tensor_metadata(served.output)]}


def _config_tensor(spec: TensorSpec) -> dict[str, Any]:
    # Triton's dims leave out the batch dimension when max_batch_size > 0
    return {"name": spec.name, "data_type": f"TYPE_{spec.datatype}", "dims": list(spec.shape[1:])}


def model_config(served: ServedModel) -> dict[str, Any]:
    """Triton's model configuration: the batch bound and the dynamic batcher's settings."""
    options = served.options
    return {"name": served.name, "platform": platform(served), "backend": BACKENDS[served.runtime.kind][1],
            "max_batch_size": options.max_batch_size,
            "input": [_config_tensor(spec) for spec in served.inputs], "output": [_config_tensor(served.output)],
            "dynamic_batching": {"preferred_batch_size": [options.max_batch_size],
                                 "max_queue_delay_microseconds": int(options.max_delay_ms * 1000)}}


def _duration(count: float, seconds: float) -> dict[str, int]:
    return {"count": int(count), "ns": int(seconds * 1e9)}


def model_statistics(served: ServedModel, stats: ModelStats) -> dict[str, Any]:
    """Counts and cumulative nanoseconds, from the server's metrics. ``fail`` has no duration (failures
    are counted, not timed); there is no separate input/output copy step (``compute_input`` and
    ``compute_output`` are zero); ``compute_infer`` counts requests, each with the duration of the
    batch it ran in, as Triton does (``execution_count`` counts the batches). ``stats``: the version's
    series for the whole server (every worker's); ``routed`` (mlscale's own) the requests by model
    name the traffic split sent it, with its ``role`` (primary, canary or shadow)."""
    failed = sum(counter.value for counter in stats.failures.values())
    return {
        "name": served.name, "version": str(served.number), "last_inference": stats.last_inference_ms,
        "inference_count": int(stats.inferences.value), "execution_count": int(stats.executions.value),
        "inference_stats": {
            "success": _duration(stats.success.value, stats.duration.sum),
            "fail": _duration(failed, 0.0),
            "queue": _duration(stats.queue.count, stats.queue.sum),
            "compute_input": _duration(0, 0.0),
            "compute_infer": _duration(stats.compute_requests.value, stats.compute_request_seconds.value),
            "compute_output": _duration(0, 0.0),
            "cache_hit": _duration(stats.cache["hit"].value, 0.0),
            "cache_miss": _duration(stats.cache["miss"].value, 0.0),
        },
        "batch_stats": [],
        "parameters": {"role": stats.role, "routed": int(stats.routed.value), "share_percent": stats.share.value},
    }


def statistics(state: ServerState, name: str | None = None, version: str | None = None) -> dict[str, Any]:
    """``model_stats`` of one model (or version), or of every model served."""
    if name and version:
        served = [state.lookup(name, version)]
    else:
        served = [s.current for s in state.slots if s.current is not None and (not name or s.current.name == name)]
        if name and not served:
            state.lookup(name)  # the 404
    models = state.metrics.view().models
    return {"model_stats": [model_statistics(model, models.get((model.name, str(model.number)), model.stats))
                            for model in served]}


def repository_index(state: ServerState, ready_only: bool = False) -> list[dict[str, Any]]:
    """Every model version the server holds; all are loaded (state READY) once the server is ready."""
    state_name = "READY" if state.ready else "UNAVAILABLE"
    if ready_only and not state.ready:
        return []
    return [{"name": slot.current.name, "version": str(slot.current.number), "state": state_name, "reason": ""}
            for slot in state.slots if slot.current is not None]
