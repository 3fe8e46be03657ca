"""Straggler detection, slow-fault draws, rejoin_by holds and parameter sharding, in-process (no workers
started)."""

import threading
import time

import pytest

from mlscale.errors import UsageError
from mlscale.faultspec import ANY_RANK, parse_fault
from mlscale.rundir import RunDir
from mlscale.train.faults import FaultInjector
from mlscale.train.stragglers import StragglerDetector
from mlscale.train.strategies.ps_server import shard_by_size


def test_a_consistently_slow_rank_is_flagged_against_the_fastest_not_the_average():
    detector = StragglerDetector(threshold=1.5, floor_ms=1.0, window=10)
    # rank 2 is 1.6x the fastest but only ~1.3x the mean of the others: scored against the fastest
    flagged = detector.observe(10, {0: [10.0] * 10, 1: [14.0] * 10, 2: [16.0] * 10})
    assert flagged == [2]
    assert detector.first_flagged == {2: 10} and detector.scores[2] == pytest.approx(1.6)
    assert "rank 2 (1.6x)" in detector.describe_now()


def test_one_slow_step_flags_nobody_and_a_recovered_rank_is_no_longer_flagged():
    detector = StragglerDetector(window=10)
    assert detector.observe(10, {0: [10.0] * 10, 1: [10.0] * 9 + [500.0]}) == []
    assert detector.observe(20, {0: [10.0] * 10, 1: [30.0] * 10}) == [1]
    assert detector.observe(30, {0: [10.0] * 10, 1: [10.0] * 10}) == []
    assert detector.summary()["flagged"] == {"1": {"first_step": 20, "max_score": 3.0}}


def test_microsecond_differences_on_a_tiny_model_flag_nobody():
    detector = StragglerDetector(threshold=1.5, floor_ms=1.0)
    assert detector.observe(10, {0: [0.1] * 10, 1: [0.4] * 10}) == []  # 4x, but 0.3 ms


def test_a_world_of_one_has_no_stragglers():
    assert StragglerDetector().observe(10, {0: [100.0] * 10}) == []


def test_transient_faults_parse_and_bad_ones_are_one_line():
    fault = parse_fault("slow:rank=any:delay_ms=40:p=0.25")
    assert (fault.rank, fault.delay_ms, fault.p) == (ANY_RANK, 40.0, 0.25)
    assert parse_fault("slow:rank=1:delay_ms=5").p == 1.0
    for spec, message in (("slow:rank=1:delay_ms=5:p=0", "p must be in (0, 1]"),
                          ("slow:rank=1:delay_ms=5:p=2", "p must be in (0, 1]"),
                          ("kill:rank=any:step=3", "rank must be a number"),
                          ("slow:rank=1:delay_ms=-5", "must not be negative")):
        with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
            parse_fault(spec)


def test_rank_any_slows_exactly_one_data_rank_per_step_and_every_rank_agrees_which():
    data_ranks = [1, 2, 3, 4]
    injectors = {r: FaultInjector(["slow:rank=any:delay_ms=10"], r, first_attempt=True, data_ranks=data_ranks,
                                  seed=7) for r in data_ranks}
    slow_by_step = []
    for step in range(1, 201):
        slow = [r for r, inj in injectors.items() if inj.delay_s(step) > 0]
        assert len(slow) == 1
        slow_by_step.append(slow[0])
    assert set(slow_by_step) == set(data_ranks)  # a random rank, not always the same


def test_p_makes_a_rank_slow_on_about_that_fraction_of_steps_the_same_in_every_run():
    def slow_steps() -> list[int]:
        injector = FaultInjector(["slow:rank=1:delay_ms=10:p=0.25"], 1, first_attempt=True, seed=3)
        return [step for step in range(1, 2001) if injector.delay_s(step)]

    steps = slow_steps()
    assert 0.2 < len(steps) / 2000 < 0.3
    assert steps == slow_steps()


def test_parameters_are_sharded_whole_and_balanced_by_size():
    sizes = [1000, 10, 800, 10, 300, 10]
    shards = shard_by_size(sizes, 2)
    assert sorted(i for shard in shards for i in shard) == list(range(len(sizes)))  # each tensor once
    loads = [sum(sizes[i] for i in shard) for shard in shards]
    assert max(loads) - min(loads) <= 300, loads
    assert shard_by_size(sizes, 1) == [list(range(len(sizes)))]


def test_rejoin_by_holds_the_others_until_the_killed_ranks_replacement_is_up(tmp_path):
    """What lets a per-step test wait on a replacement's start instead of on the host being fast."""
    run = RunDir(tmp_path)
    spec = "kill:rank=0:step=3:rejoin_by=5"
    assert parse_fault(spec).rejoin_by == 5
    with pytest.raises(UsageError, match="rejoin_by must come after"):
        parse_fault("kill:rank=0:step=3:rejoin_by=3")
    victim = FaultInjector([spec], 0, first_attempt=True, run_dir=run)
    gives_up = FaultInjector([spec], 1, first_attempt=True, run_dir=run, hold_s=0.2)
    waits = FaultInjector([spec], 2, first_attempt=True, run_dir=run, hold_s=30)
    start = time.monotonic()
    waits.hold(4)  # before rejoin_by: nothing to wait for
    assert time.monotonic() - start < 0.1
    victim._record(victim._kill[3])  # what the kill writes before SIGKILL
    gives_up.hold(5)  # no replacement: bounded
    assert 0.2 <= time.monotonic() - start < 5
    threading.Timer(0.3, FaultInjector([spec], 0, first_attempt=False, run_dir=run).ready).start()
    start = time.monotonic()
    waits.hold(5)
    assert 0.3 <= time.monotonic() - start < 5
    start = time.monotonic()
    gives_up.hold(6), waits.hold(6)  # once per kill
    assert time.monotonic() - start < 0.1
