"""Mirror a registered version into MLflow (``pip install mlscale[mlflow]``): params, metrics,
artifacts and aliases, so teams on MLflow see the same model.

MLflow numbers versions itself; ours is kept in the tags ``mlscale.uri`` and ``mlscale.version``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from mlscale.errors import MlscaleError, UsageError
from mlscale.registry.store import ModelVersion, Registry


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> dict[str, str]:
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out[prefix] = str(value)[:6000]
    return out


def _numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    flat = _flatten("", metrics, {})
    result = {}
    for key, text in flat.items():
        try:
            result[key] = float(text)
        except ValueError:
            continue
    return result


def mirror_version(registry: Registry, version: ModelVersion, tracking_uri: str,
                   artifact_root: str | None = None) -> dict[str, Any]:
    try:
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient
    except ImportError:
        raise UsageError("MLflow is not installed: pip install 'mlscale[mlflow]'") from None
    logging.getLogger("mlflow").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    if artifact_root is None and tracking_uri.startswith("sqlite:///"):
        artifact_root = str(Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent / "mlflow-artifacts")
    try:
        client = MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        experiment = client.get_experiment_by_name("mlscale")
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(
            "mlscale", artifact_location=Path(artifact_root).as_uri() if artifact_root else None)
        tags = {"mlscale.uri": version.uri, "mlscale.version": str(version.version),
                "mlscale.source_run": version.source_run or "", "mlscale.data_fingerprint":
                version.data_fingerprint or "", **{f"mlscale.tag.{k}": v for k, v in version.tags.items()}}
        run = client.create_run(experiment_id, tags=tags, run_name=f"{version.name}-v{version.version}")
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        params = _flatten("", version.config, {})
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric(k, v, now, 0) for k, v in _numeric_metrics(version.metrics).items()])
        for artifact in version.artifacts:
            client.log_artifact(run_id, str(registry.artifact_path(version, artifact)), artifact_path="model")
        client.set_terminated(run_id)
        if not client.search_registered_models(filter_string=f"name = '{version.name}'"):
            client.create_registered_model(version.name, description=version.description or None)
        mirrored = client.create_model_version(version.name, source=f"runs:/{run_id}/model", run_id=run_id,
                                               tags=tags, description=version.description or None)
        for alias in version.aliases:
            client.set_registered_model_alias(version.name, alias, mirrored.version)
    except MlflowException as exc:
        raise MlscaleError(f"MLflow at {tracking_uri} refused the mirror: {exc.message}") from None
    return {"name": version.name, "version": int(mirrored.version), "run_id": run_id, "aliases": version.aliases}
