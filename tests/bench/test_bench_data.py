"""``mlscale bench data``'s user-Dataset suites run end to end and write JSON + PNG (tiny sizes: a smoke test
of the measurement's plumbing and sanity, not a measurement), and the committed results plot."""

import json

from mlscale.bench import data
from mlscale.cli import main
from tests.helpers import REPO, run_cli

PNG = b"\x89PNG\r\n\x1a\n"


def test_bench_data_loaders_measures_mlscale_and_the_anchor_on_both_data_sets(tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "data", "--suite", "loaders", "--out", str(out), "--repeats", "2", "--batches", "3",
                 "--warmup", "2", "--item-ms", "0.05"])
    assert code == 0
    result = json.loads((out / "data.json").read_text())
    assert result["suites"] == ["loaders"] and result["machine"]["torch"] and result["how"] and result["notes"]
    assert "pipeline" not in result and "resume" not in result
    section = result["loaders"]
    assert section["batch_size"] == 64 and section["item_loops"] > 0
    for name in ("slow_items", "text"):
        table = section["data_sets"][name]
        configs = table["configs"]
        assert list(configs) == ["mlscale 0", "mlscale 1", "mlscale 2", "mlscale auto", "torch 0", "torch 1",
                                 "torch 2"]
        for row in configs.values():
            assert len(row["runs"]) == 2 and row["batches_per_s"] > 0 and row["first_batch_s"] > 0
            assert row["min_batches_per_s"] <= row["batches_per_s"] <= row["max_batches_per_s"]
        auto = configs["mlscale auto"]
        assert all(pick in (0, 1, 2) for pick in auto["picked"]) and auto["tuning_s"] > 0
        assert set(auto["runs"][0]["tuning_ms_per_batch"]) <= {"0", "1", "2"}
        best = table["anchor"]["config"]
        assert best.startswith("torch ") and table["anchor"]["batches_per_s"] == max(
            configs[c]["batches_per_s"] for c in configs if c.startswith("torch"))
        assert set(table["ratios"]) == {"mlscale 0", "mlscale 1", "mlscale 2", "mlscale auto"}
        assert all(0 < r["vs_anchor_best"] < 100 for r in table["ratios"].values())
        assert 0 < table["item_ms_measured"] < 50
    assert (out / "data.png").read_bytes()[:8] == PNG


def test_bench_data_resume_times_a_mid_epoch_resume_on_another_world_size_and_a_fresh_start(tmp_path):
    out = tmp_path / "out"
    code = main(["bench", "data", "--suite", "resume", "--out", str(out), "--repeats", "1", "--item-ms", "0.01",
                 "--resume-samples", "1280", "--resume-at", "3"])
    assert code == 0
    section = json.loads((out / "data.json").read_text())["resume"]
    assert (section["from_world_size"], section["to_world_size"], section["resumed_at_step"]) == (2, 3, 3)
    for side in ("fresh", "resume"):
        run = section[side]["runs"][0]
        assert 0 < run["first_step_s"] < run["wall_s"] < 600 and run["world_size"] == 3
        assert run["first_step_epoch"] == 0  # the resume's first step is mid-epoch 0
    assert section["resume"]["runs"][0]["first_step"] == 4
    assert (section["resume"]["runs"][0]["resumed_from_step"], section["resume"]["runs"][0][
        "resumed_from_world_size"]) == (3, 2)
    assert section["fresh"]["runs"][0]["first_step"] == 1
    assert section["resume_over_fresh"] > 0
    assert (out / "data.png").read_bytes()[:8] == PNG


def test_the_committed_data_results_plot_every_section(tmp_path):
    results = json.loads((REPO / "bench" / "results" / "data" / "data.json").read_text())
    assert {"pipeline", "loaders", "resume"} <= set(results)
    data.plot(results, tmp_path / "data.png")
    written = (tmp_path / "data.png").read_bytes()
    assert written[:8] == PNG and len(written) > 20_000


def test_the_images_suite_measures_every_system_and_s3_with_tiny_settings(tmp_path):
    result = run_cli("bench", "data", "--suite", "images", "--images", "200", "--image-batches", "2", "--repeats", "1",
                     "--crop", "32", "--train-steps", "2", "--rss-images", "100", "--out", str(tmp_path), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    images = json.loads((tmp_path / "data.json").read_text())["images"]
    assert {"mlscale auto", "torch 0", "ceiling"} <= set(images["images_per_s"]) and images["vs_ceiling"] > 0
    assert 0 < images["s3"]["objects_fetched"] <= 200 and images["s3"]["second"]["images_per_s"] > 0
    assert (tmp_path / "data.png").stat().st_size > 10_000
    assert len(images["end_to_end"]["per_rank"]) == 2 and images["memory_at_10x"]["images"] == [100, 1000]
    assert images["memory_at_10x"]["parquet_large_over_small"] > 0


def test_the_text_suite_measures_packing_against_a_plain_loop(tmp_path):
    result = run_cli("bench", "data", "--suite", "text", "--documents", "300", "--seq-len", "64", "--repeats", "1",
                     "--tokenize-workers", "2", "--out", str(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    text = json.loads((tmp_path / "data.json").read_text())["text"]
    assert set(text["tokens_per_s"]) == {"plain", "mlscale first epoch", "mlscale later epochs"}
    assert text["later_vs_plain"] > 0  # a ratio, not a verdict: 300 documents on a shared CI core decide nothing
    assert set(text["tokenize_pass"]["tokens_per_s"]) == {"threads", "2 processes"}
    assert text["tokenize_pass"]["processes_vs_threads"] > 0
