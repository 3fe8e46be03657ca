"""Checkpoints are atomic: a crash while writing never damages the newest good one."""

import pytest
import torch

from mlscale.io import atomic_write
from mlscale.train.checkpoint import Checkpointer, capture_rng, restore_rng


def test_a_crash_mid_write_leaves_the_previous_checkpoint_as_latest(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(5, {"w": torch.ones(3)})

    def crash(tmp):
        tmp.write_bytes(b"half a checkpoint")
        raise KeyboardInterrupt  # the process dies mid-write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(checkpoints.path_for(10), crash)
    assert checkpoints.latest() == checkpoints.path_for(5)
    assert torch.equal(checkpoints.load(checkpoints.latest())["w"], torch.ones(3))
    assert [p.name for p in tmp_path.iterdir()] == ["step_00000005.pt"]


def test_a_leftover_temporary_file_is_never_taken_for_a_checkpoint(tmp_path):
    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(5, {"w": torch.ones(1)})
    (tmp_path / ".step_00000010.pt.abc.tmp").write_bytes(b"torn")
    assert checkpoints.latest() == checkpoints.path_for(5)


def test_only_the_newest_k_are_kept(tmp_path):
    checkpoints = Checkpointer(tmp_path, keep=2)
    for step in (1, 2, 3, 4):
        checkpoints.save(step, {"step": step})
    assert checkpoints.steps() == [3, 4]


def test_rng_states_round_trip_through_a_weights_only_checkpoint(tmp_path):
    import random

    import numpy as np

    checkpoints = Checkpointer(tmp_path)
    checkpoints.save(1, {"rng": capture_rng()})
    expected = (random.random(), np.random.rand(), torch.rand(1))
    restore_rng(checkpoints.load(checkpoints.latest())["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected
