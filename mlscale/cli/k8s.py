"""``mlscale k8s train|serve``: Kubernetes manifests for a training Job or a serving Deployment.

YAML on standard output (for ``kubectl apply -f -``), or one file per object with ``-o DIR``. The
manifests need Kubernetes 1.33 or newer; what they contain and why: docs/scale-out.md.
"""

from __future__ import annotations

import argparse
import sys
import textwrap

from mlscale.cli.models import add_registry_option
from mlscale.cli.parsers import Parser
from mlscale.cli.serve import add_serve_arguments as add_serve_command_arguments
from mlscale.cli.serve import options_from_args
from mlscale.errors import UsageError

TRAIN_DESCRIPTION = textwrap.fill(
    "An Indexed Job running `mlscale train --config` under torchrun on every pod, with the config used with "
    "`mlscale train --workers N` locally, mounted from a ConfigMap. Pod 0 hosts the rendezvous and is rank 0; "
    "the run directory and its checkpoints go to the shared volume, so a failed pod resumes from the newest "
    "checkpoint. A config error fails the Job at once (exit 2 of the check container); a disrupted pod is "
    "retried without counting against --backoff-limit.", width=100)
SERVE_DESCRIPTION = textwrap.fill(
    "A Deployment running `mlscale serve MODEL_URI`, with probes on the v2 health endpoints and a grace period "
    "that covers --drain-delay-s, so that a rolling update or a drained node loses no request; the registry "
    "location comes from a Secret. When the registry is reachable from here (--registry or $MLSCALE_REGISTRY), "
    "the model URI is checked first. Flags after -- go to mlscale serve in the pods (batching, cache, SLO, "
    "online store), checked here as mlscale serve would.", width=100)

TRAIN_EXAMPLES = """examples:
  mlscale k8s train --config run.toml --nodes 4 --gpus-per-node 8 --image registry.example/mlscale:0.1.0 \\
      --checkpoint-volume runs-claim | kubectl apply -f -
  mlscale k8s train --config run.toml --nodes 2 --cpu 8 --memory 16Gi --image mlscale:0.1.0-cpu \\
      --checkpoint-volume runs-claim -o k8s/
"""

SERVE_EXAMPLES = """examples:
  mlscale k8s serve models:/digits@production --image registry.example/mlscale:0.1.0 --replicas 2
  mlscale k8s serve models:/digits@production --image mlscale:0.1.0-cpu --replicas 3 --max-replicas 12 \\
      --autoscale pending-requests -o k8s/ -- --max-batch-size 64 --slo-ms 50

The Secret the pods read the registry location from (key url; key artifacts, optional, for the
artifact folder of a database registry):
  kubectl create secret generic mlscale-registry --from-literal=url=postgresql://USER:PASSWORD@HOST/DB
An online store with a password (flags after -- must not carry credentials: they are written out):
  kubectl create secret generic online-store --from-literal=url=redis://:PASSWORD@HOST:6379/0
  mlscale k8s serve models:/churn@production --image mlscale:0.1.0-cpu --online-store-secret online-store
"""


def add_k8s(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("k8s", help="Kubernetes manifests: a training Job, a serving Deployment",
                       description="Render Kubernetes manifests from the same config and model URI used locally. "
                       "Needs Kubernetes 1.33+.")
    k8s = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    train = k8s.add_parser("train", help="an Indexed Job running torchrun, one pod per node",
                           description=TRAIN_DESCRIPTION, arguments="mlscale.cli.k8s:add_train_arguments",
                           epilog=TRAIN_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    train.set_defaults(handler=_train)
    serve = k8s.add_parser("serve", help="a Deployment, Service, PodDisruptionBudget and autoscaler",
                           description=SERVE_DESCRIPTION, arguments="mlscale.cli.k8s:add_serve_arguments",
                           epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    # after --: more `mlscale serve` flags for the pods (--max-batch-size 64 --slo-ms 50 --online-store ...)
    serve.set_defaults(handler=_serve, passed_on=[])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image", required=True, help="container image with mlscale installed, with a tag or digest "
                   "(the Dockerfile in the repository builds one)")
    p.add_argument("--name", help="name of the Job or Deployment and its Service (a DNS label; default from "
                   "the task or the model)")
    p.add_argument("--namespace", help="namespace of every object (default: kubectl's current one)")
    p.add_argument("-o", "--output", metavar="DIR", help="write one file per object into DIR instead of stdout")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="the run's TOML or JSON config (as for mlscale train)")
    p.add_argument("--nodes", type=int, required=True, metavar="N", help="pods, one per node (Job completions)")
    p.add_argument("--gpus-per-node", type=int, default=0, metavar="G",
                   help="GPUs per pod (nvidia.com/gpu) and processes per pod (default 0: a CPU job)")
    p.add_argument("--procs-per-node", type=int, default=1, metavar="P",
                   help="processes per pod without GPUs (default 1)")
    p.add_argument("--checkpoint-volume", metavar="CLAIM", help="a ReadWriteMany PersistentVolumeClaim for the "
                   "run directory and its checkpoints, shared by every pod (needed for more than one node)")
    p.add_argument("--data-volume", metavar="CLAIM", help="a PersistentVolumeClaim mounted read-only at /mnt/data in "
                   "every pod, for the files the config's task reads (name them under /mnt/data in the config)")
    p.add_argument("--data-secret", metavar="SECRET", help="a Secret whose keys are set as environment variables "
                   "in every pod: credentials for data in object storage (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                   "AWS_ENDPOINT_URL for s3://), kept out of the manifest")
    p.add_argument("--max-restarts", type=int, metavar="R", help="torchrun's worker restarts per pod (default: "
                   "the config's max_restarts)")
    p.add_argument("--backoff-limit", type=int, default=3, metavar="B",
                   help="retries of each pod after a failure (backoffLimitPerIndex, default 3)")
    p.add_argument("--cpu", help="CPU request per pod, e.g. 8 or 500m")
    p.add_argument("--memory", help="memory request and limit per pod, e.g. 32Gi")
    p.add_argument("--rendezvous-timeout-s", type=int, default=900, metavar="S",
                   help="how long pods wait for each other at the rendezvous (default 900: an image pull on one "
                   "node can take minutes)")
    p.add_argument("--cluster-domain", default="cluster.local", help="the cluster's DNS domain, in pod 0's full "
                   "name (default cluster.local)")
    p.add_argument("--register", metavar="NAME", help="register the final model under NAME (registry location "
                   "from the Secret --registry-secret)")
    p.add_argument("--registry-secret", default="mlscale-registry", metavar="SECRET",
                   help="Secret with the registry location (key url; default mlscale-registry)")
    _common(p)


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("uri", metavar="MODEL_URI", help="models:/NAME/VERSION, models:/NAME@ALIAS or models:/NAME/STAGE "
                   "(an alias or stage is followed: the pods load the new version when it moves)")
    p.add_argument("--replicas", type=int, default=2, metavar="R", help="replicas (default 2); the autoscaler's "
                   "minimum")
    p.add_argument("--max-replicas", type=int, metavar="M", help="the autoscaler's maximum (default 2 x R; equal "
                   "to R: no autoscaler)")
    p.add_argument("--autoscale", choices=["cpu", "pending-requests"], default="cpu",
                   help="cpu (default: utilization of the CPU request) or pending-requests (the queue length from "
                   "/metrics, through a custom metrics adapter such as the Prometheus Adapter)")
    p.add_argument("--target-cpu-percent", type=int, default=70, metavar="PCT", help="cpu target (default 70)")
    p.add_argument("--target-pending", type=int, default=8, metavar="N",
                   help="pending-requests target per pod (default 8)")
    p.add_argument("--drain-delay-s", type=float, default=10.0, metavar="S", help="after SIGTERM, seconds the pod "
                   "still serves while the Service stops routing to it (default 10)")
    p.add_argument("--exec-timeout-s", type=float, default=30.0, metavar="S", help="a model call running longer "
                   "fails liveness (default 30)")
    p.add_argument("--no-grpc", action="store_true", help="HTTP only (no gRPC port)")
    p.add_argument("--cpu", default="1", help="CPU request per pod (default 1)")
    p.add_argument("--memory", default="1Gi", help="memory request and limit per pod (default 1Gi)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs per pod (default 0)")
    p.add_argument("--registry-secret", default="mlscale-registry", metavar="SECRET",
                   help="Secret with the registry location: key url, optional key artifacts (default mlscale-registry)")
    p.add_argument("--registry-volume", metavar="CLAIM", help="a PersistentVolumeClaim mounted at /mnt/registry, "
                   "for a registry folder or artifacts on a shared file system")
    p.add_argument("--online-store-secret", metavar="SECRET", help="Secret whose key url is the online store of a "
                   "model trained from features (a redis:// URL with its password): the pods pass it to mlscale serve "
                   "--online-store from the Secret, so no password is written into the manifests")
    add_registry_option(p)
    _common(p)


def _checked_serve_args(uri: str, serve_args: list[str]) -> list[str]:
    """The flags after --, checked as `mlscale serve` checks them (its parser, then its options model),
    so a bad one exits 2 here and not in the pods."""
    from mlscale.deploy.serving import refuse_credentials

    refuse_credentials(tuple(serve_args))  # first: nothing below may echo a password
    parser = Parser(prog="mlscale serve", add_help=False)  # --help here would render nothing and exit 0
    add_serve_command_arguments(parser)
    parsed = parser.parse_args([uri, *serve_args])
    if len(parsed.uris) > 1:
        raise UsageError(f"bad value {parsed.uris[1]!r} after --: one model URI per Deployment")
    options_from_args(parsed)
    return serve_args


def _emit(manifests: list[dict], output: str | None, notes: list[str]) -> None:
    """The manifests, then the notes on stderr: a mistake found on the way is the only line printed."""
    from mlscale.deploy.manifests import to_yaml, write_manifests

    text = to_yaml(manifests) if output is None else ""
    paths = write_manifests(manifests, output) if output is not None else []
    sys.stdout.write(text)
    for path in paths:
        print(path)
    for note in notes:
        print(f"mlscale: note: {note}", file=sys.stderr)


def _train(args: argparse.Namespace) -> int:
    from mlscale.deploy import render_training_job

    job, notes = render_training_job(
        config_path=args.config, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
        procs_per_node=args.procs_per_node, image=args.image, name=args.name, namespace=args.namespace,
        checkpoint_claim=args.checkpoint_volume, data_claim=args.data_volume, data_secret=args.data_secret,
        max_restarts=args.max_restarts,
        backoff_limit_per_index=args.backoff_limit, cpu=args.cpu, memory=args.memory, register=args.register,
        registry_secret=args.registry_secret, cluster_domain=args.cluster_domain,
        rendezvous_timeout_s=args.rendezvous_timeout_s)
    from mlscale.deploy.training import training_manifests

    _emit(training_manifests(job), args.output, notes)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from mlscale.deploy import render_serving
    from mlscale.deploy.serving import serving_manifests

    serve_args = _checked_serve_args(args.uri, args.passed_on)
    spec, notes = render_serving(
        uri=args.uri, serve_args=tuple(serve_args), image=args.image,
        replicas=args.replicas, max_replicas=args.max_replicas,
        name=args.name, namespace=args.namespace, grpc=not args.no_grpc, drain_delay_s=args.drain_delay_s,
        exec_timeout_s=args.exec_timeout_s, cpu=args.cpu, memory=args.memory, gpus=args.gpus,
        autoscale=args.autoscale, target_cpu_percent=args.target_cpu_percent, target_pending=args.target_pending,
        registry_secret=args.registry_secret, registry_claim=args.registry_volume, registry=args.registry,
        online_store_secret=args.online_store_secret)
    _emit(serving_manifests(spec), args.output, notes)
    return 0

