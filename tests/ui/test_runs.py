"""How the UI reads a run directory: only what was appended, a torn line waits for its newline, a resumed
run's redone steps supersede the first try, and a long run reaches the page down-sampled (bucket means; the
straggler score the bucket's highest) with every record again where the page zooms in."""

from __future__ import annotations

import os

import numpy as np
import orjson

from mlscale.bench.ui import write_synthetic_run
from mlscale.rundir import RunDir
from mlscale.ui.runs import RunCatalog, RunView, find_runs


def _line(step: int, loss: float, ranks: int = 2, slow: int | None = None) -> dict:
    return {"step": step, "loss": loss, "lr": 0.1, "samples_per_s": 100.0 + step, "time": 0.0, "elapsed_s": step,
            "per_rank": [{"rank": r, "step_ms": 10.0, "compute_ms": 6.0 + (4.0 if r == slow else 0.0),
                          "comm_ms": 2.0, "comm_exposed_ms": 1.0, "data_wait_ms": 0.5, "optimizer_ms": 0.5,
                          "straggler_score": 2.0 if r == slow else 1.0} for r in range(ranks)],
            "stragglers": [slow] if slow is not None else []}


def test_records_are_read_as_they_grow_and_a_redone_step_supersedes_the_first(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_config({"task": "digits", "strategy": "ddp"})
    view = RunView("run", run.path)
    assert view.refresh() == 0  # no records yet
    for step, loss in ((2, 2.0), (4, 1.8), (6, 1.6)):
        run.append_metrics(_line(step, loss))
    assert view.refresh() == 3
    with run.metrics_path.open("ab") as handle:  # a line being written: not read until its newline
        handle.write(orjson.dumps(_line(8, 1.4))[:40])
    assert view.refresh() == 3
    run.append_metrics(_line(4, 1.75, slow=1))  # resumed from the checkpoint of step 2: the torn line cut off
    run.append_metrics(_line(6, 1.55))
    assert view.refresh() == 5
    payload = view.series_payload(None, None, 600)
    assert payload["steps"] == [2, 4, 6] and payload["loss"] == [2.0, 1.75, 1.55]
    assert payload["heat_steps"] == [2, 4, 6]
    assert payload["per_point"] == 1 and payload["straggler"] == [[1.0, 1.0, 1.0], [1.0, 2.0, 1.0]]
    assert [e["kind"] for e in view.events()] == ["straggler"]  # flagged on the line that stands
    _, rows = view.rows(3)  # the live stream's rows: the lines after the third, as written
    assert [r["step"] for r in rows] == [4, 6] and rows[0]["per_rank"]["1"]["straggler_score"] == 2.0


def test_a_long_run_is_down_sampled_and_a_zoomed_range_has_every_record(tmp_path):
    run = write_synthetic_run(tmp_path / "long", steps=20_000, ranks=8, log_every=10, slow_rank=3)
    records = run.read_metrics()
    standing: dict[int, dict] = {}
    for record in records:  # the later line of a step stands (the restart wrote some again)
        standing = {s: r for s, r in standing.items() if s < record["step"]}
        standing[record["step"]] = record
    view = RunView("long", run.path)
    payload = view.series_payload(None, None, 200)
    assert len(payload["steps"]) == 200 and payload["per_point"] == len(standing) / 200
    ordered = [standing[s] for s in sorted(standing)]
    first = ordered[:10]  # the first bucket: 10 lines
    assert payload["steps"][0] == first[-1]["step"]
    assert np.isclose(payload["loss"][0], np.mean([r["loss"] for r in first]), rtol=1e-5)
    heat = np.array(payload["straggler"])
    assert heat.shape == (8, 200)
    for bucket in range(200):
        lines = ordered[bucket * 10:(bucket + 1) * 10]
        top = max(r["per_rank"][3]["straggler_score"] for r in lines)
        assert abs(heat[3, bucket] - top) < 1e-3  # the highest, never averaged away
    assert heat[3].max() > 2 and np.nanmax(np.delete(heat, 3, axis=0)) < 1.5
    zoomed = view.series_payload(5_000, 5_990, 200)
    assert zoomed["per_point"] == 1 and zoomed["steps"] == list(range(5_000, 6_000, 10))
    assert zoomed["loss"] == [round(standing[s]["loss"], 6) for s in zoomed["steps"]]
    kinds = {e["kind"]: e for e in view.events()}
    assert kinds["kill"]["step"] == kinds["restart"]["step"] + 1 and kinds["resume"]["step"] < kinds["restart"]["step"]


def test_runs_are_found_under_the_folder_and_an_id_is_never_a_path_from_the_request(tmp_path):
    for name in ("a", "nested/b", "nested/deeper/c"):
        RunDir(tmp_path / name).path.mkdir(parents=True)
        RunDir(tmp_path / name).write_config({"task": "digits"})
    (tmp_path / "nested" / "not-a-run").mkdir()
    assert sorted(find_runs(tmp_path)) == ["a", "nested/b", "nested/deeper/c"]
    catalog = RunCatalog(tmp_path / "nested")
    assert catalog.view("b") is not None and catalog.view("../a") is None and catalog.view(str(tmp_path / "a")) is None
    assert catalog.id_of(tmp_path / "nested" / "deeper" / "c") == "deeper/c" and catalog.id_of(tmp_path / "a") is None


def test_a_diverged_loss_is_shown_as_a_gap_not_dropped(tmp_path):
    run = RunDir(tmp_path / "run")
    run.write_config({"task": "digits"})
    for step, loss in ((1, 2.0), (2, float("nan")), (3, float("inf"))):
        run.append_metrics(_line(step, loss))  # Python's json writes NaN and Infinity, which strict JSON lacks
    view = RunView("run", run.path)
    assert view.refresh() == 3
    assert view.series_payload(None, None, 600)["loss"] == [2.0, None, None]


def test_a_resumed_run_is_not_shown_with_its_earlier_launchs_report(tmp_path):
    """`--resume` (or a start again after a failure) writes config.json anew and report.json only at its
    end: until then the run is running, with the figures of its records."""
    run = RunDir(tmp_path / "run")
    run.write_config({"task": "digits", "steps": 100})
    run.append_metrics(_line(10, 1.0))
    run.write_report({"status": "failed", "steps": 10, "final_loss": 1.0, "restarts": 0})
    view = RunView("run", run.path)
    assert view.summary()["status"] == "failed"
    os.utime(run.report_path, (1, 1))  # the report is older than the launch that wrote config.json again
    view.refresh()
    run.append_metrics(_line(20, 0.5))  # a line the view has not read: the table reads the file's tail
    summary = view.summary()
    assert summary["status"] == "running" and summary["steps"] == 20 and summary["loss"] == 0.5


def test_only_the_most_recently_asked_for_runs_keep_their_records_in_memory(tmp_path):
    from mlscale.ui import runs as ui_runs

    for i in range(ui_runs.KEEP_RUNS + 2):
        run = RunDir(tmp_path / f"run{i:02d}")
        run.path.mkdir()
        run.write_config({"task": "digits"})
        run.append_metrics(_line(1, float(i)))
    catalog = RunCatalog(tmp_path)
    views = []
    for i in range(ui_runs.KEEP_RUNS + 2):  # each opened and read in turn
        views.append(catalog.view(f"run{i:02d}"))
        views[-1].refresh()
    assert len(catalog.summaries()) == ui_runs.KEEP_RUNS + 2  # the table touches no run's place
    held = [view.id for view in views if view.series.steps]
    assert held == [f"run{i:02d}" for i in range(2, ui_runs.KEEP_RUNS + 2)]
    catalog.view("run00")  # asked for again: read again, and the oldest of the rest forgotten
    assert catalog.view("run00").series_payload(None, None, 10)["loss"] == [0.0]
    assert not views[2].series.steps and views[3].series.steps


def test_odd_per_rank_entries_are_read_and_only_whole_rank_numbers_become_rows():
    from mlscale.ui.runs import Series

    series = Series()
    series.add(_line(1, 1.0, ranks=2))
    older = _line(2, 0.9, ranks=2)
    del older["per_rank"][1]["straggler_score"]  # a record from before the score existed
    series.add(older)
    odd = _line(3, 0.8, ranks=2)
    odd["per_rank"] += [{**odd["per_rank"][0], "rank": "x"}, {**odd["per_rank"][0], "rank": 2.5},
                        {**odd["per_rank"][0], "rank": 3.0}]
    series.add(odd)
    assert series.ranks == [0, 1, 3]  # "x" and 2.5 are no rank; 3.0 is rank 3
    scores = series.standing("straggler_score")
    assert scores.shape == (3, 3)
    assert scores[1][:2].tolist() == [1.0, 1.0]  # the missing score reads as the neutral 1.0
    assert np.isnan(scores[1][2])  # rank 3 had no entry on the second line
    assert scores[2][2] == 1.0  # rank 3's entry on the third line
