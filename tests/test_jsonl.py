"""JSONL record files (metrics.jsonl, logs/*.jsonl): a line torn by a process killed mid-write is
skipped on read and cut off before the next append, so a resumed run's records stay readable."""

from __future__ import annotations

import json

import pytest

from mlscale.cli import main
from mlscale.common.io import append_jsonl, read_jsonl, repair_jsonl
from mlscale.errors import MlscaleError
from mlscale.rundir import RunDir

TORN = b'{"step": 3, "loss": 0.4'


def test_a_torn_last_line_is_skipped_on_read(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n{"step": 2}\n' + TORN)
    assert read_jsonl(path) == [{"step": 1}, {"step": 2}]
    path.write_bytes(b'{"step": 1}\n' + TORN + b"\n\n")  # torn, then ended by a newline: still the last line
    assert read_jsonl(path) == [{"step": 1}]
    assert read_jsonl(tmp_path / "none.jsonl") == []


def test_a_torn_last_line_is_repaired_before_appending(tmp_path):
    path = tmp_path / "logs" / "faults.jsonl"
    append_jsonl(path, {"step": 1})
    with path.open("ab") as handle:
        handle.write(TORN)
    append_jsonl(path, {"step": 3})
    assert path.read_bytes() == b'{"step": 1}\n{"step": 3}\n'
    path.write_bytes(b"x" * 70_000)  # a torn first line longer than one block read from the end
    append_jsonl(path, {"step": 4})
    assert path.read_bytes() == b'{"step": 4}\n'


def test_a_writer_that_keeps_the_file_open_repairs_it_once_before(tmp_path):
    path = tmp_path / "logs" / "replica0.jsonl"
    repair_jsonl(path)  # no file yet: nothing to do
    path.parent.mkdir()
    path.write_bytes(b'{"event": "start"}\n' + TORN)
    repair_jsonl(path)
    with path.open("a", buffering=1) as handle:
        handle.write(json.dumps({"event": "step"}) + "\n")
    assert read_jsonl(path) == [{"event": "start"}, {"event": "step"}]


def test_a_damaged_line_before_the_last_is_one_line_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MlscaleError, match=r"metrics.jsonl:2 is not a JSON record"):
        read_jsonl(path)


def test_run_dir_metrics_skip_and_repair_a_torn_line(tmp_path):
    run = RunDir(tmp_path)
    run.append_metrics({"step": 1})
    with run.metrics_path.open("ab") as handle:
        handle.write(TORN)
    assert run.read_metrics() == [{"step": 1}]
    run.append_metrics({"step": 2})
    assert run.read_metrics() == [{"step": 1}, {"step": 2}]


def test_a_run_resumed_after_a_torn_metrics_line_finishes_with_exit_0(tmp_path, capsys):
    run_dir = str(tmp_path / "run")
    common = ["--task", "digits", "--steps", "6", "--checkpoint-every", "2", "--log-every", "1", "--run-dir", run_dir,
              "--no-progress"]
    assert main(["train", *common]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(b"".join(lines[:3]) + lines[3][:9])  # killed while writing the 4th line
    assert main(["train", *common, "--resume", "--steps", "8"]) == 0, capsys.readouterr().err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # every line parses
    assert records[-1]["step"] == 8 and [r["step"] for r in records[:3]] == [1, 2, 3]
