"""A training run as a Kubernetes Indexed Job running torchrun, one pod per node.

The pattern of the Kubernetes documentation (and of Kubeflow Trainer and JobSet under the hood):

- an Indexed Job with ``completions = parallelism = nodes``: pod ``i`` is named ``<job>-<i>`` and,
  with the headless Service of the same name as its subdomain, resolvable as ``<job>-<i>.<job>``;
- torchrun on every pod, with c10d rendezvous on pod 0, named by its full name
  (``<job>-0.<job>.<namespace>.svc.<cluster domain>:29500``): the one pod 0 finds in its own
  /etc/hosts, so it hosts the store without waiting for cluster DNS, and the others resolve through
  it. The rendezvous orders nodes by name, and ``<job>-0.`` sorts first: pod 0 is node rank 0, which
  writes the run directory. Pods wait up to ``rendezvous_timeout_s`` for each other (an image pull on
  one node can take minutes; torch's default is 60 s);
- an init container runs ``mlscale train --check`` on the mounted config: a configuration error exits
  2 there, and the pod failure policy fails the whole Job at once instead of retrying it;
- a disrupted pod (preemption, eviction, a drained node) is retried without counting against the
  retry budget; any other failure uses one of ``backoffLimitPerIndex`` retries of that index. Inside a
  pod, ``--max-restarts`` is torchrun's budget for restarting the workers (a peer pod lost, a worker
  crashed); every start resumes from the newest checkpoint on the shared volume (``--resume``);
- ``successPolicy``: the Job has succeeded once pod 0 (rank 0, the one that writes the report) has;
- a NetworkPolicy admits traffic to the Job's pods from its own pods only: the rendezvous store, the
  workers' store and gloo/NCCL connections listen on every interface of a pod, without a credential.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from mlscale.deploy.manifests import (
    Manifest,
    check_count,
    check_image,
    check_name,
    check_quantity,
    check_reference,
    content_hash,
    labels,
    metadata,
    pod_security,
    resources,
    secret_env,
)
from mlscale.errors import UsageError

RENDEZVOUS_PORT = 29500
CONFIG_DIR = "/mnt/config"
CHECKPOINT_DIR = "/mnt/checkpoints"
DATA_DIR = "/mnt/data"
CHECK_CONTAINER = "check"
TRAIN_CONTAINER = "trainer"
CONFIG_ERROR_EXIT = 2  # mlscale's exit code for bad usage or configuration


@dataclass(frozen=True)
class TrainingJob:
    """What ``mlscale k8s train`` renders; ``config_text`` is the run's config file, mounted as it is."""

    name: str
    image: str
    nodes: int
    config_text: str
    config_file: str = "run.toml"  # the name in the ConfigMap (its suffix tells TOML from JSON)
    gpus_per_node: int = 0
    procs_per_node: int = 1  # processes per pod without GPUs
    namespace: str | None = None
    checkpoint_claim: str | None = None
    data_claim: str | None = None  # read-only at /mnt/data: the files a config's task reads (Parquet, entities)
    # A Secret whose keys become the environment of the check and the trainer: object storage credentials
    # (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL) for a task reading s3://, never in the manifest.
    data_secret: str | None = None
    max_restarts: int = 0
    backoff_limit_per_index: int = 3
    cpu: str | None = None
    memory: str | None = None
    register: str | None = None
    registry_secret: str = "mlscale-registry"
    cluster_domain: str = "cluster.local"
    rendezvous_timeout_s: int = 900

    def __post_init__(self) -> None:
        check_count("nodes", self.nodes)
        check_count("gpus-per-node", self.gpus_per_node, least=0)
        check_count("procs-per-node", self.procs_per_node)
        if self.gpus_per_node and self.procs_per_node != 1:
            raise UsageError(f"bad value procs-per-node={self.procs_per_node}: with --gpus-per-node a pod runs one "
                             "process per GPU")
        check_count("max-restarts", self.max_restarts, least=0)
        check_count("backoff-limit", self.backoff_limit_per_index, least=0)
        # pod hostnames are <name>-<index>, and a hostname is a DNS label of at most 63 characters
        check_name("name", self.name, longest=62 - len(str(self.nodes - 1)))
        check_image(self.image)
        if self.namespace is not None:
            check_name("namespace", self.namespace)
        for flag, name in (("checkpoint-volume", self.checkpoint_claim), ("data-volume", self.data_claim),
                           ("data-secret", self.data_secret),
                           ("registry-secret", self.registry_secret), ("cluster-domain", self.cluster_domain)):
            check_reference(flag, name)
        check_quantity("cpu", self.cpu, "cpu")
        check_quantity("memory", self.memory, "memory")
        check_count("rendezvous-timeout-s", self.rendezvous_timeout_s)
        if self.nodes > 1 and self.checkpoint_claim is None:
            raise UsageError(f"bad value nodes={self.nodes}: more than one node needs --checkpoint-volume CLAIM, a "
                             "PersistentVolumeClaim (ReadWriteMany) that every pod mounts: each rank writes its part "
                             "of a checkpoint there and a restarted pod resumes from it")

    @property
    def processes_per_node(self) -> int:
        return self.gpus_per_node or self.procs_per_node

    @property
    def world_size(self) -> int:
        return self.nodes * self.processes_per_node

    @property
    def config_path(self) -> str:
        return f"{CONFIG_DIR}/{self.config_file}"

    @property
    def run_dir(self) -> str:
        return f"{CHECKPOINT_DIR}/{self.name}"

    @property
    def rendezvous_endpoint(self) -> str:
        """Pod 0's full DNS name (the namespace from the downward API, expanded by the kubelet)."""
        return f"{self.name}-0.{self.name}.$(POD_NAMESPACE).svc.{self.cluster_domain}:{RENDEZVOUS_PORT}"

    @property
    def config_map_name(self) -> str:
        """Named by its content (as kustomize's generators do), and immutable: a pod retried while the
        Job runs reads the config the Job started with, whatever was applied since."""
        return f"{self.name}-config-{content_hash(self.config_text)}"


def training_manifests(job: TrainingJob) -> list[Manifest]:
    """The ConfigMap (the run's config), the headless Service (stable pod DNS names), the NetworkPolicy
    (the pods reachable from each other only) and the Job."""
    return [_config_map(job), _headless_service(job), _network_policy(job), _job(job)]


def torchrun_command(job: TrainingJob) -> list[str]:
    """The trainer container's command: the same ``mlscale train`` as on a laptop, under torchrun."""
    command = ["torchrun", f"--nnodes={job.nodes}", f"--nproc-per-node={job.processes_per_node}",
               "--rdzv-backend=c10d", f"--rdzv-endpoint={job.rendezvous_endpoint}", f"--rdzv-id={job.name}",
               f"--rdzv-conf=join_timeout={job.rendezvous_timeout_s},read_timeout={job.rendezvous_timeout_s}",
               f"--max-restarts={job.max_restarts}",
               "-m", "mlscale", "train", "--config", job.config_path, "--run-dir", job.run_dir, "--resume"]
    if job.register:
        command += ["--register", job.register]
    return command


def check_command(job: TrainingJob) -> list[str]:
    return ["mlscale", "train", "--config", job.config_path, "--check"]


def _config_map(job: TrainingJob) -> Manifest:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": metadata(job.config_map_name, job.namespace, "training", instance=job.name),
            "immutable": True, "data": {job.config_file: job.config_text}}


def _headless_service(job: TrainingJob) -> Manifest:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": metadata(job.name, job.namespace, "training"),
            "spec": {
                "clusterIP": "None",  # headless: DNS names for the pods, no virtual IP
                "publishNotReadyAddresses": True,  # resolvable before the pods are ready: rendezvous comes first
                "selector": labels(job.name, "training"),
                "ports": [{"name": "rendezvous", "port": RENDEZVOUS_PORT, "targetPort": RENDEZVOUS_PORT}],
            }}


def _network_policy(job: TrainingJob) -> Manifest:
    """Ingress to the Job's pods from the Job's pods only, on any port: torchrun's rendezvous (29500), the
    workers' store and the collectives' connections (ports chosen at run time) take no credential, so
    nothing else may reach them. Needs a network plugin that enforces NetworkPolicy (most do)."""
    pods = {"matchLabels": labels(job.name, "training")}
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(job.name, job.namespace, "training"),
            "spec": {"podSelector": pods, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": pods}]}]}}


def _environment(job: TrainingJob) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        # Every round of the rendezvous gets a fresh store for the workers. With torch's default, the
        # workers share pod 0's agent store across rounds, and a restarted group can read the keys the
        # previous round left there (measured: gloo then hangs connecting to an old address).
        {"name": "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "value": "1"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    threads = _threads_per_process(job)
    if threads:
        env.append({"name": "OMP_NUM_THREADS", "value": str(threads)})
    if job.register:
        env.append(secret_env("MLSCALE_REGISTRY", job.registry_secret, "url"))
        env.append(secret_env("MLSCALE_ARTIFACTS", job.registry_secret, "artifacts", optional=True))
    return env


def _threads_per_process(job: TrainingJob) -> int | None:
    """CPU threads per process from the pod's CPU request (torchrun would set 1): whole CPUs only."""
    if not job.cpu or job.gpus_per_node:
        return None
    try:
        cpus = float(job.cpu[:-1]) / 1000 if job.cpu.endswith("m") else float(job.cpu)
    except ValueError:
        raise UsageError(f"bad value cpu={job.cpu!r}: a CPU quantity such as 4 or 500m") from None
    return max(1, math.floor(cpus / job.procs_per_node))


def _volumes(job: TrainingJob) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    checkpoints: dict[str, Any] = {"persistentVolumeClaim": {"claimName": job.checkpoint_claim}} \
        if job.checkpoint_claim else {"emptyDir": {}}
    volumes = [
        {"name": "config", "configMap": {"name": job.config_map_name}},
        {"name": "checkpoints", **checkpoints},
        # DataLoader workers and NCCL share memory through /dev/shm, 64 MiB by default in a container
        {"name": "shm", "emptyDir": {"medium": "Memory"}},
    ]
    mounts = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "checkpoints", "mountPath": CHECKPOINT_DIR},
        {"name": "shm", "mountPath": "/dev/shm"},
    ]
    if job.data_claim:
        volumes.append({"name": "data", "persistentVolumeClaim": {"claimName": job.data_claim, "readOnly": True}})
        mounts.append({"name": "data", "mountPath": DATA_DIR, "readOnly": True})
    return volumes, mounts


def _job(job: TrainingJob) -> Manifest:
    volumes, mounts = _volumes(job)
    env = _environment(job)
    pod_resources = resources(job.cpu, job.memory, job.gpus_per_node)
    check = {"name": CHECK_CONTAINER, "image": job.image, "command": check_command(job),
             # the world size the check sizes the job for (shards, batch, strategy): torchrun's
             "env": [{"name": "WORLD_SIZE", "value": str(job.world_size)}],
             "volumeMounts": mounts}
    trainer = {"name": TRAIN_CONTAINER, "image": job.image, "command": torchrun_command(job), "env": env,
               "ports": [{"name": "rendezvous", "containerPort": RENDEZVOUS_PORT}],
               "volumeMounts": mounts}
    if job.data_secret:  # the check lists the data too (a missing bucket fails the Job at once)
        check["envFrom"] = trainer["envFrom"] = [{"secretRef": {"name": job.data_secret}}]
    if pod_resources:  # the check too: it sees the devices the run will (a pod reserves the larger, not the sum)
        check["resources"] = trainer["resources"] = pod_resources
    pod_labels = labels(job.name, "training")
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": metadata(job.name, job.namespace, "training"),
        "spec": {
            "completionMode": "Indexed",
            "completions": job.nodes,
            "parallelism": job.nodes,
            "backoffLimitPerIndex": job.backoff_limit_per_index,
            "maxFailedIndexes": 0,  # a node that cannot come back stops the job: its peers would wait for it
            "podFailurePolicy": {"rules": [
                {"action": "FailJob",  # mlscale's exit 2: a bad config or data fails the same way on every try
                 "onExitCodes": {"containerName": CHECK_CONTAINER, "operator": "In",
                                 "values": [CONFIG_ERROR_EXIT]}},
                {"action": "Ignore",  # preempted, evicted, its node drained: retried, not counted
                 "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]},
            "successPolicy": {"rules": [{"succeededIndexes": "0"}]},
            "template": {
                "metadata": {"labels": pod_labels},
                "spec": {
                    "subdomain": job.name,  # with the headless Service: <job>-<index>.<job> resolves
                    "restartPolicy": "Never",  # the Job retries a failed pod (required by podFailurePolicy)
                    "securityContext": pod_security(),
                    "initContainers": [check],
                    "containers": [trainer],
                    "volumes": volumes,
                },
            },
        },
    }


def config_file_name(path: str | None) -> str:
    """The config's name in the ConfigMap: ``run`` with the file's suffix (``mlscale train`` reads
    ``.json`` as JSON and anything else as TOML)."""
    suffix = PurePosixPath(path).suffix if path else ""
    return f"run{suffix if suffix == '.json' else '.toml'}"
