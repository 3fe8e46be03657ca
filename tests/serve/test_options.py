"""One validated options model for the server: the Python API refuses what the CLI refuses."""

import pytest
from pydantic import ValidationError

from mlscale.cli import main
from mlscale.serve import ServeOptions


@pytest.mark.parametrize(("field", "value"), [
    ("max_batch_size", 0), ("queue_limit", 0), ("threads", 0), ("port", 70000), ("slo_ms", 0),
    ("max_delay_ms", -1), ("cache_mb", -1), ("timeout_ms", 0), ("drain_delay_s", -1), ("exec_timeout_s", 0),
    ("runtime", "tensorrt"), ("reload_interval_s", 0), ("read_timeout_s", 0), ("header_timeout_s", 0),
    ("keep_alive_s", 0), ("max_connections", 0), ("max_inflight_mb", 0), ("store_timeout_ms", 0),
])
def test_a_bad_value_is_refused_by_the_python_api_and_by_the_cli_with_one_line(field, value, capsys):
    with pytest.raises(ValidationError):
        ServeOptions(**{field: value})
    flag = "--" + field.replace("_", "-")
    if field == "runtime":
        with pytest.raises(SystemExit):  # argparse's choices
            main(["serve", "models:/m/1", flag, str(value)])
        return
    assert main(["serve", "models:/m/1", flag, str(value)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"mlscale: error: bad value {field.replace('_', '-')}={value}") and "\n" not in err


def test_options_are_immutable_and_unknown_ones_are_refused():
    options = ServeOptions(max_batch_size=8)
    with pytest.raises(ValidationError):
        options.max_batch_size = 0
    with pytest.raises(ValidationError):
        ServeOptions(max_batchsize=8)


def test_max_inflight_below_one_largest_body_is_refused():
    with pytest.raises(ValidationError, match="below max-body-mb"):
        ServeOptions(max_inflight_mb=4, max_body_mb=8)


def test_the_online_store_comes_from_the_environment_when_no_flag_gives_it(monkeypatch):
    from mlscale.cli import build_parser
    from mlscale.cli.serve import options_from_args

    monkeypatch.setenv("MLSCALE_ONLINE_STORE", "redis://:hunter2@store.example:6379/0")
    args = build_parser().parse_args(["serve", "models:/m/1"])
    assert options_from_args(args).online_store == "redis://:hunter2@store.example:6379/0"
    args = build_parser().parse_args(["serve", "models:/m/1", "--online-store", "/data/online.db"])
    assert options_from_args(args).online_store == "/data/online.db"  # the flag wins


def test_the_route_secret_is_random_per_server_unless_the_environment_gives_it(monkeypatch):
    """Never a flag (a secret on a command line is in every process listing): the environment, else drawn."""
    from mlscale.cli import build_parser
    from mlscale.cli.serve import options_from_args
    from mlscale.errors import UsageError

    monkeypatch.delenv("MLSCALE_ROUTE_SECRET", raising=False)
    args = build_parser().parse_args(["serve", "models:/m/1"])
    assert options_from_args(args).route_secret != options_from_args(args).route_secret
    monkeypatch.setenv("MLSCALE_ROUTE_SECRET", "s3cret-of-the-fleet-2024")
    assert options_from_args(args).route_secret == "s3cret-of-the-fleet-2024"
    with pytest.raises(ValidationError):
        ServeOptions(route_secret="short")
    monkeypatch.setenv("MLSCALE_ROUTE_SECRET", "hunter2")
    with pytest.raises(UsageError, match="has 7 characters") as refused:
        options_from_args(args)
    assert "hunter2" not in str(refused.value)
