"""The models a server holds: one ``ServedModel`` per loaded version, one ``ModelSlot`` per URI.

A slot that follows an alias or a stage (``models:/digits@production``) polls the registry; when the
URI points to another version, the new version is loaded and warmed up in the background, then swapped
in with one assignment: requests that arrived before keep their version (its queue drains), requests
after get the new one, and none fails.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np

from mlscale.registry import ModelVersion, Registry, parse_uri
from mlscale.serve.batcher import ONE_CORE, DynamicBatcher
from mlscale.serve.batching import batching_for
from mlscale.serve.featured import FeatureInputs, entity_rows
from mlscale.serve.generation.language_model import LanguageModel, load_lm
from mlscale.serve.metrics import ServerMetrics
from mlscale.serve.options import ServeOptions
from mlscale.serve.protocol import BadRequest
from mlscale.serve.runtime import Runtime, TensorSpec
from mlscale.serve.runtimes import RUNTIMES, load_runtime

log = logging.getLogger("mlscale.serve")


def _served_spec(tensor: dict[str, Any], precision: str | None) -> TensorSpec:
    """A registered tensor as served: in the runtime's reduced precision if it is a floating-point one."""
    datatype = tensor["datatype"]
    if precision is not None and datatype in ("FP16", "FP32", "FP64"):
        datatype = precision
    value_range = tensor.get("range")
    return TensorSpec(tensor["name"], datatype, tuple(tensor["shape"]),
                      tuple(value_range) if value_range is not None else None)


class ServedModel:
    """One loaded version: its runtime, its batcher and what clients may send it."""

    def __init__(self, version: ModelVersion, runtime: Runtime, options: ServeOptions,
                 metrics: ServerMetrics, role: str = "primary", language_model: LanguageModel | None = None) -> None:
        """``role``: primary, canary or shadow; a shadow's model calls never run on the event loop (the
        served path must not wait for them). ``language_model``: a causal LM's generation (its engine,
        tokenizer and defaults), which the generate routes use."""
        self.version, self.runtime, self.options = version, runtime, options
        self.name, self.number = version.name, version.version
        signature = version.signature
        # every input by name, in the signature's order (one, ``input``, for most models); ``input`` is the first
        self.inputs = [_served_spec(tensor, runtime.datatype) for tensor in signature["inputs"]]
        self.input, self.output = self.inputs[0], _served_spec(signature["outputs"][0], runtime.datatype)
        artifact = version.artifacts.get(RUNTIMES[runtime.kind].artifact)
        # what computes the answers: the artifact and the precision it runs in (a cache key's first part)
        self.content_id = f"{runtime.kind}:{artifact.sha256 if artifact else version.uri}:{self.output.datatype}"
        self.labels = (self.name, str(self.number))
        self.stats = metrics.stats_for(*self.labels)
        self.role = role
        self.stats.hold(role)
        self.batcher = DynamicBatcher(runtime, stats=self.stats,
                                      max_batch_size=options.max_batch_size, max_delay_s=options.max_delay_ms / 1e3,
                                      slo_s=options.slo_ms / 1e3 if options.slo_ms else None,
                                      timeout_s=options.timeout_ms / 1e3,
                                      inline=options.exec_timeout_s is None and role != "shadow",
                                      instances=options.instances, batching=batching_for(self.inputs, self.output),
                                      queue_limit=options.shadow_queue if role == "shadow" else options.queue_limit,
                                      one_core=ONE_CORE or options.core_per_worker)
        self.language_model = language_model
        self.features = None  # a model trained from features: what turns entity keys into its input
        if version.config.get("task") == "features":
            self.features = FeatureInputs(version, options.online_store, options.feature_log,
                                          timeout_s=options.store_timeout_ms / 1e3,
                                          on_log_failure=self.stats.feature_log_failures.inc)
            self.stats.feature_skew = self.features.skew

    async def feature_vectors(self, entities: Any) -> np.ndarray:
        """The input tensor of a request that names entities (a BadRequest for any other model; a
        ``StoreUnavailable`` when the online store does not answer in time)."""
        if self.features is None:
            raise BadRequest(f"model {self.name} was not trained from features: send 'inputs', not 'entities'")

        return await self.features.vectors(entity_rows(entities))

    async def close(self) -> None:
        """Drain what this version has queued, then let its threads go (the store's, the feature log's)."""
        await self.batcher.close()
        if self.language_model is not None:  # streams in flight finish first
            await self.language_model.close()
        if self.features is not None:
            await asyncio.to_thread(self.features.close)
        self.stats.release(self.role)

    def warm_up(self) -> None:
        zeros = {spec.name: np.zeros([1 if d == -1 else d for d in spec.shape], dtype=spec.dtype)
                 for spec in self.inputs}
        self.runtime.run(zeros if len(zeros) > 1 else zeros[self.input.name])


class ModelSlot:
    def __init__(self, uri: str, registry: Registry, options: ServeOptions, metrics: ServerMetrics,
                 loaded: tuple[ModelVersion, Runtime] | None = None, role: str = "primary",
                 tracer: Any = None) -> None:
        """``loaded``: the version and runtime already loaded (and verified) at start, so that a model
        is read and hashed once, not again when the server begins to listen. ``role``: primary, canary
        (a share of the model's requests) or shadow (copies of them). ``tracer``: the server's
        ``tracing.Tracer`` (``--otlp-endpoint``), handed to each version's batcher."""
        self.uri, self.parsed, self.role = uri, parse_uri(uri), role
        self.registry, self.options, self.metrics = registry, options, metrics
        self.current: ServedModel | None = None
        self.follows = self.parsed.version is None
        self.tracer = tracer
        self._loaded = loaded

    @property
    def number(self) -> int | None:
        """The version served now or, before the first load, the one loaded at start (None: neither
        yet); what a canary or shadow is checked against (another version of the model served)."""
        if self.current is not None:
            return self.current.number
        return self._loaded[0].version if self._loaded is not None else None
    @property
    def name(self) -> str:
        return self.parsed.name

    async def _prepare(self, version: ModelVersion, runtime: Runtime | None = None) -> ServedModel:
        """Load (unless given) and warm a version off the event loop, ready to be swapped in."""
        if runtime is None:
            runtime = await asyncio.to_thread(load_runtime, self.registry, version, self.options.runtime,
                                              self.options.threads, self.options.precision)
        loaded = await asyncio.to_thread(load_lm, self.registry, version, runtime)
        language_model = None
        if loaded is not None:  # the engine reports to the version's series
            series = self.metrics.stats_for(version.name, str(version.version)).generating()
            language_model = LanguageModel(version.name, loaded, self.options, observer=series)
        served = ServedModel(version, runtime, self.options, self.metrics, role=self.role,
                             language_model=language_model)
        served.batcher.tracer = self.tracer
        await asyncio.to_thread(served.warm_up)
        return served

    async def load(self) -> None:
        """The first load: the version the URI points to at start."""
        if self._loaded is None:
            await self.reload_if_moved()
            return
        loaded, self._loaded = self._loaded, None
        self.current = await self._prepare(*loaded)

    async def reload_if_moved(self) -> bool:
        """Swap in the version the URI points to now, if it moved (or none is loaded). True when swapped."""
        version = await asyncio.to_thread(self.registry.resolve, self.uri)
        old = self.current
        if old is not None and version.version == old.number:
            return False
        served = await self._prepare(version)
        self.current = served  # the swap: one assignment, new requests see the new version from here on
        if old is not None:
            log.warning("%s moved: now serving version %s", self.uri, served.number)
            await old.close()  # drain what the old version had queued
        return True

    async def follow(self) -> None:
        while self.follows:
            await asyncio.sleep(self.options.reload_interval_s)
            try:
                await self.reload_if_moved()
            except Exception as exc:  # a registry hiccup must not stop serving the current version
                log.warning("reload of %s failed, still serving version %s: %s", self.uri,
                            self.current.number if self.current else "?", exc)
