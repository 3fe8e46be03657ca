"""What every rendered Kubernetes manifest shares: names, labels, image references, YAML output.

The manifests are plain dicts in the Kubernetes API's own shape (no client library, no templating
engine): what is rendered is what is reviewed, validated against the API's schemas and applied.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from mlscale.errors import UsageError

# The oldest Kubernetes whose API has every field rendered here: the Job's successPolicy and
# backoffLimitPerIndex are GA (stable) from 1.33 on; podFailurePolicy from 1.31.
MIN_KUBERNETES = "1.33"
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # RFC 1035 label: Service and Job names
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # claims, Secrets
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_PATH_COMPONENT = re.compile(r"^[a-z0-9]+((\.|_|__|-+)[a-z0-9]+)*$")  # the OCI distribution spec's
_CPU = re.compile(r"^([0-9]+(\.[0-9]+)?|[0-9]+m)$")
_MEMORY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")

Manifest = dict[str, Any]


def check_count(flag: str, value: int, least: int = 1) -> int:
    if value < least:
        raise UsageError(f"bad value {flag}={value}: must be at least {least}")
    return value


def check_seconds(flag: str, value: float, positive: bool = False, most: float = math.inf) -> float:
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or value > most:
        bounds = f"{'> 0' if positive else '>= 0'}{f' and at most {most:g}' if math.isfinite(most) else ''}"
        raise UsageError(f"bad value {flag}={value:g}: seconds, a number {bounds}")
    return value


def check_name(flag: str, name: str, longest: int = 63) -> str:
    """A Kubernetes object name that is also a DNS label (Services, Jobs and namespaces need one)."""
    if len(name) > longest or not DNS_LABEL.fullmatch(name):
        raise UsageError(f"bad value {flag}={name!r}: use at most {longest} lowercase letters, digits and '-', "
                         "starting with a letter and ending with a letter or digit")
    return name


def check_reference(flag: str, name: str | None) -> str | None:
    """The name of an object the manifests refer to (a PersistentVolumeClaim, a Secret): a DNS subdomain."""
    if name is not None and (len(name) > 253 or not DNS_SUBDOMAIN.fullmatch(name)):
        raise UsageError(f"bad value {flag}={name!r}: a Kubernetes object name (lowercase letters, digits, '-' "
                         "and '.', starting and ending with a letter or digit)")
    return name


def check_quantity(flag: str, value: str | None, kind: str) -> str | None:
    """A CPU (``4``, ``0.5``, ``500m``) or memory (``8Gi``, ``512Mi``) quantity as Kubernetes writes it."""
    pattern, example = (_CPU, "4, 0.5 or 500m") if kind == "cpu" else (_MEMORY, "8Gi or 512Mi")
    if value is not None and not pattern.fullmatch(value):
        raise UsageError(f"bad value {flag}={value!r}: a {kind} quantity such as {example}")
    return value


def default_name(*parts: str, longest: int = 63) -> str:
    """``mlscale-<parts>`` made a DNS label: lowercase, runs of other characters as one '-'."""
    text = re.sub(r"[^a-z0-9]+", "-", "-".join(("mlscale", *parts)).lower()).strip("-")
    return text[:longest].rstrip("-")


def check_image(image: str) -> str:
    """An image pinned by a tag or a digest: an untagged image means whatever ``latest`` is when a node
    pulls it, so two pods of one job could run different code."""
    reference, at, digest = image.partition("@")
    if at and not _DIGEST.fullmatch(digest):
        raise UsageError(f"bad value image={image!r}: a digest is @sha256: and 64 hexadecimal digits")
    head, _, last = reference.rpartition("/")
    repository, _, tag = last.partition(":")
    if not at and not tag:
        raise UsageError(f"bad value image={image!r}: give a tag or a digest (REPOSITORY:TAG or "
                         "REPOSITORY@sha256:...), so that every pod runs the same code")
    if tag and not _TAG.fullmatch(tag):
        raise UsageError(f"bad value image={image!r}: the tag {tag!r} is not a valid image tag")
    path = [*head.split("/"), repository] if head else [repository]
    if len(path) > 1 and ("." in path[0] or ":" in path[0] or path[0] == "localhost"):
        path = path[1:]  # a registry host (and port): not held to the repository's lowercase rule
    if not all(_PATH_COMPONENT.fullmatch(part) for part in path):
        raise UsageError(f"bad value image={image!r}: a repository name is lowercase letters, digits and "
                         "separators (., _, -)")
    return image


def labels(name: str, component: str) -> dict[str, str]:
    """The recommended labels (app.kubernetes.io/...): what selectors, PDBs and autoscalers match on."""
    return {"app.kubernetes.io/name": "mlscale", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component}


def metadata(name: str, namespace: str | None, component: str, instance: str | None = None) -> dict[str, Any]:
    """``instance``: the run or service the object belongs to (default: the object itself)."""
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    meta["labels"] = labels(instance or name, component)
    return meta


def resources(cpu: str | None, memory: str | None, gpus: int) -> dict[str, Any]:
    """Requests for what the scheduler must reserve; a memory limit equal to the request (a pod over it
    is killed rather than starving its neighbours); no CPU limit (throttling slows collectives); GPUs
    as the NVIDIA device plugin's extended resource, which Kubernetes takes in limits."""
    requests = {key: value for key, value in (("cpu", cpu), ("memory", memory)) if value}
    limits: dict[str, Any] = {"memory": memory} if memory else {}
    if gpus:
        limits["nvidia.com/gpu"] = gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out


IMAGE_USER = 10001  # the Dockerfile's user


def pod_security() -> dict[str, Any]:
    """Not root, as the image's user; volumes group-owned by it (a checkpoint claim on a fresh disk is
    root's), changed only when the volume's root does not match already."""
    return {"runAsNonRoot": True, "runAsUser": IMAGE_USER, "runAsGroup": IMAGE_USER, "fsGroup": IMAGE_USER,
            "fsGroupChangePolicy": "OnRootMismatch"}


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:10]


def secret_env(name: str, secret: str, key: str, optional: bool = False) -> dict[str, Any]:
    ref: dict[str, Any] = {"name": secret, "key": key}
    if optional:
        ref["optional"] = True
    return {"name": name, "valueFrom": {"secretKeyRef": ref}}


class _Dumper(yaml.SafeDumper):
    """Block style, keys in the order written, multi-line strings (a config file) as literal blocks, and
    no anchors: a list used twice is written out twice, as a reviewer reads it."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _text(dumper: yaml.SafeDumper, value: str) -> yaml.Node:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _text)


def to_yaml(manifests: Iterable[Manifest]) -> str:
    """One YAML stream, ``---`` between documents; the same manifests give the same bytes."""
    return yaml.dump_all(list(manifests), Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                         explicit_start=True, width=120)


def file_name(manifest: Manifest) -> str:
    return f"{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"


def write_manifests(manifests: list[Manifest], directory: str | Path) -> list[Path]:
    """One file per object (``<kind>-<name>.yaml``), for ``kubectl apply -f DIR`` and for review."""
    folder = Path(directory)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"bad value output={str(directory)!r}: {exc.strerror}") from None
    paths = []
    for manifest in manifests:
        path = folder / file_name(manifest)
        path.write_text(to_yaml([manifest]))
        paths.append(path)
    return paths
