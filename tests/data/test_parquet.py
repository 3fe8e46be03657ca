"""Parquet data sets: sharded over workers by row group, streamed (a few row groups decoded at a
time), resumed exactly, cached on disk; and a training run on generated multi-file Parquet data."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlscale.data import Position
from mlscale.data.parquet import (
    ParquetData,
    ParquetLoader,
    check_resumable,
    deal_row_groups,
    epoch_rows,
    write_parquet,
)
from mlscale.errors import UsageError
from mlscale.tasks import TensorData
from mlscale.tasks.digits import load_digits
from tests.helpers import final_weights, run_cli
from tests.train.test_resume import stop_at

ROWS = 1000


@pytest.fixture(scope="module")
def numbered(tmp_path_factory) -> ParquetData:
    """Rows whose features are their own id (x0 = id, x1 = -id) and label id: 3 files of 37-row groups
    (so the groups at the files' ends are smaller)."""
    ids = torch.arange(ROWS, dtype=torch.float32)
    directory = tmp_path_factory.mktemp("numbered")
    write_parquet(TensorData(torch.stack([ids, -ids], dim=1), torch.arange(ROWS)), directory, files=3,
                  row_group_rows=37)
    return ParquetData(directory, target="label")


def _epoch(loader: ParquetLoader, steps: int) -> list[torch.Tensor]:
    batches = []
    for _ in range(steps):
        inputs, targets = next(loader)
        assert torch.equal(inputs[:, 0].long(), targets) and torch.equal(inputs[:, 1], -inputs[:, 0])
        batches.append(targets)
    return batches


def test_the_files_row_groups_and_columns_are_found(numbered):
    assert len(numbered.files) == 3 and len(numbered) == ROWS
    assert numbered.features == ["x0", "x1"] and numbered.target == "label"
    assert [g.first_row for g in numbered.groups[:2]] == [0, 37]
    assert sum(g.rows for g in numbered.groups) == ROWS and min(g.rows for g in numbered.groups) < 37


def _steps(data: ParquetData, world: int, batch: int, seed: int) -> int:
    return epoch_rows([g.rows for g in data.groups], world, seed) // batch


@pytest.mark.parametrize("workers", [0, 2])
def test_each_worker_streams_only_its_own_row_groups_and_no_row_twice(numbered, workers):
    world, batch = 3, 8
    rows = [g.rows for g in numbered.groups]
    plan = deal_row_groups(rows, world, seed=4)
    steps = _steps(numbered, world, batch, seed=4)
    loaders = [ParquetLoader(numbered, rank=r, world=world, step_batch=batch, seed=4, workers=workers, window=2)
               for r in range(world)]
    try:
        epochs = []
        for epoch in range(2):
            read = [torch.cat(_epoch(loader, steps)) for loader in loaders]
            everything = torch.cat(read)
            assert len(everything.unique()) == len(everything) == steps * batch * world  # no row twice
            for rank, ids in enumerate(read):
                own = torch.cat([torch.arange(numbered.groups[g].first_row,
                                              numbered.groups[g].first_row + rows[g]) for g in plan[rank]])
                assert bool(torch.isin(ids, own).all())  # only its own row groups
            # what an epoch leaves out is the excess of the workers with more rows than the fewest
            assert ROWS - len(everything) < world * (max(rows) + batch)
            assert all(loader.position == Position(epoch, steps * batch * world) for loader in loaders)
            epochs.append(read)
        assert not torch.equal(epochs[0][0], epochs[1][0])  # each epoch in another order
    finally:
        for loader in loaders:
            loader.close()


def test_only_two_windows_of_row_groups_are_decoded_at_a_time(numbered):
    loader = ParquetLoader(numbered, rank=0, world=1, step_batch=10, seed=0, window=2)
    try:
        for _ in range(60):
            next(loader)
            assert len(loader.samples._decoded) <= 4  # two windows: the one a batch ends and the next
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resume_mid_epoch_reads_exactly_the_rest(numbered, workers):
    options = dict(world=2, seed=9, window=3)
    steps = _steps(numbered, 2, 8, seed=9)
    whole = [ParquetLoader(numbered, rank=r, step_batch=8, workers=workers, **options) for r in range(2)]
    expected = [_epoch(loader, steps + 5) for loader in whole]  # past the epoch's end
    middle = 11
    resumed = [ParquetLoader(numbered, rank=r, step_batch=8, workers=workers, position=Position(0, middle * 8 * 2),
                             **options) for r in range(2)]
    # with another batch size, the same rows follow, in the same order
    regrouped = ParquetLoader(numbered, rank=1, step_batch=4, position=Position(0, middle * 8 * 2), **options)
    try:
        for rank in range(2):
            assert all(torch.equal(a, b) for a, b in zip(_epoch(resumed[rank], steps + 5 - middle),
                                                         expected[rank][middle:], strict=True))
            assert resumed[rank].position == whole[rank].position == Position(1, 5 * 16)
        rest = torch.cat(expected[1][middle:steps])
        assert torch.equal(torch.cat(_epoch(regrouped, len(rest) // 4)), rest)
    finally:
        for loader in [*whole, *resumed, regrouped]:
            loader.close()


def test_a_mid_epoch_resume_at_another_world_size_is_refused(numbered):
    check_resumable(numbered, Position(1, 0), saved_world=2, world=3)  # at a boundary: any world
    check_resumable(numbered, Position(1, 32), saved_world=2, world=2)
    with pytest.raises(UsageError, match="dealt to 2"):
        check_resumable(numbered, Position(1, 32), saved_world=2, world=3)


def test_the_disk_cache_fills_in_the_first_epoch_and_a_restart_reads_it(numbered, tmp_path):
    def loader() -> ParquetLoader:
        return ParquetLoader(numbered, rank=0, world=1, step_batch=10, seed=2, workers=2, cache="disk",
                             cache_dir=tmp_path)

    first = loader()
    try:
        steps = _steps(numbered, 1, 10, seed=2)
        ids = torch.cat(_epoch(first, steps))
        cache = first.samples.cache
        assert int(cache.filled.sum()) == len(ids) == steps * 10  # the rows read, each once
        assert sorted(cache.inputs[cache.filled.bool(), 0].long().tolist()) == sorted(ids.tolist())
    finally:
        first.close()
    again = loader()  # a restarted run: the rows come from the files in RUN_DIR/data-cache, not Parquet
    try:
        assert torch.equal(again.samples.cache.filled, cache.filled)
        read = torch.cat(_epoch(again, steps))
        assert bool(torch.isin(read, ids).all())  # no row outside the cache: none was decoded
        assert len(again.samples._decoded) == 0
    finally:
        again.close()


def test_a_shards_cache_holds_its_own_rows_and_a_large_seed_is_fine(numbered, tmp_path):
    rows = [g.rows for g in numbered.groups]
    loader = ParquetLoader(numbered, rank=1, world=2, step_batch=8, seed=2**32 - 1, cache="memory")
    try:
        own = sum(rows[g] for g in deal_row_groups(rows, 2, seed=2**32 - 1)[1])
        assert len(loader.samples.cache.filled) == own < ROWS
        next(loader)
    finally:
        loader.close()


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.integers(1, 50), min_size=1, max_size=40), world=st.integers(1, 6),
       seed=st.integers(0, 10))
def test_the_deal_covers_every_row_group_once_and_keeps_workers_within_one_group(rows, world, seed):
    plan = deal_row_groups(rows, world, seed)
    assert sorted(g for groups in plan for g in groups) == list(range(len(rows)))
    loads = [sum(rows[g] for g in groups) for groups in plan]
    assert max(loads) - min(loads) <= max(rows)
    assert plan == deal_row_groups(rows, world, seed)  # a pure function


def test_lists_of_numbers_are_features_and_bad_columns_are_one_line_errors(tmp_path):
    table = pa.table({"pixels": pa.array([[1.0, 2.0], [3.0, 4.0]], type=pa.list_(pa.float32(), 2)),
                      "age": pa.array([7, 8], type=pa.int32()), "y": pa.array([0.5, 1.5])})
    pq.write_table(table, tmp_path / "a.parquet")
    data = ParquetData(tmp_path / "a.parquet", target="y")
    inputs, targets = data.read(data.groups[0])
    assert inputs.tolist() == [[1.0, 2.0, 7.0], [3.0, 4.0, 8.0]] and targets.dtype == torch.float32
    with pytest.raises(UsageError, match="no such column"):
        ParquetData(tmp_path / "a.parquet", target="label")
    with pytest.raises(UsageError, match="no Parquet files"):
        ParquetData(tmp_path / "missing", target="y")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "b.parquet").write_text("not parquet")
    with pytest.raises(UsageError, match="not a readable Parquet file"):
        ParquetData(tmp_path / "bad", target="y")
    pq.write_table(pa.table({"x": [1.0, None], "y": [0, 1]}), tmp_path / "nulls.parquet")
    nulls = ParquetData(tmp_path / "nulls.parquet", target="y")
    with pytest.raises(UsageError, match="null"):
        nulls.read(nulls.groups[0])
    pq.write_table(pa.table({"x": ["a", "b"], "y": [0, 1]}), tmp_path / "text.parquet")
    text = ParquetData(tmp_path / "text.parquet", target="y")
    with pytest.raises(UsageError, match="must be numbers"):
        text.read(text.groups[0])


@pytest.fixture(scope="module")
def digits_parquet(tmp_path_factory):
    """The digits data set as 4 Parquet files of 100-row groups, one column per pixel, as pandas writes."""
    directory = tmp_path_factory.mktemp("digits-parquet")
    data = load_digits()
    write_parquet(TensorData(data.inputs.double(), data.targets), directory, files=4, row_group_rows=100)
    return directory


def test_training_streams_parquet_learns_and_resumes_exactly(digits_parquet, tmp_path):
    task = ["--task", "parquet", "--task-opt", f"path={digits_parquet}", "--dtype", "float64", "--batch-size", "16",
            "--steps", "120", "--checkpoint-every", "20", "--optimizer", "adam", "--lr", "0.01", "--no-progress"]

    def train(name, *extra):
        result = run_cli("train", *task, "--run-dir", str(tmp_path / name), *extra, timeout=240)
        assert result.returncode == 0, result.stderr
        return json.loads((tmp_path / name / "report.json").read_text())

    report = train("whole", "--workers", "2")
    assert report["data"]["source"] == "parquet" and report["data"]["files"] == 4
    assert report["eval"]["accuracy"] > 0.9  # the held-out last row group
    train("resumed", "--workers", "2", "--data-workers", "1", "--data-cache", "disk")
    stop_at(tmp_path / "resumed", 80)  # mid-epoch: 1,697 rows over 2 workers is about 50 steps of 16
    train("resumed", "--resume")
    reference = final_weights(tmp_path / "whole")
    assert all(torch.equal(reference[k], v) for k, v in final_weights(tmp_path / "resumed").items())
    stop_at(tmp_path / "resumed", 80)
    other = run_cli("train", "--run-dir", str(tmp_path / "resumed"), "--resume", "--workers", "1", timeout=240)
    assert other.returncode != 0 and "cannot resume Parquet data mid-epoch" in other.stderr


def test_too_few_row_groups_for_the_workers_is_refused_before_training(digits_parquet, tmp_path):
    result = run_cli("train", "--task", "parquet", "--task-opt", f"path={digits_parquet}", "--workers", "2",
                     "--batch-size", "900", "--steps", "2", "--run-dir", str(tmp_path / "r"), timeout=120)
    assert result.returncode == 2 and "bad value batch-size=900" in result.stderr
    assert "Traceback" not in result.stderr


def test_files_whose_columns_differ_stop_with_one_line(tmp_path):
    for name, width in (("a", 2), ("b", 3)):
        rows = [[float(i)] * width for i in range(8)]
        pq.write_table(pa.table({"x": pa.array(rows, type=pa.list_(pa.float32(), width)), "y": list(range(8))}),
                       tmp_path / f"{name}.parquet")
    loader = ParquetLoader(ParquetData(tmp_path, target="y"), rank=0, world=1, step_batch=4, seed=0, window=1)
    try:
        with pytest.raises(UsageError, match="every file must have the same columns and types"):
            for _ in range(4):
                next(loader)
    finally:
        loader.close()
