"""The serve-lengths benchmark runs end to end and writes JSON + PNG (tiny sizes: a smoke test): padded
batches hold several requests of different lengths and answer each as it is answered alone."""

import json

from mlscale.cli import main


def test_bench_serve_lengths_writes_json_and_png_and_padding_changes_no_answer(tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "serve-lengths", "--out", str(out), "--repeats", "1", "--requests", "48", "--clients", "8",
                 "--min-length", "4", "--max-length", "12", "--dim", "16", "--spreads", "1.5"])
    assert code == 0
    result = json.loads((out / "serve-lengths.json").read_text())
    assert list(result["median"]) == ["alone", "group", "pad-longest", "pad-x1.5"]
    assert result["median"]["alone"]["requests_per_batch"] == 1
    assert result["median"]["pad-longest"]["requests_per_batch"] > 1
    assert result["padded_vs_alone"]["max_abs_diff"] < 1e-5
    assert (out / "serve-lengths.png").read_bytes()[:4] == b"\x89PNG"
