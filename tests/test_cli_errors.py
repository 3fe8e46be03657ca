"""Bad input exits 2 with one line naming the value; a crashing worker exits 1 with its error once."""

import socket
from pathlib import Path

import pytest

from mlscale import TrainConfig, __version__, fit
from mlscale.cli import main
from mlscale.registry import Registry, register_run
from tests.helpers import refused, run_cli


@pytest.mark.parametrize(("args", "named"), [
    (["--workers", "0"], "workers=0"),
    (["--batch-size", "0"], "batch-size=0"),
    (["--task", "nope"], "task='nope'"),
    (["--task", "no.such.module:make"], "no.such.module"),
    (["--strategy", "nope"], "strategy='nope'"),
    (["--dtype", "float16"], "dtype='float16'"),
    (["--fault", "explode:rank=1"], "fault='explode:rank=1'"),
    (["--fault", "kill:rank=1"], "missing step"),
    (["--fault", "hang:rank=1:step=x"], "step must be a number"),
    (["--collective-timeout", "0"], "collective-timeout=0"),
    (["--keep-checkpoints", "0"], "keep-checkpoints=0"),
    (["--config", "/no/such/file.toml"], "/no/such/file.toml"),
    (["--task", "digits", "--task-opt", "model=rnn"], "rnn"),
    (["--batch-size", "5000"], "batch-size=5000"),
    (["--workers", "2", "--batch-size", "1000"], "batch-size=1000"),
    (["--fault", "kill:rank=5:step=2"], "rank 5 does not exist"),
    (["--device", "cuda"], "device='cuda'"),
    (["--task", "synthetic", "--task-opt", "width=abc"], "task-opt width='abc': must be int"),
    (["--task", "synthetic", "--task-opt", "widht=8"], "has no option 'widht'"),
    (["--register", "a/b"], "name='a/b'"),
    (["--min-replicas", "2"], "an option of --fault-tolerance per-step"),
    (["--fault-tolerance", "per-step", "--strategy", "tp", "--workers", "2"],
     "an option of --strategy ddp or fsdp, not of --strategy tp"),
    (["--fault-tolerance", "per-step", "--workers", "2", "--min-replicas", "3"], "min-replicas=3"),
    (["--fault-tolerance", "per-step", "--workers", "2", "--group-size", "2"], "group-size=2"),
    (["--fault-tolerance", "per-step", "--log", "tensorboard"], "log='tensorboard'"),
    (["--fault-tolerance", "per-step", "--bucket-mb", "5"], "bucket-mb=5"),
    (["--fault-tolerance", "per-step", "--lighthouse", "http://h:1", "--heartbeat-timeout-ms", "200"],
     "torchft_lighthouse --heartbeat_timeout_ms"),
    (["--fault-tolerance", "per-step", "--workers", "2", "--fault", "kill_in_step:rank=2:step=3"],
     "rank 2 does not exist"),
])
def test_bad_values_exit_2_with_one_line_naming_them(args, named, capsys, tmp_path):
    code = main(["train", *args, "--steps", "1", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert named in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists(), "a rejected config must not leave a run behind"


@pytest.mark.parametrize(("args", "named"), [
    (["bench", "train", "--workers", "0"], "--workers: 0 is less than 1"),
    (["bench", "train", "--steps", "3"], "--steps: 3 is less than 6"),
    (["bench", "export", "--batch-sizes", "0"], "--batch-sizes: 0 is less than 1"),
    (["bench", "checkpoint", "--every", "0"], "--every: 0 is less than 1"),
    (["bench", "serve", "--models", "nope"], "--models: nope: expected comma-separated names from digits-mlp"),
    (["bench", "serve", "--systems", "mlscale,triton"], "--systems: triton: expected"),
    (["bench", "serve", "--repeats", "0"], "--repeats: 0 is less than 1"),
    (["bench", "serve", "--checks", "overload", "--systems", "fastapi"], "bad value checks=overload"),
    (["train", "--workers", "two"], "--workers: invalid int value: 'two'"),
    (["train", "--worker", "2"], "unrecognized arguments: --worker 2"),  # no abbreviations
    (["models", "list", "--jsn"], "mlscale models list: error: unrecognized arguments: --jsn"),
    (["serve", "models:/m/1", "--port", "eighty"], "--port: invalid int value"),
    (["models", "list", "--registry", "/nonexistent/registry"], "no registry at '/nonexistent/registry'"),
])
def test_every_mistake_is_one_line_exit_2_and_no_work(args, named, tmp_path):
    result = refused(*args, *(["--out", str(tmp_path / "out")] if args[0] == "bench" else []))
    assert result.returncode == 2, result.stderr
    assert named in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr and "usage:" not in result.stderr
    assert not (tmp_path / "out").exists() and not Path("/nonexistent").exists()


def test_a_refused_job_with_register_leaves_no_registry_behind(tmp_path):
    result = run_cli("train", "--batch-size", "5000", "--register", "digits", "--registry", str(tmp_path / "reg"),
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "batch-size=5000" in result.stderr
    assert not (tmp_path / "reg").exists() and not (tmp_path / "run").exists()


def test_benchmarks_never_write_over_the_committed_results_by_default():
    from mlscale.cli import build_parser

    for name in ("train", "checkpoint", "export", "serve"):
        args = build_parser().parse_args(["bench", name])
        assert args.out.startswith(f"runs/bench-{name}-"), args.out


def test_bench_serve_help_states_its_duration_and_offers_quick():
    result = run_cli("bench", "serve", "--help")
    assert result.returncode == 0 and "about 35 minutes" in result.stdout and "--quick" in result.stdout


def test_version():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.strip() == f"mlscale {__version__}"


def test_a_port_in_use_is_one_line_exit_1_and_no_serving_line(tmp_path):
    fit(TrainConfig(task="digits", steps=2, run_dir=str(tmp_path / "run")))
    register_run(Registry(str(tmp_path / "registry")), tmp_path / "run", "digits")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_cli("serve", "models:/digits/1", "--port", str(port), "--registry", str(tmp_path / "registry"))
    assert result.returncode == 1
    assert result.stderr.strip() == (f"mlscale: cannot serve on 127.0.0.1:{port}: the port is already in use "
                                     "(another server?); choose another with --port")


def test_unknown_key_in_config_file(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text('task = "digits"\nwrokers = 2\n')
    assert main(["train", "--config", str(config)]) == 2
    assert "unknown configuration key 'wrokers'" in capsys.readouterr().err


def test_config_file_values_are_used_and_flags_override_them(tmp_path):
    from mlscale.config import build_config

    config = tmp_path / "run.toml"
    config.write_text('task = "synthetic"\nbatch_size = 8\n[task_options]\nwidth = 16\n')
    built = build_config(config, batch_size=4)
    assert built.task == "synthetic" and built.task_options == {"width": 16} and built.batch_size == 4


def test_bad_usage_from_the_shell_prints_no_traceback():
    result = run_cli("train", "--workers", "0")
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and "workers=0" in result.stderr


def test_a_crashing_worker_fails_the_job_with_its_error_shown_once(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "tests.helpers:exploding_task", "--workers", "2", "--steps", "10",
                     "--run-dir", str(run_dir), timeout=120)
    assert result.returncode == 1
    assert result.stderr.count("boom on rank 1 at step 3") == 1, result.stderr
    assert "worker rank 1 failed: RuntimeError" in result.stderr
    assert "Traceback" not in result.stderr
    assert "boom" in (run_dir / "logs" / "rank1.traceback.txt").read_text()
    assert '"status": "failed"' in (run_dir / "report.json").read_text()


def test_a_killed_worker_without_restarts_fails_the_job_naming_the_rank(tmp_path):
    result = run_cli("train", "--task", "digits", "--workers", "2", "--steps", "10", "--fault", "kill:rank=1:step=4",
                     "--run-dir", str(tmp_path / "run"), timeout=120)
    assert result.returncode == 1
    assert "worker rank 1 was killed by SIGKILL" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
