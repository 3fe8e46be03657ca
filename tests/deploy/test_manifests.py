"""`mlscale k8s train|serve`: the rendered manifests are the reviewed golden files, byte for byte, and
every one passes ``kubernetes-validate --strict`` against the oldest Kubernetes they support and the
newest the validator knows; bad input exits 2 with one line.

After an intended change: ``MLSCALE_UPDATE_GOLDEN=1 pytest tests/deploy/test_manifests.py``, then
review the diff of tests/deploy/golden/.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from mlscale.cli import main
from mlscale.deploy import MIN_KUBERNETES
from mlscale.deploy.serving import FINISH_IN_FLIGHT_S, ServingDeployment
from mlscale.serve.core import GRPC_GRACE_S
from tests.helpers import REPO

GOLDEN = Path(__file__).parent / "golden"
IMAGE = "registry.example.com/mlscale:0.1.0"
NEWEST_KUBERNETES = "1.37"
CASES = {
    "train-gpu": ["k8s", "train", "--config", "examples/digits.toml", "--nodes", "4", "--gpus-per-node", "8",
                  "--image", f"{IMAGE}-cuda", "--checkpoint-volume", "mlscale-runs", "--namespace", "ml",
                  "--memory", "256Gi", "--register", "digits", "--data-volume", "mlscale-data"],
    "train-cpu": ["k8s", "train", "--config", "examples/digits.toml", "--nodes", "2", "--cpu", "4", "--memory", "8Gi",
                  "--image", IMAGE, "--checkpoint-volume", "mlscale-runs"],
    "train-s3": ["k8s", "train", "--config", "examples/images-s3.toml", "--nodes", "2", "--cpu", "8", "--memory",
                 "16Gi", "--image", IMAGE, "--checkpoint-volume", "mlscale-runs", "--data-secret", "s3-credentials"],
    "serve": ["k8s", "serve", "models:/digits@production", "--image", IMAGE, "--replicas", "2"],
    "serve-pending": ["k8s", "serve", "models:/digits@production", "--image", IMAGE, "--replicas", "3",
                      "--max-replicas", "12", "--autoscale", "pending-requests", "--namespace", "ml", "--gpus", "1",
                      "--registry-volume", "mlscale-registry", "--", "--max-batch-size", "64", "--slo-ms", "50",
                      "--timeout-ms", "20000"],
    "serve-fixed": ["k8s", "serve", "models:/digits/3", "--image", f"{IMAGE}@sha256:{'0' * 64}", "--replicas", "2",
                    "--max-replicas", "2", "--no-grpc", "--drain-delay-s", "15"],
}


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def mlscale(*args: str, registry: str = "/nonexistent-registry") -> Result:
    """The command in this process (the same ``main`` as the ``mlscale`` script), from the repository root."""
    out, err = io.StringIO(), io.StringIO()
    saved, cwd = os.environ.get("MLSCALE_REGISTRY"), os.getcwd()
    os.environ["MLSCALE_REGISTRY"] = registry
    try:
        os.chdir(REPO)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exc:  # argparse's way out (exit 2 on a bad flag)
                code = exc.code
    finally:
        os.chdir(cwd)
        if saved is None:
            os.environ.pop("MLSCALE_REGISTRY")
        else:
            os.environ["MLSCALE_REGISTRY"] = saved
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    """Each case rendered with -o DIR (one file per object); its stdout form is the same YAML."""
    root = tmp_path_factory.mktemp("rendered")
    out = {}
    for case, args in CASES.items():
        result = mlscale(*args[:2], "-o", str(root / case), *args[2:])  # flags after -- are mlscale serve's
        assert result.returncode == 0, result.stderr
        out[case] = root / case
    return out


def test_the_manifests_are_the_reviewed_golden_files(rendered):
    if os.environ.get("MLSCALE_UPDATE_GOLDEN") == "1":
        shutil.rmtree(GOLDEN, ignore_errors=True)
        for case, folder in rendered.items():
            shutil.copytree(folder, GOLDEN / case)
    for case, folder in rendered.items():
        names = sorted(p.name for p in folder.iterdir())
        assert names == sorted(p.name for p in (GOLDEN / case).iterdir()), case
        for name in names:
            assert (folder / name).read_text() == (GOLDEN / case / name).read_text(), f"{case}/{name}"


def test_stdout_is_the_same_manifests_as_the_files(rendered):
    result = mlscale(*CASES["train-cpu"])
    assert result.returncode == 0, result.stderr
    documents = list(yaml.safe_load_all(result.stdout))
    files = [yaml.safe_load(p.read_text()) for p in sorted(rendered["train-cpu"].iterdir())]
    assert sorted(documents, key=str) == sorted(files, key=str)
    assert [d["kind"] for d in documents] == ["ConfigMap", "Service", "NetworkPolicy", "Job"]


@pytest.mark.parametrize("version", [MIN_KUBERNETES, NEWEST_KUBERNETES])
def test_every_manifest_passes_kubernetes_validate_strict(version):
    validator = shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
    assert validator, "kubernetes-validate is a test dependency"
    files = sorted(str(p) for p in GOLDEN.rglob("*.yaml"))
    assert len(files) >= 14
    result = subprocess.run([validator, "--strict", "-k", f"{version}.0", *files], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    passed = [line for line in result.stdout.splitlines() if " passed for resource " in line]
    assert len(passed) == len(files), result.stdout


def test_the_job_carries_the_configs_text_and_restarts(rendered):
    job = yaml.safe_load((rendered["train-gpu"] / "job-mlscale-train-digits.yaml").read_text())
    config_map = yaml.safe_load(next(rendered["train-gpu"].glob("configmap-*.yaml")).read_text())
    assert config_map["data"]["run.toml"] == (REPO / "examples" / "digits.toml").read_text()
    assert config_map["immutable"] is True
    volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert "--max-restarts=3" in trainer["command"]  # max_restarts = 3 in the config
    assert "--nproc-per-node=8" in trainer["command"] and trainer["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    registry = next(e for e in trainer["env"] if e["name"] == "MLSCALE_REGISTRY")
    assert registry["valueFrom"]["secretKeyRef"] == {"name": "mlscale-registry", "key": "url"}


def test_a_job_reading_object_storage_takes_its_credentials_from_a_secret_it_only_names(rendered):
    import yaml

    (job,) = [doc for path in sorted(rendered["train-s3"].iterdir()) for doc in yaml.safe_load_all(path.read_text())
              if doc["kind"] == "Job"]
    pod = job["spec"]["template"]["spec"]
    for container in [*pod["initContainers"], *pod["containers"]]:
        assert container["envFrom"] == [{"secretRef": {"name": "s3-credentials"}}], container["name"]
        assert not [env for env in container.get("env", []) if env["name"].startswith("AWS_")]  # only the Secret's
    text = "".join(path.read_text() for path in rendered["train-s3"].iterdir())
    assert "s3://training-data/images/train/shard-*.tar" in text


def test_a_job_and_a_deployment_of_one_model_do_not_share_an_object_name(rendered):
    """The guide's flow, train then serve in one namespace: their default names must not collide."""
    objects = [(m["kind"], m["metadata"]["name"]) for case in ("train-cpu", "serve")
               for m in (yaml.safe_load(p.read_text()) for p in rendered[case].iterdir())]
    assert len(objects) == len(set(objects)), objects


def test_the_serving_pod_drains_within_its_grace_period(rendered):
    deployment = yaml.safe_load((rendered["serve-fixed"] / "deployment-mlscale-digits.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    drain = float(command[command.index("--drain-delay-s") + 1])
    assert drain == 15 and pod["terminationGracePeriodSeconds"] == drain + FINISH_IN_FLIGHT_S + 5
    assert FINISH_IN_FLIGHT_S == GRPC_GRACE_S  # the server's own bound on finishing requests in flight
    assert deployment["spec"]["replicas"] == 2 and "--no-grpc" in command
    pending = yaml.safe_load((rendered["serve-pending"] / "deployment-mlscale-digits.yaml").read_text())
    pod = pending["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command[-6:] == ["--max-batch-size", "64", "--slo-ms", "50", "--timeout-ms", "20000"]  # after --
    assert not (rendered["serve-fixed"] / "horizontalpodautoscaler-mlscale-digits.yaml").exists()
    autoscaled = yaml.safe_load((rendered["serve"] / "deployment-mlscale-digits.yaml").read_text())
    assert "replicas" not in autoscaled["spec"]  # the autoscaler owns the count


@pytest.mark.parametrize(("args", "message"), [
    (["k8s", "train", "--nodes", "0", "--image", IMAGE], "bad value nodes=0: must be at least 1"),
    (["k8s", "train", "--nodes", "1", "--image", "mlscale"], "bad value image='mlscale': give a tag or a digest"),
    (["k8s", "train", "--nodes", "1", "--image", "localhost:5000/mlscale"],
     "bad value image='localhost:5000/mlscale': give a tag or a digest"),
    (["k8s", "train", "--nodes", "2", "--image", IMAGE], "bad value nodes=2: more than one node needs "
     "--checkpoint-volume"),
    (["k8s", "train", "--nodes", "1", "--image", IMAGE, "--config", "missing.toml"], "cannot read config file"),
    (["k8s", "train", "--nodes", "1", "--image", IMAGE, "--gpus-per-node", "8", "--procs-per-node", "2"],
     "bad value procs-per-node=2: with --gpus-per-node a pod runs one process per GPU"),
    (["k8s", "train", "--nodes", "1", "--image", IMAGE, "--name", "Bad_Name"], "bad value name='Bad_Name'"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--replicas", "0"], "bad value replicas=0"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--replicas", "3", "--max-replicas", "2"],
     "bad value max-replicas=2: must be at least --replicas (3)"),
    (["k8s", "serve", "digits", "--image", IMAGE], "bad model URI 'digits'"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--", "--port", "9"],
     "bad value '--port' after --: the manifests set --port themselves"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--", "--cache-mb", "lots"],
     "mlscale serve: error: argument --cache-mb"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--", "--port=9"], "bad value '--port=9' after --"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--", "--max-batch-size", "0"],
     "bad value max-batch-size=0"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--", "--help"], "mlscale serve: error: unrecognized"),
    (["k8s", "serve", "--image", IMAGE, "--", "models:/digits/1"], "mlscale k8s serve: error: the following"),
    (["k8s", "train", "--nodes", "1", "--image", IMAGE, "--", "--steps", "3"],
     "mlscale k8s train: error: unrecognized"),
    (["k8s", "serve", "models:/digits/1", "--image", IMAGE, "--drain-delay-s", "1e300"], "bad value drain-delay-s"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    result = mlscale(*args)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    expected = message if message.startswith("mlscale") else f"mlscale: error: {message}"
    assert len(lines) == 1 and lines[0].startswith(expected), result.stderr


def test_an_unknown_model_exits_2_when_the_registry_is_reachable(tmp_path):
    from mlscale.registry import Registry

    Registry(str(tmp_path / "registry"))  # reachable, and empty
    result = mlscale("k8s", "serve", "models:/digits@production", "--image", IMAGE, registry=str(tmp_path / "registry"))
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "digits" in lines[0], result.stderr
    unreachable = mlscale("k8s", "serve", "models:/digits@production", "--image", IMAGE)
    assert unreachable.returncode == 0 and "was not checked" in unreachable.stderr


def test_the_scale_out_guide_renders_what_it_says_and_it_validates(tmp_path):
    """docs/scale-out.md's marked blocks, in order, from a checkout's root (its examples/ copied)."""
    from tests.test_readme import readme_script

    shutil.copytree(REPO / "examples", tmp_path / "examples")
    script = readme_script((REPO / "docs" / "scale-out.md").read_text())
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "MLSCALE_REGISTRY": str(tmp_path / "no-registry-here")}
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=180)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.stdout.startswith("ok: task digits")
    kinds = {folder.name: sorted(p.name.split("-")[0] for p in folder.iterdir())
             for folder in (tmp_path / "k8s").iterdir()}
    assert kinds == {"train": ["configmap", "job", "networkpolicy", "service"],
                     "train-s3": ["configmap", "job", "networkpolicy", "service"],
                     "serve": ["deployment", "horizontalpodautoscaler", "poddisruptionbudget", "service"],
                     "serve-queue": ["deployment", "horizontalpodautoscaler", "poddisruptionbudget", "service"]}
    assert result.stdout.count(" passed for resource ") == 4  # the guide's own kubernetes-validate run
    queue = yaml.safe_load((tmp_path / "k8s/serve-queue/horizontalpodautoscaler-mlscale-digits.yaml").read_text())
    assert queue["spec"]["metrics"][0]["pods"]["metric"]["name"] == "mlscale_inference_pending_request_count"


def test_main_returns_in_a_process_that_has_its_own_process_group():
    """``main`` is the API under the ``mlscale`` command: with a group made by the caller, not by mlscale,
    it returns its exit code; only ``run`` ends a process, and only in a group mlscale made."""
    import torch.distributed as dist

    from mlscale.train.dist import owns_process_group
    from tests.serve.conftest import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        assert not owns_process_group()
        assert mlscale(*CASES["serve"]).returncode == 0
    finally:
        dist.destroy_process_group()


SECRET = "S3cr@t-pw"  # with an unencoded '@': no part of it may be shown either


@pytest.mark.parametrize("passed_on", [
    ["--online-store", f"redis://:{SECRET}@redis.example:6379/0"],
    [f"--online-store=redis://default:{SECRET}@redis.example:6379/0"],
    ["--online-store", f"rediss://redis.example:6380/0?password={SECRET}"],
    ["--feature-log", f"postgresql://u:{SECRET}@db/x"],
    ["--max-batch-size", f"redis://:{SECRET}@h"],  # refused before the serve parser could echo it
])
def test_a_url_with_credentials_after_dashdash_is_refused_and_never_written_or_printed(passed_on, tmp_path):
    result = mlscale("k8s", "serve", "models:/digits/1", "--image", IMAGE, "-o", str(tmp_path / "k8s"), "--",
                     *passed_on)
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "a URL with credentials would be written into the Deployment" in lines[0], lines
    for piece in ("S3cr", "t-pw", SECRET):
        assert piece not in result.stderr
    assert not (tmp_path / "k8s").exists()
    if passed_on[0].startswith("--online-store"):
        assert "--online-store-secret" in lines[0]


def test_an_online_store_from_a_secret_is_passed_through_the_environment_and_no_password_is_in_the_yaml():
    result = mlscale("k8s", "serve", "models:/churn/1", "--image", IMAGE, "--online-store-secret", "churn-store",
                     "--", "--max-batch-size", "16")
    assert result.returncode == 0, result.stderr
    deployment = next(m for m in yaml.safe_load_all(result.stdout) if m["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--online-store" not in container["command"]  # read from the env: never in the process's argv
    env = {e["name"]: e for e in container["env"]}
    assert env["MLSCALE_ONLINE_STORE"]["valueFrom"]["secretKeyRef"] == {"name": "churn-store", "key": "url"}
    twice = mlscale("k8s", "serve", "models:/churn/1", "--image", IMAGE, "--online-store-secret", "churn-store",
                    "--", "--online-store", "/data/online.db")
    assert twice.returncode == 2 and "--online-store-secret gives the online store already" in twice.stderr


def _serve_command(*args: str) -> list[str]:
    result = mlscale("k8s", "serve", "models:/digits/1", "--image", IMAGE, *args)
    assert result.returncode == 0, result.stderr
    deployment = next(m for m in yaml.safe_load_all(result.stdout) if m["kind"] == "Deployment")
    return deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def test_what_clients_may_hold_follows_the_pods_memory_limit_unless_given():
    small = _serve_command("--memory", "512Mi")  # a sixteenth of the limit each: bodies, connections
    assert (_flag(small, "--max-inflight-mb"), _flag(small, "--max-connections")) == ("32", "512")
    given = _serve_command("--memory", "512Mi", "--", "--max-connections", "100")
    assert given.count("--max-connections") == 1 and _flag(given, "--max-connections") == "100"
    assert _flag(given, "--max-inflight-mb") == "32"


def test_serving_workers_in_a_pod_need_the_cores_the_pod_requests(tmp_path):
    from mlscale.errors import UsageError

    with pytest.raises(UsageError, match="auto would count the node's cores"):
        ServingDeployment("digits", "models:/digits/1", IMAGE, serve_args=("--workers", "auto"))
    with pytest.raises(UsageError, match="give --cpu 4"):
        ServingDeployment("digits", "models:/digits/1", IMAGE, serve_args=("--workers=4",), cpu="2")
    ServingDeployment("digits", "models:/digits/1", IMAGE, serve_args=("--workers", "4"), cpu="4")


def test_a_language_models_engine_flags_pass_through_and_its_kv_caches_must_fit_the_pod():
    from mlscale.errors import UsageError

    result = mlscale("k8s", "serve", "models:/lm@prod", "--image", IMAGE, "--memory", "2Gi", "--",
                     "--kv-cache-mb", "512", "--max-sequences", "32")
    assert result.returncode == 0, result.stderr
    deployment = next(m for m in yaml.safe_load_all(result.stdout) if m["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert (_flag(command, "--kv-cache-mb"), _flag(command, "--max-sequences")) == ("512", "32")
    refusal = re.escape("2 worker(s)' KV caches take 2048 MiB, over the pod's memory limit 2Gi")
    with pytest.raises(UsageError, match=refusal):
        ServingDeployment("lm", "models:/lm@prod", IMAGE, memory="2Gi", cpu="2",
                          serve_args=("--kv-cache-mb=1024", "--workers", "2"))
