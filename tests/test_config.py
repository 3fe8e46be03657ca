"""Every training option is declared once: the flags, the file keys (flat or nested) and the refusals all
come from the options models."""

from __future__ import annotations

import json

import pytest

from mlscale.cli import main
from mlscale.cli.train import FLAGS_PATH, flag_table
from mlscale.config import GROUP_OF, GROUPS, TrainConfig, build_config
from mlscale.errors import UsageError


def test_the_committed_flag_table_is_the_models_own():
    assert json.loads(FLAGS_PATH.read_text()) == flag_table(), "run `make flags` after changing mlscale/config.py"


def test_every_option_has_a_flag_with_its_help_and_default():
    rows = {row["dest"]: row for row in flag_table()}
    options = set(GROUP_OF) | {name for name in TrainConfig.model_fields if name not in GROUPS}
    assert set(rows) == options
    for name in ("lr_schedule", "momentum", "weight_decay", "warmup_steps"):  # missing from earlier versions
        assert rows[name]["flag"] == f"--{name.replace('_', '-')}" and rows[name]["help"]
    assert "(default 0.9)" in rows["momentum"]["help"]


def test_the_nested_form_and_the_flat_keys_give_the_same_configuration(tmp_path):
    nested, flat = tmp_path / "nested.toml", tmp_path / "flat.toml"
    nested.write_text('strategy = "pipeline"\nworkers = 4\n[pipeline]\nstages = 4\nmicrobatches = 8\n'
                      "[optim]\nmomentum = 0.5\n")
    flat.write_text('strategy = "pipeline"\nworkers = 4\nstages = 4\nmicrobatches = 8\nmomentum = 0.5\n')
    a, b = build_config(nested), build_config(flat)
    assert a == b and a.pipeline.stages == 4 and a.optim.momentum == 0.5
    # a flag overrides the file's value by the same name, leaving the group's other values as they were
    c = build_config(nested, stages=2)
    assert (c.pipeline.stages, c.pipeline.microbatches) == (2, 8)


@pytest.mark.parametrize(("flags", "message"), [
    (["--stages", "4"], "bad value stages=4: an option of --strategy pipeline, not of --strategy ddp"),
    (["--strategy", "fsdp", "--sync", "ssp"],
     "bad value sync='ssp': an option of --strategy ps, not of --strategy fsdp"),
    (["--strategy", "ps", "--compress", "fp16"], "an option of --strategy ddp, not of --strategy ps"),
    (["--strategy", "tp", "--grad-accum", "1", "--eval-every", "2", "--clip-grad-norm", "1"],
     "bad value clip-grad-norm=1.0: an option of --strategy ddp or fsdp, not of --strategy tp"),
    (["--strategy", "pipeline", "--grad-accum", "2"], "grad-accum=2: an option of --strategy ddp or fsdp or tp"),
])
def test_an_option_of_another_strategy_is_refused_naming_both(flags, message, capsys, tmp_path):
    assert main(["train", *flags, "--check", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_the_same_refusal_from_a_file_and_from_the_api(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[ps]\nstaleness = 5\n")
    with pytest.raises(UsageError, match="staleness=5: an option of --strategy ps"):
        build_config(path)
    with pytest.raises(UsageError, match="staleness=5: an option of --strategy ps"):
        TrainConfig(staleness=5)


def test_config_json_is_nested_and_reads_back_equal():
    config = TrainConfig(strategy="ps", sync="ssp", staleness=2, faults=["slow:rank=1:delay_ms=5"])
    saved = config.model_dump(mode="json")
    assert saved["ps"] == {"sync": "ssp", "staleness": 2, "ps_servers": 1, "backup_workers": 0}
    assert saved["recovery"]["faults"] == ["slow:rank=1:delay_ms=5"]  # the spec as given
    again = TrainConfig(**json.loads(json.dumps(saved)))
    assert again == config and again.recovery.faults[0].delay_ms == 5.0


def test_mlscale_train_help_is_built_without_the_models():
    """The flags come from the generated table: `mlscale train --help` imports no pydantic, no torch."""
    import subprocess
    import sys

    from tests.helpers import REPO

    script = ("import contextlib, io, json, sys\nfrom mlscale.cli import build_parser\n"
              "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
              "    build_parser().parse_args(['train', '--help'])\nprint(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=60)
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert "mlscale.cli.train" in loaded
    assert not {m for m in loaded if m.startswith(("pydantic", "torch", "mlscale.config", "numpy"))}
