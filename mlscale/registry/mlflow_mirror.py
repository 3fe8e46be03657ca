"""Mirror a registered version into MLflow (``pip install mlscale[mlflow]``): params, metrics,
artifacts and aliases, so teams on MLflow see the same model.

MLflow numbers versions itself; ours is kept in the tags ``mlscale.uri`` and ``mlscale.version``.
Mirroring is idempotent: each MLflow version is tagged with mlscale's URI and a content hash of the
version's artifacts (``mlscale.content_sha256``); mirroring a version whose URI and content are
already in MLflow creates no second run or version, it only brings the aliases up to date.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

from mlscale.common.redact import redact_text, redact_url
from mlscale.errors import MlscaleError, UsageError, first_line
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


def content_hash(version: ModelVersion) -> str:
    """One SHA-256 over the version's artifacts (name and registered SHA-256 of each, in name order)."""
    digest = hashlib.sha256()
    for name in sorted(version.artifacts):
        digest.update(f"{name}\0{version.artifacts[name].sha256}\n".encode())
    return digest.hexdigest()


def _already_mirrored(client: Any, version: ModelVersion, content: str) -> Any | None:
    """The MLflow version that mirrors this URI with this content, if there is one."""
    if not client.search_registered_models(filter_string=f"name = '{version.name}'"):
        return None
    for mirrored in client.search_model_versions(f"name = '{version.name}'"):
        if mirrored.tags.get("mlscale.uri") == version.uri and mirrored.tags.get("mlscale.content_sha256") == content:
            return mirrored
    return None


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
        content = content_hash(version)
        existing = _already_mirrored(client, version, content)
        if existing is not None:
            _set_aliases(client, version, existing.version)
            return {"name": version.name, "version": int(existing.version), "run_id": existing.run_id,
                    "aliases": version.aliases, "created": False}
        tags = {"mlscale.uri": version.uri, "mlscale.version": str(version.version), "mlscale.content_sha256": content,
                "mlscale.source_run": version.source_run or "", "mlscale.data_fingerprint":
                version.data_fingerprint or "", **{f"mlscale.tag.{k}": v for k, v in version.tags.items()}}
        run = client.create_run(experiment_id, tags=tags, run_name=f"{version.name}-v{version.version}")
        run_id = run.info.run_id
        now = int(time.time() * 1000)
        params = _flatten("", version.config, {})
        client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()],
                         metrics=[Metric(k, v, now, 0) for k, v in _numeric_metrics(version.metrics).items()])
        with tempfile.TemporaryDirectory(prefix="mlscale-mirror-") as tmp:
            for artifact in version.artifacts:  # the verified bytes, not the file that may change after the check
                (Path(tmp) / artifact).write_bytes(registry.artifact_bytes(version, artifact))
                client.log_artifact(run_id, str(Path(tmp) / artifact), artifact_path="model")
        client.set_terminated(run_id)
        if not client.search_registered_models(filter_string=f"name = '{version.name}'"):
            client.create_registered_model(version.name, description=version.description or None)
        mirrored = client.create_model_version(version.name, source=f"runs:/{run_id}/model", run_id=run_id,
                                               tags=tags, description=version.description or None)
        _set_aliases(client, version, mirrored.version)
    except MlflowException as exc:  # its message repeats the URI, credentials and all
        raise MlscaleError(redact_text(f"MLflow at {redact_url(tracking_uri)} refused the mirror: "
                                       f"{first_line(exc.message)}", tracking_uri)) from None
    except MlscaleError:
        raise
    except Exception as exc:  # a client library's own error (a connection, a file): one line, no secret
        raise MlscaleError(redact_text(f"MLflow at {redact_url(tracking_uri)} failed: {type(exc).__name__}: "
                                       f"{first_line(exc)}", tracking_uri)) from None
    return {"name": version.name, "version": int(mirrored.version), "run_id": run_id, "aliases": version.aliases,
            "created": True}


def _set_aliases(client: Any, version: ModelVersion, mlflow_version: str) -> None:
    for alias in version.aliases:
        client.set_registered_model_alias(version.name, alias, mlflow_version)
