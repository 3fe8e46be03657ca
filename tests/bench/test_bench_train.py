"""The training benchmark runs end to end and writes JSON + PNG (tiny sizes: a smoke test, not a measurement)."""

import json

from mlscale.cli import main


def test_bench_train_writes_json_and_png(tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["bench", "train", "--out", str(out), "--workers", "1", "--repeats", "2", "--steps", "8",
                 "--width", "32", "--batch-size", "16"])
    assert code == 0
    result = json.loads((out / "train.json").read_text())
    row = result["world_sizes"]["1"]
    assert len(row["ours_samples_per_s"]) == len(row["plain_samples_per_s"]) == 2
    assert row["ratio_ours_over_plain"]["median"] > 0
    assert result["machine"]["torch"]
    assert (out / "train.png").read_bytes()[:4] == b"\x89PNG"
