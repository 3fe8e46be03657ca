"""Pods of a rendered manifest, run as local processes the way a kubelet would run them.

A pod here is its containers' exact commands, each in its own PID, mount and UTS namespace
(``unshare``): the pod's hostname; its volumes mounted at their paths (a ConfigMap as a folder of
its keys, a PersistentVolumeClaim as a folder every pod shares, an emptyDir of medium Memory as a
tmpfs); an ``/etc/hosts`` with a loopback address per pod (127.0.0.10 + index) for its full name and
its hostname, the lines the kubelet writes for a pod's own name, here for every pod since there is no
cluster DNS to answer for the others (so only full names resolve across pods, as with cluster DNS
and a headless Service, plus the short hostname); the container's environment (literal values,
Secret keys, the downward API's namespace and name) with ``$(VAR)`` expanded in the command as the
kubelet does; ``JOB_COMPLETION_INDEX`` for an Indexed Job. Killing a pod kills its
PID namespace: every process in it, as when a node is lost. The "image" is this test run's Python
environment (its ``bin`` first on PATH). The network is the machine's, shared by the pods.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.conftest import unavailable

NAMESPACE = "default"
# a user namespace where this user is not root: mounts and the hostname are then allowed inside
_UNSHARE = ["unshare", "--pid", "--fork", "--kill-child", "--mount", "--uts",
            *([] if os.geteuid() == 0 else ["--map-root-user"])]
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def require_namespaces() -> None:
    """Skip (fail in CI) where this user cannot make PID, mount and UTS namespaces."""
    if shutil.which("unshare") is None:
        unavailable("no unshare command (util-linux): pods cannot be imitated here")
    probe = subprocess.run([*_UNSHARE, "sh", "-c", "mount -t tmpfs probe /mnt && hostname probe"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        unavailable(f"cannot make PID, mount and UTS namespaces here ({probe.stderr.strip()})")


def by_kind(manifests: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind)


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """``$(VAR)`` from the container's environment, as the kubelet expands command and args."""
    return [_VAR.sub(lambda m: env.get(m[1], m[0]), arg) for arg in args]


def hosts_file(path: Path, pod_names: list[str], subdomain: str) -> Path:
    lines = ["127.0.0.1 localhost"]
    for index, name in enumerate(pod_names):
        fqdn = f"{name}.{subdomain}.{NAMESPACE}.svc.cluster.local"
        lines.append(f"127.0.0.{10 + index} {fqdn} {name}")
    path.write_text("\n".join(lines) + "\n")
    return path


class Pod:
    """One pod of a pod template: ``start(container)`` runs a container's command in the pod."""

    def __init__(self, template: dict[str, Any], name: str, workdir: Path, claims: dict[str, Path],
                 hosts: Path, env: dict[str, str] | None = None,
                 secrets: dict[str, dict[str, str]] | None = None) -> None:
        self.spec, self.name, self.hosts = template["spec"], name, hosts
        self.extra_env, self.secrets = env or {}, secrets or {}
        self.volumes = self._materialize(workdir, claims)
        self.process: subprocess.Popen | None = None
        self.log = workdir / f"{name}.log"

    def _materialize(self, workdir: Path, claims: dict[str, Path]) -> dict[str, tuple[str, Path | None]]:
        """Volume name -> ("bind", folder) or ("tmpfs", None)."""
        out: dict[str, tuple[str, Path | None]] = {}
        for volume in self.spec.get("volumes", []):
            if "configMap" in volume:
                out[volume["name"]] = ("bind", workdir / "configmaps" / volume["configMap"]["name"])
            elif "persistentVolumeClaim" in volume:
                out[volume["name"]] = ("bind", claims[volume["persistentVolumeClaim"]["claimName"]])
            elif volume.get("emptyDir", {}).get("medium") == "Memory":
                out[volume["name"]] = ("tmpfs", None)
            elif "emptyDir" in volume:
                folder = workdir / "emptydir" / self.name / volume["name"]
                folder.mkdir(parents=True, exist_ok=True)
                out[volume["name"]] = ("bind", folder)
            else:
                raise AssertionError(f"volume kind not imitated: {volume}")
        return out

    def container(self, name: str) -> dict[str, Any]:
        return next(c for c in self.spec.get("initContainers", []) + self.spec["containers"] if c["name"] == name)

    def environment(self, container: dict[str, Any]) -> dict[str, str]:
        image_bin = str(Path(sys.executable).parent)
        env = {"PATH": f"{image_bin}:/usr/local/bin:/usr/bin:/bin", "HOME": os.environ.get("HOME", "/root"),
               "HOSTNAME": self.name, "LANG": "C.UTF-8", **self.extra_env}
        for item in container.get("env", []):
            if "value" in item:
                env[item["name"]] = item["value"]
                continue
            field = item["valueFrom"].get("fieldRef", {}).get("fieldPath")
            if field is not None:  # the downward API
                env[item["name"]] = {"metadata.namespace": NAMESPACE, "metadata.name": self.name}[field]
                continue
            ref = item["valueFrom"]["secretKeyRef"]  # the only other source the manifests use
            value = self.secrets.get(ref["name"], {}).get(ref["key"])
            assert value is not None or ref.get("optional"), f"secret {ref} missing: the pod would not start"
            if value is not None:
                env[item["name"]] = value
        return env

    def _script(self, container: dict[str, Any]) -> str:
        """Mount the container's volumes (under a tmpfs on /mnt, so nothing is made on the host), set
        the hostname and /etc/hosts, then exec the command."""
        steps = ["set -e", "mount -t tmpfs pod /mnt"]
        for mount in container.get("volumeMounts", []):
            path = mount["mountPath"]
            assert path.startswith("/mnt/") or path == "/dev/shm", f"mount path not imitated: {path}"
            kind, source = self.volumes[mount["name"]]
            if kind == "tmpfs":
                steps.append(f"mount -t tmpfs {shlex.quote(mount['name'])} {shlex.quote(path)}")
                continue
            steps.append(f"mkdir -p {shlex.quote(path)} && mount --bind {shlex.quote(str(source))} {shlex.quote(path)}")
            if mount.get("readOnly"):
                steps.append(f"mount -o remount,bind,ro {shlex.quote(path)}")
        steps += [f"mount --bind {shlex.quote(str(self.hosts))} /etc/hosts", f"hostname {shlex.quote(self.name)}",
                  'exec "$@"']
        return "\n".join(steps)

    def start(self, container_name: str, command: list[str] | None = None) -> subprocess.Popen:
        """``command``: the container's command as changed by the caller (default: the manifest's)."""
        container = self.container(container_name)
        env = self.environment(container)
        command = expand(command or container["command"] + container.get("args", []), env)
        argv = [*_UNSHARE, "sh", "-c", self._script(container), "pod", *command]
        with open(self.log, "a") as log:
            log.write(f"--- {container_name}: {shlex.join(command)}\n")
            log.flush()
            self.process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        return self.process

    def run(self, container_name: str, timeout: float) -> int:
        """Run a container to its end (an init container): its exit code."""
        return self.start(container_name).wait(timeout=timeout)

    def _signal_init(self, sig: int) -> None:
        """``sig`` to the PID namespace's init: the container's first process (its PID 1)."""
        pid = self.process.pid
        try:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except FileNotFoundError:
            children = []
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(child), sig)

    def terminate(self) -> None:
        """What the kubelet does first when a pod is deleted: SIGTERM to the container's PID 1."""
        if self.process is not None and self.process.poll() is None:
            self._signal_init(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the pod's PID namespace: every process in it dies at once (its init's death takes them)."""
        if self.process is None or self.process.poll() is not None:
            return
        self._signal_init(signal.SIGKILL)
        self.process.kill()
        self.process.wait(timeout=30)


def write_config_maps(manifests: list[dict[str, Any]], workdir: Path) -> None:
    for manifest in manifests:
        if manifest["kind"] == "ConfigMap":
            folder = workdir / "configmaps" / manifest["metadata"]["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for key, text in manifest["data"].items():
                (folder / key).write_text(text)


def job_pods(manifests: list[dict[str, Any]], workdir: Path, claims: dict[str, Path]) -> list[Pod]:
    """The pods an Indexed Job makes: ``<job>-<index>`` in the Job's subdomain, with JOB_COMPLETION_INDEX."""
    job = by_kind(manifests, "Job")
    name, spec = job["metadata"]["name"], job["spec"]
    assert spec["completionMode"] == "Indexed"
    template = spec["template"]
    names = [f"{name}-{index}" for index in range(spec["completions"])]
    write_config_maps(manifests, workdir)
    hosts = hosts_file(workdir / "hosts", names, template["spec"]["subdomain"])
    return [Pod(template, pod_name, workdir, claims, hosts, env={"JOB_COMPLETION_INDEX": str(index)})
            for index, pod_name in enumerate(names)]
