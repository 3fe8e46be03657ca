"""Images from a folder (``mlscale.data.images``): the listing made once and kept, augmentation drawn from
(seed, epoch, sample) alone so that the same sample ids get bit-identical tensors under any layout, and a
file that cannot be decoded named in one line."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mlscale.data.dataset import MapData, SampleError
from mlscale.data.images import ImageFolder, Listing, random_resized_crop, sample_generator, write_image_folder
from mlscale.data.loader import ShardLoader
from mlscale.data.pipeline import DatasetLoader
from mlscale.errors import UsageError


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("images") / "tree", classes=3, per_class=12, seed=4)


def test_the_listing_is_kept_beside_the_tree_and_made_again_when_a_class_folder_changes(tmp_path):
    root = write_image_folder(tmp_path / "tree", classes=2, per_class=3)
    first = Listing.of(root)
    assert first.classes == ["class_0", "class_1"] and first.labels == [0, 0, 0, 1, 1, 1]
    assert (root / ".mlscale" / "listing.json").is_file()
    (root / "class_1" / "img_00000.jpg").rename(root / "class_1" / "img_99999.jpg")
    assert Listing.of(root).files[-1] == "class_1/img_99999.jpg"


def test_a_folder_without_class_folders_or_images_is_one_line(tmp_path):
    with pytest.raises(UsageError, match="no class folders"):
        Listing.of(tmp_path)
    (tmp_path / "cats").mkdir()
    with pytest.raises(UsageError, match=r"no \.jpg, \.jpeg, \.png files"):
        Listing.of(tmp_path)


def _tensors(loader, steps: int) -> dict[tuple[int, int], torch.Tensor]:
    """(epoch, sample id) -> the image tensor the loader gave for it."""
    seen = {}
    for _ in range(steps):
        images, _ = next(loader)
        epoch = loader.position.epoch
        seen.update(((epoch, i), image) for i, image in zip(loader.last_ids.tolist(), images))
    return seen


def test_the_same_sample_ids_get_bit_identical_crops_in_any_layout(folder):
    data = MapData(ImageFolder(folder, size=24, seed=7))
    two: dict[tuple[int, int], torch.Tensor] = {}  # 2 ranks in the training process, an epoch and a half
    for rank in range(2):
        two.update(_tensors(ShardLoader(data, rank=rank, world=2, step_batch=3, seed=1), 9))
    start = ShardLoader(data, rank=0, world=2, step_batch=3, seed=1)
    for _ in range(3):
        next(start)  # mid-epoch 0: 18 of its 36 samples trained
    three: dict[tuple[int, int], torch.Tensor] = {}  # resumed there on 3 ranks with 2 data workers each
    for rank in range(3):
        loader = DatasetLoader(data, rank=rank, world=3, step_batch=2, seed=1, position=start.position, workers=2)
        three.update(_tensors(loader, 6))
        loader.close()
    common = two.keys() & three.keys()
    assert {epoch for epoch, _ in common} == {0, 1} and len(common) >= 30
    assert all(torch.equal(two[key], three[key]) for key in common)
    assert all(torch.equal(data.item(i, epoch)[0], three[(epoch, i)]) for epoch, i in three)  # (seed, epoch, id)
    both_epochs = [i for i in range(36) if (0, i) in two and (1, i) in two]
    assert sum(not torch.equal(two[(0, i)], two[(1, i)]) for i in both_epochs) > len(both_epochs) // 2


def test_held_out_images_are_centre_cropped_the_same_every_time(folder):
    held_out = ImageFolder(folder, size=24, train=False)
    assert torch.equal(held_out.item_for_epoch(3, 0)[0], held_out.item_for_epoch(3, 5)[0])
    image, label = held_out[13]
    assert image.shape == (3, 24, 24) and image.dtype == torch.uint8 and label == 1  # normalised in the model


@given(width=st.integers(1, 400), height=st.integers(1, 400), seed=st.integers(0, 2**32))
def test_a_random_resized_crop_lies_inside_the_image(width, height, seed):
    left, top, right, bottom = random_resized_crop(width, height, sample_generator(seed, 0, 0))
    assert 0 <= left < right <= width and 0 <= top < bottom <= height


def test_a_corrupt_image_is_named_with_its_sample(tmp_path):
    root = write_image_folder(tmp_path / "tree", classes=2, per_class=4)
    (root / "class_0" / "img_00002.jpg").write_bytes(b"\xff\xd8\xff\xe0 truncated")
    data = MapData(ImageFolder(root, size=16))
    with pytest.raises(SampleError, match=r"sample 2 of the training Dataset: ValueError: cannot read or decode "
                                          r"class_0/img_00002\.jpg"):
        data.batch([0, 1, 2])


def test_uint8_images_normalised_in_the_model_equal_images_normalised_in_the_loader(folder):
    from mlscale.data.images import Normalize

    raw, normalised = ImageFolder(folder, size=24, seed=1), ImageFolder(folder, size=24, seed=1, normalize=True)
    pixels = torch.stack([raw.item_for_epoch(i, 2)[0] for i in range(5)])
    expected = torch.stack([normalised.item_for_epoch(i, 2)[0] for i in range(5)])
    assert pixels.dtype == torch.uint8 and expected.dtype == torch.float32
    assert torch.allclose(Normalize()(pixels), expected, atol=1e-5)
    assert Normalize().double()(pixels).dtype == torch.float64  # the run's dtype, with the model


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_of_images_is_stacked_channels_last_with_the_values_of_a_plain_stack(folder, workers):
    """Decoded images are ``H x W x 3`` in memory: the batch keeps that layout (one copy a sample, not a
    transposing copy of the batch), in the training process and in a data worker's shared memory."""
    data = MapData(ImageFolder(folder, size=24, seed=1))
    loader = DatasetLoader(data, rank=0, world=1, step_batch=4, seed=0, workers=workers)
    try:
        images, labels = next(loader)
        ids = loader.last_ids.tolist()
    finally:
        loader.close()
    plain = torch.stack([data.item(i, 0)[0].contiguous() for i in ids])
    assert images.is_contiguous(memory_format=torch.channels_last) and not images.is_contiguous()
    assert torch.equal(images, plain) and labels.tolist() == [data.item(i, 0)[1] for i in ids]
    assert images.is_shared() == (workers > 0)
