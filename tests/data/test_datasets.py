"""A user's map-style Dataset through mlscale's loaders, in one process: collates (stacked, padded with a
mask), batches of dict inputs, the sharding contract on a Dataset at any world size, the item cache, a
Hugging Face ``datasets.Dataset``, and one line naming the sample for each mistake."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlscale import HFDataset, PadCollate
from mlscale.data.batches import call_model, chunk, rows
from mlscale.data.collate import stack
from mlscale.data.dataset import MapData, SampleError
from mlscale.data.item_cache import make_item_cache
from mlscale.data.loader import Position, ShardLoader
from mlscale.data.pipeline import DatasetLoader
from mlscale.errors import UsageError
from tests.own_data import Broken, Classifier, Sentences


def _seq(*values):
    return torch.tensor(values)


def test_pad_collate_pads_to_the_longest_on_the_side_asked_and_masks_what_it_padded():
    items = [({"ids": _seq(1, 2, 3), "w": torch.ones(3)}, 0), ({"ids": _seq(4), "w": torch.ones(1)}, 1)]
    right, targets = PadCollate(pad_value={"ids": 9}, mask="attention_mask")(items)
    assert right["ids"].tolist() == [[1, 2, 3], [4, 9, 9]] and right["w"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]] and targets.tolist() == [0, 1]
    left, _ = PadCollate(side="left", mask="attention_mask", length=4)(items)
    assert left["ids"].tolist() == [[0, 1, 2, 3], [0, 0, 0, 4]]
    assert left["attention_mask"].tolist() == [[0, 1, 1, 1], [0, 0, 0, 1]]


def test_pad_collate_pads_token_targets_and_tuples_and_refuses_what_is_longer_than_its_length():
    items = [((_seq(1, 2), _seq(5)), _seq(7, 8)), ((_seq(3), _seq(6, 6)), _seq(9))]
    inputs, targets = PadCollate(target_pad=-100)(items)
    assert isinstance(inputs, tuple) and inputs[0].tolist() == [[1, 2], [3, 0]]
    assert inputs[1].tolist() == [[5, 0], [6, 6]]
    assert targets.tolist() == [[7, 8], [9, -100]]
    with pytest.raises(ValueError, match="longer than PadCollate"):
        PadCollate(length=2)([(_seq(1, 2, 3), 0)])
    with pytest.raises(TypeError, match="must be a dict"):
        PadCollate(mask="attention_mask")([(_seq(1), 0)])


def test_stack_keeps_the_items_structure():
    inputs, targets = stack([((torch.ones(2), torch.zeros(3)), {"y": 1}), ((torch.ones(2), torch.zeros(3)), {"y": 0})])
    assert isinstance(inputs, tuple) and [t.shape for t in inputs] == [(2, 2), (2, 3)]
    assert targets["y"].tolist() == [1, 0]


def test_the_model_is_called_by_name_by_position_or_with_one_tensor():
    assert call_model(lambda a, b: a - b, (torch.tensor(3), torch.tensor(1))) == 2
    assert call_model(lambda a, b: a - b, {"b": torch.tensor(3), "a": torch.tensor(1)}) == -2
    assert call_model(lambda x: x * 2, torch.tensor(2)) == 4


def test_micro_steps_split_every_input_the_same_way():
    batch = {"ids": torch.arange(10).view(5, 2), "mask": torch.ones(5, 2)}
    parts = chunk(batch, 2)
    assert [rows(p) for p in parts] == [3, 2] and parts[1]["ids"].tolist() == [[6, 7], [8, 9]]


def test_a_padded_batch_gives_the_model_the_answers_of_each_sample_alone():
    data = MapData(Sentences(12), PadCollate(mask="attention_mask"), dtype=torch.float64)
    model = Classifier().double()
    together = call_model(model, data.batch(range(12))[0])
    alone = torch.cat([call_model(model, data.batch([i])[0]) for i in range(12)])
    assert torch.allclose(together, alone, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(size=st.integers(20, 90), world=st.integers(1, 4), start_world=st.integers(1, 4), done=st.integers(0, 3),
       batch=st.integers(1, 4))
def test_a_dataset_epoch_resumed_at_another_world_size_trains_the_rest_once(size, world, start_world, done, batch):
    """Every rank's share balanced and disjoint; after ``done`` steps on ``start_world`` ranks, the rest of the
    epoch on ``world`` ranks: together each sample of the epoch at most once, all but a remainder."""
    data = MapData(Sentences(size), PadCollate(mask="attention_mask"))
    steps_before = min(done, size // start_world // batch)
    seen: list[int] = []
    position = Position()
    for rank in range(start_world):
        loader = ShardLoader(data, rank=rank, world=start_world, step_batch=batch, seed=3)
        for _ in range(steps_before):
            next(loader)
            seen.extend(loader.last_ids.tolist())
        position = loader.position
    if size - position.offset < world * batch:
        return
    shares = []
    for rank in range(world):
        loader = ShardLoader(data, rank=rank, world=world, step_batch=batch, seed=3, position=position)
        share = []
        while loader.position.epoch == 0 and loader.position.offset + world * batch <= size:
            inputs, _ = next(loader)
            assert rows(inputs) == batch and set(inputs) == {"input_ids", "weights", "attention_mask"}
            share.extend(loader.last_ids.tolist())
        shares.append(share)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    everything = seen + [i for share in shares for i in share]
    assert len(everything) == len(set(everything)) and size - len(everything) < world * batch


def test_data_workers_and_the_item_cache_give_the_batches_of_the_loader_in_process(tmp_path):
    data = MapData(Sentences(64), PadCollate(mask="attention_mask"), dtype=torch.float64)
    plain = ShardLoader(data, rank=1, world=2, step_batch=4, seed=0)
    expected = [next(plain) for _ in range(24)]  # 3 epochs of 8 steps: the later ones read the cache
    for cache in ("memory", "disk"):
        loader = DatasetLoader(data, rank=1, world=2, step_batch=4, seed=0, workers=2, cache=cache,
                               cache_dir=tmp_path / "cache", cache_key="k")
        got = [next(loader) for _ in range(24)]
        for (inputs, targets), (want_inputs, want_targets) in zip(got, expected, strict=True):
            assert inputs.keys() == want_inputs.keys()
            assert all(torch.equal(inputs[key], want_inputs[key]) for key in want_inputs)
            assert torch.equal(targets, want_targets)
        directory = loader.cache.directory
        assert len(list(directory.glob("*.safetensors"))) > 0
        loader.close()
        assert directory.exists() == (cache == "disk")  # shared memory is given back


def test_the_item_cache_keeps_any_structure_without_pickle(tmp_path):
    cache = make_item_cache("disk", tmp_path, "key")
    item = ({"ids": torch.arange(3), "w": torch.rand(3, dtype=torch.float64)}, (torch.tensor(1), 2.5))
    cache.put(7, item)
    back = cache.get(7)
    assert torch.equal(back[0]["ids"], item[0]["ids"]) and torch.equal(back[0]["w"], item[0]["w"])
    assert back[1][0].item() == 1 and back[1][1].item() == 2.5 and cache.get(8) is None
    from safetensors import safe_open  # what is on disk is a safetensors file, readable by any of its readers

    with safe_open(str(cache.directory / "7.safetensors"), framework="pt") as stored:
        assert torch.equal(stored.get_tensor("0"), item[0]["ids"])


def test_a_hugging_face_datasets_dataset_is_a_map_style_dataset_of_the_columns_named():
    datasets = pytest.importorskip("datasets")
    table = datasets.Dataset.from_dict({"input_ids": [[5, 6, 7], [8], [9, 10]], "label": [1, 0, 1],
                                        "text": ["a b c", "d", "e f"]})
    data = MapData(HFDataset(table, inputs=["input_ids"], target="label"), PadCollate(mask="attention_mask"))
    inputs, targets = data.batch([0, 1, 2])
    assert inputs["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]] and targets.tolist() == [1, 0, 1]
    single, _ = MapData(HFDataset(table, inputs="input_ids", target="label"), PadCollate()).batch([1])
    assert isinstance(single, torch.Tensor) and single.tolist() == [[8]]
    with pytest.raises(UsageError, match="no column 'labels'"):
        HFDataset(table, inputs=["input_ids"], target="labels")


@pytest.mark.parametrize(("mistake", "says"), [
    ("not_a_pair", "sample 0 of the training Dataset is a dict; an item must be an (inputs, target) pair"),
    ("long_len", "sample 164 of the training Dataset: __getitem__ raised IndexError (list index out of range) "
                 "although __len__ says 165 samples"),
])
def test_a_mistake_seen_before_training_is_one_line_naming_the_sample(mistake, says):
    with pytest.raises(UsageError) as raised:
        MapData(Broken(mistake, at=0)).check()
    assert str(raised.value).startswith(says)


def test_samples_that_cannot_be_stacked_name_the_collate_to_give():
    with pytest.raises(UsageError, match=r"samples \[0, 11\] .* cannot be stacked .*=mlscale.PadCollate"):
        MapData(Sentences(12)).check()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_failing_item_names_its_index_and_exception_also_from_a_worker_process(workers):
    data = MapData(Broken("raises", at=5, size=16), PadCollate(mask="attention_mask"))
    loader = DatasetLoader(data, rank=0, world=1, step_batch=16, seed=0, workers=workers)
    with pytest.raises(SampleError) as raised:
        next(loader)
    loader.close()
    assert str(raised.value) == "sample 5 of the training Dataset: ValueError: cannot decode record 5"


def test_a_data_worker_that_dies_names_the_sample_it_was_reading():
    data = MapData(Broken("dies", at=9, size=16), PadCollate(mask="attention_mask"))
    loader = DatasetLoader(data, rank=0, world=1, step_batch=16, seed=0, workers=1)
    with pytest.raises(SampleError, match="a data-loading worker process died while reading sample 9"):
        next(loader)
    loader.close()


def test_a_sample_left_out_under_bad_samples_skip_is_noted_and_its_batch_trains_without_it():
    data = MapData(Broken("raises", at=5, size=16), PadCollate(mask="attention_mask"), skip_bad=True)
    loader = ShardLoader(data, rank=0, world=1, step_batch=8, seed=0)
    seen = []
    for _ in range(2):
        inputs, targets = next(loader)
        assert rows(inputs) == rows(targets) == len(loader.last_ids)
        seen.extend(loader.last_ids.tolist())
    assert sorted(seen) == [i for i in range(16) if i != 5]
    assert [note["index"] for note in data.bad] == [5] and "cannot decode record 5" in data.bad[0]["error"]


def _children() -> list[str]:
    import os

    return [d for d in os.listdir("/proc") if d.isdigit() and _parent(d) == os.getpid()]


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


def test_closing_a_loader_stops_its_worker_processes_at_once():
    before = set(_children())
    loader = DatasetLoader(MapData(Sentences(32), PadCollate(mask="attention_mask")), rank=0, world=1, step_batch=4,
                           seed=0, workers=2)
    next(loader)
    assert len(set(_children()) - before) == 2
    loader.close()  # not waiting for the garbage collector: persistent workers are held by the DataLoader
    assert set(_children()) - before == set()


def test_data_threads_give_the_batches_of_the_loader_in_process_across_epochs_and_from_a_position():
    from mlscale.data.threads import ThreadLoader

    data = MapData(Sentences(40), PadCollate(mask="attention_mask"))
    plain = ShardLoader(data, rank=1, world=2, step_batch=4, seed=3)
    expected = [(next(plain), plain.last_ids.tolist(), plain.position) for _ in range(12)]  # 5 steps an epoch
    threads = ThreadLoader(data, rank=1, world=2, step_batch=4, seed=3, threads=3)
    for (want, ids, position) in expected:
        inputs, targets = next(threads)
        assert all(torch.equal(inputs[key], want[0][key]) for key in want[0]) and torch.equal(targets, want[1])
        assert threads.last_ids.tolist() == ids and threads.position == position
    threads.close()
    resumed = ThreadLoader(data, rank=1, world=2, step_batch=4, seed=3, threads=2, position=expected[6][2])
    assert torch.equal(next(resumed)[1], expected[7][0][1])
    resumed.close()
