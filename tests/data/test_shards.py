"""WebDataset-style tar shards (``mlscale.data.shards``) and Parquet image columns (``mlscale.data.parquet_images``):
the same images as the folder they were written from, bit for bit; the tar index kept and remade when a shard
changes; a truncated shard names the member, a Parquet row without an image names its file, row group and
row; a missing column is one line; and ``--task images --task-opt shards=DIR`` trains on either."""

from __future__ import annotations

import json

import pytest
import torch

from mlscale.data.dataset import MapData, SampleError
from mlscale.data.images import ImageFolder, write_image_folder
from mlscale.data.parquet_images import ParquetImages, write_parquet_images
from mlscale.data.shards import TarShards, write_tar_shards
from mlscale.errors import UsageError
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    folder = write_image_folder(root / "tree", classes=3, per_class=10, seed=5)
    write_tar_shards(folder, root / "shards", per_shard=8)
    write_parquet_images(folder, root / "parquet", per_file=16, per_group=5)
    return folder, root / "shards"


@pytest.mark.parametrize("kind", ["tar", "parquet"])
def test_shards_hold_the_folders_images_bit_for_bit(written, kind):
    folder, shards = written
    if kind == "tar":
        from_shards: TarShards | ParquetImages = TarShards(shards, size=24, seed=2)
        assert len(from_shards.index.shards) == 4
        rows = [8, 8, 8, 6]
    else:
        from_shards = ParquetImages(shards.parent / "parquet", size=24, seed=2)
        assert len(from_shards.files) == 2
        rows = [5, 5, 5, 1, 5, 5, 4]  # files of 16 and 14 rows, in row groups of up to 5
    assert from_shards.sample_shards().tolist() == [g for g, count in enumerate(rows) for _ in range(count)]
    from_folder = ImageFolder(folder, size=24, seed=2)
    assert len(from_shards) == len(from_folder) == 30
    for index in (0, 4, 7, 8, 16, 29):
        for epoch in (0, 3):
            image, label = from_shards.item_for_epoch(index, epoch)
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


def test_parquet_images_as_hugging_face_datasets_writes_them_and_their_mistakes(written, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder, _ = written
    listing = ImageFolder(folder, size=16).listing
    images = [{"bytes": (folder / name).read_bytes(), "path": name} for name in listing.files[:6]]
    images[4] = {"bytes": None, "path": "lost.jpg"}
    table = pa.table({"img": images, "fine_label": pa.array(listing.labels[:6], pa.int64())})
    pq.write_table(table, tmp_path / "train-00000-of-00001.parquet", row_group_size=4)
    data = ParquetImages(tmp_path, size=16, image="img", label="fine_label", seed=1)
    assert torch.equal(data.item_for_epoch(2, 1)[0], ImageFolder(folder, size=16, seed=1).item_for_epoch(2, 1)[0])
    with pytest.raises(SampleError, match=r"sample 4 of the training Dataset: ValueError: cannot read or decode "
                                          r"train-00000-of-00001\.parquet: row group 1, row 0 \(ValueError: the img "
                                          r"column holds no image bytes there\)"):
        MapData(data).batch([3, 4])
    with pytest.raises(UsageError, match=r"bad value image_column='image': .* has no such column \(columns: img, "
                                         r"fine_label\)"):
        ParquetImages(tmp_path, size=16, label="fine_label")
    with pytest.raises(UsageError, match=r"no \.parquet files there"):
        ParquetImages(tmp_path / "nothing", size=16)


@pytest.mark.parametrize("kind", ["shards", "parquet"])
def test_task_images_trains_on_shards(written, tmp_path, kind):
    _, shards = written
    shards = shards if kind == "shards" else shards.parent / "parquet"
    result = run_cli("train", "--task", "images", "--task-opt", f"shards={shards}", "--task-opt", "size=16",
                     "--task-opt", "width=8", "--workers", "2", "--batch-size", "3", "--epochs", "1",
                     "--data-workers", "1", "--no-progress", "--run-dir", str(tmp_path / "run"), timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    assert report["data"]["dataset"] == ("TarShards" if kind == "shards" else "ParquetImages")
    assert report["steps"] == 4  # 27 training images / (2 x 3)
