"""WebDataset-style tar shards (``mlscale.data.shards``): the same images as the folder they were written
from, bit for bit; the index kept and remade when a shard changes; a truncated shard names the member; and
``--task images --task-opt shards=DIR`` trains on them."""

from __future__ import annotations

import json

import pytest
import torch

from mlscale.data.dataset import MapData, SampleError
from mlscale.data.images import ImageFolder, write_image_folder
from mlscale.data.shards import TarShards, write_tar_shards
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    folder = write_image_folder(root / "tree", classes=3, per_class=10, seed=5)
    write_tar_shards(folder, root / "shards", per_shard=8)
    return folder, root / "shards"


def test_shards_hold_the_folders_images_bit_for_bit(written):
    folder, shards = written
    from_tar, from_folder = TarShards(shards, size=24, seed=2), ImageFolder(folder, size=24, seed=2)
    assert len(from_tar) == len(from_folder) == 30 and len(from_tar.index.shards) == 4
    for index in (0, 7, 8, 29):
        for epoch in (0, 3):
            image, label = from_tar.item_for_epoch(index, epoch)
            assert torch.equal(image, from_folder.item_for_epoch(index, epoch)[0])
            assert label == from_folder.listing.labels[index]


def test_the_index_is_kept_and_made_again_when_a_shard_changes(written, tmp_path):
    import shutil

    _, shards = written
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns(".mlscale"))
    TarShards(copy, size=16)
    kept = list((copy / ".mlscale").glob("index-*.npz"))
    assert len(kept) == 1
    TarShards(copy, size=16)
    assert list((copy / ".mlscale").glob("index-*.npz")) == kept  # read, not made again
    (copy / "shard-000003.tar").unlink()
    assert len(TarShards(copy, size=16)) == 24 and len(list((copy / ".mlscale").glob("index-*.npz"))) == 2


def test_a_truncated_shard_names_the_shard_and_the_member(written, tmp_path):
    import shutil

    _, shards = written
    copy = tmp_path / "shards"
    shutil.copytree(shards, copy, ignore=shutil.ignore_patterns(".mlscale"))
    data = MapData(TarShards(copy, size=16))
    last = copy / "shard-000003.tar"
    last.write_bytes(last.read_bytes()[:1500])  # cut inside the first member's image
    with pytest.raises(SampleError, match=r"sample 24 of the training Dataset: ValueError: cannot read or decode "
                                          r"shard-000003\.tar:00000024\.jpg"):
        data.batch([23, 24])


def test_task_images_trains_on_shards(written, tmp_path):
    _, shards = written
    result = run_cli("train", "--task", "images", "--task-opt", f"shards={shards}", "--task-opt", "size=16",
                     "--task-opt", "width=4", "--workers", "2", "--batch-size", "3", "--epochs", "1",
                     "--data-workers", "1", "--no-progress", "--run-dir", str(tmp_path / "run"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["data"]["dataset"] == "TarShards" and report["steps"] == 4  # 27 training images / (2 x 3)
