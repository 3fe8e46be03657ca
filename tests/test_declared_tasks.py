"""Only declared code runs: a config file, a run directory or a registry row naming any function that
was not declared as a task (``os:system``, ``subprocess:run``) is refused before it is called."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlscale import TrainConfig, UsageError, fit
from mlscale.registry import Registry, register_run
from mlscale.tasks import make_task
from tests.helpers import REPO, run_cli
from tests.serve.conftest import free_port

DANGEROUS = ["os:system", "subprocess:run", "subprocess:check_call"]


def _options(task: str, marker: Path) -> dict:
    command = f"touch {marker}"
    return {"command": command} if task == "os:system" else {"args": ["touch", str(marker)]}


def _refused_once(result: subprocess.CompletedProcess[str], marker: Path) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a declared mlscale task" in lines[0] and "@mlscale.declare_task" in lines[0]
    assert "Traceback" not in result.stderr
    assert not marker.exists(), "the undeclared function was called"


@pytest.mark.parametrize("task", DANGEROUS)
def test_a_config_file_naming_a_system_function_runs_nothing(task, tmp_path):
    marker = tmp_path / "pwned"
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"task": task, "task_options": _options(task, marker), "steps": 2}))
    _refused_once(run_cli("train", "--config", str(config), "--run-dir", str(tmp_path / "run")), marker)
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def poisoned_registry(tmp_path_factory):
    """A registry whose rows (written by a 'teammate' straight into the shared database) name os:system."""
    root = tmp_path_factory.mktemp("poisoned")
    fit(TrainConfig(task="digits", steps=2, run_dir=str(root / "run")))
    registry = Registry(str(root / "registry"))
    real = register_run(registry, root / "run", "digits")
    markers = {}
    for index, task in enumerate(DANGEROUS, start=1):
        markers[task] = root / f"pwned-{index}"
        config = {**real.config, "task": task, "task_options": _options(task, markers[task])}
        registry.create_version(f"evil{index}", {"model.safetensors": root / "run/final/model.safetensors"},
                                config=config, metrics={}, signature=real.signature)
    return str(root / "registry"), markers


@pytest.mark.parametrize("index", [1, 2, 3])
@pytest.mark.parametrize("command", [("serve", "--runtime", "torch"), ("export",), ("serve",)])
def test_a_registry_row_naming_a_system_function_runs_nothing_on_serve_or_export(index, command, poisoned_registry):
    registry, markers = poisoned_registry
    port = ("--port", str(free_port()), "--no-grpc") if command[0] == "serve" else ()
    result = run_cli(command[0], f"models:/evil{index}/1", *command[1:], *port, "--registry", registry, timeout=60)
    _refused_once(result, markers[DANGEROUS[index - 1]])


def test_registering_a_run_directory_whose_config_names_a_system_function_runs_nothing(tmp_path):
    fit(TrainConfig(task="digits", steps=2, run_dir=str(tmp_path / "run")))
    marker = tmp_path / "pwned"
    config = json.loads((tmp_path / "run/config.json").read_text())
    config.update(task="os:system", task_options=_options("os:system", marker))
    (tmp_path / "run/config.json").write_text(json.dumps(config))
    result = run_cli("models", "register", str(tmp_path / "run"), "--name", "evil", "--registry",
                     str(tmp_path / "registry"))
    _refused_once(result, marker)


def test_a_declared_factory_is_built_and_the_same_function_undeclared_is_refused():
    assert make_task("tests.declared_tasks:misbehaving", {"sleep_s": 0.1}).name == "misbehaving"
    with pytest.raises(UsageError, match="not a declared mlscale task"):
        make_task("tests.declared_tasks:undeclared")


def test_the_current_directory_is_not_put_on_the_python_path(tmp_path, monkeypatch):
    (tmp_path / "mytasks_in_cwd.py").write_text(
        "from mlscale import declare_task\n@declare_task\ndef make():\n    raise SystemExit('imported')\n")
    monkeypatch.chdir(tmp_path)
    path_before = list(sys.path)
    with pytest.raises(UsageError, match=r"cannot import 'mytasks_in_cwd'.*PYTHONPATH"):
        make_task("mytasks_in_cwd:make")
    assert sys.path == path_before


def test_a_module_in_the_current_directory_is_not_imported_even_under_python_dash_m(tmp_path):
    """``python -m`` puts the current directory first on the path; mlscale's entry points take it off."""
    marker = tmp_path / "imported"
    (tmp_path / "evil_tasks.py").write_text(f"open({str(marker)!r}, 'w').close()\n"
                                            "from mlscale import declare_task\n@declare_task\ndef make(): ...\n")
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-m", "mlscale", "train", "--task", "evil_tasks:make", "--steps", "1"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert result.returncode == 2 and "cannot import 'evil_tasks'" in result.stderr
    assert not marker.exists()


@pytest.mark.parametrize("name", ["this:x", "antigravity:x", "os.path:join", "json:loads"])
def test_a_standard_library_module_is_never_imported_for_a_task(name, capsys):
    with pytest.raises(UsageError, match="not a declared mlscale task"):
        make_task(name)
    assert "Beautiful is better" not in capsys.readouterr().out  # `this` was not imported


@pytest.mark.parametrize(("name", "says"), [(":y", "expected package.module:factory"),
                                            (".x:y", "expected package.module:factory"),
                                            ("broken_tasks:make", "importing 'broken_tasks' failed: NameError")])
def test_a_malformed_name_or_a_broken_module_is_one_line(name, says, tmp_path):
    (tmp_path / "broken_tasks.py").write_text(  # declares the task, then breaks while importing
        "from mlscale import declare_task\n@declare_task\ndef make(): ...\nundefined_name + 1\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    result = subprocess.run([sys.executable, "-m", "mlscale", "train", "--task", name, "--steps", "1"],
                            capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and says in result.stderr, result.stderr


def test_an_installed_package_declares_tasks_through_its_entry_point_group(tmp_path):
    """A package's ``[project.entry-points."mlscale.tasks"]``: the task by its entry-point name."""
    site = tmp_path / "site"
    (site / "sine_tasks-1.0.dist-info").mkdir(parents=True)
    (site / "sine_tasks-1.0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: sine-tasks\nVersion: 1.0\n")
    (site / "sine_tasks-1.0.dist-info/entry_points.txt").write_text("[mlscale.tasks]\nsine = sine_tasks:build\n")
    (site / "sine_tasks.py").write_text(  # not decorated: the entry point is the declaration
        "from examples.custom_task import make_task\n\ndef build(hidden=8):\n    return make_task(hidden=hidden)\n")
    env = {**os.environ, "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}
    result = subprocess.run([sys.executable, "-m", "mlscale", "train", "--task", "sine", "--task-opt", "hidden=4",
                             "--steps", "3", "--run-dir", str(tmp_path / "run")], capture_output=True, text=True,
                            cwd=tmp_path, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "run/config.json").read_text())["task"] == "sine"


@pytest.fixture
def program_package(tmp_path, monkeypatch):
    """A package on the path whose ``__init__`` and ``__main__`` (a program) write a marker when run,
    and a module that declares nothing: none of them may run for a name in data."""
    package = tmp_path / "somepkg"
    package.mkdir()
    marker = tmp_path / "ran"
    run = f"open({str(marker)!r}, 'a').write(__name__ + '\\n')\n"
    (package / "__init__.py").write_text(run)
    (package / "__main__.py").write_text(run + "from mlscale import declare_task\n@declare_task\ndef x(): ...\n")
    (package / "plain.py").write_text(run + "def x(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield marker
    for name in ("somepkg", "somepkg.__main__", "somepkg.plain"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("task", ["somepkg.__main__:x", "somepkg.plain:x", "somepkg:x"])
def test_a_task_name_is_checked_against_the_declared_tasks_before_anything_is_imported(task, program_package):
    with pytest.raises(UsageError, match="not a declared mlscale task"):
        make_task(task)
    assert not program_package.exists(), f"{program_package.read_text()!r} ran"
    assert "somepkg" not in sys.modules


def test_a_registry_row_naming_a_program_module_imports_nothing(program_package, poisoned_registry):
    """Through the registry's path (a version's config), not only make_task: the row is refused and no
    module of the package ran."""
    from mlscale.registry.models import load_torch_model

    registry = Registry(poisoned_registry[0])
    real = registry.resolve("models:/digits/1")
    weights = Path(real.source_run) / "final/model.safetensors"
    evil = registry.create_version("evil-main", {"model.safetensors": weights}, metrics={}, signature=real.signature,
                                   config={**real.config, "task": "somepkg.__main__:x"})
    with pytest.raises(UsageError, match="not a declared mlscale task"):
        load_torch_model(registry, evil)
    assert not program_package.exists()


def test_a_feature_service_is_checked_against_declared_repositories_before_anything_is_imported(program_package):
    from mlscale.features import load_service

    for spec in ("somepkg.__main__:svc", "somepkg.plain:svc"):
        with pytest.raises(UsageError, match="not a declared feature repository"):
            load_service(spec)
    assert not program_package.exists()


def test_a_declared_factory_in_a_module_not_yet_imported_is_found_from_its_source(tmp_path, monkeypatch):
    (tmp_path / "fresh_tasks.py").write_text(
        "import mlscale as m\nfrom mlscale import declare_task as task\n\n"
        "@task\ndef make():\n    from mlscale.tasks import make_task\n    return make_task('digits')\n\n"
        "def later():\n    return make()\n\n\nm.declare_task(later)\n\ndef other(): ...\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert make_task("fresh_tasks:make").name == "digits-mlp"
        assert make_task("fresh_tasks:later").name == "digits-mlp"
        with pytest.raises(UsageError, match="not a declared mlscale task"):
            make_task("fresh_tasks:other")
    finally:
        sys.modules.pop("fresh_tasks", None)
