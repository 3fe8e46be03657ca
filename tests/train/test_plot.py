"""`mlscale train` ends with a picture of the run, and `--json` with the report itself."""

import json

from tests.helpers import run_cli


def test_train_draws_training_png_into_the_run_directory_and_prints_the_report_as_json(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "digits", "--steps", "30", "--run-dir", str(run_dir), "--json", plot=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    png = run_dir / "plots" / "training.png"
    assert report["plot"] == str(png) and report["steps"] == 30 and report["status"] == "completed"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000  # three panels drawn, not an empty canvas


def test_no_plot_skips_it(tmp_path):
    result = run_cli("train", "--task", "digits", "--steps", "5", "--run-dir", str(tmp_path / "run"), "--no-plot")
    assert result.returncode == 0 and "training.png" not in result.stdout
    assert not (tmp_path / "run" / "plots").exists()
