"""The checkpoint benchmark runs end to end and writes JSON + PNG (tiny sizes: a smoke test)."""

import json

from mlscale.cli import main


def test_bench_checkpoint_writes_json_and_png(tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "checkpoint", "--out", str(out), "--repeats", "1", "--steps", "6", "--every", "2",
                 "--width", "64", "--depth", "2"])
    assert code == 0
    result = json.loads((out / "checkpoint.json").read_text())
    assert set(result["median"]) == {"blocking", "async"}
    assert result["median"]["blocking"]["stall_ms_p50"] > 0 and result["median"]["async"]["write_ms_p50"] > 0
    assert (out / "checkpoint.png").read_bytes()[:4] == b"\x89PNG"
