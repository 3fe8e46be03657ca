"""A user's own Dataset (tests/own_data.py: dict inputs of different lengths, padded per batch with a mask,
the model called ``model(**inputs)``) trained under every strategy and option, each equal to one process
in float64: ddp N x B = 1 x NB, fsdp, tp, fsdp x tp, the parameter server, per-step fault tolerance,
--grad-accum, activation checkpointing, data workers with a cache in memory and on disk, --eval-every;
the pipeline on batches padded to one length; and ``mlscale plan`` on it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import final_weights, max_abs_diff, refused, run_cli

pytestmark = pytest.mark.timeout(900)  # the module's runs are made once, by the first test that needs them

TASK = ["--task", "tests.own_data:sentences"]
COMMON = [*TASK, "--dtype", "float64", "--optimizer", "adam", "--lr", "3e-3", "--steps", "6", "--no-progress"]
DDP, SPLIT = 1e-10, 1e-9

RUNS = {  # name: (the run's options, the run it equals, the bound)
    "ddp": (["--workers", "2", "--batch-size", "8"], "one", DDP),
    "accum": (["--workers", "2", "--batch-size", "4", "--grad-accum", "2"], "one", DDP),
    "workers": (["--workers", "2", "--batch-size", "8", "--data-workers", "1", "--data-cache", "memory"], "one", DDP),
    "threads": (["--workers", "2", "--batch-size", "8", "--data-threads", "3"], "one", DDP),
    "disk": (["--workers", "2", "--batch-size", "8", "--data-workers", "2", "--data-cache", "disk",
              "--eval-every", "2"], "one", DDP),
    "fsdp-ac": (["--strategy", "fsdp", "--workers", "2", "--batch-size", "8", "--activation-checkpointing", "full"],
                "one", SPLIT),
    "tp": (["--strategy", "tp", "--workers", "2", "--batch-size", "16"], "one", SPLIT),
    "fsdp-tp": (["--strategy", "fsdp", "--tp", "2", "--workers", "4", "--batch-size", "8"], "one", SPLIT),
    "ps": (["--strategy", "ps", "--workers", "2", "--batch-size", "8"], "one", DDP),
    "per-step": (["--fault-tolerance", "per-step", "--workers", "2", "--batch-size", "8"], "one", DDP),
    "pipeline": (["--task-opt", "length=12", "--strategy", "pipeline", "--stages", "2", "--workers", "2",
                  "--microbatches", "2", "--batch-size", "16"], "one-fixed", SPLIT),
}


def _train(run_dir: Path, *args: str) -> None:
    result = run_cli("train", *COMMON, "--run-dir", str(run_dir), *args, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("own-data")
    _train(root / "one", "--batch-size", "16")
    _train(root / "one-fixed", "--batch-size", "16", "--task-opt", "length=12")
    for name, (options, _, _) in RUNS.items():
        _train(root / name, *options)
    return root


@pytest.mark.parametrize("name", list(RUNS))
def test_a_dataset_of_dict_inputs_of_different_lengths_trains_like_one_process(runs, name):
    _, reference, bound = RUNS[name]
    assert max_abs_diff(final_weights(runs / name), final_weights(runs / reference)) <= bound


def test_the_report_says_the_data_came_from_a_dataset_and_held_out_metrics_were_taken(runs):
    report = json.loads((runs / "disk" / "report.json").read_text())
    assert report["data"]["source"] == "dataset" and report["data"]["collate"] == "PadCollate"
    assert report["data"]["workers"] == 2 and report["data"]["cache"] == "disk"
    assert list((runs / "disk" / "data-cache").rglob("*.safetensors"))  # items kept where a restart finds them
    lines = [json.loads(line) for line in (runs / "disk" / "metrics.jsonl").read_text().splitlines()]
    assert [e["step"] for line in lines for e in line.get("eval", [])] == [2, 4]
    assert 0 <= report["eval"]["accuracy"] <= 1


def test_a_pipeline_of_batches_padded_to_their_longest_is_refused_before_it_starts():
    result = run_cli("train", *TASK, "--strategy", "pipeline", "--stages", "2", "--workers", "2", "--steps", "2")
    assert result.returncode == 2, result.stderr
    assert "changes shape from batch to batch" in result.stderr and "PadCollate(length=N)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_plan_lays_out_a_dataset_task():
    result = run_cli("plan", *TASK, "--workers", "2", "--batch-size", "8", timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line.split()[:2] for line in result.stdout.splitlines()]
    assert all(layout in rows for layout in (["ddp", "x2"], ["fsdp", "2"], ["tp", "2"], ["pipeline", "2"]))


@pytest.mark.parametrize(("options", "says"), [
    (["mistake=not_a_pair"], "sample 0 of the training Dataset is a dict; an item must be an (inputs, target) pair"),
    (["mistake=unknown_key"], "the Dataset's inputs name 'token_type_ids', which Classifier.forward does not take"),
    (["collate=false"], "cannot be stacked into one batch"),
    (["mistake=long_len"], "__getitem__ raised IndexError (list index out of range) although __len__ says 165"),
])
def test_a_mistake_in_a_users_dataset_is_one_line_and_exit_2_before_anything_starts(options, says, tmp_path):
    opts = [arg for option in options for arg in ("--task-opt", option)]
    result = refused("train", "--task", "tests.own_data:broken", *opts, "--workers", "2", "--steps", "2",
                     "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and says in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize(("mistake", "says"), [
    ("raises", "sample 37 of the training Dataset: ValueError: cannot decode record 37"),
    ("dies", "a data-loading worker process died while reading sample 37"),
])
def test_a_failure_while_training_names_the_rank_the_sample_and_the_exception(mistake, says, tmp_path):
    result = run_cli("train", "--task", "tests.own_data:broken", "--task-opt", f"mistake={mistake}", "--workers", "2",
                     "--batch-size", "8", "--steps", "12", "--data-workers", "1", "--no-progress",
                     "--run-dir", str(tmp_path / "run"), timeout=240)
    assert result.returncode == 1, result.stderr[-3000:]
    assert "worker rank" in result.stderr and says in result.stderr and "Traceback" not in result.stderr


def test_bad_samples_skip_trains_without_them_and_lists_them(tmp_path):
    run_dir = tmp_path / "run"
    result = run_cli("train", "--task", "tests.own_data:broken", "--task-opt", "mistake=raises", "--workers", "2",
                     "--batch-size", "8", "--epochs", "2", "--data-workers", "1", "--bad-samples", "skip",
                     "--log-sample-ids", "--no-progress", "--run-dir", str(run_dir), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bad samples  2 left out (--bad-samples skip)" in result.stdout
    bad = json.loads((run_dir / "report.json").read_text())["data"]["bad_samples"]
    assert bad["count"] == 2 and [(s["index"], s["epoch"]) for s in bad["samples"]] == [(37, 0), (37, 1)]
    assert "ValueError: cannot decode record 37" in bad["samples"][0]["error"]
    ids = [i for path in (run_dir / "sample_ids").glob("rank*.jsonl") for line in path.read_text().splitlines()
           for i in json.loads(line)["ids"]]
    assert len(ids) == 2 * 160 - 2 and 37 not in ids  # every other sample trained, each epoch
