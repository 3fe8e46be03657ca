"""Gradient compression through DDP communication hooks: the bytes each rank sends, measured in the hook
from the tensors it all-reduces, shrink as promised, and the model trains as well as uncompressed."""

from __future__ import annotations

import json

import pytest

from tests.helpers import refused, run_cli

BASE = ["train", "--task", "digits", "--workers", "2", "--steps", "150", "--no-progress"]


def train(run_dir, *extra):
    result = run_cli(*BASE, "--run-dir", str(run_dir), *extra, timeout=180)
    assert result.returncode == 0, result.stderr
    return json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    return train(tmp_path_factory.mktemp("compress") / "none")


@pytest.mark.parametrize("compress", ["fp16", "bf16"])
def test_16_bit_compression_sends_half_the_bytes_and_trains_the_same(compress, uncompressed, tmp_path):
    report = train(tmp_path / "run", "--compress", compress)
    sent, baseline = report["communication"], uncompressed["communication"]
    assert sent["compress"] == compress and sent["bytes_sent"] * 2 == baseline["bytes_sent"] > 0
    assert abs(report["eval"]["loss"] - uncompressed["eval"]["loss"]) <= 0.02 * uncompressed["eval"]["loss"]


def test_powersgd_sends_a_fraction_of_the_bytes_and_trains_within_tolerance(uncompressed, tmp_path):
    report = train(tmp_path / "run", "--compress", "powersgd")
    # 10 plain steps first, then rank-2 factors: about an eighth of the bytes over the run
    assert report["communication"]["bytes_sent"] < 0.25 * uncompressed["communication"]["bytes_sent"]
    assert report["eval"]["loss"] <= 1.15 * uncompressed["eval"]["loss"]


@pytest.mark.parametrize(("flags", "message"), [
    (["--strategy", "fsdp", "--compress", "fp16"], "not of --strategy fsdp (a DDP communication hook"),
    (["--compress", "powersgd", "--fp16"], "poison PowerSGD's error feedback"),
])
def test_compression_it_cannot_do_right_is_refused_before_any_process_starts(flags, message, tmp_path):
    result = refused("train", "--task", "digits", "--workers", "2", *flags, "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and message in result.stderr, result.stderr
