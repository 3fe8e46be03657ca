"""The records ranks share are typed: each packs itself into floats for the collective and is read back
whole (in-process, no workers started)."""

import math

import torch

from mlscale.train.records import RankMemory, RankTimings, RankWindow
from mlscale.train.strategy import StepRow
from mlscale.train.timing import StepTimes

TIMES = StepTimes(step_ms=10.0, compute_ms=6.0, comm_ms=3.0, comm_exposed_ms=1.0, data_wait_ms=2.0, optimizer_ms=1.5)


def test_a_window_of_rows_keeps_its_losses_medians_and_own_work_through_the_wire():
    rows = [StepRow(3, torch.tensor(2.0), TIMES), StepRow(3, torch.tensor(1.0), StepTimes(step_ms=30.0)),
            StepRow(3, 0.5, StepTimes(step_ms=20.0, data_wait_ms=4.0))]
    window = RankWindow.of(3, rows)
    assert (window.loss_mean, window.loss_last) == (3.5 / 3, 0.5)
    assert window.times.step_ms == 20.0 and window.times.data_wait_ms == 2.0  # medians, field by field
    assert window.own_ms == (9.5, 0.0, 4.0)  # compute + optimizer + data wait of each step
    assert RankWindow.from_floats(window.to_floats()) == window


def test_a_rank_without_a_loss_and_a_diverged_one_are_told_apart():
    silent = RankWindow.of(0, [StepRow(0, None, TIMES)])  # a pipeline stage before the last
    assert silent.loss_mean is None and RankWindow.from_floats(silent.to_floats()).loss_mean is None
    diverged = RankWindow.from_floats(RankWindow.of(1, [StepRow(1, torch.tensor(math.nan), TIMES)]).to_floats())
    assert diverged.loss_mean is not None and math.isnan(diverged.loss_mean)


def test_timings_and_memory_come_back_named():
    timings = RankTimings(2, TIMES)
    assert RankTimings.from_floats(timings.to_floats()) == timings
    assert TIMES.as_dict("_p50") == {"step_ms_p50": 10.0, "compute_ms_p50": 6.0, "comm_ms_p50": 3.0,
                                     "comm_exposed_ms_p50": 1.0, "data_wait_ms_p50": 2.0, "optimizer_ms_p50": 1.5}
    memory = RankMemory.from_floats(RankMemory(1, {"params_mb": 4.0, "state_mb": 8.0}, 100.0).to_floats())
    assert memory.as_report() == {"rank": 1, "params_mb": 4.0, "state_mb": 8.0, "peak_mb": 100.0}


def test_a_run_whose_data_wait_passes_a_tenth_of_the_step_is_input_bound_with_advice():
    from mlscale.config import build_config
    from mlscale.train.records import input_bound

    rows = [{"rank": 0, "data_wait_ms_p50": 1.0, "step_ms_p50": 20.0},
            {"rank": 1, "data_wait_ms_p50": 6.0, "step_ms_p50": 20.0}]
    verdict = input_bound(rows, build_config(task="digits"))
    assert verdict == {"bound": True, "data_wait_share": 0.3, "rank": 1,
                       "advice": "load in parallel: --data-workers auto"}
    cached = input_bound(rows, build_config(task="digits", data_workers=2, data_cache="memory"))["advice"]
    assert "more cores" in cached
    assert not input_bound(rows[:1], build_config(task="digits"))["bound"]


def test_each_fit_in_a_process_times_its_own_job(tmp_path):
    import time

    from mlscale.config import build_config
    from mlscale.train.launcher import fit

    fit(build_config(task="synthetic", steps=2, progress=False, run_dir=str(tmp_path / "one")))
    time.sleep(1.5)
    second = fit(build_config(task="synthetic", steps=2, progress=False, run_dir=str(tmp_path / "two")))
    assert second["wall_s"] < 1.5  # not counted from the first fit's start
