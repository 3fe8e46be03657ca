"""Checkpoints are sharded DCP directories, made visible by a rename: a crash while writing never
damages the newest good one, a damaged one is skipped, and loading runs no pickle code."""

import pickle

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

from mlscale.train.checkpoint import Checkpointer, TrainState, capture_rng, read_metadata, restore_rng


def _state(value: float, step: int = 0) -> TrainState:
    return TrainState({"model/w": torch.full((3,), value)}, {"step": step})


def _template() -> TrainState:
    return TrainState({"model/w": torch.zeros(3)})


def test_a_checkpoint_round_trips_tensors_and_json(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(5, _state(2.0, step=5), trainer={"step": 5})
    assert checkpoints.latest_complete() == (5, {"step": 5})
    loaded = checkpoints.load(5, _template())
    assert torch.equal(loaded.tensors["model/w"], torch.full((3,), 2.0))
    assert loaded.meta == {"step": 5, "own": True}


def test_an_async_save_is_visible_once_written(tmp_path):
    checkpoints = Checkpointer(tmp_path, async_save=True)
    checkpoints.save(3, _state(1.0), trainer={"step": 3})
    checkpoints.wait()
    assert checkpoints.steps() == [3]
    assert not list(tmp_path.glob("*.partial"))


def test_a_crash_mid_write_leaves_the_previous_checkpoint_as_latest(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(5, _state(1.0), trainer={"step": 5})

    def crash(step, partial_file):
        raise KeyboardInterrupt  # the process dies after its data, before the rename

    with pytest.raises(KeyboardInterrupt):
        Checkpointer(tmp_path, write_hook=crash).save(10, _state(9.0), trainer={"step": 10})
    assert checkpoints.steps() == [5]
    assert (tmp_path / "step_00000010.partial").is_dir()  # never taken for a checkpoint
    assert checkpoints.latest_complete()[0] == 5
    # The next writer removes what the crash left before it saves.
    Checkpointer(tmp_path).save(6, _state(3.0), trainer={"step": 6})
    assert not (tmp_path / "step_00000010.partial").exists()


def test_a_resave_interrupted_between_its_two_renames_is_put_back_on_start(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(4, _state(4.0), trainer={"step": 4})
    # A re-save of step 4 died after moving the old copy aside and before renaming the new one in.
    (tmp_path / "step_00000004").rename(tmp_path / "step_00000004.replaced")
    (tmp_path / "step_00000004.partial").mkdir()
    reader = Checkpointer(tmp_path)
    assert reader.latest_complete() == (4, {"step": 4})  # found before any save, by every rank
    assert torch.equal(reader.load(4, _template()).tensors["model/w"], torch.full((3,), 4.0))
    reader.save(6, _state(6.0), trainer={"step": 6})  # the next save puts it back, never removes it
    assert reader.steps() == [4, 6] and (tmp_path / "step_00000004").is_dir()
    assert not list(tmp_path.glob("*.replaced")) and not list(tmp_path.glob("*.partial"))
    assert torch.equal(Checkpointer(tmp_path).load(4, _template()).tensors["model/w"], torch.full((3,), 4.0))


def test_a_truncated_shard_is_skipped_for_the_one_before(tmp_path, capsys):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, _state(1.0), trainer={"step": 1})
    checkpoints.save(2, _state(2.0), trainer={"step": 2})
    shard = tmp_path / "step_00000002" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:20])
    assert checkpoints.latest_complete() == (1, {"step": 1})
    assert "skipping damaged checkpoint" in capsys.readouterr().err


def test_metadata_that_names_other_code_is_refused(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, _state(1.0), trainer={"step": 1})

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "step_00000001" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match=r"builtins\.print"):
        read_metadata(tmp_path / "step_00000001")
    assert checkpoints.latest_complete() is None


def test_only_the_newest_k_are_kept(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        checkpoints.save(step, _state(float(step)), trainer={"step": step})
    assert checkpoints.steps() == [3, 4]


def test_rng_states_round_trip_through_json(tmp_path):
    import random

    import numpy as np

    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, TrainState({"x": torch.zeros(1)}, {"rng": capture_rng()}), trainer={"step": 1})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng(checkpoints.load(1, TrainState({"x": torch.zeros(1)})).meta["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


def test_metadata_declaring_a_non_tensor_entry_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, _state(1.0), trainer={"step": 1})
    directory = tmp_path / "step_00000001"
    # DCP itself would store a non-tensor value as bytes, to be read back with pickle
    dcp.save({"model/w": torch.ones(3), "extra": {"any": "object"}}, checkpoint_id=str(directory), no_dist=True)
    with pytest.raises(pickle.UnpicklingError, match="BytesStorageMetadata"):
        read_metadata(directory)


def test_optimizer_state_the_checkpoint_lacks_stays_fresh(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, _state(4.0), trainer={"step": 1})  # saved before any optimizer step
    template = TrainState({"model/w": torch.zeros(3), "optimizer/w/exp_avg": torch.zeros(3)})
    loaded = checkpoints.load(1, template)
    assert set(loaded.tensors) == {"model/w"} and torch.equal(loaded.tensors["model/w"], torch.full((3,), 4.0))
    with pytest.raises(CheckpointException, match="model/missing"):  # a parameter it lacks is an error
        checkpoints.load(1, TrainState({"model/w": torch.zeros(3), "model/missing": torch.zeros(1)}))


def test_saving_a_step_again_replaces_it_whole(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, _state(1.0), trainer={"step": 1})
    checkpoints.save(1, _state(2.0), trainer={"step": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000001"]
    assert torch.equal(checkpoints.load(1, _template()).tensors["model/w"], torch.full((3,), 2.0))
