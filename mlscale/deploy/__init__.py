"""Kubernetes manifests for the same runs that work locally: a training Job, a serving Deployment.

``render_training_job`` and ``render_serving`` check what can be checked here (the config, the job's
size against its strategy, the image reference, the model URI when the registry is reachable) and
return the spec to render with notes for the user; a mistake is a ``UsageError`` (exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mlscale.deploy.manifests import MIN_KUBERNETES, default_name, to_yaml, write_manifests
from mlscale.deploy.serving import ServingDeployment, serving_manifests
from mlscale.deploy.training import TrainingJob, config_file_name, training_manifests
from mlscale.errors import UsageError

__all__ = ["MIN_KUBERNETES", "ServingDeployment", "TrainingJob", "render_serving", "render_training_job",
           "serving_manifests", "to_yaml", "training_manifests", "write_manifests"]

NO_CONFIG = "# mlscale train's defaults: no --config was given to mlscale k8s train\n"


def render_training_job(*, config_path: str | None, nodes: int, image: str, name: str | None = None,
                        max_restarts: int | None = None, **options: Any) -> tuple[TrainingJob, list[str]]:
    """The Job for ``mlscale train --config CONFIG`` on ``nodes`` pods, and notes on what it implies.
    ``options``: the other fields of ``TrainingJob``; ``max_restarts`` defaults to the config's."""
    from mlscale.config import build_config
    from mlscale.train.planner import plan_job
    from mlscale.train.strategies import strategy_for

    config = build_config(config_path)
    if config.per_step:
        raise UsageError("bad value fault-tolerance='per-step': mlscale k8s train renders restart-all Jobs; a per-step "
                         "job needs a torchft lighthouse and one torchrun per replica group (docs/scale-out.md, "
                         "section 2b)")
    if options.get("register"):
        from mlscale.registry.uri import check_name

        check_name(options["register"])
    job = TrainingJob(
        name=name or default_name("train", config.task, longest=62 - len(str(max(nodes, 1) - 1))), image=image,
        nodes=nodes, config_text=_read(config_path) if config_path else NO_CONFIG,
        config_file=config_file_name(config_path),
        max_restarts=config.recovery.max_restarts if max_restarts is None else max_restarts, **options)
    plan = plan_job(config, world=job.world_size)  # the layout the pods will run (the data is read there)
    strategy_for(config).check(config, plan.world)
    notes = []
    if "workers" in config.model_fields_set and config.workers != job.world_size:
        notes.append(f"the config's workers = {config.workers} is not used: torchrun starts {job.world_size} "
                     f"process(es) ({nodes} node(s) x {job.processes_per_node})")
    if not config.checkpoint.checkpoint_every:
        notes.append("the config has no checkpoint_every: a pod that fails restarts the run from step 0")
    if job.checkpoint_claim is None:
        notes.append("no --checkpoint-volume: the run directory is on the pod's own disk (emptyDir) and goes "
                     "with the pod")
    return job, notes


def render_serving(*, uri: str, image: str, replicas: int = 2, name: str | None = None,
                   registry: str | None = None, **options: Any) -> tuple[ServingDeployment, list[str]]:
    """The Deployment serving ``uri``; the URI is looked up when the registry can be opened from here."""
    from mlscale.registry.uri import parse_uri

    parsed = parse_uri(uri)
    spec = ServingDeployment(name=name or default_name(parsed.name), model_uri=uri, image=image, replicas=replicas,
                             **options)
    unchecked = _look_up(uri, registry)  # last: a mistake in the flags is reported before any note
    notes = [unchecked] if unchecked else []
    if spec.replicas == 1:
        notes.append("one replica: a rolling update adds a pod before removing it, but a node drain (the "
                     "disruption budget allows one pod down) or a lost node leaves no pod serving")
    return spec, notes


def _look_up(uri: str, location: str | None) -> str | None:
    """None when ``uri`` resolves in the registry; a note when the registry cannot be opened from here.
    A registry that answers without the model is a ``NotFound`` (exit 2)."""
    from mlscale.registry import Registry
    from mlscale.registry.store import NotFound, RegistryError

    try:
        registry = Registry(location, create=False)
    except (NotFound, RegistryError) as exc:
        return f"{uri} was not checked: the registry cannot be opened from here ({exc})"
    try:
        registry.resolve(uri)
    finally:
        registry.engine.dispose()
    return None


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as exc:  # build_config read it a moment ago: a race, but still one line
        raise UsageError(f"cannot read config file {path!r}: {exc.strerror}") from None
